//! [`OnPolicyTrainer`]: verl's `RayPPOTrainer.fit` step, parameterised by the advantage
//! estimator and the policy loss (PPO, GRPO, Dr. GRPO, RLOO, REINFORCE++, GSPO, DAPO).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::{
    Actor, BackgroundRollout, Critic, GENERATION_SECONDS, LogProbExtras, OLD_LOG_PROBS_FROM_UPDATE,
    POLICY_VERSION, Reference, Reward, Rollout,
};
use rl_core::{Batch, Sample, StepMetrics, Trainer, keys};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::{Kind, Tensor};

use crate::advantage::{self, AdvantageInputs};
use crate::agg::LossAggMode;
use crate::config::AdvEstimator;
use crate::dapo;
use crate::kl::{self, KlController};
use crate::rollout_corr;
use crate::trainer::async_rollout::{self, AsyncRollout, SavedBatch};
use crate::trainer::config::OnPolicyConfig;
use crate::trainer::dp;
use crate::trainer::objective::{self, PolicyLoss, RolloutLoss, ValueLoss};
use crate::trainer::reward::{SCORE_COLUMN, reward_metrics};
use crate::trainer::source::BatchSource;
use crate::trainer::step_metrics;

/// Column a [`Reward`] role may add with each row's accuracy (DAPO's `acc` filter metric).
pub const ACC_COLUMN: &str = "acc";
/// Column with the decoded prompt, used for validation samples when present.
pub const PROMPT_TEXT_COLUMN: &str = "prompt_text";
/// Column with the decoded response, used for validation samples when present.
pub const RESPONSE_TEXT_COLUMN: &str = "response_text";

/// What the advantage stage produces for this rank's rows.
struct Advantages {
    /// `token_level_rewards` (the scores after KL-in-reward).
    rewards: Tensor,
    advantages: Tensor,
    returns: Tensor,
    /// Rollout correction in decoupled mode: the policy mask after rejection, and the
    /// importance weights when asked for.
    correction: Option<(Tensor, Option<Tensor>)>,
}

/// The roles an on-policy trainer drives.
pub struct Roles {
    /// The trained policy.
    pub actor: Box<dyn Actor>,
    /// Generation (sharing the actor's weights).
    pub rollout: Box<dyn Rollout>,
    /// The frozen reference; needed when `use_kl_loss` or `use_kl_in_reward`.
    pub reference: Option<Box<dyn Reference>>,
    /// The value model; needed by `gae`.
    pub critic: Option<Box<dyn Critic>>,
    /// Rewards.
    pub reward: Box<dyn Reward>,
}

impl std::fmt::Debug for Roles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Roles")
            .field("reference", &self.reference.is_some())
            .field("critic", &self.critic.is_some())
            .finish()
    }
}

/// What `trainer_state.json` of a checkpoint holds besides the roles' own folders.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainerState {
    global_step: u64,
    train_source: Value,
    kl_ctrl: KlController,
    /// `async_training`: the batches generated ahead of their step (in the checkpoint's
    /// `async_rollout/` folder).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    async_rollout: Vec<SavedBatch>,
}

fn role_err(role: &'static str, e: impl std::fmt::Display) -> rl_core::Error {
    rl_core::Error::Role {
        role,
        source: e.to_string().into(),
    }
}

fn wrap(e: crate::Error) -> rl_core::Error {
    match e {
        crate::Error::Core(c) => c,
        other => rl_core::Error::Role {
            role: "trainer",
            source: Box::new(other),
        },
    }
}

/// One on-policy trainer for the PPO family. Each [`step`](Trainer::step): generate
/// `train_batch_size x n` responses, score them (plus DAPO's overlong shaping and dynamic
/// sampling when configured), compute `old_log_probs` (+ entropy), `ref_log_prob`, `values`,
/// KL-in-reward, advantages, then update the critic and the actor; metrics under verl's names.
///
/// Rollout seeds derive from the step (`meta_info.global_step = step * 1000 + gen_batch`), never
/// from libtorch's global RNG, so a resumed run samples what the uninterrupted one did.
///
/// Data parallel with [`with_group`](Self::with_group): see that method for what each rank does.
pub struct OnPolicyTrainer {
    cfg: OnPolicyConfig,
    roles: Roles,
    train: Box<dyn BatchSource>,
    val: Vec<Batch>,
    kl_ctrl: KlController,
    global_step: u64,
    group: Option<SharedCollective>,
    /// Whether this process has compared the ranks' weights (after its first step).
    replicas_checked: bool,
    /// `async_training`: the rollout beside the update (in a cell: a checkpoint, taken through
    /// `&self`, waits for its batches in flight).
    background: Option<RefCell<AsyncRollout>>,
}

impl std::fmt::Debug for OnPolicyTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnPolicyTrainer")
            .field("cfg", &self.cfg)
            .field("roles", &self.roles)
            .field("global_step", &self.global_step)
            .field("data_parallel", &self.group.is_some())
            .finish()
    }
}

/// Masked mean, max and min of `x` over `mask`.
fn masked_stats(x: &Tensor, mask: &Tensor) -> (f64, f64, f64) {
    let sel = x.masked_select(&mask.ne(0.0));
    if sel.numel() == 0 {
        return (0.0, 0.0, 0.0);
    }
    let sel = sel.to_kind(Kind::Double);
    (
        sel.mean(Kind::Double).double_value(&[]),
        sel.max().double_value(&[]),
        sel.min().double_value(&[]),
    )
}

fn stats(x: &Tensor) -> (f64, f64, f64) {
    let x = x.to_kind(Kind::Double);
    (
        x.mean(Kind::Double).double_value(&[]),
        x.max().double_value(&[]),
        x.min().double_value(&[]),
    )
}

/// verl's `critic/vf_explained_var`: `1 - Var(returns - values) / (Var(returns) + 1e-5)` over
/// the masked tokens (unbiased variances, as `torch.var`), from sums over every rank of `group`
/// (a collective there), so it is the global batch's figure. 0 for a critic predicting a
/// constant whatever its offset, 1 for a perfect one; `None` with fewer than 2 tokens.
fn explained_variance(
    returns: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    group: Option<&SharedCollective>,
) -> rl_core::Result<Option<f64>> {
    let keep = mask.ne(0.0);
    let r = returns.masked_select(&keep).to_kind(Kind::Double);
    let d = &r - values.masked_select(&keep).to_kind(Kind::Double);
    let sum = |t: &Tensor| t.sum(Kind::Double).double_value(&[]);
    let mut sums = [
        r.numel() as f64,
        sum(&d),
        sum(&d.square()),
        sum(&r),
        sum(&r.square()),
    ];
    if let Some(g) = group {
        dist::all_reduce_f64(&mut *dist::lock(g)?, &mut sums, dist::ReduceOp::Sum)?;
    }
    let [n, sd, sd2, sr, sr2] = sums;
    if n < 2.0 {
        return Ok(None);
    }
    let var = |s: f64, s2: f64| ((s2 - s * s / n) / (n - 1.0)).max(0.0);
    Ok(Some(1.0 - var(sd, sd2) / (var(sr, sr2) + 1e-5)))
}

fn put3(m: &mut StepMetrics, key: &str, (mean, max, min): (f64, f64, f64)) {
    m.insert(format!("{key}/mean"), mean);
    m.insert(format!("{key}/max"), max);
    m.insert(format!("{key}/min"), min);
}

fn string_column(batch: &Batch, key: &str) -> rl_core::Result<Vec<String>> {
    Ok(batch
        .column(key)?
        .iter()
        .map(|v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .collect())
}

/// Per-row values of a numeric column, or `None` when the batch lacks it.
fn f64_column(batch: &Batch, key: &str) -> Option<Vec<f64>> {
    batch
        .column(key)
        .ok()
        .map(|c| c.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect())
}

/// The next prompt batch of `train`, with the rollout's `meta_info`: the sampler's
/// `global_step` (`step * 1000 + generation batch`), the policy version that generates it, the
/// temperature, and a data-parallel rank's place in the global batch.
fn prompt_batch(
    train: &mut dyn BatchSource,
    (global_step, version): (u64, u64),
    temperature: f64,
    (rank, world): (usize, usize),
) -> rl_core::Result<Batch> {
    let mut prompts = train.next_batch()?;
    // equal shards of the global batch: this rank's prompts start at rank * len
    let offset = rank * prompts.len();
    let meta = prompts.meta_info_mut();
    meta.insert("global_step".into(), global_step.into());
    meta.insert(POLICY_VERSION.into(), version.into());
    meta.insert("temperature".into(), temperature.into());
    if world > 1 {
        meta.insert(dist::DP_RANK.into(), rank.into());
        meta.insert(dist::DP_PROMPT_OFFSET.into(), offset.into());
    }
    Ok(prompts)
}

impl OnPolicyTrainer {
    /// A trainer at step 0. Checks `cfg` (naming the verl key at fault) and that the roles the
    /// algorithm needs are there; `val` holds the validation prompt batches.
    pub fn new(
        cfg: OnPolicyConfig,
        roles: Roles,
        train: Box<dyn BatchSource>,
        val: Vec<Batch>,
    ) -> rl_core::Result<Self> {
        cfg.check().map_err(wrap)?;
        if cfg.algorithm.adv_estimator.needs_critic() && roles.critic.is_none() {
            return Err(role_err(
                "trainer",
                "algorithm.adv_estimator `gae` needs a critic role",
            ));
        }
        if (cfg.actor.use_kl_loss || cfg.algorithm.use_kl_in_reward) && roles.reference.is_none() {
            return Err(role_err(
                "trainer",
                "use_kl_loss / algorithm.use_kl_in_reward need a reference role",
            ));
        }
        let kl_ctrl = KlController::new(&cfg.algorithm.kl_ctrl).map_err(wrap)?;
        Ok(OnPolicyTrainer {
            cfg,
            roles,
            train,
            val,
            kl_ctrl,
            global_step: 0,
            group: None,
            replicas_checked: false,
            background: None,
        })
    }

    /// Generates in the background while the actor updates (`async_training`): each step's
    /// batch comes from `rollout`, generated with the weights of up to
    /// `async_training.max_staleness` steps before (see the `async_rollout` module of this
    /// crate), and validation generates there too, with the current weights. Each step then
    /// logs `async/policy_version` (the step whose weights generated its batch),
    /// `async/staleness`, `timing_s/gen` (the time it waited for its batch) and
    /// `timing_s/gen_background` (the time the batch took to generate).
    ///
    /// Errors unless `async_training.enable` is set, and for a data-parallel trainer (not built
    /// yet: each rank's batches ahead would have to be gathered into the checkpoint).
    pub fn with_background_rollout(
        mut self,
        rollout: Box<dyn BackgroundRollout>,
    ) -> rl_core::Result<Self> {
        let cfg = self.cfg.async_training;
        if !cfg.enable {
            return Err(role_err(
                "trainer",
                "a background rollout needs async_training.enable = true",
            ));
        }
        if self.group.is_some() {
            return Err(role_err(
                "trainer",
                "async_training.enable: asynchronous training is not built for data-parallel runs yet",
            ));
        }
        self.background = Some(RefCell::new(AsyncRollout::new(rollout, cfg.max_staleness)));
        Ok(self)
    }

    /// Makes the trainer one rank of a data-parallel job over `group`. The roles must have been
    /// given the same group (`ActorWorker::with_group`, `CriticWorker::with_group`) and the
    /// training source must yield this rank's shard of each global batch (rl-data's
    /// `DataLoader::with_shard`); `data.train_batch_size` stays the global batch.
    ///
    /// Each step then: generates for this rank's prompts (the rollout seed mixed with the rank),
    /// scores them, computes log-probs (and values) locally, gathers what the advantage needs
    /// (scores, masks, log-probs, values, `uid`s) so KL-in-reward, the KL controller and every
    /// estimator see the whole global batch exactly as one process would, keeps this rank's
    /// rows, updates critic and actor (gradients averaged over ranks inside the workers), and
    /// reduces the metrics over ranks, so every rank returns the global figures. After its first
    /// step and at every validation the trainer compares the ranks' weights (a digest of the
    /// actor's and critic's) and fails, naming the ranks that differ.
    /// Validation runs each rank on a contiguous shard of every validation batch and gathers
    /// the scores. Only rank 0 writes checkpoints ([`Trainer::save_checkpoint`] writes nothing
    /// on the other ranks, which only join the gathering of a ZeRO-sharded optimiser state);
    /// every rank loads them, at any world size.
    ///
    /// With DAPO's dynamic sampling (`algorithm.filter_groups.enable`) the kept-group count is
    /// global and the kept groups are re-shared over the ranks, so each rank trains on its
    /// contiguous share of the batch one process would keep.
    ///
    /// Errors when `data.train_batch_size` does not split over the ranks, or when the actor (or
    /// critic) was not given a group of the same size.
    pub fn with_group(mut self, group: SharedCollective) -> rl_core::Result<Self> {
        let world = dist::lock(&group)?.world_size();
        if self.background.is_some() {
            return Err(role_err(
                "trainer",
                "async_training.enable: asynchronous training is not built for data-parallel runs yet",
            ));
        }
        if !self.cfg.train_batch_size.is_multiple_of(world) {
            return Err(role_err(
                "trainer",
                format!(
                    "data.train_batch_size: {} prompts do not split over {world} data-parallel ranks (it is the global batch; make it a multiple of the world size)",
                    self.cfg.train_batch_size
                ),
            ));
        }
        let roles = [
            ("actor", Some(self.roles.actor.data_parallel_ranks())),
            (
                "critic",
                self.roles.critic.as_ref().map(|c| c.data_parallel_ranks()),
            ),
        ];
        for (role, ranks) in roles {
            if let Some(ranks) = ranks
                && ranks != world
            {
                return Err(role_err(
                    "trainer",
                    format!(
                        "the {role} role averages gradients over {ranks} rank(s) but the trainer's group has {world}: build it with `with_group` on the same group"
                    ),
                ));
            }
        }
        super::dp::check_val_shards(
            self.roles.actor.as_ref(),
            &self.val,
            1,
            world,
            "data.val_batch_size",
        )?;
        self.group = Some(group);
        Ok(self)
    }

    /// `(rank, world_size)`: `(0, 1)` without a group.
    pub fn rank_and_world(&self) -> rl_core::Result<(usize, usize)> {
        match &self.group {
            Some(g) => {
                let g = dist::lock(g)?;
                Ok((g.rank(), g.world_size()))
            }
            None => Ok((0, 1)),
        }
    }

    /// The data-parallel group when there is more than one rank.
    fn dp_group(&self) -> rl_core::Result<Option<SharedCollective>> {
        match &self.group {
            Some(g) if dist::lock(g)?.world_size() > 1 => Ok(Some(g.clone())),
            _ => Ok(None),
        }
    }

    /// Compares the actor's (and critic's) weights across the ranks by digest (after this
    /// process's first step and at every validation).
    fn check_replicas(&self, group: &SharedCollective) -> rl_core::Result<()> {
        let actor = self.roles.actor.weights_digest()?;
        let critic = match &self.roles.critic {
            Some(c) => c.weights_digest()?,
            None => None,
        };
        let mut g = dist::lock(group)?;
        dist::check_digests(&mut *g, "actor weights", actor)?;
        dist::check_digests(&mut *g, "critic weights", critic)
    }

    /// The config.
    pub fn config(&self) -> &OnPolicyConfig {
        &self.cfg
    }

    /// One generation batch: prompts, responses, scores (overlong-shaped when enabled).
    fn generate(
        &mut self,
        gen_batch: u64,
        timing: &mut BTreeMap<&'static str, f64>,
    ) -> rl_core::Result<Batch> {
        let (rank, world) = self.rank_and_world()?;
        let prompts = prompt_batch(
            self.train.as_mut(),
            (self.global_step * 1000 + gen_batch, self.global_step),
            self.cfg.temperature,
            (rank, world),
        )?;
        let t = Instant::now();
        let batch = self.roles.rollout.generate(&prompts)?;
        *timing.entry("gen").or_default() += t.elapsed().as_secs_f64();
        self.score(batch, timing)
    }

    /// `async_training`: this step's batch from the background rollout (after handing it the
    /// batches of the steps ahead), scored; logs its policy version and staleness.
    fn generate_async(
        &mut self,
        timing: &mut BTreeMap<&'static str, f64>,
        m: &mut StepMetrics,
    ) -> rl_core::Result<Batch> {
        let step = self.global_step;
        let total = self.total_steps();
        let ranks = self.rank_and_world()?;
        let temperature = self.cfg.temperature;
        let background = self
            .background
            .as_mut()
            .ok_or_else(|| role_err("trainer", "no background rollout"))?
            .get_mut();
        let train = self.train.as_mut();
        background.top_up(step, total, |t| {
            prompt_batch(train, (t * 1000, step), temperature, ranks)
        })?;
        let t = Instant::now();
        let (mut batch, version) = background.take(step)?;
        timing.insert("gen", t.elapsed().as_secs_f64());
        if let Some(s) = batch
            .meta_info_mut()
            .remove(GENERATION_SECONDS)
            .and_then(|v| v.as_f64())
        {
            timing.insert("gen_background", s);
        }
        m.insert("async/policy_version".into(), version as f64);
        m.insert("async/staleness".into(), (step - version) as f64);
        self.score(batch, timing)
    }

    /// Scores a generated batch (overlong shaping too, when enabled).
    fn score(
        &mut self,
        mut batch: Batch,
        timing: &mut BTreeMap<&'static str, f64>,
    ) -> rl_core::Result<Batch> {
        batch
            .meta_info_mut()
            .insert("temperature".into(), self.cfg.temperature.into());
        let t = Instant::now();
        let scores = self.roles.reward.score(&batch)?;
        batch.union(scores)?;
        if self.cfg.overlong_buffer.enable {
            let s = batch.pop(keys::TOKEN_LEVEL_SCORES)?;
            let (shaped, _) = dapo::apply_overlong_penalty(
                &s,
                batch.get(keys::RESPONSE_MASK)?,
                self.cfg.max_response_length,
                &self.cfg.overlong_buffer,
            )
            .map_err(wrap)?;
            batch.insert(keys::TOKEN_LEVEL_SCORES, shaped)?;
        }
        *timing.entry("reward").or_default() += t.elapsed().as_secs_f64();
        Ok(batch)
    }

    /// DAPO's dynamic sampling: generation batches until `train_batch_size` informative groups
    /// are kept, bounded by `max_num_gen_batches`.
    ///
    /// Data parallel, each rank generates and filters its share of every generation batch; the
    /// kept-group count is summed over the ranks after each batch, so every rank generates the
    /// same number of batches and stops together, and the kept rows are then gathered in global
    /// order (batch by batch, ranks in order) and re-shared (`dp::share_rounds`): each rank
    /// trains on its contiguous share of the batch one process would keep.
    fn generate_filtered(
        &mut self,
        timing: &mut BTreeMap<&'static str, f64>,
        metrics: &mut StepMetrics,
    ) -> rl_core::Result<Batch> {
        let fg = self.cfg.algorithm.filter_groups.clone().unwrap_or_default();
        let metric = fg.metric.clone().unwrap_or_default();
        let group = self.dp_group()?;
        // this rank's kept rows of each generation batch (possibly none)
        let mut kept: Vec<Batch> = Vec::new();
        let (mut kept_groups, mut dropped_groups) = (0i64, 0i64);
        let mut gen_batches = 0u64;
        loop {
            let batch = self.generate(gen_batches, timing)?;
            gen_batches += 1;
            let per_row: Tensor = match metric.as_str() {
                "acc" => Tensor::from_slice(&f64_column(&batch, ACC_COLUMN).ok_or_else(|| {
                    role_err(
                        "trainer",
                        "filter_groups.metric `acc` needs an `acc` column from the reward role",
                    )
                })?),
                "score" => match f64_column(&batch, SCORE_COLUMN) {
                    Some(v) => Tensor::from_slice(&v),
                    None => batch.get(keys::TOKEN_LEVEL_SCORES)?.sum_dim_intlist(
                        [-1].as_slice(),
                        false,
                        Kind::Double,
                    ),
                },
                // without KL in the reward, the final reward is the score
                _ => batch.get(keys::TOKEN_LEVEL_SCORES)?.sum_dim_intlist(
                    [-1].as_slice(),
                    false,
                    Kind::Double,
                ),
            };
            let uids = string_column(&batch, keys::UID)?;
            let index = advantage::group_index(&uids);
            let f = dapo::filter_groups(&per_row.to_kind(Kind::Double), &index).map_err(wrap)?;
            let keep: Vec<i64> = Vec::<bool>::try_from(&f.keep)?
                .iter()
                .enumerate()
                .filter(|(_, k)| **k)
                .map(|(i, _)| i as i64)
                .collect();
            let groups = uids.iter().collect::<std::collections::BTreeSet<_>>().len();
            // [kept, dropped] groups of the whole generation batch (groups never cross ranks)
            let mut counts = [f.kept_groups as f64, (groups as i64 - f.kept_groups) as f64];
            if let Some(g) = &group {
                dist::all_reduce_f64(&mut *dist::lock(g)?, &mut counts, dist::ReduceOp::Sum)?;
            }
            kept_groups += counts[0] as i64;
            dropped_groups += counts[1] as i64;
            let mut part = batch.reorder(&keep)?;
            // the generation batches differ only in their sampler seed; concat needs equal meta
            part.meta_info_mut().remove("global_step");
            kept.push(part);
            if kept_groups >= self.cfg.train_batch_size as i64 {
                break;
            }
            if fg.max_num_gen_batches > 0 && gen_batches >= fg.max_num_gen_batches as u64 {
                return Err(role_err(
                    "trainer",
                    format!(
                        "dynamic sampling kept {kept_groups} of {} groups after {gen_batches} generation batches \
                         (algorithm.filter_groups.max_num_gen_batches); the data may be too easy or too hard",
                        self.cfg.train_batch_size
                    ),
                ));
            }
        }
        metrics.insert("train/num_gen_batches".into(), gen_batches as f64);
        // groups whose responses all scored the same, over this step's generation batches
        metrics.insert("train/num_dropped_groups".into(), dropped_groups as f64);
        let rows = self.cfg.train_batch_size * self.cfg.rollout_n;
        match &group {
            Some(g) => dp::share_rounds(&mut *dist::lock(g)?, &kept, rows),
            None => dp::share_rounds(&mut dist::Solo, &kept, rows),
        }
    }

    /// KL-in-reward (when configured) and the advantage estimator over `batch`, which holds
    /// `token_level_scores`, `response_mask`, `old_log_probs`, `uid` (and `ref_log_prob`,
    /// `values` when used); returns `(token_level_rewards, advantages, returns)`.
    fn rewards_and_advantages(
        &mut self,
        batch: &Batch,
        m: &mut StepMetrics,
    ) -> rl_core::Result<Advantages> {
        let algo = self.cfg.algorithm.clone();
        // multi-turn: observation tokens carry no KL penalty, advantage or value target
        let mask = &keys::policy_mask(batch)?;
        let scores = batch.get(keys::TOKEN_LEVEL_SCORES)?.shallow_clone();
        let rewards = if algo.use_kl_in_reward {
            let (r, km) = kl::in_reward(
                &scores,
                batch.get(keys::OLD_LOG_PROBS)?,
                batch.get(keys::REF_LOG_PROB)?,
                mask,
                &mut self.kl_ctrl,
                algo.kl_penalty,
            )
            .map_err(wrap)?;
            for (k, v) in km.to_vec() {
                m.insert(k.into(), v);
            }
            r
        } else {
            scores
        };
        // rollout correction (decoupled mode): weights and rejection of old_log_probs against
        // the rollout's, after KL-in-reward and before the advantages, as verl's `fit`
        let correction = if self.decoupled_correction() {
            let c = rollout_corr::correct(
                batch.get(keys::OLD_LOG_PROBS)?,
                batch.get(keys::ROLLOUT_LOG_PROBS)?,
                mask,
                &algo.rollout_correction,
            )
            .map_err(wrap)?;
            m.extend(c.metrics.iter().map(|(k, v)| (k.clone(), *v)));
            Some(c)
        } else {
            None
        };
        let adv_mask = correction.as_ref().map_or(mask, |c| &c.response_mask);
        let index = advantage::group_index(&string_column(batch, keys::UID)?);
        let (adv, ret) = {
            let inputs = AdvantageInputs {
                token_level_rewards: &rewards,
                response_mask: adv_mask,
                values: batch.get(keys::VALUES).ok(),
                index: algo.adv_estimator.needs_groups().then_some(&index),
                reward_baselines: None,
                old_log_probs: batch.get(keys::OLD_LOG_PROBS).ok(),
                sum_pi_squared: batch.get(keys::SUM_PI_SQUARED).ok(),
                rollout_is_weights: correction.as_ref().and_then(|c| c.weights.as_ref()),
            };
            advantage::compute(&inputs, &algo).map_err(wrap)?
        };
        Ok(Advantages {
            rewards,
            advantages: adv,
            returns: ret,
            correction: correction.map(|c| (c.response_mask, c.weights)),
        })
    }

    /// Whether rollout correction runs in the trainer (verl's decoupled mode): weights or
    /// rejection asked for, or the diagnostics alone, and not in bypass mode (there the actor's
    /// loss does it).
    fn decoupled_correction(&self) -> bool {
        let rc = &self.cfg.algorithm.rollout_correction;
        !rc.bypass_mode && (rc.enabled() || self.cfg.rollout_diagnostics)
    }

    /// Whether this step may skip the old-log-prob forward over `rows` rows (outside bypass
    /// mode): the actor's update supplies them ([`Actor::old_log_probs_from_update`]: one
    /// mini-batch, one epoch, allowed by its config), the actor updates this step (past
    /// `critic_warmup`), and nothing reads them before it: no KL in the reward, no rollout
    /// correction in the trainer, no `sum_pi_squared` (the optimal token baseline).
    fn old_log_probs_from_update(&self, rows: usize) -> bool {
        !self.cfg.algorithm.use_kl_in_reward
            && !self.decoupled_correction()
            && !self.needs_sum_pi_squared()
            && self.global_step >= self.cfg.trainer.critic_warmup
            && self.roles.actor.old_log_probs_from_update(rows)
    }

    /// Whether the actor computes `sum_pi_squared` with the old log-probs.
    fn needs_sum_pi_squared(&self) -> bool {
        self.cfg.algorithm.adv_estimator.needs_sum_pi_squared()
            || self.cfg.actor.calculate_sum_pi_squared == Some(true)
    }

    /// [`rewards_and_advantages`](Self::rewards_and_advantages) over the whole global batch:
    /// the inputs of every rank are gathered (in rank order, which is the global row order),
    /// computed identically on every rank, and this rank's rows are kept.
    fn rewards_and_advantages_global(
        &mut self,
        group: &SharedCollective,
        batch: &Batch,
        m: &mut StepMetrics,
    ) -> rl_core::Result<Advantages> {
        let rows = batch.len() as i64;
        let width = batch.get(keys::RESPONSE_MASK)?.size()[1];
        let mut global = Batch::new();
        let offset = {
            let mut g = dist::lock(group)?;
            let counts = g.all_gather(&Tensor::from_slice(&[rows]))?;
            let rank = g.rank();
            let offset: i64 = counts[..rank].iter().map(|t| t.int64_value(&[0])).sum();
            // the policy mask travels as the response mask: `loss_mask` is as wide as the
            // prompts, which differ between ranks
            let policy = keys::policy_mask(batch)?;
            global.insert(keys::RESPONSE_MASK, dist::gather_rows(&mut *g, &policy)?)?;
            for key in [
                keys::TOKEN_LEVEL_SCORES,
                keys::OLD_LOG_PROBS,
                keys::REF_LOG_PROB,
                keys::VALUES,
                keys::ROLLOUT_LOG_PROBS,
                keys::SUM_PI_SQUARED,
            ] {
                if let Ok(t) = batch.get(key) {
                    global.insert(key, dist::gather_rows(&mut *g, t)?)?;
                }
            }
            let uids =
                serde_json::to_vec(batch.column(keys::UID)?).map_err(|e| role_err("trainer", e))?;
            let mut all = Vec::new();
            for part in dist::all_gather_bytes(&mut *g, &uids)? {
                let v: Vec<Value> =
                    serde_json::from_slice(&part).map_err(|e| role_err("trainer", e))?;
                all.extend(v);
            }
            global.insert_column(keys::UID, all)?;
            offset
        };
        let a = self.rewards_and_advantages(&global, m)?;
        let mine = |t: Tensor| t.narrow(0, offset, rows).narrow(1, 0, width).contiguous();
        Ok(Advantages {
            rewards: mine(a.rewards),
            advantages: mine(a.advantages),
            returns: mine(a.returns),
            correction: a.correction.map(|(mask, w)| (mine(mask), w.map(mine))),
        })
    }

    fn data_metrics(&self, batch: &Batch, m: &mut StepMetrics) -> rl_core::Result<()> {
        let response_mask = batch.get(keys::RESPONSE_MASK)?;
        let mask = &keys::policy_mask(batch)?;
        // from the attention mask, as verl: rollout correction's rejection zeroes response_mask
        // tokens without shortening the response
        let width = response_mask.size()[1];
        let attention = batch.get(keys::ATTENTION_MASK)?;
        let resp_len = attention
            .narrow(1, attention.size()[1] - width, width)
            .sum_dim_intlist([-1].as_slice(), false, Kind::Double);
        // verl's aborted responses (nothing generated) count in no score or reward
        let kept = resp_len.gt(0.0);
        if kept.any().int64_value(&[]) == 0 {
            return Err(role_err(
                "trainer",
                "every response of the batch is empty (nothing generated)",
            ));
        }
        let scores = batch.get(keys::TOKEN_LEVEL_SCORES)?.sum_dim_intlist(
            [-1].as_slice(),
            false,
            Kind::Double,
        );
        put3(m, "critic/score", stats(&scores.masked_select(&kept)));
        let rewards = batch.get(keys::TOKEN_LEVEL_REWARDS)?.sum_dim_intlist(
            [-1].as_slice(),
            false,
            Kind::Double,
        );
        put3(m, "critic/rewards", stats(&rewards.masked_select(&kept)));
        put3(
            m,
            "critic/advantages",
            masked_stats(batch.get(keys::ADVANTAGES)?, mask),
        );
        put3(
            m,
            "critic/returns",
            masked_stats(batch.get(keys::RETURNS)?, mask),
        );
        if let Ok(v) = batch.get(keys::VALUES) {
            put3(m, "critic/values", masked_stats(v, mask));
            let group = self.dp_group()?;
            let returns = batch.get(keys::RETURNS)?;
            if let Some(ev) = explained_variance(returns, v, mask, group.as_ref())? {
                m.insert("critic/vf_explained_var".into(), ev);
            }
        }
        put3(m, "response_length", stats(&resp_len));
        if batch.contains(keys::LOSS_MASK) {
            // multi-turn: generated and observation tokens apart
            let generated = mask.sum_dim_intlist([-1].as_slice(), false, Kind::Double);
            let observed = &resp_len - &generated;
            m.insert("response_length/generated_mean".into(), stats(&generated).0);
            m.insert(
                "response_length/observation_mean".into(),
                stats(&observed).0,
            );
        }
        env_metrics(batch, m);
        let clip_ratio = |lengths: &Tensor, limit: i64| {
            lengths
                .eq(limit as f64)
                .to_kind(Kind::Double)
                .mean(Kind::Double)
                .double_value(&[])
        };
        let max_response = self.cfg.max_response_length;
        m.insert(
            "response_length/clip_ratio".into(),
            clip_ratio(&resp_len, max_response),
        );
        let aborted = 1.0
            - kept
                .to_kind(Kind::Double)
                .mean(Kind::Double)
                .double_value(&[]);
        m.insert("response/aborted_ratio".into(), aborted);
        let generated = resp_len.masked_select(&kept);
        put3(m, "response_length_non_aborted", stats(&generated));
        m.insert(
            "response_length_non_aborted/clip_ratio".into(),
            clip_ratio(&generated, max_response),
        );
        let prompt_len = batch.get(keys::PROMPTS)?.size()[1];
        let prompt_lens = attention.narrow(1, 0, prompt_len).sum_dim_intlist(
            [-1].as_slice(),
            false,
            Kind::Double,
        );
        put3(m, "prompt_length", stats(&prompt_lens));
        // a prompt at the limit may have been truncated (verl pads every prompt to the limit)
        m.insert(
            "prompt_length/clip_ratio".into(),
            clip_ratio(&prompt_lens, self.cfg.max_prompt_length),
        );
        if let Some(acc) = f64_column(batch, ACC_COLUMN) {
            m.insert(
                "critic/acc/mean".into(),
                acc.iter().sum::<f64>() / acc.len().max(1) as f64,
            );
        }
        Ok(())
    }
}

/// The multi-turn rollout's `env/*` metrics, from its per-row columns (absent otherwise):
/// `env/number_of_turns` (mean model turns per response), `env/valid_action_ratio` (turns that
/// ended in a valid call or an answer, over all turns), `env/<tool>_calls` (mean calls per
/// response, every tool of the rollout) and `env/tool_errors` (mean failed calls per response).
fn env_metrics(batch: &Batch, m: &mut StepMetrics) {
    let mut totals = EnvTotals::default();
    totals.add(batch);
    m.extend(totals.metrics("env").into_iter().map(|(k, (v, _))| (k, v)));
}

/// Sums of the multi-turn columns over one or more batches (validation adds each of its
/// batches), from which the `env/*` means are taken.
#[derive(Debug, Default)]
struct EnvTotals {
    rows: f64,
    turns: f64,
    valid: Option<f64>,
    calls: Option<BTreeMap<String, f64>>,
    failed: f64,
}

impl EnvTotals {
    /// Adds a batch's rows; a batch without the multi-turn columns adds nothing.
    fn add(&mut self, batch: &Batch) {
        let Ok(turns) = batch.column(keys::NUM_TURNS) else {
            return;
        };
        self.rows += turns.len() as f64;
        self.turns += turns.iter().filter_map(Value::as_f64).sum::<f64>();
        if let Ok(valid) = batch.column(keys::VALID_ACTIONS) {
            *self.valid.get_or_insert(0.0) += valid.iter().filter_map(Value::as_f64).sum::<f64>();
        }
        if let Ok(calls) = batch.column(keys::TOOL_CALLS) {
            let per_tool = self.calls.get_or_insert_with(BTreeMap::new);
            for row in calls {
                for (tool, c) in row.as_object().into_iter().flatten() {
                    *per_tool.entry(tool.clone()).or_default() +=
                        c.get("calls").and_then(Value::as_f64).unwrap_or(0.0);
                    self.failed += c.get("failed").and_then(Value::as_f64).unwrap_or(0.0);
                }
            }
        }
    }

    /// `<prefix>/number_of_turns`, ... as `(mean, weight)`: per-response means weigh by rows,
    /// the valid action ratio by turns, so ranks combine into the global figure; empty when no
    /// multi-turn rows were added.
    fn metrics(&self, prefix: &str) -> BTreeMap<String, (f64, f64)> {
        let mut m = BTreeMap::new();
        if self.rows == 0.0 {
            return m;
        }
        let per_row = |x: f64| (x / self.rows, self.rows);
        m.insert(format!("{prefix}/number_of_turns"), per_row(self.turns));
        if let Some(valid) = self.valid {
            m.insert(
                format!("{prefix}/valid_action_ratio"),
                (valid / self.turns.max(1.0), self.turns),
            );
        }
        if let Some(calls) = &self.calls {
            for (tool, n) in calls {
                m.insert(format!("{prefix}/{tool}_calls"), per_row(*n));
            }
            m.insert(format!("{prefix}/tool_errors"), per_row(self.failed));
        }
        m
    }
}

/// Keys whose per-rank figure is a mean over response tokens, weighted by tokens when ranks are
/// combined (every other mean is weighted by rows; `actor/entropy` as its aggregation says).
fn token_weighted(key: &str) -> bool {
    ["critic/advantages/", "critic/returns/", "critic/values/"]
        .iter()
        .any(|p| key.starts_with(p))
}

/// Combines one step's metrics over the ranks (means weighted by rows or response tokens,
/// `*/max` and timings by maximum, `*/min` by minimum, token totals by sum), so every rank
/// returns the figures of the global batch; the throughput is recomputed from the totals.
/// `actor/entropy`, each rank's aggregate over its own rows with `entropy_agg`, is combined as
/// that mode aggregates the global batch: weighted by tokens (`token-mean`) or by non-empty
/// sequences (`seq-mean-*`), or summed (`seq-mean-token-sum-norm`, a sum over a constant).
fn reduce_step_metrics(
    group: &SharedCollective,
    m: StepMetrics,
    batch: &Batch,
    entropy_agg: LossAggMode,
) -> rl_core::Result<StepMetrics> {
    let rows = batch.len() as f64;
    // the token-weighted metrics are means over the loss tokens (observations excluded)
    let mask = keys::policy_mask(batch)?;
    let tokens = mask.sum(Kind::Double).double_value(&[]);
    let sequences = mask
        .sum_dim_intlist([1].as_slice(), false, Kind::Double)
        .gt(0.0)
        .sum(Kind::Double)
        .double_value(&[]);
    let (entropy_weight, entropy_reduce) = entropy_reduce(entropy_agg, tokens, sequences);
    // the `env/*` metrics carry their own weights (the valid action ratio is over turns)
    let mut env = EnvTotals::default();
    env.add(batch);
    let env = env.metrics("env");
    let local = m
        .into_iter()
        .map(|(k, v)| {
            let w = match env.get(&k) {
                Some(&(_, w)) => w,
                None if k == ENTROPY => entropy_weight,
                None if token_weighted(&k) => tokens,
                None => rows,
            };
            (k, (v, w))
        })
        .collect();
    let how = |k: &str| {
        if k == ENTROPY {
            entropy_reduce
        } else {
            dist::default_reduce(k)
        }
    };
    let mut out = dist::reduce_metrics(&mut *dist::lock(group)?, &local, how)?;
    if let (Some(t), Some(s)) = (
        out.get("perf/total_num_tokens").copied(),
        out.get("timing_s/step").copied(),
    ) {
        out.insert("perf/throughput".into(), t / s.max(1e-9));
    }
    Ok(out)
}

/// The actor's entropy metric (verl's name).
const ENTROPY: &str = "actor/entropy";

/// How the ranks' `actor/entropy` figures (each aggregated with `mode` over the rank's rows, of
/// which `tokens` response tokens and `sequences` non-empty responses) combine into the global
/// batch's: this rank's weight and the reduction.
fn entropy_reduce(mode: LossAggMode, tokens: f64, sequences: f64) -> (f64, dist::MetricReduce) {
    match mode {
        LossAggMode::TokenMean => (tokens, dist::MetricReduce::Mean),
        LossAggMode::SeqMeanTokenSum | LossAggMode::SeqMeanTokenMean => {
            (sequences, dist::MetricReduce::Mean)
        }
        // a sum over a constant: the ranks' figures add up
        LossAggMode::SeqMeanTokenSumNorm => (1.0, dist::MetricReduce::Sum),
    }
}

impl Trainer for OnPolicyTrainer {
    fn global_step(&self) -> u64 {
        self.global_step
    }

    fn total_steps(&self) -> u64 {
        self.cfg.total_steps()
    }

    fn step(&mut self) -> rl_core::Result<StepMetrics> {
        let t_step = Instant::now();
        let mut timing: BTreeMap<&'static str, f64> = BTreeMap::new();
        let mut m = StepMetrics::new();
        let filter = self
            .cfg
            .algorithm
            .filter_groups
            .as_ref()
            .is_some_and(|f| f.enable);
        let mut batch = if filter {
            self.generate_filtered(&mut timing, &mut m)?
        } else if self.background.is_some() {
            self.generate_async(&mut timing, &mut m)?
        } else {
            self.generate(0, &mut timing)?
        };
        let mask = keys::policy_mask(&batch)?;

        let algo = self.cfg.algorithm.clone();
        let rc = &algo.rollout_correction;
        let sum_pi_squared = self.needs_sum_pi_squared();
        let t = Instant::now();
        if rc.bypass_mode {
            // verl's bypass mode: the rollout's log-probs stand in for old_log_probs
            let rollout = batch.get(keys::ROLLOUT_LOG_PROBS)?.shallow_clone();
            batch.insert(keys::OLD_LOG_PROBS, rollout)?;
            if sum_pi_squared {
                let extras = LogProbExtras {
                    entropy: false,
                    sum_pi_squared: true,
                };
                let mut out = self.roles.actor.compute_log_prob_with(&batch, extras)?;
                batch.insert(keys::SUM_PI_SQUARED, out.pop(keys::SUM_PI_SQUARED)?)?;
                timing.insert("old_log_prob", t.elapsed().as_secs_f64());
            }
        } else if self.old_log_probs_from_update(batch.len()) {
            // the update is on-policy and nothing reads old_log_probs before it: its forward
            // supplies them (and the entropy metric), and the separate forward is skipped
            batch
                .meta_info_mut()
                .insert(OLD_LOG_PROBS_FROM_UPDATE.into(), true.into());
        } else {
            let extras = LogProbExtras {
                entropy: true,
                sum_pi_squared,
            };
            let old = self.roles.actor.compute_log_prob_with(&batch, extras)?;
            if let Ok(ent) = old.get(keys::ENTROPYS)
                && let Some(v) = objective::entropy_metric(&self.cfg.actor, ent, &mask)?
            {
                m.insert(ENTROPY.into(), v);
            }
            batch.union(old)?;
            timing.insert("old_log_prob", t.elapsed().as_secs_f64());
        }

        if self.cfg.actor.use_kl_loss || algo.use_kl_in_reward {
            let t = Instant::now();
            let reference = self
                .roles
                .reference
                .as_mut()
                .ok_or_else(|| role_err("trainer", "no reference role"))?;
            batch.union(reference.compute_ref_log_prob(&batch)?)?;
            timing.insert("ref", t.elapsed().as_secs_f64());
        }
        if algo.adv_estimator.needs_critic() {
            let t = Instant::now();
            let critic = self
                .roles
                .critic
                .as_mut()
                .ok_or_else(|| role_err("trainer", "no critic role"))?;
            batch.union(critic.compute_values(&batch)?)?;
            timing.insert("values", t.elapsed().as_secs_f64());
        }

        let t = Instant::now();
        let a = match self.dp_group()? {
            None => self.rewards_and_advantages(&batch, &mut m)?,
            Some(g) => self.rewards_and_advantages_global(&g, &batch, &mut m)?,
        };
        if let Some((kept, weights)) = a.correction {
            // rejected policy tokens leave the response mask; observation tokens (outside the
            // policy mask) keep theirs
            let policy = keys::policy_mask(&batch)?;
            let response = batch.get(keys::RESPONSE_MASK)?;
            let dropped = (&policy - kept.to_kind(policy.kind())).to_kind(response.kind());
            let new_mask = response - dropped;
            batch.insert(keys::RESPONSE_MASK, new_mask)?;
            if let Some(w) = weights {
                batch.insert(keys::ROLLOUT_IS_WEIGHTS, w.to_kind(Kind::Float))?;
            }
        }
        batch.insert(keys::TOKEN_LEVEL_REWARDS, a.rewards)?;
        batch.insert(keys::ADVANTAGES, a.advantages.to_kind(Kind::Float))?;
        batch.insert(keys::RETURNS, a.returns.to_kind(Kind::Float))?;
        timing.insert("adv", t.elapsed().as_secs_f64());

        if let Some(critic) = self.roles.critic.as_mut()
            && algo.adv_estimator == AdvEstimator::Gae
        {
            let t = Instant::now();
            let cm = critic.update(
                &batch,
                &ValueLoss {
                    cfg: self.cfg.critic,
                },
            )?;
            m.extend(cm.mean());
            timing.insert("update_critic", t.elapsed().as_secs_f64());
        }
        if self.global_step >= self.cfg.trainer.critic_warmup {
            let t = Instant::now();
            let am = self.roles.actor.update(
                &batch,
                &PolicyLoss {
                    cfg: self.cfg.actor,
                    rollout: RolloutLoss {
                        bypass: rc.bypass_mode.then(|| rc.clone()),
                        diagnostics: self.decoupled_correction(),
                    },
                },
            )?;
            m.extend(am.mean());
            timing.insert("update_actor", t.elapsed().as_secs_f64());
        }

        self.data_metrics(&batch, &mut m)?;
        // `reward/score/*` and each part of a combined reward (`reward/rm_score/*`, ...)
        m.extend(reward_metrics(&batch));
        // the variance proxies' row means, for the optimal token baselines (sum_pi_squared)
        if let Some(v) = step_metrics::variance_proxy(&batch)? {
            m.extend(v);
        }
        let step_s = t_step.elapsed().as_secs_f64();
        timing.insert("step", step_s);
        // [prompt tokens, response tokens, rows] of this rank's batch
        let mut sizes = step_metrics::batch_sizes(&batch)?;
        let tokens = sizes[0] + sizes[1];
        m.insert("perf/total_num_tokens".into(), tokens);
        m.insert("perf/throughput".into(), tokens / step_s.max(1e-9));
        for (k, v) in timing {
            m.insert(format!("timing_s/{k}"), v);
        }
        self.global_step += 1;
        m.insert("training/global_step".into(), self.global_step as f64);
        if let Some(g) = self.dp_group()? {
            m = reduce_step_metrics(&g, m, &batch, self.cfg.actor.loss_agg_mode)?;
            dist::all_reduce_f64(&mut *dist::lock(&g)?, &mut sizes, dist::ReduceOp::Sum)?;
            if !self.replicas_checked {
                self.check_replicas(&g)?;
                self.replicas_checked = true;
            }
        }
        // ratios of the global batch's figures
        step_metrics::add_per_token_timings(&mut m, sizes);
        step_metrics::finish_variance_proxy(&mut m, sizes);
        Ok(m)
    }

    fn validate(&mut self) -> rl_core::Result<(StepMetrics, Vec<Sample>)> {
        let mut per_source: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        let mut samples = Vec::new();
        let mut env = EnvTotals::default();
        let (rank, world) = self.rank_and_world()?;
        for i in 0..self.val.len() {
            let shard = dist::shard_range(self.val[i].len(), rank, world);
            if shard.is_empty() {
                continue;
            }
            let offset = shard.start;
            let mut prompts = if world > 1 {
                self.val[i].slice(shard)?
            } else {
                self.val[i].shallow_clone()
            };
            let meta = prompts.meta_info_mut();
            meta.insert("validate".into(), true.into());
            // sampled validation draws each row's stream by its index in the whole val batch
            meta.insert(dist::DP_PROMPT_OFFSET.into(), offset.into());
            meta.insert("global_step".into(), (self.global_step * 1000 + 999).into());
            meta.insert(POLICY_VERSION.into(), self.global_step.into());
            let mut out = match &mut self.background {
                // the background holds the policy's copy (and a server's weights): validate
                // there, with the current weights, after the batches in flight
                Some(b) => b.get_mut().generate_now(self.global_step, prompts)?,
                None => self.roles.rollout.generate(&prompts)?,
            };
            out.meta_info_mut().remove(GENERATION_SECONDS);
            out.union(self.roles.reward.score(&out)?)?;
            env.add(&out);
            let scores = match f64_column(&out, SCORE_COLUMN) {
                Some(s) => s,
                None => Vec::<f64>::try_from(out.get(keys::TOKEN_LEVEL_SCORES)?.sum_dim_intlist(
                    [-1].as_slice(),
                    false,
                    Kind::Double,
                ))?,
            };
            let sources = string_column(&out, keys::DATA_SOURCE)?;
            let prompts_text = string_column(&out, PROMPT_TEXT_COLUMN).unwrap_or_default();
            let responses_text = string_column(&out, RESPONSE_TEXT_COLUMN).unwrap_or_default();
            for (r, (s, ds)) in scores.iter().zip(&sources).enumerate() {
                per_source.entry(ds.clone()).or_default().push(*s);
                if samples.len() < self.cfg.trainer.log_val_generations {
                    samples.push(Sample {
                        prompt: prompts_text.get(r).cloned().unwrap_or_default(),
                        response: responses_text.get(r).cloned().unwrap_or_default(),
                        score: *s,
                        data_source: ds.clone(),
                    });
                }
            }
        }
        let mut local: BTreeMap<String, (f64, f64)> = per_source
            .into_iter()
            .map(|(ds, s)| {
                let n = s.len() as f64;
                (
                    format!("val/test_score/{ds}"),
                    (s.iter().sum::<f64>() / n.max(1.0), n),
                )
            })
            .collect();
        // multi-turn validation: `val/env/number_of_turns`, `val/env/search_calls`, ...
        local.extend(env.metrics("val/env"));
        if let Some(g) = self.dp_group()? {
            self.check_replicas(&g)?;
            let global =
                dist::reduce_metrics(&mut *dist::lock(&g)?, &local, |_| dist::MetricReduce::Mean)?;
            local = global.into_iter().map(|(k, v)| (k, (v, 1.0))).collect();
        }
        let m: StepMetrics = local.into_iter().map(|(k, (v, _))| (k, v)).collect();
        Ok((m, samples))
    }

    fn save_checkpoint(&self, dir: &Path) -> rl_core::Result<()> {
        // every rank holds the same weights and the same global loader state: rank 0 writes;
        // the others only join the gathering of a ZeRO-sharded optimiser state
        if self.rank_and_world()?.0 != 0 {
            self.roles.actor.save_state(&dir.join("actor"))?;
            if let Some(critic) = self.roles.critic.as_ref() {
                critic.save_state(&dir.join("critic"))?;
            }
            return Ok(());
        }
        let io = |path: &Path, source| rl_core::Error::Io {
            path: path.display().to_string(),
            source,
        };
        let actor = dir.join("actor");
        std::fs::create_dir_all(&actor).map_err(|e| io(&actor, e))?;
        self.roles.actor.save_state(&actor)?;
        if let Some(critic) = self.roles.critic.as_ref() {
            let d = dir.join("critic");
            std::fs::create_dir_all(&d).map_err(|e| io(&d, e))?;
            critic.save_state(&d)?;
        }
        let async_rollout = match &self.background {
            Some(b) => b.borrow_mut().save(&dir.join(async_rollout::FOLDER))?,
            None => Vec::new(),
        };
        let state = TrainerState {
            global_step: self.global_step,
            train_source: self.train.state(),
            kl_ctrl: self.kl_ctrl.clone(),
            async_rollout,
        };
        let path = dir.join("trainer_state.json");
        let text = serde_json::to_string_pretty(&state).map_err(|e| role_err("trainer", e))?;
        std::fs::write(&path, text).map_err(|e| io(&path, e))
    }

    fn load_checkpoint(&mut self, dir: &Path) -> rl_core::Result<()> {
        let path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&path).map_err(|source| rl_core::Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        let state: TrainerState =
            serde_json::from_str(&text).map_err(|e| rl_core::Error::Format {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
        self.roles.actor.load_state(&dir.join("actor"))?;
        if let Some(critic) = self.roles.critic.as_mut() {
            critic.load_state(&dir.join("critic"))?;
        }
        match &mut self.background {
            Some(b) => b.get_mut().load(
                &dir.join(async_rollout::FOLDER),
                state.global_step,
                &state.async_rollout,
            )?,
            None if !state.async_rollout.is_empty() => {
                return Err(rl_core::Error::Format {
                    path: path.display().to_string(),
                    reason: format!(
                        "the checkpoint holds {} batches generated ahead by asynchronous training \
                         (async_training.enable = true), which this trainer would skip; resume with \
                         the run's own config",
                        state.async_rollout.len()
                    ),
                });
            }
            None => {}
        }
        self.train.load_state(&state.train_source)?;
        self.kl_ctrl = state.kl_ctrl;
        self.global_step = state.global_step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `actor/entropy` is verl's `agg_loss` of the entropies with the loss's mode (checked by
    /// hand on rows of 3, 1 and 0 tokens), and each rank's figure over its own rows, combined as
    /// [`entropy_reduce`] says, is the figure of the whole batch, for every mode, with ranks
    /// of unequal tokens and sequences.
    #[test]
    fn the_entropy_metric_follows_the_loss_aggregation_and_combines_over_ranks() {
        use crate::trainer::config::ActorLossConfig;
        let e = Tensor::from_slice(&[1.0f64, 2.0, 6.0, 4.0, 9.0, 9.0, 5.0, 7.0, 7.0]).view([3, 3]);
        let m = Tensor::from_slice(&[1.0f64, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]).view([3, 3]);
        let metric = |mode, scale: Option<f64>, e: &Tensor, m: &Tensor| {
            let cfg = ActorLossConfig {
                loss_agg_mode: mode,
                loss_scale_factor: scale,
                ..ActorLossConfig::default()
            };
            objective::entropy_metric(&cfg, e, m).unwrap()
        };
        for (mode, scale, want) in [
            (LossAggMode::TokenMean, None, 13.0 / 4.0),
            (LossAggMode::SeqMeanTokenSum, None, (9.0 + 4.0) / 2.0),
            (LossAggMode::SeqMeanTokenMean, None, (3.0 + 4.0) / 2.0),
            (LossAggMode::SeqMeanTokenSumNorm, None, 13.0 / 3.0),
            (LossAggMode::SeqMeanTokenSumNorm, Some(10.0), 1.3),
        ] {
            let got = metric(mode, scale, &e, &m).unwrap();
            assert!((got - want).abs() < 1e-6, "{mode}: {got}, want {want}");
            assert_eq!(metric(mode, scale, &e, &m.zeros_like()), None, "{mode}");
        }
        // 7 rows of 0-5 tokens over two ranks of 3 and 4 rows
        let e = Tensor::from_slice(
            &(0..35)
                .map(|i| (i * 7 % 11) as f64 / 3.0)
                .collect::<Vec<_>>(),
        )
        .view([7, 5]);
        let lengths = [5i64, 1, 3, 0, 2, 5, 4];
        let m = Tensor::arange(5, (Kind::Double, tch::Device::Cpu))
            .unsqueeze(0)
            .lt_tensor(&Tensor::from_slice(&lengths).unsqueeze(1))
            .to_kind(Kind::Double);
        for mode in LossAggMode::ALL {
            let whole = metric(mode, None, &e, &m).unwrap();
            let (mut sum, mut weights) = (0.0, 0.0);
            let mut reduce = None;
            for (start, rows) in [(0, 3), (3, 4)] {
                let (e, m) = (e.narrow(0, start, rows), m.narrow(0, start, rows));
                let v = metric(mode, None, &e, &m).unwrap();
                let tokens = m.sum(Kind::Double).double_value(&[]);
                let sequences = m
                    .sum_dim_intlist([1].as_slice(), false, Kind::Double)
                    .gt(0.0);
                let sequences = sequences.sum(Kind::Double).double_value(&[]);
                let (w, how) = entropy_reduce(mode, tokens, sequences);
                reduce = Some(how);
                sum += match how {
                    dist::MetricReduce::Sum => v,
                    _ => v * w,
                };
                weights += w;
            }
            let combined = match reduce.unwrap() {
                dist::MetricReduce::Sum => sum,
                _ => sum / weights,
            };
            assert!(
                (combined - whole).abs() < 1e-9 * whole.abs(),
                "{mode}: ranks {combined}, whole batch {whole}"
            );
        }
    }

    /// verl's formula on the masked tokens: a constant prediction explains nothing whatever
    /// its offset, a perfect one everything, and a half-way one the figure `torch.var` gives.
    #[test]
    fn explained_variance_is_verls_over_the_masked_tokens() {
        let returns = Tensor::from_slice(&[1.0f32, 2.0, 4.0, 9.0, 7.0, 5.0]).view([2, 3]);
        let mask = Tensor::from_slice(&[1.0f32, 1.0, 1.0, 1.0, 1.0, 0.0]).view([2, 3]);
        let ev = |values: &Tensor| {
            explained_variance(&returns, values, &mask, None)
                .unwrap()
                .unwrap()
        };
        let kept = [1.0f64, 2.0, 4.0, 9.0, 7.0];
        let var = |x: &[f64]| {
            let mean = x.iter().sum::<f64>() / x.len() as f64;
            x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (x.len() - 1) as f64
        };
        for offset in [0.0f32, 3.5, -20.0] {
            let constant = Tensor::full([2, 3], offset as f64, (Kind::Float, tch::Device::Cpu));
            let want = 1.0 - var(&kept) / (var(&kept) + 1e-5);
            assert!((ev(&constant) - want).abs() < 1e-9, "offset {offset}");
        }
        assert!((ev(&returns) - 1.0).abs() < 1e-12);
        // the masked-out token's value does not count
        let half = Tensor::from_slice(&[0.5f32, 1.0, 2.0, 4.5, 3.5, 100.0]).view([2, 3]);
        let want = 1.0 - var(&kept.map(|r| r / 2.0)) / (var(&kept) + 1e-5);
        assert!((ev(&half) - want).abs() < 1e-9);
        let one = Tensor::from_slice(&[1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0]).view([2, 3]);
        assert_eq!(
            explained_variance(&returns, &returns, &one, None).unwrap(),
            None
        );
    }

    #[test]
    fn env_metrics_average_turns_calls_and_errors_per_response() {
        let mut b = Batch::new();
        b.insert_column(keys::NUM_TURNS, vec![json!(3), json!(1)])
            .unwrap();
        b.insert_column(keys::VALID_ACTIONS, vec![json!(2), json!(1)])
            .unwrap();
        b.insert_column(
            keys::TOOL_CALLS,
            vec![
                json!({"search": {"calls": 2, "failed": 1}, "calculator": {"calls": 0, "failed": 0}}),
                json!({"search": {"calls": 0, "failed": 0}, "calculator": {"calls": 0, "failed": 0}}),
            ],
        )
        .unwrap();
        let mut m = StepMetrics::new();
        env_metrics(&b, &mut m);
        assert_eq!(m["env/number_of_turns"], 2.0);
        assert_eq!(m["env/valid_action_ratio"], 0.75);
        assert_eq!(m["env/search_calls"], 1.0);
        assert_eq!(m["env/calculator_calls"], 0.0);
        assert_eq!(m["env/tool_errors"], 0.5);
        // single-turn batches have none
        let mut none = StepMetrics::new();
        env_metrics(&Batch::new(), &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn env_totals_over_several_batches_weigh_rows_and_turns() {
        let batch = |turns: Vec<i64>, valid: Vec<i64>, calls: Vec<i64>| {
            let mut b = Batch::new();
            b.insert_column(
                keys::NUM_TURNS,
                turns.into_iter().map(|t| json!(t)).collect(),
            )
            .unwrap();
            b.insert_column(
                keys::VALID_ACTIONS,
                valid.into_iter().map(|t| json!(t)).collect(),
            )
            .unwrap();
            b.insert_column(
                keys::TOOL_CALLS,
                calls
                    .into_iter()
                    .map(|c| json!({"search": {"calls": c, "failed": 0}}))
                    .collect(),
            )
            .unwrap();
            b
        };
        let mut t = EnvTotals::default();
        t.add(&batch(vec![1], vec![0], vec![0]));
        t.add(&batch(vec![3, 2, 2], vec![3, 2, 2], vec![2, 1, 1]));
        let m = t.metrics("val/env");
        // 8 turns over 4 rows; 7 of the 8 turns valid (not the mean of 0 and 1); 4 calls
        assert_eq!(m["val/env/number_of_turns"], (2.0, 4.0));
        assert_eq!(m["val/env/valid_action_ratio"], (7.0 / 8.0, 8.0));
        assert_eq!(m["val/env/search_calls"], (1.0, 4.0));
        assert_eq!(m["val/env/tool_errors"], (0.0, 4.0));
    }
}
