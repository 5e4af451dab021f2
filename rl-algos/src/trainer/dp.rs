//! Data parallelism shared by the trainers: the group checks, metric reduction and replica
//! check of the single-model trainers (SFT, DPO, the reward model), and the re-sharing of rows the ranks kept in
//! unequal numbers (online DPO's pairs, DAPO's dynamically sampled groups).

use std::collections::BTreeMap;

use rl_core::dist::{self, Collective, SharedCollective};
use rl_core::roles::Actor;
use rl_core::{Batch, StepMetrics, keys};
use serde_json::Value;
use tch::Tensor;

/// A data-parallel group attached to a trainer, with the checks done once.
pub(crate) struct Dp {
    pub(crate) group: SharedCollective,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// Whether the ranks' weights have been compared (after the first step).
    pub(crate) replicas_checked: bool,
}

impl std::fmt::Debug for Dp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dp")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

fn err(reason: String) -> rl_core::Error {
    rl_core::Error::Role {
        role: "trainer",
        source: reason.into(),
    }
}

impl Dp {
    /// Checks that `actor` averages its gradients over the group's ranks and that the global
    /// batch `batch_key` (`batch` rows or pairs) splits over them.
    ///
    /// `val` are the trainer's validation batches: with an actor whose forwards are collectives
    /// (ZeRO stage 3) each must give every rank an item ([`check_val_shards`]).
    pub(crate) fn new(
        group: SharedCollective,
        actor: &dyn Actor,
        batch_key: &str,
        batch: usize,
        val: ValBatches<'_>,
    ) -> rl_core::Result<Self> {
        let dp = Self::for_role(
            group,
            "actor",
            actor.data_parallel_ranks(),
            batch_key,
            batch,
        )?;
        check_val_shards(actor, val.batches, val.per, dp.world, val.key)?;
        Ok(dp)
    }

    /// [`new`](Self::new) for any trained role: `ranks` is the number of ranks the `role`
    /// averages its gradients over (`Actor::data_parallel_ranks`,
    /// `Critic::data_parallel_ranks`).
    pub(crate) fn for_role(
        group: SharedCollective,
        role: &str,
        ranks: usize,
        batch_key: &str,
        batch: usize,
    ) -> rl_core::Result<Self> {
        let (rank, world) = {
            let g = dist::lock(&group)?;
            (g.rank(), g.world_size())
        };
        if !batch.is_multiple_of(world) {
            return Err(err(format!(
                "{batch_key}: {batch} do not split over {world} data-parallel ranks (it is the \
                 global batch; make it a multiple of the world size)"
            )));
        }
        if ranks != world {
            return Err(err(format!(
                "the {role} role averages gradients over {ranks} rank(s) but the trainer's group \
                 has {world}: build it with `with_group` on the same group"
            )));
        }
        Ok(Dp {
            group,
            rank,
            world,
            replicas_checked: false,
        })
    }

    /// Combines a step's metrics over the ranks, the same on every rank: means weighted by the
    /// rank's `rows`, `*/max` and timings by maximum, `*/min` by minimum.
    pub(crate) fn reduce(&self, m: StepMetrics, rows: f64) -> rl_core::Result<StepMetrics> {
        if self.world == 1 {
            return Ok(m);
        }
        let local = m.into_iter().map(|(k, v)| (k, (v, rows))).collect();
        dist::reduce_metrics(&mut *dist::lock(&self.group)?, &local, dist::default_reduce)
    }

    /// After the first step: fails naming the ranks whose actor weights differ from rank 0's.
    pub(crate) fn check_replicas_once(&mut self, actor: &dyn Actor) -> rl_core::Result<()> {
        self.check_digests_once("actor weights", || actor.weights_digest())
    }

    /// After the first step: fails naming the ranks whose `what` (the digest `digest` computes)
    /// differ from rank 0's.
    pub(crate) fn check_digests_once(
        &mut self,
        what: &str,
        digest: impl FnOnce() -> rl_core::Result<Option<u64>>,
    ) -> rl_core::Result<()> {
        if self.replicas_checked || self.world == 1 {
            return Ok(());
        }
        let digest = digest()?;
        dist::check_digests(&mut *dist::lock(&self.group)?, what, digest)?;
        self.replicas_checked = true;
        Ok(())
    }

    /// Sums `values` over the ranks in place.
    pub(crate) fn sum(&self, values: &mut [f64]) -> rl_core::Result<()> {
        dist::all_reduce_f64(&mut *dist::lock(&self.group)?, values, dist::ReduceOp::Sum)
    }
}

/// `(prompt_width, response_width)`: the widths of `batch`'s `prompts` and `responses`.
fn layout_widths(batch: &Batch) -> rl_core::Result<(i64, i64)> {
    let width = |key: &str| -> rl_core::Result<i64> {
        let t = batch.get(key)?;
        match t.size()[..] {
            [_, w] => Ok(w),
            _ => Err(rl_core::Error::Shape {
                key: key.into(),
                expected: "[batch, width]".into(),
                got: t.size(),
            }),
        }
    };
    Ok((width(keys::PROMPTS)?, width(keys::RESPONSES)?))
}

/// A trainer's validation batches, for [`Dp::new`]: `per` rows make one item (1 for prompts
/// or rows, 2 for pairs), and `key` is the setting that sizes the batches.
pub(crate) struct ValBatches<'a> {
    pub(crate) batches: &'a [Batch],
    pub(crate) per: usize,
    pub(crate) key: &'static str,
}

impl<'a> ValBatches<'a> {
    /// Batches of rows or prompts sized by `data.val_batch_size`.
    pub(crate) fn rows(batches: &'a [Batch]) -> Self {
        ValBatches {
            batches,
            per: 1,
            key: "data.val_batch_size",
        }
    }
}

/// With an actor whose every forward is a collective (ZeRO stage 3), every validation batch
/// must give each of the `world` ranks at least one item (`per` rows each: 1 for prompts or
/// rows, 2 for pairs): a rank left without any would skip forwards the others wait in. Errors
/// naming `key`, the setting that sizes the validation batches.
pub(crate) fn check_val_shards(
    actor: &dyn Actor,
    val: &[Batch],
    per: usize,
    world: usize,
    key: &'static str,
) -> rl_core::Result<()> {
    if !actor.forwards_are_collective() {
        return Ok(());
    }
    match val.iter().position(|b| b.len() / per < world) {
        None => Ok(()),
        Some(i) => Err(rl_core::Error::InvalidArgument {
            name: key,
            reason: format!(
                "at actor_rollout_ref.actor.zero_stage = 3 every forward runs on all ranks together, but validation batch {i} holds {} item(s) for {world} ranks, which leaves a rank none: make every validation batch at least {world} (or use zero_stage 2)",
                val[i].len() / per
            ),
        }),
    }
}

/// `batch` with its prompts left-padded (0, mask 0) to `prompt_width` and its responses
/// right-padded (0, mask 0; positions go on past the last one, as the rollout writes them) to
/// `response_width`. Which side a 2-D tensor pads on follows from its width: `prompts` on the
/// left, a sequence (`prompt_len + response_len`: ids, masks, positions, `loss_mask`) on both
/// sides, a response-wide tensor (`responses`, `response_mask`, scores) on the right; other
/// tensors and the columns are kept as they are.
///
/// # Shapes
/// - `batch`: rollout layout, `[batch, prompt_len]` prompts and `[batch, response_len]`
///   responses, no wider than the widths
/// - returns: `[batch, prompt_width]` prompts, `[batch, response_width]` responses,
///   `[batch, prompt_width + response_width]` sequences
pub(crate) fn pad_to_widths(
    batch: &Batch,
    prompt_width: i64,
    response_width: i64,
) -> rl_core::Result<Batch> {
    let (p, r) = layout_widths(batch)?;
    let (left, right) = (prompt_width - p, response_width - r);
    if left < 0 || right < 0 {
        return Err(err(format!(
            "cannot pad [{p} prompt, {r} response] columns to narrower widths \
             [{prompt_width}, {response_width}]"
        )));
    }
    let mut out = batch.shallow_clone();
    if left == 0 && right == 0 {
        return Ok(out);
    }
    for k in batch.tensor_keys() {
        let t = batch.get(k)?;
        let (l, rt) = match t.size()[..] {
            _ if k == keys::PROMPTS => (left, 0),
            [_, w] if w == p + r => (left, right),
            [_, w] if w == r => (0, right),
            _ => continue,
        };
        let rows = t.size()[0];
        let zeros = |w: i64| Tensor::zeros([rows, w], (t.kind(), t.device()));
        let mut parts = Vec::new();
        if l > 0 {
            parts.push(zeros(l));
        }
        parts.push(t.shallow_clone());
        if rt > 0 {
            if k == keys::POSITION_IDS {
                // positions go on past the last one, as the rollout writes them
                let last = t.narrow(1, t.size()[1] - 1, 1);
                let step = Tensor::arange_start(1, rt + 1, (t.kind(), t.device())).unsqueeze(0);
                parts.push(last + step);
            } else {
                parts.push(zeros(rt));
            }
        }
        out.insert(k, Tensor::cat(&parts, 1))?;
    }
    Ok(out)
}

/// The widest prompts and responses of `parts` on every rank: `(prompt_width, response_width)`,
/// the same on every rank.
pub(crate) fn global_widths(
    c: &mut dyn Collective,
    parts: &[Batch],
) -> rl_core::Result<(i64, i64)> {
    let mut widths = [0.0f64; 2];
    for part in parts {
        let (p, r) = layout_widths(part)?;
        widths[0] = widths[0].max(p as f64);
        widths[1] = widths[1].max(r as f64);
    }
    dist::all_reduce_f64(c, &mut widths, dist::ReduceOp::Max)?;
    Ok((widths[0] as i64, widths[1] as i64))
}

/// Every rank's rows of `local` (every tensor and every column), in rank order; the meta is
/// this rank's. The ranks must hold the same keys (an error names the first rank that does
/// not) and equal widths where a tensor's rows are sequences (pad them with [`pad_to_widths`]
/// first); other 2-D tensors are right-padded with zeros to the widest.
pub(crate) fn gather_batch(c: &mut dyn Collective, local: &Batch) -> rl_core::Result<Batch> {
    if c.world_size() == 1 {
        return Ok(local.shallow_clone());
    }
    let names: Vec<String> = local
        .tensor_keys()
        .map(|k| format!("tensor {k}"))
        .chain(local.column_keys().map(|k| format!("column {k}")))
        .collect();
    let all = dist::all_gather_bytes(c, names.join("\n").as_bytes())?;
    if let Some(r) = all.iter().position(|b| *b != all[0]) {
        return Err(err(format!(
            "rank {r} holds other batch keys than rank 0 ({:?} vs {:?}): the ranks' batches \
             cannot be gathered",
            String::from_utf8_lossy(&all[r]),
            String::from_utf8_lossy(&all[0]),
        )));
    }
    let mut out = Batch::new();
    for k in local.tensor_keys() {
        out.insert(k, dist::gather_rows(c, local.get(k)?)?)?;
    }
    let columns: BTreeMap<&str, &[Value]> = local
        .column_keys()
        .map(|k| Ok((k, local.column(k)?)))
        .collect::<rl_core::Result<_>>()?;
    let bytes = serde_json::to_vec(&columns).map_err(|e| err(e.to_string()))?;
    let mut joined: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for part in dist::all_gather_bytes(c, &bytes)? {
        let part: BTreeMap<String, Vec<Value>> =
            serde_json::from_slice(&part).map_err(|e| err(e.to_string()))?;
        for (k, v) in part {
            joined.entry(k).or_default().extend(v);
        }
    }
    for (k, v) in joined {
        out.insert_column(k, v)?;
    }
    out.meta_info_mut().extend(local.meta_info().clone());
    Ok(out)
}

/// Row indices into the rank-ordered gather of every rank's rounds (rank 0's rounds, then rank
/// 1's, ...) that put the rows in global order (round by round, ranks in order within a
/// round, as one process would have concatenated them), keep the first `take`, and of those
/// this rank's contiguous share (`dist::shard_range`). `counts[round][rank]` are the rows.
fn global_order(counts: &[Vec<usize>], take: usize, rank: usize, world: usize) -> Vec<i64> {
    let per_rank: Vec<usize> = (0..world)
        .map(|r| counts.iter().map(|c| c[r]).sum())
        .collect();
    let mut start: Vec<usize> = (0..world).map(|r| per_rank[..r].iter().sum()).collect();
    let mut order = Vec::new();
    for round in counts {
        for r in 0..world {
            order.extend((start[r]..start[r] + round[r]).map(|i| i as i64));
            start[r] += round[r];
        }
    }
    order.truncate(take);
    order[dist::shard_range(order.len(), rank, world)].to_vec()
}

/// Rows each rank kept over several rounds (`rounds`, the same number on every rank, each
/// padded here to the widths of all of them), re-shared so that every rank holds its
/// contiguous share of the first `take` rows in global order: the rows one process would
/// have kept by concatenating every round's rows (ranks in order within a round) and taking
/// the first `take`. With one rank this is that concatenation. DAPO's dynamic sampling under
/// data parallelism.
pub(crate) fn share_rounds(
    c: &mut dyn Collective,
    rounds: &[Batch],
    take: usize,
) -> rl_core::Result<Batch> {
    let (rank, world) = (c.rank(), c.world_size());
    let (pw, rw) = global_widths(c, rounds)?;
    let padded = rounds
        .iter()
        .map(|b| pad_to_widths(b, pw, rw))
        .collect::<rl_core::Result<Vec<_>>>()?;
    let local = Batch::concat(&padded)?;
    let mut flat = vec![0.0; rounds.len() * world];
    for (i, b) in rounds.iter().enumerate() {
        flat[i * world + rank] = b.len() as f64;
    }
    dist::all_reduce_f64(c, &mut flat, dist::ReduceOp::Sum)?;
    let counts: Vec<Vec<usize>> = flat
        .chunks(world)
        .map(|c| c.iter().map(|&n| n as usize).collect())
        .collect();
    let all = gather_batch(c, &local)?;
    let total = all.len();
    if take > total {
        return Err(err(format!(
            "{take} rows to share but the ranks kept {total}"
        )));
    }
    all.reorder(&global_order(&counts, take, rank, world))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_are_taken_in_global_order_and_shared_contiguously() {
        // rank 0 kept 2 then 4 rows, rank 1 kept 2 then 2: gathered as [r0: 0 1 | 2 3 4 5,
        // r1: 6 7 | 8 9]; one process would have [0 1 6 7] then [2 3 4 5 8 9]
        let counts = vec![vec![2, 2], vec![4, 2]];
        assert_eq!(global_order(&counts, 8, 0, 2), vec![0, 1, 6, 7]);
        assert_eq!(global_order(&counts, 8, 1, 2), vec![2, 3, 4, 5]);
        assert_eq!(
            global_order(&[vec![2], vec![4]], 5, 0, 1),
            vec![0, 1, 2, 3, 4]
        );
        // a rank that kept nothing in a round
        let counts = vec![vec![0, 2], vec![2, 0]];
        assert_eq!(global_order(&counts, 4, 0, 2), vec![2, 3]);
        assert_eq!(global_order(&counts, 4, 1, 2), vec![0, 1]);
    }

    fn rollout(prompt: &[i64], response: &[i64], rows: i64) -> Batch {
        let mut b = Batch::new();
        let (p, r) = (prompt.len() as i64, response.len() as i64);
        let p_t = Tensor::from_slice(prompt).repeat([rows, 1]);
        let r_t = Tensor::from_slice(response).repeat([rows, 1]);
        b.insert(keys::PROMPTS, p_t.shallow_clone()).unwrap();
        b.insert(keys::RESPONSES, r_t.shallow_clone()).unwrap();
        b.insert(keys::INPUT_IDS, Tensor::cat(&[p_t, r_t], 1))
            .unwrap();
        b.insert(
            keys::POSITION_IDS,
            Tensor::arange(p + r, (tch::Kind::Int64, tch::Device::Cpu)).repeat([rows, 1]),
        )
        .unwrap();
        b.insert(
            keys::RESPONSE_MASK,
            Tensor::ones([rows, r], (tch::Kind::Float, tch::Device::Cpu)),
        )
        .unwrap();
        b.insert(
            "row",
            Tensor::arange(rows, (tch::Kind::Int64, tch::Device::Cpu)),
        )
        .unwrap();
        b.insert_column("uid", (0..rows).map(|i| i.into()).collect())
            .unwrap();
        b
    }

    #[test]
    fn padding_follows_each_tensors_width() {
        let b = pad_to_widths(&rollout(&[5, 6], &[7], 1), 3, 2).unwrap();
        let row = |k: &str| Vec::<i64>::try_from(b.get(k).unwrap().get(0)).unwrap();
        assert_eq!(row(keys::PROMPTS), vec![0, 5, 6]);
        assert_eq!(row(keys::RESPONSES), vec![7, 0]);
        assert_eq!(row(keys::INPUT_IDS), vec![0, 5, 6, 7, 0]);
        assert_eq!(row(keys::POSITION_IDS), vec![0, 0, 1, 2, 3]);
        assert_eq!(
            Vec::<f32>::try_from(b.get(keys::RESPONSE_MASK).unwrap().get(0)).unwrap(),
            vec![1.0, 0.0]
        );
        assert_eq!(b.get("row").unwrap().size(), vec![1]);
        assert!(pad_to_widths(&b, 2, 2).is_err());
    }

    #[test]
    fn one_rank_concatenates_the_rounds_at_common_widths() {
        let rounds = [
            rollout(&[5], &[7, 8], 2),
            rollout(&[5, 6], &[7], 0),
            rollout(&[5, 6, 4], &[7], 3),
        ];
        let b = share_rounds(&mut dist::Solo, &rounds, 4).unwrap();
        assert_eq!(b.len(), 4);
        assert_eq!(b.get(keys::INPUT_IDS).unwrap().size(), vec![4, 5]);
        assert_eq!(
            Vec::<i64>::try_from(b.get("row").unwrap()).unwrap(),
            vec![0, 1, 0, 1]
        );
        assert!(share_rounds(&mut dist::Solo, &rounds, 6).is_err());
    }
}
