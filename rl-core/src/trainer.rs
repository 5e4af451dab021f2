//! The seam between a training algorithm (rl-algos) and whatever drives it (the harness, a
//! test): a [`Trainer`] is stepped from outside, reports each step's metrics, and saves and
//! loads everything an exact resume needs.
//!
//! The driver owns the loop, the run store, checkpoint frequency and wall-clock time; the
//! trainer owns its roles, its data loader position, its RNG streams and its step counter.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::Result;

/// Scalar metrics of one step or one validation pass, under verl's names
/// (`actor/pg_loss`, `val/test_score/<data_source>`, `timing_s/gen`, ...).
pub type StepMetrics = BTreeMap<String, f64>;

/// Whether a metric measures wall-clock time (`timing_s/*`, `timing_per_token_ms/*`,
/// `perf/time_per_step`, `perf/throughput`): the one kind of figure two runs of the same config
/// may differ in (the exact-resume contract below holds for every other).
pub fn is_wall_clock(key: &str) -> bool {
    key.starts_with("timing_s/")
        || key.starts_with("timing_per_token_ms/")
        || key == "perf/time_per_step"
        || key == "perf/throughput"
}

/// A few generations logged as samples during validation.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The prompt as text.
    pub prompt: String,
    /// The generated response as text.
    pub response: String,
    /// Its score.
    pub score: f64,
    /// The row's `data_source`.
    pub data_source: String,
}

/// A training algorithm, stepped from outside.
///
/// Contract for exact resume: after `load_checkpoint(dir)` of a checkpoint written by
/// `save_checkpoint(dir)` at step `s`, the following calls to `step` return exactly the metrics
/// (timings aside) that the trainer which wrote the checkpoint would have returned, given the
/// same config. Checkpoints must not depend on the number of processes that wrote them.
pub trait Trainer {
    /// Steps completed so far (0 before the first step).
    fn global_step(&self) -> u64;
    /// The step count at which training ends.
    fn total_steps(&self) -> u64;
    /// Runs one training step and returns its metrics.
    fn step(&mut self) -> Result<StepMetrics>;
    /// Runs validation and returns its metrics plus a few samples.
    fn validate(&mut self) -> Result<(StepMetrics, Vec<Sample>)>;
    /// Writes everything an exact resume needs into the existing, empty folder `dir`
    /// (weights, optimizer state, LR schedule, data loader, RNGs, KL controller, step).
    ///
    /// Data parallel, every rank calls it at the same step: rank 0 writes into `dir`, the other
    /// ranks only take part in the collectives that gather a sharded (ZeRO) optimiser state and
    /// never touch `dir`. With replicated state those ranks issue no collective, so a driver
    /// may then call it on rank 0 alone.
    fn save_checkpoint(&self, dir: &Path) -> Result<()>;
    /// Restores the state written by [`save_checkpoint`](Self::save_checkpoint).
    fn load_checkpoint(&mut self, dir: &Path) -> Result<()>;
}
