//! ZeRO stage 3 (FSDP's `FULL_SHARD`): a model's parameters split over the data-parallel ranks
//! and gathered one unit at a time, just before the unit computes, then freed.
//!
//! The units are FSDP's wrapping of a decoder: one per layer (`model.layers.<i>.*`) and a root
//! unit with everything else (embeddings, final norm, `lm_head` or the value/score head). A
//! unit is one flat vector of its parameters in name order, padded with zeros to a multiple of
//! the world size; rank `r` keeps elements `[r * part, (r + 1) * part)` ([`Unit`]'s `local`) in
//! the model's dtype and nothing else of it.
//!
//! While a unit is released its parameters keep their shapes but hold a single NaN broadcast
//! over them (one element of memory), so code that reads a released parameter by mistake
//! computes NaN rather than plausible numbers; [`ParamShards::gather`] all-gathers the unit
//! and points its parameters at views of the gathered vector, and [`ParamShards::release`]
//! (the last of nested holds) drops it again.
//!
//! Every gather is a collective: every rank must gather the same units in the same order. The
//! model calls them in forward and backward order ([`crate::Model`]); where ranks would run
//! different numbers of forwards (token-balanced micro-batches, a rank whose rows all ended
//! generating), the one with fewer runs idle rounds that make the same collectives.

use std::cell::{Cell, RefCell};

use rl_core::dist::{self, Pending, ReduceOp, SharedCollective};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// The unit of everything outside the decoder layers.
pub(crate) const ROOT: usize = 0;

/// The unit of decoder layer `layer`.
pub(crate) fn layer_unit(layer: usize) -> usize {
    layer + 1
}

/// A libtorch optimiser over some parameters, used only for its `zero_grad`, which sets their
/// gradients to none (tch has no call that frees a gradient).
pub(crate) struct GradReleaser(tch::COptimizer);

impl std::fmt::Debug for GradReleaser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GradReleaser")
    }
}

impl GradReleaser {
    pub(crate) fn new(params: &[Tensor]) -> Result<GradReleaser> {
        let mut opt = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)?;
        for p in params {
            opt.add_parameters(p, 0)?;
        }
        Ok(GradReleaser(opt))
    }

    pub(crate) fn release(&self) -> Result<()> {
        Ok(self.0.zero_grad()?)
    }
}

/// One unit's layout and this rank's part of it.
pub(crate) struct Unit {
    /// The variables' names, in flat order.
    pub(crate) names: Vec<String>,
    /// Handles of the model's variables (the same tensors the layers compute with).
    params: Vec<Tensor>,
    shapes: Vec<Vec<i64>>,
    /// Where each variable starts in the flat vector.
    pub(crate) offsets: Vec<i64>,
    /// Elements per rank (the padded length divided by the world size).
    pub(crate) part: i64,
    kind: Kind,
    device: Device,
    /// This rank's `part` elements, in the model's dtype: the only copy of them it keeps.
    pub(crate) local: Tensor,
    /// Training: this rank's part of the averaged gradient, float32, accumulated over
    /// micro-batches (undefined until [`ParamShards::enable_grads`]).
    pub(crate) grad: RefCell<Tensor>,
    /// The gathered flat vector while held.
    full: RefCell<Option<Tensor>>,
    /// Nested holds.
    held: Cell<u32>,
    releaser: GradReleaser,
}

/// A model's parameters under ZeRO stage 3 over a data-parallel group.
pub struct ParamShards {
    group: SharedCollective,
    rank: usize,
    world: usize,
    pub(crate) units: Vec<Unit>,
    /// The unit whose all-gather was started ahead of its turn ([`ParamShards::prefetch`]).
    prefetched: RefCell<Option<(usize, Pending)>>,
    /// Gathers a prefetch served.
    prefetch_hits: Cell<u64>,
}

impl std::fmt::Debug for ParamShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamShards")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("units", &self.units.len())
            .finish()
    }
}

/// The unit a variable of a decoder model belongs to.
fn unit_of(name: &str) -> usize {
    name.split('.')
        .collect::<Vec<_>>()
        .windows(3)
        .find(|w| w[0] == "model" && w[1] == "layers")
        .and_then(|w| w[2].parse::<usize>().ok())
        .map_or(ROOT, layer_unit)
}

/// `tensors` with their element counts (an undefined tensor counts as zeros) as one `kind`
/// vector of `len` elements, zero-padded past their end.
fn flatten(
    tensors: impl Iterator<Item = (Tensor, i64)>,
    len: i64,
    kind: Kind,
    device: Device,
) -> Tensor {
    let mut parts: Vec<Tensor> = Vec::new();
    let mut numel = 0;
    for (t, n) in tensors {
        parts.push(if t.defined() {
            t.reshape([-1]).to_kind(kind)
        } else {
            Tensor::zeros([n], (kind, device))
        });
        numel += n;
    }
    parts.push(Tensor::zeros([len - numel], (kind, device)));
    Tensor::cat(&parts, 0)
}

/// A released parameter's stand-in: one NaN broadcast to `shape`.
fn placeholder(shape: &[i64], kind: Kind, device: Device) -> Tensor {
    Tensor::full([1], f64::NAN, (kind, device)).expand(shape, false)
}

fn core(e: rl_core::Error) -> Error {
    Error::Core(e)
}

impl ParamShards {
    /// Splits every variable of `vs` over `group` (every rank passes identical weights: call
    /// it after rank 0's weights were broadcast) and releases them.
    pub fn new(vs: &VarStore, group: SharedCollective) -> Result<ParamShards> {
        let (rank, world) = {
            let g = dist::lock(&group).map_err(core)?;
            (g.rank(), g.world_size())
        };
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let count = vars.iter().map(|(n, _)| unit_of(n)).max().unwrap_or(ROOT) + 1;
        let mut grouped: Vec<Vec<(String, Tensor)>> = (0..count).map(|_| Vec::new()).collect();
        for (n, t) in vars {
            grouped[unit_of(&n)].push((n, t));
        }
        let _guard = tch::no_grad_guard();
        let mut units = Vec::with_capacity(count);
        for (u, vars) in grouped.into_iter().enumerate() {
            let Some((first, t0)) = vars.first() else {
                return Err(Error::invalid(
                    "zero_stage",
                    format!("stage 3 found no parameters of unit {u} (layer {})", u - 1),
                ));
            };
            let (kind, device) = (t0.kind(), t0.device());
            if let Some((n, t)) = vars.iter().find(|(_, t)| t.kind() != kind) {
                return Err(Error::invalid(
                    "zero_stage",
                    format!(
                        "stage 3 shards a unit of one dtype, but `{n}` is {:?} and `{first}` {kind:?}",
                        t.kind()
                    ),
                ));
            }
            let mut offsets = Vec::with_capacity(vars.len());
            let mut numel = 0i64;
            for (_, t) in &vars {
                offsets.push(numel);
                numel += t.numel() as i64;
            }
            let part = (numel + world as i64 - 1) / world as i64;
            let whole = vars.iter().map(|(_, t)| (t.detach(), t.numel() as i64));
            let local = flatten(whole, part * world as i64, kind, device)
                .narrow(0, rank as i64 * part, part)
                .copy();
            let (names, params): (Vec<String>, Vec<Tensor>) = vars.into_iter().unzip();
            let shapes = params.iter().map(Tensor::size).collect();
            let releaser = GradReleaser::new(&params)?;
            let unit = Unit {
                names,
                params,
                shapes,
                offsets,
                part,
                kind,
                device,
                local,
                grad: RefCell::new(Tensor::new()),
                full: RefCell::new(None),
                held: Cell::new(0),
                releaser,
            };
            unit.free();
            units.push(unit);
        }
        Ok(ParamShards {
            group,
            rank,
            world,
            units,
            prefetched: RefCell::new(None),
            prefetch_hits: Cell::new(0),
        })
    }

    /// The data-parallel group.
    pub(crate) fn group(&self) -> &SharedCollective {
        &self.group
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Allocates (zero) float32 gradient parts, for training.
    pub(crate) fn enable_grads(&self) {
        for u in &self.units {
            *u.grad.borrow_mut() = Tensor::zeros([u.part], (Kind::Float, u.device));
        }
    }

    /// Gathers unit `u` (a collective when it is not held already) and holds it.
    pub(crate) fn gather(&self, u: usize) -> Result<()> {
        let unit = &self.units[u];
        if unit.held.get() == 0 {
            let _guard = tch::no_grad_guard();
            let ahead = self.prefetched.borrow_mut().take();
            let full = match ahead {
                Some((v, pending)) if v == u => {
                    self.prefetch_hits.set(self.prefetch_hits.get() + 1);
                    pending.wait().map_err(core)?
                }
                other => {
                    // a gather started for another unit completes first (every rank started it)
                    if let Some((_, pending)) = other {
                        drop(pending.wait().map_err(core)?);
                    }
                    dist::lock(&self.group)
                        .and_then(|mut g| g.all_gather_flat(&unit.local))
                        .map_err(core)?
                }
            };
            for ((p, shape), &off) in unit.params.iter().zip(&unit.shapes).zip(&unit.offsets) {
                let n: i64 = shape.iter().product();
                p.shallow_clone()
                    .set_data(&full.narrow(0, off, n).view(shape.as_slice()));
            }
            *unit.full.borrow_mut() = Some(full);
        }
        unit.held.set(unit.held.get() + 1);
        Ok(())
    }

    /// Starts unit `u`'s all-gather now, to run while the current unit computes (FSDP's
    /// prefetch; the next [`ParamShards::gather`] of `u` waits for it). Nothing when `u` is
    /// held already, out of range, or another prefetch is in flight: the decision depends only
    /// on the holds, which every rank makes alike, so every rank starts the same collectives.
    pub(crate) fn prefetch(&self, u: usize) -> Result<()> {
        let Some(unit) = self.units.get(u) else {
            return Ok(());
        };
        if unit.held.get() > 0 || self.prefetched.borrow().is_some() {
            return Ok(());
        }
        let pending = dist::lock(&self.group)
            .and_then(|mut g| g.all_gather_flat_start(&unit.local))
            .map_err(core)?;
        *self.prefetched.borrow_mut() = Some((u, pending));
        Ok(())
    }

    /// Ends one hold of unit `u`; the last frees the gathered parameters.
    pub(crate) fn release(&self, u: usize) {
        let unit = &self.units[u];
        match unit.held.get() {
            0 => {}
            1 => {
                unit.held.set(0);
                unit.free();
            }
            n => unit.held.set(n - 1),
        }
    }

    /// Holds unit `u` until the guard drops.
    pub(crate) fn hold(&self, u: usize) -> Result<Held<'_>> {
        self.gather(u)?;
        Ok(Held {
            shards: self,
            unit: u,
        })
    }

    /// Training, after unit `u`'s backward: reduce-scatters (averages) its parameters'
    /// gradients into this rank's float32 part and frees them (a collective).
    pub(crate) fn reduce_grads(&self, u: usize) -> Result<()> {
        let unit = &self.units[u];
        let _guard = tch::no_grad_guard();
        let grads =
            (unit.params.iter().zip(&unit.shapes)).map(|(p, s)| (p.grad(), s.iter().product()));
        let flat = flatten(
            grads,
            unit.part * self.world as i64,
            Kind::Float,
            unit.device,
        );
        unit.releaser.release()?;
        let mine = dist::lock(&self.group)
            .and_then(|mut g| g.reduce_scatter(&flat, ReduceOp::Avg))
            .map_err(core)?;
        let mut acc = unit.grad.borrow_mut();
        if acc.defined() {
            let _ = acc.g_add_(&mine);
        } else {
            *acc = mine;
        }
        Ok(())
    }

    /// Every unit gathered at once (a collective), for reading or writing whole weights
    /// (checkpoints, replica checks); writes into the parameters reach the shards when the
    /// guard drops.
    pub(crate) fn hold_all(&self) -> Result<HeldAll<'_>> {
        self.gather_all()?;
        Ok(HeldAll { shards: self })
    }

    /// Gathers every unit (a collective) until [`ParamShards::release_all`]; on an error the
    /// units gathered so far are released.
    pub(crate) fn gather_all(&self) -> Result<()> {
        for u in 0..self.units.len() {
            if let Err(e) = self.gather(u) {
                for v in 0..u {
                    self.release(v);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Ends a hold of every unit; with `keep_writes`, first copies this rank's part of each
    /// gathered vector back into its shard (what was written into the parameters meanwhile).
    pub(crate) fn release_all(&self, keep_writes: bool) {
        let _guard = tch::no_grad_guard();
        for (u, unit) in self.units.iter().enumerate() {
            if keep_writes && let Some(full) = unit.full.borrow().as_ref() {
                unit.local.shallow_clone().copy_(&full.narrow(
                    0,
                    self.rank as i64 * unit.part,
                    unit.part,
                ));
            }
            self.release(u);
        }
    }

    /// How many gathers found their unit prefetched (started while the unit before computed).
    pub fn prefetch_hits(&self) -> u64 {
        self.prefetch_hits.get()
    }

    /// Whether every unit is gathered now.
    pub(crate) fn all_held(&self) -> bool {
        self.units.iter().all(|u| u.held.get() > 0)
    }

    /// Bytes of parameters this rank keeps (its parts).
    pub fn local_bytes(&self) -> i64 {
        self.units
            .iter()
            .map(|u| u.part * u.kind.elt_size_in_bytes() as i64)
            .sum()
    }
}

impl Unit {
    /// Points the parameters at their NaN stand-ins and drops the gathered vector.
    fn free(&self) {
        for (p, shape) in self.params.iter().zip(&self.shapes) {
            p.shallow_clone()
                .set_data(&placeholder(shape, self.kind, self.device));
        }
        *self.full.borrow_mut() = None;
    }
}

/// A hold of one unit: released on drop.
pub(crate) struct Held<'a> {
    shards: &'a ParamShards,
    unit: usize,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.shards.release(self.unit);
    }
}

/// A hold of every unit ([`crate::Model::hold_all`]): while it lives the parameters are whole;
/// on drop, this rank's part of each gathered vector (which writes into the parameters
/// changed) is copied back into its shard, and the units are released.
#[must_use = "the weights are whole only while the hold lives"]
pub struct HeldAll<'a> {
    shards: &'a ParamShards,
}

impl Drop for HeldAll<'_> {
    fn drop(&mut self) {
        self.shards.release_all(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_fall_into_their_layer_or_the_root() {
        assert_eq!(unit_of("model.layers.0.self_attn.q_proj.weight"), 1);
        assert_eq!(unit_of("model.layers.11.mlp.down_proj.weight"), 12);
        assert_eq!(unit_of("model.embed_tokens.weight"), ROOT);
        assert_eq!(unit_of("model.norm.weight"), ROOT);
        assert_eq!(unit_of("lm_head.weight"), ROOT);
        assert_eq!(unit_of("score.weight"), ROOT);
    }

    #[test]
    fn a_one_rank_group_gathers_what_it_released() {
        let vs = VarStore::new(Device::Cpu);
        let root = vs.root();
        // drawn under the generator's hold, so concurrent seeded tests are not disturbed
        let a = crate::seeded(1, || {
            (&root / "lm_head").var(
                "weight",
                &[3, 2],
                tch::nn::Init::Randn {
                    mean: 0.,
                    stdev: 1.,
                },
            )
        });
        let b = (&root / "model" / "layers" / 0).var("w", &[5], tch::nn::Init::Const(2.0));
        let (a0, b0) = (a.detach().copy(), b.detach().copy());
        let shards = ParamShards::new(&vs, dist::share(dist::Solo)).unwrap();
        assert_eq!(shards.units.len(), 2);
        assert!(a.isnan().all().int64_value(&[]) != 0, "released");
        assert_eq!(a.size(), [3, 2], "a released parameter keeps its shape");
        {
            let _h = shards.hold(ROOT).unwrap();
            assert!(a.equal(&a0));
            assert!(
                b.isnan().all().int64_value(&[]) != 0,
                "other units stay released"
            );
        }
        assert!(a.isnan().all().int64_value(&[]) != 0);
        {
            let _all = shards.hold_all().unwrap();
            assert!(b.equal(&b0));
            let _ = tch::no_grad(|| b.shallow_clone().fill_(5.0));
        }
        let _h = shards.hold(layer_unit(0)).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&b).unwrap(),
            vec![5.0; 5],
            "writes reach the shard"
        );
    }

    /// A training forward of a sharded model, the loss's backward and `finish_backward` give
    /// each parameter the gradient one backward through the whole model gives (a one-rank
    /// group: the averaged part is the whole gradient), tied embeddings or not.
    #[test]
    fn the_layerwise_backward_gives_the_whole_models_gradients() {
        use crate::{CausalLm, Config};
        for tie in [false, true] {
            let mut cfg = Config::tiny();
            cfg.tie_word_embeddings = tie;
            let make =
                || crate::seeded(7, || CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap());
            let (whole, mut sharded) = (make(), make());
            let ids = Tensor::from_slice(&[5i64, 9, 17, 3, 40, 41, 0, 0, 7, 8, 9, 10]).view([2, 6]);
            let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]).view([2, 6]);
            let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
            let weights = Tensor::arange(128, (Kind::Float, Device::Cpu)) / 128.0;
            let loss_of = |lm: &CausalLm| {
                let logits = lm.forward(&ids, &mask, &pos, None).unwrap();
                (logits.log_softmax(-1, Kind::Float) * &weights).sum(Kind::Float)
            };
            let want_loss = loss_of(&whole);
            want_loss.backward();
            sharded.shard_params(dist::share(dist::Solo)).unwrap();
            let shards = sharded.model().param_shards().unwrap();
            shards.enable_grads();
            let loss = loss_of(&sharded);
            loss.backward();
            sharded.model().finish_backward().unwrap();
            assert!((loss.double_value(&[]) - want_loss.double_value(&[])).abs() < 1e-5);
            let want: std::collections::HashMap<String, Tensor> = whole
                .var_store()
                .variables()
                .into_iter()
                .map(|(n, t)| (n, t.grad()))
                .collect();
            let mut seen = 0;
            for unit in &shards.units {
                assert_eq!(unit.held.get(), 0, "every unit released");
                let grad = unit.grad.borrow();
                for ((name, shape), &off) in unit.names.iter().zip(&unit.shapes).zip(&unit.offsets)
                {
                    let n: i64 = shape.iter().product();
                    let got = grad.narrow(0, off, n).view(shape.as_slice());
                    let diff = (got - &want[name]).abs().max().double_value(&[]);
                    assert!(diff < 1e-6, "tie {tie}: {name} differs by {diff}");
                    seen += 1;
                }
            }
            assert_eq!(seen, want.len());
        }
    }
}
