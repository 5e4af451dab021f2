//! Rollout correction: importance weights and rejection of the tokens or sequences whose
//! rollout policy strayed from the training policy, matching verl's
//! `verl/trainer/ppo/rollout_corr_helper.py`.
//!
//! The rollout engine's log-probs (`rollout_log_probs`) and the training policy's
//! (`old_log_probs`, or the current ones in bypass mode) differ when the engine computes in
//! another precision or kernel, or when samples are a few policy versions old (asynchronous
//! rollout). Three tools, configured under verl's `algorithm.rollout_correction`:
//! - [`weights`]: truncated importance weights `π_train / π_rollout`, per token or per
//!   sequence (the product over its tokens), capped at `rollout_is_threshold`, optionally
//!   normalised to mean 1 over the batch;
//! - [`rejection_mask`]: zero the response mask where a divergence statistic (k1, k2 or k3 per
//!   token, or their sum, mean or max per sequence) leaves its bounds; several criteria may be
//!   combined (`"token_k1,seq_max_k3"`) and all must pass;
//! - [`offpolicy_metrics`]: the diagnostics verl logs (KL, k3 KL, perplexities, χ²).
//!
//! Every log-ratio is clamped to ±[`SAFETY_BOUND`] before it is exponentiated, as in verl.
//! All metric names are verl's, and [`correct`] prefixes them with `rollout_corr/`.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use crate::check;
use crate::error::{Error, Result};
use crate::masked::{mean_, sum_};

mod config;

pub use config::{
    BypassLossType, IsLevel, RolloutCorrectionConfig, RsEstimator, RsLevel, RsOption, RsRule,
    RsThreshold, parse_rules,
};

/// The clamp applied to log-ratios before `exp` (verl's `SAFETY_BOUND`): weights stay within
/// `exp(±20)`.
pub const SAFETY_BOUND: f64 = 20.0;

/// Metric name to value, in name order.
pub type Metrics = BTreeMap<String, f64>;

fn item(t: &Tensor) -> f64 {
    t.double_value(&[])
}

/// Checks the shapes and the mask; returns the mask in the log-ratio's dtype.
fn inputs(log_ratio: &Tensor, mask: &Tensor) -> Result<Tensor> {
    check::float(
        "log_ratio",
        log_ratio,
        &[
            rl_core::shape::Dim::Any("batch"),
            rl_core::shape::Dim::Any("response_len"),
        ],
    )?;
    let m = check::mask("response_mask", mask, "log_ratio", log_ratio)?;
    nonempty(&m)?;
    Ok(m)
}

fn nonempty(mask: &Tensor) -> Result<()> {
    if mask.sum(Kind::Double).double_value(&[]) == 0.0 {
        return Err(Error::EmptyMask {
            name: "response_mask",
            count: 0,
            reason: "rollout correction needs at least one response token (verl raises too)",
        });
    }
    Ok(())
}

fn clamp_safe(x: &Tensor) -> Tensor {
    x.clamp(-SAFETY_BOUND, SAFETY_BOUND)
}

/// Masked max (`-inf` where the mask is 0) over everything.
fn masked_max(x: &Tensor, keep: &Tensor) -> f64 {
    item(&x.masked_fill(&keep.logical_not(), f64::NEG_INFINITY).max())
}

fn masked_min(x: &Tensor, keep: &Tensor) -> f64 {
    item(&x.masked_fill(&keep.logical_not(), f64::INFINITY).min())
}

/// Unbiased std of a 1-D tensor, 0 for fewer than two elements (verl's `x.std() if n > 1`).
fn std_or_zero(x: &Tensor) -> f64 {
    if x.numel() > 1 {
        item(&x.std(true))
    } else {
        0.0
    }
}

/// Truncated importance weights, matching verl's `compute_rollout_correction_weights`.
///
/// `token`: `exp(clamp(log_ratio))` per token; `sequence`: `exp(clamp(Σ log_ratio))` per row,
/// broadcast over its tokens. Weights are zero where the mask is 0, capped at `threshold`, and
/// carry no gradient. The metrics (`rollout_is_*`, verl's names, unprefixed) describe the
/// weights before the cap; with `batch_normalize` the weights are then divided by their mean
/// over the tokens (token level) or over the non-empty sequences (sequence level), unless that
/// mean is ≤ 1e-8, and `rollout_is_batch_norm_factor` records the divisor.
///
/// # Shapes
/// - `log_ratio`: `[batch, response_len]` float, `log π_train − log π_rollout`
/// - `response_mask`: `[batch, response_len]`, binary, at least one 1
/// - returns: `[batch, response_len]` weights in `log_ratio`'s dtype, and the metrics
pub fn weights(
    log_ratio: &Tensor,
    response_mask: &Tensor,
    level: IsLevel,
    threshold: f64,
    batch_normalize: bool,
) -> Result<(Tensor, Metrics)> {
    let mask = inputs(log_ratio, response_mask)?;
    weights_checked(log_ratio, &mask, level, threshold, batch_normalize)
}

/// [`weights`] with `mask` checked and in `log_ratio`'s dtype.
fn weights_checked(
    log_ratio: &Tensor,
    mask: &Tensor,
    level: IsLevel,
    threshold: f64,
    batch_normalize: bool,
) -> Result<(Tensor, Metrics)> {
    if threshold.is_nan() || threshold <= 0.0 {
        return Err(Error::invalid(
            "rollout_is_threshold",
            format!("must be positive, got {threshold}"),
        ));
    }
    let _guard = tch::no_grad_guard();
    let log_ratio = log_ratio.detach();
    let (w, for_metrics) = match level {
        IsLevel::Token => (clamp_safe(&log_ratio).exp(), log_ratio.shallow_clone()),
        IsLevel::Sequence => {
            let sum = sum_(&log_ratio, mask, Some(-1)).unsqueeze(-1);
            (clamp_safe(&sum).exp().expand_as(&log_ratio), sum)
        }
    };
    let w = w * mask;
    let mut metrics = is_metrics(&w, &for_metrics, mask, level, threshold);
    let mut w = w.clamp_max(threshold);
    if batch_normalize {
        let mean = match level {
            IsLevel::Token => mean_(&w, mask, None),
            IsLevel::Sequence => {
                let seq_w = mean_(&w, mask, Some(-1));
                let seq_mask = mask
                    .sum_dim_intlist([-1].as_slice(), false, None::<Kind>)
                    .gt(0.0)
                    .to_kind(w.kind());
                (seq_w * &seq_mask).sum(None::<Kind>) / seq_mask.sum(None::<Kind>).clamp_min(1e-8)
            }
        };
        let factor = item(&mean);
        if factor > 1e-8 {
            w /= mean;
            metrics.insert("rollout_is_batch_norm_factor".into(), factor);
        } else {
            metrics.insert("rollout_is_batch_norm_factor".into(), 1.0);
        }
    }
    Ok((w, metrics))
}

/// verl's `compute_is_metrics`, on the masked weights before truncation.
fn is_metrics(
    w: &Tensor,
    log_ratio_for_metrics: &Tensor,
    mask: &Tensor,
    level: IsLevel,
    threshold: f64,
) -> Metrics {
    let mut m = Metrics::new();
    let lower = 1.0 / threshold;
    let keep = mask.gt(0.0);
    // verl's `.float()`: float32, so unmasked means of it are float32 means
    let fmask = |b: Tensor| b.to_kind(Kind::Float);
    match level {
        IsLevel::Sequence => {
            // verl takes the logs of float32 scalar tensors here (torch.tensor's default dtype)
            let log_upper = Tensor::from(threshold as f32).log();
            let log_lower = Tensor::from(lower as f32).log();
            let log_max = log_ratio_for_metrics.max();
            let log_min = log_ratio_for_metrics.min();
            m.insert(
                "rollout_is_max".into(),
                item(&log_max.clamp_max(SAFETY_BOUND).exp()),
            );
            m.insert("rollout_is_min".into(), item(&log_min.exp()));
            m.insert("rollout_is_mean".into(), item(&mean_(w, mask, None)));
            m.insert(
                "rollout_is_ratio_fraction_high".into(),
                item(&fmask(log_ratio_for_metrics.gt_tensor(&log_upper)).mean(None::<Kind>)),
            );
            m.insert(
                "rollout_is_ratio_fraction_low".into(),
                item(&fmask(log_ratio_for_metrics.lt_tensor(&log_lower)).mean(None::<Kind>)),
            );
        }
        IsLevel::Token => {
            m.insert("rollout_is_mean".into(), item(&mean_(w, mask, None)));
            m.insert(
                "rollout_is_ratio_fraction_high".into(),
                item(&mean_(&fmask(w.gt(threshold)), mask, None)),
            );
            m.insert(
                "rollout_is_ratio_fraction_low".into(),
                item(&mean_(&fmask(w.lt(lower)), mask, None)),
            );
            m.insert("rollout_is_max".into(), masked_max(w, &keep));
            m.insert("rollout_is_min".into(), masked_min(w, &keep));
        }
    }
    let clamped = w.clamp(lower, threshold);
    let std = if item(&mask.sum(Kind::Double)) > 1.0 {
        let mean_c = mean_(&clamped, mask, None);
        let var = mean_(&clamped.square(), mask, None) - mean_c.square();
        item(&var.clamp_min(0.0).sqrt())
    } else {
        0.0
    };
    m.insert("rollout_is_std".into(), std);
    let mean_e = mean_(&clamped, mask, None);
    let normalized = &clamped / (mean_e + 1e-8);
    m.insert(
        "rollout_is_eff_sample_size".into(),
        1.0 / item(&mean_(&normalized.square(), mask, None)),
    );
    let seq = mean_(w, mask, Some(-1));
    m.insert("rollout_is_seq_mean".into(), item(&seq.mean(None::<Kind>)));
    m.insert("rollout_is_seq_std".into(), std_or_zero(&seq));
    m.insert("rollout_is_seq_max".into(), item(&seq.max()));
    m.insert("rollout_is_seq_min".into(), item(&seq.min()));
    m.insert(
        "rollout_is_seq_max_deviation".into(),
        item(&(&seq - 1.0).abs().max()),
    );
    m.insert(
        "rollout_is_seq_fraction_high".into(),
        item(&fmask(seq.gt(threshold)).mean(None::<Kind>)),
    );
    m.insert(
        "rollout_is_seq_fraction_low".into(),
        item(&fmask(seq.lt(lower)).mean(None::<Kind>)),
    );
    m
}

/// The rejection mask, matching verl's `compute_rollout_rejection_mask`.
///
/// For each rule, a token is kept when its statistic is within bounds (a sequence-level
/// statistic keeps or drops every token of its row); the returned mask is `response_mask` with
/// every token some rule rejects set to 0, in `response_mask`'s dtype. The metrics
/// (`rollout_rs_*`, unprefixed) are verl's: per rule its mean, max, min, std, fractions above
/// and below the bounds, sequence summaries and masked fractions, and overall
/// `rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction`.
///
/// # Shapes
/// - `log_ratio`: `[batch, response_len]` float, `log π_train − log π_rollout`
/// - `response_mask`: `[batch, response_len]`, binary, at least one 1 (a batch of no rows is
///   returned as it is)
/// - returns: the new `[batch, response_len]` mask and the metrics
pub fn rejection_mask(
    log_ratio: &Tensor,
    response_mask: &Tensor,
    rules: &[RsRule],
) -> Result<(Tensor, Metrics)> {
    if log_ratio.dim() == 2 && log_ratio.size()[0] == 0 {
        return Ok((response_mask.shallow_clone(), Metrics::new()));
    }
    let mask = inputs(log_ratio, response_mask)?;
    rejection_checked(log_ratio, &mask, response_mask, rules)
}

/// [`rejection_mask`] with `mask` checked and in `log_ratio`'s dtype; the result takes
/// `response_mask`'s dtype.
fn rejection_checked(
    log_ratio: &Tensor,
    mask: &Tensor,
    response_mask: &Tensor,
    rules: &[RsRule],
) -> Result<(Tensor, Metrics)> {
    if rules.is_empty() {
        return Err(Error::invalid(
            "rollout_correction.rollout_rs",
            "names no rejection option",
        ));
    }
    let _guard = tch::no_grad_guard();
    let kind = log_ratio.kind();
    let safe = clamp_safe(&log_ratio.detach());
    let k1 = -&safe;
    let k2 = 0.5 * safe.square();
    let k3 = safe.exp() - 1.0 - &safe;
    let keep_tokens = mask.gt(0.0);
    let seq_valid = mask
        .sum_dim_intlist([-1].as_slice(), false, None::<Kind>)
        .gt(0.0);
    let mut combined = Tensor::ones_like(mask);
    let mut metrics = Metrics::new();
    for rule in rules {
        let name = rule.option.name();
        let token_stat = match rule.option.estimator {
            RsEstimator::K1 => &k1,
            RsEstimator::K2 => &k2,
            RsEstimator::K3 => &k3,
        };
        let is_k1 = rule.option.estimator == RsEstimator::K1;
        // k1 bounds are ratios, compared in log space
        let (lower_log, upper) = if is_k1 {
            let lower = rule.lower.unwrap_or(1.0 / rule.upper);
            (Some(lower.ln()), rule.upper.ln())
        } else {
            (None, rule.upper)
        };
        let within = |stat: &Tensor| -> Tensor {
            let below = stat.le(upper);
            match lower_log {
                Some(lo) => stat.ge(lo).logical_and(&below),
                None => below,
            }
        };
        let (per_token, per_seq, keep) = match rule.option.level {
            RsLevel::Token => (token_stat.shallow_clone(), None, within(token_stat)),
            level => {
                let seq = match level {
                    RsLevel::SeqSum => sum_(token_stat, mask, Some(-1)),
                    RsLevel::SeqMean => mean_(token_stat, mask, Some(-1)),
                    _ => {
                        let max = token_stat
                            .masked_fill(&keep_tokens.logical_not(), f64::NEG_INFINITY)
                            .amax([-1].as_slice(), false);
                        max.where_scalarother(&max.isneginf().logical_not(), 0.0)
                    }
                };
                let keep = within(&seq).unsqueeze(-1).expand_as(&keep_tokens);
                (seq.unsqueeze(-1).expand_as(mask), Some(seq), keep)
            }
        };
        let metrics_lower = lower_log.unwrap_or(0.0);
        let keep_f = keep.to_kind(kind);
        combined *= &keep_f;
        let seq_keep = keep
            .logical_not()
            .logical_and(&keep_tokens)
            .logical_not()
            .all_dim(-1, false);
        rs_metrics(
            &mut metrics,
            &name,
            &per_token,
            mask,
            &seq_valid,
            per_seq.as_ref(),
            upper,
            metrics_lower,
            is_k1,
        );
        metrics.insert(
            format!("rollout_rs_{name}_masked_fraction"),
            item(&mean_(&(1.0 - &keep_f), mask, None)),
        );
        let valid_f = seq_valid.to_kind(kind);
        let n_valid = item(&valid_f.sum(None::<Kind>));
        let seq_masked = if n_valid > 0.0 {
            {
                let dropped: Tensor = 1.0 - &seq_keep.to_kind(kind);
                item(&(dropped * &valid_f).sum(None::<Kind>)) / n_valid
            }
        } else {
            0.0
        };
        metrics.insert(format!("rollout_rs_{name}_seq_masked_fraction"), seq_masked);
    }
    metrics.insert(
        "rollout_rs_masked_fraction".into(),
        item(&mean_(&(1.0 - &combined), mask, None)),
    );
    let final_keep = combined.gt(0.5).logical_and(&keep_tokens);
    let seq_has_masked = final_keep
        .logical_not()
        .logical_and(&keep_tokens)
        .any_dim(-1, false);
    metrics.insert(
        "rollout_rs_seq_masked_fraction".into(),
        item(&seq_has_masked.to_kind(Kind::Float).mean(None::<Kind>)),
    );
    let modified = (response_mask.to_kind(kind) * combined).to_kind(response_mask.kind());
    Ok((modified, metrics))
}

/// verl's `compute_rs_metrics` for one rejection rule.
#[allow(clippy::too_many_arguments)]
fn rs_metrics(
    m: &mut Metrics,
    name: &str,
    stat: &Tensor,
    mask: &Tensor,
    seq_valid: &Tensor,
    per_seq: Option<&Tensor>,
    upper: f64,
    lower: f64,
    apply_lower: bool,
) {
    let p = format!("rollout_rs_{name}");
    let keep = mask.gt(0.0);
    // verl's `.float()`: float32, so unmasked means of it are float32 means
    let fmask = |b: Tensor| b.to_kind(Kind::Float);
    let seq = match per_seq {
        Some(s) => s.shallow_clone(),
        None => mean_(stat, mask, Some(-1)),
    };
    let seq_valid_values = seq.masked_select(seq_valid);
    let n_valid = seq_valid_values.numel();
    let sequence_level = per_seq.is_some();
    m.insert(format!("{p}_mean"), item(&mean_(stat, mask, None)));
    if sequence_level && n_valid > 0 {
        m.insert(format!("{p}_max"), item(&seq_valid_values.max()));
        m.insert(format!("{p}_min"), item(&seq_valid_values.min()));
        let high = item(&fmask(seq_valid_values.gt(upper)).mean(None::<Kind>));
        let low = if apply_lower {
            item(&fmask(seq_valid_values.lt(lower)).mean(None::<Kind>))
        } else {
            0.0
        };
        m.insert(format!("{p}_fraction_high"), high);
        m.insert(format!("{p}_fraction_low"), low);
    } else {
        m.insert(format!("{p}_max"), masked_max(stat, &keep));
        m.insert(format!("{p}_min"), masked_min(stat, &keep));
        m.insert(
            format!("{p}_fraction_high"),
            item(&mean_(&fmask(stat.gt(upper)), mask, None)),
        );
        let low = if apply_lower {
            item(&mean_(&fmask(stat.lt(lower)), mask, None))
        } else {
            0.0
        };
        m.insert(format!("{p}_fraction_low"), low);
    }
    let std = if item(&mask.sum(Kind::Double)) > 1.0 {
        let clamp_min = if apply_lower { lower } else { 0.0 };
        let s = stat.clamp(clamp_min, upper);
        let mean_c = mean_(&s, mask, None);
        let var = mean_(&s.square(), mask, None) - mean_c.square();
        item(&var.clamp_min(0.0).sqrt())
    } else {
        0.0
    };
    m.insert(format!("{p}_std"), std);
    if n_valid > 0 {
        m.insert(
            format!("{p}_seq_mean"),
            item(&seq_valid_values.mean(None::<Kind>)),
        );
        m.insert(format!("{p}_seq_std"), std_or_zero(&seq_valid_values));
        m.insert(format!("{p}_seq_max"), item(&seq_valid_values.max()));
        m.insert(format!("{p}_seq_min"), item(&seq_valid_values.min()));
        m.insert(
            format!("{p}_seq_max_deviation"),
            item(&seq_valid_values.abs().max()),
        );
        m.insert(
            format!("{p}_seq_fraction_high"),
            item(&fmask(seq_valid_values.gt(upper)).mean(None::<Kind>)),
        );
        if apply_lower {
            m.insert(
                format!("{p}_seq_fraction_low"),
                item(&fmask(seq_valid_values.lt(lower)).mean(None::<Kind>)),
            );
        }
    }
}

/// The off-policy diagnostics, matching verl's `compute_offpolicy_metrics` (unprefixed):
/// `training_ppl` and `training_log_ppl` always; with rollout log-probs also `kl`
/// (`E[log π_rollout − log π_train]`), `k3_kl`, `rollout_ppl`, `rollout_log_ppl`,
/// `log_ppl_diff` (mean, `_abs_`, `_max`, `_min`), `ppl_ratio`, `chi2_token` and `chi2_seq`.
/// Perplexities are per sequence, then averaged over the rows.
///
/// # Shapes
/// - `old_log_prob`, `rollout_log_prob`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary, at least one 1
pub fn offpolicy_metrics(
    old_log_prob: &Tensor,
    rollout_log_prob: Option<&Tensor>,
    response_mask: &Tensor,
) -> Result<Metrics> {
    let mask = inputs(old_log_prob, response_mask)?;
    if let Some(rollout) = rollout_log_prob {
        check::float_like("rollout_log_prob", rollout, "old_log_prob", old_log_prob)?;
    }
    offpolicy_checked(old_log_prob, rollout_log_prob, &mask)
}

/// [`offpolicy_metrics`] with the inputs checked and `mask` in `old_log_prob`'s dtype.
fn offpolicy_checked(
    old_log_prob: &Tensor,
    rollout_log_prob: Option<&Tensor>,
    mask: &Tensor,
) -> Result<Metrics> {
    let _guard = tch::no_grad_guard();
    let old = old_log_prob.detach();
    let mut m = Metrics::new();
    let mean_train = mean_(&old, mask, Some(-1));
    m.insert(
        "training_ppl".into(),
        item(&(-&mean_train).exp().mean(None::<Kind>)),
    );
    m.insert(
        "training_log_ppl".into(),
        item(&(-&mean_train).mean(None::<Kind>)),
    );
    if let Some(rollout) = rollout_log_prob {
        let rollout = rollout.detach().to_kind(old.kind());
        m.insert("kl".into(), item(&mean_(&(&rollout - &old), mask, None)));
        let log_ratio = &old - &rollout;
        let k3 = log_ratio.exp() - &log_ratio - 1.0;
        m.insert("k3_kl".into(), item(&mean_(&k3, mask, None)));
        let mean_rollout = mean_(&rollout, mask, Some(-1));
        m.insert(
            "rollout_ppl".into(),
            item(&(-&mean_rollout).exp().mean(None::<Kind>)),
        );
        m.insert(
            "rollout_log_ppl".into(),
            item(&(-&mean_rollout).mean(None::<Kind>)),
        );
        let diff = &mean_rollout - &mean_train;
        m.insert("log_ppl_diff".into(), item(&diff.mean(None::<Kind>)));
        m.insert(
            "log_ppl_abs_diff".into(),
            item(&diff.abs().mean(None::<Kind>)),
        );
        m.insert("log_ppl_diff_max".into(), item(&diff.max()));
        m.insert("log_ppl_diff_min".into(), item(&diff.min()));
        m.insert("ppl_ratio".into(), item(&diff.exp().mean(None::<Kind>)));
        let rho = clamp_safe(&log_ratio).exp();
        m.insert(
            "chi2_token".into(),
            item(&mean_(&rho.square(), mask, None)) - 1.0,
        );
        let seq_sum = clamp_safe(&sum_(&log_ratio, mask, Some(-1)));
        m.insert(
            "chi2_seq".into(),
            item(&(&seq_sum * 2.0).exp().mean(None::<Kind>)) - 1.0,
        );
    }
    Ok(m)
}

/// What [`correct`] produces.
#[derive(Debug)]
pub struct Correction {
    /// The importance weights, when `rollout_is` is set.
    pub weights: Option<Tensor>,
    /// The response mask with rejected tokens zeroed (the input mask without `rollout_rs`).
    pub response_mask: Tensor,
    /// Every metric, prefixed `rollout_corr/`.
    pub metrics: Metrics,
}

/// Weights, rejection and diagnostics together, matching verl's
/// `compute_rollout_correction_and_rejection_mask`: `log_ratio = old_log_prob −
/// rollout_log_prob`; weights when `cfg.rollout_is` is set, rejection when `cfg.rollout_rs`
/// is, and the off-policy metrics always; every metric prefixed `rollout_corr/`.
///
/// # Shapes
/// - `old_log_prob`, `rollout_log_prob`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary, at least one 1
pub fn correct(
    old_log_prob: &Tensor,
    rollout_log_prob: &Tensor,
    response_mask: &Tensor,
    cfg: &RolloutCorrectionConfig,
) -> Result<Correction> {
    check::float_like(
        "rollout_log_prob",
        rollout_log_prob,
        "old_log_prob",
        old_log_prob,
    )?;
    // the inputs are checked once here, not again by each part
    let mask = inputs(old_log_prob, response_mask)?;
    let _guard = tch::no_grad_guard();
    let log_ratio = old_log_prob.detach() - rollout_log_prob.detach();
    let mut metrics = Metrics::new();
    let weights = match cfg.rollout_is {
        Some(level) => {
            let (w, m) = weights_checked(
                &log_ratio,
                &mask,
                level,
                cfg.rollout_is_threshold,
                cfg.rollout_is_batch_normalize,
            )?;
            metrics.extend(m);
            Some(w)
        }
        None => None,
    };
    let rules = cfg.rules()?;
    let rejected = if rules.is_empty() {
        response_mask.shallow_clone()
    } else {
        let (kept, m) = rejection_checked(&log_ratio, &mask, response_mask, &rules)?;
        metrics.extend(m);
        kept
    };
    // the diagnostics describe the batch as sampled: the mask before rejection, as in verl
    metrics.extend(offpolicy_checked(
        old_log_prob,
        Some(rollout_log_prob),
        &mask,
    )?);
    Ok(Correction {
        weights,
        response_mask: rejected,
        metrics: prefixed(metrics),
    })
}

/// The diagnostics of the current policy against the rollout's, prefixed `rollout_corr/`
/// (verl's `compute_rollout_corr_metrics_from_logprobs`, which the actor logs per micro-batch).
pub fn metrics_from_logprobs(
    log_prob: &Tensor,
    rollout_log_prob: &Tensor,
    response_mask: &Tensor,
) -> Result<Metrics> {
    Ok(prefixed(offpolicy_metrics(
        log_prob,
        Some(rollout_log_prob),
        response_mask,
    )?))
}

fn prefixed(m: Metrics) -> Metrics {
    m.into_iter()
        .map(|(k, v)| (format!("rollout_corr/{k}"), v))
        .collect()
}
