//! Preference trainers on the PPO roles: the DPO objective handed to the actor, its config
//! ([`DpoTrainerConfig`]), and [`DpoTrainer`] (offline DPO on preference pairs, TRL's
//! `DPOTrainer` / verl-recipe's DPO actor loss).
//!
//! PPO's four models become two: the critic and the reward are dropped, the reference stays
//! frozen and moves into the loss. A batch holds each pair as two adjacent rows in the rollout
//! layout, chosen first (`2i` chosen, `2i + 1` rejected), so the actor's single padded forward
//! computes both responses; the actor must therefore never split a pair across mini- or
//! micro-batches (no shuffle, even micro-batch sizes), which [`DpoLoss`] checks.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::{Actor, Metrics, MiniBatchInfo, PolicyObjective, PolicyOutput, Reference};
use rl_core::{Batch, Sample, StepMetrics, Trainer, keys};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::{Kind, Tensor};

use crate::dpo::{self, DpoConfig, DpoLossType};
use crate::trainer::dp::{Dp, ValBatches};
use crate::trainer::source::BatchSource;

/// `[batch]` i64: the pair each row belongs to (rows `2i` and `2i + 1` hold `i`).
pub const PAIR_INDEX: &str = "pair_index";
/// `[batch]` f32: the reference's sequence log-prob of each row's response (summed over
/// `response_mask`), written by the trainer from `ref_log_prob` or its cache.
pub const REF_SEQ_LOG_PROB: &str = "ref_seq_log_prob";

/// The preference trainers' settings, under TRL's names (verl-recipe's `dpo_beta` etc. are the
/// same keys with a `dpo_` prefix).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoTrainerConfig {
    /// Inverse temperature of the implicit reward `beta * (log pi - log ref)`, positive.
    /// Default 0.1.
    pub beta: f64,
    /// `sigmoid` (DPO), `ipo` or `hinge`. Default `sigmoid`.
    pub loss_type: DpoLossType,
    /// Probability a label is flipped (conservative DPO, `sigmoid` only), in `[0, 0.5]`.
    /// Default 0.
    pub label_smoothing: f64,
    /// Drop the reference (a uniform reference): no reference forward at all. Default false.
    pub reference_free: bool,
    /// Compute each pair's reference log-probs once and reuse them on later epochs (the
    /// reference is frozen), saving a forward pass per step. Default false.
    pub precompute_ref_log_probs: bool,
    /// SPIN: replace the reference by the current policy every this many steps (verl-recipe's
    /// `ref_update_freq`); 0 = never. Default 0 (offline / online DPO ignore it).
    pub ref_update_freq: u64,
    /// Online DPO: responses generated per prompt, at least 2. Default 2.
    pub n: usize,
    /// Optimiser steps. Default 100.
    pub total_training_steps: u64,
}

impl Default for DpoTrainerConfig {
    fn default() -> Self {
        DpoTrainerConfig {
            beta: 0.1,
            loss_type: DpoLossType::Sigmoid,
            label_smoothing: 0.0,
            reference_free: false,
            precompute_ref_log_probs: false,
            ref_update_freq: 0,
            n: 2,
            total_training_steps: 100,
        }
    }
}

impl DpoTrainerConfig {
    /// The loss math's config.
    pub fn dpo(&self) -> DpoConfig {
        DpoConfig {
            dpo_beta: self.beta,
            dpo_loss_type: self.loss_type,
            dpo_label_smoothing: self.label_smoothing,
            reference_free: self.reference_free,
        }
    }

    /// Checks every range, naming the key at fault.
    pub fn check(&self) -> rl_core::Result<()> {
        let bad = |name: &'static str, reason: String| {
            Err(rl_core::Error::InvalidArgument { name, reason })
        };
        if !(self.beta > 0.0 && self.beta.is_finite()) {
            return bad("beta", format!("must be positive, got {}", self.beta));
        }
        if !(0.0..=0.5).contains(&self.label_smoothing) {
            return bad(
                "label_smoothing",
                format!("must be in [0, 0.5], got {}", self.label_smoothing),
            );
        }
        if self.label_smoothing != 0.0 && self.loss_type != DpoLossType::Sigmoid {
            return bad(
                "label_smoothing",
                format!(
                    "applies to loss_type = \"sigmoid\" only, got loss_type = \"{}\"",
                    self.loss_type
                ),
            );
        }
        if self.n < 2 {
            return bad(
                "n",
                format!("needs at least 2 responses per prompt, got {}", self.n),
            );
        }
        if self.total_training_steps == 0 {
            return bad("total_training_steps", "would run zero steps".into());
        }
        Ok(())
    }
}

fn wrap(e: crate::Error) -> rl_core::Error {
    match e {
        crate::Error::Core(c) => c,
        other => rl_core::Error::Role {
            role: "dpo loss",
            source: Box::new(other),
        },
    }
}

fn item(t: &Tensor) -> f64 {
    t.detach().double_value(&[])
}

/// Per-row sums of `log_prob` over `response_mask`.
///
/// # Shapes
/// - `log_prob`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`
/// - returns: `[batch]` f32
fn seq_sum(log_prob: &Tensor, response_mask: &Tensor) -> rl_core::Result<Tensor> {
    if log_prob.size() != response_mask.size() {
        return Err(rl_core::Error::Shape {
            key: "response_mask".into(),
            expected: format!("{:?} (the log-probs' shape)", log_prob.size()),
            got: response_mask.size(),
        });
    }
    Ok(
        (log_prob * response_mask.to_kind(log_prob.kind())).sum_dim_intlist(
            [-1].as_slice(),
            false,
            Kind::Float,
        ),
    )
}

/// Checks that `batch` holds whole pairs, chosen first: an even row count and
/// `pair_index[2i] == pair_index[2i + 1]`.
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
            name: "actor_rollout_ref.actor",
            reason: "a DPO micro-batch split a (chosen, rejected) pair: set shuffle = false, \
                     an even ppo_micro_batch_size_per_gpu and use_dynamic_bsz = false"
                .into(),
        });
    }
    Ok(())
}

/// Sequence log-probs split into (chosen, rejected).
///
/// # Shapes
/// - `seq`: `[2 * pairs]`
/// - returns: `[pairs]` each
fn split_pairs(seq: &Tensor) -> (Tensor, Tensor) {
    let v = seq.view([-1, 2]);
    (v.select(1, 0), v.select(1, 1))
}

/// The DPO metrics TRL logs, from sequence log-probs.
fn pair_metrics(
    prefix: &str,
    cfg: &DpoConfig,
    pc: &Tensor,
    pr: &Tensor,
    rc: &Tensor,
    rr: &Tensor,
) -> Metrics {
    let (pc, pr) = (
        pc.detach().to_kind(Kind::Double),
        pr.detach().to_kind(Kind::Double),
    );
    let (rc, rr) = if cfg.reference_free {
        (pc.zeros_like(), pr.zeros_like())
    } else {
        (rc.to_kind(Kind::Double), rr.to_kind(Kind::Double))
    };
    let chosen = (&pc - rc) * cfg.dpo_beta;
    let rejected = (&pr - rr) * cfg.dpo_beta;
    let mean = |t: &Tensor| t.mean(Kind::Double).double_value(&[]);
    let mut m = Metrics::new();
    m.push(format!("{prefix}rewards/chosen"), mean(&chosen));
    m.push(format!("{prefix}rewards/rejected"), mean(&rejected));
    m.push(
        format!("{prefix}rewards/accuracies"),
        mean(&chosen.gt_tensor(&rejected).to_kind(Kind::Double)),
    );
    m.push(
        format!("{prefix}rewards/margins"),
        mean(&(&chosen - &rejected)),
    );
    m.push(format!("{prefix}logps/chosen"), mean(&pc));
    m.push(format!("{prefix}logps/rejected"), mean(&pr));
    m
}

/// The DPO loss family as the actor's objective. Reads `response_mask`, [`PAIR_INDEX`] and
/// (unless reference-free) [`REF_SEQ_LOG_PROB`]; rows come in (chosen, rejected) pairs.
///
/// The micro-batch's loss is its pairs' summed loss over the mini-batch's pair count
/// (`MiniBatchInfo::sequences / 2`), so accumulation over micro-batches is exact. Under data
/// parallelism the count is the global mini-batch's and the loss is multiplied by `dp_size`
/// (`meta_info.dp_size`, as the other objectives), so the ranks' averaged gradients are the
/// gradient of the whole global mini-batch. Logs
/// `loss` (summed over micro-batches, i.e. the mini-batch loss) and TRL's `rewards/*`,
/// `logps/*`.
#[derive(Debug, Clone, Copy)]
pub struct DpoLoss {
    /// The loss math's config.
    pub cfg: DpoConfig,
}

impl PolicyObjective for DpoLoss {
    fn needs_entropy(&self) -> bool {
        false
    }

    fn loss(
        &self,
        micro: &Batch,
        out: &PolicyOutput,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        check_pairs(micro)?;
        let seq = seq_sum(&out.log_prob, micro.get(keys::RESPONSE_MASK)?)?;
        let (pc, pr) = split_pairs(&seq);
        let reference = if self.cfg.reference_free {
            seq.zeros_like().detach()
        } else {
            micro.get(REF_SEQ_LOG_PROB)?.to_kind(seq.kind())
        };
        let (rc, rr) = split_pairs(&reference);
        let mean = dpo::loss(&pc, &pr, &rc, &rr, &self.cfg).map_err(wrap)?;
        let pairs = pc.size()[0] as f64;
        let mini_pairs = (info.sequences / 2.0).max(1.0);
        let dp = rl_core::dist::dp_size(micro) as f64;
        let loss = mean * (pairs / mini_pairs * dp);
        let mut metrics = pair_metrics("", &self.cfg, &pc, &pr, &rc, &rr);
        metrics.push("loss", item(&loss));
        Ok((loss, metrics))
    }
}

/// Adds [`PAIR_INDEX`] to a batch of interleaved pairs (rows `2i`, `2i + 1`), checking the
/// row count is even.
pub fn mark_pairs(batch: &mut Batch) -> rl_core::Result<()> {
    let n = batch.len() as i64;
    if n == 0 || n % 2 != 0 {
        return Err(rl_core::Error::InvalidArgument {
            name: "batch",
            reason: format!("a preference batch holds (chosen, rejected) row pairs, got {n} rows"),
        });
    }
    let device = batch.get(keys::RESPONSES)?.device();
    let idx = Tensor::arange(n, (Kind::Int64, device)).divide_scalar_mode(2, "floor");
    if batch.contains(PAIR_INDEX) {
        let _ = batch.pop(PAIR_INDEX)?;
    }
    batch.insert(PAIR_INDEX, idx)
}

/// The frozen reference's sequence log-probs, optionally cached per row content (the key is
/// the row's attended tokens and its response length), so a dataset's pairs cost one
/// reference forward each over the whole run.
#[derive(Debug, Default)]
pub(crate) struct RefCache {
    enabled: bool,
    map: HashMap<Vec<i64>, f32>,
}

impl RefCache {
    pub(crate) fn new(enabled: bool) -> Self {
        RefCache {
            enabled,
            map: HashMap::new(),
        }
    }

    fn row_keys(batch: &Batch) -> rl_core::Result<Vec<Vec<i64>>> {
        let ids = batch.get(keys::INPUT_IDS)?;
        let mask = batch.get(keys::ATTENTION_MASK)?;
        let resp_len = batch.get(keys::RESPONSE_MASK)?.size()[1];
        let ids = Vec::<Vec<i64>>::try_from(ids.to_kind(Kind::Int64))?;
        let mask = Vec::<Vec<i64>>::try_from(mask.to_kind(Kind::Int64))?;
        Ok(ids
            .into_iter()
            .zip(mask)
            .map(|(r, m)| {
                let mut k: Vec<i64> = r
                    .into_iter()
                    .zip(m)
                    .filter(|&(_, m)| m != 0)
                    .map(|(t, _)| t)
                    .collect();
                k.push(-resp_len - 1);
                k
            })
            .collect())
    }

    /// `[batch]` f32 reference sequence log-probs of `batch`'s responses.
    pub(crate) fn seq_log_probs(
        &mut self,
        reference: &mut dyn Reference,
        batch: &Batch,
    ) -> rl_core::Result<(Tensor, bool)> {
        let mask = batch.get(keys::RESPONSE_MASK)?;
        if !self.enabled {
            let lp = reference.compute_ref_log_prob(batch)?;
            return Ok((seq_sum(lp.get(keys::REF_LOG_PROB)?, mask)?, true));
        }
        let row_keys = Self::row_keys(batch)?;
        let missing: Vec<i64> = (0..row_keys.len() as i64)
            .filter(|&i| !self.map.contains_key(&row_keys[i as usize]))
            .collect();
        let forward = !missing.is_empty();
        if forward {
            let sub = batch.reorder(&missing)?;
            let lp = reference.compute_ref_log_prob(&sub)?;
            let seq = seq_sum(lp.get(keys::REF_LOG_PROB)?, sub.get(keys::RESPONSE_MASK)?)?;
            let seq = Vec::<f32>::try_from(seq.to_kind(Kind::Float))?;
            for (&i, v) in missing.iter().zip(seq) {
                self.map.insert(row_keys[i as usize].clone(), v);
            }
        }
        let vals: Vec<f32> = row_keys.iter().map(|k| self.map[k]).collect();
        Ok((Tensor::from_slice(&vals).to_device(mask.device()), forward))
    }
}

/// What the preference trainers (DPO, online DPO, SPIN) keep besides the actor's own state:
/// `trainer_state.json` next to `actor/` in a checkpoint folder.
#[derive(Serialize, Deserialize)]
pub(crate) struct PairTrainerState {
    pub(crate) global_step: u64,
    pub(crate) train_source: Value,
}

impl PairTrainerState {
    /// Writes `dir/actor/` (the actor's state) and `dir/trainer_state.json`.
    pub(crate) fn save(
        dir: &Path,
        actor: &dyn Actor,
        global_step: u64,
        train: &dyn BatchSource,
    ) -> rl_core::Result<()> {
        let actor_dir = dir.join("actor");
        std::fs::create_dir_all(&actor_dir).map_err(|e| io_err(&actor_dir, e))?;
        actor.save_state(&actor_dir)?;
        let state = PairTrainerState {
            global_step,
            train_source: train.state(),
        };
        write_json(&dir.join("trainer_state.json"), &state)
    }

    /// Reads `dir/trainer_state.json`.
    pub(crate) fn read(dir: &Path) -> rl_core::Result<PairTrainerState> {
        read_json(&dir.join("trainer_state.json"))
    }

    /// Restores the actor and the data source from `dir`; returns the global step.
    pub(crate) fn restore(
        self,
        dir: &Path,
        actor: &mut dyn Actor,
        train: &mut dyn BatchSource,
    ) -> rl_core::Result<u64> {
        actor.load_state(&dir.join("actor"))?;
        train.load_state(&self.train_source)?;
        Ok(self.global_step)
    }
}

pub(crate) fn io_err(path: &Path, source: std::io::Error) -> rl_core::Error {
    rl_core::Error::Io {
        path: path.display().to_string(),
        source,
    }
}

pub(crate) fn write_json<T: Serialize>(path: &Path, v: &T) -> rl_core::Result<()> {
    let text = serde_json::to_string(v).map_err(|e| rl_core::Error::Role {
        role: "trainer",
        source: Box::new(e),
    })?;
    std::fs::write(path, text).map_err(|e| io_err(path, e))
}

pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> rl_core::Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    serde_json::from_str(&text).map_err(|e| rl_core::Error::Format {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Offline DPO (TRL's `DPOTrainer`): each [`step`](Trainer::step) takes a batch of
/// (chosen, rejected) row pairs in the rollout layout (`input_ids`, `attention_mask`,
/// `position_ids`, `responses`, `response_mask`; rows `2i` chosen, `2i + 1` rejected), adds the
/// reference's sequence log-probs (one padded forward for both sides, or the cache), and makes
/// one `actor.update` with [`DpoLoss`].
///
/// The actor should be built with `rollout_n = 2` so `ppo_mini_batch_size` counts pairs, with
/// `shuffle = false` and an even (or no) `ppo_micro_batch_size_per_gpu`.
/// Validation reports `val/rewards/accuracies` (the share of held-out pairs whose implicit
/// reward ranks chosen above rejected), `val/rewards/margins` and `val/loss`.
///
/// Data parallel with [`with_group`](Self::with_group).
pub struct DpoTrainer {
    cfg: DpoTrainerConfig,
    actor: Box<dyn Actor>,
    reference: Option<Box<dyn Reference>>,
    train: Box<dyn BatchSource>,
    val: Vec<Batch>,
    cache: RefCache,
    global_step: u64,
    dp: Option<Dp>,
}

impl std::fmt::Debug for DpoTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DpoTrainer")
            .field("cfg", &self.cfg)
            .field("global_step", &self.global_step)
            .finish()
    }
}

impl DpoTrainer {
    /// A trainer at step 0; `reference` may be `None` only when `reference_free`.
    pub fn new(
        cfg: DpoTrainerConfig,
        actor: Box<dyn Actor>,
        reference: Option<Box<dyn Reference>>,
        train: Box<dyn BatchSource>,
        val: Vec<Batch>,
    ) -> rl_core::Result<Self> {
        cfg.check()?;
        if reference.is_none() && !cfg.reference_free {
            return Err(rl_core::Error::InvalidArgument {
                name: "reference_free",
                reason: "DPO needs a reference role unless reference_free = true".into(),
            });
        }
        let cache = RefCache::new(cfg.precompute_ref_log_probs);
        Ok(DpoTrainer {
            cfg,
            actor,
            reference,
            train,
            val,
            cache,
            global_step: 0,
            dp: None,
        })
    }

    /// Makes the trainer one rank of a data-parallel job over `group`, as
    /// `OnPolicyTrainer::with_group`: the actor must have been given the same group
    /// (`ActorWorker::with_group` with `rollout_n = 2`, so `ppo_mini_batch_size` counts global
    /// pairs) and the source must yield this rank's contiguous share of each global batch of
    /// `pairs` pairs (`preference_data.train_batch_size`). [`DpoLoss`] then normalises by the
    /// global pair count times `dp_size`, so the averaged gradients are one process's; each
    /// step's metrics are combined over the ranks, the ranks' weights are compared after the
    /// first step, validation runs each rank on its share of the pairs of every validation batch
    /// and pools the gathered log-probs, and only rank 0 writes checkpoints.
    ///
    /// Errors when `pairs` does not split over the ranks or the actor was not given a group of
    /// the same size.
    pub fn with_group(mut self, group: SharedCollective, pairs: usize) -> rl_core::Result<Self> {
        // the validation pairs come in batches of `train_batch_size` pairs
        let val = ValBatches {
            batches: &self.val,
            per: 2,
            key: "preference_data.train_batch_size",
        };
        let dp = Dp::new(
            group,
            self.actor.as_ref(),
            "preference_data.train_batch_size",
            pairs,
            val,
        )?;
        self.dp = Some(dp);
        Ok(self)
    }

    /// Gives the actor back.
    pub fn into_actor(self) -> Box<dyn Actor> {
        self.actor
    }
}

/// Marks pairs and adds [`REF_SEQ_LOG_PROB`]; returns whether a reference forward ran.
pub(crate) fn prepare_pairs(
    batch: &mut Batch,
    cfg: &DpoTrainerConfig,
    reference: Option<&mut Box<dyn Reference>>,
    cache: &mut RefCache,
) -> rl_core::Result<bool> {
    mark_pairs(batch)?;
    if cfg.reference_free {
        return Ok(false);
    }
    let reference = reference.ok_or_else(|| rl_core::Error::InvalidArgument {
        name: "reference_free",
        reason: "DPO needs a reference role unless reference_free = true".into(),
    })?;
    let (seq, forward) = cache.seq_log_probs(reference.as_mut(), batch)?;
    if batch.contains(REF_SEQ_LOG_PROB) {
        let _ = batch.pop(REF_SEQ_LOG_PROB)?;
    }
    batch.insert(REF_SEQ_LOG_PROB, seq)?;
    Ok(forward)
}

/// Held-out preference metrics of `val` under the current actor: `val/rewards/*`,
/// `val/logps/*` and `val/loss`, pooled over every pair.
/// With `dp`, each rank scores its contiguous share of the
/// pairs of every batch, and the sequence log-probs are gathered before pooling, so every rank
/// returns the figures of the whole validation set.
fn preference_validation(
    cfg: &DpoTrainerConfig,
    actor: &mut dyn Actor,
    mut reference: Option<&mut Box<dyn Reference>>,
    val: &[Batch],
    dp: Option<&Dp>,
) -> rl_core::Result<StepMetrics> {
    let dcfg = cfg.dpo();
    let (rank, world) = dp.map_or((0, 1), |d| (d.rank, d.world));
    let (mut pcs, mut prs, mut rcs, mut rrs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for b in val {
        let pairs = dist::shard_range(b.len() / 2, rank, world);
        if pairs.is_empty() {
            continue;
        }
        let mut b = b.slice(2 * pairs.start..2 * pairs.end)?;
        let mut nocache = RefCache::new(false);
        prepare_pairs(&mut b, cfg, reference.as_deref_mut(), &mut nocache)?;
        let lp = actor.compute_log_prob(&b, false)?;
        let seq = seq_sum(lp.get(keys::OLD_LOG_PROBS)?, b.get(keys::RESPONSE_MASK)?)?;
        let (pc, pr) = split_pairs(&seq);
        let r = if cfg.reference_free {
            seq.zeros_like()
        } else {
            b.get(REF_SEQ_LOG_PROB)?.shallow_clone()
        };
        let (rc, rr) = split_pairs(&r);
        pcs.push(pc);
        prs.push(pr);
        rcs.push(rc);
        rrs.push(rr);
    }
    let mut m = StepMetrics::new();
    let cat = |v: &[Tensor]| {
        if v.is_empty() {
            Tensor::zeros([0], (Kind::Float, tch::Device::Cpu))
        } else {
            Tensor::cat(v, 0)
                .to_kind(Kind::Float)
                .to_device(tch::Device::Cpu)
        }
    };
    // [pairs, 4]: chosen, rejected, reference chosen, reference rejected
    let mut cols = Tensor::stack(&[cat(&pcs), cat(&prs), cat(&rcs), cat(&rrs)], 1);
    if let Some(dp) = dp.filter(|d| d.world > 1) {
        cols = dist::gather_rows(&mut *dist::lock(&dp.group)?, &cols)?;
    }
    if cols.size()[0] == 0 {
        return Ok(m);
    }
    let (pc, pr, rc, rr) = (
        cols.select(1, 0),
        cols.select(1, 1),
        cols.select(1, 2),
        cols.select(1, 3),
    );
    let loss = dpo::loss(&pc, &pr, &rc, &rr, &dcfg).map_err(wrap)?;
    m.extend(pair_metrics("val/", &dcfg, &pc, &pr, &rc, &rr).mean());
    m.insert("val/loss".into(), item(&loss));
    Ok(m)
}

impl Trainer for DpoTrainer {
    fn global_step(&self) -> u64 {
        self.global_step
    }

    fn total_steps(&self) -> u64 {
        self.cfg.total_training_steps
    }

    fn step(&mut self) -> rl_core::Result<StepMetrics> {
        let t = Instant::now();
        let mut batch = self.train.next_batch()?;
        let t_ref = Instant::now();
        let forward = prepare_pairs(
            &mut batch,
            &self.cfg,
            self.reference.as_mut(),
            &mut self.cache,
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
        if forward {
            m.insert("timing_s/ref".into(), ref_s);
        }
        m.insert(
            "timing_s/update_actor".into(),
            t_upd.elapsed().as_secs_f64(),
        );
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
        let m = preference_validation(
            &self.cfg,
            self.actor.as_mut(),
            self.reference.as_mut(),
            &self.val,
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
    fn check_names_the_bad_key() {
        let bad = |c: DpoTrainerConfig| c.check().unwrap_err().to_string();
        assert!(
            bad(DpoTrainerConfig {
                beta: 0.0,
                ..Default::default()
            })
            .contains("beta")
        );
        assert!(
            bad(DpoTrainerConfig {
                loss_type: DpoLossType::Ipo,
                label_smoothing: 0.1,
                ..Default::default()
            })
            .contains("label_smoothing")
        );
        assert!(
            bad(DpoTrainerConfig {
                n: 1,
                ..Default::default()
            })
            .contains("`n`")
        );
        let e = serde_json::from_str::<DpoTrainerConfig>(r#"{"betta": 0.2}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("betta"), "{e}");
        let ok: DpoTrainerConfig =
            serde_json::from_str(r#"{"beta": 0.5, "loss_type": "hinge"}"#).unwrap();
        assert_eq!(ok.loss_type, DpoLossType::Hinge);
        ok.check().unwrap();
    }

    fn micro(n: i64) -> Batch {
        let mut b = Batch::new();
        b.insert(
            keys::RESPONSES,
            Tensor::zeros([n, 3], (Kind::Int64, tch::Device::Cpu)),
        )
        .unwrap();
        b.insert(
            keys::RESPONSE_MASK,
            Tensor::ones([n, 3], (Kind::Float, tch::Device::Cpu)),
        )
        .unwrap();
        b
    }

    #[test]
    fn loss_is_ln2_at_the_reference_and_accumulates_exactly() {
        let mut b = micro(4);
        mark_pairs(&mut b).unwrap();
        let lp = Tensor::from_slice(&[
            -1.0f32, -2.0, -0.5, -0.1, -3.0, -1.0, -0.2, -0.2, -1.0, -1.5, -0.7, -0.3,
        ])
        .view([4, 3]);
        let seq = lp.sum_dim_intlist([-1].as_slice(), false, Kind::Float);
        b.insert(REF_SEQ_LOG_PROB, seq).unwrap();
        let obj = DpoLoss {
            cfg: DpoConfig::default(),
        };
        let info = MiniBatchInfo {
            tokens: 12.0,
            sequences: 4.0,
            on_policy: false,
        };
        let out = PolicyOutput {
            log_prob: lp.shallow_clone(),
            entropy: None,
        };
        let (l, m) = obj.loss(&b, &out, info).unwrap();
        assert!((item(&l) - std::f64::consts::LN_2).abs() < 1e-6);
        assert_eq!(m.values("rewards/accuracies"), &[0.0]);
        // two micro-batches of one pair each add up to the mini-batch loss
        let lp2 = &lp + Tensor::from_slice(&[0.3f32, -0.2, 0.1, 0.4]).view([4, 1]);
        let whole = obj
            .loss(
                &b,
                &PolicyOutput {
                    log_prob: lp2.shallow_clone(),
                    entropy: None,
                },
                info,
            )
            .unwrap()
            .0;
        let parts: f64 = (0..2)
            .map(|i| {
                let mb = b.slice(2 * i..2 * i + 2).unwrap();
                let o = PolicyOutput {
                    log_prob: lp2.narrow(0, 2 * i as i64, 2),
                    entropy: None,
                };
                item(&obj.loss(&mb, &o, info).unwrap().0)
            })
            .sum();
        assert!((item(&whole) - parts).abs() < 1e-6);
        // a split pair is an error naming the actor's keys
        let odd = b.reorder(&[0, 2, 1, 3]).unwrap();
        let e = obj.loss(&odd, &out, info).unwrap_err().to_string();
        assert!(e.contains("shuffle"), "{e}");
    }
}
