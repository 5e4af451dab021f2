//! The trainer's config: the loss keys of verl's `actor` and `critic` groups, verl's `trainer`
//! group, and [`OnPolicyConfig`], the checked plan an [`OnPolicyTrainer`](super::OnPolicyTrainer)
//! runs, composed from the crates' config groups by whoever reads the experiment file.

use serde::{Deserialize, Serialize};

use crate::agg::LossAggMode;
use crate::config::{AdvEstimator, AlgoConfig, KlPenalty};
use crate::dapo::OverlongBufferConfig;
use crate::error::{Error, Result};
use crate::loss::{PolicyLossConfig, PolicyLossMode, PolicyLossParams};

/// The loss keys of verl's `actor_rollout_ref.actor` group (the worker keys — optimiser,
/// mini/micro-batch sizes, clipping — are rl-workers' `ActorConfig`), with verl's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActorLossConfig {
    /// PPO's clip range. Default 0.2.
    pub clip_ratio: f64,
    /// Lower clip range; absent = `clip_ratio`.
    pub clip_ratio_low: Option<f64>,
    /// Upper clip range (DAPO's clip-higher); absent = `clip_ratio`.
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip bound, > 1. Default 3.0.
    pub clip_ratio_c: f64,
    /// Loss aggregation. Default `token-mean`.
    pub loss_agg_mode: LossAggMode,
    /// Divisor of `seq-mean-token-sum-norm`; absent = the response length.
    pub loss_scale_factor: Option<f64>,
    /// The policy loss and its parameters.
    pub policy_loss: PolicyLossParams,
    /// SAPO (`policy_loss.loss_mode = "sapo"`): the gate's temperature where the advantage is
    /// positive, > 0. Default 1.0.
    pub tau_pos: f64,
    /// SAPO: the gate's temperature where the advantage is not positive, > 0. Default 1.05.
    pub tau_neg: f64,
    /// Entropy bonus coefficient (the loss subtracts `entropy_coeff * entropy`). Default 0.
    pub entropy_coeff: f64,
    /// Add `kl_loss_coef * KL(policy || reference)` to the loss (GRPO). Default false.
    pub use_kl_loss: bool,
    /// Coefficient of the KL loss, >= 0. Default 0.001.
    pub kl_loss_coef: f64,
    /// KL estimator of the KL loss. Default `low_var_kl`.
    pub kl_loss_type: KlPenalty,
    /// Compute `Σπ²` per token with the old log-probs (verl's switch; the optimal token
    /// baselines need it). Absent = exactly when the advantage estimator needs it; false with
    /// such an estimator is an error.
    pub calculate_sum_pi_squared: Option<bool>,
}

impl Default for ActorLossConfig {
    fn default() -> Self {
        let p = PolicyLossConfig::default();
        ActorLossConfig {
            clip_ratio: p.clip_ratio,
            clip_ratio_low: p.clip_ratio_low,
            clip_ratio_high: p.clip_ratio_high,
            clip_ratio_c: p.clip_ratio_c,
            loss_agg_mode: p.loss_agg_mode,
            loss_scale_factor: p.loss_scale_factor,
            policy_loss: p.policy_loss,
            tau_pos: p.tau_pos,
            tau_neg: p.tau_neg,
            entropy_coeff: 0.0,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: KlPenalty::LowVarKl,
            calculate_sum_pi_squared: None,
        }
    }
}

impl ActorLossConfig {
    /// The keys of this group, for a composer splitting verl's `actor` table.
    pub const FIELDS: &'static [&'static str] = &[
        "clip_ratio",
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "loss_agg_mode",
        "loss_scale_factor",
        "policy_loss",
        "tau_pos",
        "tau_neg",
        "entropy_coeff",
        "use_kl_loss",
        "kl_loss_coef",
        "kl_loss_type",
        "calculate_sum_pi_squared",
    ];

    /// The policy-loss part.
    pub fn policy_loss_config(&self) -> PolicyLossConfig {
        PolicyLossConfig {
            clip_ratio: self.clip_ratio,
            clip_ratio_low: self.clip_ratio_low,
            clip_ratio_high: self.clip_ratio_high,
            clip_ratio_c: self.clip_ratio_c,
            loss_agg_mode: self.loss_agg_mode,
            loss_scale_factor: self.loss_scale_factor,
            policy_loss: self.policy_loss,
            tau_pos: self.tau_pos,
            tau_neg: self.tau_neg,
        }
    }
}

/// The loss keys of verl's `critic` group.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriticLossConfig {
    /// Value clip range around the rollout-time values, >= 0. Default 0.5.
    pub cliprange_value: f64,
    /// Loss aggregation. Default `token-mean`.
    pub loss_agg_mode: LossAggMode,
}

impl Default for CriticLossConfig {
    fn default() -> Self {
        CriticLossConfig {
            cliprange_value: 0.5,
            loss_agg_mode: LossAggMode::TokenMean,
        }
    }
}

/// verl's `trainer` group (the keys a trainer reads; the harness owns the rest).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerSection {
    /// Epochs over the training set, used when `total_training_steps` is absent. Default 30.
    pub total_epochs: usize,
    /// Training steps; absent = `total_epochs * batches per epoch`.
    pub total_training_steps: Option<u64>,
    /// Validate every this many steps; -1 = never. Default -1.
    pub test_freq: i64,
    /// Validate before the first step. Default true.
    pub val_before_train: bool,
    /// Generations logged as samples per validation. Default 0.
    pub log_val_generations: usize,
    /// Steps during which only the critic is updated. Default 0.
    pub critic_warmup: u64,
    /// Checkpoint every this many steps; -1 = never (read by the harness). Default -1.
    pub save_freq: i64,
}

impl Default for TrainerSection {
    fn default() -> Self {
        TrainerSection {
            total_epochs: 30,
            total_training_steps: None,
            test_freq: -1,
            val_before_train: true,
            log_val_generations: 0,
            critic_warmup: 0,
            save_freq: -1,
        }
    }
}

/// The `async_training` group: rollout beside the update (verl's one-step off-policy and
/// bounded-staleness modes). A background thread generates the next steps' batches on its own
/// copy of the policy while the actor trains; the batch of step `t` is generated with the
/// weights after step `max(0, t - max_staleness)`, never older: the trainer waits for it rather
/// than drop it, so the staleness of every sample is fixed by the step and a run repeats (and
/// resumes) exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AsyncTrainingConfig {
    /// Generate in the background thread (false: generate in the step, the synchronous loop).
    /// Default false.
    pub enable: bool,
    /// How many policy versions old a sample may be: 0 generates each step's batch with the
    /// current weights (the synchronous run, through the background thread), 1 is verl's
    /// one-step off-policy, K the bounded-staleness mode. Default 1.
    pub max_staleness: u64,
    /// Intra-op CPU threads of the background rollout; 0 = as many as the trainer's, so it
    /// generates exactly what the synchronous rollout would (another count may round
    /// differently). On a CPU with few cores, 1 keeps the two threads' OpenMP teams from
    /// slowing each other (docs/async.md). Default 0.
    pub rollout_threads: u32,
}

impl Default for AsyncTrainingConfig {
    fn default() -> Self {
        AsyncTrainingConfig {
            enable: false,
            max_staleness: 1,
            rollout_threads: 0,
        }
    }
}

/// Everything [`OnPolicyTrainer`](super::OnPolicyTrainer) needs, composed from verl's groups:
/// `algorithm`, the loss keys of `actor_rollout_ref.actor` and `critic`, the sizes that must
/// agree across groups, and `trainer`. [`check`](Self::check) names the verl key at fault.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnPolicyConfig {
    /// verl's `algorithm`.
    pub algorithm: AlgoConfig,
    /// The loss keys of `actor_rollout_ref.actor`.
    pub actor: ActorLossConfig,
    /// The loss keys of `critic`.
    pub critic: CriticLossConfig,
    /// verl's `trainer`.
    pub trainer: TrainerSection,
    /// `data.train_batch_size`: prompts per step.
    pub train_batch_size: usize,
    /// `actor_rollout_ref.rollout.n`: responses per prompt.
    pub rollout_n: usize,
    /// `actor_rollout_ref.rollout.temperature` (log-probs are computed at it).
    pub temperature: f64,
    /// `actor_rollout_ref.rollout.response_length` (= `data.max_response_length`).
    pub max_response_length: i64,
    /// `data.max_prompt_length`: a prompt of this length may have been truncated
    /// (`prompt_length/clip_ratio`).
    pub max_prompt_length: i64,
    /// `actor_rollout_ref.actor.ppo_mini_batch_size`: prompts per actor mini-batch.
    pub actor_ppo_mini_batch_size: usize,
    /// `critic.ppo_mini_batch_size`: prompts per critic mini-batch.
    pub critic_ppo_mini_batch_size: usize,
    /// `reward_model.overlong_buffer` (DAPO's overlong shaping).
    pub overlong_buffer: OverlongBufferConfig,
    /// Batches per epoch of the training loader (to derive the step count from epochs).
    pub batches_per_epoch: usize,
    /// `actor_rollout_ref.rollout.calculate_log_probs`: log the `rollout_corr/*` diagnostics
    /// even when rollout correction is off.
    pub rollout_diagnostics: bool,
    /// `async_training`: rollout in the background, samples up to `max_staleness` steps old.
    pub async_training: AsyncTrainingConfig,
}

impl Default for OnPolicyConfig {
    fn default() -> Self {
        OnPolicyConfig {
            algorithm: AlgoConfig::default(),
            actor: ActorLossConfig::default(),
            critic: CriticLossConfig::default(),
            trainer: TrainerSection::default(),
            train_batch_size: 1024,
            rollout_n: 1,
            temperature: 1.0,
            max_response_length: 512,
            max_prompt_length: 512,
            actor_ppo_mini_batch_size: 256,
            critic_ppo_mini_batch_size: 256,
            overlong_buffer: OverlongBufferConfig::default(),
            batches_per_epoch: 1,
            rollout_diagnostics: false,
            async_training: AsyncTrainingConfig::default(),
        }
    }
}

fn bad(key: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        name: key,
        reason: reason.into(),
    }
}

impl OnPolicyConfig {
    /// The step count: `trainer.total_training_steps`, else epochs x batches per epoch.
    pub fn total_steps(&self) -> u64 {
        self.trainer
            .total_training_steps
            .unwrap_or((self.trainer.total_epochs * self.batches_per_epoch) as u64)
    }

    /// Checks the cross-group rules verl asserts (and a few more) before any model loads;
    /// every error names the verl key (`actor_rollout_ref.rollout.n`, ...).
    pub fn check(&self) -> Result<()> {
        let algo = &self.algorithm;
        algo.validate()
            .map_err(|e| bad("algorithm", e.to_string()))?;
        self.actor
            .policy_loss_config()
            .validate()
            .map_err(|e| bad("actor_rollout_ref.actor", e.to_string()))?;
        if algo.adv_estimator.needs_sum_pi_squared()
            && self.actor.calculate_sum_pi_squared == Some(false)
        {
            return Err(bad(
                "actor_rollout_ref.actor.calculate_sum_pi_squared",
                format!(
                    "adv_estimator `{}` needs sum_pi_squared from the actor; set it to true or leave it out",
                    algo.adv_estimator
                ),
            ));
        }
        let rc = &algo.rollout_correction;
        if rc.bypass_mode && self.actor.policy_loss.loss_mode != PolicyLossMode::Vanilla {
            return Err(bad(
                "algorithm.rollout_correction.bypass_mode",
                format!(
                    "bypass mode's policy loss is rollout_correction.loss_type ({:?}); \
                     actor_rollout_ref.actor.policy_loss.loss_mode = `{}` would be ignored (verl overrides it silently)",
                    rc.loss_type, self.actor.policy_loss.loss_mode
                ),
            ));
        }
        if self.train_batch_size == 0 {
            return Err(bad("data.train_batch_size", "must be at least 1"));
        }
        if self.rollout_n == 0 {
            return Err(bad("actor_rollout_ref.rollout.n", "must be at least 1"));
        }
        if algo.adv_estimator.needs_groups() && self.rollout_n < 2 {
            return Err(bad(
                "actor_rollout_ref.rollout.n",
                format!(
                    "adv_estimator `{}` compares responses within a group and needs n >= 2, got {}",
                    algo.adv_estimator, self.rollout_n
                ),
            ));
        }
        if self.actor_ppo_mini_batch_size == 0
            || !self
                .train_batch_size
                .is_multiple_of(self.actor_ppo_mini_batch_size)
        {
            return Err(bad(
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                format!(
                    "{} must divide data.train_batch_size ({})",
                    self.actor_ppo_mini_batch_size, self.train_batch_size
                ),
            ));
        }
        if algo.adv_estimator.needs_critic()
            && (self.critic_ppo_mini_batch_size == 0
                || !self
                    .train_batch_size
                    .is_multiple_of(self.critic_ppo_mini_batch_size))
        {
            return Err(bad(
                "critic.ppo_mini_batch_size",
                format!(
                    "{} must divide data.train_batch_size ({})",
                    self.critic_ppo_mini_batch_size, self.train_batch_size
                ),
            ));
        }
        if algo.adv_estimator == AdvEstimator::Remax {
            return Err(bad(
                "algorithm.adv_estimator",
                "`remax` needs a greedy baseline rollout, which this trainer does not run",
            ));
        }
        if self.temperature.is_nan() || self.temperature <= 0.0 {
            return Err(bad(
                "actor_rollout_ref.rollout.temperature",
                format!("must be positive for training, got {}", self.temperature),
            ));
        }
        if self.max_response_length < 1 {
            return Err(bad("data.max_response_length", "must be at least 1"));
        }
        if self.actor.kl_loss_coef.is_nan() || self.actor.kl_loss_coef < 0.0 {
            return Err(bad("actor_rollout_ref.actor.kl_loss_coef", "must be >= 0"));
        }
        if self.critic.cliprange_value.is_nan() || self.critic.cliprange_value < 0.0 {
            return Err(bad("critic.cliprange_value", "must be >= 0"));
        }
        let ob = &self.overlong_buffer;
        if ob.enable && (ob.len <= 0 || ob.len > self.max_response_length) {
            return Err(bad(
                "reward_model.overlong_buffer.len",
                format!(
                    "must be in 1..={} (the response length), got {}",
                    self.max_response_length, ob.len
                ),
            ));
        }
        if let Some(fg) = &algo.filter_groups
            && fg.enable
        {
            let metric = fg.metric.as_deref().unwrap_or("");
            if !["acc", "score", "seq_reward", "seq_final_reward"].contains(&metric) {
                return Err(bad(
                    "algorithm.filter_groups.metric",
                    format!(
                        "must be one of acc, score, seq_reward, seq_final_reward, got `{metric}`"
                    ),
                ));
            }
            if self.rollout_n < 2 {
                return Err(bad(
                    "actor_rollout_ref.rollout.n",
                    "dynamic sampling (algorithm.filter_groups) needs n >= 2",
                ));
            }
        }
        if self.actor.policy_loss.loss_mode == PolicyLossMode::Reinforce && self.actor.use_kl_loss {
            // allowed; nothing to check, kept explicit for readers
        }
        if self.async_training.enable
            && let Some(fg) = &algo.filter_groups
            && fg.enable
        {
            return Err(bad(
                "async_training.enable",
                "dynamic sampling (algorithm.filter_groups) generates as many batches as a step \
                 needs, which a background rollout cannot know ahead; turn one of them off",
            ));
        }
        if self.total_steps() == 0 {
            return Err(bad(
                "trainer.total_training_steps",
                "training would run zero steps",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// verl keeps SAPO's temperatures beside the other actor loss keys; they reach the loss.
    #[test]
    fn sapos_temperatures_reach_the_policy_loss() {
        let actor = ActorLossConfig {
            tau_pos: 2.0,
            tau_neg: 3.0,
            ..ActorLossConfig::default()
        };
        let p = actor.policy_loss_config();
        assert_eq!((p.tau_pos, p.tau_neg), (2.0, 3.0));
        let d = ActorLossConfig::default().policy_loss_config();
        assert_eq!((d.tau_pos, d.tau_neg), (1.0, 1.05), "verl's defaults");
    }

    #[test]
    fn bad_configs_name_the_key() {
        let grpo = OnPolicyConfig {
            algorithm: AlgoConfig {
                adv_estimator: AdvEstimator::Grpo,
                ..AlgoConfig::default()
            },
            train_batch_size: 8,
            actor_ppo_mini_batch_size: 4,
            rollout_n: 1,
            ..OnPolicyConfig::default()
        };
        let err = grpo.check().unwrap_err().to_string();
        assert!(err.contains("actor_rollout_ref.rollout.n"), "{err}");
        let uneven = OnPolicyConfig {
            rollout_n: 4,
            actor_ppo_mini_batch_size: 3,
            ..grpo.clone()
        };
        let err = uneven.check().unwrap_err().to_string();
        assert!(
            err.contains("actor_rollout_ref.actor.ppo_mini_batch_size"),
            "{err}"
        );
        let ok = OnPolicyConfig {
            rollout_n: 4,
            ..grpo
        };
        ok.check().unwrap();
        let err =
            serde_json::from_str::<OnPolicyConfig>(r#"{"algorithm": {"adv_estimator": "grpoo"}}"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("grpoo"), "{err}");
    }
}
