//! KL penalties (k1, abs, k2, k3, straight-through), KL controllers and KL-in-reward.
//!
//! They match `kl_penalty`, `FixedKLController`, `AdaptiveKLController` in
//! `verl/trainer/ppo/core_algos.py` and `apply_kl_penalty` in `verl/trainer/ppo/ray_trainer.py`.

use rl_core::shape::Dim;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::check;
use crate::config::{KlCtrlConfig, KlCtrlType, KlEstimator, KlPenalty};
use crate::error::Result;
use crate::masked;

/// Per-token KL estimate, matching `verl.trainer.ppo.core_algos.kl_penalty`.
///
/// For the straight-through (`+`) names the value is the estimator's and the gradient with
/// respect to `log_prob` (and `ref_log_prob`) is k2's: `k2 - k2.detach() + value.detach()`.
/// verl's own `kl_penalty` passes the `+` on to `kl_penalty_forward`, which rejects it; here the
/// `+` is stripped for the value, which is what verl's docstring describes.
/// `full` (a KL over the whole vocabulary) is not supported, as in verl.
///
/// # Shapes
/// - `log_prob`: `[batch, response_len]` float
/// - `ref_log_prob`: `[batch, response_len]` float
/// - returns: `[batch, response_len]`
pub fn penalty(log_prob: &Tensor, ref_log_prob: &Tensor, kind: KlPenalty) -> Result<Tensor> {
    check_pair(log_prob, ref_log_prob)?;
    Ok(penalty_(log_prob, ref_log_prob, kind))
}

/// k1, `log_prob - ref_log_prob`: [`penalty`] with `kl`.
///
/// # Shapes
/// - `log_prob`, `ref_log_prob`: `[batch, response_len]` float
/// - returns: `[batch, response_len]`
pub fn k1(log_prob: &Tensor, ref_log_prob: &Tensor) -> Result<Tensor> {
    penalty(log_prob, ref_log_prob, KlPenalty::Kl)
}

/// `|log_prob - ref_log_prob|`: [`penalty`] with `abs`.
///
/// # Shapes
/// - `log_prob`, `ref_log_prob`: `[batch, response_len]` float
/// - returns: `[batch, response_len]`
pub fn abs(log_prob: &Tensor, ref_log_prob: &Tensor) -> Result<Tensor> {
    penalty(log_prob, ref_log_prob, KlPenalty::Abs)
}

/// k2, `0.5 * (log_prob - ref_log_prob)^2`: [`penalty`] with `mse`.
///
/// # Shapes
/// - `log_prob`, `ref_log_prob`: `[batch, response_len]` float
/// - returns: `[batch, response_len]`
pub fn k2(log_prob: &Tensor, ref_log_prob: &Tensor) -> Result<Tensor> {
    penalty(log_prob, ref_log_prob, KlPenalty::Mse)
}

/// k3, `exp(ref - lp) - (ref - lp) - 1` with `ref - lp` clamped to `[-20, 20]` and the result to
/// `[-10, 10]`: [`penalty`] with `low_var_kl`.
///
/// # Shapes
/// - `log_prob`, `ref_log_prob`: `[batch, response_len]` float
/// - returns: `[batch, response_len]`
pub fn low_var_kl(log_prob: &Tensor, ref_log_prob: &Tensor) -> Result<Tensor> {
    penalty(log_prob, ref_log_prob, KlPenalty::LowVarKl)
}

fn check_pair(log_prob: &Tensor, ref_log_prob: &Tensor) -> Result<()> {
    check::float(
        "log_prob",
        log_prob,
        &[Dim::Any("batch"), Dim::Any("response_len")],
    )?;
    check::float_like("ref_log_prob", ref_log_prob, "log_prob", log_prob)
}

/// [`penalty`] on checked inputs.
pub(crate) fn penalty_(log_prob: &Tensor, ref_log_prob: &Tensor, kind: KlPenalty) -> Tensor {
    let forward = forward(log_prob, ref_log_prob, kind.estimator());
    if !kind.straight_through() {
        return forward;
    }
    let backward: Tensor = 0.5 * (log_prob - ref_log_prob).square();
    &backward - backward.detach() + forward.detach()
}

/// verl's `kl_penalty_forward`.
fn forward(log_prob: &Tensor, ref_log_prob: &Tensor, estimator: KlEstimator) -> Tensor {
    match estimator {
        KlEstimator::K1 => log_prob - ref_log_prob,
        KlEstimator::Abs => (log_prob - ref_log_prob).abs(),
        KlEstimator::K2 => 0.5 * (log_prob - ref_log_prob).square(),
        KlEstimator::K3 => {
            // for numerical stability
            let kl = (ref_log_prob - log_prob).clamp(-20.0, 20.0);
            let ratio = kl.exp();
            let kld = (ratio - &kl - 1.0).contiguous();
            kld.clamp(-10.0, 10.0)
        }
    }
}

/// The KL coefficient `beta` of KL-in-reward: fixed, or adapted towards a target KL
/// (<https://arxiv.org/abs/1909.08593>), matching verl's `FixedKLController` and
/// `AdaptiveKLController`. Serialisable, so a checkpoint can hold it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KlController {
    /// `value` never changes.
    Fixed {
        /// The coefficient.
        value: f64,
    },
    /// `value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon` after each step.
    Adaptive {
        /// The current coefficient.
        value: f64,
        /// The KL aimed at.
        target: f64,
        /// Samples over which the coefficient moves by at most 20%.
        horizon: f64,
    },
}

impl KlController {
    /// The controller `cfg` describes, as verl's `get_kl_controller`.
    pub fn new(cfg: &KlCtrlConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(match cfg.kind {
            KlCtrlType::Fixed => KlController::Fixed { value: cfg.kl_coef },
            KlCtrlType::Adaptive => KlController::Adaptive {
                value: cfg.kl_coef,
                target: cfg.target_kl,
                horizon: cfg.horizon as f64,
            },
        })
    }

    /// The current coefficient.
    pub fn value(&self) -> f64 {
        match self {
            KlController::Fixed { value } | KlController::Adaptive { value, .. } => *value,
        }
    }

    /// Updates the coefficient after a step that measured `current_kl` over `n_steps` samples.
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        if let KlController::Adaptive {
            value,
            target,
            horizon,
        } = self
        {
            let proportional_error = (current_kl / *target - 1.0).clamp(-0.2, 0.2);
            let mult = 1.0 + proportional_error * n_steps as f64 / *horizon;
            *value *= mult;
        }
    }
}

/// Metric key of the mean per-sequence KL measured by [`in_reward`].
pub const REWARD_KL_PENALTY: &str = "actor/reward_kl_penalty";
/// Metric key of the coefficient [`in_reward`] used.
pub const REWARD_KL_PENALTY_COEFF: &str = "actor/reward_kl_penalty_coeff";

/// What [`in_reward`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlInRewardMetrics {
    /// `actor/reward_kl_penalty`: the per-sequence masked-mean KL, averaged over the batch.
    pub reward_kl_penalty: f64,
    /// `actor/reward_kl_penalty_coeff`: the `beta` applied (before the controller's update).
    pub reward_kl_penalty_coeff: f64,
}

impl KlInRewardMetrics {
    /// The metrics under verl's keys.
    pub fn to_vec(&self) -> Vec<(&'static str, f64)> {
        vec![
            (REWARD_KL_PENALTY, self.reward_kl_penalty),
            (REWARD_KL_PENALTY_COEFF, self.reward_kl_penalty_coeff),
        ]
    }
}

/// KL-in-reward, matching verl's `apply_kl_penalty`:
/// `token_level_rewards = token_level_scores - beta * kl * response_mask`, with `beta` the
/// controller's value; then the controller is updated with the measured KL and the batch size.
///
/// # Shapes
/// - `token_level_scores`: `[batch, response_len]` float
/// - `old_log_probs`: `[batch, response_len]` float
/// - `ref_log_prob`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - returns: `token_level_rewards`, `[batch, response_len]`
pub fn in_reward(
    token_level_scores: &Tensor,
    old_log_probs: &Tensor,
    ref_log_prob: &Tensor,
    response_mask: &Tensor,
    ctrl: &mut KlController,
    kind: KlPenalty,
) -> Result<(Tensor, KlInRewardMetrics)> {
    let size = check::float(
        "token_level_scores",
        token_level_scores,
        &[Dim::Any("batch"), Dim::Any("response_len")],
    )?;
    check::float_like(
        "old_log_probs",
        old_log_probs,
        "token_level_scores",
        token_level_scores,
    )?;
    check::float_like(
        "ref_log_prob",
        ref_log_prob,
        "token_level_scores",
        token_level_scores,
    )?;
    let mask = check::mask(
        "response_mask",
        response_mask,
        "token_level_scores",
        token_level_scores,
    )?;
    let _guard = tch::no_grad_guard();
    let kld = penalty_(old_log_probs, ref_log_prob, kind) * &mask;
    let beta = ctrl.value();
    let rewards = token_level_scores - beta * &kld;
    // average over each sequence, then over the batch
    let current_kl = masked::mean_(&kld, &mask, Some(-1))
        .mean(None::<tch::Kind>)
        .double_value(&[]);
    ctrl.update(current_kl, size[0] as usize);
    Ok((
        rewards,
        KlInRewardMetrics {
            reward_kl_penalty: current_kl,
            reward_kl_penalty_coeff: beta,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn names_parse_and_classify() {
        for k in KlPenalty::ALL {
            assert_eq!(k.as_str().parse::<KlPenalty>().unwrap(), k);
            assert_eq!(
                serde_json::from_str::<KlPenalty>(&format!("\"{k}\"")).unwrap(),
                k
            );
        }
        assert!(KlPenalty::K3Plus.straight_through());
        assert!(!KlPenalty::K2Plus.straight_through());
        assert!(!KlPenalty::LowVarKl.straight_through());
        let err = "full".parse::<KlPenalty>().unwrap_err().to_string();
        assert!(
            err.starts_with("unknown kl_penalty `full`; expected one of: kl, k1, abs,"),
            "{err}"
        );
    }

    #[test]
    fn straight_through_has_k3_value_and_k2_gradient() {
        let lp = Tensor::from_slice(&[-1.0f64, -2.0, -0.5, -3.0])
            .reshape([2, 2])
            .set_requires_grad(true);
        let rf = Tensor::from_slice(&[-1.5f64, -1.0, -0.5, -2.0]).reshape([2, 2]);
        let st = penalty(&lp, &rf, KlPenalty::K3Plus).unwrap();
        let k3 = low_var_kl(&lp, &rf).unwrap();
        assert!(st.allclose(&k3, 0.0, 0.0, false));
        st.sum(Kind::Double).backward();
        let want = &lp.detach() - &rf;
        assert!(lp.grad().allclose(&want, 1e-12, 0.0, false));
    }

    #[test]
    fn adaptive_controller_moves_towards_target() {
        let cfg = KlCtrlConfig {
            kind: KlCtrlType::Adaptive,
            kl_coef: 0.1,
            horizon: 100,
            target_kl: 0.1,
        };
        let mut c = KlController::new(&cfg).unwrap();
        c.update(1.0, 10); // error clipped to +0.2 -> x1.02
        assert!((c.value() - 0.102).abs() < 1e-12);
        c.update(0.0, 50); // -0.2 * 0.5 -> x0.9
        assert!((c.value() - 0.0918).abs() < 1e-12);
        let mut f = KlController::new(&KlCtrlConfig::default()).unwrap();
        f.update(5.0, 10);
        assert_eq!(f.value(), 0.001);
        let bad = KlCtrlConfig { horizon: 0, ..cfg };
        assert!(KlController::new(&bad).is_err());
    }
}
