//! AdamW over a `VarStore`'s variables, with global-norm gradient clipping that skips the step
//! on a non-finite norm, and a state (moments, step counts) that checkpoints exactly.
//!
//! Written here rather than using `tch::nn::Optimizer` because that one does not expose its
//! state, so a resumed run could not continue bit for bit.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::fsdp::GradReleaser;
use crate::roles::config::OptimConfig;
use crate::roles::zero::{Sharded, StepConsts, WholeState, ZeroStage, adamw_};

/// The counters of an [`AdamW`], saved as JSON next to the moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct OptimCounters {
    /// Optimiser steps taken (AdamW's `t`, for bias correction).
    pub steps: i64,
    /// Schedule position: `update` calls completed (the LR of the next one is `lr_at(this)`).
    pub schedule_steps: i64,
    /// Steps skipped because the gradient norm was not finite.
    pub skipped_steps: i64,
}

/// AdamW exactly as `torch.optim.AdamW` (decoupled decay `p *= 1 - lr * wd`, bias-corrected
/// moments, `eps` added after the square root) over every trainable variable, in name order.
///
/// With master weights ([`AdamW::with_master_weights`], mixed precision) the optimiser keeps a
/// float32 copy of each parameter and float32 gradient accumulators: each micro-batch's
/// gradient (in the compute dtype) is added into its accumulator ([`AdamW::accumulate_grads`]),
/// averaging across ranks, clipping and the step run in float32 on the masters, and the
/// parameters are the masters rounded to the compute dtype after each step.
#[derive(Debug)]
pub struct AdamW {
    cfg: OptimConfig,
    names: Vec<String>,
    params: Vec<Tensor>,
    /// Mixed precision: float32 master weights, one per parameter (under ZeRO the
    /// [`Sharded`] state holds this rank's part instead).
    master: Option<Vec<Tensor>>,
    /// Mixed precision: float32 accumulators of the whole gradients (not under ZeRO stage 2,
    /// which accumulates this rank's part of the reduced gradient instead).
    accum: Option<Accum>,
    /// AdamW's moments, one float32 tensor per parameter; empty until first needed (and
    /// always under ZeRO, whose [`Sharded`] state holds this rank's part instead).
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// ZeRO stage 1 or 2 over a data-parallel group.
    sharded: Option<Sharded>,
    /// Sets the parameters' gradients to none (libtorch's `zero_grad(set_to_none)`), freeing
    /// them where ZeRO has taken what it needs from them.
    releaser: Option<GradReleaser>,
    counters: OptimCounters,
}

/// Float32 gradient accumulators, one per parameter.
#[derive(Debug)]
struct Accum {
    grads: Vec<Tensor>,
    /// Whether a micro-batch gave the parameter a gradient since the last zeroing.
    touched: Vec<bool>,
}

impl AdamW {
    /// An optimiser over the trainable variables of `vs`.
    pub fn new(vs: &VarStore, cfg: OptimConfig) -> AdamW {
        let mut vars: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let (names, params) = vars.into_iter().unzip();
        AdamW {
            cfg,
            names,
            params,
            master: None,
            accum: None,
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
            sharded: None,
            releaser: None,
            counters: OptimCounters::default(),
        }
    }

    /// Allocates the (zero) moments of an unsharded optimiser on first use.
    fn ensure_moments(&mut self) {
        if self.sharded.is_some() || !self.exp_avg.is_empty() {
            return;
        }
        let zeros = |ps: &[Tensor]| -> Vec<Tensor> {
            ps.iter()
                .map(|t| Tensor::zeros(t.size(), (Kind::Float, t.device())))
                .collect()
        };
        self.exp_avg = zeros(&self.params);
        self.exp_avg_sq = zeros(&self.params);
    }

    /// Splits the optimiser state over the ranks of `group` (ZeRO `stage` 1 or 2, see
    /// [`crate::roles::zero`]); a no-op for [`ZeroStage::Replicated`] or a world of one. A
    /// collective only in that every rank must call it with the same parameters; call it
    /// before the first step (after loading or broadcasting the weights). Stage 3 shards the
    /// model's parameters too: see [`AdamW::shard_params`].
    pub fn shard(
        &mut self,
        group: rl_core::dist::SharedCollective,
        stage: ZeroStage,
    ) -> rl_core::Result<()> {
        if stage == ZeroStage::Replicated || rl_core::dist::lock(&group)?.world_size() == 1 {
            return Ok(());
        }
        if stage == ZeroStage::Parameters {
            return Err(rl_core::Error::Role {
                role: "optimizer",
                source: "ZeRO stage 3 shards with the model's parameters: use shard_params".into(),
            });
        }
        self.shard_with(stage, |params, whole| {
            Sharded::new(group, stage, params, whole)
        })
    }

    /// ZeRO stage 3: the optimiser state split as the model's parameter `shards` are, stepping
    /// their parts in place; every trained parameter must be one of theirs. Call it right
    /// after sharding the model, before the first step.
    pub fn shard_params(&mut self, shards: &crate::ParamShards) -> rl_core::Result<()> {
        let names = self.names.clone();
        self.shard_with(ZeroStage::Parameters, |params, whole| {
            Sharded::with_params(shards, &names, params, whole)
        })
    }

    fn shard_with(
        &mut self,
        stage: ZeroStage,
        make: impl FnOnce(&[Tensor], &WholeState<'_>) -> rl_core::Result<Sharded>,
    ) -> rl_core::Result<()> {
        if self.sharded.is_some() {
            return Err(rl_core::Error::Role {
                role: "optimizer",
                source: "the optimizer state is already sharded".into(),
            });
        }
        let moments = !self.exp_avg.is_empty();
        let (m, v) = (&self.exp_avg, &self.exp_avg_sq);
        let exp_avg = |i: usize| {
            if moments {
                m[i].shallow_clone()
            } else {
                Tensor::new()
            }
        };
        let exp_avg_sq = |i: usize| {
            if moments {
                v[i].shallow_clone()
            } else {
                Tensor::new()
            }
        };
        let masters = self.master.as_ref();
        let master = |i: usize| masters.map_or_else(Tensor::new, |w| w[i].shallow_clone());
        let whole = WholeState {
            exp_avg: &exp_avg,
            exp_avg_sq: &exp_avg_sq,
            master: masters
                .is_some()
                .then_some(&master as &dyn Fn(usize) -> Tensor),
        };
        let sharded = make(&self.params, &whole)?;
        self.releaser = Some(GradReleaser::new(&self.params).map_err(role)?);
        self.sharded = Some(sharded);
        // the whole state is now this rank's part: free the rest
        self.exp_avg = Vec::new();
        self.exp_avg_sq = Vec::new();
        self.master = None;
        if stage >= ZeroStage::Gradients {
            // each micro-batch's gradient goes straight into this rank's part
            self.accum = None;
        }
        Ok(())
    }

    /// Copies rank 0's float32 master weights to every rank (a collective; a no-op without
    /// masters or on one rank): the masters were copied from each rank's weights before the
    /// roles broadcast rank 0's, and the steps start from them.
    pub fn broadcast_masters(
        &mut self,
        group: &mut dyn rl_core::dist::Collective,
    ) -> rl_core::Result<()> {
        let Some(m) = &mut self.master else {
            return Ok(());
        };
        if group.world_size() == 1 {
            return Ok(());
        }
        for w in m {
            group.broadcast(w, 0)?;
        }
        Ok(())
    }

    /// The ZeRO stage the state is split by ([`ZeroStage::Replicated`] when not sharded).
    pub fn zero_stage(&self) -> ZeroStage {
        self.sharded
            .as_ref()
            .map_or(ZeroStage::Replicated, |s| s.stage)
    }

    /// Whether every micro-batch's gradient is reduced across the ranks (ZeRO stage 2): every
    /// rank must then call [`AdamW::accumulate_grads`] equally often in a mini-batch.
    pub fn reduces_per_micro_batch(&self) -> bool {
        self.sharded
            .as_ref()
            .is_some_and(Sharded::reduces_per_micro_batch)
    }

    /// Bytes of optimiser state this rank holds once it has stepped (replicated moments are
    /// allocated by the first step): AdamW's moments, the float32 master weights and gradient
    /// accumulators (with mixed precision), and under ZeRO stage 2 the owned gradient part. The
    /// parameters and their own gradients are not counted.
    pub fn state_bytes(&self) -> i64 {
        let floats: i64 = self.params.iter().map(|p| p.numel() as i64).sum();
        let accum = if self.accum.is_some() { 4 * floats } else { 0 };
        if let Some(s) = &self.sharded {
            return s.state_bytes() + accum;
        }
        let per = if self.master.is_some() { 3 } else { 2 };
        floats * 4 * per + accum
    }

    /// An optimiser with float32 master weights copied from the trainable variables of `vs`
    /// now: build it while the model is still in float32, then cast the model to its compute
    /// dtype.
    pub fn with_master_weights(vs: &VarStore, cfg: OptimConfig) -> AdamW {
        let mut optim = AdamW::new(vs, cfg);
        let _guard = tch::no_grad_guard();
        let weights: Vec<Tensor> = optim
            .params
            .iter()
            .map(|p| p.detach().to_kind(Kind::Float).copy())
            .collect();
        optim.accum = Some(Accum {
            grads: weights.iter().map(Tensor::zeros_like).collect(),
            touched: vec![false; weights.len()],
        });
        optim.master = Some(weights);
        optim
    }

    /// The optimiser of a model's trainable variables under `mp`: with mixed precision, float32
    /// masters are copied from `vs` (which must be float32 then) and `vs` is cast to the compute
    /// dtype, frozen variables included; without, a plain [`AdamW::new`].
    pub fn for_model(
        vs: &mut VarStore,
        cfg: OptimConfig,
        mp: &crate::roles::MixedPrecision,
    ) -> Result<AdamW> {
        if !mp.enabled() {
            return Ok(AdamW::new(vs, cfg));
        }
        if let Some((name, t)) = vs
            .variables()
            .into_iter()
            .find(|(_, t)| t.requires_grad() && t.kind() != Kind::Float)
        {
            return Err(Error::invalid(
                "mixed_precision.param_dtype",
                format!(
                    "needs the model loaded in float32 (the master weights' source), but `{name}` is {:?}: set model.dtype = \"float32\"",
                    t.kind()
                ),
            ));
        }
        let optim = AdamW::with_master_weights(vs, cfg);
        match mp.kind() {
            Kind::BFloat16 => vs.bfloat16(),
            Kind::Half => vs.half(),
            _ => {}
        }
        Ok(optim)
    }

    /// Whether the optimiser keeps float32 master weights.
    pub fn has_master_weights(&self) -> bool {
        self.master.is_some() || self.sharded.as_ref().is_some_and(Sharded::has_master)
    }

    /// Call after each micro-batch's backward. Mixed precision: adds each parameter's gradient
    /// (compute dtype) into its float32 accumulator and clears it, so micro-batches accumulate
    /// in float32. ZeRO stage 2: reduce-scatters the gradient into this rank's part and
    /// releases the parameters' gradients (a collective). Otherwise a no-op.
    pub fn accumulate_grads(&mut self) -> rl_core::Result<()> {
        if let Some(s) = &mut self.sharded
            && s.shards_params()
        {
            // stage 3 reduced each layer's gradient as the backward passed it
            return Ok(());
        }
        if let Some(s) = &mut self.sharded
            && s.reduces_per_micro_batch()
        {
            s.reduce_scatter_grads(&self.params)?;
            return self.release_grads();
        }
        let Some(m) = &mut self.accum else {
            return Ok(());
        };
        let _guard = tch::no_grad_guard();
        for (i, p) in self.params.iter_mut().enumerate() {
            let g = p.grad();
            if g.defined() {
                let _ = m.grads[i].g_add_(&g.to_kind(Kind::Float));
                m.touched[i] = true;
                p.zero_grad();
            }
        }
        Ok(())
    }

    /// Sets the parameters' gradients to none (ZeRO, once it has taken them).
    fn release_grads(&self) -> rl_core::Result<()> {
        match &self.releaser {
            Some(r) => r.release().map_err(role),
            None => Ok(()),
        }
    }

    /// The whole gradient of parameter `i`: the float32 accumulator with mixed precision
    /// (undefined when no micro-batch touched it), else the parameter's own.
    fn grad(&self, i: usize) -> Tensor {
        match &self.accum {
            Some(m) if m.touched[i] => m.grads[i].shallow_clone(),
            Some(_) => Tensor::new(),
            None => self.params[i].grad(),
        }
    }

    /// The config.
    pub fn config(&self) -> &OptimConfig {
        &self.cfg
    }

    /// The counters.
    pub fn counters(&self) -> OptimCounters {
        self.counters
    }

    /// The LR the current schedule position gives.
    pub fn current_lr(&self) -> f64 {
        self.cfg.lr_at(self.counters.schedule_steps)
    }

    /// Advances the schedule by one training step.
    pub fn schedule_step(&mut self) {
        self.counters.schedule_steps += 1;
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.zero_grad();
        }
        if let Some(m) = &mut self.accum {
            let _guard = tch::no_grad_guard();
            for g in &mut m.grads {
                let _ = g.zero_();
            }
            m.touched.fill(false);
        }
        if let Some(s) = &mut self.sharded {
            s.zero_grad();
        }
    }

    /// The trained parameters, in name order (for broadcasts and replica checks).
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// Averages the gradients over the ranks of `group` in place (bucketed all-reduce), so that
    /// clipping and stepping afterwards is identical on every rank. A parameter without a
    /// gradient on this rank gets a zero one first, so every rank reduces the same list.
    pub fn average_grads(
        &mut self,
        group: &mut dyn rl_core::dist::Collective,
    ) -> rl_core::Result<()> {
        if group.world_size() == 1 {
            return Ok(());
        }
        if self.reduces_per_micro_batch() {
            // ZeRO stage 2 reduced every micro-batch's gradient already
            return Ok(());
        }
        if let Some(m) = &mut self.accum {
            // float32 accumulators, defined (zero) for every parameter on every rank
            m.touched.fill(true);
            return group.all_reduce(&mut m.grads, rl_core::dist::ReduceOp::Avg);
        }
        define_and_average(&self.params, group)
    }

    /// The global L2 norm of the gradients (0 for parameters without a gradient); a
    /// collective under ZeRO stage 2.
    pub fn grad_norm(&self) -> rl_core::Result<f64> {
        if let Some(s) = &self.sharded
            && s.reduces_per_micro_batch()
        {
            return s.part_grad_norm();
        }
        let _guard = tch::no_grad_guard();
        let mut total = 0f64;
        for i in 0..self.params.len() {
            let g = self.grad(i);
            if g.defined() {
                let n = g.to_kind(Kind::Double).norm().double_value(&[]);
                total += n * n;
            }
        }
        Ok(total.sqrt())
    }

    /// Clips the gradients to global norm `max_norm` (as `clip_grad_norm_`), then takes a step
    /// at learning rate `lr` when the norm is finite; returns the norm before clipping and
    /// whether the step was taken. A skipped step is counted and the gradients are zeroed.
    /// Under ZeRO a collective: every rank calls it.
    pub fn clip_and_step(&mut self, max_norm: f64, lr: f64) -> rl_core::Result<(f64, bool)> {
        let norm = self.grad_norm()?;
        if !norm.is_finite() {
            self.counters.skipped_steps += 1;
            self.zero_grad();
            return Ok((norm, false));
        }
        let _guard = tch::no_grad_guard();
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        if coef < 1.0 {
            if let Some(s) = &mut self.sharded
                && s.reduces_per_micro_batch()
            {
                s.scale_part_grads(coef);
            } else {
                for i in 0..self.params.len() {
                    let mut g = self.grad(i);
                    if g.defined() {
                        let _ = g.g_mul_scalar_(coef);
                    }
                }
            }
        }
        self.step(lr)?;
        Ok((norm, true))
    }

    /// One AdamW step at `lr` with the current gradients.
    fn step(&mut self, lr: f64) -> rl_core::Result<()> {
        let _guard = tch::no_grad_guard();
        self.counters.steps += 1;
        let t = self.counters.steps as f64;
        let [b1, b2] = self.cfg.betas;
        let k = StepConsts {
            b1,
            b2,
            bc1: 1.0 - b1.powf(t),
            bc2: 1.0 - b2.powf(t),
            eps: self.cfg.eps,
            lr,
            weight_decay: self.cfg.weight_decay,
        };
        if self.sharded.is_some() {
            // stage 1: the whole (averaged, clipped) gradients; stage 2 holds its own part
            let whole: Vec<Tensor> = (0..self.params.len()).map(|i| self.grad(i)).collect();
            if let Some(s) = &mut self.sharded {
                s.step(&mut self.params, &whole, &k)?;
            }
            // the whole gradients are spent: free them until the next backward
            return self.release_grads();
        }
        self.ensure_moments();
        for i in 0..self.params.len() {
            let g = self.grad(i);
            if !g.defined() {
                continue;
            }
            let g = g.to_kind(Kind::Float);
            let p = &mut self.params[i];
            let (m, v) = (&mut self.exp_avg[i], &mut self.exp_avg_sq[i]);
            match &mut self.master {
                Some(master) => {
                    let w = &mut master[i];
                    adamw_(w, &g, m, v, &k);
                    p.copy_(&w.to_kind(p.kind()));
                }
                None => {
                    let mut w = p.to_kind(Kind::Float).copy();
                    adamw_(&mut w, &g, m, v, &k);
                    p.copy_(&w.to_kind(p.kind()));
                }
            }
        }
        Ok(())
    }

    /// Writes `optim.safetensors` (the moments, named `exp_avg.<param>` / `exp_avg_sq.<param>`,
    /// and the float32 master weights `master.<param>` when kept) and `optim.json` (the
    /// counters) into `dir`.
    ///
    /// The file holds the whole state whatever the ZeRO stage, so it loads at any world size
    /// and stage. Under ZeRO this is a collective: every rank calls it, the state is gathered
    /// bucket by bucket, and rank 0 alone writes (the other ranks never touch `dir`).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let whole: Vec<(Tensor, Tensor, Option<Tensor>)> = match &self.sharded {
            Some(s) => {
                let writer = rl_core::dist::lock(&s.group)?.rank() == 0;
                let whole = s.gather(&self.params, writer)?;
                if !writer {
                    return Ok(());
                }
                whole
            }
            None => (0..self.params.len())
                .map(|i| {
                    let (m, v) = match self.exp_avg.get(i) {
                        Some(m) => (m.shallow_clone(), self.exp_avg_sq[i].shallow_clone()),
                        // never stepped: zero moments
                        None => {
                            let z = Tensor::zeros(
                                self.params[i].size(),
                                (Kind::Float, self.params[i].device()),
                            );
                            (z.shallow_clone(), z)
                        }
                    };
                    let w = self.master.as_ref().map(|m| m[i].shallow_clone());
                    (m, v, w)
                })
                .collect(),
        };
        let mut named: Vec<(String, &Tensor)> = Vec::new();
        for (name, (m, v, w)) in self.names.iter().zip(&whole) {
            named.push((format!("exp_avg.{name}"), m));
            named.push((format!("exp_avg_sq.{name}"), v));
            if let Some(w) = w {
                named.push((format!("master.{name}"), w));
            }
        }
        Tensor::write_safetensors(&named, dir.join("optim.safetensors"))?;
        let path = dir.join("optim.json");
        let text = serde_json::to_string_pretty(&self.counters)
            .map_err(|e| Error::format(&path, e.to_string()))?;
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))
    }

    /// What a rank other than 0 does where rank 0 calls [`save`](Self::save): under ZeRO it
    /// takes part in gathering the state (a collective), otherwise nothing; it never writes.
    pub fn join_save(&self) -> rl_core::Result<()> {
        match &self.sharded {
            Some(s) => s.gather(&self.params, false).map(drop),
            None => Ok(()),
        }
    }

    /// Restores what [`save`](Self::save) wrote (at any world size and ZeRO stage: under ZeRO
    /// each rank reads the whole file and keeps its part); a missing or mis-shaped tensor
    /// names it.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let path = dir.join("optim.safetensors");
        if !path.exists() {
            return Err(Error::io(
                &path,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ));
        }
        let mut tensors: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(&path)?.into_iter().collect();
        let masters = self.has_master_weights();
        let mut prefixes = vec!["exp_avg", "exp_avg_sq"];
        if masters {
            prefixes.push("master");
        }
        // every tensor, checked against its parameter's shape, on the parameter's device
        let mut per: Vec<Vec<Tensor>> = Vec::with_capacity(prefixes.len());
        for prefix in &prefixes {
            let mut col = Vec::with_capacity(self.names.len());
            for (name, p) in self.names.iter().zip(&self.params) {
                let key = format!("{prefix}.{name}");
                let t = tensors.remove(&key).ok_or_else(|| Error::MissingTensor {
                    path: path.display().to_string(),
                    name: key.clone(),
                })?;
                if t.size() != p.size() {
                    return Err(Error::TensorShape {
                        path: path.display().to_string(),
                        name: key,
                        expected: p.size(),
                        got: t.size(),
                    });
                }
                // kept on the host under ZeRO, where each rank moves only its part
                col.push(if self.sharded.is_some() {
                    t.to_kind(Kind::Float)
                } else {
                    t.to_device(p.device()).to_kind(Kind::Float)
                });
            }
            per.push(col);
        }
        let _guard = tch::no_grad_guard();
        if let Some(s) = &mut self.sharded {
            let (m, v) = (&per[0], &per[1]);
            let exp_avg = |i: usize| m[i].shallow_clone();
            let exp_avg_sq = |i: usize| v[i].shallow_clone();
            let master = |i: usize| per[2][i].shallow_clone();
            s.load(
                &mut self.params,
                &WholeState {
                    exp_avg: &exp_avg,
                    exp_avg_sq: &exp_avg_sq,
                    master: masters.then_some(&master as &dyn Fn(usize) -> Tensor),
                },
            );
        } else {
            let mut cols = per.into_iter();
            self.exp_avg = cols.next().unwrap_or_default();
            self.exp_avg_sq = cols.next().unwrap_or_default();
            if let (Some(m), Some(ws)) = (&mut self.master, cols.next()) {
                for (i, w) in ws.into_iter().enumerate() {
                    // the parameters are the masters rounded, exactly as after the saved step
                    let p = &mut self.params[i];
                    p.copy_(&w.to_kind(p.kind()));
                    m[i] = w;
                }
            }
        }
        let jpath = dir.join("optim.json");
        let text = std::fs::read_to_string(&jpath).map_err(|e| Error::io(&jpath, e))?;
        self.counters =
            serde_json::from_str(&text).map_err(|e| Error::format(&jpath, e.to_string()))?;
        Ok(())
    }
}

/// An optimiser error as the role error of `optimizer`.
fn role(e: Error) -> rl_core::Error {
    rl_core::Error::Role {
        role: "optimizer",
        source: Box::new(e),
    }
}

/// Averages the parameters' gradients over `group` (bucketed all-reduce), a parameter without
/// a gradient on this rank getting a zero one first, so that every rank reduces the same list.
pub(crate) fn define_and_average(
    params: &[Tensor],
    group: &mut dyn rl_core::dist::Collective,
) -> rl_core::Result<()> {
    let missing: Vec<Tensor> = params
        .iter()
        .filter(|p| !p.grad().defined())
        .map(|p| (p * 0.0).sum(Kind::Float))
        .collect();
    if !missing.is_empty() {
        // defines the gradients (as zeros) through autograd, the only way tch offers
        Tensor::stack(&missing, 0).sum(Kind::Float).backward();
    }
    let _guard = tch::no_grad_guard();
    let mut grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
    group.all_reduce(&mut grads, rl_core::dist::ReduceOp::Avg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;
    use tch::nn::Init;

    #[test]
    fn matches_torch_adamw_on_a_quadratic() {
        // reference: torch.optim.AdamW(lr=0.1, betas=(0.9, 0.99), weight_decay=0.1), x0 = [1, -2],
        // loss = sum(x^2), three steps -> values computed by hand from torch's update rule
        let vs = VarStore::new(Device::Cpu);
        let mut x = vs.root().var("x", &[2], Init::Const(0.0));
        tch::no_grad(|| x.copy_(&Tensor::from_slice(&[1.0f32, -2.0])));
        let cfg = OptimConfig {
            lr: 0.1,
            betas: [0.9, 0.99],
            weight_decay: 0.1,
            ..OptimConfig::default()
        };
        let mut opt = AdamW::new(&vs, cfg.clone());
        // the reference loop, written out
        let mut xr = [1.0f64, -2.0];
        let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
        for t in 1..=3 {
            opt.zero_grad();
            x.square().sum(Kind::Float).backward();
            let (_, took) = opt.clip_and_step(1e9, 0.1).unwrap();
            assert!(took);
            for i in 0..2 {
                let g = 2.0 * xr[i];
                xr[i] *= 1.0 - 0.1 * 0.1;
                m[i] = 0.9 * m[i] + 0.1 * g;
                v[i] = 0.99 * v[i] + 0.01 * g * g;
                let bc1 = 1.0 - 0.9f64.powi(t);
                let bc2 = 1.0 - 0.99f64.powi(t);
                xr[i] -= 0.1 / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + 1e-8);
            }
        }
        let got = Vec::<f32>::try_from(&x).unwrap();
        for i in 0..2 {
            assert!((got[i] as f64 - xr[i]).abs() < 1e-5, "{got:?} vs {xr:?}");
        }
        assert_eq!(opt.counters().steps, 3);
    }

    #[test]
    fn master_weights_take_float32_steps_and_round_into_bf16_params() {
        // many small steps: a bf16 parameter alone would stall (each update under its ulp),
        // the float32 master accumulates them; the parameter is always the master rounded
        let cfg = OptimConfig {
            lr: 1e-4,
            weight_decay: 0.0,
            ..OptimConfig::default()
        };
        let run = |master: bool| {
            let mut vs = VarStore::new(Device::Cpu);
            let x = vs.root().var("x", &[2], Init::Const(0.0));
            tch::no_grad(|| {
                x.shallow_clone()
                    .copy_(&Tensor::from_slice(&[4.0f32, -3.0]))
            });
            let mut opt = if master {
                let mp = crate::roles::MixedPrecision {
                    param_dtype: crate::roles::ParamDtype::Bf16,
                };
                AdamW::for_model(&mut vs, cfg.clone(), &mp).unwrap()
            } else {
                vs.bfloat16();
                AdamW::new(&vs, cfg.clone())
            };
            assert_eq!(x.kind(), Kind::BFloat16);
            for _ in 0..50 {
                opt.zero_grad();
                x.to_kind(Kind::Float).square().sum(Kind::Float).backward();
                opt.accumulate_grads().unwrap();
                assert!(opt.clip_and_step(1e9, 1e-4).unwrap().1);
            }
            let master_x = opt.master.as_ref().map(|m| m[0].copy());
            (x.to_kind(Kind::Float), master_x)
        };
        let (plain, none) = run(false);
        assert!(none.is_none());
        // 4.0 in bf16 has an ulp of 1/32: fifty steps of 1e-4 leave it where it was
        assert_eq!(Vec::<f32>::try_from(&plain).unwrap(), vec![4.0, -3.0]);
        let (param, master) = run(true);
        let master = master.unwrap();
        let m = Vec::<f32>::try_from(&master).unwrap();
        assert!((m[0] - (4.0 - 50.0 * 1e-4)).abs() < 1e-5, "{m:?}");
        assert!((m[1] - (-3.0 + 50.0 * 1e-4)).abs() < 1e-5, "{m:?}");
        assert!(param.equal(&master.to_kind(Kind::BFloat16).to_kind(Kind::Float)));
    }

    #[test]
    fn mixed_precision_needs_a_float32_model() {
        let mut vs = VarStore::new(Device::Cpu);
        let _x = vs.root().var("x", &[2], Init::Const(1.0));
        vs.bfloat16();
        let mp = crate::roles::MixedPrecision {
            param_dtype: crate::roles::ParamDtype::Bf16,
        };
        let e = AdamW::for_model(&mut vs, OptimConfig::default(), &mp)
            .unwrap_err()
            .to_string();
        assert!(e.contains("float32") && e.contains("`x`"), "{e}");
    }

    #[test]
    fn master_weights_round_trip_through_save_and_load() {
        let dir = tempfile::tempdir().unwrap();
        let mp = crate::roles::MixedPrecision {
            param_dtype: crate::roles::ParamDtype::Bf16,
        };
        let mut vs = VarStore::new(Device::Cpu);
        let x = vs.root().var("x", &[3], Init::Const(1.0));
        let mut opt = AdamW::for_model(&mut vs, OptimConfig::default(), &mp).unwrap();
        x.to_kind(Kind::Float).square().sum(Kind::Float).backward();
        opt.accumulate_grads().unwrap();
        opt.clip_and_step(1.0, 0.1).unwrap();
        opt.save(dir.path()).unwrap();
        let mut vs2 = VarStore::new(Device::Cpu);
        let y = vs2.root().var("x", &[3], Init::Const(5.0));
        let mut other = AdamW::for_model(&mut vs2, OptimConfig::default(), &mp).unwrap();
        other.load(dir.path()).unwrap();
        let (a, b) = (opt.master.as_ref().unwrap(), other.master.as_ref().unwrap());
        assert!(a[0].equal(&b[0]));
        assert!(x.equal(&y), "the parameter is the loaded master rounded");
    }

    #[test]
    fn non_finite_norm_skips_and_counts() {
        let vs = VarStore::new(Device::Cpu);
        let x = vs.root().var("x", &[2], Init::Const(1.0));
        let mut opt = AdamW::new(&vs, OptimConfig::default());
        (x.sum(Kind::Float) * f64::NAN).backward();
        let (norm, took) = opt.clip_and_step(1.0, 0.1).unwrap();
        assert!(!norm.is_finite() && !took);
        assert_eq!(opt.counters().skipped_steps, 1);
        assert_eq!(Vec::<f32>::try_from(&x).unwrap(), vec![1.0, 1.0]);
    }

    #[test]
    fn state_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let vs = VarStore::new(Device::Cpu);
        let x = vs.root().var("x", &[3], Init::Const(1.0));
        let mut opt = AdamW::new(&vs, OptimConfig::default());
        x.square().sum(Kind::Float).backward();
        opt.clip_and_step(1.0, 0.1).unwrap();
        opt.schedule_step();
        opt.save(dir.path()).unwrap();
        let mut other = AdamW::new(&vs, OptimConfig::default());
        other.load(dir.path()).unwrap();
        assert_eq!(other.counters(), opt.counters());
        assert!(other.exp_avg[0].equal(&opt.exp_avg[0]));
        assert!(other.exp_avg_sq[0].equal(&opt.exp_avg_sq[0]));
    }
}
