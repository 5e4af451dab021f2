//! The policy's three roles over one set of weights (verl's hybrid engine): [`ActorWorker`]
//! trains it, [`RolloutWorker`] samples from the same weights (no copy per step), and
//! [`ReferenceWorker`] is a frozen copy of the initial policy.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::{
    Actor, LogProbExtras, Metrics, OLD_LOG_PROBS_FROM_UPDATE, PolicyObjective, PolicyOutput,
    Reference, Rollout,
};
use rl_core::{Batch, keys};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::heads::CausalLm;
use crate::multiturn::{MultiTurnOutput, ToolEnv, TurnStats, generate_multi_turn};
use crate::remote::RemoteEngine;
use crate::roles::config::{ActorConfig, ValKwargs};
use crate::roles::micro::{self, Micro, Packing};
use crate::roles::optim::AdamW;
use crate::roles::role_err;
use crate::roles::zero::ZeroStage;
use crate::rollout::Progress;
use crate::rollout::{GenerateOptions, RolloutConfig, RolloutOutput, generate};

/// The policy's weights, shared by the actor and the rollout.
pub type SharedPolicy = Arc<Mutex<CausalLm>>;

/// Wraps a model for sharing between [`ActorWorker`] and [`RolloutWorker`].
pub fn share(lm: CausalLm) -> SharedPolicy {
    Arc::new(Mutex::new(lm))
}

pub(crate) fn lock<'a, T>(
    m: &'a Mutex<T>,
    role: &'static str,
) -> rl_core::Result<MutexGuard<'a, T>> {
    m.lock().map_err(|_| rl_core::Error::Role {
        role,
        source: "the shared model's lock is poisoned (a previous call panicked)".into(),
    })
}

/// `meta_info[key]` as f64, or `default`.
pub(crate) fn meta_f64(batch: &Batch, key: &str, default: f64) -> f64 {
    batch
        .meta_info()
        .get(key)
        .and_then(Value::as_f64)
        .unwrap_or(default)
}

/// `meta_info[key]` as u64, or `default`.
pub(crate) fn meta_u64(batch: &Batch, key: &str, default: u64) -> u64 {
    batch
        .meta_info()
        .get(key)
        .and_then(Value::as_u64)
        .unwrap_or(default)
}

/// The trained policy: log-probs without gradient, and PPO-style updates (mini-batches x
/// `ppo_epochs`, micro-batch accumulation with the mini-batch's global normalisers, global-norm
/// clipping that skips non-finite steps, AdamW with a warmup/cosine schedule).
///
/// Data parallel with [`with_group`](Self::with_group): each rank updates on its shard of the
/// batch, normalises by the global mini-batch counts, and averages gradients over the ranks
/// before clipping and stepping, so the weights stay bit-identical on every rank.
pub struct ActorWorker {
    lm: SharedPolicy,
    cfg: ActorConfig,
    rollout_n: usize,
    optim: AdamW,
    group: Option<SharedCollective>,
}

impl std::fmt::Debug for ActorWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActorWorker")
            .field("cfg", &self.cfg)
            .field("rollout_n", &self.rollout_n)
            .field("optim", &self.optim)
            .field("data_parallel", &self.group.is_some())
            .finish_non_exhaustive()
    }
}

/// Checks that the global `ppo_mini_batch_size` splits over the ranks of `group`.
pub(crate) fn check_dp_mini_batch(
    key: &'static str,
    ppo_mini_batch_size: usize,
    group: &SharedCollective,
    role: &'static str,
) -> rl_core::Result<usize> {
    let world = dist::lock(group)?.world_size();
    if !ppo_mini_batch_size.is_multiple_of(world) {
        return Err(role_err(role)(Error::invalid(
            key,
            format!(
                "{ppo_mini_batch_size} prompts per mini-batch do not split over {world} data-parallel ranks (it is the global mini-batch; make it a multiple of the world size)"
            ),
        )));
    }
    Ok(world)
}

/// Copies rank 0's `tensors` to every rank (DDP's initial broadcast).
pub(crate) fn broadcast_from_rank0(
    group: &SharedCollective,
    tensors: &[tch::Tensor],
) -> rl_core::Result<()> {
    let mut g = dist::lock(group)?;
    if g.world_size() == 1 {
        return Ok(());
    }
    let _guard = tch::no_grad_guard();
    for t in tensors {
        let mut c = t.contiguous();
        g.broadcast(&mut c, 0)?;
        let mut t = t.shallow_clone();
        t.copy_(&c);
    }
    Ok(())
}

impl ActorWorker {
    /// The layout of this actor's forwards (`use_remove_padding`, `use_prefix_grouper`).
    fn packing(&self) -> Packing {
        Packing::new(self.cfg.use_remove_padding, self.cfg.use_prefix_grouper)
    }

    /// Whether an update over `rows` rows is one mini-batch for one epoch ([`is_on_policy`]).
    fn updates_on_policy(&self, rows: usize) -> bool {
        let world = self.data_parallel_ranks();
        is_on_policy(
            &self.cfg,
            mini_batch_rows(&self.cfg, self.rollout_n, world),
            rows,
        )
    }

    /// An actor over `lm`; `rollout_n` turns `ppo_mini_batch_size` (prompts) into rows.
    pub fn new(lm: SharedPolicy, cfg: ActorConfig, rollout_n: usize) -> rl_core::Result<Self> {
        cfg.validate("actor_rollout_ref.actor")
            .map_err(role_err("actor"))?;
        if rollout_n == 0 {
            return Err(role_err("actor")(Error::invalid(
                "rollout_n",
                "must be at least 1",
            )));
        }
        let optim = AdamW::for_model(
            lock(&lm, "actor")?.var_store_mut(),
            cfg.optim.clone(),
            &cfg.mixed_precision,
        )
        .map_err(role_err("actor"))?;
        Ok(ActorWorker {
            lm,
            cfg,
            rollout_n,
            optim,
            group: None,
        })
    }

    /// Makes the actor data-parallel over `group`: `ppo_mini_batch_size` becomes the global
    /// mini-batch (each rank updates on its `1 / world_size` share), and rank 0's weights are
    /// broadcast to every rank now, so replicas start equal. A collective: every rank calls it.
    ///
    /// Errors when `actor_rollout_ref.actor.ppo_mini_batch_size` is not a multiple of the
    /// world size.
    pub fn with_group(mut self, group: SharedCollective) -> rl_core::Result<Self> {
        if self.cfg.use_fused_kernels
            && self.cfg.zero_stage == 3
            && dist::lock(&group)?.world_size() > 1
        {
            return Err(rl_core::Error::InvalidArgument {
                name: "actor_rollout_ref.model.use_fused_kernels",
                reason: "the fused head is not built for ZeRO stage 3 \
                         (actor_rollout_ref.actor.zero_stage = 3): set one of them lower"
                    .into(),
            });
        }
        check_dp_mini_batch(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            self.cfg.ppo_mini_batch_size,
            &group,
            "actor",
        )?;
        {
            let lm = lock(&self.lm, "actor")?;
            let vars: Vec<tch::Tensor> = sorted_vars(lm.var_store());
            broadcast_from_rank0(&group, &vars)?;
        }
        shard_role(
            "actor",
            "actor_rollout_ref.actor.zero_stage",
            self.cfg.zero_stage,
            &group,
            &mut self.optim,
            &mut *lock(&self.lm, "actor")?,
        )?;
        self.group = Some(group);
        Ok(self)
    }

    /// The data-parallel group, if any.
    pub fn group(&self) -> Option<&SharedCollective> {
        self.group.as_ref()
    }

    /// Checks that the weights are bit-identical on every rank (a collective); without a group
    /// it is a no-op.
    pub fn check_replicas(&self) -> rl_core::Result<()> {
        let Some(group) = &self.group else {
            return Ok(());
        };
        let lm = lock(&self.lm, "actor")?;
        let _whole = lm.model().hold_all().map_err(role_err("actor"))?;
        let vars = sorted_vars(lm.var_store());
        dist::check_replicas(&mut *dist::lock(group)?, "actor weights", &vars)
    }

    /// The shared weights (hand them to a [`RolloutWorker`] or a [`ReferenceWorker`]).
    pub fn policy(&self) -> SharedPolicy {
        self.lm.clone()
    }

    /// The optimiser (for its counters).
    pub fn optimizer(&self) -> &AdamW {
        &self.optim
    }

    /// The config.
    pub fn config(&self) -> &ActorConfig {
        &self.cfg
    }
}

/// Every variable of `vs` in name order (the same order on every rank).
pub(crate) fn sorted_vars(vs: &tch::nn::VarStore) -> Vec<tch::Tensor> {
    let mut vars: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars.into_iter().map(|(_, t)| t).collect()
}

/// A head whose parameters ZeRO stage 3 can shard.
pub(crate) trait ShardableHead {
    /// Shards the parameters over `group` ([`crate::ParamShards`]).
    fn shard_params(&mut self, group: SharedCollective) -> crate::Result<()>;
    /// The decoder stack, which holds the shards.
    fn stack(&self) -> &crate::Model;
}

impl ShardableHead for CausalLm {
    fn shard_params(&mut self, group: SharedCollective) -> crate::Result<()> {
        CausalLm::shard_params(self, group)
    }
    fn stack(&self) -> &crate::Model {
        self.model()
    }
}

impl ShardableHead for crate::ValueModel {
    fn shard_params(&mut self, group: SharedCollective) -> crate::Result<()> {
        crate::ValueModel::shard_params(self, group)
    }
    fn stack(&self) -> &crate::Model {
        self.model()
    }
}

/// Splits a trained role's state over `group` at the ZeRO stage of config `key` (`stage`):
/// the optimiser state (stages 1 and 2), or at stage 3 the head's parameters with it. Call it
/// after rank 0's weights were broadcast; a collective.
pub(crate) fn shard_role(
    role: &'static str,
    key: &str,
    stage: u8,
    group: &SharedCollective,
    optim: &mut AdamW,
    head: &mut dyn ShardableHead,
) -> rl_core::Result<()> {
    let stage = ZeroStage::from_config(key, stage).map_err(role_err(role))?;
    optim.broadcast_masters(&mut *dist::lock(group)?)?;
    if stage != ZeroStage::Parameters || dist::lock(group)?.world_size() == 1 {
        return optim.shard(group.clone(), stage);
    }
    head.shard_params(group.clone()).map_err(role_err(role))?;
    match head.stack().param_shards() {
        Some(shards) => optim.shard_params(shards),
        None => Err(role_err(role)(Error::invalid(
            key,
            "stage 3 left the parameters whole",
        ))),
    }
}

/// Runs `f` over micro-batches without gradient and reassembles `[batch, response_len]` outputs.
/// With `stack`'s parameters sharded (stage 3) the ranks then run as many forwards (a rank
/// with fewer micro-batches makes idle ones).
pub(crate) fn no_grad_per_micro(
    batch: &Batch,
    rows: Option<usize>,
    tokens: Option<usize>,
    stack: &crate::Model,
    mut f: impl FnMut(&Batch) -> rl_core::Result<Vec<tch::Tensor>>,
) -> rl_core::Result<Vec<tch::Tensor>> {
    let _guard = tch::no_grad_guard();
    let micros = micro::split(batch, rows, tokens)?;
    let count = micros.len();
    let most = stack.most_forwards(count).map_err(role_err("forward"))?;
    let mut outs: Vec<Vec<tch::Tensor>> = Vec::new();
    let mut order = Vec::new();
    for Micro { batch, rows } in micros {
        let parts = f(&batch)?;
        if outs.is_empty() {
            outs = parts.iter().map(|_| Vec::new()).collect();
        }
        for (slot, t) in outs.iter_mut().zip(parts) {
            slot.push(t);
        }
        order.push(rows);
    }
    for _ in count..most {
        stack.idle_forward().map_err(role_err("forward"))?;
    }
    Ok(outs
        .iter()
        .map(|parts| micro::reassemble(parts, &order))
        .collect())
}

/// The shared update loop of actor and critic: mini-batches x epochs, micro-batch gradient
/// accumulation, clip, step; `loss` gives one micro-batch's share of its mini-batch's loss.
pub(crate) fn update_loop(
    cfg: &ActorConfig,
    rollout_n: usize,
    batch: &Batch,
    optim: &mut AdamW,
    prefix: &'static str,
    stack: &crate::Model,
    loss: impl FnMut(&Batch, rl_core::roles::MiniBatchInfo) -> rl_core::Result<(tch::Tensor, Metrics)>,
) -> rl_core::Result<Metrics> {
    update_loop_dp(
        cfg,
        rollout_n,
        batch,
        optim,
        prefix,
        None,
        stack,
        loss,
        || Ok(()),
    )
}

/// Rows of one of this rank's mini-batches: `ppo_mini_batch_size` prompts times `rollout_n`
/// over the `world` ranks, as verl normalises it.
fn mini_batch_rows(cfg: &ActorConfig, rollout_n: usize, world: usize) -> usize {
    cfg.ppo_mini_batch_size * rollout_n / world.max(1)
}

/// verl's `on_policy`: an update of `len` rows in mini-batches of `rows` is one mini-batch for
/// one epoch, so every forward of it runs at the weights the batch arrived with.
fn is_on_policy(cfg: &ActorConfig, rows: usize, len: usize) -> bool {
    len == rows && cfg.ppo_epochs == 1
}

/// [`update_loop`], data parallel over `group` when given.
///
/// With a `group`, `batch` is this rank's shard: a mini-batch is `1 / world_size` of the global
/// one, its normalisers ([`MiniBatchInfo`](rl_core::roles::MiniBatchInfo)) are the global counts
/// (all-reduced), each micro-batch carries `meta_info.dp_size`, and gradients are averaged over
/// the ranks before clipping (verl's `agg_loss` with `dp_size` under FSDP). With `stack`'s
/// parameters sharded (ZeRO stage 3) each micro-batch's backward continues through the layers
/// ([`crate::Model::finish_backward`]). `after_backward` runs after each micro-batch's loss
/// backward, before that: the fused head's recompute ([`crate::fused_head::PendingHead`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn update_loop_dp(
    cfg: &ActorConfig,
    rollout_n: usize,
    batch: &Batch,
    optim: &mut AdamW,
    prefix: &'static str,
    group: Option<&SharedCollective>,
    stack: &crate::Model,
    mut loss: impl FnMut(
        &Batch,
        rl_core::roles::MiniBatchInfo,
    ) -> rl_core::Result<(tch::Tensor, Metrics)>,
    mut after_backward: impl FnMut() -> rl_core::Result<()>,
) -> rl_core::Result<Metrics> {
    let world = match group {
        Some(g) => dist::lock(g)?.world_size(),
        None => 1,
    };
    let rows = mini_batch_rows(cfg, rollout_n, world);
    let len = batch.len();
    if rows == 0 || !len.is_multiple_of(rows) {
        return Err(rl_core::Error::UnevenMiniBatch { len, size: rows });
    }
    let on_policy = is_on_policy(cfg, rows, len);
    let lr = optim.current_lr();
    let seed = cfg
        .data_loader_seed
        .wrapping_add(optim.counters().schedule_steps as u64);
    let mut metrics = Metrics::new();
    for mini in batch.iter_minibatches(rows, cfg.shuffle, seed, cfg.ppo_epochs)? {
        let mini = mini?;
        let mut info = micro::mini_batch_info(&mini)?;
        info.on_policy = on_policy;
        if let Some(g) = group
            && world > 1
        {
            let mut counts = [info.tokens, info.sequences];
            dist::all_reduce_f64(&mut *dist::lock(g)?, &mut counts, dist::ReduceOp::Sum)?;
            [info.tokens, info.sequences] = counts;
        }
        if info.tokens <= 0.0 {
            continue;
        }
        let mut micros = micro::split(
            &mini,
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.use_dynamic_bsz.then_some(cfg.ppo_max_token_len_per_gpu),
        )?;
        if world > 1 {
            for m in &mut micros {
                m.batch
                    .meta_info_mut()
                    .insert(dist::DP_SIZE.into(), world.into());
            }
        }
        optim.zero_grad();
        // ZeRO stages 2 and 3 reduce every micro-batch's gradient, so the ranks must run as
        // many (token-balanced micro-batches can differ in number): the extra ones add nothing
        let rounds = match group {
            Some(g) if optim.reduces_per_micro_batch() => {
                let mut n = [micros.len() as f64];
                dist::all_reduce_f64(&mut *dist::lock(g)?, &mut n, dist::ReduceOp::Max)?;
                n[0] as usize
            }
            _ => micros.len(),
        };
        let mut mm = Metrics::new();
        for m in &micros {
            let (l, ms) = loss(&m.batch, info)?;
            l.backward();
            after_backward()?;
            stack.finish_backward().map_err(role_err(prefix))?;
            optim.accumulate_grads()?;
            mm.extend(ms);
        }
        for _ in micros.len()..rounds {
            stack.idle_train_round().map_err(role_err(prefix))?;
            optim.accumulate_grads()?;
        }
        micro::fold_micro_metrics(&mm, &mut metrics);
        if let Some(g) = group {
            optim.average_grads(&mut *dist::lock(g)?)?;
        }
        let (norm, _took) = optim.clip_and_step(cfg.grad_clip, lr)?;
        metrics.push(format!("{prefix}/grad_norm"), norm);
    }
    optim.schedule_step();
    metrics.push(format!("{prefix}/lr"), lr);
    metrics.push(
        format!("{prefix}/skipped_steps"),
        optim.counters().skipped_steps as f64,
    );
    Ok(metrics)
}

/// Saves a trained role's state into `dir`: `model` writes what training changed (the model,
/// or with LoRA only the adapters), then the optimiser state. Data parallel, every rank calls
/// it and rank 0 alone writes; the others only take part in gathering a ZeRO-sharded
/// optimiser state and (stage 3) `stack`'s parameters, which every rank holds whole until the
/// save ends.
pub(crate) fn save_trained_state(
    role: &'static str,
    group: Option<&SharedCollective>,
    optim: &AdamW,
    dir: &Path,
    stack: &crate::Model,
    model: impl FnOnce(&Path) -> crate::error::Result<()>,
) -> rl_core::Result<()> {
    let writer = match group {
        Some(g) => dist::lock(g)?.rank() == 0,
        None => true,
    };
    let _whole = stack.hold_all().map_err(role_err(role))?;
    if !writer {
        return optim.join_save();
    }
    // the optimiser first: under ZeRO its save is the collective the other ranks wait in, so
    // they are released before rank 0 spends time (or fails) writing the model
    optim.save(dir).map_err(role_err(role))?;
    model(dir).map_err(role_err(role))
}

impl Actor for ActorWorker {
    fn compute_log_prob_with(
        &mut self,
        batch: &Batch,
        extras: LogProbExtras,
    ) -> rl_core::Result<Batch> {
        let lm = lock(&self.lm, "actor")?;
        let temperature = meta_f64(batch, "temperature", 1.0);
        let packing = self.packing();
        let outs = no_grad_per_micro(
            batch,
            self.cfg.log_prob_micro_batch_size_per_gpu,
            self.cfg
                .use_dynamic_bsz
                .then_some(self.cfg.log_prob_max_token_len_per_gpu),
            lm.model(),
            |m| {
                let out = micro::log_probs_with(&lm, m, temperature, extras, packing)?;
                Ok(std::iter::once(out.log_prob)
                    .chain(out.entropy)
                    .chain(out.sum_pi_squared)
                    .collect())
            },
        )?;
        let mut out = Batch::new();
        let mut it = outs.into_iter();
        if let Some(lp) = it.next() {
            out.insert(keys::OLD_LOG_PROBS, lp)?;
        }
        if extras.entropy
            && let Some(ent) = it.next()
        {
            out.insert(keys::ENTROPYS, ent)?;
        }
        if extras.sum_pi_squared
            && let Some(s) = it.next()
        {
            out.insert(keys::SUM_PI_SQUARED, s)?;
        }
        Ok(out)
    }

    fn update(
        &mut self,
        batch: &Batch,
        objective: &dyn PolicyObjective,
    ) -> rl_core::Result<Metrics> {
        let lm = lock(&self.lm, "actor")?;
        let temperature = meta_f64(batch, "temperature", 1.0);
        let entropy = objective.needs_entropy();
        // the trainer skipped the old-log-prob forward: this update reports its entropy metric
        let entropy_metric = batch
            .meta_info()
            .get(OLD_LOG_PROBS_FROM_UPDATE)
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if entropy_metric && !self.updates_on_policy(batch.len()) {
            return Err(role_err("actor")(Error::invalid(
                OLD_LOG_PROBS_FROM_UPDATE,
                format!(
                    "set on a batch of {} rows, which this update does not take in one \
                     mini-batch for one epoch: its forwards would not run at the old weights",
                    batch.len()
                ),
            )));
        }
        // each micro-batch's entropies and mask, detached, for the objective's entropy metric
        let mut entropies: Vec<(Tensor, Tensor)> = Vec::new();
        let packing = self.packing();
        // LoRA dropout: one mask seed per micro-batch, a function of the optimiser's step (so
        // a resumed run drops what the uninterrupted one did)
        let base_seed = (self.optim.counters().steps as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut micro_index = 0u64;
        let fused = self.cfg.use_fused_kernels;
        let pending = std::cell::RefCell::new(None);
        let out = update_loop_dp(
            &self.cfg,
            self.rollout_n,
            batch,
            &mut self.optim,
            "actor",
            self.group.as_ref(),
            lm.model(),
            |micro, info| {
                micro_index += 1;
                lm.set_lora_dropout_seed(Some(base_seed.wrapping_add(micro_index)));
                let want = micro::EntropyOut::new(entropy, entropy_metric);
                let (log_prob, ent) = if fused {
                    let (lp, ent, head) =
                        micro::log_probs_fused(&lm, micro, temperature, want.any(), packing)?;
                    *pending.borrow_mut() = Some(head);
                    (lp, ent)
                } else {
                    micro::log_probs(&lm, micro, temperature, want, packing)?
                };
                if entropy_metric && let Some(e) = &ent {
                    entropies.push((e.detach(), keys::policy_mask(micro)?));
                }
                let entropy = if entropy { ent } else { None };
                objective.loss(micro, &PolicyOutput { log_prob, entropy }, info)
            },
            || {
                if let Some(head) = pending.borrow_mut().take() {
                    head.finish(&lm);
                }
                Ok(())
            },
        );
        lm.set_lora_dropout_seed(None);
        let mut out = out?;
        if entropy_metric && !entropies.is_empty() {
            // over this rank's rows, as the trainer takes it of the old forward's
            let (e, m): (Vec<Tensor>, Vec<Tensor>) = entropies.into_iter().unzip();
            if let Some(v) = objective.entropy_metric(&Tensor::cat(&e, 0), &Tensor::cat(&m, 0))? {
                out.push("actor/entropy", v);
            }
        }
        Ok(out)
    }

    fn old_log_probs_from_update(&self, rows: usize) -> bool {
        self.cfg.old_log_prob_from_update && self.updates_on_policy(rows)
    }

    fn save_state(&self, dir: &Path) -> rl_core::Result<()> {
        let lm = lock(&self.lm, "actor")?;
        save_trained_state(
            "actor",
            self.group.as_ref(),
            &self.optim,
            dir,
            lm.model(),
            |d| lm.save_trained(d),
        )
    }

    fn data_parallel_ranks(&self) -> usize {
        self.group
            .as_ref()
            .and_then(|g| g.lock().ok().map(|g| g.world_size()))
            .unwrap_or(1)
    }

    fn forwards_are_collective(&self) -> bool {
        self.optim.zero_stage() == ZeroStage::Parameters
    }

    fn weights_digest(&self) -> rl_core::Result<Option<u64>> {
        let lm = lock(&self.lm, "actor")?;
        if lm.model().param_shards().is_some() {
            // ZeRO stage 3: each rank holds its own part, and the whole they gather is one by
            // construction; gathering it to digest would hold the whole model on every rank at
            // every check (`check_replicas` still does, on demand)
            return Ok(None);
        }
        Ok(Some(dist::digest(&sorted_vars(lm.var_store()))?))
    }

    fn load_state(&mut self, dir: &Path) -> rl_core::Result<()> {
        let lm = lock(&self.lm, "actor")?;
        lm.load_trained(dir).map_err(role_err("actor"))?;
        self.optim.load(dir).map_err(role_err("actor"))
    }
}

/// Samples from the actor's weights (verl's hybrid engine: the same tensors, no copy).
///
/// `meta_info` of the prompt batch steers a call: `validate: true` samples with
/// [`ValKwargs`] instead of the training config; `seed` (u64) sets the sampler's seed, else it is
/// `cfg.seed_for(global_step)` with `global_step` from `meta_info` (0 when absent); a
/// `dp_rank` other than 0 mixes the rank into that seed (SplitMix64 of seed and rank), so
/// data-parallel ranks sample independently while rank 0 samples as a single process does.
pub struct RolloutWorker {
    lm: SharedPolicy,
    cfg: RolloutConfig,
    val: ValKwargs,
    eos_token_ids: Vec<i64>,
    pad_token_id: i64,
    progress: Option<ProgressHook>,
    tools: Option<ToolEnv>,
    /// Generation on external servers (`server_url`), and whose weights they hold.
    remote: Option<(RemoteEngine, Option<SyncKey>)>,
}

/// Which weights a rollout server holds: the trainer's policy version (`meta_info`'s
/// `policy_version`), or, for a caller that names none, the generation step they were synced
/// for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SyncKey {
    Version(u64),
    Step(u64),
}

/// Called after every decode step of a generation (a progress bar, a log line).
pub type ProgressHook = Arc<dyn Fn(&Progress) + Send + Sync>;

impl std::fmt::Debug for RolloutWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutWorker")
            .field("cfg", &self.cfg)
            .field("val", &self.val)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("pad_token_id", &self.pad_token_id)
            .field("progress", &self.progress.is_some())
            .field("tools", &self.tools.as_ref().map(ToolEnv::tool_names))
            .finish_non_exhaustive()
    }
}

impl RolloutWorker {
    /// A rollout over the shared weights, stopping at `eos_token_ids` and padding with
    /// `pad_token_id`.
    pub fn new(
        lm: SharedPolicy,
        cfg: RolloutConfig,
        val: ValKwargs,
        eos_token_ids: Vec<i64>,
        pad_token_id: i64,
    ) -> rl_core::Result<Self> {
        cfg.validate().map_err(role_err("rollout"))?;
        if eos_token_ids.is_empty() {
            return Err(role_err("rollout")(Error::invalid(
                "eos_token_ids",
                "needs at least one stop token",
            )));
        }
        let remote = if cfg.server_url.is_empty() {
            None
        } else {
            Some((RemoteEngine::new(&cfg).map_err(role_err("rollout"))?, None))
        };
        Ok(RolloutWorker {
            lm,
            cfg,
            val,
            eos_token_ids,
            pad_token_id,
            progress: None,
            tools: None,
            remote,
        })
    }

    /// Makes every generation (training and validation) multi-turn over `env`'s tools: the
    /// batch then also holds `loss_mask` (generated tokens only) and the `__num_turns__`,
    /// `tool_calls` and `valid_actions` columns (see [`generate_multi_turn`]).
    pub fn with_tools(mut self, env: ToolEnv) -> rl_core::Result<Self> {
        if self.remote.is_some() {
            return Err(role_err("rollout")(Error::invalid(
                "server_url",
                "multi-turn tools run on the in-process engine only; leave server_url empty"
                    .to_owned(),
            )));
        }
        self.tools = Some(env);
        Ok(self)
    }

    /// Reports every decode step of every generation to `hook`.
    pub fn with_progress(mut self, hook: ProgressHook) -> Self {
        self.progress = Some(hook);
        self
    }

    /// The training sampling config.
    pub fn config(&self) -> &RolloutConfig {
        &self.cfg
    }
}

impl Rollout for RolloutWorker {
    fn generate(&mut self, prompts: &Batch) -> rl_core::Result<Batch> {
        let validate = prompts
            .meta_info()
            .get("validate")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let cfg = if validate {
            RolloutConfig {
                n: self.val.n,
                temperature: self.val.temperature,
                top_k: self.val.top_k,
                top_p: self.val.top_p,
                do_sample: self.val.do_sample,
                ..self.cfg.clone()
            }
        } else {
            self.cfg.clone()
        };
        let seed = match prompts.meta_info().get("seed").and_then(Value::as_u64) {
            Some(s) => s,
            None => cfg.seed_for(meta_u64(prompts, "global_step", 0)),
        };
        // a data-parallel rank samples its rows from the streams of their global indices
        let row_offset = meta_u64(prompts, dist::DP_PROMPT_OFFSET, 0) * cfg.n as u64;
        let hook = self.progress.clone();
        let mut report = |p: &Progress| {
            if let Some(h) = &hook {
                h(p);
            }
        };
        let mut opts = GenerateOptions {
            eos_token_ids: self.eos_token_ids.clone(),
            pad_token_id: self.pad_token_id,
            seed,
            row_offset,
            progress: if self.progress.is_some() {
                Some(&mut report)
            } else {
                None
            },
        };
        let lm = lock(&self.lm, "rollout")?;
        let (ids, mask, pos) = (
            prompts.get(keys::INPUT_IDS)?,
            prompts.get(keys::ATTENTION_MASK)?,
            prompts.get(keys::POSITION_IDS)?,
        );
        let (out, multi): (RolloutOutput, Option<(tch::Tensor, Vec<TurnStats>)>) = match &self.tools
        {
            None if self.remote.is_some() => {
                // the servers load the weights again when the trainer's policy version
                // changes (without one, at every new generation step)
                let key = match prompts
                    .meta_info()
                    .get(rl_core::roles::POLICY_VERSION)
                    .and_then(Value::as_u64)
                {
                    Some(v) => SyncKey::Version(v),
                    None => SyncKey::Step(meta_u64(prompts, "global_step", 0)),
                };
                let (engine, synced) = self.remote.as_mut().expect("checked above");
                if *synced != Some(key) {
                    let version = match key {
                        SyncKey::Version(v) | SyncKey::Step(v) => v,
                    };
                    engine.sync(&lm, version).map_err(role_err("rollout"))?;
                    *synced = Some(key);
                }
                let out = remote_generate(engine, (ids, mask, pos), &cfg, seed, row_offset, &opts)
                    .map_err(role_err("rollout"))?;
                (out, None)
            }
            None => (
                generate(&lm, ids, mask, pos, &cfg, &mut opts).map_err(role_err("rollout"))?,
                None,
            ),
            Some(env) => {
                let MultiTurnOutput {
                    rollout,
                    loss_mask,
                    stats,
                } = generate_multi_turn(&lm, ids, mask, pos, &cfg, env, &mut opts)
                    .map_err(role_err("rollout"))?;
                (rollout, Some((loss_mask, stats)))
            }
        };
        drop(lm);
        // carry every other key through, repeated n times interleaved like the rows
        let mut rest = prompts.shallow_clone();
        for k in [keys::INPUT_IDS, keys::ATTENTION_MASK, keys::POSITION_IDS] {
            let _ = rest.pop(k)?;
        }
        let mut batch =
            if rest.tensor_keys().next().is_some() || rest.column_keys().next().is_some() {
                rest.repeat(cfg.n, true)?
            } else {
                let mut b = Batch::new();
                *b.meta_info_mut() = rest.meta_info().clone();
                b
            };
        let device = prompts.get(keys::INPUT_IDS)?.device();
        let rollout_log_probs = if cfg.debug_logprob_noise > 0.0 {
            crate::rollout::perturb_log_probs(
                &out.rollout_log_probs,
                &out.response_mask,
                cfg.debug_logprob_noise,
                seed,
                row_offset,
            )
        } else {
            out.rollout_log_probs
        };
        for (k, t) in [
            (keys::PROMPTS, out.prompts),
            (keys::RESPONSES, out.responses),
            (keys::INPUT_IDS, out.input_ids),
            (keys::ATTENTION_MASK, out.attention_mask),
            (keys::POSITION_IDS, out.position_ids),
            (keys::ROLLOUT_LOG_PROBS, rollout_log_probs),
            (keys::RESPONSE_MASK, out.response_mask),
        ] {
            batch.insert(k, t.to_device(device))?;
        }
        if let (Some((loss_mask, stats)), Some(env)) = (multi, &self.tools) {
            batch.insert(keys::LOSS_MASK, loss_mask.to_device(device))?;
            insert_turn_stats(&mut batch, &stats, env)?;
        }
        Ok(batch)
    }
}

/// The rollout on external servers, in the in-process engine's layout: each prompt's real
/// tokens (its left padding dropped) to the servers, the rows back assembled over the prompts
/// repeated `n` times.
fn remote_generate(
    engine: &RemoteEngine,
    (ids, mask, pos): (&tch::Tensor, &tch::Tensor, &tch::Tensor),
    cfg: &RolloutConfig,
    seed: u64,
    row_offset: u64,
    opts: &GenerateOptions<'_>,
) -> Result<RolloutOutput> {
    crate::rollout::check_prompts(ids, mask, pos, cfg)?;
    let cpu = |t: &tch::Tensor| Vec::<Vec<i64>>::try_from(&t.to_device(tch::Device::Cpu));
    let (id_rows, mask_rows) = (cpu(ids)?, cpu(mask)?);
    let prompts: Vec<Vec<i64>> = id_rows
        .iter()
        .zip(&mask_rows)
        .map(|(i, m)| {
            i.iter()
                .zip(m)
                .filter(|(_, m)| **m != 0)
                .map(|(t, _)| *t)
                .collect()
        })
        .collect();
    let rows = engine.generate(&prompts, cfg, seed, row_offset, &opts.eos_token_ids)?;
    let (tokens, log_probs): (Vec<Vec<i64>>, Vec<Vec<f32>>) = rows.into_iter().unzip();
    let n = cfg.n as i64;
    let repeat = |t: &tch::Tensor| t.repeat_interleave_self_int(n, 0, None);
    Ok(crate::rollout::assemble(
        &tokens,
        &log_probs,
        &repeat(ids),
        &repeat(mask),
        &repeat(pos),
        cfg.response_length,
        opts.pad_token_id,
    ))
}

/// The per-row multi-turn columns `__num_turns__`, `valid_actions` and `tool_calls` (every tool
/// of `env`, called or not, so the `env/<tool>_calls` metric is always there).
fn insert_turn_stats(batch: &mut Batch, stats: &[TurnStats], env: &ToolEnv) -> rl_core::Result<()> {
    let names = env.tool_names();
    let mut turns = Vec::with_capacity(stats.len());
    let mut valid = Vec::with_capacity(stats.len());
    let mut calls = Vec::with_capacity(stats.len());
    for s in stats {
        turns.push(Value::from(s.turns));
        valid.push(Value::from(s.valid_actions));
        let per_tool: serde_json::Map<String, Value> = names
            .iter()
            .map(|&n| {
                let c = s.calls.get(n).copied().unwrap_or(0);
                let f = s.failed_calls.get(n).copied().unwrap_or(0);
                (n.to_owned(), serde_json::json!({"calls": c, "failed": f}))
            })
            .collect();
        calls.push(Value::Object(per_tool));
    }
    batch.insert_column(keys::NUM_TURNS, turns)?;
    batch.insert_column(keys::VALID_ACTIONS, valid)?;
    batch.insert_column(keys::TOOL_CALLS, calls)?;
    Ok(())
}

/// The frozen reference policy: a copy of the initial actor weights, or, for a LoRA policy,
/// the policy itself with its adapters switched off (its base weights never train, so no copy
/// is needed: verl's `ref_in_actor`).
#[derive(Debug)]
pub struct ReferenceWorker {
    lm: RefModel,
    micro_batch_size: Option<usize>,
    /// Padded, packed (verl's `use_remove_padding`) or with shared prompts (verl's
    /// `use_prefix_grouper`).
    packing: Packing,
}

#[derive(Debug)]
enum RefModel {
    /// A frozen model of its own.
    Own(Box<CausalLm>),
    /// The base model under a LoRA policy's adapters.
    BaseOf(SharedPolicy),
}

impl ReferenceWorker {
    /// A frozen copy of the policy's current weights; for a policy with LoRA adapters, the
    /// policy's base model (adapters off) without a copy.
    pub fn from_policy(
        policy: &SharedPolicy,
        micro_batch_size: Option<usize>,
    ) -> rl_core::Result<Self> {
        let src = lock(policy, "reference")?;
        if src.lora().is_some() {
            return Ok(ReferenceWorker {
                lm: RefModel::BaseOf(policy.clone()),
                micro_batch_size,
                packing: Packing::Padded,
            });
        }
        // every variable is copied from the policy below
        let mut lm = CausalLm::to_be_filled(src.config(), src.device(), src.kind())
            .map_err(role_err("reference"))?;
        // a policy sharded by ZeRO stage 3: every rank gathers it (a collective)
        let whole = src.model().hold_all().map_err(role_err("reference"))?;
        lm.var_store_mut().copy(src.var_store())?;
        drop(whole);
        lm.var_store_mut().freeze();
        Ok(ReferenceWorker {
            lm: RefModel::Own(Box::new(lm)),
            micro_batch_size,
            packing: Packing::Padded,
        })
    }

    /// Runs the reference's forwards on the real tokens packed into rows (verl's
    /// `use_remove_padding`), computing a prompt that several rows share once when
    /// `prefix_grouper` (verl's `use_prefix_grouper`); the log-probs equal the padded ones up
    /// to rounding.
    pub fn with_packing(mut self, remove_padding: bool, prefix_grouper: bool) -> Self {
        self.packing = Packing::new(remove_padding, prefix_grouper);
        self
    }

    /// ZeRO stage 3: shards the reference's own weights over `group` (every rank holds the
    /// same); its forwards then gather a layer at a time. A no-op for the LoRA policy's base
    /// (the policy's sharding applies) or a world of one. A collective.
    pub fn shard_params(mut self, group: SharedCollective) -> rl_core::Result<Self> {
        if dist::lock(&group)?.world_size() > 1
            && let RefModel::Own(lm) = &mut self.lm
        {
            lm.shard_params(group).map_err(role_err("reference"))?;
        }
        Ok(self)
    }

    /// Whether the reference is the LoRA policy's base model rather than a copy.
    pub fn shares_policy_base(&self) -> bool {
        matches!(self.lm, RefModel::BaseOf(_))
    }

    /// A frozen model loaded from a Hugging Face directory.
    pub fn from_pretrained(
        dir: impl AsRef<Path>,
        device: Device,
        kind: Kind,
        micro_batch_size: Option<usize>,
    ) -> rl_core::Result<Self> {
        let mut lm = CausalLm::from_pretrained(dir, device, kind).map_err(role_err("reference"))?;
        lm.var_store_mut().freeze();
        Ok(ReferenceWorker {
            lm: RefModel::Own(Box::new(lm)),
            micro_batch_size,
            packing: Packing::Padded,
        })
    }
}

impl Reference for ReferenceWorker {
    fn compute_ref_log_prob(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let temperature = meta_f64(batch, "temperature", 1.0);
        let (micro_batch_size, packing) = (self.micro_batch_size, self.packing);
        let run = |lm: &CausalLm| {
            no_grad_per_micro(batch, micro_batch_size, None, lm.model(), |m| {
                Ok(vec![
                    micro::log_probs(lm, m, temperature, micro::EntropyOut::No, packing)?.0,
                ])
            })
        };
        let outs = match &self.lm {
            RefModel::Own(lm) => run(lm)?,
            RefModel::BaseOf(policy) => lock(policy, "reference")?.without_adapters(run)?,
        };
        let mut out = Batch::new();
        if let Some(lp) = outs.into_iter().next() {
            out.insert(keys::REF_LOG_PROB, lp)?;
        }
        Ok(out)
    }
}
