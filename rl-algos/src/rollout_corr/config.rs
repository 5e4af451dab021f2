//! verl's `algorithm.rollout_correction` group and the parsing of its rejection criteria
//! (`rollout_rs`, `rollout_rs_threshold`), with verl's rules and error cases.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The level at which importance weights are computed (verl's `rollout_is`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IsLevel {
    /// One weight per token: `exp(log_ratio)` (biased, low variance).
    Token,
    /// One weight per sequence, the product of its token ratios (unbiased, high variance).
    Sequence,
}

impl IsLevel {
    /// verl's config string.
    pub fn as_str(self) -> &'static str {
        match self {
            IsLevel::Token => "token",
            IsLevel::Sequence => "sequence",
        }
    }
}

/// The policy loss of bypass mode (verl's `rollout_correction.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BypassLossType {
    /// PPO's clipped objective against the rollout log-probs (the ratio is the correction; no
    /// extra weights).
    #[default]
    PpoClip,
    /// REINFORCE with the importance weights applied explicitly.
    Reinforce,
}

/// A rejection threshold as written: a number, or a string of comma-separated entries
/// (`"0.5_2.0,8.0"`), one per `rollout_rs` option or one shared by all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RsThreshold {
    /// One number for every option (for `k1` options, the upper ratio bound; the lower bound is
    /// its reciprocal).
    Number(f64),
    /// Comma-separated entries; `k1` options take `lower_upper` ratio bounds.
    Text(String),
}

impl fmt::Display for RsThreshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RsThreshold::Number(x) => write!(f, "{x}"),
            RsThreshold::Text(s) => write!(f, "{s:?}"),
        }
    }
}

/// verl's `algorithm.rollout_correction`, with verl's defaults (everything off).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutCorrectionConfig {
    /// Importance weights per `token` or per `sequence`; absent (verl's `null`) = none.
    pub rollout_is: Option<IsLevel>,
    /// Importance weights are capped at this, > 0. Default 2.0.
    pub rollout_is_threshold: f64,
    /// Divide the importance weights by their batch mean (token or sequence level). Default
    /// false.
    pub rollout_is_batch_normalize: bool,
    /// Rejection criteria, comma-separated: `token_k1|k2|k3`, `seq_sum_k1|k2|k3`,
    /// `seq_mean_k1|k2|k3`, `seq_max_k2|k3`; absent = no rejection.
    pub rollout_rs: Option<String>,
    /// The rejection bounds, one entry per criterion or one for all (`k1`: `"lower_upper"`
    /// ratios or an upper ratio; others: an upper bound). Required with `rollout_rs`.
    pub rollout_rs_threshold: Option<RsThreshold>,
    /// Reuse the rollout log-probs as `old_log_probs` (no recomputation) and apply the
    /// correction inside the policy loss (`loss_type`). Default false.
    pub bypass_mode: bool,
    /// Bypass mode's policy loss: `ppo_clip` or `reinforce`. Default `ppo_clip`.
    pub loss_type: BypassLossType,
}

impl Default for RolloutCorrectionConfig {
    fn default() -> Self {
        RolloutCorrectionConfig {
            rollout_is: None,
            rollout_is_threshold: 2.0,
            rollout_is_batch_normalize: false,
            rollout_rs: None,
            rollout_rs_threshold: None,
            bypass_mode: false,
            loss_type: BypassLossType::PpoClip,
        }
    }
}

impl RolloutCorrectionConfig {
    /// Whether anything is switched on (weights, rejection or bypass mode).
    pub fn enabled(&self) -> bool {
        self.rollout_is.is_some() || self.rollout_rs.is_some() || self.bypass_mode
    }

    /// The parsed rejection rules (empty without `rollout_rs`).
    pub fn rules(&self) -> Result<Vec<RsRule>> {
        match &self.rollout_rs {
            None => Ok(Vec::new()),
            Some(rs) => {
                let threshold = self.rollout_rs_threshold.as_ref().ok_or_else(|| {
                    Error::invalid(
                        "rollout_correction.rollout_rs_threshold",
                        format!(
                            "must be set when rollout_rs is ({rs:?}): one bound per option, e.g. \
                             \"0.5_2.0\" for a k1 option or 2.0 for k2/k3"
                        ),
                    )
                })?;
                parse_rules(rs, threshold)
            }
        }
    }

    /// Checks the thresholds and parses the rejection rules, as verl does before a step.
    pub fn validate(&self) -> Result<()> {
        let t = self.rollout_is_threshold;
        if !(t > 0.0 && t.is_finite()) {
            return Err(Error::invalid(
                "rollout_correction.rollout_is_threshold",
                format!("must be positive and finite, got {t}"),
            ));
        }
        if self.rollout_rs.is_none() && self.rollout_rs_threshold.is_some() {
            return Err(Error::invalid(
                "rollout_correction.rollout_rs_threshold",
                "is set but rollout_rs is not: name the rejection criteria it bounds",
            ));
        }
        self.rules().map(|_| ())
    }
}

/// The statistic a rejection criterion aggregates over a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RsLevel {
    /// Each token on its own.
    Token,
    /// The sum over the sequence's tokens.
    SeqSum,
    /// The mean over the sequence's tokens.
    SeqMean,
    /// The maximum over the sequence's tokens.
    SeqMax,
}

/// The per-token divergence estimator of a rejection criterion, from `log_ratio = log π_train
/// − log π_rollout` (clamped to ±20).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RsEstimator {
    /// `-log_ratio`, bounded below and above (ratio bounds in log space).
    K1,
    /// `0.5 * log_ratio²`, bounded above.
    K2,
    /// `exp(log_ratio) - 1 - log_ratio`, bounded above.
    K3,
}

/// One rejection criterion (`seq_mean_k3`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RsOption {
    /// Token or sequence aggregate.
    pub level: RsLevel,
    /// The divergence estimator.
    pub estimator: RsEstimator,
}

impl RsOption {
    /// verl's eleven option names (`seq_max_k1` does not exist).
    pub const ALL: [&'static str; 11] = [
        "token_k1",
        "token_k2",
        "token_k3",
        "seq_sum_k1",
        "seq_sum_k2",
        "seq_sum_k3",
        "seq_mean_k1",
        "seq_mean_k2",
        "seq_mean_k3",
        "seq_max_k2",
        "seq_max_k3",
    ];

    /// verl's name of the option.
    pub fn name(self) -> String {
        let level = match self.level {
            RsLevel::Token => "token",
            RsLevel::SeqSum => "seq_sum",
            RsLevel::SeqMean => "seq_mean",
            RsLevel::SeqMax => "seq_max",
        };
        let k = match self.estimator {
            RsEstimator::K1 => "k1",
            RsEstimator::K2 => "k2",
            RsEstimator::K3 => "k3",
        };
        format!("{level}_{k}")
    }
}

impl FromStr for RsOption {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let unknown = || Error::UnknownName {
            what: "rollout_correction.rollout_rs option",
            got: s.to_owned(),
            valid: Self::ALL.join(", "),
        };
        let (level, k) = s.rsplit_once('_').ok_or_else(unknown)?;
        let level = match level {
            "token" => RsLevel::Token,
            "seq_sum" => RsLevel::SeqSum,
            "seq_mean" => RsLevel::SeqMean,
            "seq_max" => RsLevel::SeqMax,
            _ => return Err(unknown()),
        };
        let estimator = match k {
            "k1" if level != RsLevel::SeqMax => RsEstimator::K1,
            "k2" => RsEstimator::K2,
            "k3" => RsEstimator::K3,
            _ => return Err(unknown()),
        };
        Ok(RsOption { level, estimator })
    }
}

/// A criterion with its bounds. `k1` bounds are ratios and must both be given; the others have
/// an upper bound only.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RsRule {
    /// The criterion.
    pub option: RsOption,
    /// The lower ratio bound (`k1` only).
    pub lower: Option<f64>,
    /// The upper bound (a ratio for `k1`, a divergence otherwise).
    pub upper: f64,
}

/// Parses verl's `rollout_rs` (comma-separated, duplicates dropped, order kept) and
/// `rollout_rs_threshold` (one entry per option or one shared), with verl's rules: `k1` takes
/// `lower_upper` or an upper ratio whose reciprocal is the lower one; k2/k3 take one positive
/// upper bound.
pub fn parse_rules(rollout_rs: &str, threshold: &RsThreshold) -> Result<Vec<RsRule>> {
    const KEY: &str = "rollout_correction.rollout_rs";
    const TKEY: &str = "rollout_correction.rollout_rs_threshold";
    let mut options: Vec<RsOption> = Vec::new();
    for part in rollout_rs
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let opt: RsOption = part.parse()?;
        if !options.contains(&opt) {
            options.push(opt);
        }
    }
    if options.is_empty() {
        return Err(Error::invalid(
            KEY,
            format!(
                "{rollout_rs:?} names no option; expected some of {}",
                RsOption::ALL.join(", ")
            ),
        ));
    }
    let specs: Vec<String> = match threshold {
        // `{:?}` prints every f64 so that it parses back to itself (`2.0`, `1e-12`, `inf`)
        RsThreshold::Number(x) => vec![format!("{x:?}")],
        RsThreshold::Text(s) => s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect(),
    };
    if specs.is_empty() {
        return Err(Error::invalid(
            TKEY,
            "must contain at least one threshold value",
        ));
    }
    if specs.len() != 1 && specs.len() != options.len() {
        return Err(Error::invalid(
            TKEY,
            format!(
                "{threshold} has {} entries; expected one shared by all options or exactly {} \
                 (one per option of rollout_rs {rollout_rs:?})",
                specs.len(),
                options.len()
            ),
        ));
    }
    let number = |s: &str, opt: RsOption, spec: &str| -> Result<f64> {
        let v: f64 = s.parse().map_err(|_| {
            Error::invalid(
                TKEY,
                format!(
                    "invalid numeric threshold {spec:?} for option {}",
                    opt.name()
                ),
            )
        })?;
        if v.is_nan() || v <= 0.0 {
            return Err(Error::invalid(
                TKEY,
                format!(
                    "thresholds for option {} must be positive, got {spec:?}",
                    opt.name()
                ),
            ));
        }
        Ok(v)
    };
    options
        .iter()
        .enumerate()
        .map(|(i, &option)| {
            let spec = specs[if specs.len() == 1 { 0 } else { i }].as_str();
            if option.estimator == RsEstimator::K1 {
                let (lower, upper) = match spec.split_once('_') {
                    Some((lo, hi)) => (number(lo, option, spec)?, number(hi, option, spec)?),
                    None => {
                        let upper = number(spec, option, spec)?;
                        (1.0 / upper, upper)
                    }
                };
                Ok(RsRule {
                    option,
                    lower: Some(lower),
                    upper,
                })
            } else {
                if spec.contains('_') {
                    return Err(Error::invalid(
                        TKEY,
                        format!(
                            "option {} takes a single upper bound without '_', got {spec:?}",
                            option.name()
                        ),
                    ));
                }
                Ok(RsRule {
                    option,
                    lower: None,
                    upper: number(spec, option, spec)?,
                })
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(rs: &str, t: RsThreshold) -> Result<Vec<RsRule>> {
        parse_rules(rs, &t)
    }

    #[test]
    fn thresholds_follow_verls_rules() {
        // a number for a k1 option is the upper ratio; the lower one is its reciprocal
        let r = rules("token_k1", RsThreshold::Number(2.0)).unwrap();
        assert_eq!((r[0].lower, r[0].upper), (Some(0.5), 2.0));
        // one entry is shared; duplicates are dropped, order kept
        let r = rules(
            " seq_mean_k3, token_k2 ,seq_mean_k3",
            RsThreshold::Text("0.03".into()),
        )
        .unwrap();
        let names: Vec<String> = r.iter().map(|r| r.option.name()).collect();
        assert_eq!(names, ["seq_mean_k3", "token_k2"]);
        assert!(r.iter().all(|r| r.upper == 0.03 && r.lower.is_none()));
        let r = rules(
            "seq_sum_k1,seq_max_k2",
            RsThreshold::Text("0.2_4,0.5".into()),
        )
        .unwrap();
        assert_eq!((r[0].lower, r[0].upper, r[1].upper), (Some(0.2), 4.0, 0.5));
    }

    #[test]
    fn bad_criteria_and_thresholds_are_named() {
        let err = |rs: &str, t: RsThreshold| rules(rs, t).unwrap_err().to_string();
        let e = err("seq_max_k1", RsThreshold::Number(2.0));
        assert!(
            e.contains("unknown rollout_correction.rollout_rs option `seq_max_k1`"),
            "{e}"
        );
        assert!(e.contains("seq_max_k2"), "{e}");
        let e = err(
            "token_k1,token_k2,token_k3",
            RsThreshold::Text("1.5,2".into()),
        );
        assert!(
            e.contains("rollout_rs_threshold") && e.contains("has 2 entries"),
            "{e}"
        );
        let e = err("token_k2", RsThreshold::Text("0.1_0.2".into()));
        assert!(e.contains("single upper bound"), "{e}");
        let e = err("token_k3", RsThreshold::Number(-1.0));
        assert!(e.contains("must be positive"), "{e}");
        let e = err("token_k1", RsThreshold::Text("x_2".into()));
        assert!(e.contains("invalid numeric threshold \"x_2\""), "{e}");
        let e = err(" , ", RsThreshold::Number(1.0));
        assert!(e.contains("names no option"), "{e}");
        let cfg = RolloutCorrectionConfig {
            rollout_rs: Some("token_k2".into()),
            ..RolloutCorrectionConfig::default()
        };
        let e = cfg.validate().unwrap_err().to_string();
        assert!(
            e.contains("rollout_rs_threshold") && e.contains("must be set"),
            "{e}"
        );
        let cfg = RolloutCorrectionConfig {
            rollout_rs_threshold: Some(RsThreshold::Number(2.0)),
            ..RolloutCorrectionConfig::default()
        };
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("rollout_rs is not")
        );
    }

    #[test]
    fn the_config_reads_verls_spellings() {
        let cfg: RolloutCorrectionConfig = serde_json::from_value(serde_json::json!({
            "rollout_is": "sequence",
            "rollout_rs": "token_k1,seq_max_k3",
            "rollout_rs_threshold": "0.5_2.0,0.3",
            "bypass_mode": true,
            "loss_type": "reinforce",
        }))
        .unwrap();
        assert_eq!(cfg.rollout_is, Some(IsLevel::Sequence));
        assert_eq!(cfg.loss_type, BypassLossType::Reinforce);
        assert!(cfg.enabled() && cfg.validate().is_ok());
        let cfg: RolloutCorrectionConfig = serde_json::from_value(
            serde_json::json!({"rollout_rs": "token_k3", "rollout_rs_threshold": 2}),
        )
        .unwrap();
        assert_eq!(cfg.rules().unwrap()[0].upper, 2.0);
        assert!(
            serde_json::from_value::<RolloutCorrectionConfig>(
                serde_json::json!({"rollout_is": "tokens"})
            )
            .is_err()
        );
    }
}
