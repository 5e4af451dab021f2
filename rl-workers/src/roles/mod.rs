//! The roles of rl-core implemented on a device: actor, rollout sharing the actor's weights,
//! frozen reference, critic, reward model (scoring and Bradley–Terry training), with their
//! configs and a checkpointable AdamW.
//!
//! A worker never knows which algorithm trains it: the loss arrives as an
//! [`rl_core::roles::PolicyObjective`] / [`rl_core::roles::ValueObjective`].

mod actor;
mod background;
mod config;
mod critic;
mod micro;
mod optim;
mod reward_model;
pub mod zero;

pub use actor::{ActorWorker, ProgressHook, ReferenceWorker, RolloutWorker, SharedPolicy, share};
pub use background::BackgroundWorker;
pub use config::{
    ActorConfig, CriticConfig, LrSchedule, MixedPrecision, OptimConfig, ParamDtype, ValKwargs,
};
pub use critic::CriticWorker;
pub use micro::token_balanced_partitions;
pub use optim::{AdamW, OptimCounters};
pub use reward_model::{
    RewardModelConfig, RewardModelWorker, RmWorker, RmWorkerConfig, reward_model_from_lm,
    reward_model_from_lm_stack_in,
};
pub use zero::ZeroStage;

/// Wraps an rl-workers error as the `rl_core::Error::Role` of `role`.
pub(crate) fn role_err(role: &'static str) -> impl Fn(crate::Error) -> rl_core::Error {
    move |e| rl_core::Error::Role {
        role,
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests;
