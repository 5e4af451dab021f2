//! Loss aggregation (verl's `agg_loss`), with global normalisers for micro-batch accumulation.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::check;
use crate::error::{Error, Result};
use crate::masked;

/// How a loss matrix becomes a scalar (verl's `loss_agg_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum LossAggMode {
    /// Mean over every unmasked token of the batch.
    #[default]
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Sum over the tokens of each sequence, mean over the non-empty sequences.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Mean over the tokens of each sequence, mean over the non-empty sequences.
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Sum over all tokens divided by a constant (`loss_scale_factor`, by default the
    /// response length), as in Dr. GRPO.
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    /// Every mode, in verl's order.
    pub const ALL: [LossAggMode; 4] = [
        LossAggMode::TokenMean,
        LossAggMode::SeqMeanTokenSum,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ];

    /// verl's config string for this mode.
    pub fn as_str(self) -> &'static str {
        match self {
            LossAggMode::TokenMean => "token-mean",
            LossAggMode::SeqMeanTokenSum => "seq-mean-token-sum",
            LossAggMode::SeqMeanTokenMean => "seq-mean-token-mean",
            LossAggMode::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }
}

impl fmt::Display for LossAggMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LossAggMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| Error::UnknownName {
                what: "loss_agg_mode",
                got: s.to_owned(),
                valid: Self::ALL.map(Self::as_str).join(", "),
            })
    }
}

/// The normalisers of one optimiser step, verl's `global_batch_info`.
///
/// With [`GlobalBatchInfo::local`] (every field `None`, `dp_size` 1) each call normalises by
/// its own micro-batch, which is verl's behaviour without global info.
/// With the counts of the whole mini-batch (see [`GlobalBatchInfo::from_mini_batch`]) the
/// losses of its micro-batches add up to the loss of the whole mini-batch, so accumulating
/// their gradients gives the gradient of the whole.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GlobalBatchInfo {
    /// Data-parallel world size; the loss is multiplied by it because the gradients of the
    /// ranks are averaged. At least 1. Ignored by `seq-mean-token-sum-norm`, as in verl.
    pub dp_size: i64,
    /// Unmasked tokens in the global mini-batch (all ranks), for `token-mean`.
    pub batch_num_tokens: Option<f64>,
    /// Sequences in the global mini-batch (all ranks), for the `seq-mean-*` modes.
    pub global_batch_size: Option<f64>,
    /// Divisor of `seq-mean-token-sum-norm`; `None` means the response length.
    pub loss_scale_factor: Option<f64>,
}

impl Default for GlobalBatchInfo {
    fn default() -> Self {
        Self::local()
    }
}

impl GlobalBatchInfo {
    /// No global information: normalise by the micro-batch itself (verl's default).
    pub fn local() -> Self {
        GlobalBatchInfo {
            dp_size: 1,
            batch_num_tokens: None,
            global_batch_size: None,
            loss_scale_factor: None,
        }
    }

    /// The counts of a whole (single-rank) mini-batch: its unmasked tokens and its non-empty
    /// sequences, so that every mode of [`aggregate`] summed over micro-batches equals the
    /// whole mini-batch aggregated locally.
    ///
    /// verl's new engine sets `global_batch_size` to `ppo_mini_batch_size * rollout.n`, every
    /// sequence including empty ones; the two agree when no response is empty.
    ///
    /// # Shapes
    /// - `response_mask`: `[batch, response_len]` of the whole mini-batch, binary
    pub fn from_mini_batch(response_mask: &Tensor) -> Result<Self> {
        rl_core::shape::expect_2d("response_mask", response_mask)?;
        check::binary("response_mask", response_mask)?;
        let m = response_mask.to_kind(Kind::Double);
        let tokens = m.sum(None::<Kind>).double_value(&[]);
        let seqs = m
            .sum_dim_intlist([1].as_slice(), false, None::<Kind>)
            .gt(0.0);
        let seqs = seqs
            .to_kind(Kind::Double)
            .sum(None::<Kind>)
            .double_value(&[]);
        Ok(GlobalBatchInfo {
            batch_num_tokens: Some(tokens),
            global_batch_size: Some(seqs),
            ..Self::local()
        })
    }

    fn check(&self) -> Result<()> {
        if self.dp_size < 1 {
            return Err(Error::invalid(
                "dp_size",
                format!("must be at least 1, got {}", self.dp_size),
            ));
        }
        for (name, v) in [
            ("batch_num_tokens", self.batch_num_tokens),
            ("global_batch_size", self.global_batch_size),
            ("loss_scale_factor", self.loss_scale_factor),
        ] {
            if let Some(v) = v
                && !(v > 0.0 && v.is_finite())
            {
                return Err(Error::invalid(
                    name,
                    format!("must be positive and finite, got {v}"),
                ));
            }
        }
        Ok(())
    }
}

/// Aggregates a loss matrix into a scalar, matching `verl.trainer.ppo.core_algos.agg_loss`.
///
/// - `token-mean`: `masked_sum(loss) / batch_num_tokens * dp_size`
/// - `seq-mean-token-sum`: per-sequence token sums, summed over non-empty sequences,
///   `/ global_batch_size * dp_size`
/// - `seq-mean-token-mean`: per-sequence `token_sum / (tokens + 1e-8)`, likewise
/// - `seq-mean-token-sum-norm`: `sum(loss * mask) / loss_scale_factor`
///
/// Each missing normaliser falls back to this micro-batch's own count, as in verl; with
/// local counts an all-empty mask gives NaN for the mean modes, as in verl.
/// Values at masked positions never reach the result or its gradient, even when they are
/// NaN or infinite (verl multiplies by the mask, so there a NaN would leak).
///
/// # Shapes
/// - `loss_mat`: `[batch, response_len]` float
/// - `loss_mask`: `[batch, response_len]`; bool, integer or float, binary
/// - returns: a scalar of `loss_mat`'s dtype
pub fn aggregate(
    loss_mat: &Tensor,
    loss_mask: &Tensor,
    mode: LossAggMode,
    info: &GlobalBatchInfo,
) -> Result<Tensor> {
    check::float(
        "loss_mat",
        loss_mat,
        &[
            rl_core::shape::Dim::Any("batch"),
            rl_core::shape::Dim::Any("response_len"),
        ],
    )?;
    let mask = check::mask("loss_mask", loss_mask, "loss_mat", loss_mat)?;
    info.check()?;
    Ok(aggregate_(loss_mat, &mask, mode, info))
}

/// [`aggregate`] on checked inputs (mask already in the loss's dtype).
pub(crate) fn aggregate_(
    loss_mat: &Tensor,
    mask: &Tensor,
    mode: LossAggMode,
    info: &GlobalBatchInfo,
) -> Tensor {
    let dp = info.dp_size as f64;
    let row_sum = |x: &Tensor| x.sum_dim_intlist([-1].as_slice(), false, None::<Kind>);
    match mode {
        LossAggMode::TokenMean => {
            let total = masked::sum_(loss_mat, mask, None);
            match info.batch_num_tokens {
                Some(n) => total / n * dp,
                None => total / mask.sum(None::<Kind>) * dp,
            }
        }
        LossAggMode::SeqMeanTokenSum | LossAggMode::SeqMeanTokenMean => {
            let tokens = row_sum(mask);
            let token_sums = masked::sum_(loss_mat, mask, Some(-1));
            let seq_losses = match mode {
                LossAggMode::SeqMeanTokenMean => token_sums / (&tokens + 1e-8),
                _ => token_sums,
            };
            // exclude fully masked sequences
            let seq_mask = tokens.gt(0.0).to_kind(loss_mat.kind());
            let total = masked::sum_(&seq_losses, &seq_mask, None);
            match info.global_batch_size {
                Some(n) => total / n * dp,
                None => total / seq_mask.sum(None::<Kind>) * dp,
            }
        }
        LossAggMode::SeqMeanTokenSumNorm => {
            let total = masked::sum_(loss_mat, mask, Some(-1)).sum(None::<Kind>);
            let scale = info.loss_scale_factor.unwrap_or(loss_mat.size()[1] as f64);
            total / scale
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_names_round_trip_and_unknown_names_list_the_valid_ones() {
        for m in LossAggMode::ALL {
            assert_eq!(m.as_str().parse::<LossAggMode>().unwrap(), m);
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, format!("\"{}\"", m.as_str()));
            assert_eq!(serde_json::from_str::<LossAggMode>(&json).unwrap(), m);
        }
        let err = "token_mean".parse::<LossAggMode>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown loss_agg_mode `token_mean`; expected one of: token-mean, seq-mean-token-sum, \
             seq-mean-token-mean, seq-mean-token-sum-norm"
        );
        let err = serde_json::from_str::<LossAggMode>("\"sum\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("token-mean"), "{err}");
    }

    #[test]
    fn bad_normalisers_are_errors() {
        let x = Tensor::ones([2, 3], (Kind::Double, tch::Device::Cpu));
        let info = GlobalBatchInfo {
            dp_size: 0,
            ..GlobalBatchInfo::local()
        };
        assert!(aggregate(&x, &x, LossAggMode::TokenMean, &info).is_err());
        let info = GlobalBatchInfo {
            batch_num_tokens: Some(0.0),
            ..GlobalBatchInfo::local()
        };
        let err = aggregate(&x, &x, LossAggMode::TokenMean, &info).unwrap_err();
        assert!(err.to_string().contains("batch_num_tokens"));
        assert!(
            aggregate(
                &x,
                &x.narrow(1, 0, 2),
                LossAggMode::TokenMean,
                &GlobalBatchInfo::local()
            )
            .is_err()
        );
    }
}
