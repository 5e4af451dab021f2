//! Shared helpers of the end-to-end tests: composing the crates' config groups into one
//! experiment (the shape the harness composes too), adapting rl-data's loader to the trainers'
//! [`BatchSource`], SFT batches in the rollout layout, and the tiny character-level setup.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rl_algos::trainer::{
    ActorLossConfig, BatchSource, CriticLossConfig, OnPolicyConfig, OnPolicyTrainer, Roles,
    SftConfig, SftTrainer, TrainerSection,
};
use rl_algos::{AlgoConfig, OverlongBufferConfig};
use rl_core::{Batch, keys};
use rl_data::reward::RewardRegistry;
use rl_data::reward::role::RuleReward;
use rl_data::{DataConfig, DataLoader, LoaderOptions, LoaderState, RlDataset, Sampler, Tokenizer};
use rl_workers::roles::{
    ActorConfig, ActorWorker, CriticConfig, CriticWorker, ReferenceWorker, RolloutWorker,
    SharedPolicy, ValKwargs, share,
};
use rl_workers::{CausalLm, Config, RolloutConfig, ValueModel};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

/// Any error of the workspace crates, as a boxed error for tests.
pub type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// verl's `actor_rollout_ref` group, split into the worker and loss halves of `actor`.
#[derive(Debug, Clone, Default)]
pub struct ActorRolloutRef {
    /// `actor_rollout_ref.model.path`.
    pub model_path: PathBuf,
    /// `actor_rollout_ref.actor` (worker keys).
    pub actor: ActorConfig,
    /// `actor_rollout_ref.actor` (loss keys).
    pub actor_loss: ActorLossConfig,
    /// `actor_rollout_ref.rollout`.
    pub rollout: RolloutConfig,
    /// `actor_rollout_ref.rollout.val_kwargs`.
    pub val_kwargs: ValKwargs,
    /// `actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu`.
    pub ref_micro_batch_size: Option<usize>,
}

/// The whole experiment, in verl's groups: what the harness composes from the crates' parts.
#[derive(Debug, Clone, Default)]
pub struct ExperimentConfig {
    /// `data`.
    pub data: DataConfig,
    /// `actor_rollout_ref`.
    pub actor_rollout_ref: ActorRolloutRef,
    /// `critic` (worker keys).
    pub critic: CriticConfig,
    /// `critic` (loss keys).
    pub critic_loss: CriticLossConfig,
    /// `reward_model.overlong_buffer`.
    pub overlong_buffer: OverlongBufferConfig,
    /// `algorithm`.
    pub algorithm: AlgoConfig,
    /// `trainer`.
    pub trainer: TrainerSection,
}

impl ExperimentConfig {
    /// The trainer's plan; [`OnPolicyConfig::check`] then names any key at fault.
    pub fn on_policy(&self, batches_per_epoch: usize) -> OnPolicyConfig {
        let arr = &self.actor_rollout_ref;
        OnPolicyConfig {
            algorithm: self.algorithm.clone(),
            actor: arr.actor_loss,
            critic: self.critic_loss,
            trainer: self.trainer.clone(),
            train_batch_size: self.data.train_batch_size,
            rollout_n: arr.rollout.n,
            temperature: arr.rollout.temperature,
            max_response_length: arr.rollout.response_length,
            actor_ppo_mini_batch_size: arr.actor.ppo_mini_batch_size,
            critic_ppo_mini_batch_size: self.critic.ppo_mini_batch_size,
            overlong_buffer: self.overlong_buffer,
            batches_per_epoch,
        }
    }

    /// Every check, before any model loads: each group's own ranges, then the cross-group
    /// rules, each error naming the key.
    pub fn check(&self) -> AnyResult<()> {
        self.data.validate()?;
        self.actor_rollout_ref
            .actor
            .validate("actor_rollout_ref.actor")?;
        self.actor_rollout_ref
            .rollout
            .validate()
            .map_err(|e| format!("actor_rollout_ref.rollout: {e}"))?;
        if self.algorithm.adv_estimator.needs_critic() {
            self.critic.validate("critic")?;
        }
        self.on_policy(1).check()?;
        Ok(())
    }
}

/// rl-data's loader as a [`BatchSource`] of prompt batches.
#[derive(Debug)]
pub struct LoaderSource(pub DataLoader);

impl BatchSource for LoaderSource {
    fn next_batch(&mut self) -> rl_core::Result<Batch> {
        let pb = self.0.next_batch_cycling().map_err(data_err)?;
        pb.into_batch().map_err(data_err)
    }
    fn state(&self) -> Value {
        serde_json::to_value(self.0.state()).unwrap_or(Value::Null)
    }
    fn load_state(&mut self, state: &Value) -> rl_core::Result<()> {
        let s: LoaderState =
            serde_json::from_value(state.clone()).map_err(|e| rl_core::Error::Role {
                role: "loader",
                source: Box::new(e),
            })?;
        self.0.load_state(s).map_err(data_err)
    }
}

fn data_err(e: rl_data::Error) -> rl_core::Error {
    rl_core::Error::Role {
        role: "data",
        source: Box::new(e),
    }
}

/// Left-pads prompts and right-pads responses into the rollout layout (`input_ids`,
/// `attention_mask`, `position_ids`, `prompts`, `responses`, `response_mask`).
pub fn rollout_layout(prompts: &[Vec<u32>], responses: &[Vec<u32>], pad: u32) -> AnyResult<Batch> {
    let (p_ids, p_mask, p_pos) = rl_data::collate_left_padded(prompts, pad, None)?;
    let b = prompts.len() as i64;
    let width = responses.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let mut r = vec![pad as i64; b as usize * width];
    let mut m = vec![0f32; b as usize * width];
    for (i, resp) in responses.iter().enumerate() {
        for (j, &t) in resp.iter().enumerate() {
            r[i * width + j] = t as i64;
            m[i * width + j] = 1.0;
        }
    }
    let responses = Tensor::from_slice(&r).view([b, width as i64]);
    let response_mask = Tensor::from_slice(&m).view([b, width as i64]);
    let last = p_pos.narrow(1, p_pos.size()[1] - 1, 1);
    let r_pos =
        last + Tensor::arange_start(1, width as i64 + 1, (Kind::Int64, Device::Cpu)).unsqueeze(0);
    let mut batch = Batch::new();
    batch.insert(keys::INPUT_IDS, Tensor::cat(&[&p_ids, &responses], 1))?;
    batch.insert(
        keys::ATTENTION_MASK,
        Tensor::cat(&[&p_mask, &response_mask.to_kind(Kind::Int64)], 1),
    )?;
    batch.insert(keys::POSITION_IDS, Tensor::cat(&[&p_pos, &r_pos], 1))?;
    batch.insert(keys::PROMPTS, p_ids)?;
    batch.insert(keys::RESPONSES, responses)?;
    batch.insert(keys::RESPONSE_MASK, response_mask)?;
    Ok(batch)
}

/// SFT batches from an RL parquet whose `extra_info.answer` is the target: the prompt rendered
/// with the chat template and the generation prompt, the response `answer + eos`.
#[derive(Debug)]
pub struct SftSource {
    dataset: Arc<RlDataset>,
    tokenizer: Arc<Tokenizer>,
    sampler: Sampler,
}

impl SftSource {
    /// Batches of `batch_size` rows, shuffled per epoch with `seed`.
    pub fn new(
        dataset: Arc<RlDataset>,
        tokenizer: Arc<Tokenizer>,
        batch_size: usize,
        seed: u64,
    ) -> AnyResult<Self> {
        let sampler = Sampler::new(dataset.len(), batch_size, true, true, seed)?;
        Ok(SftSource {
            dataset,
            tokenizer,
            sampler,
        })
    }

    /// The batch of rows `idx`.
    pub fn batch(&self, idx: &[usize]) -> AnyResult<Batch> {
        let mut prompts = Vec::new();
        let mut responses = Vec::new();
        for &i in idx {
            let row = self.dataset.row(i)?;
            let answer = row
                .extra_info
                .get("answer")
                .and_then(Value::as_str)
                .ok_or("row lacks extra_info.answer")?;
            let ex = rl_data::tokenize_prompt_response(&self.tokenizer, &row.prompt, answer)?;
            let split = ex
                .loss_mask
                .iter()
                .position(|&m| m == 1)
                .unwrap_or(ex.input_ids.len());
            prompts.push(ex.input_ids[..split].to_vec());
            responses.push(ex.input_ids[split..].to_vec());
        }
        rollout_layout(&prompts, &responses, self.tokenizer.pad_id_or_eos()?)
    }
}

impl BatchSource for SftSource {
    fn next_batch(&mut self) -> rl_core::Result<Batch> {
        let (idx, _) = match self.sampler.next_indices() {
            Some(x) => x,
            None => self
                .sampler
                .next_indices()
                .ok_or_else(|| rl_core::Error::Role {
                    role: "data",
                    source: "an epoch produced no batch".into(),
                })?,
        };
        self.batch(&idx).map_err(|e| rl_core::Error::Role {
            role: "data",
            source: e,
        })
    }
    fn state(&self) -> Value {
        serde_json::to_value(self.sampler.state()).unwrap_or(Value::Null)
    }
    fn load_state(&mut self, state: &Value) -> rl_core::Result<()> {
        let s: LoaderState =
            serde_json::from_value(state.clone()).map_err(|e| rl_core::Error::Role {
                role: "loader",
                source: Box::new(e),
            })?;
        self.sampler.load_state(s).map_err(data_err)
    }
}

/// A tiny Llama for the character-level tokenizer: vocab 100, hidden 64, 2 layers.
pub fn tiny_llama_config(vocab: i64) -> Config {
    let mut cfg = Config::tiny();
    cfg.vocab_size = vocab;
    cfg.hidden_size = 64;
    cfg.intermediate_size = 192;
    cfg.num_hidden_layers = 2;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = Some(4);
    cfg.bos_token_id = None;
    cfg.eos_token_id = Some(rl_workers::TokenIds::One(3));
    cfg.pad_token_id = Some(0);
    cfg.tie_word_embeddings = true;
    cfg
}

/// The on-disk pieces of the tiny task: a model folder holding the tokenizer (and, once
/// written, weights) and the `train`/`test` parquet files.
#[derive(Debug)]
pub struct TinyTask {
    /// Holds everything; removed on drop.
    pub root: tempfile::TempDir,
    /// The tokenizer / model folder.
    pub model_dir: PathBuf,
    /// `train.parquet`.
    pub train: PathBuf,
    /// `test.parquet`.
    pub test: PathBuf,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
}

/// Writes the tiny tokenizer and an addition task with operands up to `max_operand`.
pub fn tiny_task(max_operand: i64, train: usize, test: usize, seed: u64) -> AnyResult<TinyTask> {
    let task = rl_data::tasks::tiny_vocab::TinyAddition {
        max_operand,
        no_carry: false,
        zero_pad: false,
    };
    tiny_task_with(task, train, test, seed)
}

/// [`tiny_task`] with every option of the addition task.
pub fn tiny_task_with(
    addition: rl_data::tasks::tiny_vocab::TinyAddition,
    train: usize,
    test: usize,
    seed: u64,
) -> AnyResult<TinyTask> {
    let root = tempfile::tempdir()?;
    let model_dir = root.path().join("model");
    rl_data::tasks::tiny_vocab::write_tiny_tokenizer(&model_dir)?;
    let files = rl_data::tasks::tiny_vocab::generate_tiny_addition(
        &root.path().join("data"),
        addition,
        rl_data::tasks::SplitSizes { train, test },
        seed,
    )?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir)?);
    Ok(TinyTask {
        model_dir,
        train: files.train,
        test: files.test,
        tokenizer,
        root,
    })
}

/// The data config of the tiny task (prompts padded to the longest in a batch).
pub fn tiny_data_config(task: &TinyTask, train_batch_size: usize, seed: u64) -> DataConfig {
    DataConfig {
        train_files: vec![task.train.clone()],
        val_files: vec![task.test.clone()],
        max_prompt_length: 64,
        max_response_length: 8,
        train_batch_size,
        seed: Some(seed),
        pad_to_max_prompt_length: false,
        return_raw_chat: false,
        ..DataConfig::default()
    }
}

/// The training loader and the validation batches of `cfg.data`.
pub fn loaders(
    cfg: &ExperimentConfig,
    tokenizer: &Arc<Tokenizer>,
) -> AnyResult<(LoaderSource, Vec<Batch>)> {
    let train = Arc::new(RlDataset::train(&cfg.data)?);
    let loader = DataLoader::new(train, tokenizer.clone(), LoaderOptions::train(&cfg.data))?;
    let val = Arc::new(RlDataset::val(&cfg.data)?);
    let n = val.len();
    let mut vl = DataLoader::new(val, tokenizer.clone(), LoaderOptions::val(&cfg.data, n))?;
    let mut val_batches = Vec::new();
    while let Some(b) = vl.next_batch()? {
        val_batches.push(b.into_batch()?);
    }
    Ok((LoaderSource(loader), val_batches))
}

/// Builds the on-policy trainer of `cfg` over the policy weights in `policy` (checked first,
/// so a bad config fails before any model is touched by the trainer). The reference is a
/// frozen copy of `policy` as it is now; the critic (GAE only) starts from `critic_init`.
pub fn build_on_policy(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    critic_init: Option<ValueModel>,
    tokenizer: &Arc<Tokenizer>,
) -> AnyResult<OnPolicyTrainer> {
    cfg.check()?;
    let (train, val) = loaders(cfg, tokenizer)?;
    let arr = &cfg.actor_rollout_ref;
    let n = arr.rollout.n;
    let need_ref = arr.actor_loss.use_kl_loss || cfg.algorithm.use_kl_in_reward;
    let reference = if need_ref {
        Some(Box::new(ReferenceWorker::from_policy(
            &policy,
            arr.ref_micro_batch_size,
        )?) as Box<dyn rl_core::roles::Reference>)
    } else {
        None
    };
    let eos = tokenizer.eos_token_id().ok_or("tokenizer has no eos")? as i64;
    let pad = tokenizer.pad_id_or_eos()? as i64;
    let rollout = RolloutWorker::new(
        policy.clone(),
        arr.rollout.clone(),
        arr.val_kwargs.clone(),
        vec![eos],
        pad,
    )?;
    let actor = ActorWorker::new(policy, arr.actor.clone(), n)?;
    let critic = match (cfg.algorithm.adv_estimator.needs_critic(), critic_init) {
        (true, Some(vm)) => Some(Box::new(CriticWorker::new(vm, cfg.critic.clone(), n)?)
            as Box<dyn rl_core::roles::Critic>),
        (true, None) => return Err("adv_estimator gae needs a critic model".into()),
        _ => None,
    };
    let reward = RuleReward::new(tokenizer.clone(), RewardRegistry::verl_default());
    let batches_per_epoch = train.0.batches_per_epoch();
    let roles = Roles {
        actor: Box::new(actor),
        rollout: Box::new(rollout),
        reference,
        critic,
        reward: Box::new(reward),
    };
    Ok(OnPolicyTrainer::new(
        cfg.on_policy(batches_per_epoch),
        roles,
        Box::new(train),
        val,
    )?)
}

/// SFT of `policy` on `task`'s train split for `steps` steps of `batch_size`; returns the SFT
/// trainer (its validation gives `val/loss`).
pub fn build_sft(
    task: &TinyTask,
    policy: SharedPolicy,
    actor_cfg: ActorConfig,
    steps: u64,
    seed: u64,
) -> AnyResult<SftTrainer> {
    let data = tiny_data_config(task, actor_cfg.ppo_mini_batch_size, seed);
    let train = Arc::new(RlDataset::train(&data)?);
    let val = Arc::new(RlDataset::val(&data)?);
    let source = SftSource::new(
        train,
        task.tokenizer.clone(),
        actor_cfg.ppo_mini_batch_size,
        seed,
    )?;
    let val_source = SftSource::new(val.clone(), task.tokenizer.clone(), val.len(), seed)?;
    let val_batch = val_source.batch(&(0..val.len()).collect::<Vec<_>>())?;
    let actor = ActorWorker::new(policy, actor_cfg, 1)?;
    Ok(SftTrainer::new(
        SftConfig {
            total_training_steps: steps,
        },
        Box::new(actor),
        Box::new(source),
        vec![val_batch],
    )?)
}

/// A fresh tiny policy (seeded init).
pub fn fresh_tiny_policy(vocab: i64, seed: i64) -> AnyResult<SharedPolicy> {
    tch::manual_seed(seed);
    Ok(share(CausalLm::new(
        &tiny_llama_config(vocab),
        Device::Cpu,
        Kind::Float,
    )?))
}

/// Loads a policy saved with `save_pretrained` into `dir`.
pub fn load_policy(dir: &Path) -> AnyResult<SharedPolicy> {
    Ok(share(CausalLm::from_pretrained(
        dir,
        Device::Cpu,
        Kind::Float,
    )?))
}

/// Parses verl's `algorithm` group; an unknown `adv_estimator` is an error naming
/// `algorithm.adv_estimator` and the valid names, any other bad key names itself.
pub fn parse_algorithm(v: &Value) -> AnyResult<AlgoConfig> {
    if let Some(name) = v.get("adv_estimator").and_then(Value::as_str) {
        name.parse::<rl_algos::AdvEstimator>()
            .map_err(|e| format!("algorithm.adv_estimator: {e}"))?;
    }
    serde_json::from_value(v.clone()).map_err(|e| format!("algorithm: {e}").into())
}

// ---- preference-test helpers (issue 8): appended block, owned by the preference tests ----

/// SFT of `policy` on `task` until the held-out loss first drops below `target` (checked every
/// 10 steps) or `max_steps` pass; returns the held-out losses (before training, then every 10
/// steps). The loss curve of the tiny task has a sharp transition whose step varies, so a loss
/// target gives a steadier starting accuracy than a fixed step count.
pub fn sft_until_loss(
    task: &TinyTask,
    policy: SharedPolicy,
    actor_cfg: ActorConfig,
    max_steps: u64,
    target: f64,
    seed: u64,
) -> AnyResult<Vec<f64>> {
    use rl_core::Trainer;
    let mut sft = build_sft(task, policy, actor_cfg, max_steps, seed)?;
    let mut losses = vec![sft.validate()?.0["val/loss"]];
    while sft.global_step() < max_steps {
        sft.step()?;
        if sft.global_step().is_multiple_of(10) {
            let loss = sft.validate()?.0["val/loss"];
            losses.push(loss);
            if loss < target {
                break;
            }
        }
    }
    Ok(losses)
}

// ---- end of the preference-test helpers ----
