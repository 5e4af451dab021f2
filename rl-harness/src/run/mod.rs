//! Running an experiment: composing the trainer the config names ([`compose`]), driving it step
//! by step with metrics, validation and exact checkpoint/resume ([`train`], [`checkpoint`]), as
//! one process or as a rank of a data-parallel group ([`rank`]), and the launcher that starts
//! the ranks on this machine ([`launch`]).
//!
//! Inside, `launch` uses `train`, which uses `compose`, `checkpoint` and `rank`; `rank` (what a
//! process is part of, and the launcher–rank contract) uses none of them. The folder uses
//! `config`, `store`, `integrations` and the crate's leaves, never `analysis` or `cli`.

pub mod checkpoint;
pub mod compose;
pub mod launch;
pub mod rank;
pub mod train;
