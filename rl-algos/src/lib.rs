//! The math of RL post-training: advantages, KL penalties, policy, value and DPO losses.
//!
//! Loss aggregation lives here too, and the trainer loops written against the role traits of
//! `rl-core` ([`trainer`]).
//!
//! The math is pure tensor code: no IO, deterministic given its inputs and seed (the trainers
//! write their own `trainer_state.json` into a checkpoint folder, nothing else).
//! Each function matches a named verl function (its doc says which) value for value and, for
//! the losses, gradient for gradient; the parity fixtures under `tests/fixtures/` pin that.
//!
//! The namespaces users spell:
//! - [`masked`]: masked sum, mean, variance and whitening with verl's epsilons
//! - [`logits`]: log-probs of given tokens and entropy from logits, in memory-bounded chunks
//! - [`agg`]: `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean`,
//!   `seq-mean-token-sum-norm`, with global normalisers for micro-batch accumulation
//! - [`advantage`]: GAE, GRPO (and Dr. GRPO), RLOO, REINFORCE++ (and its baseline variant),
//!   ReMax, OPO, GPG, GRPO pass@k
//! - [`kl`]: k1 / abs / k2 / k3 and straight-through variants, KL controllers, KL-in-reward
//! - [`loss`]: PPO clip (clip-higher, dual-clip), GSPO, SAPO, GPG, Clip-Cov, KL-Cov, GMPO,
//!   CISPO, REINFORCE; value loss; entropy loss
//! - [`dpo`]: DPO (sigmoid, IPO, hinge, reference-free), online-DPO pairs, sequence log-probs,
//!   SPPO
//! - [`dapo`]: overlong reward shaping and the dynamic-sampling group filter
//! - [`rm`]: the Bradley–Terry reward-model loss (TRL's `RewardTrainer`)
//! - [`trainer`]: [`trainer::OnPolicyTrainer`], [`trainer::SftTrainer`], their objectives and config
//!
//! Mutually exclusive choices are enums whose serde names are verl's config strings; the
//! config groups are [`AlgoConfig`] (verl's `algorithm`) and [`PolicyLossConfig`] (the policy
//! loss keys of verl's `actor`).
//!
//! One GRPO step's math, from rewards to the loss that is back-propagated:
//!
//! ```
//! use rl_algos::{advantage, loss, GlobalBatchInfo, PolicyLossConfig};
//! use tch::{Device, Kind, Tensor};
//!
//! // two prompts, two responses each, three response tokens; the last response is shorter
//! let opts = (Kind::Float, Device::Cpu);
//! let rewards = Tensor::from_slice(&[0f32, 0., 1., 0., 0., 0., 0., 0., 1., 0., 0., 0.]).view([4, 3]);
//! let mask = Tensor::from_slice(&[1f32, 1., 1., 1., 1., 1., 1., 1., 1., 1., 1., 0.]).view([4, 3]);
//! let uids = advantage::group_index(&["p0", "p0", "p1", "p1"]);
//! let (advantages, _returns) = advantage::grpo(&rewards, &mask, &uids, true, advantage::EPSILON)?;
//!
//! let old_log_prob = Tensor::full([4, 3], -1.0, opts);
//! let log_prob = (&old_log_prob + 0.1).set_requires_grad(true);
//! let inputs = loss::PolicyLossInputs {
//!     old_log_prob: &old_log_prob,
//!     log_prob: &log_prob,
//!     advantages: &advantages,
//!     response_mask: &mask,
//!     rollout_is_weights: None,
//! };
//! let cfg = PolicyLossConfig { clip_ratio_high: Some(0.28), ..Default::default() };
//! let out = loss::ppo_clip(&inputs, &cfg, &GlobalBatchInfo::local())?;
//! out.loss.backward();
//! assert_eq!(out.metrics.pg_clipfrac, Some(0.0)); // exp(0.1) is inside [0.8, 1.28]
//! assert_eq!(log_prob.grad().size(), [4, 3]);
//! # Ok::<(), rl_algos::Error>(())
//! ```

mod check;
mod config;
mod error;

pub mod advantage;
pub mod agg;
pub mod dapo;
pub mod dpo;
pub mod kl;
pub mod logits;
pub mod loss;
pub mod masked;
pub mod rm;
pub mod rollout_corr;
pub mod trainer;

pub use agg::{GlobalBatchInfo, LossAggMode};
pub use config::{
    AdvEstimator, AlgoConfig, FilterGroupsConfig, KlCtrlConfig, KlCtrlType, KlEstimator, KlPenalty,
};
pub use dapo::OverlongBufferConfig;
pub use dpo::{DpoConfig, DpoLossType};
pub use error::{Error, Result};
pub use kl::KlController;
pub use loss::{PolicyLossConfig, PolicyLossMode, PolicyLossParams};
