//! The `algorithm` config group: verl's `AlgoConfig`, `KLControlConfig`, `FilterGroupsConfig`.

use serde::{Deserialize, Serialize};

use crate::advantage::AdvEstimator;
use crate::error::{Error, Result};
use crate::kl::KlPenalty;
use crate::rollout_corr::RolloutCorrectionConfig;

/// verl's `algorithm` group: the advantage estimator and KL-in-reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgoConfig {
    /// Discount factor, in `[0, 1]`. Default 1.0.
    pub gamma: f64,
    /// GAE's lambda (bias/variance trade-off), in `[0, 1]`. Default 1.0.
    pub lam: f64,
    /// The advantage estimator (`gae`, `grpo`, `rloo`, ...). Default `gae`.
    pub adv_estimator: AdvEstimator,
    /// Divide GRPO (and pass@k) advantages by the group std; false is Dr. GRPO. Default true.
    pub norm_adv_by_std_in_grpo: bool,
    /// Subtract `beta * KL(policy || reference)` from the token rewards. Default false.
    pub use_kl_in_reward: bool,
    /// The KL estimator of KL-in-reward (`kl`, `abs`, `mse`, `low_var_kl`, ...). Default `kl`.
    pub kl_penalty: KlPenalty,
    /// The controller of KL-in-reward's coefficient.
    pub kl_ctrl: KlCtrlConfig,
    /// DAPO's dynamic sampling; absent (verl's `null`) means off.
    pub filter_groups: Option<FilterGroupsConfig>,
    /// The `epsilon` added to GRPO's (and pass@k's) group std, > 0. Default 1e-6 (verl's
    /// function default; verl's trainer does not expose it).
    pub grpo_epsilon: f64,
    /// GPG's `f_norm`, the divisor of its advantages, non-zero. Default 1.0 (verl's function
    /// default; verl's trainer does not expose it).
    pub gpg_f_norm: f64,
    /// The optimal token baselines' `epsilon` in `Σ G W / (Σ W + epsilon)`, > 0. Default 1e-8.
    pub otb_epsilon: f64,
    /// The optimal token baselines' `handle_zero_tail`; absent = verl's default (false for
    /// `optimal_token_baseline`, true for `tir_optimal_token_baseline`).
    pub otb_handle_zero_tail: Option<bool>,
    /// Importance weights and rejection for rollouts whose policy differs from the trained one
    /// (verl's `algorithm.rollout_correction`); everything off by default.
    pub rollout_correction: RolloutCorrectionConfig,
}

impl Default for AlgoConfig {
    fn default() -> Self {
        AlgoConfig {
            gamma: 1.0,
            lam: 1.0,
            adv_estimator: AdvEstimator::Gae,
            norm_adv_by_std_in_grpo: true,
            use_kl_in_reward: false,
            kl_penalty: KlPenalty::Kl,
            kl_ctrl: KlCtrlConfig::default(),
            filter_groups: None,
            grpo_epsilon: crate::advantage::EPSILON,
            gpg_f_norm: 1.0,
            otb_epsilon: 1e-8,
            otb_handle_zero_tail: None,
            rollout_correction: RolloutCorrectionConfig::default(),
        }
    }
}

impl AlgoConfig {
    /// Checks the ranges and cross-field rules.
    pub fn validate(&self) -> Result<()> {
        unit_interval("gamma", self.gamma)?;
        unit_interval("lam", self.lam)?;
        positive("grpo_epsilon", self.grpo_epsilon)?;
        positive("otb_epsilon", self.otb_epsilon)?;
        if !(self.gpg_f_norm != 0.0 && self.gpg_f_norm.is_finite()) {
            return Err(Error::invalid(
                "gpg_f_norm",
                format!("must be finite and non-zero, got {}", self.gpg_f_norm),
            ));
        }
        self.rollout_correction.validate()?;
        self.kl_ctrl.validate()
    }
}

fn positive(name: &'static str, v: f64) -> Result<()> {
    if v > 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(Error::invalid(
            name,
            format!("must be positive and finite, got {v}"),
        ))
    }
}

fn unit_interval(name: &'static str, v: f64) -> Result<()> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(Error::invalid(name, format!("must be in [0, 1], got {v}")))
    }
}

/// The kind of KL controller (verl's `kl_ctrl.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlCtrlType {
    /// The coefficient stays at `kl_coef`.
    #[default]
    Fixed,
    /// The coefficient adapts towards `target_kl` over `horizon` samples.
    Adaptive,
}

/// verl's `algorithm.kl_ctrl`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KlCtrlConfig {
    /// `fixed` or `adaptive`. Default `fixed`.
    #[serde(rename = "type")]
    pub kind: KlCtrlType,
    /// The (initial) coefficient, at least 0. Default 0.001.
    pub kl_coef: f64,
    /// Samples over which an adaptive coefficient moves by at most 20%, at least 1. Default 10000.
    pub horizon: i64,
    /// The KL an adaptive controller aims at, positive. Default 0.1.
    pub target_kl: f64,
}

impl Default for KlCtrlConfig {
    fn default() -> Self {
        KlCtrlConfig {
            kind: KlCtrlType::Fixed,
            kl_coef: 0.001,
            horizon: 10000,
            target_kl: 0.1,
        }
    }
}

impl KlCtrlConfig {
    /// Checks the ranges (verl asserts `horizon > 0` for the adaptive controller).
    pub fn validate(&self) -> Result<()> {
        if !(self.kl_coef >= 0.0 && self.kl_coef.is_finite()) {
            return Err(Error::invalid(
                "kl_ctrl.kl_coef",
                format!("must be finite and >= 0, got {}", self.kl_coef),
            ));
        }
        if self.kind == KlCtrlType::Adaptive {
            if self.horizon <= 0 {
                return Err(Error::invalid(
                    "kl_ctrl.horizon",
                    format!("must be larger than 0, got {}", self.horizon),
                ));
            }
            if self.target_kl.is_nan() || self.target_kl <= 0.0 {
                return Err(Error::invalid(
                    "kl_ctrl.target_kl",
                    format!("must be positive, got {}", self.target_kl),
                ));
            }
        }
        Ok(())
    }
}

/// verl's `algorithm.filter_groups` (DAPO's dynamic sampling).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FilterGroupsConfig {
    /// Drop the groups whose metric is the same for every response. Default false.
    pub enable: bool,
    /// The per-response metric compared within a group: `seq_final_reward` (summed token
    /// rewards), `seq_reward` (summed token scores), `acc`, `score`, ... Default none.
    pub metric: Option<String>,
    /// Generation batches tried to fill a training batch; 0 or less means no limit. Default 0.
    pub max_num_gen_batches: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_verls_and_unknown_keys_are_errors() {
        let cfg: AlgoConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(cfg, AlgoConfig::default());
        assert_eq!(cfg.kl_ctrl.kl_coef, 0.001);
        let cfg: AlgoConfig =
            serde_json::from_str(r#"{"adv_estimator": "grpo", "kl_penalty": "low_var_kl", "kl_ctrl": {"type": "adaptive"}}"#)
                .unwrap();
        assert_eq!(cfg.adv_estimator, AdvEstimator::Grpo);
        assert_eq!(cfg.kl_ctrl.kind, KlCtrlType::Adaptive);
        cfg.validate().unwrap();
        let err = serde_json::from_str::<AlgoConfig>(r#"{"gama": 0.9}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `gama`"), "{err}");
        let err = serde_json::from_str::<AlgoConfig>(r#"{"adv_estimator": "ppo"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown variant `ppo`") && err.contains("`grpo`"),
            "{err}"
        );
        let err = serde_json::from_str::<AlgoConfig>(r#"{"kl_ctrl": {"type": "pid"}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`adaptive`"), "{err}");
        let bad = AlgoConfig {
            gamma: 1.5,
            ..AlgoConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("gamma"));
    }
}
