//! Per-token log-probabilities of given tokens and entropies, from logits.
//!
//! They match `verl/utils/torch_functional.py` and run in row chunks, so no full-vocabulary
//! temporary of the whole batch (and never a float64 copy) is made.

use rl_core::shape;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// Elements of the `[rows, vocab]` temporaries made at once (128 MiB of f32).
const CHUNK_ELEMS: i64 = 1 << 25;

/// Log-probabilities of `labels` under `logits`, matching
/// `verl.utils.torch_functional.logprobs_from_logits` (its `logprobs_from_logits_v2` path,
/// taken when flash-attn is absent): `logit[label] - logsumexp(logits)` for f32/f64, and a
/// per-chunk `log_softmax` in the logits' own dtype for bf16/f16.
///
/// The result keeps the logits' dtype and is differentiable with respect to `logits`.
///
/// # Shapes
/// - `logits`: `[..., vocab]` float (typically `[batch, response_len, vocab]`)
/// - `labels`: `[...]` int64, the leading dims of `logits`, each in `0..vocab`
/// - returns: `[...]`, the dtype of `logits`
pub fn log_probs(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let (lead, vocab) = leading(logits)?;
    shape::expect_kind("labels", labels, &[Kind::Int64])?;
    if labels.size() != lead {
        return Err(rl_core::Error::Shape {
            key: "labels".into(),
            expected: format!("{lead:?} (the leading dims of `logits`)"),
            got: labels.size(),
        }
        .into());
    }
    if labels.numel() > 0 {
        let (lo, hi) = (labels.min().int64_value(&[]), labels.max().int64_value(&[]));
        if lo < 0 || hi >= vocab {
            let bad = if lo < 0 { lo } else { hi };
            return Err(Error::invalid(
                "labels",
                format!("token id {bad} is outside 0..{vocab}"),
            ));
        }
    }
    let flat = logits.reshape([-1, vocab]);
    let flat_labels = labels.reshape([-1, 1]);
    let rows = flat.size()[0];
    let chunk = (CHUNK_ELEMS / vocab.max(1)).max(1);
    let wide = matches!(logits.kind(), Kind::Float | Kind::Double);
    let mut parts = Vec::new();
    let mut start = 0;
    while start < rows {
        let len = chunk.min(rows - start);
        let x = flat.narrow(0, start, len);
        let y = flat_labels.narrow(0, start, len);
        let part = if wide {
            // log_softmax(x)_i = x_i - logsumexp(x)
            x.gather(1, &y, false).squeeze_dim(1) - x.logsumexp([1].as_slice(), false)
        } else {
            // logsumexp is unstable in bf16; verl falls back to log_softmax there too.
            x.log_softmax(1, None::<Kind>)
                .gather(1, &y, false)
                .squeeze_dim(1)
        };
        parts.push(part);
        start += len;
    }
    let out = if parts.is_empty() {
        Tensor::zeros([0], (logits.kind(), logits.device()))
    } else {
        Tensor::cat(&parts, 0)
    };
    Ok(out.reshape(lead.as_slice()))
}

/// Entropy of the categorical distribution given by `logits`, matching
/// `verl.utils.torch_functional.entropy_from_logits`:
/// `logsumexp(logits) - sum(softmax(logits) * logits)`.
///
/// Computed in row chunks in the logits' dtype; differentiable with respect to `logits`.
///
/// # Shapes
/// - `logits`: `[..., vocab]` float
/// - returns: `[...]`, the dtype of `logits`
pub fn entropy(logits: &Tensor) -> Result<Tensor> {
    let (lead, vocab) = leading(logits)?;
    let flat = logits.reshape([-1, vocab]);
    let rows = flat.size()[0];
    let chunk = (CHUNK_ELEMS / vocab.max(1)).max(1);
    let mut parts = Vec::new();
    let mut start = 0;
    while start < rows {
        let x = flat.narrow(0, start, chunk.min(rows - start));
        let pd = x.softmax(1, None::<Kind>);
        let h = x.logsumexp([1].as_slice(), false)
            - (pd * &x).sum_dim_intlist([1].as_slice(), false, None::<Kind>);
        parts.push(h);
        start += chunk;
    }
    let out = if parts.is_empty() {
        Tensor::zeros([0], (logits.kind(), logits.device()))
    } else {
        Tensor::cat(&parts, 0)
    };
    Ok(out.reshape(lead.as_slice()))
}

fn leading(logits: &Tensor) -> Result<(Vec<i64>, i64)> {
    shape::expect_float("logits", logits)?;
    let mut size = logits.size();
    let Some(vocab) = size.pop() else {
        return Err(rl_core::Error::Shape {
            key: "logits".into(),
            expected: "[..., vocab]".into(),
            got: vec![],
        }
        .into());
    };
    if vocab == 0 {
        return Err(Error::invalid("logits", "the vocab dimension is empty"));
    }
    Ok((size, vocab))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probs_match_log_softmax_and_chunking_is_invisible() {
        tch::manual_seed(0);
        let logits = Tensor::randn([3, 5, 7], (Kind::Double, tch::Device::Cpu));
        let labels = Tensor::randint(7, [3, 5], (Kind::Int64, tch::Device::Cpu));
        let got = log_probs(&logits, &labels).unwrap();
        let want = logits
            .log_softmax(-1, None::<Kind>)
            .gather(-1, &labels.unsqueeze(-1), false);
        assert!(got.allclose(&want.squeeze_dim(-1), 1e-12, 1e-12, false));
        let h = entropy(&logits).unwrap();
        let p = logits.softmax(-1, None::<Kind>);
        let want = -(&p * p.log()).sum_dim_intlist([-1].as_slice(), false, None::<Kind>);
        assert!(h.allclose(&want, 1e-10, 1e-10, false));
    }

    #[test]
    fn bad_labels_are_errors() {
        let logits = Tensor::zeros([2, 4], (Kind::Float, tch::Device::Cpu));
        let labels = Tensor::from_slice(&[0i64, 4]);
        let err = log_probs(&logits, &labels).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid argument `labels`: token id 4 is outside 0..4"
        );
        assert!(log_probs(&logits, &Tensor::from_slice(&[0i64, 1, 2])).is_err());
        assert!(log_probs(&logits, &Tensor::from_slice(&[0i32, 1])).is_err());
    }
}
