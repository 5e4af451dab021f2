//! Where a trainer's batches come from, and where its metrics go.

use std::io::Write;

use rl_core::{Result, Sample, StepMetrics, Trainer};
use serde_json::Value;

/// A resumable stream of batches: prompts (`input_ids`, `attention_mask`, `position_ids`
/// left-padded, plus `uid`, `data_source`, `ground_truth` columns) for on-policy trainers, or
/// prompt + response rows for SFT. rl-data's loader is adapted to it by the composer, so
/// rl-algos stays free of IO.
pub trait BatchSource {
    /// The next batch (an endless stream: epochs roll over).
    fn next_batch(&mut self) -> Result<rl_core::Batch>;
    /// The position to save in a checkpoint.
    fn state(&self) -> Value;
    /// Restores a position saved by [`state`](Self::state).
    fn load_state(&mut self, state: &Value) -> Result<()>;
}

/// Where metrics and samples go: the harness's run store, a console, a JSONL file.
pub trait MetricsSink {
    /// Records the metrics of `step`.
    fn log(&mut self, step: u64, metrics: &StepMetrics) -> Result<()>;
    /// Records validation samples of `step`; ignored by default.
    fn samples(&mut self, step: u64, samples: &[Sample]) -> Result<()> {
        let _ = (step, samples);
        Ok(())
    }
}

/// Keeps everything in memory (for tests).
#[derive(Debug, Default)]
pub struct MemorySink {
    /// `(step, metrics)` in the order logged.
    pub records: Vec<(u64, StepMetrics)>,
    /// `(step, samples)` in the order logged.
    pub samples: Vec<(u64, Vec<Sample>)>,
}

impl MetricsSink for MemorySink {
    fn log(&mut self, step: u64, metrics: &StepMetrics) -> Result<()> {
        self.records.push((step, metrics.clone()));
        Ok(())
    }
    fn samples(&mut self, step: u64, samples: &[Sample]) -> Result<()> {
        self.samples.push((step, samples.to_vec()));
        Ok(())
    }
}

/// One JSON object per line: `{"step": s, "metrics": {...}}`.
#[derive(Debug)]
pub struct JsonlSink<W: Write> {
    out: W,
}

impl<W: Write> JsonlSink<W> {
    /// Writes to `out` (a file, stdout).
    pub fn new(out: W) -> Self {
        JsonlSink { out }
    }
}

impl<W: Write> MetricsSink for JsonlSink<W> {
    fn log(&mut self, step: u64, metrics: &StepMetrics) -> Result<()> {
        let line = serde_json::json!({ "step": step, "metrics": metrics });
        writeln!(self.out, "{line}").map_err(|source| rl_core::Error::Io {
            path: "jsonl sink".into(),
            source,
        })
    }
}

/// When a [`run`] validates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    /// Validate before the first step (verl's `trainer.val_before_train`).
    pub val_before_train: bool,
    /// Validate every this many steps and after the last; <= 0 = never (`trainer.test_freq`).
    pub test_freq: i64,
}

/// Drives `trainer` to its last step, logging to `sink` (a stand-in for the harness's loop):
/// validation before training and every `test_freq` steps and at the end, as verl's `fit`.
/// Returns the last validation metrics, if any.
pub fn run(
    trainer: &mut dyn Trainer,
    sink: &mut dyn MetricsSink,
    opts: RunOptions,
) -> Result<Option<StepMetrics>> {
    let mut last_val = None;
    let mut validate = |trainer: &mut dyn Trainer, sink: &mut dyn MetricsSink| -> Result<()> {
        let (m, samples) = trainer.validate()?;
        let step = trainer.global_step();
        sink.log(step, &m)?;
        sink.samples(step, &samples)?;
        last_val = Some(m);
        Ok(())
    };
    if opts.val_before_train {
        validate(trainer, sink)?;
    }
    while trainer.global_step() < trainer.total_steps() {
        let m = trainer.step()?;
        sink.log(trainer.global_step(), &m)?;
        let s = trainer.global_step();
        let last = s == trainer.total_steps();
        if opts.test_freq > 0 && (s.is_multiple_of(opts.test_freq as u64) || last) {
            validate(trainer, sink)?;
        }
    }
    Ok(last_val)
}
