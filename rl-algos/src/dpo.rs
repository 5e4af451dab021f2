//! The DPO family: DPO losses, online-DPO preference pairs, sequence log-probs and SPPO.
//!
//! They match verl-recipe's `spin/core_algos.py` and `sppo/dp_actor.py`; the hinge loss, which
//! verl lacks, matches TRL's `DPOTrainer`.

use std::fmt;
use std::str::FromStr;

use rl_core::shape::{self, Dim};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::check;
use crate::error::{Error, Result};
use crate::logits;
use crate::masked;

/// The label that marks a position to ignore in [`sequence_log_probs`] (PyTorch's
/// `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// The shape of the DPO loss (verl-recipe's `dpo_loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DpoLossType {
    /// `-log sigmoid(beta * z) * (1 - eps) - log sigmoid(-beta * z) * eps` (label smoothing eps).
    #[default]
    Sigmoid,
    /// IPO: `(z - 1 / (2 * beta))^2`.
    Ipo,
    /// SLiC's hinge: `relu(1 - beta * z)` (from TRL; verl-recipe names it but lacks it).
    Hinge,
}

impl DpoLossType {
    /// Every loss type.
    pub const ALL: [DpoLossType; 3] = [DpoLossType::Sigmoid, DpoLossType::Ipo, DpoLossType::Hinge];

    /// The config string.
    pub fn as_str(self) -> &'static str {
        match self {
            DpoLossType::Sigmoid => "sigmoid",
            DpoLossType::Ipo => "ipo",
            DpoLossType::Hinge => "hinge",
        }
    }
}

impl fmt::Display for DpoLossType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DpoLossType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| Error::UnknownName {
                what: "dpo_loss_type",
                got: s.to_owned(),
                valid: Self::ALL.map(Self::as_str).join(", "),
            })
    }
}

/// The DPO keys of verl-recipe's SPIN / online-DPO actor, with its defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoConfig {
    /// Inverse temperature of the implicit reward, positive. Default 0.1.
    pub dpo_beta: f64,
    /// The loss shape. Default `sigmoid`.
    pub dpo_loss_type: DpoLossType,
    /// Probability that a preference label is flipped (sigmoid only), in `[0, 0.5]`. Default 0.
    pub dpo_label_smoothing: f64,
    /// Drop the reference log-ratio (the reference is uniform). Default false.
    pub reference_free: bool,
}

impl Default for DpoConfig {
    fn default() -> Self {
        DpoConfig {
            dpo_beta: 0.1,
            dpo_loss_type: DpoLossType::Sigmoid,
            dpo_label_smoothing: 0.0,
            reference_free: false,
        }
    }
}

impl DpoConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<()> {
        if !(self.dpo_beta > 0.0 && self.dpo_beta.is_finite()) {
            return Err(Error::invalid(
                "dpo_beta",
                format!("must be positive, got {}", self.dpo_beta),
            ));
        }
        if !(0.0..=0.5).contains(&self.dpo_label_smoothing) {
            return Err(Error::invalid(
                "dpo_label_smoothing",
                format!("must be in [0, 0.5], got {}", self.dpo_label_smoothing),
            ));
        }
        Ok(())
    }
}

/// The DPO loss averaged over pairs, matching verl-recipe's `compute_online_dpo_loss`.
///
/// With `z = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)` (the reference term is 0
/// when `reference_free`), the per-pair loss is given by [`DpoLossType`].
///
/// # Shapes
/// - `policy_chosen_logps`, `policy_rejected_logps`: `[pairs]` float, sequence log-probs
/// - `reference_chosen_logps`, `reference_rejected_logps`: `[pairs]` float
/// - returns: a scalar
pub fn loss(
    policy_chosen_logps: &Tensor,
    policy_rejected_logps: &Tensor,
    reference_chosen_logps: &Tensor,
    reference_rejected_logps: &Tensor,
    cfg: &DpoConfig,
) -> Result<Tensor> {
    check::float(
        "policy_chosen_logps",
        policy_chosen_logps,
        &[Dim::Any("pairs")],
    )?;
    for (name, t) in [
        ("policy_rejected_logps", policy_rejected_logps),
        ("reference_chosen_logps", reference_chosen_logps),
        ("reference_rejected_logps", reference_rejected_logps),
    ] {
        check::float_like(name, t, "policy_chosen_logps", policy_chosen_logps)?;
    }
    cfg.validate()?;
    let beta = cfg.dpo_beta;
    let pi_logratios = policy_chosen_logps - policy_rejected_logps;
    let ref_logratios = if cfg.reference_free {
        pi_logratios.zeros_like()
    } else {
        reference_chosen_logps - reference_rejected_logps
    };
    let logits = pi_logratios - ref_logratios;
    let losses = match cfg.dpo_loss_type {
        DpoLossType::Sigmoid => {
            let eps = cfg.dpo_label_smoothing;
            -(beta * &logits).log_sigmoid() * (1.0 - eps) - (-beta * &logits).log_sigmoid() * eps
        }
        DpoLossType::Ipo => (logits - 1.0 / (2.0 * beta)).square(),
        DpoLossType::Hinge => {
            let margin: Tensor = 1.0 - beta * logits;
            margin.relu()
        }
    };
    Ok(losses.mean(None::<Kind>))
}

/// Preferences from the rewards of interleaved response pairs, matching verl-recipe's
/// `compute_onlinedpo_pref`: rows `2i` and `2i + 1` answer prompt `i`; the row with the larger
/// masked reward sum is chosen, the first on a tie.
///
/// # Shapes
/// - `token_level_rewards`: `[2 * pairs, response_len]` float
/// - `response_mask`: `[2 * pairs, response_len]`, binary
/// - returns: `[2 * pairs]` bool, true at each pair's chosen row
pub fn pref_from_rewards(token_level_rewards: &Tensor, response_mask: &Tensor) -> Result<Tensor> {
    let size = check::float(
        "token_level_rewards",
        token_level_rewards,
        &[Dim::Any("batch"), Dim::Any("response_len")],
    )?;
    let mask = check::mask(
        "response_mask",
        response_mask,
        "token_level_rewards",
        token_level_rewards,
    )?;
    if size[0] % 2 != 0 {
        return Err(Error::invalid(
            "token_level_rewards",
            format!(
                "the batch must hold pairs (an even number of rows), got {}",
                size[0]
            ),
        ));
    }
    let scores = masked::sum_(token_level_rewards, &mask, Some(-1)).view([-1, 2]);
    // argmax picks the first maximum: the second row wins only when strictly larger
    let second = scores.select(1, 1).gt_tensor(&scores.select(1, 0));
    Ok(Tensor::stack(&[second.logical_not(), second], 1).reshape([-1]))
}

/// Per-sequence log-probs of labelled tokens, matching verl-recipe's `get_batch_logps`:
/// position `t` of `logits` predicts `labels[t + 1]`; labels equal to [`IGNORE_INDEX`] count
/// for nothing; the sum (or, with `average_log_prob`, the mean over labelled tokens, 0 for none)
/// per row. Differentiable with respect to `logits`; computed with [`logits::log_probs`], so
/// no full-vocabulary copy of the batch is made.
///
/// # Shapes
/// - `logits`: `[batch, seq_len, vocab]` float
/// - `labels`: `[batch, seq_len]` int64, token ids or -100
/// - returns: `[batch]`, the dtype of `logits`
pub fn sequence_log_probs(
    logits: &Tensor,
    labels: &Tensor,
    average_log_prob: bool,
) -> Result<Tensor> {
    let size = check::float(
        "logits",
        logits,
        &[Dim::Any("batch"), Dim::Any("seq_len"), Dim::Any("vocab")],
    )?;
    shape::expect_dims("labels", labels, &[Dim::Is(size[0]), Dim::Is(size[1])])?;
    shape::expect_kind("labels", labels, &[Kind::Int64])?;
    let len = size[1];
    if len == 0 {
        return Ok(Tensor::zeros([size[0]], (logits.kind(), logits.device())));
    }
    // shift so that tokens < n predict n
    let shift_logits = logits.narrow(1, 0, len - 1);
    let shift_labels = labels.narrow(1, 1, len - 1);
    let keep = shift_labels.ne(IGNORE_INDEX);
    let safe_labels = shift_labels.where_scalarother(&keep, 0);
    let per_token = logits::log_probs(&shift_logits, &safe_labels)?;
    let keep = keep.to_kind(per_token.kind());
    let sums = masked::sum_(&per_token, &keep, Some(-1));
    Ok(if average_log_prob {
        sums / keep
            .sum_dim_intlist([-1].as_slice(), false, None::<Kind>)
            .clamp_min(1.0)
    } else {
        sums
    })
}

/// The SPPO loss and the quantities verl-recipe logs with it.
#[derive(Debug)]
pub struct SppoOutput {
    /// The scalar to back-propagate.
    pub loss: Tensor,
    /// `[batch]`: `sum(log_prob) - sum(old_log_prob)` over each response.
    pub log_ratios: Tensor,
    /// `[batch]`: `eta * rewards`.
    pub scaled_rewards: Tensor,
}

/// The SPPO loss, matching verl-recipe's `compute_sppo_loss` (its only mode, `token-mean`):
/// the mean over non-empty responses of `(log_ratio - eta * reward)^2`, with `log_ratio` the
/// response's summed log-prob minus its summed old log-prob.
///
/// # Shapes
/// - `old_log_prob`: `[batch, response_len]` float
/// - `log_prob`: `[batch, response_len]` float
/// - `rewards`: `[batch]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - returns: a scalar loss and `[batch]` log-ratios and scaled rewards
pub fn sppo(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    rewards: &Tensor,
    response_mask: &Tensor,
    eta: f64,
) -> Result<SppoOutput> {
    let size = check::float(
        "log_prob",
        log_prob,
        &[Dim::Any("batch"), Dim::Any("response_len")],
    )?;
    check::float_like("old_log_prob", old_log_prob, "log_prob", log_prob)?;
    check::float("rewards", rewards, &[Dim::Is(size[0])])?;
    let mask = check::mask("response_mask", response_mask, "log_prob", log_prob)?;
    let log_prob_sum = masked::sum_(log_prob, &mask, Some(1));
    let old_log_prob_sum = masked::sum_(old_log_prob, &mask, Some(1));
    let log_ratios = log_prob_sum - old_log_prob_sum;
    let scaled_rewards = eta * rewards;
    let loss_vec = (&log_ratios - &scaled_rewards).square();
    // verl's sample mask is `response_mask.any(dim=1).float()`: float32 whatever the losses'
    // dtype, so `masked_mean`'s `+ 1e-8` is added to a float32 count and vanishes for any
    // count >= 1; the loss is the sum divided by exactly n (and 0 for no non-empty row).
    let sample_mask = mask
        .sum_dim_intlist([1].as_slice(), false, None::<Kind>)
        .gt(0.0)
        .to_kind(Kind::Float);
    let count = (sample_mask.sum(Kind::Float) + 1e-8).to_kind(loss_vec.kind());
    let loss = (&loss_vec * sample_mask.to_kind(loss_vec.kind())).sum(None::<Kind>) / count;
    Ok(SppoOutput {
        loss,
        log_ratios,
        scaled_rewards,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigmoid_loss_is_ln2_at_equal_margins() {
        let a = Tensor::from_slice(&[-3.0f64, -7.5]);
        let b = Tensor::from_slice(&[-4.0f64, -2.0]);
        let l = loss(&a, &b, &a, &b, &DpoConfig::default())
            .unwrap()
            .double_value(&[]);
        assert!((l - std::f64::consts::LN_2).abs() < 1e-12);
    }

    #[test]
    fn pairs_prefer_the_larger_reward_and_the_first_on_ties() {
        let r = Tensor::from_slice(&[1.0f64, 0.0, 0.0, 2.0, 5.0, 5.0]).reshape([6, 1]);
        let m = r.ones_like();
        let p = pref_from_rewards(&r, &m).unwrap();
        assert_eq!(
            Vec::<bool>::try_from(&p).unwrap(),
            vec![true, false, false, true, true, false]
        );
        assert!(pref_from_rewards(&r.narrow(0, 0, 3), &m.narrow(0, 0, 3)).is_err());
        assert!(
            "kto"
                .parse::<DpoLossType>()
                .unwrap_err()
                .to_string()
                .contains("sigmoid, ipo, hinge")
        );
    }
}
