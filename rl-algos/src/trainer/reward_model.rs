//! Reward-model training (Bradley–Terry, TRL's `RewardTrainer`, OpenRLHF's RM trainer): the
//! pairwise objective handed to the reward-model worker, its config ([`RmTrainerConfig`]) and
//! [`RmTrainer`].
//!
//! The reward-model worker is driven through the [`Critic`] role (rl-algos never sees a model):
//! its `values` hold each row's scalar reward on the row's last response token and 0 elsewhere,
//! the layout of `token_level_scores`, so a row's reward is its masked sum. A batch holds each
//! pair as two adjacent rows in the rollout layout, chosen first, like the DPO trainer's.

use std::path::Path;
use std::time::Instant;

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::{Critic, Metrics, MiniBatchInfo, ValueObjective};
use rl_core::{Batch, Sample, StepMetrics, Trainer, keys};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::{Kind, Tensor};

use crate::rm;
use crate::trainer::dp::Dp;
use crate::trainer::preference::{PAIR_INDEX, io_err, mark_pairs, read_json, write_json};
use crate::trainer::source::BatchSource;

/// Optional `[batch]` float: the margin each pair's reward gap must clear (TRL's `margin`
/// column, Llama 2's preference strength), equal on a pair's two rows; added to
/// [`RmTrainerConfig::margin`].
pub const RM_MARGIN: &str = "rm_margin";

/// The reward-model trainer's settings, under TRL's `RewardConfig` names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmTrainerConfig {
    /// Optimiser steps (one batch of pairs each). Default 100.
    pub total_training_steps: u64,
    /// A margin every pair's gap must clear, `>= 0`, added to the per-pair [`RM_MARGIN`].
    /// Default 0 (the plain Bradley–Terry loss).
    pub margin: f64,
    /// TRL's `center_rewards_coefficient`: adds `c * mean((r_chosen + r_rejected)^2)` so the
    /// rewards stay centred on 0, `>= 0`. Default 0 (off).
    pub center_rewards_coefficient: f64,
}

impl Default for RmTrainerConfig {
    fn default() -> Self {
        RmTrainerConfig {
            total_training_steps: 100,
            margin: 0.0,
            center_rewards_coefficient: 0.0,
        }
    }
}

impl RmTrainerConfig {
    /// Checks every range, naming the key at fault.
    pub fn check(&self) -> rl_core::Result<()> {
        let bad = |name: &'static str, reason: String| {
            Err(rl_core::Error::InvalidArgument { name, reason })
        };
        if self.total_training_steps == 0 {
            return bad("total_training_steps", "would run zero steps".into());
        }
        if !(self.margin.is_finite() && self.margin >= 0.0) {
            return bad(
                "margin",
                format!("must be finite and >= 0, got {}", self.margin),
            );
        }
        if !(self.center_rewards_coefficient.is_finite() && self.center_rewards_coefficient >= 0.0)
        {
            return bad(
                "center_rewards_coefficient",
                format!(
                    "must be finite and >= 0, got {}",
                    self.center_rewards_coefficient
                ),
            );
        }
        Ok(())
    }

    /// The objective handed to the worker.
    pub fn objective(&self) -> BradleyTerryLoss {
        BradleyTerryLoss {
            margin: self.margin,
            center_rewards_coefficient: self.center_rewards_coefficient,
        }
    }
}

fn wrap(e: crate::Error) -> rl_core::Error {
    match e {
        crate::Error::Core(c) => c,
        other => rl_core::Error::Role {
            role: "rm loss",
            source: Box::new(other),
        },
    }
}

/// Checks that `batch` holds whole pairs, chosen first: `pair_index[2i] == pair_index[2i + 1]`.
fn check_pairs(batch: &Batch) -> rl_core::Result<()> {
    let idx = batch.get(PAIR_INDEX)?;
    let n = idx.size()[0];
    let ok = n % 2 == 0 && {
        let v = idx.view([-1, 2]);
        v.select(1, 0)
            .eq_tensor(&v.select(1, 1))
            .all()
            .int64_value(&[])
            == 1
    };
    if !ok {
        return Err(rl_core::Error::InvalidArgument {
            name: "reward_model",
            reason: "a reward-model micro-batch split a (chosen, rejected) pair: use an even \
                     micro-batch size and no shuffle"
                .into(),
        });
    }
    Ok(())
}

/// Each row's reward: `values` summed over `response_mask`.
///
/// # Shapes
/// - `values`, `response_mask`: `[batch, response_len]`
/// - returns `[batch]` f32
fn row_rewards(values: &Tensor, response_mask: &Tensor) -> rl_core::Result<Tensor> {
    rl_core::shape::expect_same_shape(keys::VALUES, values, keys::RESPONSE_MASK, response_mask)?;
    Ok(
        (values.to_kind(Kind::Float) * response_mask.to_kind(Kind::Float)).sum_dim_intlist(
            [-1].as_slice(),
            false,
            Kind::Float,
        ),
    )
}

/// `[batch]` -> (`[pairs]` chosen, `[pairs]` rejected).
fn split_pairs(seq: &Tensor) -> (Tensor, Tensor) {
    let v = seq.view([-1, 2]);
    (v.select(1, 0), v.select(1, 1))
}

/// Each pair's margin: the config's plus [`RM_MARGIN`] when the batch has it.
fn pair_margin(batch: &Batch, margin: f64, pairs: i64) -> rl_core::Result<Option<Tensor>> {
    let per_pair = if batch.contains(RM_MARGIN) {
        let m = batch.get(RM_MARGIN)?;
        rl_core::shape::expect_dims(RM_MARGIN, m, &[rl_core::shape::Dim::Is(2 * pairs)])?;
        Some(split_pairs(&m.to_kind(Kind::Float)).0 + margin)
    } else {
        None
    };
    Ok(match (per_pair, margin) {
        (Some(m), _) => Some(m),
        (None, m) if m != 0.0 => Some(Tensor::full(
            [pairs],
            m,
            (Kind::Float, batch.get(PAIR_INDEX)?.device()),
        )),
        _ => None,
    })
}

/// The metrics of rewards `[pairs]` chosen / rejected under `prefix` (`rm/`, `val/rm/`).
fn reward_metrics(prefix: &str, chosen: &Tensor, rejected: &Tensor) -> rl_core::Result<Metrics> {
    let (c, r) = (
        chosen.detach().to_kind(Kind::Double),
        rejected.detach().to_kind(Kind::Double),
    );
    let mean = |t: &Tensor| t.mean(Kind::Double).double_value(&[]);
    let mut m = Metrics::new();
    m.push(
        format!("{prefix}accuracy"),
        rm::accuracy(&c, &r).map_err(wrap)?,
    );
    m.push(format!("{prefix}chosen_reward"), mean(&c));
    m.push(format!("{prefix}rejected_reward"), mean(&r));
    m.push(format!("{prefix}margin"), mean(&(&c - &r)));
    Ok(m)
}

/// The Bradley–Terry loss as the reward-model worker's objective ([`rm::pairwise_loss`]).
/// Reads `response_mask`, [`PAIR_INDEX`] and optionally [`RM_MARGIN`]; rows come in
/// (chosen, rejected) pairs.
///
/// The micro-batch's loss is its pairs' mean loss scaled by its share of the mini-batch's pairs
/// (`MiniBatchInfo::sequences / 2`), so accumulation over micro-batches is exact. Under data
/// parallelism the count is the global mini-batch's and the loss is multiplied by `dp_size`
/// (`meta_info.dp_size`, as the DPO loss), so the ranks' averaged gradients are the gradient of
/// the whole global mini-batch. Logs `rm/loss`
/// (summed over micro-batches: the mini-batch loss), `rm/accuracy`, `rm/chosen_reward`,
/// `rm/rejected_reward` and `rm/margin` (the mean reward gap, chosen minus rejected).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BradleyTerryLoss {
    /// See [`RmTrainerConfig::margin`].
    pub margin: f64,
    /// See [`RmTrainerConfig::center_rewards_coefficient`].
    pub center_rewards_coefficient: f64,
}

impl ValueObjective for BradleyTerryLoss {
    fn loss(
        &self,
        micro: &Batch,
        values: &Tensor,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        check_pairs(micro)?;
        let seq = row_rewards(values, micro.get(keys::RESPONSE_MASK)?)?;
        let (c, r) = split_pairs(&seq);
        let pairs = c.size()[0];
        let margin = pair_margin(micro, self.margin, pairs)?;
        let mean = rm::pairwise_loss(&c, &r, margin.as_ref(), self.center_rewards_coefficient)
            .map_err(wrap)?;
        let mini_pairs = (info.sequences / 2.0).max(1.0);
        let dp = dist::dp_size(micro) as f64;
        let loss = mean * (pairs as f64 / mini_pairs * dp);
        let mut m = reward_metrics("rm/", &c, &r)?;
        m.push("rm/loss", loss.detach().double_value(&[]));
        Ok((loss, m))
    }
}

/// What `trainer_state.json` of an RM checkpoint holds besides `rm/`.
#[derive(Serialize, Deserialize)]
struct RmTrainerState {
    global_step: u64,
    train_source: Value,
}

/// Reward-model training (TRL's `RewardTrainer`, OpenRLHF's `train_rm`): each
/// [`step`](Trainer::step) takes a batch of (chosen, rejected) row pairs in the rollout layout
/// (`input_ids`, `attention_mask`, `position_ids`, `responses`, `response_mask`; rows `2i`
/// chosen, `2i + 1` rejected) and makes one `update` of the reward-model worker with
/// [`BradleyTerryLoss`].
///
/// The worker should be built with `rollout_n = 2` so its mini-batch size counts pairs, without
/// shuffling and with an even micro-batch size. Validation reports `val/rm/accuracy` (the share
/// of held-out pairs ranked right), `val/rm/loss`, `val/rm/chosen_reward`,
/// `val/rm/rejected_reward` and `val/rm/margin`, pooled over every pair. A checkpoint holds
/// `rm/` (the worker's state: a Hugging Face `*ForSequenceClassification` folder plus the
/// optimiser) and `trainer_state.json` (step and data position), so resume is exact.
///
/// Data parallel with [`with_group`](Self::with_group).
pub struct RmTrainer {
    cfg: RmTrainerConfig,
    rm: Box<dyn Critic>,
    train: Box<dyn BatchSource>,
    val: Vec<Batch>,
    global_step: u64,
    dp: Option<Dp>,
}

impl std::fmt::Debug for RmTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RmTrainer")
            .field("cfg", &self.cfg)
            .field("global_step", &self.global_step)
            .finish()
    }
}

impl RmTrainer {
    /// A trainer at step 0 over the reward-model worker `rm`.
    pub fn new(
        cfg: RmTrainerConfig,
        rm: Box<dyn Critic>,
        train: Box<dyn BatchSource>,
        val: Vec<Batch>,
    ) -> rl_core::Result<Self> {
        cfg.check()?;
        Ok(RmTrainer {
            cfg,
            rm,
            train,
            val,
            global_step: 0,
            dp: None,
        })
    }

    /// Makes the trainer one rank of a data-parallel job over `group`, as
    /// `DpoTrainer::with_group`: the worker must have been given the same group
    /// (`RmWorker::with_group`, whose `train_batch_size` counts global pairs) and the source
    /// must yield this rank's contiguous share of each global batch of `pairs` pairs
    /// (`preference_data.train_batch_size`; pairs are never split over ranks).
    /// [`BradleyTerryLoss`] then normalises by the global pair count times `dp_size`, so the
    /// averaged gradients are one process's; each step's metrics are combined over the ranks,
    /// the ranks' weights are compared after the first step, validation scores each rank's
    /// share of the pairs of every validation batch and pools the gathered rewards, and only
    /// rank 0 writes checkpoints (a no-op without any collective elsewhere); every rank loads
    /// them, at any world size.
    ///
    /// Errors when `pairs` does not split over the ranks or the worker was not given a group of
    /// the same size.
    pub fn with_group(mut self, group: SharedCollective, pairs: usize) -> rl_core::Result<Self> {
        self.dp = Some(Dp::for_role(
            group,
            "reward-model",
            self.rm.data_parallel_ranks(),
            "preference_data.train_batch_size",
            pairs,
        )?);
        Ok(self)
    }

    /// The config.
    pub fn config(&self) -> &RmTrainerConfig {
        &self.cfg
    }

    /// Gives the worker back.
    pub fn into_rm(self) -> Box<dyn Critic> {
        self.rm
    }
}

impl Trainer for RmTrainer {
    fn global_step(&self) -> u64 {
        self.global_step
    }

    fn total_steps(&self) -> u64 {
        self.cfg.total_training_steps
    }

    fn step(&mut self) -> rl_core::Result<StepMetrics> {
        let t = Instant::now();
        let mut batch = self.train.next_batch()?;
        mark_pairs(&mut batch)?;
        let t_upd = Instant::now();
        let metrics = self.rm.update(&batch, &self.cfg.objective())?;
        let mut m: StepMetrics = metrics.mean();
        self.global_step += 1;
        m.insert("timing_s/update_rm".into(), t_upd.elapsed().as_secs_f64());
        m.insert("timing_s/step".into(), t.elapsed().as_secs_f64());
        m.insert("training/global_step".into(), self.global_step as f64);
        match &mut self.dp {
            Some(dp) => {
                let rm = self.rm.as_ref();
                dp.check_digests_once("reward-model weights", || rm.weights_digest())?;
                dp.reduce(m, batch.len() as f64)
            }
            None => Ok(m),
        }
    }

    fn validate(&mut self) -> rl_core::Result<(StepMetrics, Vec<Sample>)> {
        let (rank, world) = self.dp.as_ref().map_or((0, 1), |d| (d.rank, d.world));
        let mut parts = Vec::new();
        for b in &self.val {
            // each rank scores its contiguous share of the batch's pairs
            let pairs = dist::shard_range(b.len() / 2, rank, world);
            if pairs.is_empty() {
                continue;
            }
            let mut b = b.slice(2 * pairs.start..2 * pairs.end)?;
            mark_pairs(&mut b)?;
            let v = self.rm.compute_values(&b)?;
            let seq = row_rewards(v.get(keys::VALUES)?, b.get(keys::RESPONSE_MASK)?)?;
            let (c, r) = split_pairs(&seq);
            let pairs = c.size()[0];
            let margin = pair_margin(&b, self.cfg.margin, pairs)?
                .unwrap_or_else(|| c.zeros_like())
                .to_device(c.device());
            // [pairs, 3]: chosen, rejected, margin
            parts.push(Tensor::stack(&[c, r, margin], 1).to_device(tch::Device::Cpu));
        }
        let mut cols = if parts.is_empty() {
            Tensor::zeros([0, 3], (Kind::Float, tch::Device::Cpu))
        } else {
            Tensor::cat(&parts, 0).to_kind(Kind::Float)
        };
        if let Some(dp) = self.dp.as_ref().filter(|d| d.world > 1) {
            cols = dist::gather_rows(&mut *dist::lock(&dp.group)?, &cols)?;
        }
        let mut m = StepMetrics::new();
        if cols.size()[0] == 0 {
            return Ok((m, Vec::new()));
        }
        let (c, r, margin) = (cols.select(1, 0), cols.select(1, 1), cols.select(1, 2));
        let loss = rm::pairwise_loss(&c, &r, Some(&margin), self.cfg.center_rewards_coefficient)
            .map_err(wrap)?;
        m.extend(reward_metrics("val/rm/", &c, &r)?.mean());
        m.insert("val/rm/loss".into(), loss.double_value(&[]));
        Ok((m, Vec::new()))
    }

    fn save_checkpoint(&self, dir: &Path) -> rl_core::Result<()> {
        // every rank holds the same weights and the same global source state: rank 0 writes;
        // the others only join the gathering of a ZeRO-sharded optimiser state
        if self.dp.as_ref().is_some_and(|d| d.rank != 0) {
            return self.rm.save_state(&dir.join("rm"));
        }
        let rm_dir = dir.join("rm");
        std::fs::create_dir_all(&rm_dir).map_err(|e| io_err(&rm_dir, e))?;
        self.rm.save_state(&rm_dir)?;
        let state = RmTrainerState {
            global_step: self.global_step,
            train_source: self.train.state(),
        };
        write_json(&dir.join("trainer_state.json"), &state)
    }

    fn load_checkpoint(&mut self, dir: &Path) -> rl_core::Result<()> {
        let state: RmTrainerState = read_json(&dir.join("trainer_state.json"))?;
        self.rm.load_state(&dir.join("rm"))?;
        self.train.load_state(&state.train_source)?;
        self.global_step = state.global_step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair_batch(scores: &[f32]) -> (Batch, Tensor) {
        let n = scores.len() as i64;
        let mut b = Batch::new();
        b.insert(
            keys::RESPONSES,
            Tensor::zeros([n, 2], (Kind::Int64, tch::Device::Cpu)),
        )
        .unwrap();
        let mask = Tensor::ones([n, 2], (Kind::Float, tch::Device::Cpu));
        b.insert(keys::RESPONSE_MASK, mask).unwrap();
        mark_pairs(&mut b).unwrap();
        // the score on the last response token, 0 on the first
        let values = Tensor::stack(
            &[
                Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)),
                Tensor::from_slice(scores),
            ],
            1,
        );
        (b, values)
    }

    #[test]
    fn loss_accumulates_exactly_and_is_ln2_at_ties() {
        let obj = RmTrainerConfig::default().objective();
        let info = MiniBatchInfo {
            tokens: 8.0,
            sequences: 4.0,
            on_policy: false,
        };
        let (b, v) = pair_batch(&[0.5, 0.5, -1.0, -1.0]);
        let (l, m) = obj.loss(&b, &v, info).unwrap();
        assert!((l.double_value(&[]) - std::f64::consts::LN_2).abs() < 1e-6);
        assert_eq!(m.values("rm/accuracy"), &[0.0]);
        let (b, v) = pair_batch(&[1.0, -0.5, 0.2, 0.7]);
        let whole = obj.loss(&b, &v, info).unwrap().0.double_value(&[]);
        let parts: f64 = (0..2)
            .map(|i| {
                let mb = b.slice(2 * i..2 * i + 2).unwrap();
                obj.loss(&mb, &v.narrow(0, 2 * i as i64, 2), info)
                    .unwrap()
                    .0
                    .double_value(&[])
            })
            .sum();
        assert!((whole - parts).abs() < 1e-6);
        let (_, m) = obj.loss(&b, &v, info).unwrap();
        assert_eq!(m.values("rm/accuracy"), &[0.5]);
        assert!((m.values("rm/margin")[0] - 0.5 * (1.5 - 0.5)).abs() < 1e-6);
        // a split pair is refused
        let odd = b.reorder(&[0, 2, 1, 3]).unwrap();
        let e = obj.loss(&odd, &v, info).unwrap_err().to_string();
        assert!(e.contains("pair"), "{e}");
    }

    #[test]
    fn margins_add_up() {
        let obj = BradleyTerryLoss {
            margin: 0.5,
            center_rewards_coefficient: 0.0,
        };
        let info = MiniBatchInfo {
            tokens: 4.0,
            sequences: 2.0,
            on_policy: false,
        };
        let (mut b, v) = pair_batch(&[1.0, 1.0]);
        b.insert(RM_MARGIN, Tensor::from_slice(&[0.5f32, 0.5]))
            .unwrap();
        let l = obj.loss(&b, &v, info).unwrap().0.double_value(&[]);
        // gap 0 - margin 1
        assert!((l - (1.0 + 1f64.exp()).ln()).abs() < 1e-6, "{l}");
    }

    #[test]
    fn config_names_the_bad_key() {
        let e = RmTrainerConfig {
            margin: -1.0,
            ..Default::default()
        }
        .check()
        .unwrap_err()
        .to_string();
        assert!(e.contains("margin"), "{e}");
        let e = serde_json::from_str::<RmTrainerConfig>(r#"{"margn": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("margn"), "{e}");
    }
}
