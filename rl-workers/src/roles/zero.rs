//! ZeRO stages 1 and 2 for [`AdamW`](super::AdamW): the optimiser state (AdamW's moments and,
//! with mixed precision, the float32 master weights) split across the data-parallel ranks,
//! and at stage 2 the gradients too (DeepSpeed's ZeRO, PyTorch FSDP's `SHARD_GRAD_OP` for the
//! optimiser; see docs/distributed.md, "Sharding").
//!
//! The trained parameters, in name order, are grouped into buckets of at most
//! [`BUCKET_ELEMS`] elements (25 MiB of float32, DDP's bucket size; a larger parameter, such
//! as an embedding, is a bucket of its own). A bucket is one flat
//! vector of its parameters, padded with zeros to a multiple of the world size, and rank `r`
//! owns its elements `[r * part, (r + 1) * part)`. Each rank keeps the state of the elements it
//! owns only, updates them, and the ranks all-gather the updated elements bucket by bucket, so
//! every rank ends a step with the whole, identical, parameters; a collective never moves more
//! than one bucket.
//!
//! AdamW is elementwise, so updating a rank's part with the same gradient gives bit for bit
//! what the unsharded optimiser gives. Stage 1 averages whole gradients as plain data
//! parallelism does (so it equals it exactly); stage 2 reduce-scatters each micro-batch's
//! gradient into the owned part and releases the whole gradient, so the sums round in another
//! order (about 1e-7 relative).

use rl_core::dist::{self, ReduceOp, SharedCollective};
use tch::{Kind, Tensor};

use crate::fsdp::ParamShards;

/// Elements per bucket: 25 MiB of float32.
pub(crate) const BUCKET_ELEMS: i64 = 25 * 1024 * 1024 / 4;

/// How a role's training state is split over its data-parallel ranks
/// (`actor_rollout_ref.actor.zero_stage`, `critic.zero_stage`,
/// `reward_model.train.zero_stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum ZeroStage {
    /// Every rank holds everything (plain data parallelism, DDP).
    #[default]
    Replicated,
    /// AdamW's moments and the master weights split over the ranks.
    OptimizerState,
    /// Stage 1 plus the gradients reduce-scattered into each rank's part.
    Gradients,
    /// Stage 2 plus the parameters: each rank keeps its part of every layer and gathers a
    /// layer just before it computes ([`crate::ParamShards`]; FSDP's `FULL_SHARD`).
    Parameters,
}

impl ZeroStage {
    /// The stage of the config value `zero_stage`; `key` names it in the error.
    pub fn from_config(key: &str, stage: u8) -> crate::error::Result<ZeroStage> {
        match stage {
            0 => Ok(ZeroStage::Replicated),
            1 => Ok(ZeroStage::OptimizerState),
            2 => Ok(ZeroStage::Gradients),
            3 => Ok(ZeroStage::Parameters),
            s => Err(crate::error::Error::invalid(
                key,
                format!(
                    "must be 0 (replicated), 1 (optimizer state), 2 (plus gradients) or 3 (plus parameters), got {s}"
                ),
            )),
        }
    }
}

/// A run of consecutive parameters flattened into one vector.
#[derive(Debug, Default)]
pub(crate) struct Bucket {
    /// Indices into the optimiser's parameters.
    params: Vec<usize>,
    /// Where each of them starts in the flat vector.
    offsets: Vec<i64>,
    /// Elements per rank: the bucket's length padded to a multiple of the world size, divided.
    part: i64,
    /// The bucket's length without padding.
    numel: i64,
}

/// Groups `params` (in order) into buckets of at most [`BUCKET_ELEMS`] elements (a larger
/// parameter gets a bucket of its own).
pub(crate) fn buckets(params: &[Tensor], world: usize, cap: i64) -> Vec<Bucket> {
    let world = world as i64;
    let mut out: Vec<Bucket> = Vec::new();
    let mut cur = Bucket::default();
    for (i, p) in params.iter().enumerate() {
        let n = p.numel() as i64;
        if !cur.params.is_empty() && cur.numel + n > cap {
            out.push(std::mem::take(&mut cur));
        }
        cur.params.push(i);
        cur.offsets.push(cur.numel);
        cur.numel += n;
    }
    if !cur.params.is_empty() {
        out.push(cur);
    }
    for b in &mut out {
        b.part = (b.numel + world - 1) / world;
    }
    out
}

impl Bucket {
    /// Elements `[from, to)` of the bucket as one float32 vector on the parameters' device:
    /// `value(i)` for each parameter overlapping the range (zeros where it is undefined), then
    /// zero padding past the bucket's end.
    fn range(
        &self,
        params: &[Tensor],
        value: impl Fn(usize) -> Tensor,
        from: i64,
        to: i64,
    ) -> Tensor {
        let device = params[self.params[0]].device();
        let mut parts: Vec<Tensor> = Vec::with_capacity(self.params.len() + 1);
        for (&i, &off) in self.params.iter().zip(&self.offsets) {
            let n = params[i].numel() as i64;
            let (lo, hi) = (from.max(off), to.min(off + n));
            if lo >= hi {
                continue;
            }
            let v = value(i);
            parts.push(if v.defined() {
                v.reshape([-1])
                    .narrow(0, lo - off, hi - lo)
                    .to_kind(Kind::Float)
                    .to_device(device)
            } else {
                Tensor::zeros([hi - lo], (Kind::Float, device))
            });
        }
        let pad = to - from.max(self.numel);
        if pad > 0 {
            parts.push(Tensor::zeros([pad], (Kind::Float, device)));
        }
        Tensor::cat(&parts, 0)
    }

    /// The whole bucket, `world * part` elements (see [`Bucket::range`]).
    fn flat(&self, world: usize, params: &[Tensor], value: impl Fn(usize) -> Tensor) -> Tensor {
        self.range(params, value, 0, self.part * world as i64)
    }

    /// Rank `rank`'s `part` elements of the bucket (see [`Bucket::range`]), made from the
    /// overlapping parameters only; a new tensor (`cat` copies), never a view of `value`'s.
    fn local(&self, rank: usize, params: &[Tensor], value: impl Fn(usize) -> Tensor) -> Tensor {
        let from = rank as i64 * self.part;
        self.range(params, value, from, from + self.part)
    }

    /// Copies a whole bucket vector (`world * part` elements) into its parameters, each rounded
    /// to its own dtype.
    fn scatter_into(&self, full: &Tensor, params: &mut [Tensor]) {
        for (&i, &off) in self.params.iter().zip(&self.offsets) {
            let p = &mut params[i];
            let part = full
                .narrow(0, off, p.numel() as i64)
                .view(p.size().as_slice());
            p.copy_(&part.to_kind(p.kind()));
        }
    }
}

/// The state one rank keeps under ZeRO stage 1 or 2 (the whole gradients of stage 1, and
/// their float32 accumulators under mixed precision, stay with [`AdamW`](super::AdamW)).
pub(crate) struct Sharded {
    pub(crate) group: SharedCollective,
    pub(crate) stage: ZeroStage,
    rank: usize,
    world: usize,
    buckets: Vec<Bucket>,
    /// AdamW's moments of the owned elements, one float32 `[part]` per bucket.
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// Mixed precision: float32 master weights of the owned elements.
    master: Option<Vec<Tensor>>,
    /// Stages 2 and 3: the owned part of the averaged gradient, accumulated over
    /// micro-batches (stage 3: the [`ParamShards`]' own gradient parts, shared).
    grad: Vec<Tensor>,
    /// Stage 3: the owned elements of the weights themselves, in the model's dtype (the
    /// [`ParamShards`]' parts, shared: a step updates them in place).
    weights: Vec<Tensor>,
}

impl std::fmt::Debug for Sharded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharded")
            .field("stage", &self.stage)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("buckets", &self.buckets.len())
            .field("master", &self.master.is_some())
            .finish()
    }
}

/// AdamW's per-step constants.
pub(crate) struct StepConsts {
    pub(crate) b1: f64,
    pub(crate) b2: f64,
    pub(crate) bc1: f64,
    pub(crate) bc2: f64,
    pub(crate) eps: f64,
    pub(crate) lr: f64,
    pub(crate) weight_decay: f64,
}

/// One AdamW update, in place, of the float32 weights `w` from the float32 gradient `g` and
/// the moments `m`, `v`: torch.optim.AdamW's update (decoupled decay, bias-corrected moments,
/// `eps` after the square root), written with plain multiply-adds where torch uses `lerp_` and
/// `addcdiv_`, so the two can differ in the last bit; the sharded and unsharded paths share
/// this one function and so agree exactly.
pub(crate) fn adamw_(w: &mut Tensor, g: &Tensor, m: &mut Tensor, v: &mut Tensor, k: &StepConsts) {
    let _ = m.g_mul_scalar_(k.b1);
    let _ = m.g_add_(&(g * (1.0 - k.b1)));
    let _ = v.g_mul_scalar_(k.b2);
    let _ = v.g_add_(&(g.square() * (1.0 - k.b2)));
    let denom = v.sqrt() / k.bc2.sqrt() + k.eps;
    let update = (&*m / denom) * (k.lr / k.bc1);
    if k.weight_decay != 0.0 {
        let _ = w.g_mul_scalar_(1.0 - k.lr * k.weight_decay);
    }
    let _ = w.g_sub_(&update);
}

/// The whole (unsharded) state the sharded one is made from or written as: per parameter,
/// AdamW's moments and the master weights.
pub(crate) struct WholeState<'a> {
    pub(crate) exp_avg: &'a dyn Fn(usize) -> Tensor,
    pub(crate) exp_avg_sq: &'a dyn Fn(usize) -> Tensor,
    pub(crate) master: Option<&'a dyn Fn(usize) -> Tensor>,
}

impl Sharded {
    /// This rank's share of `whole` over `group`, for `params` (every rank passes the same
    /// parameters, in the same order).
    pub(crate) fn new(
        group: SharedCollective,
        stage: ZeroStage,
        params: &[Tensor],
        whole: &WholeState<'_>,
    ) -> rl_core::Result<Sharded> {
        let (rank, world) = {
            let g = dist::lock(&group)?;
            (g.rank(), g.world_size())
        };
        let buckets = buckets(params, world, BUCKET_ELEMS);
        let mut state = Sharded::over(group, stage, (rank, world), buckets, params, whole);
        if stage == ZeroStage::Gradients {
            let device = params.first().map_or(tch::Device::Cpu, Tensor::device);
            state.grad = state
                .buckets
                .iter()
                .map(|b| Tensor::zeros([b.part], (Kind::Float, device)))
                .collect();
        }
        Ok(state)
    }

    /// The state over `buckets`: this rank's share of `whole`'s moments and masters, with no
    /// gradient parts and no weights of its own (the constructors add what their stage keeps).
    fn over(
        group: SharedCollective,
        stage: ZeroStage,
        (rank, world): (usize, usize),
        buckets: Vec<Bucket>,
        params: &[Tensor],
        whole: &WholeState<'_>,
    ) -> Sharded {
        let _guard = tch::no_grad_guard();
        let shares = |value: &dyn Fn(usize) -> Tensor| -> Vec<Tensor> {
            buckets
                .iter()
                .map(|b| b.local(rank, params, value))
                .collect()
        };
        let exp_avg = shares(whole.exp_avg);
        let exp_avg_sq = shares(whole.exp_avg_sq);
        let master = whole.master.map(shares);
        Sharded {
            group,
            stage,
            rank,
            world,
            buckets,
            exp_avg,
            exp_avg_sq,
            master,
            grad: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Stage 3: this rank's share of `whole` for `params` (named `names`), laid out as the
    /// units of `shards` (one bucket per unit), whose weight and gradient parts it shares.
    /// Every variable of the sharded model must be trained (no frozen base under LoRA).
    pub(crate) fn with_params(
        shards: &ParamShards,
        names: &[String],
        params: &[Tensor],
        whole: &WholeState<'_>,
    ) -> rl_core::Result<Sharded> {
        let index: std::collections::HashMap<&str, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let world = dist::lock(shards.group())?.world_size();
        let mut buckets = Vec::with_capacity(shards.units.len());
        for unit in &shards.units {
            let mut b = Bucket {
                part: unit.part,
                ..Bucket::default()
            };
            for (n, &off) in unit.names.iter().zip(&unit.offsets) {
                let &i = index.get(n.as_str()).ok_or_else(|| rl_core::Error::Role {
                    role: "optimizer",
                    source: format!(
                        "ZeRO stage 3 shards every parameter with its optimizer state, but `{n}` is frozen (LoRA): use zero_stage 2 with LoRA"
                    )
                    .into(),
                })?;
                b.params.push(i);
                b.offsets.push(off);
                b.numel = off + params[i].numel() as i64;
            }
            buckets.push(b);
        }
        if buckets.iter().map(|b| b.params.len()).sum::<usize>() != params.len() {
            return Err(rl_core::Error::Role {
                role: "optimizer",
                source: "ZeRO stage 3: the optimizer trains parameters the model does not hold"
                    .into(),
            });
        }
        shards.enable_grads();
        let group = shards.group().clone();
        let position = (shards.rank(), world);
        let mut state = Sharded::over(
            group,
            ZeroStage::Parameters,
            position,
            buckets,
            params,
            whole,
        );
        state.grad = shards
            .units
            .iter()
            .map(|u| u.grad.borrow().shallow_clone())
            .collect();
        state.weights = shards
            .units
            .iter()
            .map(|u| u.local.shallow_clone())
            .collect();
        Ok(state)
    }

    /// Whether the float32 master weights are kept.
    pub(crate) fn has_master(&self) -> bool {
        self.master.is_some()
    }

    /// Whether every micro-batch's gradient is reduced (stages 2 and 3): then every rank must
    /// run as many micro-batches per mini-batch, and the gradient lives in the owned parts.
    pub(crate) fn reduces_per_micro_batch(&self) -> bool {
        self.stage >= ZeroStage::Gradients
    }

    /// Whether the parameters themselves are sharded (stage 3, which reduces gradients as the
    /// backward reaches each layer).
    pub(crate) fn shards_params(&self) -> bool {
        self.stage == ZeroStage::Parameters
    }

    /// Stage 2, after a micro-batch's backward: reduce-scatters (averages) the parameters'
    /// gradients into the owned parts, bucket by bucket (a collective).
    pub(crate) fn reduce_scatter_grads(&mut self, params: &[Tensor]) -> rl_core::Result<()> {
        let _guard = tch::no_grad_guard();
        let mut g = dist::lock(&self.group)?;
        for (b, acc) in self.buckets.iter().zip(&mut self.grad) {
            let flat = b.flat(self.world, params, |i| params[i].grad());
            let mine = g.reduce_scatter(&flat, ReduceOp::Avg)?;
            let _ = acc.g_add_(&mine);
        }
        Ok(())
    }

    /// Stage 2: the global L2 norm of the averaged gradient from the owned parts (a
    /// collective).
    pub(crate) fn part_grad_norm(&self) -> rl_core::Result<f64> {
        let _guard = tch::no_grad_guard();
        let mut total = [0f64];
        for g in &self.grad {
            let n = g.to_kind(Kind::Double).norm().double_value(&[]);
            total[0] += n * n;
        }
        dist::all_reduce_f64(&mut *dist::lock(&self.group)?, &mut total, ReduceOp::Sum)?;
        Ok(total[0].sqrt())
    }

    /// Stage 2: multiplies the owned gradient parts by `coef` (clipping).
    pub(crate) fn scale_part_grads(&mut self, coef: f64) {
        let _guard = tch::no_grad_guard();
        for g in &mut self.grad {
            let _ = g.g_mul_scalar_(coef);
        }
    }

    /// One AdamW step of the owned elements, from the owned gradient parts (stage 2) or the
    /// owned elements of `whole_grads` (stage 1: the averaged, clipped gradient of each
    /// parameter), then the all-gather of every bucket into the parameters (a collective).
    pub(crate) fn step(
        &mut self,
        params: &mut [Tensor],
        whole_grads: &[Tensor],
        k: &StepConsts,
    ) -> rl_core::Result<()> {
        let _guard = tch::no_grad_guard();
        let rank = self.rank;
        let mut group = dist::lock(&self.group)?;
        for (bi, b) in self.buckets.iter().enumerate() {
            let g = match self.stage {
                ZeroStage::Gradients | ZeroStage::Parameters => self.grad[bi].shallow_clone(),
                _ => b.local(rank, params, |i| whole_grads[i].shallow_clone()),
            };
            let mut w = match (&self.master, self.weights.get(bi)) {
                (Some(m), _) => m[bi].shallow_clone(),
                (None, Some(mine)) => mine.to_kind(Kind::Float).copy(),
                (None, None) => b.local(rank, params, |i| params[i].shallow_clone()),
            };
            adamw_(
                &mut w,
                &g,
                &mut self.exp_avg[bi],
                &mut self.exp_avg_sq[bi],
                k,
            );
            match self.weights.get_mut(bi) {
                // stage 3: the owned elements are all this rank keeps of the weights
                Some(mine) => {
                    mine.copy_(&w.to_kind(mine.kind()));
                }
                None => {
                    let full = group.all_gather_flat(&w)?;
                    b.scatter_into(&full, params);
                }
            }
        }
        Ok(())
    }

    /// Zeroes the owned gradient parts.
    pub(crate) fn zero_grad(&mut self) {
        let _guard = tch::no_grad_guard();
        for g in &mut self.grad {
            let _ = g.zero_();
        }
    }

    /// The whole state, gathered from every rank (a collective): per parameter `i`, its
    /// `(exp_avg, exp_avg_sq, master)` on the host, bucket by bucket. With `keep` false (a rank that does
    /// not write) each bucket is dropped as soon as it has been exchanged, so such a rank never
    /// holds more than one bucket of the whole state, and the result is empty.
    pub(crate) fn gather(
        &self,
        params: &[Tensor],
        keep: bool,
    ) -> rl_core::Result<Vec<(Tensor, Tensor, Option<Tensor>)>> {
        let _guard = tch::no_grad_guard();
        let mut group = dist::lock(&self.group)?;
        let mut out: Vec<Option<(Tensor, Tensor, Option<Tensor>)>> =
            (0..params.len()).map(|_| None).collect();
        for (bi, b) in self.buckets.iter().enumerate() {
            let m = group.all_gather_flat(&self.exp_avg[bi])?;
            let v = group.all_gather_flat(&self.exp_avg_sq[bi])?;
            let w = match &self.master {
                Some(ms) => Some(group.all_gather_flat(&ms[bi])?),
                None => None,
            };
            if !keep {
                continue;
            }
            for (&i, &off) in b.params.iter().zip(&b.offsets) {
                let n = params[i].numel() as i64;
                let shape = params[i].size();
                // on the host: the writer collects the whole state there, not on the device
                let cut = |t: &Tensor| {
                    t.narrow(0, off, n)
                        .view(shape.as_slice())
                        .to_device(tch::Device::Cpu)
                        .copy()
                };
                out[i] = Some((cut(&m), cut(&v), w.as_ref().map(cut)));
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Replaces the owned state with this rank's share of `whole` (a checkpoint read whole by
    /// every rank, on the host: each bucket moves to the device in turn); with master weights
    /// the parameters become the whole masters rounded.
    pub(crate) fn load(&mut self, params: &mut [Tensor], whole: &WholeState<'_>) {
        let _guard = tch::no_grad_guard();
        let (rank, world) = (self.rank, self.world);
        for (bi, b) in self.buckets.iter().enumerate() {
            self.exp_avg[bi] = b.local(rank, params, whole.exp_avg);
            self.exp_avg_sq[bi] = b.local(rank, params, whole.exp_avg_sq);
            if let (Some(ms), Some(m)) = (&mut self.master, whole.master) {
                ms[bi] = b.local(rank, params, m);
                match self.weights.get_mut(bi) {
                    Some(mine) => {
                        mine.copy_(&ms[bi].to_kind(mine.kind()));
                    }
                    None => {
                        let full = b.flat(world, params, m);
                        b.scatter_into(&full, params);
                    }
                }
            }
        }
    }

    /// Bytes of state this rank holds: its parts of the moments, the masters and (stage 2) the
    /// gradient.
    pub(crate) fn state_bytes(&self) -> i64 {
        let bytes = |ts: &[Tensor]| ts.iter().map(|t| t.numel() as i64 * 4).sum::<i64>();
        bytes(&self.exp_avg)
            + bytes(&self.exp_avg_sq)
            + self.master.as_deref().map_or(0, bytes)
            + bytes(&self.grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_element_once_and_pad_to_the_world() {
        let params: Vec<Tensor> = [5i64, 7, 3, 20, 1]
            .iter()
            .map(|&n| Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)))
            .collect();
        let bs = buckets(&params, 3, 12);
        // 5 + 7 = 12 fits; 3 starts a new one; 20 alone exceeds the cap; then 1
        let groups: Vec<Vec<usize>> = bs.iter().map(|b| b.params.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        assert_eq!(bs[0].offsets, vec![0, 5]);
        let parts: Vec<i64> = bs.iter().map(|b| b.part).collect();
        assert_eq!(parts, vec![4, 1, 7, 1]);
        let flat = bs[0].flat(3, &params, |i| params[i].ones_like() * (i as f64 + 1.0));
        assert_eq!(flat.size(), [12]);
        assert_eq!(
            Vec::<f32>::try_from(&flat).unwrap(),
            [vec![1.0; 5], vec![2.0; 7]].concat()
        );
    }

    #[test]
    fn each_ranks_part_is_its_slice_of_the_whole_bucket() {
        let params: Vec<Tensor> = [5i64, 7, 3]
            .iter()
            .map(|&n| Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)))
            .collect();
        let value = |i: usize| {
            if i == 1 {
                Tensor::new() // undefined: zeros
            } else {
                Tensor::arange(params[i].numel() as i64, (Kind::Float, tch::Device::Cpu))
                    + 10.0 * i as f64
            }
        };
        for world in [1usize, 2, 4, 6, 20] {
            let b = &buckets(&params, world, 100)[0];
            let whole = b.flat(world, &params, value);
            assert_eq!(whole.size(), [b.part * world as i64]);
            for rank in 0..world {
                let mine = b.local(rank, &params, value);
                let want = whole.narrow(0, rank as i64 * b.part, b.part);
                assert!(mine.equal(&want), "world {world}, rank {rank}");
            }
        }
    }

    #[test]
    fn stage_keys_name_themselves() {
        assert_eq!(
            ZeroStage::from_config("k", 2).unwrap(),
            ZeroStage::Gradients
        );
        assert_eq!(
            ZeroStage::from_config("k", 3).unwrap(),
            ZeroStage::Parameters
        );
        let e = ZeroStage::from_config("critic.zero_stage", 7)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("got 7") && e.contains("critic.zero_stage"),
            "{e}"
        );
    }
}
