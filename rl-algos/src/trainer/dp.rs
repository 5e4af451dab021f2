//! Data parallelism for the single-actor trainers (SFT, offline DPO): the group checks, the
//! metric reduction and the replica check they share with the on-policy trainer's rules.

use rl_core::StepMetrics;
use rl_core::dist::{self, SharedCollective};
use rl_core::roles::Actor;

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
    pub(crate) fn new(
        group: SharedCollective,
        actor: &dyn Actor,
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
        let ranks = actor.data_parallel_ranks();
        if ranks != world {
            return Err(err(format!(
                "the actor role averages gradients over {ranks} rank(s) but the trainer's group \
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
        if self.replicas_checked || self.world == 1 {
            return Ok(());
        }
        let digest = actor.weights_digest()?;
        dist::check_digests(&mut *dist::lock(&self.group)?, "actor weights", digest)?;
        self.replicas_checked = true;
        Ok(())
    }

    /// Sums `values` over the ranks in place.
    pub(crate) fn sum(&self, values: &mut [f64]) -> rl_core::Result<()> {
        dist::all_reduce_f64(&mut *dist::lock(&self.group)?, values, dist::ReduceOp::Sum)
    }
}
