//! [`SftTrainer`]: supervised fine-tuning with the loss on response tokens only (verl's
//! `fsdp_sft_trainer`), through the actor role, so SFT and RL share one optimiser and layout.

use std::path::Path;
use std::time::Instant;

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::Actor;
use rl_core::{Batch, Sample, StepMetrics, Trainer, keys};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::Kind;

use crate::trainer::dp::{Dp, ValBatches};
use crate::trainer::objective::SftLoss;
use crate::trainer::source::BatchSource;

/// The SFT trainer's settings (verl's `trainer` keys for SFT).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// Optimiser steps. Default 100.
    pub total_training_steps: u64,
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            total_training_steps: 100,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct SftState {
    global_step: u64,
    train_source: Value,
}

/// SFT over batches in the rollout layout: `input_ids`, `attention_mask`, `position_ids`
/// (prompt left-padded, response right-padded), `responses` and `response_mask` (1 on the
/// trained tokens). Each step is one `actor.update` with [`SftLoss`]; the actor's
/// `ppo_mini_batch_size` should be the batch size for one optimiser step per batch.
///
/// Data parallel with [`with_group`](Self::with_group).
pub struct SftTrainer {
    cfg: SftConfig,
    actor: Box<dyn Actor>,
    train: Box<dyn BatchSource>,
    val: Vec<Batch>,
    global_step: u64,
    dp: Option<Dp>,
}

impl std::fmt::Debug for SftTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SftTrainer")
            .field("cfg", &self.cfg)
            .field("global_step", &self.global_step)
            .finish()
    }
}

impl SftTrainer {
    /// A trainer at step 0.
    pub fn new(
        cfg: SftConfig,
        actor: Box<dyn Actor>,
        train: Box<dyn BatchSource>,
        val: Vec<Batch>,
    ) -> rl_core::Result<Self> {
        if cfg.total_training_steps == 0 {
            return Err(rl_core::Error::InvalidArgument {
                name: "trainer.total_training_steps",
                reason: "SFT would run zero steps".into(),
            });
        }
        Ok(SftTrainer {
            cfg,
            actor,
            train,
            val,
            global_step: 0,
            dp: None,
        })
    }

    /// Makes the trainer one rank of a data-parallel job over `group`, as
    /// `OnPolicyTrainer::with_group`: the actor must have been given the same group
    /// (`ActorWorker::with_group`: the SFT loss then normalises by the global token count and
    /// the gradients are averaged) and the source must yield this rank's contiguous share of
    /// each global batch of `batch_size` rows (`sft.train_batch_size`, verl's global batch).
    /// Each step's metrics are combined over the ranks (every rank returns the global figures),
    /// the ranks' weights are compared after the first step, validation runs each rank on its
    /// share of every validation batch and sums the log-likelihoods, and only rank 0 writes
    /// checkpoints (a no-op without any collective elsewhere); every rank loads them, at any
    /// world size.
    ///
    /// Errors when `batch_size` does not split over the ranks or the actor was not given a
    /// group of the same size.
    pub fn with_group(
        mut self,
        group: SharedCollective,
        batch_size: usize,
    ) -> rl_core::Result<Self> {
        let val = ValBatches::rows(&self.val);
        let dp = Dp::new(
            group,
            self.actor.as_ref(),
            "sft.train_batch_size",
            batch_size,
            val,
        )?;
        self.dp = Some(dp);
        Ok(self)
    }

    /// Gives the actor back (to hand the trained weights to an RL trainer).
    pub fn into_actor(self) -> Box<dyn Actor> {
        self.actor
    }
}

impl Trainer for SftTrainer {
    fn global_step(&self) -> u64 {
        self.global_step
    }

    fn total_steps(&self) -> u64 {
        self.cfg.total_training_steps
    }

    fn step(&mut self) -> rl_core::Result<StepMetrics> {
        let t = Instant::now();
        let batch = self.train.next_batch()?;
        let metrics = self.actor.update(&batch, &SftLoss)?;
        let mut m: StepMetrics = metrics.mean();
        self.global_step += 1;
        m.insert("timing_s/step".into(), t.elapsed().as_secs_f64());
        match &mut self.dp {
            Some(dp) => {
                dp.check_replicas_once(self.actor.as_ref())?;
                dp.reduce(m, batch.len() as f64)
            }
            None => Ok(m),
        }
    }

    fn validate(&mut self) -> rl_core::Result<(StepMetrics, Vec<Sample>)> {
        if self.val.is_empty() {
            // no validation set: nothing to report (every rank alike)
            return Ok((StepMetrics::new(), Vec::new()));
        }
        let (mut nll, mut tokens) = (0.0, 0.0);
        let (rank, world) = self.dp.as_ref().map_or((0, 1), |d| (d.rank, d.world));
        for b in &self.val {
            // each rank scores its contiguous share of the batch
            let shard = dist::shard_range(b.len(), rank, world);
            if shard.is_empty() {
                continue;
            }
            let b = &b.slice(shard)?;
            let lp = self.actor.compute_log_prob(b, false)?;
            // the tokens the loss trains (tool observations of `sft.mask_tags` traces excluded)
            let mask = &keys::policy_mask(b)?;
            nll -= (lp.get(keys::OLD_LOG_PROBS)? * mask)
                .sum(Kind::Double)
                .double_value(&[]);
            tokens += mask.sum(Kind::Double).double_value(&[]);
        }
        if let Some(dp) = &self.dp {
            let mut sums = [nll, tokens];
            dp.sum(&mut sums)?;
            [nll, tokens] = sums;
        }
        let mut m = StepMetrics::new();
        m.insert("val/loss".into(), nll / tokens.max(1.0));
        Ok((m, Vec::new()))
    }

    fn save_checkpoint(&self, dir: &Path) -> rl_core::Result<()> {
        // every rank holds the same weights and the same global source state: rank 0 writes;
        // the others only join the gathering of a ZeRO-sharded optimiser state
        if self.dp.as_ref().is_some_and(|d| d.rank != 0) {
            return self.actor.save_state(&dir.join("actor"));
        }
        let actor = dir.join("actor");
        std::fs::create_dir_all(&actor).map_err(|source| rl_core::Error::Io {
            path: actor.display().to_string(),
            source,
        })?;
        self.actor.save_state(&actor)?;
        let state = SftState {
            global_step: self.global_step,
            train_source: self.train.state(),
        };
        let path = dir.join("trainer_state.json");
        let text = serde_json::to_string(&state).map_err(|e| rl_core::Error::Role {
            role: "trainer",
            source: Box::new(e),
        })?;
        std::fs::write(&path, text).map_err(|source| rl_core::Error::Io {
            path: path.display().to_string(),
            source,
        })
    }

    fn load_checkpoint(&mut self, dir: &Path) -> rl_core::Result<()> {
        let path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&path).map_err(|source| rl_core::Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        let state: SftState = serde_json::from_str(&text).map_err(|e| rl_core::Error::Format {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        self.actor.load_state(&dir.join("actor"))?;
        self.train.load_state(&state.train_source)?;
        self.global_step = state.global_step;
        Ok(())
    }
}
