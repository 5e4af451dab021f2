//! The checks of the LLM groups the selected trainer reads, each error naming its key, and the
//! trainers' configs they are checked as ([`on_policy_config`], [`dpo_config`]): plain functions
//! of the resolved config that run before any model loads. [`super::validate`] runs [`check`];
//! `run::compose` runs them again for the trainer it builds.

use anyhow::{Result, anyhow, bail};
use rl_algos::trainer::{DpoTrainerConfig, OnPolicyConfig, TrainerSection};

use super::{ExperimentConfig, TrainerKind};

/// The trainer's plan of an on-policy experiment (`batches_per_epoch` from the loader).
pub fn on_policy_config(cfg: &ExperimentConfig, batches_per_epoch: usize) -> OnPolicyConfig {
    let arr = &cfg.actor_rollout_ref;
    let t = &cfg.trainer;
    OnPolicyConfig {
        algorithm: cfg.algorithm.clone(),
        actor: arr.actor_loss,
        critic: cfg.critic.loss,
        trainer: TrainerSection {
            total_epochs: t.total_epochs as usize,
            total_training_steps: t.total_training_steps,
            test_freq: t.test_freq,
            val_before_train: t.val_before_train,
            log_val_generations: t.log_val_generations,
            critic_warmup: t.critic_warmup,
            save_freq: t.save_freq,
        },
        train_batch_size: cfg.data.train_batch_size,
        rollout_n: arr.rollout.n,
        temperature: arr.rollout.temperature,
        max_response_length: arr.rollout.response_length,
        max_prompt_length: cfg.data.max_prompt_length as i64,
        actor_ppo_mini_batch_size: arr.actor.ppo_mini_batch_size,
        critic_ppo_mini_batch_size: cfg.critic.worker.ppo_mini_batch_size,
        overlong_buffer: cfg.reward_model.own.overlong_buffer,
        batches_per_epoch,
        rollout_diagnostics: arr.rollout.calculate_log_probs,
        async_training: cfg.async_training,
    }
}

/// The checks of the LLM groups the selected trainer reads (none for the bandit), each error
/// naming the key.
pub fn check(cfg: &ExperimentConfig) -> Result<()> {
    let kind = cfg.trainer.algorithm;
    if !kind.trains_policy() {
        return Ok(());
    }
    if cfg.actor_rollout_ref.model.path.as_os_str().is_empty() {
        bail!(
            "config key `actor_rollout_ref.model.path`: trainer.algorithm = {kind:?} needs a \
             Hugging Face model folder"
        );
    }
    check_groups(cfg, kind)
}

/// The checks of the groups trainer `kind` reads, whatever `trainer.algorithm` says (the
/// builders below run them: they are also called directly, with a policy already loaded).
pub fn check_groups(cfg: &ExperimentConfig, kind: TrainerKind) -> Result<()> {
    check_lora(cfg, kind)?;
    check_async(cfg, kind)?;
    if kind == TrainerKind::RewardModel {
        return check_reward_model(cfg);
    }
    let arr = &cfg.actor_rollout_ref;
    arr.actor
        .validate("actor_rollout_ref.actor")
        .map_err(|e| anyhow!("{e}"))?;
    let mini = arr.actor.ppo_mini_batch_size;
    let divides = |key: &str, batch: usize| {
        if batch == 0 || !batch.is_multiple_of(mini) {
            bail!(
                "config key `actor_rollout_ref.actor.ppo_mini_batch_size`: {mini} must divide \
                 `{key}` ({batch}), the rows (pairs for the preference trainers) of a step"
            );
        }
        Ok(())
    };
    if matches!(kind, TrainerKind::Sft | TrainerKind::Spin) {
        divides("sft.train_batch_size", cfg.sft.train_batch_size)?;
        check_sft(cfg, kind)?;
    }
    if kind == TrainerKind::Dpo {
        divides(
            "preference_data.train_batch_size",
            cfg.preference_data.train_batch_size,
        )?;
    }
    if matches!(
        kind,
        TrainerKind::Dpo | TrainerKind::OnlineDpo | TrainerKind::Spin
    ) {
        dpo_config(cfg, 1)?;
        if kind == TrainerKind::Dpo {
            let p = &cfg.preference_data;
            if p.train_files.is_empty() || p.val_files.is_empty() {
                bail!(
                    "config keys `preference_data.train_files` and `preference_data.val_files`: \
                     offline DPO needs both"
                );
            }
            return Ok(());
        }
    }
    if kind == TrainerKind::Sft {
        return Ok(());
    }
    arr.rollout
        .validate()
        .map_err(|e| anyhow!("config group `actor_rollout_ref.rollout`: {e}"))?;
    check_multi_turn(cfg, kind)?;
    if kind != TrainerKind::OnPolicy {
        return Ok(());
    }
    if cfg.algorithm.adv_estimator.needs_critic() {
        cfg.critic
            .worker
            .validate("critic")
            .map_err(|e| anyhow!("{e}"))?;
    }
    on_policy_config(cfg, 1)
        .check()
        .map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// `async_training`: the trainer and the rollouts it is built for.
fn check_async(cfg: &ExperimentConfig, kind: TrainerKind) -> Result<()> {
    if !cfg.async_training.enable {
        return Ok(());
    }
    if kind != TrainerKind::OnPolicy {
        bail!(
            "config key `async_training.enable`: only the on-policy trainer (trainer.algorithm = \
             \"on_policy\") generates in the background, not {kind:?}"
        );
    }
    if cfg.actor_rollout_ref.multi_turn.enable {
        bail!(
            "config keys `async_training.enable` and `actor_rollout_ref.rollout.multi_turn.enable`: \
             multi-turn rollouts with tools run in the step only (asynchronous multi-turn is not \
             built yet); turn one of them off"
        );
    }
    if cfg.actor_rollout_ref.actor.zero_stage == 3 {
        bail!(
            "config keys `async_training.enable` and `actor_rollout_ref.actor.zero_stage`: the \
             background rollout copies the whole policy, which stage 3 shards; use stage 0-2"
        );
    }
    Ok(())
}

/// LoRA's keys in range, and the combinations not built.
fn check_lora(cfg: &ExperimentConfig, kind: TrainerKind) -> Result<()> {
    let m = &cfg.actor_rollout_ref.model;
    let lora = m.lora()?;
    if kind == TrainerKind::OnPolicy && cfg.algorithm.adv_estimator.needs_critic() {
        cfg.critic.model.lora("critic.model")?;
    }
    if kind == TrainerKind::Spin && (lora.is_some() || m.lora_adapter_path.is_some()) {
        bail!(
            "config key `actor_rollout_ref.model.lora_rank`: SPIN with LoRA is not built (its reference becomes the adapted policy every dpo.ref_update_freq steps, which needs a second set of adapters); use full fine-tuning for SPIN"
        );
    }
    if kind == TrainerKind::RewardModel && m.lora_adapter_path.is_some() {
        bail!(
            "config key `actor_rollout_ref.model.lora_adapter_path`: a reward model starts from fresh adapters (set lora_rank) or from a merged model folder"
        );
    }
    Ok(())
}

/// The rules of `trainer.algorithm = "reward_model"`: `preference_data` train and val files,
/// whole pairs a step, `reward_model.train` in range.
fn check_reward_model(cfg: &ExperimentConfig) -> Result<()> {
    let p = &cfg.preference_data;
    if p.train_files.is_empty() || p.val_files.is_empty() {
        bail!(
            "config keys `preference_data.train_files` and `preference_data.val_files`: \
             reward-model training needs both"
        );
    }
    if p.train_batch_size == 0 {
        bail!("config key `preference_data.train_batch_size`: 0 pairs a step");
    }
    let train = &cfg.reward_model.own.train;
    if let Some(micro) = train.micro_train_batch_size
        && (micro == 0 || !p.train_batch_size.is_multiple_of(micro))
    {
        bail!(
            "config key `reward_model.train.micro_train_batch_size`: {micro} must divide \
             `preference_data.train_batch_size` ({}), the pairs of a step",
            p.train_batch_size
        );
    }
    train
        .worker(p.train_batch_size)
        .validate("reward_model.train")
        .map_err(|e| anyhow!("{e}"))?;
    train
        .trainer(1)
        .check()
        .map_err(|e| anyhow!("config group `reward_model.train`: {e}"))?;
    Ok(())
}

/// The rules of `actor_rollout_ref.rollout.multi_turn`: only the on-policy trainer runs it, with
/// at least one tool, distinct tool names and limits in range.
fn check_multi_turn(cfg: &ExperimentConfig, kind: TrainerKind) -> Result<()> {
    let mt = &cfg.actor_rollout_ref.multi_turn;
    if !mt.enable {
        return Ok(());
    }
    if kind != TrainerKind::OnPolicy {
        bail!(
            "config key `actor_rollout_ref.rollout.multi_turn.enable`: multi-turn rollouts train \
             with trainer.algorithm = \"on_policy\" only, not {kind:?}"
        );
    }
    if mt.tools.is_empty() {
        bail!(
            "config key `actor_rollout_ref.rollout.multi_turn.tools`: multi_turn.enable needs at \
             least one tool, e.g. [{{type = \"search\", url = \"http://127.0.0.1:8000/retrieve\"}}]"
        );
    }
    for (i, t) in mt.tools.iter().enumerate() {
        if mt.tools[..i].iter().any(|u| u.name() == t.name()) {
            bail!(
                "config key `actor_rollout_ref.rollout.multi_turn.tools`: two tools are called \
                 `{}` (tools[{i}] and an earlier one)",
                t.name()
            );
        }
    }
    mt.limits()
        .validate()
        .map_err(|e| anyhow!("config group `actor_rollout_ref.rollout`: {e}"))?;
    Ok(())
}

/// A column, or `column.field…` inside a struct column, as (column, fields): the form of
/// `sft.prompt_key` and `sft.response_key` (verl's `prompt_key` + `prompt_dict_keys`).
pub fn column_path(key: &str, value: &str) -> Result<(String, Vec<String>)> {
    let mut parts = value.split('.');
    let column = parts.next().unwrap_or_default().to_string();
    let fields: Vec<String> = parts.map(str::to_string).collect();
    if column.is_empty() || fields.iter().any(String::is_empty) {
        bail!(
            "config key `{key}`: {value:?} is not a column or `column.field` (e.g. `answer`, \
             `extra_info.answer`)"
        );
    }
    Ok((column, fields))
}

/// The checks of the `sft` group for trainer `kind` (SFT or SPIN).
fn check_sft(cfg: &ExperimentConfig, kind: TrainerKind) -> Result<()> {
    let sft = &cfg.sft;
    column_path("sft.response_key", &sft.response_key)?;
    if let Some(p) = &sft.prompt_key {
        column_path("sft.prompt_key", p)?;
    }
    if let Some(bad) = sft.mask_tags.iter().find(|t| {
        t.is_empty() || t.contains(|c: char| c == '<' || c == '>' || c == '/' || c.is_whitespace())
    }) {
        bail!(
            "config key `sft.mask_tags`: {bad:?} is not a tag name (write `information` for `<information>…</information>`)"
        );
    }
    if let Some(m) = &sft.messages_key {
        if m.is_empty() {
            bail!("config key `sft.messages_key`: empty (unset it for single-turn SFT)");
        }
        if kind == TrainerKind::Spin {
            bail!(
                "config key `sft.messages_key`: SPIN answers single-turn prompts \
                 (`sft.prompt_key`, `sft.response_key`); unset it"
            );
        }
        if !sft.mask_tags.is_empty() {
            bail!(
                "config keys `sft.messages_key` and `sft.mask_tags`: a conversation trains its \
                 assistant turns and no others; tags mask spans of a single-turn response only"
            );
        }
    }
    if sft.max_length == Some(0) {
        bail!("config key `sft.max_length`: 0 leaves no token (unset it for no limit)");
    }
    if sft.truncation == rl_data::Truncation::Middle {
        bail!(
            "config key `sft.truncation`: `middle` is not a choice for SFT examples (error, left \
             or right, as verl's SFT dataset)"
        );
    }
    Ok(())
}

/// The preference trainers' config: `dpo` with the step count of `trainer`
/// (`total_training_steps`, else `total_epochs` epochs of `batches_per_epoch`).
pub fn dpo_config(cfg: &ExperimentConfig, batches_per_epoch: usize) -> Result<DpoTrainerConfig> {
    let mut d = cfg.dpo.0.clone();
    d.total_training_steps = cfg
        .trainer
        .total_training_steps
        .unwrap_or(cfg.trainer.total_epochs * batches_per_epoch as u64);
    d.check().map_err(|e| anyhow!("config group `dpo`: {e}"))?;
    Ok(d)
}
