//! The critic role: a [`ValueModel`] (value head over the decoder stack) with its own AdamW.

use std::path::Path;

use rl_core::roles::{Critic, Metrics, ValueObjective};
use rl_core::{Batch, keys};

use crate::error::Error;
use crate::heads::ValueModel;
use crate::roles::actor::update_loop;
use crate::roles::config::CriticConfig;
use crate::roles::micro;
use crate::roles::optim::AdamW;
use crate::roles::role_err;

/// The value model of PPO: `values` for the states before each response token, and clipped
/// value-loss updates with the same mini/micro-batch loop as the actor.
#[derive(Debug)]
pub struct CriticWorker {
    model: ValueModel,
    cfg: CriticConfig,
    rollout_n: usize,
    optim: AdamW,
}

impl CriticWorker {
    /// A critic over `model`; `rollout_n` turns `ppo_mini_batch_size` (prompts) into rows.
    pub fn new(model: ValueModel, cfg: CriticConfig, rollout_n: usize) -> rl_core::Result<Self> {
        cfg.validate("critic").map_err(role_err("critic"))?;
        if rollout_n == 0 {
            return Err(role_err("critic")(Error::invalid(
                "rollout_n",
                "must be at least 1",
            )));
        }
        let optim = AdamW::new(model.var_store(), cfg.optim.clone());
        Ok(CriticWorker {
            model,
            cfg,
            rollout_n,
            optim,
        })
    }

    /// The value model.
    pub fn model(&self) -> &ValueModel {
        &self.model
    }
}

impl Critic for CriticWorker {
    fn compute_values(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let _guard = tch::no_grad_guard();
        let cfg = self.cfg.as_actor();
        let micros = micro::split(
            batch,
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.use_dynamic_bsz.then_some(cfg.ppo_max_token_len_per_gpu),
        )?;
        let mut parts = Vec::new();
        let mut order = Vec::new();
        for m in micros {
            parts.push(micro::values(&self.model, &m.batch)?);
            order.push(m.rows);
        }
        let mut out = Batch::new();
        out.insert(keys::VALUES, micro::reassemble(&parts, &order))?;
        Ok(out)
    }

    fn update(
        &mut self,
        batch: &Batch,
        objective: &dyn ValueObjective,
    ) -> rl_core::Result<Metrics> {
        let cfg = self.cfg.as_actor();
        let model = &self.model;
        update_loop(
            &cfg,
            self.rollout_n,
            batch,
            &mut self.optim,
            "critic",
            |m, info| {
                let v = micro::values(model, m)?;
                objective.loss(m, &v, info)
            },
        )
    }

    fn save_state(&self, dir: &Path) -> rl_core::Result<()> {
        self.model
            .save_pretrained(dir)
            .map_err(role_err("critic"))?;
        self.optim.save(dir).map_err(role_err("critic"))
    }

    fn load_state(&mut self, dir: &Path) -> rl_core::Result<()> {
        let path = dir.join("model.safetensors");
        tch::no_grad(|| self.model.var_store_mut().load(&path)).map_err(|e| {
            rl_core::Error::Role {
                role: "critic",
                source: format!("{}: {e}", path.display()).into(),
            }
        })?;
        self.optim.load(dir).map_err(role_err("critic"))
    }
}
