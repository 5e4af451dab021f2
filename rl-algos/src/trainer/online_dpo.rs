//! [`OnlineDpoTrainer`]: online DPO (TRL's `OnlineDPOTrainer`, verl-recipe's online-DPO actor):
//! `n` generations per prompt from the current policy, scored by the reward role, the best and
//! worst of each prompt's group paired (ties skipped and counted), and the DPO loss against the
//! frozen reference.

use std::path::Path;
use std::time::Instant;

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::{Actor, Reference, Reward, Rollout};
use rl_core::{Batch, Sample, StepMetrics, Trainer, keys};
use tch::Kind;

use crate::trainer::dp::{self, Dp, ValBatches};

use crate::trainer::preference::{
    DpoLoss, DpoTrainerConfig, PairTrainerState, RefCache, prepare_pairs,
};
use crate::trainer::source::BatchSource;
use crate::trainer::spin::{LAYOUT, interleave_pairs, task_validation};

/// Picks (chosen, rejected) rows from `n`-row groups of `scores`: the first best and the first
/// worst row of each group; a group whose best equals its worst is a tie and is skipped.
/// Returns the row indices and the number of ties.
pub fn best_worst_pairs(scores: &[f64], n: usize) -> (Vec<i64>, Vec<i64>, usize) {
    let (mut chosen, mut rejected, mut ties) = (Vec::new(), Vec::new(), 0);
    for (g, group) in scores.chunks(n.max(1)).enumerate() {
        let (mut best, mut worst) = (0, 0);
        for (i, &s) in group.iter().enumerate() {
            if s > group[best] {
                best = i;
            }
            if s < group[worst] {
                worst = i;
            }
        }
        if group[best] > group[worst] {
            chosen.push((g * n + best) as i64);
            rejected.push((g * n + worst) as i64);
        } else {
            ties += 1;
        }
    }
    (chosen, rejected, ties)
}

/// Online DPO. Each [`step`](Trainer::step): take a prompt batch, generate `n` responses per
/// prompt (the rollout's `n` must equal `cfg.n`), score them with the reward role (rule rewards
/// or a reward model), pair each prompt's best and worst response (ties skipped and counted in
/// `online_dpo/ties`), keep a multiple of `pairs_per_update` pairs (the actor's
/// `ppo_mini_batch_size`; the rest are counted in `online_dpo/dropped_pairs`), and make one
/// `actor.update` with [`DpoLoss`] against the frozen reference. A step with fewer pairs than
/// `pairs_per_update` makes no update.
pub struct OnlineDpoTrainer {
    cfg: DpoTrainerConfig,
    actor: Box<dyn Actor>,
    rollout: Box<dyn Rollout>,
    reference: Option<Box<dyn Reference>>,
    reward: Box<dyn Reward>,
    train: Box<dyn BatchSource>,
    val: Vec<Batch>,
    pairs_per_update: usize,
    global_step: u64,
    dp: Option<Dp>,
}

impl std::fmt::Debug for OnlineDpoTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnlineDpoTrainer")
            .field("cfg", &self.cfg)
            .field("global_step", &self.global_step)
            .finish()
    }
}

impl OnlineDpoTrainer {
    /// A trainer at step 0; `reference` may be `None` only when `reference_free`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: DpoTrainerConfig,
        actor: Box<dyn Actor>,
        rollout: Box<dyn Rollout>,
        reference: Option<Box<dyn Reference>>,
        reward: Box<dyn Reward>,
        train: Box<dyn BatchSource>,
        val: Vec<Batch>,
        pairs_per_update: usize,
    ) -> rl_core::Result<Self> {
        cfg.check()?;
        if reference.is_none() && !cfg.reference_free {
            return Err(rl_core::Error::InvalidArgument {
                name: "reference_free",
                reason: "online DPO needs a reference role unless reference_free = true".into(),
            });
        }
        if pairs_per_update == 0 {
            return Err(rl_core::Error::InvalidArgument {
                name: "actor_rollout_ref.actor.ppo_mini_batch_size",
                reason: "online DPO needs at least one pair per update".into(),
            });
        }
        Ok(OnlineDpoTrainer {
            cfg,
            actor,
            rollout,
            reference,
            reward,
            train,
            val,
            pairs_per_update,
            global_step: 0,
            dp: None,
        })
    }

    /// Makes the trainer one rank of a data-parallel job over `group`: the actor must have been
    /// given the same group (`rollout_n = 2`) and the source must yield this rank's contiguous
    /// share of each global batch of `prompts` prompts (`data.train_batch_size`).
    ///
    /// Each rank generates for its own prompts, each row from the random stream of its global
    /// index (`meta_info.dp_prompt_offset`), and pairs its groups' best and worst responses.
    /// Ties make the ranks' pair counts differ, so the pairs are then gathered in global prompt
    /// order (prompts left-padded and responses right-padded to the widths of the whole
    /// batch, which are one process's), the first multiple of `pairs_per_update` is kept, and
    /// each global mini-batch of `pairs_per_update` pairs is split evenly over the ranks: the
    /// update is the one-process update. Metrics are global, validation sharded, and only rank
    /// 0 writes checkpoints.
    ///
    /// Errors when `prompts` or `pairs_per_update` does not split over the ranks, or the actor
    /// was not given a group of the same size.
    pub fn with_group(mut self, group: SharedCollective, prompts: usize) -> rl_core::Result<Self> {
        let val = ValBatches::rows(&self.val);
        let dp = Dp::new(
            group,
            self.actor.as_ref(),
            "data.train_batch_size",
            prompts,
            val,
        )?;
        if !self.pairs_per_update.is_multiple_of(dp.world) {
            return Err(rl_core::Error::InvalidArgument {
                name: "actor_rollout_ref.actor.ppo_mini_batch_size",
                reason: format!(
                    "{} pairs per update do not split over {} data-parallel ranks",
                    self.pairs_per_update, dp.world
                ),
            });
        }
        self.dp = Some(dp);
        Ok(self)
    }
}

/// One data-parallel step's pairs: every rank's `local` pairs (rollout layout, `2 * c_r` rows)
/// gathered in rank (global prompt) order, the first multiple of `per_update` kept, and this
/// rank's share of each global mini-batch. Returns (this rank's pair batch, kept pairs, dropped
/// pairs), the same counts on every rank.
fn share_pairs(
    dp: &Dp,
    local: &Batch,
    per_update: usize,
) -> rl_core::Result<(Batch, usize, usize)> {
    let mut g = dist::lock(&dp.group)?;
    let mut counts = vec![0.0; dp.world];
    counts[dp.rank] = (local.len() / 2) as f64;
    dist::all_reduce_f64(&mut *g, &mut counts, dist::ReduceOp::Sum)?;
    let mut widths = [
        local.get(keys::PROMPTS)?.size()[1] as f64,
        local.get(keys::RESPONSES)?.size()[1] as f64,
    ];
    dist::all_reduce_f64(&mut *g, &mut widths, dist::ReduceOp::Max)?;
    let padded = dp::pad_to_widths(local, widths[0] as i64, widths[1] as i64)?;
    let mut all = Batch::new();
    for k in LAYOUT {
        all.insert(k, dist::gather_rows(&mut *g, padded.get(k)?)?)?;
    }
    let total = counts.iter().sum::<f64>() as usize;
    let keep = total / per_update * per_update;
    let share = per_update / dp.world;
    let rows: Vec<i64> = (0..keep / per_update)
        .flat_map(|m| {
            let first = m * per_update + dp.rank * share;
            (first..first + share).flat_map(|p| [2 * p as i64, 2 * p as i64 + 1])
        })
        .collect();
    Ok((all.reorder(&rows)?, keep, total - keep))
}

impl Trainer for OnlineDpoTrainer {
    fn global_step(&self) -> u64 {
        self.global_step
    }

    fn total_steps(&self) -> u64 {
        self.cfg.total_training_steps
    }

    fn step(&mut self) -> rl_core::Result<StepMetrics> {
        let t = Instant::now();
        let mut prompts = self.train.next_batch()?;
        prompts
            .meta_info_mut()
            .insert("global_step".into(), self.global_step.into());
        if let Some(dp) = self.dp.as_ref().filter(|d| d.world > 1) {
            // equal shards of the global batch: this rank's prompts start at rank * len
            let offset = dp.rank * prompts.len();
            let meta = prompts.meta_info_mut();
            meta.insert(dist::DP_RANK.into(), dp.rank.into());
            meta.insert(dist::DP_PROMPT_OFFSET.into(), offset.into());
        }
        let t_gen = Instant::now();
        let mut generated = self.rollout.generate(&prompts)?;
        let gen_s = t_gen.elapsed().as_secs_f64();
        let n = self.cfg.n;
        if generated.len() != prompts.len() * n {
            return Err(rl_core::Error::InvalidArgument {
                name: "n",
                reason: format!(
                    "expected {} rows ({} prompts x n = {n}), the rollout gave {}: set \
                     actor_rollout_ref.rollout.n = n",
                    prompts.len() * n,
                    prompts.len(),
                    generated.len()
                ),
            });
        }
        generated.union(self.reward.score(&generated)?)?;
        let scores =
            Vec::<f64>::try_from(generated.get(keys::TOKEN_LEVEL_SCORES)?.sum_dim_intlist(
                [-1].as_slice(),
                false,
                Kind::Double,
            ))?;
        let (mut chosen, mut rejected, mut ties) = best_worst_pairs(&scores, n);
        let mut groups = prompts.len() as f64;
        let (batch, keep, dropped) = match self.dp.as_ref().filter(|d| d.world > 1) {
            Some(dp) => {
                let local =
                    interleave_pairs(&generated.reorder(&chosen)?, &generated.reorder(&rejected)?)?;
                let mut totals = [ties as f64, groups];
                dp.sum(&mut totals)?;
                (ties, groups) = (totals[0] as usize, totals[1]);
                let (batch, keep, dropped) = share_pairs(dp, &local, self.pairs_per_update)?;
                (Some(batch).filter(|_| keep > 0), keep, dropped)
            }
            None => {
                let keep = chosen.len() / self.pairs_per_update * self.pairs_per_update;
                let dropped = chosen.len() - keep;
                chosen.truncate(keep);
                rejected.truncate(keep);
                let batch = if keep > 0 {
                    Some(interleave_pairs(
                        &generated.reorder(&chosen)?,
                        &generated.reorder(&rejected)?,
                    )?)
                } else {
                    None
                };
                (batch, keep, dropped)
            }
        };
        let mut m = StepMetrics::new();
        if let Some(mut batch) = batch {
            let t_ref = Instant::now();
            let mut nocache = RefCache::new(false);
            prepare_pairs(&mut batch, &self.cfg, self.reference.as_mut(), &mut nocache)?;
            m.insert("timing_s/ref".into(), t_ref.elapsed().as_secs_f64());
            let t_upd = Instant::now();
            let metrics = self.actor.update(
                &batch,
                &DpoLoss {
                    cfg: self.cfg.dpo(),
                },
            )?;
            m.extend(metrics.mean());
            m.insert(
                "timing_s/update_actor".into(),
                t_upd.elapsed().as_secs_f64(),
            );
        }
        self.global_step += 1;
        let groups = groups.max(1.0);
        m.insert(
            "critic/score/mean".into(),
            scores.iter().sum::<f64>() / scores.len().max(1) as f64,
        );
        m.insert("online_dpo/pairs".into(), keep as f64);
        m.insert("online_dpo/ties".into(), ties as f64);
        m.insert("online_dpo/tie_ratio".into(), ties as f64 / groups);
        m.insert("online_dpo/dropped_pairs".into(), dropped as f64);
        m.insert("timing_s/gen".into(), gen_s);
        m.insert("timing_s/step".into(), t.elapsed().as_secs_f64());
        match &mut self.dp {
            // the counts are global already; the means are weighted by each rank's rows
            Some(dp) => {
                dp.check_replicas_once(self.actor.as_ref())?;
                dp.reduce(m, generated.len() as f64)
            }
            None => Ok(m),
        }
    }

    fn validate(&mut self) -> rl_core::Result<(StepMetrics, Vec<Sample>)> {
        let m = task_validation(
            self.rollout.as_mut(),
            self.reward.as_mut(),
            &self.val,
            self.global_step,
            self.dp.as_ref(),
        )?;
        Ok((m, Vec::new()))
    }

    fn save_checkpoint(&self, dir: &Path) -> rl_core::Result<()> {
        // every rank holds the same weights and the same global source state: rank 0 writes;
        // the others only join the gathering of a ZeRO-sharded optimiser state
        if self.dp.as_ref().is_some_and(|d| d.rank != 0) {
            return self.actor.save_state(&dir.join("actor"));
        }
        PairTrainerState::save(
            dir,
            self.actor.as_ref(),
            self.global_step,
            self.train.as_ref(),
        )
    }

    fn load_checkpoint(&mut self, dir: &Path) -> rl_core::Result<()> {
        let state = PairTrainerState::read(dir)?;
        self.global_step = state.restore(dir, self.actor.as_mut(), self.train.as_mut())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_pair_best_with_worst_and_skip_ties() {
        let scores = [0.0, 1.0, 0.5, 0.5, 1.0, 0.0, 0.0, 1.0, 0.5];
        let (c, r, ties) = best_worst_pairs(&scores[..6], 2);
        assert_eq!((c, r, ties), (vec![1, 4], vec![0, 5], 1));
        let (c, r, ties) = best_worst_pairs(&scores, 3);
        assert_eq!((c, r, ties), (vec![1, 4, 7], vec![0, 5, 6], 0));
    }
}
