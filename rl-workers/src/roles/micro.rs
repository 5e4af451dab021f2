//! Micro-batching (fixed rows or verl's dynamic token budget), padding removal, and the
//! forward that gives response log-probs, entropies or values for one micro-batch.

use rl_core::roles::{LogProbExtras, Metrics, MiniBatchInfo};
use rl_core::{Batch, keys};
use tch::{Device, Kind, Tensor};

pub(crate) use crate::fused_head::EntropyOut;
use crate::fused_head::{PendingHead, fused_log_probs, head_log_probs, scaled_logits};
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
    Ok(MiniBatchInfo {
        tokens,
        sequences,
        on_policy: false,
    })
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

/// How a micro-batch's forward lays out its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Packing {
    /// The padded `[batch, seq_len]` rows as they are.
    Padded,
    /// The real tokens packed into rows without padding (verl's `use_remove_padding`).
    Packed,
    /// Packed, and the rows that share a prompt (a GRPO group) compute it once (verl's
    /// `use_prefix_grouper`): the prompt, then each response attending to it and to itself.
    SharedPrompts,
}

impl Packing {
    /// The layout `use_remove_padding` and `use_prefix_grouper` ask for (the prefix grouper
    /// packs too).
    pub(crate) fn new(remove_padding: bool, prefix_grouper: bool) -> Self {
        match (remove_padding, prefix_grouper) {
            (_, true) => Packing::SharedPrompts,
            (true, false) => Packing::Packed,
            (false, false) => Packing::Padded,
        }
    }

    /// `tr` packed as this layout says, or `None` when padded.
    fn pack(self, tr: &Trimmed) -> rl_core::Result<Option<Packed>> {
        match self {
            Packing::Padded => Ok(None),
            Packing::Packed => pack(tr, false).map(Some),
            Packing::SharedPrompts => pack(tr, true).map(Some),
        }
    }
}

/// A trimmed micro-batch's real tokens packed into rows without padding (verl's
/// `use_remove_padding`), for [`Model::forward_packed`](crate::Model::forward_packed): each
/// unit whole in one row, rows as wide as the longest unit, filled first-fit in order of
/// decreasing length. A unit is one sequence (its prompt, then its response), or with shared
/// prompts one prompt followed by the responses of all the rows that share it (the forward
/// attends block by block, so a wide unit costs its tokens, not its width squared).
struct Packed {
    input_ids: Tensor,
    segment_ids: Tensor,
    prefix_ids: Tensor,
    position_ids: Tensor,
    /// Per response position `(b, k)` the loss reads (`response_mask` set), in row-major
    /// order: the flat index (`row * width + column`) in the packed rows of the hidden state
    /// that predicts it.
    predictors: Tensor,
    /// The matching flat indices `b * keep + k` in the `[batch, keep]` output.
    targets: Tensor,
}

/// Rows that share one prompt: each row's prompt and response as padded flat indices of its
/// real tokens (the prompts equal in tokens and positions); the first row's prompt is placed.
struct Unit {
    rows: Vec<(Vec<usize>, Vec<usize>)>,
}

impl Unit {
    fn len(&self) -> usize {
        self.rows[0].0.len() + self.rows.iter().map(|r| r.1.len()).sum::<usize>()
    }
}

/// Packs `tr` (see [`Packed`]), sharing equal prompts when `share`; a response token whose
/// predecessor is not a real token (never made by the rollout) is an error.
fn pack(tr: &Trimmed, share: bool) -> rl_core::Result<Packed> {
    let (b, w) = (tr.input_ids.size()[0], tr.input_ids.size()[1]);
    let flat_i64 = |t: &Tensor| Vec::<i64>::try_from(t.to_device(Device::Cpu).reshape([-1]));
    let ids = flat_i64(&tr.input_ids)?;
    let mask = flat_i64(&tr.attention_mask.ne(0).to_kind(Kind::Int64))?;
    let pos = flat_i64(&tr.position_ids)?;
    // columns 0..=first are the prompt, the rest the response
    let prompt_cols = (tr.first + 1) as usize;
    let (w, rows_in) = (w as usize, b as usize);
    let real = |r: usize, cols: std::ops::Range<usize>| -> Vec<usize> {
        cols.map(|c| r * w + c).filter(|&i| mask[i] != 0).collect()
    };
    let mut units: Vec<Unit> = Vec::new();
    // with sharing: a prompt's tokens and positions -> its unit
    let mut open: std::collections::HashMap<Vec<(i64, i64)>, usize> =
        std::collections::HashMap::new();
    for r in 0..rows_in {
        let prompt = real(r, 0..prompt_cols);
        let response = real(r, prompt_cols..w);
        let key: Vec<(i64, i64)> = prompt.iter().map(|&i| (ids[i], pos[i])).collect();
        let joins = share.then(|| open.get(&key).copied()).flatten();
        match joins {
            Some(u) => units[u].rows.push((prompt, response)),
            None => {
                if share {
                    open.insert(key, units.len());
                }
                units.push(Unit {
                    rows: vec![(prompt, response)],
                });
            }
        }
    }
    let width = units.iter().map(Unit::len).max().unwrap_or(1).max(1);
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by(|&x, &y| units[y].len().cmp(&units[x].len()).then(x.cmp(&y)));
    // first fit, decreasing: (used, row) per packed row
    let mut fill: Vec<usize> = Vec::new();
    let mut place = vec![(0usize, 0usize); units.len()];
    for &u in &order {
        let n = units[u].len();
        let row = match fill.iter().position(|&used| used + n <= width) {
            Some(r) => r,
            None => {
                fill.push(0);
                fill.len() - 1
            }
        };
        place[u] = (row, fill[row]);
        fill[row] += n;
    }
    let rows = fill.len().max(1);
    let mut p_ids = vec![0i64; rows * width];
    let mut p_seg = vec![0i64; rows * width];
    let mut p_pre = vec![0i64; rows * width];
    let mut p_pos = vec![0i64; rows * width];
    // where each padded (b, column) real token went; a shared prompt's tokens, for every row
    // that shares it
    let mut at = vec![-1i64; rows_in * w];
    let mut segment = 0i64;
    for (u, unit) in units.iter().enumerate() {
        let (row, mut dst) = place[u];
        dst += row * width;
        segment += 1;
        let prompt_segment = segment;
        let mut prompt_at = Vec::with_capacity(unit.rows[0].0.len());
        for &i in &unit.rows[0].0 {
            (p_ids[dst], p_seg[dst], p_pos[dst]) = (ids[i], prompt_segment, pos[i]);
            prompt_at.push(dst as i64);
            dst += 1;
        }
        for (prompt, response) in &unit.rows {
            segment += 1;
            // every row of the unit reads the placed prompt as its own
            for (&i, &p) in prompt.iter().zip(&prompt_at) {
                at[i] = p;
            }
            for &i in response {
                (p_ids[dst], p_seg[dst], p_pos[dst]) = (ids[i], segment, pos[i]);
                p_pre[dst] = prompt_segment;
                at[i] = dst as i64;
                dst += 1;
            }
        }
    }
    let rmask = Vec::<f64>::try_from(
        tr.response_mask
            .narrow(1, 0, tr.keep)
            .to_device(Device::Cpu)
            .to_kind(Kind::Double)
            .reshape([-1]),
    )?;
    let (mut predictors, mut targets) = (Vec::new(), Vec::new());
    for r in 0..b {
        for k in 0..tr.keep {
            if rmask[(r * tr.keep + k) as usize] == 0.0 {
                continue;
            }
            let src = at[r as usize * w + (tr.first + k) as usize];
            if src < 0 {
                return Err(rl_core::Error::InvalidArgument {
                    name: "use_remove_padding",
                    reason: format!(
                        "row {r}: response token {k} follows a padding position, which a packed forward does not compute"
                    ),
                });
            }
            predictors.push(src);
            targets.push(r * tr.keep + k);
        }
    }
    let t = |v: Vec<i64>| Tensor::from_slice(&v).view([rows as i64, width as i64]);
    Ok(Packed {
        input_ids: t(p_ids),
        segment_ids: t(p_seg),
        prefix_ids: t(p_pre),
        position_ids: t(p_pos),
        predictors: Tensor::from_slice(&predictors),
        targets: Tensor::from_slice(&targets),
    })
}

impl Packed {
    /// The hidden states predicting the read response tokens, `[n, hidden]`, from the packed
    /// forward of `model`.
    fn predicting_states(
        &self,
        model: &crate::Model,
        device: Device,
        role: &'static str,
    ) -> rl_core::Result<Tensor> {
        let hidden = model
            .forward_packed(
                &self.input_ids.to_device(device),
                &self.segment_ids.to_device(device),
                &self.prefix_ids.to_device(device),
                &self.position_ids.to_device(device),
            )
            .map_err(role_err(role))?;
        let h = hidden.size()[2];
        Ok(hidden
            .reshape([-1, h])
            .index_select(0, &self.predictors.to_device(device)))
    }

    /// `[n]` values at the read positions as the `[batch, keep]` tensor of `tr` (zeros
    /// elsewhere).
    fn unpack(&self, values: &Tensor, tr: &Trimmed) -> Tensor {
        let b = tr.input_ids.size()[0];
        Tensor::zeros([b * tr.keep], (values.kind(), values.device()))
            .index_copy(0, &self.targets.to_device(values.device()), values)
            .view([b, tr.keep])
    }
}

/// Log-probs of `responses` (and per-token entropy as `entropy` says) under `lm`, logits
/// divided by `temperature`, zero at masked positions. Gradients flow when the caller allows
/// them.
///
/// # Shapes
/// - `micro`: `input_ids`, `attention_mask`, `position_ids` `[batch, seq_len]`, `responses`,
///   `response_mask` `[batch, response_len]`
/// - returns `([batch, response_len], Option<[batch, response_len]>)` f32
pub(crate) fn log_probs(
    lm: &CausalLm,
    micro: &Batch,
    temperature: f64,
    entropy: EntropyOut,
    packing: Packing,
) -> rl_core::Result<(Tensor, Option<Tensor>)> {
    let out = log_probs_inner(lm, micro, temperature, entropy, false, packing)?;
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
///
/// `packing` other than padded (verl's `use_remove_padding`, `use_prefix_grouper`) runs the
/// model on the real tokens packed into rows
/// ([`Model::forward_packed`](crate::Model::forward_packed)) and the head only on the states
/// that predict a read response token; the result equals the padded forward's up to rounding.
pub(crate) fn log_probs_with(
    lm: &CausalLm,
    micro: &Batch,
    temperature: f64,
    extras: LogProbExtras,
    packing: Packing,
) -> rl_core::Result<LogProbOutputs> {
    let entropy = EntropyOut::new(extras.entropy, false);
    log_probs_inner(
        lm,
        micro,
        temperature,
        entropy,
        extras.sum_pi_squared,
        packing,
    )
}

/// [`log_probs_with`] with the entropy as `entropy` says.
fn log_probs_inner(
    lm: &CausalLm,
    micro: &Batch,
    temperature: f64,
    entropy: EntropyOut,
    with_sum_pi_squared: bool,
    packing: Packing,
) -> rl_core::Result<LogProbOutputs> {
    // stage 3: the root unit (embeddings, head) stays gathered from the stack to the head
    let _root = lm.model().hold_root().map_err(role_err("actor"))?;
    let head = head_inputs(lm, micro, packing)?;
    let logits = scaled_logits(lm, &head.hidden, temperature);
    let (lp, entropy) = head_log_probs(&logits, &head.responses, entropy);
    let sum_pi_squared = with_sum_pi_squared.then(|| sum_pi_squared(&logits));
    Ok(LogProbOutputs {
        log_prob: head.back(lp),
        entropy: entropy.map(|t| head.back(t)),
        sum_pi_squared: sum_pi_squared.map(|t| head.back(t)),
    })
}

/// [`log_probs`] through the fused head (verl's `use_fused_kernels`): the same values, but
/// no full-vocabulary tensor is kept for the backward. The returned [`PendingHead`] must be
/// finished after the loss's backward; ZeRO stage 3 is not supported (the caller refuses it).
pub(crate) fn log_probs_fused(
    lm: &CausalLm,
    micro: &Batch,
    temperature: f64,
    with_entropy: bool,
    packing: Packing,
) -> rl_core::Result<(Tensor, Option<Tensor>, PendingHead)> {
    let head = head_inputs(lm, micro, packing)?;
    let fused = fused_log_probs(lm, &head.hidden, &head.responses, temperature, with_entropy);
    Ok((
        head.back(fused.log_prob),
        fused.entropy.map(|t| head.back(t)),
        fused.pending,
    ))
}

/// The states that predict a micro-batch's response tokens, those tokens, and the way back
/// from per-state values to `[batch, response_len]`.
struct HeadInputs {
    /// `[batch, keep, hidden]`, or packed `[n, hidden]`
    hidden: Tensor,
    /// `[batch, keep]`, or packed `[n]`
    responses: Tensor,
    tr: Trimmed,
    packing: Option<Packed>,
}

impl HeadInputs {
    /// Per-state values as `[batch, response_len]` on the batch's device, zero at masked
    /// positions.
    fn back(&self, t: Tensor) -> Tensor {
        let t = match &self.packing {
            Some(p) => p.unpack(&t, &self.tr),
            None => t,
        };
        pad_back(t.to_device(self.tr.response_mask.device()), &self.tr)
    }
}

/// The decoder's forward of `micro`, laid out as `packing` says, up to the states the head
/// reads.
fn head_inputs(lm: &CausalLm, micro: &Batch, packing: Packing) -> rl_core::Result<HeadInputs> {
    let tr = trim(micro)?;
    let device = lm.device();
    let packing = packing.pack(&tr)?;
    // the states predicting response tokens: [batch, keep, hidden], or packed [n, hidden]
    let (hidden, responses) = match &packing {
        Some(p) => {
            let resp = tr
                .responses
                .reshape([-1])
                .index_select(0, &p.targets.to_device(tr.responses.device()))
                .to_device(device);
            (p.predicting_states(lm.model(), device, "actor")?, resp)
        }
        None => {
            let hidden = lm
                .model()
                .forward(
                    &tr.input_ids.to_device(device),
                    &tr.attention_mask.to_device(device),
                    &tr.position_ids.to_device(device),
                    None,
                )
                .map_err(role_err("actor"))?;
            (
                hidden.narrow(1, tr.first, tr.keep),
                tr.responses.to_device(device),
            )
        }
    };
    Ok(HeadInputs {
        hidden,
        responses,
        tr,
        packing,
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
pub(crate) fn values(
    critic: &ValueModel,
    micro: &Batch,
    packing: Packing,
) -> rl_core::Result<Tensor> {
    let tr = trim(micro)?;
    let device = critic.var_store().device();
    let _root = critic.model().hold_root().map_err(role_err("critic"))?;
    if let Some(p) = packing.pack(&tr)? {
        let v = critic.values(&p.predicting_states(critic.model(), device, "critic")?);
        let v = p.unpack(&v, &tr).to_device(tr.response_mask.device());
        return Ok(pad_back(v, &tr));
    }
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

    /// Three rows, two sharing a prompt: the shared layout places that prompt once, and both
    /// rows' first response token is predicted by its last token.
    #[test]
    fn shared_prompts_are_packed_once() {
        // prompts (left-padded to 3): [5 6 7], [5 6 7], [0 8 9]; responses of 2, 1 and 2
        let ids =
            Tensor::from_slice(&[5i64, 6, 7, 1, 2, 5, 6, 7, 3, 0, 0, 8, 9, 4, 4]).view([3, 5]);
        let mask =
            Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]).view([3, 5]);
        let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
        let response_mask = Tensor::from_slice(&[1f32, 1., 1., 0., 1., 1.]).view([3, 2]);
        let tr = Trimmed {
            input_ids: ids.shallow_clone(),
            attention_mask: mask,
            position_ids: pos,
            responses: ids.narrow(1, 3, 2),
            response_mask,
            first: 2,
            keep: 2,
            response_len: 2,
        };
        let real = |p: &Packed| p.segment_ids.ne(0).sum(Kind::Int64).int64_value(&[]);
        let plain = pack(&tr, false).unwrap();
        let shared = pack(&tr, true).unwrap();
        assert_eq!(real(&plain), 5 + 4 + 4);
        assert_eq!(
            real(&shared),
            3 + 2 + 1 + 4,
            "the shared prompt is placed once"
        );
        let flat = |t: &Tensor| Vec::<i64>::try_from(t.reshape([-1])).unwrap();
        let (sids, spos, sseg, spre) = (
            flat(&shared.input_ids),
            flat(&shared.position_ids),
            flat(&shared.segment_ids),
            flat(&shared.prefix_ids),
        );
        let predictors = flat(&shared.predictors);
        // rows 0 and 1 read their first response token off the same state: the shared
        // prompt's last token, 7 at position 2
        assert_eq!(predictors[0], predictors[2]);
        let last = predictors[0] as usize;
        assert_eq!((sids[last], spos[last]), (7, 2));
        // row 1's response (token 3 at position 3) names the prompt's segment as its prefix
        let r1 = sids
            .iter()
            .zip(&spos)
            .position(|(&i, &p)| (i, p) == (3, 3))
            .unwrap();
        assert_eq!(spre[r1], sseg[last]);
        assert_ne!(sseg[r1], sseg[last]);
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
