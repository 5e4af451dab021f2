//! Policy losses (PPO clip, GSPO, SAPO, GPG, Clip-Cov, KL-Cov, GMPO, CISPO, REINFORCE), value loss.
//!
//! They match the `compute_policy_loss_*`, `compute_value_loss` and `compute_entropy_loss`
//! functions of `verl/trainer/ppo/core_algos.py`.
//!
//! Each policy loss returns the scalar to back-propagate and verl's metrics; gradients flow into
//! `log_prob` exactly where verl lets them (the same ops are detached).

use std::fmt;
use std::str::FromStr;

use rl_core::shape::Dim;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::agg::{self, GlobalBatchInfo, LossAggMode};
use crate::check;
use crate::error::{Error, Result};
use crate::logits;
use crate::masked;

/// Which policy loss the actor minimises (verl's `actor.policy_loss.loss_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyLossMode {
    /// PPO's clipped surrogate with clip-higher and dual-clip: [`ppo_clip`].
    #[default]
    Vanilla,
    /// Sequence-level importance ratios: [`gspo`].
    Gspo,
    /// Soft gates instead of clipping: [`sapo`].
    Sapo,
    /// Plain `-log_prob * advantage`: [`gpg`].
    Gpg,
    /// PPO with covariance-selected tokens detached: [`clip_cov`].
    ClipCov,
    /// PPO with a KL penalty on high-covariance tokens: [`kl_cov`].
    KlCov,
    /// Geometric-mean ratios (GMPO): [`geo_mean`].
    GeoMean,
    /// Clipped, detached importance weights times `log_prob`: [`cispo`].
    Cispo,
    /// REINFORCE, `-advantage * log_prob` times the optional importance weights: [`reinforce`].
    /// verl reaches this loss through `bypass_mode` with `loss_type: reinforce`; the name is ours.
    Reinforce,
}

impl PolicyLossMode {
    /// Every mode.
    pub const ALL: [PolicyLossMode; 9] = [
        PolicyLossMode::Vanilla,
        PolicyLossMode::Gspo,
        PolicyLossMode::Sapo,
        PolicyLossMode::Gpg,
        PolicyLossMode::ClipCov,
        PolicyLossMode::KlCov,
        PolicyLossMode::GeoMean,
        PolicyLossMode::Cispo,
        PolicyLossMode::Reinforce,
    ];

    /// The config string.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyLossMode::Vanilla => "vanilla",
            PolicyLossMode::Gspo => "gspo",
            PolicyLossMode::Sapo => "sapo",
            PolicyLossMode::Gpg => "gpg",
            PolicyLossMode::ClipCov => "clip_cov",
            PolicyLossMode::KlCov => "kl_cov",
            PolicyLossMode::GeoMean => "geo_mean",
            PolicyLossMode::Cispo => "cispo",
            PolicyLossMode::Reinforce => "reinforce",
        }
    }
}

impl fmt::Display for PolicyLossMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyLossMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| Error::UnknownName {
                what: "loss_mode",
                got: s.to_owned(),
                valid: Self::ALL.map(Self::as_str).join(", "),
            })
    }
}

/// verl's `actor.policy_loss` group: the mode and the parameters of the covariance modes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyLossParams {
    /// The policy loss. Default `vanilla`.
    pub loss_mode: PolicyLossMode,
    /// Clip-Cov: fraction of tokens whose gradient is cut, in `(0, 1]`. Default 0.0002.
    pub clip_cov_ratio: f64,
    /// Clip-Cov: lower bound of the covariance of selectable tokens. Default 1.0.
    pub clip_cov_lb: f64,
    /// Clip-Cov: upper bound of the covariance of selectable tokens. Default 5.0.
    pub clip_cov_ub: f64,
    /// KL-Cov: fraction of tokens that get the KL penalty, in `(0, 1]`. Default 0.0002.
    pub kl_cov_ratio: f64,
    /// KL-Cov: coefficient of the `|log ratio|` penalty. Default 0.1.
    pub ppo_kl_coef: f64,
}

impl Default for PolicyLossParams {
    fn default() -> Self {
        PolicyLossParams {
            loss_mode: PolicyLossMode::Vanilla,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
        }
    }
}

/// The policy-loss keys of verl's `actor` group, with verl's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyLossConfig {
    /// PPO's clip range epsilon, used where `clip_ratio_low`/`clip_ratio_high` are absent.
    /// Default 0.2.
    pub clip_ratio: f64,
    /// Lower clip range: ratios below `1 - clip_ratio_low` are clipped. Default: `clip_ratio`
    /// (verl's YAML spells out 0.2, which is the same value).
    pub clip_ratio_low: Option<f64>,
    /// Upper clip range (DAPO's clip-higher): ratios above `1 + clip_ratio_high` are clipped.
    /// Default: `clip_ratio`.
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip bound for negative advantages, greater than 1. Default 3.0.
    pub clip_ratio_c: f64,
    /// How the loss matrix is reduced. Default `token-mean`.
    pub loss_agg_mode: LossAggMode,
    /// Divisor of `seq-mean-token-sum-norm`, positive; absent means the response length.
    pub loss_scale_factor: Option<f64>,
    /// SAPO: gate temperature for positive advantages, positive. Default 1.0.
    pub tau_pos: f64,
    /// SAPO: gate temperature for non-positive advantages, positive. Default 1.05.
    pub tau_neg: f64,
    /// The mode and its parameters.
    pub policy_loss: PolicyLossParams,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        PolicyLossConfig {
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: 3.0,
            loss_agg_mode: LossAggMode::TokenMean,
            loss_scale_factor: None,
            tau_pos: 1.0,
            tau_neg: 1.05,
            policy_loss: PolicyLossParams::default(),
        }
    }
}

impl PolicyLossConfig {
    /// The effective lower clip range.
    pub fn clip_low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }

    /// The effective upper clip range.
    pub fn clip_high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }

    /// Checks the ranges verl asserts, and a few more.
    pub fn validate(&self) -> Result<()> {
        let finite_non_neg = |name: &'static str, v: f64| {
            if v >= 0.0 && v.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid(
                    name,
                    format!("must be finite and >= 0, got {v}"),
                ))
            }
        };
        finite_non_neg("clip_ratio", self.clip_ratio)?;
        finite_non_neg("clip_ratio_low", self.clip_low())?;
        finite_non_neg("clip_ratio_high", self.clip_high())?;
        if self.clip_ratio_c.is_nan() || self.clip_ratio_c <= 1.0 {
            return Err(Error::invalid(
                "clip_ratio_c",
                format!(
                    "the lower bound of clip_ratio_c for dual-clip PPO must be greater than 1.0, got {}",
                    self.clip_ratio_c
                ),
            ));
        }
        if let Some(f) = self.loss_scale_factor
            && !(f > 0.0 && f.is_finite())
        {
            return Err(Error::invalid(
                "loss_scale_factor",
                format!("must be positive, got {f}"),
            ));
        }
        for (name, t) in [("tau_pos", self.tau_pos), ("tau_neg", self.tau_neg)] {
            if !(t > 0.0 && t.is_finite()) {
                return Err(Error::invalid(name, format!("must be positive, got {t}")));
            }
        }
        let p = &self.policy_loss;
        for (name, r) in [
            ("policy_loss.clip_cov_ratio", p.clip_cov_ratio),
            ("policy_loss.kl_cov_ratio", p.kl_cov_ratio),
        ] {
            if !(r > 0.0 && r <= 1.0) {
                return Err(Error::invalid(name, format!("must be in (0, 1], got {r}")));
            }
        }
        Ok(())
    }

    fn batch_info(&self, norm: &GlobalBatchInfo) -> GlobalBatchInfo {
        GlobalBatchInfo {
            loss_scale_factor: norm.loss_scale_factor.or(self.loss_scale_factor),
            ..*norm
        }
    }
}

/// The tensors a policy loss reads, named as in verl's batch.
#[derive(Debug, Clone, Copy)]
pub struct PolicyLossInputs<'a> {
    /// `[batch, response_len]` float: log-probs under the policy that produced the data
    /// (for [`reinforce`], the rollout policy's).
    pub old_log_prob: &'a Tensor,
    /// `[batch, response_len]` float: log-probs under the current policy; the gradient flows here.
    pub log_prob: &'a Tensor,
    /// `[batch, response_len]` float.
    pub advantages: &'a Tensor,
    /// `[batch, response_len]`, binary: 1 for response tokens.
    pub response_mask: &'a Tensor,
    /// `[batch, response_len]` float: rollout importance-sampling weights that multiply the
    /// per-token losses (verl's `rollout_is_weights`), if any.
    pub rollout_is_weights: Option<&'a Tensor>,
}

/// Metric key of the fraction of tokens whose ratio was clipped.
pub const PG_CLIPFRAC: &str = "actor/pg_clipfrac";
/// Metric key of the masked mean of `old_log_prob - log_prob`.
pub const PPO_KL: &str = "actor/ppo_kl";
/// Metric key of the fraction of tokens clipped by the dual-clip bound.
pub const PG_CLIPFRAC_LOWER: &str = "actor/pg_clipfrac_lower";

/// verl's policy-loss metrics; a metric a loss does not report is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PolicyLossMetrics {
    /// `actor/pg_clipfrac`.
    pub pg_clipfrac: Option<f64>,
    /// `actor/ppo_kl`.
    pub ppo_kl: Option<f64>,
    /// `actor/pg_clipfrac_lower`.
    pub pg_clipfrac_lower: Option<f64>,
}

impl PolicyLossMetrics {
    /// The reported metrics under verl's keys.
    pub fn to_vec(&self) -> Vec<(&'static str, f64)> {
        [
            (PG_CLIPFRAC, self.pg_clipfrac),
            (PPO_KL, self.ppo_kl),
            (PG_CLIPFRAC_LOWER, self.pg_clipfrac_lower),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect()
    }
}

/// A policy loss and its metrics.
#[derive(Debug)]
pub struct PolicyLossOutput {
    /// The scalar to back-propagate.
    pub loss: Tensor,
    /// verl's metrics of this loss.
    pub metrics: PolicyLossMetrics,
}

/// The checked inputs: the mask in `log_prob`'s dtype.
struct Checked<'a> {
    old: &'a Tensor,
    lp: &'a Tensor,
    adv: &'a Tensor,
    mask: Tensor,
    weights: Option<&'a Tensor>,
}

fn checked<'a>(inputs: &PolicyLossInputs<'a>, cfg: &PolicyLossConfig) -> Result<Checked<'a>> {
    let lp = inputs.log_prob;
    check::float(
        "log_prob",
        lp,
        &[Dim::Any("batch"), Dim::Any("response_len")],
    )?;
    check::float_like("old_log_prob", inputs.old_log_prob, "log_prob", lp)?;
    check::float_like("advantages", inputs.advantages, "log_prob", lp)?;
    let mask = check::mask("response_mask", inputs.response_mask, "log_prob", lp)?;
    if let Some(w) = inputs.rollout_is_weights {
        check::float_like("rollout_is_weights", w, "log_prob", lp)?;
    }
    cfg.validate()?;
    Ok(Checked {
        old: inputs.old_log_prob,
        lp,
        adv: inputs.advantages,
        mask,
        weights: inputs.rollout_is_weights,
    })
}

fn item(t: &Tensor) -> f64 {
    t.detach().double_value(&[])
}

fn weighted(pg_losses: Tensor, weights: Option<&Tensor>) -> Tensor {
    match weights {
        Some(w) => pg_losses * w,
        None => pg_losses,
    }
}

/// Runs the loss chosen by `cfg.policy_loss.loss_mode`, as verl's `get_policy_loss_fn`.
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn policy(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    match cfg.policy_loss.loss_mode {
        PolicyLossMode::Vanilla => ppo_clip(inputs, cfg, norm),
        PolicyLossMode::Gspo => gspo(inputs, cfg, norm),
        PolicyLossMode::Sapo => sapo(inputs, cfg, norm),
        PolicyLossMode::Gpg => gpg(inputs, cfg, norm),
        PolicyLossMode::ClipCov => clip_cov(inputs, cfg, norm),
        PolicyLossMode::KlCov => kl_cov(inputs, cfg, norm),
        PolicyLossMode::GeoMean => geo_mean(inputs, cfg),
        PolicyLossMode::Cispo => cispo(inputs, cfg, norm),
        PolicyLossMode::Reinforce => reinforce(inputs, cfg, norm),
    }
}

/// PPO's clipped surrogate, matching `compute_policy_loss_vanilla`.
///
/// With `ratio = exp(clamp(log_prob - old_log_prob, -20, 20))`, the per-token loss is
/// `max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))`, and for `A < 0` it is
/// further capped at `-A * clip_ratio_c` (dual-clip). The loss matrix is multiplied by the
/// rollout importance weights, if any, and aggregated with `cfg.loss_agg_mode`.
/// Metrics: `pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`.
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn ppo_clip(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let (low, high) = (cfg.clip_low(), cfg.clip_high());
    // clamp for stability
    let negative_approx_kl = (c.lp - c.old).clamp(-20.0, 20.0);
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked::mean_(&(-&negative_approx_kl), &c.mask, None);

    let pg_losses1 = -c.adv * &ratio;
    let pg_losses2 = -c.adv * ratio.clamp(1.0 - low, 1.0 + high);
    let clip_pg_losses1 = pg_losses1.maximum(&pg_losses2);
    let pg_clipfrac = masked::mean_(
        &pg_losses2.gt_tensor(&pg_losses1).to_kind(c.mask.kind()),
        &c.mask,
        None,
    );

    let pg_losses3 = -c.adv * cfg.clip_ratio_c;
    let clip_pg_losses2 = pg_losses3.minimum(&clip_pg_losses1);
    let negative = c.adv.lt(0.0);
    let lower = clip_pg_losses1
        .gt_tensor(&pg_losses3)
        .logical_and(&negative)
        .to_kind(c.mask.kind());
    let pg_clipfrac_lower = masked::mean_(&lower, &c.mask, None);

    let pg_losses = clip_pg_losses2.where_self(&negative, &clip_pg_losses1);
    let pg_losses = weighted(pg_losses, c.weights);
    let loss = agg::aggregate_(
        &pg_losses,
        &c.mask,
        cfg.loss_agg_mode,
        &cfg.batch_info(norm),
    );
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics {
            pg_clipfrac: Some(item(&pg_clipfrac)),
            ppo_kl: Some(item(&ppo_kl)),
            pg_clipfrac_lower: Some(item(&pg_clipfrac_lower)),
        },
    })
}

/// GSPO's sequence-level clipped loss, matching `compute_policy_loss_gspo`.
///
/// The token ratio is `exp(min(sg[mean_seq(log_prob - old_log_prob)] + log_prob - sg[log_prob],
/// 10))`: its value is the sequence's geometric-mean ratio and its gradient the token's. The
/// loss is PPO's clipped surrogate on it, always aggregated with `seq-mean-token-mean` (verl
/// ignores `loss_agg_mode` here). Metrics: `pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower` (= 0).
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn gspo(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let (low, high) = (cfg.clip_low(), cfg.clip_high());
    let negative_approx_kl = c.lp - c.old;
    let seq_lengths = c
        .mask
        .sum_dim_intlist([-1].as_slice(), false, None::<Kind>)
        .clamp_min(1.0);
    let negative_approx_kl_seq = masked::sum_(&negative_approx_kl, &c.mask, Some(-1)) / seq_lengths;
    let log_seq_importance_ratio =
        c.lp - c.lp.detach() + negative_approx_kl_seq.detach().unsqueeze(-1);
    // clamp for numerical stability
    let seq_importance_ratio = log_seq_importance_ratio.clamp_max(10.0).exp();

    let pg_losses1 = -c.adv * &seq_importance_ratio;
    let pg_losses2 = -c.adv * seq_importance_ratio.clamp(1.0 - low, 1.0 + high);
    let pg_losses = pg_losses1.maximum(&pg_losses2);
    let pg_losses = weighted(pg_losses, c.weights);
    let loss = agg::aggregate_(
        &pg_losses,
        &c.mask,
        LossAggMode::SeqMeanTokenMean,
        &cfg.batch_info(norm),
    );

    let pg_clipfrac = masked::mean_(
        &pg_losses2.gt_tensor(&pg_losses1).to_kind(c.mask.kind()),
        &c.mask,
        None,
    );
    let ppo_kl = masked::mean_(&(-&negative_approx_kl), &c.mask, None);
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics {
            pg_clipfrac: Some(item(&pg_clipfrac)),
            ppo_kl: Some(item(&ppo_kl)),
            pg_clipfrac_lower: Some(0.0),
        },
    })
}

/// SAPO's soft-gated loss, matching `compute_policy_loss_sapo`.
///
/// With `ratio = exp(clamp(log_prob - old_log_prob, -20, 20))` and `tau = tau_pos` where
/// `A > 0`, else `tau_neg`, the per-token loss is `-sigmoid(tau * (ratio - 1)) * 4 / tau * A`,
/// always aggregated with `seq-mean-token-mean`. Metrics: `pg_clipfrac` (= 0), `ppo_kl`,
/// `pg_clipfrac_lower` (= 0).
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn sapo(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let negative_approx_kl = (c.lp - c.old).clamp(-20.0, 20.0);
    let ratio = negative_approx_kl.exp();
    let opts = (c.adv.kind(), c.adv.device());
    let tau_pos = Tensor::from(cfg.tau_pos).to_kind(opts.0).to_device(opts.1);
    let tau_neg = Tensor::from(cfg.tau_neg).to_kind(opts.0).to_device(opts.1);
    let taus = tau_pos.where_self(&c.adv.gt(0.0), &tau_neg);
    let gates: Tensor = (&taus * (ratio - 1.0)).sigmoid() * (4.0 / &taus);
    let pg_losses = -gates * c.adv;
    let pg_losses = weighted(pg_losses, c.weights);
    let loss = agg::aggregate_(
        &pg_losses,
        &c.mask,
        LossAggMode::SeqMeanTokenMean,
        &cfg.batch_info(norm),
    );
    let ppo_kl = masked::mean_(&(-&negative_approx_kl), &c.mask, None);
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics {
            pg_clipfrac: Some(0.0),
            ppo_kl: Some(item(&ppo_kl)),
            pg_clipfrac_lower: Some(0.0),
        },
    })
}

/// GPG's loss, matching `compute_policy_loss_gpg`: `-log_prob * A` (times the importance
/// weights), aggregated with `cfg.loss_agg_mode`. No metrics.
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn gpg(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let pg_losses = weighted(-c.lp * c.adv, c.weights);
    let loss = agg::aggregate_(
        &pg_losses,
        &c.mask,
        cfg.loss_agg_mode,
        &cfg.batch_info(norm),
    );
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics::default(),
    })
}

/// Clip-Cov, matching `compute_policy_loss_clip_cov`.
///
/// PPO's clipped surrogate (without the ratio clamp or dual-clip), where among the unclipped
/// tokens whose centred covariance `(A - mean A) * (log_prob - mean log_prob)` lies strictly
/// between `clip_cov_lb` and `clip_cov_ub`, `max(1, floor(clip_cov_ratio * tokens))` tokens
/// picked at random get no gradient (their loss is multiplied by 0).
/// The pick uses libtorch's global generator (`torch.randperm`), so seed it with
/// `tch::manual_seed` for a reproducible loss. Metrics: `pg_clipfrac` (the fraction picked),
/// `ppo_kl`.
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn clip_cov(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let p = &cfg.policy_loss;
    let (low, high) = (cfg.clip_low(), cfg.clip_high());
    let negative_approx_kl = c.lp - c.old;
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked::mean_(&(-&negative_approx_kl), &c.mask, None);

    let pg_losses1 = -c.adv * &ratio;
    let pg_losses2 = -c.adv * ratio.clamp(1.0 - low, 1.0 + high);
    let corr = {
        let _guard = tch::no_grad_guard();
        let valid = c.mask.gt(0.0);
        let clip_by_origin = pg_losses2.gt_tensor(&pg_losses1).logical_and(&valid);
        let adv_mean = masked::mean_(c.adv, &c.mask, None);
        let lp_mean = masked::mean_(&c.lp.detach(), &c.mask, None);
        let cov_all = (c.adv - adv_mean) * (c.lp.detach() - lp_mean);
        let cov_all = cov_all
            .masked_fill(&valid.logical_not(), f64::NEG_INFINITY)
            .masked_fill(&clip_by_origin, f64::NEG_INFINITY);
        let tokens = c.mask.sum(Kind::Double).double_value(&[]);
        let clip_num = ((p.clip_cov_ratio * tokens) as i64).max(1);
        let candidates = cov_all
            .lt(p.clip_cov_ub)
            .logical_and(&cov_all.gt(p.clip_cov_lb))
            .logical_and(&valid);
        let idx = candidates.nonzero(); // [k, 2]
        let k = idx.size()[0];
        let mut corr = c.adv.ones_like();
        if k > 0 {
            let perm = Tensor::randperm(k, (Kind::Int64, tch::Device::Cpu)).to_device(idx.device());
            let picked = idx.index_select(0, &perm.narrow(0, 0, clip_num.min(k)));
            let zero = Tensor::zeros([1], (corr.kind(), corr.device()));
            let _ = corr.index_put_(
                &[Some(picked.select(1, 0)), Some(picked.select(1, 1))],
                &zero,
                false,
            );
        }
        corr
    };
    let pg_clipfrac = masked::mean_(&corr.eq(0.0).to_kind(c.mask.kind()), &c.mask, None);
    let pg_losses = pg_losses1.maximum(&pg_losses2) * &corr;
    let pg_losses = weighted(pg_losses, c.weights);
    let loss = agg::aggregate_(
        &pg_losses,
        &c.mask,
        cfg.loss_agg_mode,
        &cfg.batch_info(norm),
    );
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics {
            pg_clipfrac: Some(item(&pg_clipfrac)),
            ppo_kl: Some(item(&ppo_kl)),
            pg_clipfrac_lower: None,
        },
    })
}

/// KL-Cov, matching `compute_policy_loss_kl_cov`.
///
/// The unclipped surrogate `-A * ratio` (`ratio = exp(log_prob - old_log_prob)`), where the
/// `max(1, floor(kl_cov_ratio * tokens))` unmasked tokens with the largest centred covariance
/// `(A - mean A) * (log_prob - mean log_prob)` get `ppo_kl_coef * |log_prob - old_log_prob|`
/// added. Metrics: `ppo_kl`, which here is the masked mean of `|log_prob - old_log_prob|`.
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn kl_cov(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let p = &cfg.policy_loss;
    let negative_approx_kl = c.lp - c.old;
    let abs_kl = negative_approx_kl.abs();
    let ratio = negative_approx_kl.exp();
    let ppo_kl_abs = masked::mean_(&abs_kl, &c.mask, None);
    let pg_losses1 = -c.adv * &ratio;
    let pg_losses_kl = -c.adv * &ratio + p.ppo_kl_coef * &abs_kl;

    let selected = {
        let _guard = tch::no_grad_guard();
        let valid = c.mask.gt(0.0);
        let flat_valid = valid.reshape([-1]);
        let valid_idx = flat_valid.nonzero().squeeze_dim(1);
        let adv = c
            .adv
            .detach()
            .masked_select(&valid)
            .to_device(tch::Device::Cpu);
        let logp =
            c.lp.detach()
                .masked_select(&valid)
                .to_device(tch::Device::Cpu);
        let n = adv.size()[0];
        let selected = if n > 0 {
            let cov = (&adv - adv.mean(None::<Kind>)) * (&logp - logp.mean(None::<Kind>));
            let k = ((n as f64 * p.kl_cov_ratio) as i64).max(1);
            let (_, large) = cov.topk(k, 0, true, true);
            let flat = valid_idx.index_select(0, &large.to_device(valid_idx.device()));
            Tensor::zeros_like(&flat_valid).index_fill(0, &flat, 1)
        } else {
            Tensor::zeros_like(&flat_valid)
        };
        selected.reshape(c.lp.size().as_slice())
    };
    let pg_losses = pg_losses_kl.where_self(&selected, &pg_losses1);
    let pg_losses = weighted(pg_losses, c.weights);
    let loss = agg::aggregate_(
        &pg_losses,
        &c.mask,
        cfg.loss_agg_mode,
        &cfg.batch_info(norm),
    );
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics {
            pg_clipfrac: None,
            ppo_kl: Some(item(&ppo_kl_abs)),
            pg_clipfrac_lower: None,
        },
    })
}

/// GMPO's geometric-mean loss, matching `compute_policy_loss_geo_mean`.
///
/// The token log-ratios are clipped to `[-clip_low, clip_high]` in the direction that limits
/// the update (`sign(A) * min(sign(A) * x, sign(A) * clip(x))`), averaged over each sequence and
/// exponentiated; the per-sequence loss `-mean_seq(A) * ratio` (times the geometric mean of the
/// importance weights, if any) is averaged over the batch.
/// As in verl, `loss_agg_mode` and the global normalisers are not used: the mean is over this
/// micro-batch's rows. Metrics: `pg_clipfrac` (clipped tokens with `A > 0`), `ppo_kl`,
/// `pg_clipfrac_lower` (clipped tokens with `A < 0`).
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn geo_mean(inputs: &PolicyLossInputs<'_>, cfg: &PolicyLossConfig) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let (low, high) = (cfg.clip_low(), cfg.clip_high());
    let negative_approx_kl = c.lp - c.old;
    let ppo_kl = masked::mean_(&(-&negative_approx_kl), &c.mask, None);

    // clipping at token level, and clipping wider
    let sgn_advantage = c.adv.sign();
    let negative_approx_kl_clamp = negative_approx_kl.clamp(-low, high);
    let negative_approx_kl_min = (&sgn_advantage * &negative_approx_kl)
        .minimum(&(&sgn_advantage * &negative_approx_kl_clamp));
    let negative_approx_kl_min = &sgn_advantage * negative_approx_kl_min;

    let row_sum = |x: &Tensor| x.sum_dim_intlist([-1].as_slice(), false, None::<Kind>);
    let response_mask_sum = row_sum(&c.mask);
    let ratio = (row_sum(&(negative_approx_kl_min * &c.mask)) / (&response_mask_sum + 1e-8)).exp();
    // only sequence-level advantages, as in the paper
    let advantage = row_sum(&(c.adv * &c.mask)) / (&response_mask_sum + 1e-8);
    let pg_losses = -advantage * ratio;
    let pg_losses = match c.weights {
        // token-level weights, aggregated to the sequence by their geometric mean
        Some(w) => {
            let log_w = row_sum(&((w + 1e-10).log() * &c.mask));
            pg_losses * (log_w / (&response_mask_sum + 1e-8)).exp()
        }
        None => pg_losses,
    };
    let loss = pg_losses.mean(None::<Kind>);

    let clipped = negative_approx_kl.ne_tensor(&negative_approx_kl_clamp);
    let upper = clipped.logical_and(&c.adv.gt(0.0)).to_kind(c.mask.kind());
    let lower = clipped.logical_and(&c.adv.lt(0.0)).to_kind(c.mask.kind());
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics {
            pg_clipfrac: Some(item(&masked::mean_(&upper, &c.mask, None))),
            ppo_kl: Some(item(&ppo_kl)),
            pg_clipfrac_lower: Some(item(&masked::mean_(&lower, &c.mask, None))),
        },
    })
}

/// CISPO, matching `compute_policy_loss_cispo`: `-sg[clip(ratio, 1 - clip_low, 1 + clip_high)]
/// * A * log_prob` with `ratio = exp(clamp(log_prob - old_log_prob, -20, 20))`, so the gradient
/// flows only through `log_prob`. Metrics: `pg_clipfrac` (ratios changed by the clip), `ppo_kl`,
/// `pg_clipfrac_lower` (= 0).
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn cispo(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let (low, high) = (cfg.clip_low(), cfg.clip_high());
    let negative_approx_kl = (c.lp - c.old).clamp(-20.0, 20.0);
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked::mean_(&(-&negative_approx_kl), &c.mask, None);
    let clipped_ratio = ratio.clamp(1.0 - low, 1.0 + high);
    let pg_losses = -clipped_ratio.detach() * c.adv * c.lp;
    let pg_clipfrac = masked::mean_(
        &ratio.ne_tensor(&clipped_ratio).to_kind(c.mask.kind()),
        &c.mask,
        None,
    );
    let pg_losses = weighted(pg_losses, c.weights);
    let loss = agg::aggregate_(
        &pg_losses,
        &c.mask,
        cfg.loss_agg_mode,
        &cfg.batch_info(norm),
    );
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics {
            pg_clipfrac: Some(item(&pg_clipfrac)),
            ppo_kl: Some(item(&ppo_kl)),
            pg_clipfrac_lower: Some(0.0),
        },
    })
}

/// REINFORCE, matching `compute_policy_loss_reinforce`: `-A * log_prob`, times the
/// (detached) rollout importance weights when given, aggregated with `cfg.loss_agg_mode`.
/// `old_log_prob` is the rollout policy's and only feeds the metric `ppo_kl`, the masked mean
/// of `old_log_prob - log_prob`.
///
/// # Shapes
/// - see [`PolicyLossInputs`]
/// - returns: a scalar loss
pub fn reinforce(
    inputs: &PolicyLossInputs<'_>,
    cfg: &PolicyLossConfig,
    norm: &GlobalBatchInfo,
) -> Result<PolicyLossOutput> {
    let c = checked(inputs, cfg)?;
    let pg_losses = match c.weights {
        Some(w) => -c.adv * c.lp * w.detach(),
        None => -c.adv * c.lp,
    };
    let loss = agg::aggregate_(
        &pg_losses,
        &c.mask,
        cfg.loss_agg_mode,
        &cfg.batch_info(norm),
    );
    let negative_approx_kl = c.lp - c.old;
    let kl = masked::mean_(&(-negative_approx_kl), &c.mask, None);
    Ok(PolicyLossOutput {
        loss,
        metrics: PolicyLossMetrics {
            pg_clipfrac: None,
            ppo_kl: Some(item(&kl)),
            pg_clipfrac_lower: None,
        },
    })
}

/// Metric key of the value loss.
pub const VF_LOSS: &str = "critic/vf_loss";
/// Metric key of the fraction of tokens where the clipped value loss was used.
pub const VF_CLIPFRAC: &str = "critic/vf_clipfrac";

/// The clipped value loss and its clip fraction.
#[derive(Debug)]
pub struct ValueLossOutput {
    /// The scalar to back-propagate (`0.5 *` the aggregated loss).
    pub loss: Tensor,
    /// `critic/vf_clipfrac`.
    pub vf_clipfrac: f64,
}

/// PPO's clipped value loss, matching `compute_value_loss`:
/// `0.5 * agg(max((v - R)^2, (clip(v, old - c, old + c) - R)^2))` with `c = cliprange_value`.
/// verl passes no global normalisers here; pass [`GlobalBatchInfo::local`] for its behaviour.
///
/// # Shapes
/// - `vpreds`: `[batch, response_len]` float, the critic's current predictions
/// - `returns`: `[batch, response_len]` float
/// - `values`: `[batch, response_len]` float, the predictions at rollout time
/// - `response_mask`: `[batch, response_len]`, binary
/// - returns: a scalar loss and the clip fraction
pub fn value(
    vpreds: &Tensor,
    returns: &Tensor,
    values: &Tensor,
    response_mask: &Tensor,
    cliprange_value: f64,
    mode: LossAggMode,
    norm: &GlobalBatchInfo,
) -> Result<ValueLossOutput> {
    check::float(
        "vpreds",
        vpreds,
        &[Dim::Any("batch"), Dim::Any("response_len")],
    )?;
    check::float_like("returns", returns, "vpreds", vpreds)?;
    check::float_like("values", values, "vpreds", vpreds)?;
    let mask = check::mask("response_mask", response_mask, "vpreds", vpreds)?;
    if cliprange_value.is_nan() || cliprange_value < 0.0 {
        return Err(Error::invalid(
            "cliprange_value",
            format!("must be >= 0, got {cliprange_value}"),
        ));
    }
    // verl's clip_by_value: max(min(x, hi), lo)
    let vpredclipped = vpreds
        .minimum(&(values + cliprange_value))
        .maximum(&(values - cliprange_value));
    let vf_losses1 = (vpreds - returns).square();
    let vf_losses2 = (vpredclipped - returns).square();
    let clipped_vf_losses = vf_losses1.maximum(&vf_losses2);
    let loss = 0.5 * agg::aggregate_(&clipped_vf_losses, &mask, mode, norm);
    let vf_clipfrac = masked::mean_(
        &vf_losses2.gt_tensor(&vf_losses1).to_kind(mask.kind()),
        &mask,
        None,
    );
    Ok(ValueLossOutput {
        loss,
        vf_clipfrac: item(&vf_clipfrac),
    })
}

/// The entropy of the policy, aggregated like a loss, matching `compute_entropy_loss`
/// (the actor subtracts `entropy_coeff *` this).
///
/// # Shapes
/// - `logits`: `[batch, response_len, vocab]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - returns: a scalar
pub fn entropy(
    logits: &Tensor,
    response_mask: &Tensor,
    mode: LossAggMode,
    norm: &GlobalBatchInfo,
) -> Result<Tensor> {
    check::float(
        "logits",
        logits,
        &[
            Dim::Any("batch"),
            Dim::Any("response_len"),
            Dim::Any("vocab"),
        ],
    )?;
    let token_entropy = logits::entropy(logits)?;
    agg::aggregate(&token_entropy, response_mask, mode, norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_names_and_validation() {
        let cfg: PolicyLossConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(cfg, PolicyLossConfig::default());
        assert_eq!((cfg.clip_low(), cfg.clip_high()), (0.2, 0.2));
        let cfg: PolicyLossConfig = serde_json::from_str(
            r#"{"clip_ratio_high": 0.28, "loss_agg_mode": "seq-mean-token-mean", "policy_loss": {"loss_mode": "clip_cov"}}"#,
        )
        .unwrap();
        assert_eq!(cfg.clip_high(), 0.28);
        assert_eq!(cfg.policy_loss.loss_mode, PolicyLossMode::ClipCov);
        let err =
            serde_json::from_str::<PolicyLossConfig>(r#"{"policy_loss": {"loss_mode": "ppo"}}"#)
                .unwrap_err();
        assert!(err.to_string().contains("`vanilla`"), "{err}");
        let err = serde_json::from_str::<PolicyLossConfig>(r#"{"clip_ratio_cc": 3}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `clip_ratio_cc`"),
            "{err}"
        );
        let bad = PolicyLossConfig {
            clip_ratio_c: 1.0,
            ..PolicyLossConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("clip_ratio_c")
        );
        for m in PolicyLossMode::ALL {
            assert_eq!(m.as_str().parse::<PolicyLossMode>().unwrap(), m);
        }
        assert!(
            "bypass_mode"
                .parse::<PolicyLossMode>()
                .unwrap_err()
                .to_string()
                .contains("geo_mean")
        );
    }
}
