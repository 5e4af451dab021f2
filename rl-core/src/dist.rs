//! The data-parallel seam: [`Collective`], the few cross-rank operations the workers and trainers
//! need, implemented over c10d by `rl_dist::ProcessGroup` and by [`Solo`] for one process.
//!
//! rl-algos and rl-workers program against this trait, so neither depends on the C++ shim; the
//! launcher (the harness, a test) creates the group and hands a [`SharedCollective`] to every
//! role and trainer of its rank. Every rank must issue the same collectives in the same order.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// Key in a micro-batch's `meta_info` holding the data-parallel world size (verl's
/// `data["dp_size"]`): the workers set it when a group is attached, objectives read it with
/// [`dp_size`].
pub const DP_SIZE: &str = "dp_size";

/// Key in a prompt batch's `meta_info` holding this process's data-parallel rank.
pub const DP_RANK: &str = "dp_rank";

/// Key in a prompt batch's `meta_info` holding the global index of its first prompt; the
/// rollout samples each row from the random stream of its global index, so a sampled run
/// does not depend on how its prompts are spread over ranks.
pub const DP_PROMPT_OFFSET: &str = "dp_prompt_offset";

/// The reduction of [`Collective::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum over ranks.
    Sum,
    /// Sum divided by the world size (floating-point tensors only).
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
}

/// Cross-rank operations over a data-parallel group of `world_size` processes.
///
/// Every rank must call the same operations in the same order with tensors of the same shapes
/// and dtypes. An `Err` means the group is broken (a peer died or timed out): stop training.
pub trait Collective: Send {
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Reduces every tensor of `tensors` in place over all ranks (gradients: bucketed, so small
    /// tensors share one round trip).
    ///
    /// # Shapes
    /// - `tensors`: any shapes, the same list of shapes and dtypes on every rank
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()>;
    /// Every rank's `tensor`, in rank order.
    ///
    /// # Shapes
    /// - `tensor`: any shape, the same on every rank; returns `world_size` such tensors
    fn all_gather(&mut self, tensor: &Tensor) -> Result<Vec<Tensor>>;
    /// Copies rank `src`'s `tensor` into every rank's `tensor`.
    ///
    /// # Shapes
    /// - `tensor`: any shape, contiguous, the same on every rank
    fn broadcast(&mut self, tensor: &mut Tensor, src: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()>;
    /// Reduces every rank's 1-D `input` and returns this rank's `1 / world_size` of the result:
    /// rank `r` gets the elements `[r * n, (r + 1) * n)` (ZeRO's gradient reduce-scatter).
    ///
    /// The default reduces everything and keeps this rank's part; `rl_dist::ProcessGroup` runs
    /// c10d's reduce-scatter, which moves `1 / world_size` of the bytes to each rank.
    ///
    /// # Shapes
    /// - `input`: `[world_size * n]`, the same on every rank
    /// - returns `[n]`
    fn reduce_scatter(&mut self, input: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let world = self.world_size();
        if input.dim() != 1 || !(input.numel()).is_multiple_of(world) {
            return Err(Error::Role {
                role: "dist",
                source: format!(
                    "reduce_scatter needs a 1-D tensor whose length splits over {world} ranks, got shape {:?}",
                    input.size()
                )
                .into(),
            });
        }
        let mut all = [input.copy()];
        self.all_reduce(&mut all, op)?;
        let n = (input.numel() / world) as i64;
        Ok(all[0].narrow(0, self.rank() as i64 * n, n).copy())
    }
    /// Every rank's 1-D `input` concatenated in rank order (ZeRO's parameter all-gather).
    ///
    /// # Shapes
    /// - `input`: `[n]`, the same on every rank
    /// - returns `[world_size * n]`
    fn all_gather_flat(&mut self, input: &Tensor) -> Result<Tensor> {
        let parts = self.all_gather(input)?;
        Ok(Tensor::cat(&parts, 0))
    }
    /// [`Collective::all_gather_flat`] started without waiting: [`Pending::wait`] returns its
    /// result, and collectives issued meanwhile are allowed (every rank issues them all in the
    /// same order). FSDP's prefetch: the next layer's gather runs while this one computes.
    ///
    /// The default runs the collective at once and hands back its result; `rl_dist`'s process
    /// group runs it on the backend's threads.
    fn all_gather_flat_start(&mut self, input: &Tensor) -> Result<Pending> {
        let out = self.all_gather_flat(input)?;
        Ok(Pending::new(move || Ok(out)))
    }
}

/// A collective in flight ([`Collective::all_gather_flat_start`]).
pub struct Pending(Box<dyn FnOnce() -> Result<Tensor> + Send>);

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pending")
    }
}

impl Pending {
    /// A collective whose completion `wait` gives.
    pub fn new(wait: impl FnOnce() -> Result<Tensor> + Send + 'static) -> Pending {
        Pending(Box::new(wait))
    }

    /// Blocks until the collective completes; its result.
    pub fn wait(self) -> Result<Tensor> {
        (self.0)()
    }
}

/// A collective shared by the roles and the trainer of one rank.
pub type SharedCollective = Arc<Mutex<dyn Collective>>;

/// Wraps a collective for sharing between roles and trainer.
pub fn share<C: Collective + 'static>(c: C) -> SharedCollective {
    Arc::new(Mutex::new(c))
}

/// Locks a shared collective; a poisoned lock (a previous call panicked) is an error.
pub fn lock(c: &SharedCollective) -> Result<MutexGuard<'_, dyn Collective + 'static>> {
    c.lock().map_err(|_| Error::Role {
        role: "dist",
        source: "the process group's lock is poisoned (a previous call panicked)".into(),
    })
}

/// The world of one process: every collective is the identity. Useful in tests and to run the
/// data-parallel code path without a group.
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce(&mut self, _tensors: &mut [Tensor], _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn all_gather(&mut self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        Ok(vec![tensor.copy()])
    }
    fn broadcast(&mut self, _tensor: &mut Tensor, _src: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
}

/// `meta_info[DP_SIZE]` of `batch`, 1 when absent.
pub fn dp_size(batch: &crate::Batch) -> usize {
    batch
        .meta_info()
        .get(DP_SIZE)
        .and_then(serde_json::Value::as_u64)
        .map_or(1, |v| v.max(1) as usize)
}

/// Reduces f64 scalars in place over all ranks (as one f64 tensor, so sums of counts are exact
/// up to 2^53).
pub fn all_reduce_f64(c: &mut dyn Collective, values: &mut [f64], op: ReduceOp) -> Result<()> {
    if values.is_empty() || c.world_size() == 1 {
        return Ok(());
    }
    let mut t = [Tensor::from_slice(values)];
    c.all_reduce(&mut t, op)?;
    let out = Vec::<f64>::try_from(&t[0])?;
    values.copy_from_slice(&out);
    Ok(())
}

/// Every rank's `bytes` (of any lengths), in rank order: lengths are gathered first, then the
/// bytes padded to the longest.
pub fn all_gather_bytes(c: &mut dyn Collective, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    if c.world_size() == 1 {
        return Ok(vec![bytes.to_vec()]);
    }
    let lens = c.all_gather(&Tensor::from_slice(&[bytes.len() as i64]))?;
    let lens = lens
        .iter()
        .map(|t| t.int64_value(&[0]) as usize)
        .collect::<Vec<_>>();
    let longest = lens.iter().copied().max().unwrap_or(0).max(1);
    let mut padded = bytes.to_vec();
    padded.resize(longest, 0);
    let parts = c.all_gather(&Tensor::from_slice(&padded))?;
    parts
        .iter()
        .zip(lens)
        .map(|(t, n)| Ok(Vec::<u8>::try_from(t)?[..n].to_vec()))
        .collect()
}

/// Every rank's rows of `tensor` concatenated in rank order; ranks may hold different numbers of
/// rows and (for 2-D tensors) different widths: rows are padded to the most rows and columns to
/// the widest with zeros, then trimmed back (so narrower ranks' rows end in zero columns).
///
/// # Shapes
/// - `tensor`: `[rows_r, ...]` on rank `r`, the same trailing dims on every rank except dim 1
///   of a 2-D tensor
/// - returns `[sum_r rows_r, ...]` (2-D: `[sum_r rows_r, max_r width_r]`)
pub fn gather_rows(c: &mut dyn Collective, tensor: &Tensor) -> Result<Tensor> {
    if c.world_size() == 1 {
        return Ok(tensor.shallow_clone());
    }
    let size = tensor.size();
    if size.is_empty() {
        return Err(Error::InvalidArgument {
            name: "tensor",
            reason: "gather_rows needs at least one dimension".into(),
        });
    }
    let width = if size.len() == 2 { size[1] } else { 0 };
    let each = c.all_gather(&Tensor::from_slice(&[size[0], width]))?;
    let rows: Vec<i64> = each.iter().map(|t| t.int64_value(&[0])).collect();
    let max_rows = rows.iter().copied().max().unwrap_or(0);
    let max_width = each.iter().map(|t| t.int64_value(&[1])).max().unwrap_or(0);
    let mut padded = tensor.contiguous();
    if size.len() == 2 && width < max_width {
        padded = padded.constant_pad_nd([0, max_width - width]);
    }
    if size[0] < max_rows {
        let mut pad = vec![0i64; 2 * (size.len() - 1)];
        pad.extend([0, max_rows - size[0]]);
        padded = padded.constant_pad_nd(pad);
    }
    let parts = c.all_gather(&padded.contiguous())?;
    let kept: Vec<Tensor> = parts
        .iter()
        .zip(&rows)
        .map(|(t, &r)| t.narrow(0, 0, r))
        .collect();
    Ok(Tensor::cat(&kept, 0))
}

/// The half-open row range `[start, end)` rank `rank` of `world_size` takes from `len` rows:
/// contiguous, sizes differing by at most one, earlier ranks first.
pub fn shard_range(len: usize, rank: usize, world_size: usize) -> std::ops::Range<usize> {
    let world = world_size.max(1);
    (rank * len / world)..((rank + 1) * len / world)
}

/// How one metric key is combined over ranks by [`reduce_metrics`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricReduce {
    /// Weighted mean (the weight given with the value, e.g. rows or tokens).
    Mean,
    /// Maximum over ranks.
    Max,
    /// Minimum over ranks.
    Min,
    /// Sum over ranks.
    Sum,
}

/// The reduction verl's names imply: `*/max` and `timing_s/*` take the maximum, `*/min` the
/// minimum, `perf/total_num_tokens` the sum, everything else the weighted mean.
pub fn default_reduce(key: &str) -> MetricReduce {
    if key.ends_with("/max") || key.starts_with("timing_s/") {
        MetricReduce::Max
    } else if key.ends_with("/min") {
        MetricReduce::Min
    } else if key == "perf/total_num_tokens" {
        MetricReduce::Sum
    } else {
        MetricReduce::Mean
    }
}

/// Combines each rank's `metrics` (key -> `(value, weight)`) into the global figures, the same on
/// every rank. Keys missing on some ranks are combined over the ranks that have them; a mean
/// whose weights sum to zero is the plain mean.
pub fn reduce_metrics(
    c: &mut dyn Collective,
    metrics: &BTreeMap<String, (f64, f64)>,
    how: impl Fn(&str) -> MetricReduce,
) -> Result<BTreeMap<String, f64>> {
    if c.world_size() == 1 {
        return Ok(metrics.iter().map(|(k, (v, _))| (k.clone(), *v)).collect());
    }
    let bytes = serde_json::to_vec(metrics).map_err(|e| Error::Role {
        role: "dist",
        source: Box::new(e),
    })?;
    let mut per_key: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for part in all_gather_bytes(c, &bytes)? {
        let m: BTreeMap<String, (f64, f64)> =
            serde_json::from_slice(&part).map_err(|e| Error::Role {
                role: "dist",
                source: Box::new(e),
            })?;
        for (k, v) in m {
            per_key.entry(k).or_default().push(v);
        }
    }
    Ok(per_key
        .into_iter()
        .map(|(k, vs)| {
            let v = match how(&k) {
                MetricReduce::Max => vs.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max),
                MetricReduce::Min => vs.iter().map(|x| x.0).fold(f64::INFINITY, f64::min),
                MetricReduce::Sum => vs.iter().map(|x| x.0).sum(),
                MetricReduce::Mean => {
                    let w: f64 = vs.iter().map(|x| x.1).sum();
                    if w > 0.0 {
                        vs.iter().map(|x| x.0 * x.1).sum::<f64>() / w
                    } else {
                        vs.iter().map(|x| x.0).sum::<f64>() / vs.len() as f64
                    }
                }
            };
            (k, v)
        })
        .collect())
}

/// A 64-bit FNV-1a digest of `tensors`' bytes (in order, as stored): equal digests on two ranks
/// mean bit-identical weights, with overwhelming probability.
pub fn digest(tensors: &[Tensor]) -> Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tensors {
        let t = t.to_device(Device::Cpu).contiguous();
        // reinterpret rather than convert: view the storage as bytes
        let raw = if t.kind() == Kind::Uint8 {
            t
        } else {
            t.flatten(0, -1).f_view_dtype(Kind::Uint8)?
        };
        for b in Vec::<u8>::try_from(raw.flatten(0, -1))? {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    Ok(h)
}

/// Checks that `tensors` are bit-identical on every rank (by [`digest`]); the error names the
/// ranks that differ from rank 0.
pub fn check_replicas(c: &mut dyn Collective, what: &str, tensors: &[Tensor]) -> Result<()> {
    if c.world_size() == 1 {
        return Ok(());
    }
    check_digests(c, what, Some(digest(tensors)?))
}

/// Compares each rank's `digest` (of its weights) with rank 0's; the error names `what` and the
/// ranks that differ. Ranks whose digest is `None` (the role cannot tell) are not compared.
pub fn check_digests(c: &mut dyn Collective, what: &str, digest: Option<u64>) -> Result<()> {
    if c.world_size() == 1 {
        return Ok(());
    }
    let bytes: Vec<u8> = digest
        .map(u64::to_le_bytes)
        .map_or(Vec::new(), |b| b.to_vec());
    let all = all_gather_bytes(c, &bytes)?;
    if all[0].is_empty() {
        return Ok(());
    }
    let bad: Vec<usize> = all
        .iter()
        .enumerate()
        .filter(|(_, b)| !b.is_empty() && **b != all[0])
        .map(|(r, _)| r)
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(Error::Role {
            role: "dist",
            source: format!("{what} differ from rank 0's on ranks {bad:?}").into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_contiguous_and_cover_every_row() {
        for len in 0..9 {
            for world in 1..4 {
                let mut next = 0;
                for r in 0..world {
                    let s = shard_range(len, r, world);
                    assert_eq!(s.start, next);
                    assert!(s.len() == len / world || s.len() == len / world + 1);
                    next = s.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn solo_is_the_identity() {
        let mut solo = Solo;
        let mut v = [1.0, 2.0];
        all_reduce_f64(&mut solo, &mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [1.0, 2.0]);
        let parts = all_gather_bytes(&mut solo, b"abc").unwrap();
        assert_eq!(parts, vec![b"abc".to_vec()]);
        let mut m = BTreeMap::new();
        m.insert("a/max".to_owned(), (3.0, 1.0));
        let r = reduce_metrics(&mut solo, &m, default_reduce).unwrap();
        assert_eq!(r["a/max"], 3.0);
        check_replicas(&mut solo, "weights", &[Tensor::from_slice(&[1.0f32])]).unwrap();
    }

    #[test]
    fn digest_sees_one_bit() {
        let a = Tensor::from_slice(&[1.0f32, 2.0]);
        let b = Tensor::from_slice(&[1.0f32, 2.000_000_2]);
        assert_eq!(
            digest(&[a.shallow_clone()]).unwrap(),
            digest(&[a.copy()]).unwrap()
        );
        assert_ne!(digest(&[a]).unwrap(), digest(&[b]).unwrap());
    }

    #[test]
    fn default_reductions_follow_the_names() {
        assert_eq!(default_reduce("critic/score/max"), MetricReduce::Max);
        assert_eq!(default_reduce("critic/score/min"), MetricReduce::Min);
        assert_eq!(default_reduce("timing_s/gen"), MetricReduce::Max);
        assert_eq!(default_reduce("perf/total_num_tokens"), MetricReduce::Sum);
        assert_eq!(default_reduce("actor/pg_loss"), MetricReduce::Mean);
    }
}
