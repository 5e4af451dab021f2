//! The `algorithm` config group: verl's `AlgoConfig`, `KLControlConfig`, `FilterGroupsConfig`,
//! and the names it chooses between ([`AdvEstimator`], [`KlPenalty`]).
//!
//! It sits below the math that reads it: [`crate::advantage`] and [`crate::kl`] import these
//! types, and nothing here imports them (`rollout_corr`'s config is a leaf of its own).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::rollout_corr::RolloutCorrectionConfig;

/// Which advantage estimator a run uses (verl's `algorithm.adv_estimator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvEstimator {
    /// Generalised advantage estimation with a critic: [`crate::advantage::gae`].
    #[default]
    Gae,
    /// Group-relative outcome advantages: [`crate::advantage::grpo`] (verl's `grpo_vectorized` is accepted as
    /// this estimator).
    #[serde(alias = "grpo_vectorized")]
    Grpo,
    /// Discounted returns, whitened over the batch: [`crate::advantage::reinforce_plus_plus`].
    ReinforcePlusPlus,
    /// Group-mean baseline, whitened over the batch: [`crate::advantage::reinforce_plus_plus_baseline`].
    ReinforcePlusPlusBaseline,
    /// Greedy-rollout baseline: [`crate::advantage::remax`].
    Remax,
    /// Leave-one-out baseline: [`crate::advantage::rloo`] (verl's `rloo_vectorized` is accepted as this
    /// estimator).
    #[serde(alias = "rloo_vectorized")]
    Rloo,
    /// Length-weighted group baseline: [`crate::advantage::opo`].
    Opo,
    /// Pass@k advantage for the best response of each group: [`crate::advantage::grpo_passk`].
    GrpoPassk,
    /// Group Policy Gradient: [`crate::advantage::gpg`].
    Gpg,
    /// A baseline per token, weighted by the path's accumulated variance:
    /// [`crate::advantage::optimal_token_baseline`].
    OptimalTokenBaseline,
    /// The optimal token baseline over the policy's own tokens of multi-turn responses:
    /// [`crate::advantage::tir_optimal_token_baseline`].
    TirOptimalTokenBaseline,
}

impl AdvEstimator {
    /// Every estimator, in verl's order.
    pub const ALL: [AdvEstimator; 11] = [
        AdvEstimator::Gae,
        AdvEstimator::Grpo,
        AdvEstimator::ReinforcePlusPlus,
        AdvEstimator::ReinforcePlusPlusBaseline,
        AdvEstimator::Remax,
        AdvEstimator::Rloo,
        AdvEstimator::Opo,
        AdvEstimator::GrpoPassk,
        AdvEstimator::Gpg,
        AdvEstimator::OptimalTokenBaseline,
        AdvEstimator::TirOptimalTokenBaseline,
    ];

    /// verl's registry names that run the same estimator as another name here (their
    /// implementations differ from the canonical ones only in float32 rounding).
    pub const ALIASES: [(&'static str, AdvEstimator); 2] = [
        ("grpo_vectorized", AdvEstimator::Grpo),
        ("rloo_vectorized", AdvEstimator::Rloo),
    ];

    /// verl's config string for this estimator.
    pub fn as_str(self) -> &'static str {
        match self {
            AdvEstimator::Gae => "gae",
            AdvEstimator::Grpo => "grpo",
            AdvEstimator::ReinforcePlusPlus => "reinforce_plus_plus",
            AdvEstimator::ReinforcePlusPlusBaseline => "reinforce_plus_plus_baseline",
            AdvEstimator::Remax => "remax",
            AdvEstimator::Rloo => "rloo",
            AdvEstimator::Opo => "opo",
            AdvEstimator::GrpoPassk => "grpo_passk",
            AdvEstimator::Gpg => "gpg",
            AdvEstimator::OptimalTokenBaseline => "optimal_token_baseline",
            AdvEstimator::TirOptimalTokenBaseline => "tir_optimal_token_baseline",
        }
    }

    /// Whether the estimator needs a critic's `values` (only GAE).
    pub fn needs_critic(self) -> bool {
        self == AdvEstimator::Gae
    }

    /// Whether the estimator groups rows by prompt (`index`).
    pub fn needs_groups(self) -> bool {
        matches!(
            self,
            AdvEstimator::Grpo
                | AdvEstimator::ReinforcePlusPlusBaseline
                | AdvEstimator::Rloo
                | AdvEstimator::Opo
                | AdvEstimator::GrpoPassk
                | AdvEstimator::Gpg
                | AdvEstimator::OptimalTokenBaseline
                | AdvEstimator::TirOptimalTokenBaseline
        )
    }

    /// Whether the estimator reads the actor's `old_log_probs` and `sum_pi_squared` (the
    /// optimal-token baselines).
    pub fn needs_sum_pi_squared(self) -> bool {
        matches!(
            self,
            AdvEstimator::OptimalTokenBaseline | AdvEstimator::TirOptimalTokenBaseline
        )
    }
}

impl fmt::Display for AdvEstimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AdvEstimator {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .or_else(|| Self::ALIASES.iter().find(|(a, _)| *a == s).map(|(_, e)| *e))
            .ok_or_else(|| Error::UnknownName {
                what: "adv_estimator",
                got: s.to_owned(),
                valid: Self::ALL.map(Self::as_str).join(", "),
            })
    }
}

/// How the per-token KL is estimated (verl's `kl_penalty` / `kl_loss_type`).
///
/// See <http://joschu.net/blog/kl-approx.html>. A trailing `+` keeps the estimator's value but
/// takes the gradient of k2 (`logprob - ref_logprob`), which is the unbiased gradient of the KL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KlPenalty {
    /// k1: `logprob - ref_logprob`.
    #[serde(rename = "kl")]
    Kl,
    /// Same as [`KlPenalty::Kl`].
    #[serde(rename = "k1")]
    K1,
    /// `|logprob - ref_logprob|`.
    #[serde(rename = "abs")]
    Abs,
    /// k2: `0.5 * (logprob - ref_logprob)^2`.
    #[serde(rename = "mse")]
    Mse,
    /// Same as [`KlPenalty::Mse`].
    #[serde(rename = "k2")]
    K2,
    /// k3: `exp(ref - logprob) - (ref - logprob) - 1`, with verl's clamps.
    #[serde(rename = "low_var_kl")]
    LowVarKl,
    /// Same as [`KlPenalty::LowVarKl`].
    #[serde(rename = "k3")]
    K3,
    /// k1 value, k2 gradient.
    #[serde(rename = "kl+")]
    KlPlus,
    /// k1 value, k2 gradient.
    #[serde(rename = "k1+")]
    K1Plus,
    /// abs value, k2 gradient.
    #[serde(rename = "abs+")]
    AbsPlus,
    /// k2 (the `+` changes nothing).
    #[serde(rename = "mse+")]
    MsePlus,
    /// k2 (the `+` changes nothing).
    #[serde(rename = "k2+")]
    K2Plus,
    /// k3 value, k2 gradient.
    #[serde(rename = "low_var_kl+")]
    LowVarKlPlus,
    /// k3 value, k2 gradient.
    #[serde(rename = "k3+")]
    K3Plus,
}

/// The four estimators behind the [`KlPenalty`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KlEstimator {
    /// `logprob - ref_logprob`.
    K1,
    /// `|logprob - ref_logprob|`.
    Abs,
    /// `0.5 * (logprob - ref_logprob)^2`.
    K2,
    /// `exp(ref - logprob) - (ref - logprob) - 1`.
    K3,
}

impl KlPenalty {
    /// Every name verl accepts, in its order.
    pub const ALL: [KlPenalty; 14] = [
        KlPenalty::Kl,
        KlPenalty::K1,
        KlPenalty::Abs,
        KlPenalty::Mse,
        KlPenalty::K2,
        KlPenalty::LowVarKl,
        KlPenalty::K3,
        KlPenalty::KlPlus,
        KlPenalty::K1Plus,
        KlPenalty::AbsPlus,
        KlPenalty::MsePlus,
        KlPenalty::K2Plus,
        KlPenalty::LowVarKlPlus,
        KlPenalty::K3Plus,
    ];

    /// verl's config string.
    pub fn as_str(self) -> &'static str {
        match self {
            KlPenalty::Kl => "kl",
            KlPenalty::K1 => "k1",
            KlPenalty::Abs => "abs",
            KlPenalty::Mse => "mse",
            KlPenalty::K2 => "k2",
            KlPenalty::LowVarKl => "low_var_kl",
            KlPenalty::K3 => "k3",
            KlPenalty::KlPlus => "kl+",
            KlPenalty::K1Plus => "k1+",
            KlPenalty::AbsPlus => "abs+",
            KlPenalty::MsePlus => "mse+",
            KlPenalty::K2Plus => "k2+",
            KlPenalty::LowVarKlPlus => "low_var_kl+",
            KlPenalty::K3Plus => "k3+",
        }
    }

    /// The estimator whose value is returned.
    pub fn estimator(self) -> KlEstimator {
        use KlPenalty::*;
        match self {
            Kl | K1 | KlPlus | K1Plus => KlEstimator::K1,
            Abs | AbsPlus => KlEstimator::Abs,
            Mse | K2 | MsePlus | K2Plus => KlEstimator::K2,
            LowVarKl | K3 | LowVarKlPlus | K3Plus => KlEstimator::K3,
        }
    }

    /// Whether the gradient is k2's (a `+` name other than `mse+`/`k2+`).
    pub fn straight_through(self) -> bool {
        self.as_str().ends_with('+') && self.estimator() != KlEstimator::K2
    }
}

impl fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KlPenalty {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| Error::UnknownName {
                what: "kl_penalty",
                got: s.to_owned(),
                valid: Self::ALL.map(Self::as_str).join(", "),
            })
    }
}

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
            grpo_epsilon: 1e-6, // advantage::EPSILON, pinned by a test there
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
