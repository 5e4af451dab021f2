//! [`rl_core::dist::Collective`] for [`ProcessGroup`]: how the workers and trainers, which know
//! only rl-core's trait, reach c10d.

use std::time::Duration;

use rl_core::dist::{Collective, Pending, ReduceOp as CoreOp, SharedCollective};
use tch::Tensor;

use crate::error::Result;
use crate::group::{ProcessGroup, ReduceOp};

/// Joins the group torchrun's environment describes ([`ProcessGroup::from_env`]) and wraps it
/// for the roles and the trainer of this rank; `None` when `WORLD_SIZE` is not set, i.e. a plain
/// one-process run (with `WORLD_SIZE` set, even to 1, the group is created as torchrun asks).
pub fn shared_from_env(timeout: Duration) -> Result<Option<SharedCollective>> {
    if std::env::var_os("WORLD_SIZE").is_none() {
        return Ok(None);
    }
    Ok(Some(rl_core::dist::share(ProcessGroup::from_env(timeout)?)))
}

fn op(o: CoreOp) -> ReduceOp {
    match o {
        CoreOp::Sum => ReduceOp::Sum,
        CoreOp::Avg => ReduceOp::Avg,
        CoreOp::Max => ReduceOp::Max,
        CoreOp::Min => ReduceOp::Min,
    }
}

/// An rl-dist error as the `rl_core::Error::Role` of `dist` (the message names the rank and
/// the operation).
fn core_err(e: crate::Error) -> rl_core::Error {
    rl_core::Error::Role {
        role: "dist",
        source: Box::new(e),
    }
}

impl Collective for ProcessGroup {
    fn rank(&self) -> usize {
        ProcessGroup::rank(self)
    }

    fn world_size(&self) -> usize {
        ProcessGroup::world_size(self)
    }

    fn all_reduce(&mut self, tensors: &mut [Tensor], o: CoreOp) -> rl_core::Result<()> {
        self.all_reduce_many(tensors, op(o)).map_err(core_err)
    }

    fn all_gather(&mut self, tensor: &Tensor) -> rl_core::Result<Vec<Tensor>> {
        ProcessGroup::all_gather(self, tensor).map_err(core_err)
    }

    fn broadcast(&mut self, tensor: &mut Tensor, src: usize) -> rl_core::Result<()> {
        ProcessGroup::broadcast(self, tensor, src).map_err(core_err)
    }

    fn barrier(&mut self) -> rl_core::Result<()> {
        ProcessGroup::barrier(self).map_err(core_err)
    }

    fn reduce_scatter(&mut self, input: &Tensor, o: CoreOp) -> rl_core::Result<Tensor> {
        ProcessGroup::reduce_scatter(self, input, op(o)).map_err(core_err)
    }

    fn all_gather_flat(&mut self, input: &Tensor) -> rl_core::Result<Tensor> {
        ProcessGroup::all_gather_flat(self, input).map_err(core_err)
    }

    fn all_gather_flat_start(&mut self, input: &Tensor) -> rl_core::Result<Pending> {
        let pending = ProcessGroup::all_gather_flat_start(self, input).map_err(core_err)?;
        Ok(Pending::new(move || pending.wait().map_err(core_err)))
    }
}
