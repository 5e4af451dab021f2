//! The language-model head's per-token log-probs (and entropy) without a full-vocabulary tensor
//! kept for the backward: verl's `use_fused_kernels` (its `FusedLinearForPPO`), on any device.
//!
//! The plain path computes `[tokens, vocab]` logits, their log-softmax (and for the entropy their
//! probabilities) for the whole micro-batch, and autograd keeps them until the backward: at
//! SmolLM2's 49,152 classes that is 654 MB per tensor for `32 x 104` tokens, each a fresh
//! mapping the kernel zeroes. Here the forward runs the head in row chunks without a graph and
//! hands the loss *leaf* tensors; once the loss's backward has put its gradients on those leaves,
//! [`PendingHead::finish`] recomputes each chunk with a graph, back-propagates it at once (so one
//! chunk's logits live at a time) into the head's weight and the hidden states, and then sends
//! the hidden states' gradient into the decoder. The head runs twice (about 7% more arithmetic
//! for SmolLM2), and the values and gradients equal the plain path's up to rounding.

use tch::{Kind, Tensor};

use crate::heads::CausalLm;

/// Logits per chunk: 4M (16 MiB of f32), below glibc's largest mmap threshold, so the chunks'
/// temporaries are recycled by the heap instead of being fresh pages every time.
const CHUNK_ELEMS: i64 = 1 << 22;

/// The head's outputs for the loss, and what the backward still owes the head and the decoder.
pub struct FusedHead {
    /// `[...]` f32 log-probs of the labels, a leaf requiring grad.
    pub log_prob: Tensor,
    /// `[...]` f32 entropies, a leaf requiring grad, when asked for.
    pub entropy: Option<Tensor>,
    /// Call [`PendingHead::finish`] after the loss's backward.
    pub pending: PendingHead,
}

/// The second half of [`fused_log_probs`]: the recompute and backward of the head.
#[must_use = "the head's and the decoder's gradients arrive only through finish"]
pub struct PendingHead {
    hidden: Tensor,
    leaf: Tensor,
    labels: Tensor,
    temperature: f64,
    step: i64,
    log_prob: Tensor,
    entropy: Option<Tensor>,
}

/// `lm`'s logits of hidden states `h` in f32, divided by `temperature`.
pub(crate) fn scaled_logits(lm: &CausalLm, h: &Tensor, temperature: f64) -> Tensor {
    let mut logits = lm.logits(h).to_kind(Kind::Float);
    if temperature != 1.0 {
        logits /= temperature;
    }
    logits
}

/// What a forward computes of the per-token entropy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntropyOut {
    /// None.
    No,
    /// For the loss: with its graph.
    Loss,
    /// Its value only (a metric): no graph is recorded for it, so a forward with gradients
    /// keeps no full-vocabulary tensor for it.
    Value,
}

impl EntropyOut {
    /// `Loss` when the loss needs it, else `Value` when a metric does.
    pub(crate) fn new(for_loss: bool, for_metric: bool) -> Self {
        match (for_loss, for_metric) {
            (true, _) => EntropyOut::Loss,
            (false, true) => EntropyOut::Value,
            (false, false) => EntropyOut::No,
        }
    }

    /// Whether it is computed at all.
    pub(crate) fn any(self) -> bool {
        self != EntropyOut::No
    }
}

/// Log-probs of `labels` under f32 `logits` (`[..., vocab]`) and the entropies as `entropy`
/// says: the arithmetic of the plain head and of each fused chunk, row by row.
pub(crate) fn head_log_probs(
    logits: &Tensor,
    labels: &Tensor,
    entropy: EntropyOut,
) -> (Tensor, Option<Tensor>) {
    let log_softmax = logits.log_softmax(-1, Kind::Float);
    let lp = log_softmax
        .gather(-1, &labels.unsqueeze(-1), false)
        .squeeze_dim(-1);
    let ent = entropy.any().then(|| {
        let ls = match entropy {
            EntropyOut::Value => log_softmax.detach(),
            _ => log_softmax.shallow_clone(),
        };
        let p = ls.exp();
        -(p * &ls).sum_dim_intlist([-1].as_slice(), false, Kind::Float)
    });
    (lp, ent)
}

/// One chunk's log-probs of `labels` (and entropies) from hidden states `h` (`[n, hidden]`).
fn chunk(
    lm: &CausalLm,
    h: &Tensor,
    labels: &Tensor,
    temperature: f64,
    entropy: bool,
) -> (Tensor, Option<Tensor>) {
    head_log_probs(
        &scaled_logits(lm, h, temperature),
        labels,
        EntropyOut::new(entropy, false),
    )
}

/// Rows of `[rows, vocab]` logits per chunk.
fn chunk_rows(lm: &CausalLm) -> i64 {
    (CHUNK_ELEMS / lm.config().vocab_size.max(1)).max(1)
}

/// `(start, len)` of each chunk of `step` rows (the last one shorter) over `rows` rows.
fn spans(rows: i64, step: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..rows)
        .step_by(step.max(1) as usize)
        .map(move |start| (start, step.min(rows - start)))
}

/// Log-probs of `labels` (and entropies when `entropy`) under `lm`'s head applied to `hidden`,
/// logits divided by `temperature`, as leaves for the loss; [`PendingHead::finish`] completes
/// the backward.
///
/// # Shapes
/// - `hidden`: `[..., hidden]`, part of the decoder's graph
/// - `labels`: `[...]` i64, its leading dims
/// - returns `log_prob` and `entropy` `[...]` f32
pub fn fused_log_probs(
    lm: &CausalLm,
    hidden: &Tensor,
    labels: &Tensor,
    temperature: f64,
    entropy: bool,
) -> FusedHead {
    fused_in_chunks(lm, hidden, labels, temperature, entropy, chunk_rows(lm))
}

/// [`fused_log_probs`] with `step` rows per chunk.
fn fused_in_chunks(
    lm: &CausalLm,
    hidden: &Tensor,
    labels: &Tensor,
    temperature: f64,
    entropy: bool,
    step: i64,
) -> FusedHead {
    let lead = labels.size();
    let width = *hidden.size().last().unwrap_or(&1);
    // a leaf of its own (reshape copies a non-contiguous view, such as the response columns)
    let leaf = hidden.detach().reshape([-1, width]).set_requires_grad(true);
    let flat_labels = labels.reshape([-1]);
    let rows = leaf.size()[0];
    let (mut lps, mut ents) = (Vec::new(), Vec::new());
    tch::no_grad(|| {
        for (start, len) in spans(rows, step) {
            let (lp, ent) = chunk(
                lm,
                &leaf.narrow(0, start, len),
                &flat_labels.narrow(0, start, len),
                temperature,
                entropy,
            );
            lps.push(lp);
            ents.extend(ent);
        }
    });
    let gather = |parts: Vec<Tensor>| {
        let t = if parts.is_empty() {
            Tensor::zeros([0], (Kind::Float, hidden.device()))
        } else {
            Tensor::cat(&parts, 0)
        };
        t.reshape(lead.as_slice()).set_requires_grad(true)
    };
    let log_prob = gather(lps);
    let entropy = entropy.then(|| gather(ents));
    FusedHead {
        log_prob: log_prob.shallow_clone(),
        entropy: entropy.as_ref().map(Tensor::shallow_clone),
        pending: PendingHead {
            hidden: hidden.shallow_clone(),
            leaf,
            labels: flat_labels,
            temperature,
            step,
            log_prob,
            entropy,
        },
    }
}

impl PendingHead {
    /// After the loss's backward: recomputes the head chunk by chunk with a graph, weighting each
    /// chunk's log-probs and entropies by the gradients the loss left on the leaves, and
    /// back-propagates it (into the head's weight and the hidden states' leaf), then sends the
    /// hidden states' gradient into the decoder. A loss that used neither output leaves nothing
    /// to do.
    pub fn finish(self, lm: &CausalLm) {
        let flat = |t: &Tensor| {
            let g = t.grad();
            g.defined().then(|| g.reshape([-1]))
        };
        let g_lp = flat(&self.log_prob);
        let g_ent = self.entropy.as_ref().and_then(flat);
        if g_lp.is_none() && g_ent.is_none() {
            return;
        }
        for (start, len) in spans(self.leaf.size()[0], self.step) {
            let (lp, ent) = chunk(
                lm,
                &self.leaf.narrow(0, start, len),
                &self.labels.narrow(0, start, len),
                self.temperature,
                g_ent.is_some(),
            );
            let mut surrogate = Tensor::zeros([], (Kind::Float, lp.device()));
            if let Some(g) = &g_lp {
                surrogate += (lp * g.narrow(0, start, len)).sum(Kind::Float);
            }
            if let (Some(e), Some(g)) = (ent, &g_ent) {
                surrogate += (e * g.narrow(0, start, len)).sum(Kind::Float);
            }
            surrogate.backward();
        }
        let g_hidden = self.leaf.grad();
        if g_hidden.defined() {
            (&self.hidden * g_hidden.reshape(self.hidden.size().as_slice()).detach())
                .sum(Kind::Float)
                .backward();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;
    use tch::Device;

    /// A tiny model; with `lora`, adapters on the query projections and the head, their B
    /// drawn (a fresh B is zero).
    fn tiny(tied: bool, lora: bool) -> CausalLm {
        let mut cfg = Config::tiny();
        cfg.vocab_size = 97;
        cfg.tie_word_embeddings = tied;
        crate::seeded(3, || {
            let mut lm = CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap();
            if lora {
                lm.add_lora(&crate::LoraConfig {
                    rank: 4,
                    alpha: 8.0,
                    target_modules: crate::TargetModules::Names(vec![
                        "q_proj".into(),
                        "lm_head".into(),
                    ]),
                    exclude_modules: Vec::new(),
                    dropout: 0.0,
                    use_rslora: false,
                })
                .unwrap();
                tch::no_grad(|| {
                    for (name, mut t) in lm.var_store().variables() {
                        if name.contains(".lora_B.") {
                            t.copy_(&(Tensor::randn_like(&t) * 0.05));
                        }
                    }
                });
            }
            lm
        })
    }

    /// The gradients of the variables that train.
    fn grads(lm: &CausalLm) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = lm
            .var_store()
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(k, t)| (k, t.grad().copy()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    fn zero(lm: &CausalLm) {
        for mut t in lm.var_store().trainable_variables() {
            t.zero_grad();
        }
    }

    /// The fused head gives the plain path's log-probs, entropies and every parameter's
    /// gradient (a loss mixing both, a temperature, more rows than one chunk holds), with and
    /// without a LoRA adapter on the head.
    #[test]
    fn fused_head_matches_the_plain_head_in_values_and_gradients() {
        for (tied, lora) in [(true, false), (false, false), (true, true), (false, true)] {
            let lm = tiny(tied, lora);
            if lora {
                let trained = lm
                    .var_store()
                    .variables()
                    .values()
                    .filter(|t| t.requires_grad())
                    .count();
                assert_eq!(trained, 2 * 2 + 2, "q_proj's and the head's A and B");
            }
            let (b, t) = (3, 9);
            // the global generator is shared with the other tests of the process: hold it
            let (ids, labels, weights) = crate::seeded(4, || {
                (
                    Tensor::randint(97, [b, t], (Kind::Int64, Device::Cpu)),
                    Tensor::randint(97, [b, t], (Kind::Int64, Device::Cpu)),
                    Tensor::randn([b, t], (Kind::Float, Device::Cpu)),
                )
            });
            let mask = Tensor::ones([b, t], (Kind::Int64, Device::Cpu));
            let pos = Tensor::arange(t, (Kind::Int64, Device::Cpu))
                .unsqueeze(0)
                .repeat([b, 1]);
            let loss = |lp: &Tensor, ent: &Tensor| {
                (lp * &weights).sum(Kind::Float) - (ent * ent).sum(Kind::Float) * 0.3
            };
            let temperature = 0.7;

            zero(&lm);
            let hidden = lm.model().forward(&ids, &mask, &pos, None).unwrap();
            let (lp, ent) = chunk(&lm, &hidden, &labels, temperature, true);
            let ent = ent.unwrap();
            loss(&lp, &ent).backward();
            let plain = grads(&lm);

            zero(&lm);
            let hidden = lm.model().forward(&ids, &mask, &pos, None).unwrap();
            // 27 rows in chunks of 4: several chunks and a short last one
            let fused = fused_in_chunks(&lm, &hidden, &labels, temperature, true, 4);
            let fent = fused.entropy.as_ref().unwrap();
            assert!(
                (&fused.log_prob - &lp).abs().max().double_value(&[]) < 1e-6,
                "log-probs"
            );
            assert!(
                (fent - &ent).abs().max().double_value(&[]) < 1e-6,
                "entropies"
            );
            loss(&fused.log_prob, fent).backward();
            fused.pending.finish(&lm);
            let got = grads(&lm);
            assert_eq!(plain.len(), got.len());
            for ((name, a), (_, g)) in plain.iter().zip(&got) {
                assert!(a.defined() && g.defined(), "{name}: no gradient");
                let diff = (a - g).abs().max().double_value(&[]);
                let scale = a.abs().max().double_value(&[]).max(1e-3);
                assert!(
                    diff <= 1e-5 * scale,
                    "tied={tied} lora={lora} {name}: gradients differ by {diff} (scale {scale})"
                );
            }
        }
    }
}
