//! The worker-side config groups of verl's `actor_rollout_ref.actor`, `critic` and
//! `actor_rollout_ref.rollout.val_kwargs`: optimiser, LR schedule, mini/micro-batch sizes.
//!
//! The loss keys of verl's `actor` group (`clip_ratio`, `entropy_coeff`, `use_kl_loss`, ...) and
//! `critic.cliprange_value` belong to the objective and live in rl-algos; a composer that reads
//! one `actor` table splits it by [`ActorConfig::FIELDS`].

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The LR schedule after warmup (verl's `optim.lr_scheduler_type`, formerly `warmup_style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// Linear warmup to `lr`, then constant.
    #[default]
    Constant,
    /// Linear warmup to `lr`, then a cosine decay to `min_lr_ratio * lr`.
    Cosine,
}

/// verl's `optim` group: AdamW and its LR schedule. The schedule advances once per `update`
/// call (one training step), as verl's `lr_scheduler.step()` does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Peak learning rate, > 0. Default 1e-6 (actor); the critic's default is 1e-5.
    pub lr: f64,
    /// AdamW's `(beta1, beta2)`, each in `[0, 1)`. Default `[0.9, 0.999]`.
    pub betas: [f64; 2],
    /// AdamW's epsilon, > 0. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay, >= 0. Default 0.01.
    pub weight_decay: f64,
    /// Warmup steps; -1 means use `lr_warmup_steps_ratio`. Default -1.
    pub lr_warmup_steps: i64,
    /// Warmup as a fraction of `total_training_steps`, in `[0, 1]`. Default 0.
    pub lr_warmup_steps_ratio: f64,
    /// Training steps the schedule spans; -1 = filled in by the trainer. Default -1.
    pub total_training_steps: i64,
    /// The schedule after warmup. Default `constant`.
    pub lr_scheduler_type: LrSchedule,
    /// Cosine only: the floor, as a fraction of `lr`, in `[0, 1]`. Default 0.
    pub min_lr_ratio: f64,
    /// Cosine only: number of cosine half-waves times 2 over training. Default 0.5.
    pub num_cycles: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 1e-6,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            lr_warmup_steps: -1,
            lr_warmup_steps_ratio: 0.0,
            total_training_steps: -1,
            lr_scheduler_type: LrSchedule::Constant,
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
        }
    }
}

impl OptimConfig {
    /// Checks ranges; `prefix` is the config path of this group (`actor_rollout_ref.actor.optim`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        let bad = |k: &str, why: String| Err(Error::invalid(&format!("{prefix}.{k}"), why));
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("lr", format!("must be positive, got {}", self.lr));
        }
        if self.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            return bad(
                "betas",
                format!("each must be in [0, 1), got {:?}", self.betas),
            );
        }
        if self.eps.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return bad("eps", format!("must be positive, got {}", self.eps));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad(
                "weight_decay",
                format!("must be >= 0, got {}", self.weight_decay),
            );
        }
        if !(0.0..=1.0).contains(&self.lr_warmup_steps_ratio) {
            return bad(
                "lr_warmup_steps_ratio",
                format!("must be in [0, 1], got {}", self.lr_warmup_steps_ratio),
            );
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return bad(
                "min_lr_ratio",
                format!("must be in [0, 1], got {}", self.min_lr_ratio),
            );
        }
        Ok(())
    }

    /// This schedule over a run of `steps` training steps: `total_training_steps` filled in
    /// with `steps` where it is -1 (as verl's trainers set `optim.total_training_steps` from
    /// the run's step count), kept where the config sets it.
    pub fn spanning(mut self, steps: u64) -> Self {
        if self.total_training_steps < 0 {
            self.total_training_steps = i64::try_from(steps).unwrap_or(i64::MAX);
        }
        self
    }

    /// Warmup steps: `lr_warmup_steps` when positive, else `ratio * total_training_steps`.
    pub fn warmup_steps(&self) -> i64 {
        if self.lr_warmup_steps > 0 {
            self.lr_warmup_steps
        } else {
            (self.lr_warmup_steps_ratio * self.total_training_steps.max(0) as f64) as i64
        }
    }

    /// The learning rate of schedule step `step` (0-based), as verl's
    /// `get_constant_schedule_with_warmup` / `get_cosine_schedule_with_warmup`.
    pub fn lr_at(&self, step: i64) -> f64 {
        let warmup = self.warmup_steps();
        let factor = match self.lr_scheduler_type {
            LrSchedule::Constant => {
                if step < warmup {
                    step as f64 / warmup.max(1) as f64
                } else {
                    1.0
                }
            }
            LrSchedule::Cosine => {
                let min = self.min_lr_ratio;
                if step < warmup {
                    min + (1.0 - min) * step as f64 / warmup.max(1) as f64
                } else {
                    let total = self.total_training_steps.max(1);
                    let progress = (step - warmup) as f64 / (total - warmup).max(1) as f64;
                    let x = (std::f64::consts::PI * self.num_cycles * 2.0 * progress).cos();
                    (x * (1.0 - min) * 0.5 + (1.0 + min) * 0.5).max(min)
                }
            }
        };
        self.lr * factor
    }
}

fn default_token_len() -> usize {
    16384
}

/// The dtype the trained weights compute in (`mixed_precision.param_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamDtype {
    /// Float32 throughout: no mixed precision (the default).
    #[default]
    Fp32,
    /// bfloat16 weights and compute, float32 master weights, optimizer state and gradients.
    Bf16,
}

/// Mixed precision (verl's `fsdp_config.mixed_precision`, under our own key): the model's
/// weights and matmuls in `param_dtype`, while the optimizer keeps float32 master weights and
/// float32 AdamW moments, gradients are accumulated over micro-batches and averaged across
/// ranks in float32 (verl's `reduce_dtype: fp32`), and log-softmax and the losses run in
/// float32. The model must be loaded in float32 (`model.dtype`), the masters' source.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MixedPrecision {
    /// `fp32` (off) or `bf16`. Default `fp32`.
    pub param_dtype: ParamDtype,
}

impl MixedPrecision {
    /// Whether master weights are kept.
    pub fn enabled(&self) -> bool {
        self.param_dtype != ParamDtype::Fp32
    }

    /// The compute dtype.
    pub fn kind(&self) -> tch::Kind {
        match self.param_dtype {
            ParamDtype::Fp32 => tch::Kind::Float,
            ParamDtype::Bf16 => tch::Kind::BFloat16,
        }
    }
}

/// verl's `actor_rollout_ref.actor` worker keys (the loss keys are rl-algos').
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActorConfig {
    /// Prompts per mini-batch (one optimiser step); multiplied by `rollout.n` into rows, as
    /// verl normalises it. Default 256.
    pub ppo_mini_batch_size: usize,
    /// Rows per micro-batch (gradient accumulation); `None` = the whole mini-batch. Default none.
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Split micro-batches by token count instead of rows. Default false.
    pub use_dynamic_bsz: bool,
    /// Token budget of a dynamic micro-batch (prompt + response tokens). Default 16384.
    #[serde(default = "default_token_len")]
    pub ppo_max_token_len_per_gpu: usize,
    /// Passes over each batch. Default 1.
    pub ppo_epochs: usize,
    /// Shuffle rows into mini-batches (seeded by `data_loader_seed` and the step). Default false.
    pub shuffle: bool,
    /// Seed of the mini-batch shuffle. Default 0.
    pub data_loader_seed: u64,
    /// Clip the global gradient norm to this; a non-finite norm skips the step. Default 1.0.
    pub grad_clip: f64,
    /// Rows per micro-batch of `compute_log_prob` (verl's `rollout.log_prob_micro_batch_size_per_gpu`);
    /// `None` = the whole batch (on a CPU, parts whose activations fit the caches are faster for
    /// long sequences: 3-4x at 512 rows of ~290 tokens of a 64-wide model, docs/perf.md).
    /// Default none.
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Token budget of a dynamic `compute_log_prob` micro-batch. Default 16384.
    #[serde(default = "default_token_len")]
    pub log_prob_max_token_len_per_gpu: usize,
    /// AdamW and LR schedule.
    pub optim: OptimConfig,
    /// Mixed precision of the trained weights. Default off (float32).
    pub mixed_precision: MixedPrecision,
    /// ZeRO stage of the data-parallel training state (DeepSpeed's and OpenRLHF's
    /// `zero_stage`): 0 every rank holds everything, 1 AdamW's moments and the master weights
    /// are split over the ranks, 2 the gradients too, 3 the weights too (each layer gathered
    /// as it computes, FSDP's `FULL_SHARD`; not with LoRA or multi-turn tools). Default 0.
    /// Ignored on one rank.
    pub zero_stage: u8,
    /// Forward passes on the real tokens packed into rows, without padding (verl's
    /// `use_remove_padding`, set from `actor_rollout_ref.model.use_remove_padding`); the results equal the padded forward's up
    /// to rounding. Default false.
    #[serde(skip)]
    pub use_remove_padding: bool,
    /// The update's log-probs and entropies through the fused head
    /// ([`crate::fused_head`]: row chunks, recomputed in the backward, so no full-vocabulary
    /// tensor is kept; verl's `use_fused_kernels`, set from
    /// `actor_rollout_ref.model.use_fused_kernels`); the results equal the plain head's up to
    /// rounding. Not with ZeRO stage 3. Default false.
    #[serde(skip)]
    pub use_fused_kernels: bool,
    /// verl's `use_prefix_grouper`: the rows of a micro-batch that share a prompt (a GRPO
    /// group's samples) compute it once, in the update's forward and backward, the old
    /// log-probs and the reference's (the packed layout of `use_remove_padding`, each prompt
    /// followed by its responses, which attend to it and to themselves); the same results up
    /// to rounding, the prompt's work done once instead of once per sample (docs/perf.md).
    /// Default false.
    pub use_prefix_grouper: bool,
    /// When the update is on-policy (one mini-batch, `ppo_epochs = 1`) and nothing reads
    /// `old_log_probs` before it (no KL in the reward, no rollout correction, no optimal-token
    /// baseline), skip the separate old-log-prob forward: the update's own forward runs at the
    /// same weights, its log-probs, detached, are the old ones (as verl's actor takes them when
    /// on-policy), and it reports `actor/entropy`. `false` runs verl's separate forward every
    /// step (the same loss; only `timing_s/old_log_prob` and the forward's rounding differ).
    /// Default true.
    pub old_log_prob_from_update: bool,
}

impl Default for ActorConfig {
    fn default() -> Self {
        ActorConfig {
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 16384,
            ppo_epochs: 1,
            shuffle: false,
            data_loader_seed: 0,
            grad_clip: 1.0,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_max_token_len_per_gpu: 16384,
            optim: OptimConfig::default(),
            mixed_precision: MixedPrecision::default(),
            zero_stage: 0,
            use_remove_padding: false,
            use_fused_kernels: false,
            use_prefix_grouper: false,
            old_log_prob_from_update: true,
        }
    }
}

impl ActorConfig {
    /// The keys of this group, for a composer that splits verl's `actor` table between this
    /// struct and the loss keys.
    pub const FIELDS: &'static [&'static str] = &[
        "ppo_mini_batch_size",
        "ppo_micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu",
        "ppo_epochs",
        "shuffle",
        "data_loader_seed",
        "grad_clip",
        "log_prob_micro_batch_size_per_gpu",
        "log_prob_max_token_len_per_gpu",
        "optim",
        "mixed_precision",
        "zero_stage",
        "old_log_prob_from_update",
    ];

    /// Checks ranges; `prefix` names the group (`actor_rollout_ref.actor`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        let bad = |k: &str, why: String| Err(Error::invalid(&format!("{prefix}.{k}"), why));
        if self.ppo_mini_batch_size == 0 {
            return bad("ppo_mini_batch_size", "must be at least 1".into());
        }
        if self.ppo_micro_batch_size_per_gpu == Some(0) {
            return bad(
                "ppo_micro_batch_size_per_gpu",
                "must be at least 1 (or null)".into(),
            );
        }
        if self.log_prob_micro_batch_size_per_gpu == Some(0) {
            return bad(
                "log_prob_micro_batch_size_per_gpu",
                "must be at least 1 (or null)".into(),
            );
        }
        if self.ppo_epochs == 0 {
            return bad("ppo_epochs", "must be at least 1".into());
        }
        if self.use_dynamic_bsz && self.ppo_max_token_len_per_gpu == 0 {
            return bad("ppo_max_token_len_per_gpu", "must be at least 1".into());
        }
        if self.grad_clip.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return bad(
                "grad_clip",
                format!("must be positive, got {}", self.grad_clip),
            );
        }
        crate::roles::ZeroStage::from_config(&format!("{prefix}.zero_stage"), self.zero_stage)?;
        self.optim.validate(&format!("{prefix}.optim"))
    }
}

/// verl's `critic` worker keys (`cliprange_value` and `loss_agg_mode` are the objective's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriticConfig {
    /// Prompts per mini-batch, times `rollout.n` rows. Default 256.
    pub ppo_mini_batch_size: usize,
    /// Rows per micro-batch; `None` = the whole mini-batch. Default none.
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Split micro-batches by token count. Default false.
    pub use_dynamic_bsz: bool,
    /// Token budget of a dynamic micro-batch. Default 32768.
    pub ppo_max_token_len_per_gpu: usize,
    /// Passes over each batch. Default 1.
    pub ppo_epochs: usize,
    /// Shuffle rows into mini-batches. Default false.
    pub shuffle: bool,
    /// Seed of the mini-batch shuffle. Default 0.
    pub data_loader_seed: u64,
    /// Global gradient-norm clip. Default 1.0.
    pub grad_clip: f64,
    /// AdamW and LR schedule; the critic's default `lr` is 1e-5.
    pub optim: OptimConfig,
    /// Mixed precision of the critic's weights. Default off (float32).
    pub mixed_precision: MixedPrecision,
    /// ZeRO stage of the data-parallel training state (DeepSpeed's and OpenRLHF's
    /// `zero_stage`): 0 every rank holds everything, 1 AdamW's moments and the master weights
    /// are split over the ranks, 2 the gradients too, 3 the weights too (each layer gathered
    /// as it computes, FSDP's `FULL_SHARD`; not with LoRA or multi-turn tools). Default 0.
    /// Ignored on one rank.
    pub zero_stage: u8,
    /// Forward passes on the real tokens packed into rows, without padding (verl's
    /// `use_remove_padding`, set from `critic.model.use_remove_padding`); the results equal the padded forward's up
    /// to rounding. Default false.
    #[serde(skip)]
    pub use_remove_padding: bool,
}

impl Default for CriticConfig {
    fn default() -> Self {
        CriticConfig {
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 32768,
            ppo_epochs: 1,
            shuffle: false,
            data_loader_seed: 0,
            grad_clip: 1.0,
            optim: OptimConfig {
                lr: 1e-5,
                ..OptimConfig::default()
            },
            mixed_precision: MixedPrecision::default(),
            zero_stage: 0,
            use_remove_padding: false,
        }
    }
}

impl CriticConfig {
    /// The keys of this group (see [`ActorConfig::FIELDS`]).
    pub const FIELDS: &'static [&'static str] = &[
        "ppo_mini_batch_size",
        "ppo_micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu",
        "ppo_epochs",
        "shuffle",
        "data_loader_seed",
        "grad_clip",
        "optim",
        "mixed_precision",
        "zero_stage",
    ];

    /// The same settings as an [`ActorConfig`] (the update loop is shared).
    pub(crate) fn as_actor(&self) -> ActorConfig {
        ActorConfig {
            ppo_mini_batch_size: self.ppo_mini_batch_size,
            ppo_micro_batch_size_per_gpu: self.ppo_micro_batch_size_per_gpu,
            use_dynamic_bsz: self.use_dynamic_bsz,
            ppo_max_token_len_per_gpu: self.ppo_max_token_len_per_gpu,
            ppo_epochs: self.ppo_epochs,
            shuffle: self.shuffle,
            data_loader_seed: self.data_loader_seed,
            grad_clip: self.grad_clip,
            log_prob_micro_batch_size_per_gpu: self.ppo_micro_batch_size_per_gpu,
            log_prob_max_token_len_per_gpu: self.ppo_max_token_len_per_gpu,
            optim: self.optim.clone(),
            mixed_precision: self.mixed_precision.clone(),
            zero_stage: self.zero_stage,
            use_remove_padding: self.use_remove_padding,
            use_fused_kernels: false,
            use_prefix_grouper: false,
            // a critic has no old log-probs
            old_log_prob_from_update: false,
        }
    }

    /// Checks ranges; `prefix` names the group (`critic`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        self.as_actor().validate(prefix)
    }
}

/// verl's `actor_rollout_ref.rollout.val_kwargs`: sampling during validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValKwargs {
    /// Top-k; -1 = off. Default -1.
    pub top_k: i64,
    /// Nucleus; default 1.0.
    pub top_p: f64,
    /// Temperature; default 0 (greedy).
    pub temperature: f64,
    /// Samples per prompt; default 1.
    pub n: usize,
    /// Sample (true) or greedy (false). Default false.
    pub do_sample: bool,
}

impl Default for ValKwargs {
    fn default() -> Self {
        ValKwargs {
            top_k: -1,
            top_p: 1.0,
            temperature: 0.0,
            n: 1,
            do_sample: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_verls_and_schedules_warm_up() {
        let a: ActorConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(a, ActorConfig::default());
        assert_eq!(a.optim.lr, 1e-6);
        let c: CriticConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c.optim.lr, 1e-5);
        assert!(serde_json::from_str::<ActorConfig>(r#"{"ppo_epoch": 2}"#).is_err());
        let o = OptimConfig {
            lr: 1.0,
            lr_warmup_steps: 4,
            total_training_steps: 14,
            lr_scheduler_type: LrSchedule::Cosine,
            ..OptimConfig::default()
        };
        assert_eq!(o.lr_at(0), 0.0);
        assert_eq!(o.lr_at(2), 0.5);
        assert!((o.lr_at(4) - 1.0).abs() < 1e-12);
        assert!((o.lr_at(9) - 0.5).abs() < 1e-12);
        assert!(o.lr_at(14).abs() < 1e-12);
        let k = OptimConfig {
            lr_scheduler_type: LrSchedule::Constant,
            ..o
        };
        assert_eq!(k.lr_at(100), 1.0);
        // the run's step count fills an unset span (warmup ratio and cosine both read it); a
        // span the config sets is kept
        let unset = OptimConfig {
            lr: 1.0,
            lr_warmup_steps_ratio: 0.25,
            lr_scheduler_type: LrSchedule::Cosine,
            ..OptimConfig::default()
        };
        assert_eq!(
            unset.lr_at(1),
            0.0,
            "a span of 1: the cosine is done at once"
        );
        let run = unset.clone().spanning(8);
        assert_eq!((run.total_training_steps, run.warmup_steps()), (8, 2));
        assert_eq!(run.lr_at(1), 0.5);
        assert!((run.lr_at(5) - 0.5).abs() < 1e-12);
        assert!(run.lr_at(8).abs() < 1e-12);
        assert_eq!(o.clone().spanning(100).total_training_steps, 14);
        let bad = ActorConfig {
            ppo_epochs: 0,
            ..ActorConfig::default()
        };
        let err = bad
            .validate("actor_rollout_ref.actor")
            .unwrap_err()
            .to_string();
        assert!(err.contains("actor_rollout_ref.actor.ppo_epochs"), "{err}");
    }
}
