//! [`SpinTrainer`]: self-play fine-tuning (verl-recipe's `spin/spin_trainer.py`): the DPO loss
//! with chosen = the dataset's ground-truth response and rejected = the current policy's own
//! generation, the reference replaced by the current policy every `ref_update_freq` steps.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::{Actor, Reference, Reward, Rollout};
use rl_core::{Batch, Sample, StepMetrics, Trainer, keys};
use tch::{Kind, Tensor};

use crate::trainer::dp::{Dp, ValBatches};

use crate::trainer::preference::{
    DpoLoss, DpoTrainerConfig, PairTrainerState, RefCache, prepare_pairs,
};
use crate::trainer::source::BatchSource;

/// Which weights a new reference is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefInit {
    /// The initial model (the SFT checkpoint the run started from).
    Initial,
    /// The policy's current weights.
    Policy,
}

/// Builds a frozen reference from [`RefInit`]'s weights (the composer closes over the policy's
/// shared weights and the initial checkpoint's path).
pub type ReferenceFactory = Box<dyn FnMut(RefInit) -> rl_core::Result<Box<dyn Reference>>>;

/// The rollout-layout keys a pair batch is made of.
pub(crate) const LAYOUT: [&str; 6] = [
    keys::INPUT_IDS,
    keys::ATTENTION_MASK,
    keys::POSITION_IDS,
    keys::PROMPTS,
    keys::RESPONSES,
    keys::RESPONSE_MASK,
];

/// The left-padded prompt half of a rollout-layout batch, with its columns.
pub(crate) fn prompt_half(batch: &Batch) -> rl_core::Result<Batch> {
    let p = batch.get(keys::PROMPTS)?.size()[1];
    let mut out = Batch::new();
    out.insert(keys::INPUT_IDS, batch.get(keys::PROMPTS)?.shallow_clone())?;
    for k in [keys::ATTENTION_MASK, keys::POSITION_IDS] {
        out.insert(k, batch.get(k)?.narrow(1, 0, p))?;
    }
    for k in batch.column_keys().map(str::to_owned).collect::<Vec<_>>() {
        out.insert_column(k.clone(), batch.column(&k)?.to_vec())?;
    }
    *out.meta_info_mut() = batch.meta_info().clone();
    Ok(out)
}

/// The layout keys of `batch` with responses right-padded (mask 0, token 0) to `width`.
///
/// # Shapes
/// - `batch`: rollout layout, responses `[batch, response_len]`, `response_len <= width`
/// - returns: the same keys with `response_len = width`
fn pad_responses(batch: &Batch, width: i64) -> rl_core::Result<Batch> {
    let r = batch.get(keys::RESPONSES)?.size()[1];
    let mut out = Batch::new();
    for k in LAYOUT {
        let t = batch.get(k)?;
        let extra = width - r;
        let t = if extra <= 0 || k == keys::PROMPTS {
            t.shallow_clone()
        } else if k == keys::POSITION_IDS {
            let last = t.narrow(1, t.size()[1] - 1, 1);
            let step = Tensor::arange_start(1, extra + 1, (t.kind(), t.device())).unsqueeze(0);
            Tensor::cat(&[t, &(last + step)], 1)
        } else {
            let pad = Tensor::zeros([t.size()[0], extra], (t.kind(), t.device()));
            Tensor::cat(&[t, &pad], 1)
        };
        out.insert(k, t)?;
    }
    Ok(out)
}

/// Interleaves two rollout-layout batches over the same prompts into (chosen, rejected) pairs.
///
/// # Shapes
/// - `chosen`, `rejected`: rollout layout with the same `[batch, prompt_len]` prompts
/// - returns: `2 * batch` rows, row `2i` from `chosen`, `2i + 1` from `rejected`
pub fn interleave_pairs(chosen: &Batch, rejected: &Batch) -> rl_core::Result<Batch> {
    let n = chosen.len();
    if rejected.len() != n {
        return Err(rl_core::Error::BatchSize {
            key: "rejected".into(),
            expected: n,
            got: rejected.len(),
        });
    }
    let (pc, pr) = (
        chosen.get(keys::PROMPTS)?.size(),
        rejected.get(keys::PROMPTS)?.size(),
    );
    if pc != pr {
        return Err(rl_core::Error::Shape {
            key: "prompts".into(),
            expected: format!("{pc:?} (the chosen side's prompts)"),
            got: pr,
        });
    }
    let width =
        chosen.get(keys::RESPONSES)?.size()[1].max(rejected.get(keys::RESPONSES)?.size()[1]);
    let both = Batch::concat(&[
        pad_responses(chosen, width)?,
        pad_responses(rejected, width)?,
    ])?;
    let order: Vec<i64> = (0..n as i64).flat_map(|i| [i, i + n as i64]).collect();
    both.reorder(&order)
}

/// Each row's response tokens under its `response_mask`.
///
/// # Shapes
/// - `batch`: `responses` and `response_mask` `[batch, response_len]`
/// - returns: `batch` token lists
fn masked_responses(batch: &Batch) -> rl_core::Result<Vec<Vec<i64>>> {
    let ids = Vec::<Vec<i64>>::try_from(batch.get(keys::RESPONSES)?.to_kind(Kind::Int64))?;
    let mask = Vec::<Vec<f64>>::try_from(batch.get(keys::RESPONSE_MASK)?.to_kind(Kind::Double))?;
    Ok(ids
        .into_iter()
        .zip(mask)
        .map(|(r, m)| {
            r.into_iter()
                .zip(m)
                .filter(|&(_, m)| m != 0.0)
                .map(|(t, _)| t)
                .collect()
        })
        .collect())
}

/// The share of rows whose generated response equals the ground truth token for token: such
/// a SPIN pair has chosen = rejected, so it carries no gradient. Near 1, the policy imitates
/// the data perfectly and SPIN has nothing left to learn.
///
/// # Shapes
/// - `truth`, `generated`: `responses`, `response_mask` `[batch, response_len]` (the two
///   response widths may differ)
/// - returns: a share in `[0, 1]`
pub(crate) fn identical_share(truth: &Batch, generated: &Batch) -> rl_core::Result<f64> {
    let (a, b) = (masked_responses(truth)?, masked_responses(generated)?);
    if a.len() != b.len() {
        return Err(rl_core::Error::BatchSize {
            key: "generated".into(),
            expected: a.len(),
            got: b.len(),
        });
    }
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    Ok(same as f64 / a.len().max(1) as f64)
}

/// Task accuracy of validation prompt batches: generate (with `validate: true`), score, and
/// average `token_level_scores` per `data_source` as `val/test_score/<data_source>`.
pub(crate) fn task_validation(
    rollout: &mut dyn Rollout,
    reward: &mut dyn Reward,
    val: &[Batch],
    global_step: u64,
    dp: Option<&Dp>,
) -> rl_core::Result<StepMetrics> {
    let (rank, world) = dp.map_or((0, 1), |d| (d.rank, d.world));
    // data_source -> (sum of scores, rows)
    let mut per_source: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for b in val {
        // each rank generates for its contiguous share of the batch
        let shard = dist::shard_range(b.len(), rank, world);
        if shard.is_empty() {
            continue;
        }
        let offset = shard.start;
        let mut prompts = if world > 1 {
            b.slice(shard)?
        } else {
            b.shallow_clone()
        };
        let meta = prompts.meta_info_mut();
        meta.insert("validate".into(), true.into());
        // sampled validation draws each row's stream by its index in the whole batch
        meta.insert(dist::DP_PROMPT_OFFSET.into(), offset.into());
        meta.insert("global_step".into(), (global_step * 1000 + 999).into());
        let mut out = rollout.generate(&prompts)?;
        out.union(reward.score(&out)?)?;
        let scores = Vec::<f64>::try_from(out.get(keys::TOKEN_LEVEL_SCORES)?.sum_dim_intlist(
            [-1].as_slice(),
            false,
            Kind::Double,
        ))?;
        let sources: Vec<String> = out
            .column(keys::DATA_SOURCE)?
            .iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
            .collect();
        for (s, ds) in scores.into_iter().zip(sources) {
            let e = per_source.entry(ds).or_default();
            e.0 += s;
            e.1 += 1.0;
        }
    }
    let local = per_source
        .into_iter()
        .map(|(ds, (sum, n))| (format!("val/test_score/{ds}"), (sum / n.max(1.0), n)))
        .collect();
    match dp.filter(|d| d.world > 1) {
        // means weighted by each rank's rows: the mean over the whole validation set
        Some(d) => dist::reduce_metrics(&mut *dist::lock(&d.group)?, &local, |_| {
            dist::MetricReduce::Mean
        }),
        None => Ok(local.into_iter().map(|(k, (v, _))| (k, v)).collect()),
    }
}

/// SPIN. Each [`step`](Trainer::step): take a batch of prompts with their ground-truth responses
/// in the rollout layout (SFT rows: `input_ids`, `attention_mask`, `position_ids`, `prompts`,
/// `responses`, `response_mask`, plus `data_source` etc.), generate one response per prompt with
/// the current policy (the rollout's `n` must be 1), pair ground truth (chosen) with the
/// generation (rejected), and make one `actor.update` with [`DpoLoss`] against the reference.
/// After every `ref_update_freq`-th step the reference is rebuilt from the policy's weights
/// (verl-recipe's `ref_update_freq`); in between it stays frozen.
///
/// Build the actor with `rollout_n = 2` (pairs), `shuffle = false`, an even micro-batch size.
/// Validation generates on the validation prompts and reports `val/test_score/<data_source>`.
/// Resume rebuilds the reference: exact when the checkpoint's step is a multiple of
/// `ref_update_freq` or before the first update (otherwise `load_checkpoint` is an error).
pub struct SpinTrainer {
    cfg: DpoTrainerConfig,
    actor: Box<dyn Actor>,
    rollout: Box<dyn Rollout>,
    reference: Box<dyn Reference>,
    make_reference: ReferenceFactory,
    reward: Box<dyn Reward>,
    train: Box<dyn BatchSource>,
    val: Vec<Batch>,
    global_step: u64,
    dp: Option<Dp>,
}

impl std::fmt::Debug for SpinTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinTrainer")
            .field("cfg", &self.cfg)
            .field("global_step", &self.global_step)
            .finish()
    }
}

impl SpinTrainer {
    /// A trainer at step 0, its reference built with `make_reference(RefInit::Initial)`;
    /// `reward` scores validation generations only.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: DpoTrainerConfig,
        actor: Box<dyn Actor>,
        rollout: Box<dyn Rollout>,
        mut make_reference: ReferenceFactory,
        reward: Box<dyn Reward>,
        train: Box<dyn BatchSource>,
        val: Vec<Batch>,
    ) -> rl_core::Result<Self> {
        cfg.check()?;
        if cfg.reference_free {
            return Err(rl_core::Error::InvalidArgument {
                name: "reference_free",
                reason: "SPIN is defined against a reference; set reference_free = false".into(),
            });
        }
        let reference = make_reference(RefInit::Initial)?;
        Ok(SpinTrainer {
            cfg,
            actor,
            rollout,
            reference,
            make_reference,
            reward,
            train,
            val,
            global_step: 0,
            dp: None,
        })
    }

    /// Makes the trainer one rank of a data-parallel job over `group`, as `DpoTrainer::with_group`:
    /// the actor must have been given the same group (`rollout_n = 2`, so
    /// `ppo_mini_batch_size` counts global pairs) and the source must yield this rank's
    /// contiguous share of each global batch of `rows` rows (`sft.train_batch_size`). Each rank
    /// generates for its own rows, each row from the random stream of its global index
    /// (`meta_info.dp_prompt_offset`), so the generations, hence the pairs, are those of one
    /// process; every row makes exactly one pair, so the ranks' pair counts stay equal. The
    /// reference is rebuilt from the (identical) policy on every rank; metrics are reduced,
    /// weights compared after the first step, validation sharded, and only rank 0 writes
    /// checkpoints.
    ///
    /// Errors when `rows` does not split over the ranks or the actor was not given a group of
    /// the same size.
    pub fn with_group(mut self, group: SharedCollective, rows: usize) -> rl_core::Result<Self> {
        let val = ValBatches::rows(&self.val);
        self.dp = Some(Dp::new(
            group,
            self.actor.as_ref(),
            "sft.train_batch_size",
            rows,
            val,
        )?);
        Ok(self)
    }

    /// The actor (to probe its log-probs in tests).
    pub fn actor_mut(&mut self) -> &mut dyn Actor {
        self.actor.as_mut()
    }

    /// The current reference (to probe its log-probs in tests).
    pub fn reference_mut(&mut self) -> &mut dyn Reference {
        self.reference.as_mut()
    }
}

impl Trainer for SpinTrainer {
    fn global_step(&self) -> u64 {
        self.global_step
    }

    fn total_steps(&self) -> u64 {
        self.cfg.total_training_steps
    }

    fn step(&mut self) -> rl_core::Result<StepMetrics> {
        let t = Instant::now();
        let truth = self.train.next_batch()?;
        let mut prompts = prompt_half(&truth)?;
        prompts
            .meta_info_mut()
            .insert("global_step".into(), self.global_step.into());
        if let Some(dp) = self.dp.as_ref().filter(|d| d.world > 1) {
            // equal shards of the global batch: this rank's rows start at rank * len
            let offset = dp.rank * prompts.len();
            let meta = prompts.meta_info_mut();
            meta.insert(dist::DP_RANK.into(), dp.rank.into());
            meta.insert(dist::DP_PROMPT_OFFSET.into(), offset.into());
        }
        let t_gen = Instant::now();
        let generated = self.rollout.generate(&prompts)?;
        let gen_s = t_gen.elapsed().as_secs_f64();
        if generated.len() != truth.len() {
            return Err(rl_core::Error::InvalidArgument {
                name: "actor_rollout_ref.rollout.n",
                reason: format!(
                    "SPIN pairs one generation with each ground truth: expected {} rows, got {}",
                    truth.len(),
                    generated.len()
                ),
            });
        }
        let identical = identical_share(&truth, &generated)?;
        let mut batch = interleave_pairs(&truth, &generated)?;
        let t_ref = Instant::now();
        let mut nocache = RefCache::new(false);
        prepare_pairs(
            &mut batch,
            &self.cfg,
            Some(&mut self.reference),
            &mut nocache,
        )?;
        let ref_s = t_ref.elapsed().as_secs_f64();
        let t_upd = Instant::now();
        let metrics = self.actor.update(
            &batch,
            &DpoLoss {
                cfg: self.cfg.dpo(),
            },
        )?;
        let mut m: StepMetrics = metrics.mean();
        self.global_step += 1;
        let f = self.cfg.ref_update_freq;
        let updated = f > 0 && self.global_step.is_multiple_of(f);
        if updated {
            self.reference = (self.make_reference)(RefInit::Policy)?;
        }
        let mask = generated.get(keys::RESPONSE_MASK)?;
        m.insert(
            "response_length/mean".into(),
            mask.sum(Kind::Double).double_value(&[]) / truth.len().max(1) as f64,
        );
        m.insert("spin/ref_updated".into(), f64::from(u8::from(updated)));
        m.insert("spin/identical_ratio".into(), identical);
        m.insert("timing_s/gen".into(), gen_s);
        m.insert("timing_s/ref".into(), ref_s);
        m.insert(
            "timing_s/update_actor".into(),
            t_upd.elapsed().as_secs_f64(),
        );
        m.insert("timing_s/step".into(), t.elapsed().as_secs_f64());
        match &mut self.dp {
            Some(dp) => {
                dp.check_replicas_once(self.actor.as_ref())?;
                dp.reduce(m, truth.len() as f64)
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
        let f = self.cfg.ref_update_freq;
        let init = if f == 0 || state.global_step < f {
            RefInit::Initial
        } else if state.global_step.is_multiple_of(f) {
            RefInit::Policy
        } else {
            return Err(rl_core::Error::InvalidArgument {
                name: "ref_update_freq",
                reason: format!(
                    "SPIN resumes exactly only from a step that is a multiple of \
                     ref_update_freq = {f} (the reference is the policy of that step); \
                     the checkpoint is at step {}",
                    state.global_step
                ),
            });
        };
        let step = state.restore(dir, self.actor.as_mut(), self.train.as_mut())?;
        self.reference = (self.make_reference)(init)?;
        self.global_step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn responses(rows: &[&[i64]], width: i64) -> Batch {
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        for r in rows {
            for j in 0..width as usize {
                ids.push(r.get(j).copied().unwrap_or(0));
                mask.push(if j < r.len() { 1.0f32 } else { 0.0 });
            }
        }
        let n = rows.len() as i64;
        let mut b = Batch::new();
        b.insert(keys::RESPONSES, Tensor::from_slice(&ids).view([n, width]))
            .unwrap();
        b.insert(
            keys::RESPONSE_MASK,
            Tensor::from_slice(&mask).view([n, width]),
        )
        .unwrap();
        b
    }

    #[test]
    fn identical_share_compares_masked_tokens_across_widths() {
        let truth = responses(&[&[5, 6, 3], &[7, 3], &[4, 4, 3]], 3);
        // same tokens, wider padding; a prefix of the truth; a different token
        let generated = responses(&[&[5, 6, 3], &[7], &[4, 5, 3]], 5);
        let share = identical_share(&truth, &generated).unwrap();
        assert!((share - 1.0 / 3.0).abs() < 1e-12, "{share}");
        let short = responses(&[&[5]], 1);
        assert!(identical_share(&truth, &short).is_err());
    }
}
