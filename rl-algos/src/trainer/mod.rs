//! The trainer loops, written against the role traits of rl-core: [`OnPolicyTrainer`] (PPO,
//! GRPO, Dr. GRPO, RLOO, REINFORCE++, GSPO, DAPO), [`SftTrainer`], the preference trainers
//! ([`DpoTrainer`], [`OnlineDpoTrainer`], [`SpinTrainer`]), reward-model training
//! ([`RmTrainer`]) and reward composition ([`CombinedReward`]), the objectives they hand to the
//! actor and critic, their config, and a small metrics-sink interface.

mod async_rollout;
mod config;
mod dp;
mod objective;
mod on_policy;
mod online_dpo;
mod preference;
mod reward;
mod reward_model;
mod sft;
mod source;
mod spin;
mod step_metrics;

pub use config::{
    ActorLossConfig, AsyncTrainingConfig, CriticLossConfig, OnPolicyConfig, TrainerSection,
};
pub use objective::{PolicyLoss, RolloutLoss, SftLoss, ValueLoss};
pub use on_policy::{ACC_COLUMN, OnPolicyTrainer, PROMPT_TEXT_COLUMN, RESPONSE_TEXT_COLUMN, Roles};
pub use online_dpo::{OnlineDpoTrainer, best_worst_pairs};
pub use preference::{
    DpoLoss, DpoTrainer, DpoTrainerConfig, PAIR_INDEX, REF_SEQ_LOG_PROB, mark_pairs,
};
pub use reward::{
    CombinedReward, PART_SCORE_SUFFIX, RewardPart, SCORE_COLUMN, TrainValReward, reward_metrics,
};
pub use reward_model::{BradleyTerryLoss, RM_MARGIN, RmTrainer, RmTrainerConfig};
pub use sft::{SftConfig, SftTrainer};
pub use source::{BatchSource, JsonlSink, MemorySink, MetricsSink, RunOptions, run};
pub use spin::{RefInit, ReferenceFactory, SpinTrainer, interleave_pairs};
