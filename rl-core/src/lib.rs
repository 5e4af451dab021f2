//! The shared foundation of the workspace: [`Batch`] (verl's `DataProto`), the batch [`keys`],
//! [`shape`] checks, the [`roles`] the trainers program against, the [`Trainer`] seam the harness
//! drives, the multi-turn [`tool::Tool`] seam, the data-parallel seam ([`dist::Collective`]), and the [`Error`] type.
//!
//! ```
//! use rl_core::{Batch, keys};
//! use tch::{Kind, Tensor};
//!
//! let mut batch = Batch::new();
//! batch.insert(keys::RESPONSES, Tensor::zeros([4, 8], (Kind::Int64, tch::Device::Cpu)))?;
//! batch.insert_column(keys::UID, vec!["a".into(), "a".into(), "b".into(), "b".into()])?;
//! let halves = batch.chunk(2)?;
//! assert_eq!(halves[1].column(keys::UID)?, &["b", "b"]);
//! # Ok::<(), rl_core::Error>(())
//! ```

mod batch;
mod cuda_link;
pub mod device_memory;
pub mod dist;
mod error;
pub mod keys;
pub mod roles;
mod save;
pub mod shape;
pub mod tool;
pub mod trainer;

pub use batch::{Batch, MiniBatches};
pub use error::{Error, Result};
pub use roles::Metrics;
pub use tool::{Observation, Tool};
pub use trainer::{Sample, StepMetrics, Trainer, is_wall_clock};
