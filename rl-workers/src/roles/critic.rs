//! The critic role: a [`ValueModel`] (value head over the decoder stack) with its own AdamW.

use std::path::Path;

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::{Critic, Metrics, ValueObjective};
use rl_core::{Batch, keys};

use crate::error::Error;
use crate::heads::ValueModel;
use crate::roles::actor::{
    broadcast_from_rank0, check_dp_mini_batch, no_grad_per_micro, save_trained_state, shard_role,
    sorted_vars, update_loop_dp,
};
use crate::roles::config::CriticConfig;
use crate::roles::micro::{self, Packing};
use crate::roles::optim::AdamW;
use crate::roles::role_err;

/// The value model of PPO: `values` for the states before each response token, and clipped
/// value-loss updates with the same mini/micro-batch loop as the actor (data parallel with
/// [`with_group`](Self::with_group), as [`ActorWorker`](crate::roles::ActorWorker)).
pub struct CriticWorker {
    model: ValueModel,
    cfg: CriticConfig,
    rollout_n: usize,
    optim: AdamW,
    group: Option<SharedCollective>,
}

impl std::fmt::Debug for CriticWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CriticWorker")
            .field("cfg", &self.cfg)
            .field("rollout_n", &self.rollout_n)
            .field("optim", &self.optim)
            .field("data_parallel", &self.group.is_some())
            .finish_non_exhaustive()
    }
}

impl CriticWorker {
    /// The layout of this critic's forwards (`use_remove_padding`).
    fn packing(&self) -> Packing {
        Packing::new(self.cfg.use_remove_padding, false)
    }

    /// A critic over `model`; `rollout_n` turns `ppo_mini_batch_size` (prompts) into rows.
    pub fn new(model: ValueModel, cfg: CriticConfig, rollout_n: usize) -> rl_core::Result<Self> {
        cfg.validate("critic").map_err(role_err("critic"))?;
        if rollout_n == 0 {
            return Err(role_err("critic")(Error::invalid(
                "rollout_n",
                "must be at least 1",
            )));
        }
        let mut model = model;
        let optim = AdamW::for_model(
            model.var_store_mut(),
            cfg.optim.clone(),
            &cfg.mixed_precision,
        )
        .map_err(role_err("critic"))?;
        Ok(CriticWorker {
            model,
            cfg,
            rollout_n,
            optim,
            group: None,
        })
    }

    /// Makes the critic data-parallel over `group` (see
    /// [`ActorWorker::with_group`](crate::roles::ActorWorker::with_group)): `critic.ppo_mini_batch_size`
    /// is global and must be a multiple of the world size; rank 0's weights are broadcast now.
    pub fn with_group(mut self, group: SharedCollective) -> rl_core::Result<Self> {
        check_dp_mini_batch(
            "critic.ppo_mini_batch_size",
            self.cfg.ppo_mini_batch_size,
            &group,
            "critic",
        )?;
        broadcast_from_rank0(&group, &sorted_vars(self.model.var_store()))?;
        shard_role(
            "critic",
            "critic.zero_stage",
            self.cfg.zero_stage,
            &group,
            &mut self.optim,
            &mut self.model,
        )?;
        self.group = Some(group);
        Ok(self)
    }

    /// Checks that the weights are bit-identical on every rank (a collective); without a group
    /// it is a no-op.
    pub fn check_replicas(&self) -> rl_core::Result<()> {
        let Some(group) = &self.group else {
            return Ok(());
        };
        let _whole = self.model.model().hold_all().map_err(role_err("critic"))?;
        let vars = sorted_vars(self.model.var_store());
        dist::check_replicas(&mut *dist::lock(group)?, "critic weights", &vars)
    }

    /// The value model.
    pub fn model(&self) -> &ValueModel {
        &self.model
    }

    /// The optimiser (for its counters and state size).
    pub fn optimizer(&self) -> &AdamW {
        &self.optim
    }
}

impl Critic for CriticWorker {
    fn compute_values(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let cfg = self.cfg.as_actor();
        let (model, packing) = (&self.model, self.packing());
        let outs = no_grad_per_micro(
            batch,
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.use_dynamic_bsz.then_some(cfg.ppo_max_token_len_per_gpu),
            model.model(),
            |m| Ok(vec![micro::values(model, m, packing)?]),
        )?;
        let mut out = Batch::new();
        if let Some(values) = outs.into_iter().next() {
            out.insert(keys::VALUES, values)?;
        }
        Ok(out)
    }

    fn update(
        &mut self,
        batch: &Batch,
        objective: &dyn ValueObjective,
    ) -> rl_core::Result<Metrics> {
        let cfg = self.cfg.as_actor();
        let model = &self.model;
        let packing = self.packing();
        update_loop_dp(
            &cfg,
            self.rollout_n,
            batch,
            &mut self.optim,
            "critic",
            self.group.as_ref(),
            model.model(),
            |m, info| {
                let v = micro::values(model, m, packing)?;
                objective.loss(m, &v, info)
            },
            || Ok(()),
        )
    }

    fn save_state(&self, dir: &Path) -> rl_core::Result<()> {
        save_trained_state(
            "critic",
            self.group.as_ref(),
            &self.optim,
            dir,
            self.model.model(),
            |d| self.model.save_trained(d),
        )
    }

    fn data_parallel_ranks(&self) -> usize {
        self.group
            .as_ref()
            .and_then(|g| g.lock().ok().map(|g| g.world_size()))
            .unwrap_or(1)
    }

    fn weights_digest(&self) -> rl_core::Result<Option<u64>> {
        if self.model.model().param_shards().is_some() {
            // ZeRO stage 3: no whole weights to compare (see the actor's)
            return Ok(None);
        }
        Ok(Some(dist::digest(&sorted_vars(self.model.var_store()))?))
    }

    fn load_state(&mut self, dir: &Path) -> rl_core::Result<()> {
        self.model.load_trained(dir).map_err(role_err("critic"))?;
        self.optim.load(dir).map_err(role_err("critic"))
    }
}
