//! The role traits the trainers in rl-algos program against, implemented by rl-workers.
//!
//! A trainer never sees a model: it hands a [`Batch`] to a role and gets a `Batch` of new keys
//! back, to `union` into its own. The loss goes into the actor and critic as a value
//! (verl's `train_batch(data, loss_fn)`), so rl-workers does not know which algorithm trains it,
//! and rl-algos can be tested with small mock roles. These traits are deliberately small; they
//! grow with the trainers.

use std::collections::BTreeMap;
use std::path::Path;

use tch::Tensor;

use crate::batch::Batch;
use crate::error::{Error, Result};

/// The error the default `save_state` / `load_state` return: the role keeps no state to resume.
fn not_checkpointable(role: &'static str) -> Error {
    Error::Role {
        role,
        source: "this implementation does not support checkpoints".into(),
    }
}

/// Scalar metrics under verl's names (`actor/pg_loss`), with every value reported in a step
/// kept so they can be averaged (or summed) when the step ends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    values: BTreeMap<String, Vec<f64>>,
}

impl Metrics {
    /// No metrics.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one value of `key`.
    pub fn push(&mut self, key: impl Into<String>, value: f64) {
        self.values.entry(key.into()).or_default().push(value);
    }

    /// Appends every value of `other`.
    pub fn extend(&mut self, other: Metrics) {
        for (key, vs) in other.values {
            self.values.entry(key).or_default().extend(vs);
        }
    }

    /// The values recorded for `key`.
    pub fn values(&self, key: &str) -> &[f64] {
        self.values.get(key).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Each key's mean over the values recorded (verl's `reduce_metrics`).
    pub fn mean(&self) -> BTreeMap<String, f64> {
        self.values
            .iter()
            .filter(|(_, vs)| !vs.is_empty())
            .map(|(k, vs)| (k.clone(), vs.iter().sum::<f64>() / vs.len() as f64))
            .collect()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

/// Turns left-padded prompts into prompts plus responses.
pub trait Rollout {
    /// Reads `input_ids`, `attention_mask`, `position_ids` (left-padded prompts) and returns a
    /// batch with `prompts`, `responses`, `input_ids`, `attention_mask`, `position_ids`,
    /// `response_mask` and `rollout_log_probs`, carrying the columns through.
    fn generate(&mut self, prompts: &Batch) -> Result<Batch>;
}

/// Generation on a copy of the policy that runs beside the update (asynchronous training): the
/// trainer hands it weight snapshots and prompt batches, and work runs in the order it was
/// handed over, so each batch is generated with the weights of the last
/// [`sync_weights`](Self::sync_weights) before its [`submit`](Self::submit), whatever the
/// actor has done since.
pub trait BackgroundRollout {
    /// Snapshots the policy's weights as they are now; batches submitted after this call
    /// generate with them.
    fn sync_weights(&mut self) -> Result<()>;
    /// Queues `prompts` (read as [`Rollout::generate`] reads them) for generation and returns
    /// at once.
    fn submit(&mut self, prompts: Batch) -> Result<()>;
    /// The output of the oldest submitted batch not yet collected, waiting for it. Its
    /// `meta_info` carries `generation_s`, the seconds its generation took.
    fn collect(&mut self) -> Result<Batch>;
}

/// The `meta_info` key under which a [`BackgroundRollout`] reports a batch's generation time.
pub const GENERATION_SECONDS: &str = "generation_s";

/// The `meta_info` key of a prompt batch naming the policy version (the trainer step whose
/// weights) it is generated with: a rollout on external servers syncs their weights when it
/// changes, and reports it to them (vLLM's `weight_version`).
pub const POLICY_VERSION: &str = "policy_version";

/// The `meta_info` key (bool) of a batch whose `old_log_probs` the trainer did not compute
/// because the actor's update supplies them ([`Actor::old_log_probs_from_update`]): the update
/// then also reports `actor/entropy` of its forward ([`PolicyObjective::entropy_metric`]), which
/// the separate old-log-prob forward would have reported.
pub const OLD_LOG_PROBS_FROM_UPDATE: &str = "old_log_probs_from_update";

/// What the actor computes with gradients for one micro-batch, handed to the objective.
#[derive(Debug)]
pub struct PolicyOutput {
    /// Log-probs of `responses`, `[batch, response_len]`, with gradient.
    pub log_prob: Tensor,
    /// Per-token entropy, `[batch, response_len]`, when the objective asked for it.
    pub entropy: Option<Tensor>,
}

/// Sizes of the whole mini-batch a micro-batch belongs to, so that losses summed over
/// micro-batches equal the mini-batch loss (global token / sequence normalisation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MiniBatchInfo {
    /// Unmasked response tokens in the mini-batch.
    pub tokens: f64,
    /// Sequences in the mini-batch.
    pub sequences: f64,
    /// Whether this mini-batch is the update's only one, for one epoch (verl's `on_policy`):
    /// every micro-batch's forward then runs at the weights the batch's `old_log_probs` were
    /// computed at, and verl's actor takes the current log-probs, detached, as the old ones.
    pub on_policy: bool,
}

/// A policy objective: the loss of one micro-batch, already scaled for accumulation.
pub trait PolicyObjective {
    /// Whether the actor must compute per-token entropy for [`loss`](Self::loss).
    fn needs_entropy(&self) -> bool;
    /// The scalar loss to back-propagate for `micro` and the metrics to report.
    fn loss(
        &self,
        micro: &Batch,
        out: &PolicyOutput,
        info: MiniBatchInfo,
    ) -> Result<(Tensor, Metrics)>;
    /// The `actor/entropy` metric of a batch's per-token `entropy` over its `mask` (both
    /// `[batch, response_len]`), as the trainer reports it of the old-log-prob forward (verl
    /// aggregates it with the loss's `loss_agg_mode`); `None` when the mask holds no token.
    /// Default: the mean over the masked tokens.
    fn entropy_metric(&self, entropy: &Tensor, mask: &Tensor) -> Result<Option<f64>> {
        let mask = mask.to_kind(tch::Kind::Double);
        let tokens = mask.sum(tch::Kind::Double).double_value(&[]);
        Ok((tokens > 0.0).then(|| {
            (entropy.to_kind(tch::Kind::Double) * &mask)
                .sum(tch::Kind::Double)
                .double_value(&[])
                / tokens
        }))
    }
}

/// A value objective for the critic: the loss of one micro-batch given predicted values.
pub trait ValueObjective {
    /// The scalar loss to back-propagate for `micro` (values `[batch, response_len]`).
    fn loss(
        &self,
        micro: &Batch,
        values: &Tensor,
        info: MiniBatchInfo,
    ) -> Result<(Tensor, Metrics)>;
}

/// What [`Actor::compute_log_prob_with`] computes besides `old_log_probs`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogProbExtras {
    /// Per-token entropy (`entropys`).
    pub entropy: bool,
    /// `Σπ²` over the vocabulary per position (`sum_pi_squared`, the optimal token baseline's).
    pub sum_pi_squared: bool,
}

/// The trained policy.
pub trait Actor {
    /// `old_log_probs`, plus the `extras` asked for (`entropys`, `sum_pi_squared`), for
    /// `responses`, without gradient.
    fn compute_log_prob_with(&mut self, batch: &Batch, extras: LogProbExtras) -> Result<Batch>;
    /// `old_log_probs` (and `entropys` when `with_entropy`) for `responses`, without gradient.
    fn compute_log_prob(&mut self, batch: &Batch, with_entropy: bool) -> Result<Batch> {
        self.compute_log_prob_with(
            batch,
            LogProbExtras {
                entropy: with_entropy,
                sum_pi_squared: false,
            },
        )
    }
    /// One update over `batch` (mini-batches × PPO epochs, micro-batch accumulation).
    fn update(&mut self, batch: &Batch, objective: &dyn PolicyObjective) -> Result<Metrics>;
    /// Writes the trained state (weights, optimizer moments and step, LR-schedule position)
    /// into the existing folder `dir`. The default returns an error: not checkpointable.
    /// Data parallel, every rank calls it; rank 0 writes and the others only join the
    /// gathering of a sharded optimiser state (they never touch `dir`).
    fn save_state(&self, dir: &Path) -> Result<()> {
        let _ = dir;
        Err(not_checkpointable("actor"))
    }
    /// Restores what [`save_state`](Self::save_state) wrote.
    fn load_state(&mut self, dir: &Path) -> Result<()> {
        let _ = dir;
        Err(not_checkpointable("actor"))
    }
    /// A digest of the trained weights (equal digests mean bit-identical weights, see
    /// [`crate::dist::digest`]), which data-parallel trainers compare across ranks; `None`, the
    /// default, when the role cannot tell.
    fn weights_digest(&self) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Whether [`update`](Self::update) over a batch of `rows` rows supplies `old_log_probs`
    /// itself, so that the trainer may skip [`compute_log_prob_with`](Self::compute_log_prob_with)
    /// when nothing else reads them before the update: true when the update is one mini-batch
    /// for one epoch (its forwards then run at the weights the separate forward would have run
    /// at, and the loss takes their log-probs, detached, as the old ones) and the role allows
    /// it. The trainer then sets [`OLD_LOG_PROBS_FROM_UPDATE`] in the batch's `meta_info`.
    /// False by default.
    fn old_log_probs_from_update(&self, rows: usize) -> bool {
        let _ = rows;
        false
    }
    /// The number of data-parallel ranks this role averages its gradients over (1, the default,
    /// when it has no group).
    fn data_parallel_ranks(&self) -> usize {
        1
    }
    /// Whether every forward of this role is a collective (ZeRO stage 3 gathers the weights a
    /// layer at a time), so every data-parallel rank must run the same forwards: none may sit
    /// out a batch that leaves it no rows. False by default.
    fn forwards_are_collective(&self) -> bool {
        false
    }
}

/// The frozen reference policy.
pub trait Reference {
    /// `ref_log_prob` for `responses`.
    fn compute_ref_log_prob(&mut self, batch: &Batch) -> Result<Batch>;
}

/// The value model (PPO with GAE).
pub trait Critic {
    /// `values` for the response tokens.
    fn compute_values(&mut self, batch: &Batch) -> Result<Batch>;
    /// One update over `batch`.
    fn update(&mut self, batch: &Batch, objective: &dyn ValueObjective) -> Result<Metrics>;
    /// Writes the trained state into the existing folder `dir`; the default returns an error.
    fn save_state(&self, dir: &Path) -> Result<()> {
        let _ = dir;
        Err(not_checkpointable("critic"))
    }
    /// Restores what [`save_state`](Self::save_state) wrote.
    fn load_state(&mut self, dir: &Path) -> Result<()> {
        let _ = dir;
        Err(not_checkpointable("critic"))
    }
    /// A digest of the trained weights, as [`Actor::weights_digest`]; `None` by default.
    fn weights_digest(&self) -> Result<Option<u64>> {
        Ok(None)
    }
    /// The number of data-parallel ranks this role averages its gradients over (1 by default).
    fn data_parallel_ranks(&self) -> usize {
        1
    }
}

/// Rewards: rule functions by `data_source` and/or a reward model.
pub trait Reward {
    /// `token_level_scores` (the score on each row's last response token) plus any
    /// per-row extra information as columns.
    fn score(&mut self, batch: &Batch) -> Result<Batch>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_average_per_key() {
        let mut m = Metrics::new();
        m.push("actor/pg_loss", 1.0);
        m.push("actor/pg_loss", 3.0);
        let mut other = Metrics::new();
        other.push("actor/lr", 1e-6);
        m.extend(other);
        let mean = m.mean();
        assert_eq!(mean["actor/pg_loss"], 2.0);
        assert_eq!(mean["actor/lr"], 1e-6);
        assert_eq!(m.values("actor/pg_loss"), &[1.0, 3.0]);
        assert!(m.values("nope").is_empty());
    }
}
