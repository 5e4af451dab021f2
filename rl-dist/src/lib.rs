//! Data-parallel collectives over PyTorch's own c10d: rendezvous through `TCPStore`, Gloo on CPU and
//! NCCL on CUDA, initialised from the torchrun environment.
//!
//! ```no_run
//! use std::time::Duration;
//! use rl_dist::{ProcessGroup, ReduceOp};
//!
//! // Started by torchrun (or `harness train --nproc-per-node N`): RANK, WORLD_SIZE, ... are set.
//! let mut pg = ProcessGroup::from_env(Duration::from_secs(300))?;
//! let mut grads = vec![tch::Tensor::ones([3], (tch::Kind::Float, tch::Device::Cpu))];
//! pg.all_reduce_many(&mut grads, ReduceOp::Avg)?;
//! # Ok::<(), rl_dist::Error>(())
//! ```
//!
//! `ProcessGroup` implements [`rl_core::dist::Collective`], the trait the workers and trainers
//! take, so they data-parallelise without depending on this crate.
//!
//! See the crate's README for the launcher contract.

mod collective;
mod error;
mod ffi;
mod group;

pub use collective::shared_from_env;
pub use error::{Error, Result};
pub use group::{
    Backend, DEFAULT_BUCKET_BYTES, ENV_VARS, InitOptions, PendingGather, ProcessGroup, ReduceOp,
};
