//! DAPO's pieces: overlong reward shaping and the dynamic-sampling group filter.
//!
//! They match `verl/workers/reward_manager/dapo.py` and verl-recipe's `dapo/dapo_ray_trainer.py`.

use rl_core::shape::Dim;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::check;
use crate::error::{Error, Result};

/// verl's `reward_model.overlong_buffer`: a soft penalty for responses that run into the last
/// `len` tokens before `max_response_length`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OverlongBufferConfig {
    /// Apply the penalty. Default false.
    pub enable: bool,
    /// Tokens of the buffer, positive when enabled and at most the maximum response length.
    /// Default 0.
    pub len: i64,
    /// The penalty at the maximum length (it grows linearly over the buffer). Default 0.
    pub penalty_factor: f64,
    /// Log `overlong_reward` and `overlong` per response. Default false.
    pub log: bool,
}

impl Default for OverlongBufferConfig {
    fn default() -> Self {
        OverlongBufferConfig {
            enable: false,
            len: 0,
            penalty_factor: 0.0,
            log: false,
        }
    }
}

/// The overlong penalty of each response, matching the shaping in verl's `DAPORewardManager`:
/// `min(-(length - (max_resp_len - len)) / len * penalty_factor, 0)`, computed in f32 as verl
/// does. Zero everywhere when the buffer is not enabled.
///
/// # Shapes
/// - `response_lengths`: `[batch]` integer or float, the number of response tokens
/// - returns: `[batch]` f32, at most 0
pub fn overlong_penalty(
    response_lengths: &Tensor,
    max_resp_len: i64,
    cfg: &OverlongBufferConfig,
) -> Result<Tensor> {
    check_lengths(response_lengths)?;
    let lengths = response_lengths.to_kind(Kind::Float);
    if !cfg.enable {
        return Ok(lengths.zeros_like());
    }
    if cfg.len <= 0 {
        return Err(Error::invalid(
            "overlong_buffer.len",
            format!("must be positive when enabled, got {}", cfg.len),
        ));
    }
    if max_resp_len < cfg.len {
        return Err(Error::invalid(
            "overlong_buffer.len",
            format!(
                "max_resp_len ({max_resp_len}) must be at least overlong_buffer.len ({})",
                cfg.len
            ),
        ));
    }
    let expected_len = (max_resp_len - cfg.len) as f64;
    let exceed_len = lengths - expected_len;
    Ok((-exceed_len / cfg.len as f64 * cfg.penalty_factor).clamp_max(0.0))
}

/// Adds the [`overlong_penalty`] to each response's last token, where verl's DAPO reward manager
/// puts `score + overlong_reward`; returns the shaped scores and the penalties.
///
/// # Shapes
/// - `token_level_scores`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary, each row's ones first
/// - returns: `([batch, response_len], [batch])`
pub fn apply_overlong_penalty(
    token_level_scores: &Tensor,
    response_mask: &Tensor,
    max_resp_len: i64,
    cfg: &OverlongBufferConfig,
) -> Result<(Tensor, Tensor)> {
    check::float(
        "token_level_scores",
        token_level_scores,
        &[Dim::Any("batch"), Dim::Any("response_len")],
    )?;
    let mask = check::mask(
        "response_mask",
        response_mask,
        "token_level_scores",
        token_level_scores,
    )?;
    let lengths = mask.sum_dim_intlist([-1].as_slice(), false, Kind::Int64);
    let penalty = overlong_penalty(&lengths, max_resp_len, cfg)?;
    // the last response token; an empty response has no penalty (its length is below the buffer)
    let last = (&lengths - 1).clamp_min(0).unsqueeze(-1);
    let add =
        penalty.to_kind(token_level_scores.kind()).unsqueeze(-1) * lengths.gt(0).unsqueeze(-1);
    let shaped = token_level_scores.scatter_add(1, &last, &add);
    Ok((shaped, penalty))
}

fn check_lengths(response_lengths: &Tensor) -> Result<()> {
    rl_core::shape::expect_dims("response_lengths", response_lengths, &[Dim::Any("batch")])?;
    rl_core::shape::expect_kind(
        "response_lengths",
        response_lengths,
        &[Kind::Int64, Kind::Int, Kind::Float, Kind::Double],
    )?;
    Ok(())
}

/// Which rows survive DAPO's dynamic sampling.
#[derive(Debug)]
pub struct GroupFilter {
    /// `[batch]` bool: true for the rows of kept groups.
    pub keep: Tensor,
    /// How many groups (prompts) were kept.
    pub kept_groups: i64,
}

/// DAPO's dynamic-sampling filter, matching the `filter_groups` step of verl-recipe's
/// `RayDAPOTrainer.fit`: a group (prompt) is kept when its metric varies or when it has a single
/// response; groups where every response scored the same carry no GRPO signal and are dropped.
///
/// "Varies" is exact here (some value differs); verl tests `np.std(values) > 0`, which agrees
/// except that rounding can make the std of identical non-dyadic values (three times 0.1) a
/// tiny positive number, keeping a group verl's intent drops.
///
/// # Shapes
/// - `metric`: `[batch]` float, e.g. each response's summed `token_level_rewards`
/// - `index`: `[batch]` int64 group ids
/// - returns: `keep`, `[batch]` bool
pub fn filter_groups(metric: &Tensor, index: &Tensor) -> Result<GroupFilter> {
    let size = check::float("metric", metric, &[Dim::Any("batch")])?;
    let groups = check::groups("index", index, size[0], metric.kind())?;
    let varies = groups.max(metric).ne_tensor(&groups.min(metric));
    let kept = varies.logical_or(&groups.counts.eq(1.0));
    let kept_groups = kept.sum(Kind::Int64).int64_value(&[]);
    Ok(GroupFilter {
        keep: groups.rows(&kept),
        kept_groups,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_penalty_ramps_over_the_buffer() {
        let cfg = OverlongBufferConfig {
            enable: true,
            len: 4,
            penalty_factor: 1.0,
            log: false,
        };
        let lengths = Tensor::from_slice(&[0i64, 6, 7, 8, 10]);
        let p = overlong_penalty(&lengths, 10, &cfg).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&p).unwrap(),
            vec![0.0, 0.0, -0.25, -0.5, -1.0]
        );
        let bad = OverlongBufferConfig { len: 11, ..cfg };
        assert!(overlong_penalty(&lengths, 10, &bad).is_err());
    }

    #[test]
    fn constant_groups_are_dropped_and_singletons_kept() {
        let metric = Tensor::from_slice(&[1.0f64, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0]);
        let index = Tensor::from_slice(&[7i64, 7, 3, 3, 9, 4, 4]);
        let f = filter_groups(&metric, &index).unwrap();
        assert_eq!(
            Vec::<bool>::try_from(&f.keep).unwrap(),
            vec![false, false, true, true, true, false, false]
        );
        assert_eq!(f.kept_groups, 2);
    }
}
