//! [`OnlineDpoTrainer`]: online DPO (TRL's `OnlineDPOTrainer`, verl-recipe's online-DPO actor):
//! `n` generations per prompt from the current policy, scored by the reward role, the best and
//! worst of each prompt's group paired (ties skipped and counted), and the DPO loss against the
//! frozen reference.

use std::path::Path;
use std::time::Instant;

use rl_core::roles::{Actor, Reference, Reward, Rollout};
use rl_core::{Batch, Sample, StepMetrics, Trainer, keys};
use tch::Kind;

use crate::trainer::preference::{
    DpoLoss, DpoTrainerConfig, PairTrainerState, RefCache, prepare_pairs,
};
use crate::trainer::source::BatchSource;
use crate::trainer::spin::{interleave_pairs, task_validation};

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
        })
    }
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
        let (mut chosen, mut rejected, ties) = best_worst_pairs(&scores, n);
        let keep = chosen.len() / self.pairs_per_update * self.pairs_per_update;
        let dropped = chosen.len() - keep;
        chosen.truncate(keep);
        rejected.truncate(keep);
        let mut m = StepMetrics::new();
        if keep > 0 {
            let mut batch =
                interleave_pairs(&generated.reorder(&chosen)?, &generated.reorder(&rejected)?)?;
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
        let groups = prompts.len().max(1) as f64;
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
        Ok(m)
    }

    fn validate(&mut self) -> rl_core::Result<(StepMetrics, Vec<Sample>)> {
        let m = task_validation(
            self.rollout.as_mut(),
            self.reward.as_mut(),
            &self.val,
            self.global_step,
            None,
        )?;
        Ok((m, Vec::new()))
    }

    fn save_checkpoint(&self, dir: &Path) -> rl_core::Result<()> {
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
