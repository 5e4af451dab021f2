//! Micro-batching (fixed rows or verl's dynamic token budget), padding removal, and the
//! forward that gives response log-probs, entropies or values for one micro-batch.

use rl_core::roles::{LogProbExtras, Metrics, MiniBatchInfo};
use rl_core::{Batch, keys};
use tch::{Kind, Tensor};

use crate::heads::{CausalLm, ValueModel};
use crate::roles::role_err;

/// One micro-batch and the rows of the parent batch it holds, in order.
pub(crate) struct Micro {
    pub(crate) batch: Batch,
    pub(crate) rows: Vec<i64>,
}

/// Real tokens per row (`attention_mask` summed).
fn row_tokens(batch: &Batch) -> rl_core::Result<Vec<i64>> {
    let am = batch.get(keys::ATTENTION_MASK)?;
    Ok(Vec::<i64>::try_from(am.sum_dim_intlist(
        [1].as_slice(),
        false,
        Kind::Int64,
    ))?)
}

/// Balanced partitions of rows with token counts `lens` into the fewest parts whose sums stay
/// within `budget` (a row larger than the budget gets a part of its own), as verl's
/// `rearrange_micro_batches`: `k = ceil(total / budget)` parts filled longest-first into the
/// lightest part, `k` grown until every part fits. Each part lists its rows in ascending order.
pub fn token_balanced_partitions(lens: &[i64], budget: i64) -> Vec<Vec<i64>> {
    let total: i64 = lens.iter().sum();
    let budget = budget.max(1);
    let mut k = ((total + budget - 1) / budget).max(1) as usize;
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by(|&a, &b| lens[b].cmp(&lens[a]).then(a.cmp(&b)));
    loop {
        let k_now = k.min(lens.len().max(1));
        let mut parts: Vec<(i64, Vec<i64>)> = vec![(0, Vec::new()); k_now];
        for &i in &order {
            let lightest = (0..k_now).min_by_key(|&p| (parts[p].0, p)).unwrap_or(0);
            parts[lightest].0 += lens[i];
            parts[lightest].1.push(i as i64);
        }
        let fits = parts
            .iter()
            .all(|(sum, rows)| *sum <= budget || rows.len() <= 1);
        if fits || k_now >= lens.len() {
            let mut out: Vec<Vec<i64>> = parts
                .into_iter()
                .map(|(_, mut rows)| {
                    rows.sort_unstable();
                    rows
                })
                .filter(|r| !r.is_empty())
                .collect();
            out.sort_by_key(|r| r[0]);
            return out;
        }
        k += 1;
    }
}

/// Splits `batch` into micro-batches: by `max_tokens` when set (dynamic batch size), else in
/// consecutive groups of `rows` (the whole batch when `None`).
pub(crate) fn split(
    batch: &Batch,
    rows: Option<usize>,
    max_tokens: Option<usize>,
) -> rl_core::Result<Vec<Micro>> {
    let len = batch.len();
    if let Some(budget) = max_tokens {
        let parts = token_balanced_partitions(&row_tokens(batch)?, budget as i64);
        return parts
            .into_iter()
            .map(|rows| {
                Ok(Micro {
                    batch: batch.reorder(&rows)?,
                    rows,
                })
            })
            .collect();
    }
    let size = rows.unwrap_or(len).clamp(1, len.max(1));
    let mut out = Vec::new();
    let mut start = 0;
    while start < len {
        let end = (start + size).min(len);
        out.push(Micro {
            batch: batch.slice(start..end)?,
            rows: (start as i64..end as i64).collect(),
        });
        start = end;
    }
    Ok(out)
}

/// Puts per-micro-batch outputs (`[micro_rows, ...]`) back into the parent's row order.
pub(crate) fn reassemble(parts: &[Tensor], rows: &[Vec<i64>]) -> Tensor {
    let cat = Tensor::cat(parts, 0);
    let order: Vec<i64> = rows.iter().flatten().copied().collect();
    let mut inverse = vec![0i64; order.len()];
    for (pos, &r) in order.iter().enumerate() {
        inverse[r as usize] = pos as i64;
    }
    cat.index_select(0, &Tensor::from_slice(&inverse).to_device(cat.device()))
}

/// The mini-batch's normalisers: response tokens the loss reads ([`keys::policy_mask`]: not
/// multi-turn observations) and sequences with at least one.
pub(crate) fn mini_batch_info(mini: &Batch) -> rl_core::Result<MiniBatchInfo> {
    let mask = keys::policy_mask(mini)?.to_kind(Kind::Double);
    let tokens = mask.sum(Kind::Double).double_value(&[]);
    let sequences = mask
        .sum_dim_intlist([1].as_slice(), false, Kind::Double)
        .gt(0.0)
        .to_kind(Kind::Double)
        .sum(Kind::Double)
        .double_value(&[]);
    Ok(MiniBatchInfo { tokens, sequences })
}

/// A micro-batch with the all-padding columns removed: leading prompt columns that are padding
/// in every row and trailing response columns past every row's end.
struct Trimmed {
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    /// Index in the trimmed sequence of the hidden state that predicts response token 0.
    first: i64,
    /// Response columns kept.
    keep: i64,
    /// The full response width.
    response_len: i64,
}

/// # Shapes
/// - `input_ids`, `attention_mask`, `position_ids`: `[batch, prompt_len + response_len]` i64
/// - `responses`: `[batch, response_len]` i64; `response_mask`: `[batch, response_len]` f32
fn trim(micro: &Batch) -> rl_core::Result<Trimmed> {
    let input_ids = micro.get(keys::INPUT_IDS)?;
    let (batch, seq_len) = rl_core::shape::expect_2d(keys::INPUT_IDS, input_ids)?;
    let responses = micro.get(keys::RESPONSES)?;
    rl_core::shape::expect_dims(
        keys::RESPONSES,
        responses,
        &[
            rl_core::shape::Dim::Is(batch),
            rl_core::shape::Dim::Any("response_len"),
        ],
    )?;
    let response_len = responses.size()[1];
    let prompt_len = seq_len - response_len;
    if prompt_len < 1 {
        return Err(rl_core::Error::InvalidArgument {
            name: "input_ids",
            reason: format!(
                "{seq_len} columns cannot hold a prompt and {response_len} response tokens"
            ),
        });
    }
    let attention_mask = micro.get(keys::ATTENTION_MASK)?;
    let position_ids = micro.get(keys::POSITION_IDS)?;
    let response_mask = micro.get(keys::RESPONSE_MASK)?;
    let used = Vec::<bool>::try_from(attention_mask.ne(0).any_dim(0, false))?;
    let lead = used[..(prompt_len - 1) as usize]
        .iter()
        .position(|&u| u)
        .unwrap_or((prompt_len - 1) as usize) as i64;
    let resp_used = Vec::<bool>::try_from(response_mask.ne(0.0).any_dim(0, false))?;
    let keep = resp_used
        .iter()
        .rposition(|&u| u)
        .map_or(1, |i| i as i64 + 1);
    let width = prompt_len - lead + keep;
    Ok(Trimmed {
        input_ids: input_ids.narrow(1, lead, width),
        attention_mask: attention_mask.narrow(1, lead, width),
        position_ids: position_ids.narrow(1, lead, width),
        responses: responses.narrow(1, 0, keep),
        response_mask: response_mask.shallow_clone(),
        first: prompt_len - lead - 1,
        keep,
        response_len,
    })
}

/// Pads `[batch, keep]` back to `[batch, response_len]` with zeros and masks it.
fn pad_back(t: Tensor, tr: &Trimmed) -> Tensor {
    let b = t.size()[0];
    let t = if tr.keep < tr.response_len {
        let zeros = Tensor::zeros([b, tr.response_len - tr.keep], (t.kind(), t.device()));
        Tensor::cat(&[&t, &zeros], 1)
    } else {
        t
    };
    t * tr.response_mask.to_kind(Kind::Float)
}

/// Log-probs of `responses` (and per-token entropy) under `lm`, logits divided by
/// `temperature`, zero at masked positions. Gradients flow when the caller allows them.
///
/// # Shapes
/// - `micro`: `input_ids`, `attention_mask`, `position_ids` `[batch, seq_len]`, `responses`,
///   `response_mask` `[batch, response_len]`
/// - returns `([batch, response_len], Option<[batch, response_len]>)` f32
pub(crate) fn log_probs(
    lm: &CausalLm,
    micro: &Batch,
    temperature: f64,
    with_entropy: bool,
) -> rl_core::Result<(Tensor, Option<Tensor>)> {
    let extras = LogProbExtras {
        entropy: with_entropy,
        sum_pi_squared: false,
    };
    let out = log_probs_with(lm, micro, temperature, extras)?;
    Ok((out.log_prob, out.entropy))
}

/// What [`log_probs_with`] returns, each `[batch, response_len]` f32, zero at masked positions.
pub(crate) struct LogProbOutputs {
    pub(crate) log_prob: Tensor,
    pub(crate) entropy: Option<Tensor>,
    pub(crate) sum_pi_squared: Option<Tensor>,
}

/// [`log_probs`] with the extras asked for: entropy, and `Σπ²` over the vocabulary
/// (verl's `calculate_sum_pi_squared_from_logits`, `exp(logsumexp(2 logits) − 2 logsumexp(logits))`
/// of the temperature-scaled logits).
pub(crate) fn log_probs_with(
    lm: &CausalLm,
    micro: &Batch,
    temperature: f64,
    extras: LogProbExtras,
) -> rl_core::Result<LogProbOutputs> {
    let tr = trim(micro)?;
    let device = lm.device();
    let hidden = lm
        .model()
        .forward(
            &tr.input_ids.to_device(device),
            &tr.attention_mask.to_device(device),
            &tr.position_ids.to_device(device),
            None,
        )
        .map_err(role_err("actor"))?;
    // [batch, seq_len, hidden] -> [batch, keep, hidden]: the states predicting response tokens
    let hidden = hidden.narrow(1, tr.first, tr.keep);
    let mut logits = lm.logits(&hidden).to_kind(Kind::Float);
    if temperature != 1.0 {
        logits /= temperature;
    }
    let log_softmax = logits.log_softmax(-1, Kind::Float);
    let lp = log_softmax
        .gather(-1, &tr.responses.to_device(device).unsqueeze(-1), false)
        .squeeze_dim(-1);
    let entropy = extras.entropy.then(|| {
        let p = log_softmax.exp();
        -(p * &log_softmax).sum_dim_intlist([-1].as_slice(), false, Kind::Float)
    });
    let sum_pi_squared = extras.sum_pi_squared.then(|| sum_pi_squared(&logits));
    let back = |t: Tensor| pad_back(t.to_device(tr.response_mask.device()), &tr);
    Ok(LogProbOutputs {
        log_prob: back(lp),
        entropy: entropy.map(back),
        sum_pi_squared: sum_pi_squared.map(back),
    })
}

/// `Σπ²` per position of `[..., vocab]` logits as `exp(logsumexp(2x) − 2 logsumexp(x))`, in
/// row chunks of at most [`SUM_PI_SQUARED_CHUNK`] elements so the temporaries stay bounded;
/// no gradient (the optimal token baseline reads it as data).
fn sum_pi_squared(logits: &Tensor) -> Tensor {
    sum_pi_squared_chunked(logits, SUM_PI_SQUARED_CHUNK)
}

fn sum_pi_squared_chunked(logits: &Tensor, chunk_elems: i64) -> Tensor {
    let _guard = tch::no_grad_guard();
    let mut size = logits.size();
    let vocab = size.pop().unwrap_or(1).max(1);
    let flat = logits.reshape([-1, vocab]);
    let rows = flat.size()[0];
    let chunk = (chunk_elems / vocab).max(1);
    let parts: Vec<Tensor> = (0..rows)
        .step_by(chunk as usize)
        .map(|start| {
            let x = flat.narrow(0, start, chunk.min(rows - start));
            let lse = x.logsumexp([-1].as_slice(), false);
            ((&x * 2.0).logsumexp([-1].as_slice(), false) - lse * 2.0).exp()
        })
        .collect();
    if parts.is_empty() {
        return Tensor::zeros(size.as_slice(), (logits.kind(), logits.device()));
    }
    Tensor::cat(&parts, 0).reshape(size.as_slice())
}

/// Elements of the `[rows, vocab]` temporaries of [`sum_pi_squared`] made at once (64 MiB of f32).
const SUM_PI_SQUARED_CHUNK: i64 = 1 << 24;

/// Values of the states before each response token (verl's `values[:, -response_len - 1:-1]`),
/// zero at masked positions.
///
/// # Shapes
/// - as [`log_probs`]; returns `[batch, response_len]` f32
pub(crate) fn values(critic: &ValueModel, micro: &Batch) -> rl_core::Result<Tensor> {
    let tr = trim(micro)?;
    let device = critic.var_store().device();
    let v = critic
        .forward(
            &tr.input_ids.to_device(device),
            &tr.attention_mask.to_device(device),
            &tr.position_ids.to_device(device),
        )
        .map_err(role_err("critic"))?;
    let v = v
        .narrow(1, tr.first, tr.keep)
        .to_device(tr.response_mask.device());
    Ok(pad_back(v, &tr))
}

/// Folds one mini-batch's micro-batch metrics: keys ending in `loss` are shares of the
/// mini-batch loss and are summed; every other key is averaged.
pub(crate) fn fold_micro_metrics(micro: &Metrics, into: &mut Metrics) {
    for key in micro.mean().keys() {
        let vs = micro.values(key);
        let v = if key.ends_with("loss") {
            vs.iter().sum::<f64>()
        } else {
            vs.iter().sum::<f64>() / vs.len() as f64
        };
        into.push(key.clone(), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// verl's `calculate_sum_pi_squared_from_logits` on the cases of rl-algos' `otb` fixture
    /// (made from verl's function), in float64 and float32, through the chunked version with
    /// one-row chunks too.
    #[test]
    fn sum_pi_squared_matches_verl() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../rl-algos/tests/fixtures/otb.safetensors");
        let t: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&path)
            .unwrap()
            .into_iter()
            .collect();
        for (case, kind, rtol) in [
            ("sum_pi_squared", Kind::Double, 1e-12),
            ("sum_pi_squared/f32", Kind::Float, 1e-5),
        ] {
            let logits = t[&format!("{case}/logits")].to_kind(kind);
            let want = &t[&format!("{case}/sum_pi_squared")];
            let got = sum_pi_squared(&logits).to_kind(Kind::Double);
            assert!(
                got.allclose(want, rtol, 1e-12, false),
                "{case}: {got} vs {want}"
            );
            let vocab = logits.size()[2];
            let one_row = sum_pi_squared_chunked(&logits, vocab).to_kind(Kind::Double);
            assert!(
                one_row.allclose(&got, 0.0, 0.0, false),
                "{case}: chunking changed it"
            );
        }
    }

    #[test]
    fn partitions_respect_the_budget_and_cover_every_row() {
        let lens = [5i64, 3, 8, 2, 7, 1, 4];
        let parts = token_balanced_partitions(&lens, 10);
        let mut seen: Vec<i64> = parts.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..7).collect::<Vec<_>>());
        for p in &parts {
            assert!(
                p.iter().map(|&i| lens[i as usize]).sum::<i64>() <= 10,
                "{parts:?}"
            );
        }
        assert_eq!(parts.len(), 3);
        // a row over budget gets its own part
        let parts = token_balanced_partitions(&[20, 1, 1], 10);
        assert!(parts.contains(&vec![0]));
    }

    #[test]
    fn reassemble_restores_order() {
        let parts = [
            Tensor::from_slice(&[30i64, 10]),
            Tensor::from_slice(&[20i64]),
        ];
        let t = reassemble(&parts, &[vec![2, 0], vec![1]]);
        assert_eq!(Vec::<i64>::try_from(&t).unwrap(), vec![10, 20, 30]);
    }
}
