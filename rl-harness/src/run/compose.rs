//! Composing an LLM trainer from the resolved config: the tokenizer and policy from
//! `actor_rollout_ref.model`, rl-data's loaders as the trainers' batch sources, the roles
//! (actor, rollout, reference, critic, rule reward) from rl-workers and rl-data, and the
//! trainer from rl-algos. Every check ([`crate::config::checks`]) runs before any model loads,
//! each error naming its key.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow, bail};
use rl_algos::trainer::{
    BatchSource, CombinedReward, DpoTrainer, OnPolicyTrainer, OnlineDpoTrainer, RefInit,
    ReferenceFactory, RewardPart, RmTrainer, Roles, SftConfig, SftTrainer, SpinTrainer,
    TrainValReward,
};
use rl_core::dist::SharedCollective;
use rl_core::roles::Reference;
use rl_core::{Batch, Trainer, keys};
use rl_data::reward::RewardRegistry;
use rl_data::reward::role::RuleReward;
use rl_data::{
    DataLoader, LoaderOptions, LoaderState, MultiturnConfig, PreferenceDataset, RlDataset, Sampler,
    SftDataConfig, SftDataset, Tokenizer,
};
use rl_workers::roles::{
    ActorWorker, BackgroundWorker, CriticWorker, ProgressHook, ReferenceWorker, RewardModelWorker,
    RmWorker, RolloutWorker, SharedPolicy, reward_model_from_lm_stack_in, share,
};
use rl_workers::{CausalLm, RewardModel, TextCodec, ToolEnv, ValueModel};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::config::checks::{check, check_groups, column_path, dpo_config, on_policy_config};
use crate::config::{ExperimentConfig, TrainerKind};

/// A trainer ready to drive, with the model it trains (to export it at the end).
pub struct Built {
    /// The trainer.
    pub trainer: Box<dyn Trainer>,
    /// The trained model, shared with the trainer's worker; `None` for the bandit.
    pub model: Option<TrainedModel>,
    /// The folder the model's tokenizer came from.
    pub source_dir: Option<PathBuf>,
    /// The device it trains on.
    pub device: Device,
}

impl std::fmt::Debug for Built {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Built")
            .field("global_step", &self.trainer.global_step())
            .field("source_dir", &self.source_dir)
            .finish_non_exhaustive()
    }
}

/// What a run trains and exports at the end as a Hugging Face folder (`<run dir>/model` and
/// `trainer.export_dir`): the handle shares the weights the trainer moves.
#[derive(Clone)]
pub enum TrainedModel {
    /// The policy (`*ForCausalLM`) of every LLM trainer but the reward model's.
    Policy(SharedPolicy),
    /// The reward model (`*ForSequenceClassification`, one label) of
    /// `trainer.algorithm = "reward_model"`, the folder `reward_model.model.path` loads.
    RewardModel(Arc<Mutex<RewardModel>>),
}

impl TrainedModel {
    /// What it is, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            TrainedModel::Policy(_) => "policy",
            TrainedModel::RewardModel(_) => "reward model",
        }
    }

    /// The name of the first weight (in name order) holding a NaN or an infinity, if any.
    pub fn first_non_finite(&self) -> Result<Option<String>> {
        let poisoned = || anyhow!("the {}'s lock is poisoned", self.name());
        let vars = match self {
            TrainedModel::Policy(p) => p.lock().map_err(|_| poisoned())?.var_store().variables(),
            TrainedModel::RewardModel(m) => {
                m.lock().map_err(|_| poisoned())?.var_store().variables()
            }
        };
        let mut names: Vec<&String> = vars.keys().collect();
        names.sort();
        Ok(names
            .into_iter()
            .find(|n| {
                let t = &vars[*n];
                t.is_floating_point() && t.isfinite().all().int64_value(&[]) == 0
            })
            .cloned())
    }

    /// `f` over the model's decoder stack, under the model's lock.
    fn with_stack<R>(&self, f: impl FnOnce(&rl_workers::Model) -> R) -> Result<R> {
        let poisoned = || anyhow!("the {}'s lock is poisoned", self.name());
        Ok(match self {
            TrainedModel::Policy(p) => f(p.lock().map_err(|_| poisoned())?.model()),
            TrainedModel::RewardModel(m) => f(m.lock().map_err(|_| poisoned())?.model()),
        })
    }

    /// ZeRO stage 3: gathers the whole weights (a collective: every rank calls it, rank 0
    /// to export them, the others to take part) until [`TrainedModel::release_whole`]. A
    /// no-op when the weights are whole.
    pub fn gather_whole(&self) -> Result<()> {
        self.with_stack(rl_workers::Model::gather_whole)?
            .with_context(|| format!("gathering the {}'s sharded weights", self.name()))
    }

    /// Ends [`TrainedModel::gather_whole`].
    pub fn release_whole(&self) -> Result<()> {
        self.with_stack(rl_workers::Model::release_whole)
    }

    /// Writes `config.json` and the weights into `out`.
    fn save_pretrained(&self, out: &Path) -> Result<()> {
        let poisoned = || anyhow!("the {}'s lock is poisoned", self.name());
        match self {
            TrainedModel::Policy(p) => {
                let lm = p.lock().map_err(|_| poisoned())?;
                // a LoRA policy: merged weights (a plain folder), plus the adapter in PEFT's
                // format under `adapter/`
                lm.save_pretrained(out).and_then(|()| match lm.lora() {
                    Some(_) => lm.save_adapter(out.join("adapter"), None),
                    None => Ok(()),
                })
            }
            TrainedModel::RewardModel(m) => m.lock().map_err(|_| poisoned())?.save_pretrained(out),
        }
        .with_context(|| format!("exporting the {} to {}", self.name(), out.display()))
    }
}

/// The run's tokenizer as the multi-turn rollout's codec (no special tokens added, none
/// skipped). It wraps rl-data's `Tokenizer`, not the `tokenizers` one rl-workers implements the
/// codec for, so that observations are encoded exactly as training encodes text.
#[derive(Debug)]
struct TokenizerCodec(Arc<Tokenizer>);

impl TextCodec for TokenizerCodec {
    fn encode(&self, text: &str) -> std::result::Result<Vec<i64>, String> {
        let ids = self.0.encode(text, false).map_err(|e| e.to_string())?;
        Ok(ids.into_iter().map(i64::from).collect())
    }

    fn decode(&self, ids: &[i64]) -> std::result::Result<String, String> {
        let ids = rl_workers::token_ids_u32(ids)?;
        self.0.decode(&ids, false).map_err(|e| e.to_string())
    }
}

/// The tools of `actor_rollout_ref.rollout.multi_turn` built from their specs (rl-tools), with
/// the run's tokenizer; `None` when multi-turn is off.
pub fn tool_env(cfg: &ExperimentConfig, tokenizer: &Arc<Tokenizer>) -> Result<Option<ToolEnv>> {
    let mt = &cfg.actor_rollout_ref.multi_turn;
    if !mt.enable {
        return Ok(None);
    }
    let tools = mt
        .tools
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            rl_tools::build_tool(spec).with_context(|| {
                format!("config key `actor_rollout_ref.rollout.multi_turn.tools[{i}]`")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let env = ToolEnv::new(
        tools,
        Arc::new(TokenizerCodec(tokenizer.clone())),
        mt.limits(),
    )
    .map_err(|e| anyhow!("config group `actor_rollout_ref.rollout`: {e}"))?;
    Ok(Some(env))
}

/// Builds the trainer `cfg` selects, on `device`; `tch::manual_seed(trainer.seed)` first, so
/// fresh heads start the same every time.
pub fn build(
    cfg: &ExperimentConfig,
    device: Device,
    progress: Option<ProgressHook>,
) -> Result<Built> {
    build_with_group(cfg, device, progress, None)
}

/// [`build`] as one rank of the data-parallel `group` (`docs/distributed.md`): the sources
/// yield this rank's share of each global batch, the actor and critic average their gradients
/// over the group, the trainer reduces its metrics. The on-policy, SFT, DPO (offline and
/// online), SPIN and reward-model trainers are data-parallel; the bandit is refused with more
/// than one rank.
pub fn build_with_group(
    cfg: &ExperimentConfig,
    device: Device,
    progress: Option<ProgressHook>,
    group: Option<&SharedCollective>,
) -> Result<Built> {
    check(cfg)?;
    let world = match group {
        Some(g) => rl_core::dist::lock(g)?.world_size(),
        None => 1,
    };
    if world > 1 && !cfg.trainer.algorithm.is_data_parallel() {
        bail!("{}", cfg.trainer.algorithm.not_data_parallel());
    }
    // not held across the build (`rl_workers::hold_generator`): joining a group broadcasts,
    // and a rank must not wait on a collective while holding a process-wide lock; `harness`
    // builds on one thread, so the seeded draws below are its own
    tch::manual_seed(cfg.trainer.seed as i64);
    let dir = cfg.actor_rollout_ref.model.path.clone();
    let kind = cfg.actor_rollout_ref.model.dtype.kind();
    let tok_dir = cfg.data.tokenizer.clone().unwrap_or_else(|| dir.clone());
    let tokenizer = Arc::new(
        Tokenizer::from_dir(&tok_dir)
            .with_context(|| format!("loading the tokenizer of {}", tok_dir.display()))?,
    );
    if cfg.trainer.algorithm == TrainerKind::RewardModel {
        // trains a reward model from the policy's folder: the reward model is exported
        let (trainer, model) = build_reward_model_in(cfg, device, &tokenizer, group)?;
        return Ok(Built {
            trainer: Box::new(trainer),
            model: Some(TrainedModel::RewardModel(model)),
            source_dir: Some(tok_dir),
            device,
        });
    }
    let policy = share(load_policy(cfg, device)?);
    let trainer: Box<dyn Trainer> = match cfg.trainer.algorithm {
        TrainerKind::Sft => Box::new(build_sft_in(cfg, policy.clone(), &tokenizer, group)?),
        TrainerKind::OnPolicy => {
            let critic = if cfg.algorithm.adv_estimator.needs_critic() {
                let path = cfg.critic.model.path.clone().unwrap_or_else(|| dir.clone());
                let lora = cfg.critic.model.lora("critic.model")?;
                let base =
                    frozen_base_kind(lora.is_some(), &cfg.critic.worker.mixed_precision, kind);
                let mut critic = ValueModel::from_pretrained_stack_in(&path, device, kind, base)
                    .with_context(|| format!("loading critic.model.path {}", path.display()))?;
                if let Some(lora) = lora {
                    critic
                        .add_lora_in(&lora, kind)
                        .context("critic.model.lora_rank")?;
                }
                Some(critic)
            } else {
                None
            };
            Box::new(build_on_policy_in(
                cfg,
                policy.clone(),
                critic,
                &tokenizer,
                progress,
                group,
            )?)
        }
        TrainerKind::Dpo => Box::new(build_dpo_in(cfg, policy.clone(), &tokenizer, group)?),
        TrainerKind::OnlineDpo => Box::new(build_online_dpo_in(
            cfg,
            policy.clone(),
            &tokenizer,
            progress,
            group,
        )?),
        TrainerKind::Spin => Box::new(build_spin_in(
            cfg,
            policy.clone(),
            &tokenizer,
            device,
            progress,
            group,
        )?),
        TrainerKind::RewardModel => bail!("the reward-model trainer is built above"),
        TrainerKind::Bandit => bail!("the bandit trainer is built by the harness itself"),
    };
    Ok(Built {
        trainer,
        model: Some(TrainedModel::Policy(policy)),
        source_dir: Some(tok_dir),
        device,
    })
}

/// The policy of `actor_rollout_ref.model`: its weights from `path` in `dtype`, with LoRA
/// adapters when `lora_rank` > 0 (fresh, PEFT's initialisation) or `lora_adapter_path` is set
/// (that adapter, whose rank, alpha and targets are used).
///
/// With LoRA under the actor's mixed precision the frozen base is loaded straight in the compute
/// dtype and only the adapters in `model.dtype` (float32, the masters' source): the actor's
/// optimizer copies the masters and casts the adapters (`AdamW::for_model`), so the numbers are
/// those of loading everything in float32 and casting, without a float32 copy of the base.
pub fn load_policy(cfg: &ExperimentConfig, device: Device) -> Result<CausalLm> {
    let m = &cfg.actor_rollout_ref.model;
    let lora = m.lora()?;
    let adapter_kind = m.dtype.kind();
    let base_kind = frozen_base_kind(
        lora.is_some() || m.lora_adapter_path.is_some(),
        &cfg.actor_rollout_ref.actor.mixed_precision,
        adapter_kind,
    );
    let mut lm = CausalLm::from_pretrained(&m.path, device, base_kind)
        .with_context(|| format!("loading actor_rollout_ref.model.path {}", m.path.display()))?;
    match (&m.lora_adapter_path, lora) {
        (Some(adapter), lora) => {
            let from_file = rl_workers::lora::read_adapter_config(adapter)?;
            if let Some(l) = &lora
                && l.rank != from_file.rank
            {
                bail!(
                    "config key `actor_rollout_ref.model.lora_rank`: {} differs from the rank {} of the adapter in lora_adapter_path {} (leave lora_rank at 0 or set it to {})",
                    l.rank,
                    from_file.rank,
                    adapter.display(),
                    from_file.rank
                );
            }
            lm.add_lora_in(
                &rl_workers::LoraConfig {
                    dropout: m.lora_dropout,
                    ..from_file
                },
                adapter_kind,
            )
            .context("actor_rollout_ref.model.lora_adapter_path")?;
            lm.load_adapter(adapter).with_context(|| {
                format!(
                    "loading actor_rollout_ref.model.lora_adapter_path {}",
                    adapter.display()
                )
            })?;
        }
        (None, Some(lora)) => lm
            .add_lora_in(&lora, adapter_kind)
            .context("actor_rollout_ref.model.target_modules")?,
        (None, None) => {}
    }
    Ok(lm)
}

/// The dtype a model's base is loaded in: with LoRA under mixed precision the frozen base goes
/// straight to the compute dtype (its float32 copy would only be cast), while the trained
/// variables (adapters, a score head) stay in `kind`, float32, the masters' source
/// (`AdamW::for_model` casts them); otherwise `kind`.
fn frozen_base_kind(
    lora: bool,
    mp: &rl_workers::roles::MixedPrecision,
    kind: tch::Kind,
) -> tch::Kind {
    if lora && mp.enabled() && kind == tch::Kind::Float {
        mp.kind()
    } else {
        kind
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
        let s: LoaderState = serde_json::from_value(state.clone()).map_err(|e| role_err(&e))?;
        self.0.load_state(s).map_err(data_err)
    }
}

fn data_err(e: rl_data::Error) -> rl_core::Error {
    rl_core::Error::Role {
        role: "data",
        source: Box::new(e),
    }
}

fn role_err(e: &dyn std::fmt::Display) -> rl_core::Error {
    rl_core::Error::Role {
        role: "loader",
        source: e.to_string().into(),
    }
}

/// Left-pads prompts and right-pads responses into the rollout layout (`input_ids`,
/// `attention_mask`, `position_ids`, `prompts`, `responses`, `response_mask`).
pub fn rollout_layout(prompts: &[Vec<u32>], responses: &[Vec<u32>], pad: u32) -> Result<Batch> {
    let (p_ids, p_mask, p_pos) = rl_data::collate_left_padded(prompts, pad, None)?;
    let b = prompts.len() as i64;
    let width = responses.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let mut r = vec![i64::from(pad); b as usize * width];
    let mut m = vec![0f32; b as usize * width];
    for (i, resp) in responses.iter().enumerate() {
        for (j, &t) in resp.iter().enumerate() {
            r[i * width + j] = i64::from(t);
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

/// SFT batches from a parquet read as [`sft_rows`] reads it: the prompt rendered with the chat
/// template and the generation prompt, the response the row's target plus eos (or a whole
/// conversation, split before its first trained token), in the rollout layout so the actor's
/// SFT loss reads `response_mask` (and `loss_mask` where some response tokens are not trained).
#[derive(Debug)]
pub struct SftSource {
    dataset: Arc<SftDataset>,
    tokenizer: Arc<Tokenizer>,
    sampler: Sampler,
    /// `sft.mask_tags`: tool observations in the responses, masked out of the loss.
    mask_tags: Vec<String>,
}

impl SftSource {
    /// Shuffled batches of `batch_size` rows per epoch, seeded with `seed`.
    pub fn new(
        dataset: Arc<SftDataset>,
        tokenizer: Arc<Tokenizer>,
        batch_size: usize,
        seed: u64,
    ) -> Result<Self> {
        let sampler = Sampler::new(dataset.len(), batch_size, true, true, seed)?;
        Ok(SftSource {
            dataset,
            tokenizer,
            sampler,
            mask_tags: Vec::new(),
        })
    }

    /// Masks the `<tag>…</tag>` spans of `tags` in every response out of the loss (a
    /// `loss_mask` key), tokenising the responses segment by segment as the multi-turn rollout
    /// does; see [`rl_data::observation_segments`].
    pub fn with_mask_tags(mut self, tags: Vec<String>) -> Self {
        self.mask_tags = tags;
        self
    }

    /// Batches per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.sampler.batches_per_epoch()
    }

    /// The batch of rows `idx`.
    pub fn batch(&self, idx: &[usize]) -> Result<Batch> {
        let mut prompts = Vec::with_capacity(idx.len());
        let mut responses = Vec::with_capacity(idx.len());
        let mut trained = Vec::with_capacity(idx.len());
        for &i in idx {
            let ex = self
                .dataset
                .example_masking(i, &self.tokenizer, &self.mask_tags)?;
            let (p, r) = split_example(&ex);
            if p.is_empty() {
                let (path, row) = self.dataset.source(i)?;
                bail!(
                    "{}: row {row}: no prompt token is left before the first trained token (the \
                     response alone is longer than `sft.max_length` under `sft.truncation = \
                     \"left\"`, or the conversation starts with an assistant turn)",
                    path.display()
                );
            }
            trained.push(ex.loss_mask[p.len()..].to_vec());
            prompts.push(p);
            responses.push(r);
        }
        let mut batch = rollout_layout(&prompts, &responses, self.tokenizer.pad_id_or_eos()?)?;
        if trained.iter().flatten().any(|&m| m == 0) {
            let seq_len = batch.get(keys::INPUT_IDS)?.size()[1];
            let prompt_len = (seq_len - batch.get(keys::RESPONSES)?.size()[1]) as usize;
            let mut loss = vec![0i64; idx.len() * seq_len as usize];
            for (r, flags) in trained.iter().enumerate() {
                for (t, &m) in flags.iter().enumerate() {
                    loss[r * seq_len as usize + prompt_len + t] = i64::from(m);
                }
            }
            let loss = Tensor::from_slice(&loss).view([idx.len() as i64, seq_len]);
            batch.insert(keys::LOSS_MASK, loss)?;
        }
        Ok(batch)
    }
}

/// The SFT rows of `files` (`data.train_files` or `data.val_files`, at most `cap`), read as
/// the `sft` group says: a prompt (`sft.prompt_key`, else `data.prompt_key`) and a response
/// (`sft.response_key`) per row, or a conversation (`sft.messages_key`), under
/// `sft.max_length` and `sft.truncation`.
pub fn sft_rows(
    cfg: &ExperimentConfig,
    files: &[PathBuf],
    files_key: &str,
    cap: Option<usize>,
) -> Result<SftDataset> {
    if files.is_empty() {
        bail!("config key `{files_key}`: no files given");
    }
    let sft = &cfg.sft;
    let prompt_key = sft.prompt_key.as_deref().unwrap_or(&cfg.data.prompt_key);
    let (prompt_key, prompt_dict_keys) = column_path("sft.prompt_key", prompt_key)?;
    let (response_key, response_dict_keys) = column_path("sft.response_key", &sft.response_key)?;
    let data = SftDataConfig {
        train_files: Vec::new(),
        val_files: Vec::new(),
        prompt_key,
        prompt_dict_keys,
        response_key,
        response_dict_keys,
        multiturn: MultiturnConfig {
            enable: sft.messages_key.is_some(),
            messages_key: sft.messages_key.clone().unwrap_or_default(),
        },
        max_length: sft.max_length.unwrap_or(usize::MAX),
        truncation: sft.truncation,
        train_batch_size: sft.train_batch_size,
        train_max_samples: cap.map_or(-1, |c| c as i64),
    };
    Ok(SftDataset::open(files, &data)?.in_group("sft"))
}

/// [`sft_rows`] of `data.train_files` (capped by `data.train_max_samples`).
pub fn sft_train_rows(cfg: &ExperimentConfig) -> Result<SftDataset> {
    sft_rows(
        cfg,
        &cfg.data.train_files,
        "data.train_files",
        cfg.data.train_cap(),
    )
}

/// [`sft_rows`] of `data.val_files` (capped by `data.val_max_samples`).
pub fn sft_val_rows(cfg: &ExperimentConfig) -> Result<SftDataset> {
    sft_rows(
        cfg,
        &cfg.data.val_files,
        "data.val_files",
        cfg.data.val_cap(),
    )
}

impl BatchSource for SftSource {
    fn next_batch(&mut self) -> rl_core::Result<Batch> {
        let idx = next_indices(&mut self.sampler)?;
        self.batch(&idx).map_err(data_err_any)
    }
    fn state(&self) -> Value {
        sampler_state(&self.sampler)
    }
    fn load_state(&mut self, state: &Value) -> rl_core::Result<()> {
        load_sampler_state(&mut self.sampler, state)
    }
}

/// The next batch's row indices, starting the next epoch when one ends.
fn next_indices(sampler: &mut Sampler) -> rl_core::Result<Vec<usize>> {
    match sampler.next_indices() {
        Some((idx, _)) => Ok(idx),
        None => sampler
            .next_indices()
            .map(|(i, _)| i)
            .ok_or_else(|| rl_core::Error::Role {
                role: "data",
                source: "an epoch produced no batch".into(),
            }),
    }
}

fn sampler_state(sampler: &Sampler) -> Value {
    serde_json::to_value(sampler.state()).unwrap_or(Value::Null)
}

fn load_sampler_state(sampler: &mut Sampler, state: &Value) -> rl_core::Result<()> {
    let s: LoaderState = serde_json::from_value(state.clone()).map_err(|e| role_err(&e))?;
    sampler.load_state(s).map_err(data_err)
}

fn data_err_any(e: anyhow::Error) -> rl_core::Error {
    rl_core::Error::Role {
        role: "data",
        source: e.into(),
    }
}

/// An SFT example split at its first loss token into (prompt, response) ids.
fn split_example(ex: &rl_data::SftExample) -> (Vec<u32>, Vec<u32>) {
    let split = ex
        .loss_mask
        .iter()
        .position(|&m| m == 1)
        .unwrap_or(ex.input_ids.len());
    (
        ex.input_ids[..split].to_vec(),
        ex.input_ids[split..].to_vec(),
    )
}

/// The training loader and the validation batches of `cfg.data`.
pub fn loaders(
    cfg: &ExperimentConfig,
    tokenizer: &Arc<Tokenizer>,
) -> Result<(LoaderSource, Vec<Batch>)> {
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
    progress: Option<ProgressHook>,
) -> Result<OnPolicyTrainer> {
    build_on_policy_in(cfg, policy, critic_init, tokenizer, progress, None)
}

/// `(rank, world_size)` of `group`, `(0, 1)` without one.
fn rank_world(group: Option<&SharedCollective>) -> Result<(usize, usize)> {
    Ok(match group {
        Some(g) => {
            let g = rl_core::dist::lock(g)?;
            (g.rank(), g.world_size())
        }
        None => (0, 1),
    })
}

/// [`build_on_policy`] as one rank of `group`: the loader yields this rank's share of every
/// global batch, actor and critic average their gradients, the trainer gathers the advantage
/// inputs and reduces its metrics.
pub fn build_on_policy_in(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    critic_init: Option<ValueModel>,
    tokenizer: &Arc<Tokenizer>,
    progress: Option<ProgressHook>,
    group: Option<&SharedCollective>,
) -> Result<OnPolicyTrainer> {
    check_groups(cfg, TrainerKind::OnPolicy)?;
    let (mut train, val) = loaders(cfg, tokenizer)?;
    let (rank, world) = rank_world(group)?;
    if group.is_some() {
        train.0 = train.0.with_shard(rank, world)?;
    }
    let arr = &cfg.actor_rollout_ref;
    let n = arr.rollout.n;
    let eos = tokenizer
        .eos_token_id()
        .ok_or_else(|| anyhow!("the tokenizer has no eos token (tokenizer_config.json)"))?;
    let pad = tokenizer.pad_id_or_eos()?;
    let mut rollout = with_progress(
        RolloutWorker::new(
            policy.clone(),
            arr.rollout.clone(),
            arr.val_kwargs.clone(),
            vec![i64::from(eos)],
            i64::from(pad),
        )?,
        progress,
    );
    if let Some(env) = tool_env(cfg, tokenizer)? {
        rollout = rollout.with_tools(env)?;
    }
    let policy_device = policy
        .lock()
        .map_err(|_| anyhow!("the policy's lock is poisoned"))?
        .device();
    let background_policy = policy.clone();
    let batches_per_epoch = train.0.batches_per_epoch();
    let steps = cfg
        .trainer
        .total_training_steps
        .unwrap_or(cfg.trainer.total_epochs * batches_per_epoch as u64);
    // the actor first: with mixed precision it casts the shared weights to their compute
    // dtype, which the reference's copy must have too
    let mut actor = ActorWorker::new(policy, actor_config(cfg, steps), n)?;
    if let Some(g) = group {
        actor = actor.with_group(g.clone())?;
    }
    let need_ref = arr.actor_loss.use_kl_loss || cfg.algorithm.use_kl_in_reward;
    let reference = if need_ref {
        Some(Box::new(shard_reference(
            ReferenceWorker::from_policy(&actor.policy(), arr.ref_micro_batch_size)?
                .with_packing(arr.model.use_remove_padding, arr.actor.use_prefix_grouper),
            cfg,
            group,
        )?) as Box<dyn rl_core::roles::Reference>)
    } else {
        None
    };
    let critic = match (cfg.algorithm.adv_estimator.needs_critic(), critic_init) {
        (true, Some(vm)) => {
            let mut ccfg = cfg.critic.worker.clone();
            ccfg.use_remove_padding = cfg.critic.model.use_remove_padding;
            ccfg.optim = ccfg.optim.spanning(steps);
            let mut c = CriticWorker::new(vm, ccfg, n)?;
            if let Some(g) = group {
                c = c.with_group(g.clone())?;
            }
            Some(Box::new(c) as Box<dyn rl_core::roles::Critic>)
        }
        (true, None) => bail!("algorithm.adv_estimator = \"gae\" needs a critic model"),
        _ => None,
    };
    let reward = reward_role(cfg, &policy_device, tokenizer)?;
    let roles = Roles {
        actor: Box::new(actor),
        rollout: Box::new(rollout),
        reference,
        critic,
        reward,
    };
    let mut trainer = OnPolicyTrainer::new(
        on_policy_config(cfg, batches_per_epoch),
        roles,
        Box::new(train),
        val,
    )?;
    if let Some(g) = group {
        trainer = trainer.with_group(g.clone())?;
    }
    if cfg.async_training.enable {
        let rc = &cfg.algorithm.rollout_correction;
        if cfg.async_training.max_staleness > 0 && !rc.bypass_mode && rc.rollout_is.is_none() {
            crate::note!(
                "harness: note: async_training.max_staleness = {}: samples up to that many policy \
                 versions old are trained on as if the current policy drew them (no \
                 algorithm.rollout_correction); on the quickstart this collapsed learning, and \
                 algorithm.rollout_correction.bypass_mode = true (PPO's ratio against the policy \
                 that drew them) learned as the synchronous run did (docs/async.md)",
                cfg.async_training.max_staleness
            );
        }
        // built last: the replica's construction draws from torch's generator, which no model
        // built after it may see moved
        let background = BackgroundWorker::new(
            &background_policy,
            arr.rollout.clone(),
            arr.val_kwargs.clone(),
            vec![i64::from(eos)],
            i64::from(pad),
            match cfg.async_training.rollout_threads {
                0 => None,
                n => Some(i32::try_from(n).map_err(|_| {
                    anyhow!("config key `async_training.rollout_threads`: {n} is too many threads")
                })?),
            },
        )?;
        trainer = trainer.with_background_rollout(Box::new(background))?;
    }
    Ok(trainer)
}

/// verl's `data_source` table of rule rewards with the experiment's `reward` group on top; or,
/// when set, `custom_reward_function.path` (its Python workers started and the file loaded
/// now) or `reward.remote_url` scoring every row.
pub fn rule_rewards(cfg: &ExperimentConfig) -> Result<RewardRegistry> {
    RewardRegistry::build(&cfg.reward, &cfg.custom_reward_function)
        .context("config groups `reward` and `custom_reward_function`")
}

/// The reward role of `reward_model`: the rule reward of each row's `data_source`, or, when
/// `reward_model.enable`, `rm_coef * rm_score + rule_coef * rule_score` from a reward model
/// (`reward_model.model.path`) and the rule for training, and the rule alone for validation
/// (verl's `val_reward_fn`), so `val/test_score/*` stays the task's score.
pub fn reward_role(
    cfg: &ExperimentConfig,
    device: &Device,
    tokenizer: &Arc<Tokenizer>,
) -> Result<Box<dyn rl_core::roles::Reward>> {
    let rule = Box::new(RuleReward::new(tokenizer.clone(), rule_rewards(cfg)?));
    let rm = &cfg.reward_model;
    if !rm.own.enable {
        return Ok(rule);
    }
    let path = rm.own.model.path.clone().ok_or_else(|| {
        anyhow!("config key `reward_model.model.path`: reward_model.enable = true needs a reward model folder")
    })?;
    let worker = RewardModelWorker::from_pretrained(
        &path,
        *device,
        cfg.actor_rollout_ref.model.dtype.kind(),
        rm.worker.clone(),
    )
    .with_context(|| format!("loading reward_model.model.path {}", path.display()))?;
    let val = rule.clone();
    let train = CombinedReward::new(vec![
        RewardPart {
            name: "rm".into(),
            weight: rm.own.rm_coef,
            reward: Box::new(worker),
        },
        RewardPart {
            name: "rule".into(),
            weight: rm.own.rule_coef,
            reward: rule,
        },
    ])?;
    // validation scores with the rule reward alone, as verl's `val_reward_fn`
    Ok(Box::new(TrainValReward {
        train: Box::new(train),
        val,
    }))
}

/// Builds the SFT trainer of `cfg`: `data.train_files` rows with their `sft.response_key`
/// targets, `sft.train_batch_size` rows a step, validated on `data.val_files`.
pub fn build_sft(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    tokenizer: &Arc<Tokenizer>,
) -> Result<SftTrainer> {
    build_sft_in(cfg, policy, tokenizer, None)
}

/// [`build_sft`] as one rank of `group`: `sft.train_batch_size` is the global batch, each
/// rank trains on its contiguous share of it.
pub fn build_sft_in(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    tokenizer: &Arc<Tokenizer>,
    group: Option<&SharedCollective>,
) -> Result<SftTrainer> {
    check_groups(cfg, TrainerKind::Sft)?;
    let seed = cfg.data.seed.unwrap_or(cfg.trainer.seed);
    let bs = cfg.sft.train_batch_size;
    let train = Arc::new(sft_train_rows(cfg)?);
    let tags = cfg.sft.mask_tags.clone();
    let mut source =
        SftSource::new(train, tokenizer.clone(), bs, seed)?.with_mask_tags(tags.clone());
    let (rank, world) = rank_world(group)?;
    if group.is_some() {
        source
            .sampler
            .set_shard(rank, world)
            .map_err(|e| anyhow!("sft.train_batch_size: {e}"))?;
    }
    let total = cfg
        .trainer
        .total_training_steps
        .unwrap_or(cfg.trainer.total_epochs * source.batches_per_epoch() as u64);
    // no validation files (verl's `val_files: null`): no validation
    let val_batches = if cfg.data.val_files.is_empty() {
        Vec::new()
    } else {
        let val = Arc::new(sft_val_rows(cfg)?);
        let val_source =
            SftSource::new(val.clone(), tokenizer.clone(), bs, seed)?.with_mask_tags(tags);
        let val_bs = cfg.data.val_batch_size.unwrap_or(bs).max(1);
        let all: Vec<usize> = (0..val.len()).collect();
        all.chunks(val_bs)
            .map(|idx| val_source.batch(idx))
            .collect::<Result<Vec<_>>>()?
    };
    let mut actor = ActorWorker::new(policy, actor_config(cfg, total), 1)?;
    if let Some(g) = group {
        actor = actor.with_group(g.clone())?;
    }
    let trainer = SftTrainer::new(
        SftConfig {
            total_training_steps: total,
        },
        Box::new(actor),
        Box::new(source),
        val_batches,
    )?;
    Ok(match group {
        Some(g) => trainer.with_group(g.clone(), bs)?,
        None => trainer,
    })
}

/// Writes the trained policy as a Hugging Face folder: weights and `config.json` from the
/// policy, the tokenizer files copied from `source_dir`.
pub fn export_policy(policy: &SharedPolicy, source_dir: &Path, out: &Path) -> Result<()> {
    export_model(&TrainedModel::Policy(policy.clone()), source_dir, out)
}

/// Writes a trained model as a Hugging Face folder: weights and `config.json` from the model
/// (a reward model's with its one-label `score` head), the tokenizer files copied from
/// `source_dir`.
pub fn export_model(model: &TrainedModel, source_dir: &Path, out: &Path) -> Result<()> {
    if let Some(name) = model.first_non_finite()? {
        bail!(
            "not exporting the {} to {}: weight `{name}` holds NaN or infinite values",
            model.name(),
            out.display()
        );
    }
    model.save_pretrained(out)?;
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
    ] {
        let from = source_dir.join(name);
        if from.is_file() && !out.join(name).exists() {
            std::fs::copy(&from, out.join(name))
                .with_context(|| format!("copying {} to {}", from.display(), out.display()))?;
        }
    }
    Ok(())
}

/// The tiny Llama of the quickstart and the tests: hidden 64, 2 layers, 4 heads, tied
/// embeddings, eos `<|im_end|>` (3) and pad 0 of the character-level tokenizer.
pub fn tiny_llama_config(vocab: i64) -> rl_workers::Config {
    let mut cfg = rl_workers::Config::tiny();
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

/// Writes the character-level tokenizer and a tiny Llama initialised with `seed` into `dir`
/// as a Hugging Face folder; returns the parameter count. A `noise` > 0 then multiplies every
/// weight by `1 + noise * N(0, 1)` (drawn after the initialisation, from the same seeded
/// stream): the same model up to a relative perturbation, to check that a training recipe does
/// not ride one exact float trajectory (`scripts/learning-report`).
pub fn init_tiny(dir: &Path, seed: i64, noise: f64) -> Result<i64> {
    if !(noise >= 0.0 && noise.is_finite()) {
        bail!("--noise: must be a finite number >= 0, got {noise}");
    }
    let vocab = rl_data::tasks::tiny_vocab::write_tiny_tokenizer(dir)
        .with_context(|| format!("writing the tiny tokenizer to {}", dir.display()))?;
    let _generator = rl_workers::hold_generator();
    tch::manual_seed(seed);
    let lm = CausalLm::new(&tiny_llama_config(vocab as i64), Device::Cpu, Kind::Float)?;
    if noise > 0.0 {
        tch::no_grad(|| {
            for mut v in lm.var_store().trainable_variables() {
                let factor = v.randn_like() * noise + 1.0;
                let _ = v.f_mul_(&factor)?;
            }
            Ok::<_, tch::TchError>(())
        })?;
    }
    lm.save_pretrained(dir)
        .with_context(|| format!("writing the tiny model to {}", dir.display()))?;
    let params = lm
        .var_store()
        .trainable_variables()
        .iter()
        .map(Tensor::numel)
        .sum::<usize>();
    Ok(params as i64)
}

/// Builds the reward-model trainer of `cfg` (`trainer.algorithm = "reward_model"`): a
/// `*ForSequenceClassification` model from `actor_rollout_ref.model.path` with a fresh
/// one-label head (seeded by `trainer.seed` in [`build`]), trained with Bradley–Terry on
/// `preference_data`'s pairs (`reward_model.train`), validated on its `val_files`. Its
/// checkpoints hold `rm/`, the folder `reward_model.model.path` loads.
pub fn build_reward_model(
    cfg: &ExperimentConfig,
    device: Device,
    tokenizer: &Arc<Tokenizer>,
) -> Result<RmTrainer> {
    Ok(build_reward_model_in(cfg, device, tokenizer, None)?.0)
}

/// `preference_data`'s pairs: the training source (this rank's contiguous share of every
/// global batch of `preference_data.train_batch_size` pairs when `group` is set) and the
/// validation pairs in batches of the same size.
fn preference_sources(
    cfg: &ExperimentConfig,
    tokenizer: &Arc<Tokenizer>,
    group: Option<&SharedCollective>,
) -> Result<(PreferenceSource, Vec<Batch>)> {
    let p = &cfg.preference_data;
    let open = |files: &[PathBuf], what: &str| {
        PreferenceDataset::open(files, p)
            .map(Arc::new)
            .with_context(|| format!("reading preference_data.{what}"))
    };
    let train = open(&p.train_files, "train_files")?;
    let val = open(&p.val_files, "val_files")?;
    let seed = cfg.data.seed.unwrap_or(cfg.trainer.seed);
    let mut source = PreferenceSource::new(train, tokenizer.clone(), p.train_batch_size, seed)?;
    let (rank, world) = rank_world(group)?;
    if group.is_some() {
        source
            .sampler
            .set_shard(rank, world)
            .map_err(|e| anyhow!("preference_data.train_batch_size: {e}"))?;
    }
    let val_source = PreferenceSource::new(val.clone(), tokenizer.clone(), 1, seed)?;
    let all: Vec<usize> = (0..val.len()).collect();
    let val_batches = all
        .chunks(p.train_batch_size)
        .map(|idx| val_source.batch(idx))
        .collect::<Result<Vec<_>>>()?;
    Ok((source, val_batches))
}

/// [`build_reward_model`] as one rank of `group` (`preference_data.train_batch_size` pairs is
/// the global batch, each rank trains on its contiguous share of the pairs), with the trained
/// model's handle, which a finished run exports.
pub fn build_reward_model_in(
    cfg: &ExperimentConfig,
    device: Device,
    tokenizer: &Arc<Tokenizer>,
    group: Option<&SharedCollective>,
) -> Result<(RmTrainer, Arc<Mutex<RewardModel>>)> {
    check_groups(cfg, TrainerKind::RewardModel)?;
    let (source, val_batches) = preference_sources(cfg, tokenizer, group)?;
    let steps = cfg
        .trainer
        .total_training_steps
        .unwrap_or(cfg.trainer.total_epochs * source.sampler.batches_per_epoch() as u64);
    let dir = &cfg.actor_rollout_ref.model.path;
    let rm = &cfg.reward_model.own.train;
    let lora = cfg.actor_rollout_ref.model.lora()?;
    let kind = cfg.actor_rollout_ref.model.dtype.kind();
    let base = frozen_base_kind(lora.is_some(), &rm.mixed_precision, kind);
    let mut model = reward_model_from_lm_stack_in(dir, device, kind, base)
        .with_context(|| format!("loading actor_rollout_ref.model.path {}", dir.display()))?;
    if let Some(lora) = lora {
        model
            .add_lora_in(&lora, kind)
            .context("actor_rollout_ref.model.target_modules")?;
    }
    let mut wcfg = rm.worker(cfg.preference_data.train_batch_size);
    wcfg.optim = wcfg.optim.spanning(steps);
    let mut worker = RmWorker::new(model, wcfg)?;
    if let Some(g) = group {
        worker = worker.with_group(g.clone())?;
    }
    let model = worker.model();
    let trainer = RmTrainer::new(
        rm.trainer(steps),
        Box::new(worker),
        Box::new(source),
        val_batches,
    )?;
    let trainer = match group {
        Some(g) => trainer.with_group(g.clone(), cfg.preference_data.train_batch_size)?,
        None => trainer,
    };
    Ok((trainer, model))
}

/// Offline DPO pairs from a TRL-schema parquet, each batch `[chosen_0, rejected_0, chosen_1,
/// ...]` in the rollout layout.
#[derive(Debug)]
pub struct PreferenceSource {
    dataset: Arc<PreferenceDataset>,
    tokenizer: Arc<Tokenizer>,
    sampler: Sampler,
}

impl PreferenceSource {
    /// Shuffled batches of `pairs` pairs per epoch, seeded with `seed`.
    pub fn new(
        dataset: Arc<PreferenceDataset>,
        tokenizer: Arc<Tokenizer>,
        pairs: usize,
        seed: u64,
    ) -> Result<Self> {
        let sampler = Sampler::new(dataset.len(), pairs, true, true, seed)?;
        Ok(PreferenceSource {
            dataset,
            tokenizer,
            sampler,
        })
    }

    /// The interleaved pairs of rows `idx`.
    pub fn batch(&self, idx: &[usize]) -> Result<Batch> {
        let mut prompts = Vec::with_capacity(2 * idx.len());
        let mut responses = Vec::with_capacity(2 * idx.len());
        for &i in idx {
            let ex = self.dataset.example(i, &self.tokenizer)?;
            for side in [ex.chosen, ex.rejected] {
                let (p, r) = split_example(&side);
                prompts.push(p);
                responses.push(r);
            }
        }
        rollout_layout(&prompts, &responses, self.tokenizer.pad_id_or_eos()?)
    }
}

impl BatchSource for PreferenceSource {
    fn next_batch(&mut self) -> rl_core::Result<Batch> {
        let idx = next_indices(&mut self.sampler)?;
        self.batch(&idx).map_err(data_err_any)
    }
    fn state(&self) -> Value {
        sampler_state(&self.sampler)
    }
    fn load_state(&mut self, state: &Value) -> rl_core::Result<()> {
        load_sampler_state(&mut self.sampler, state)
    }
}

/// The actor of the pair trainers: one optimiser step per `ppo_mini_batch_size` pairs.
fn pair_actor(cfg: &ExperimentConfig, policy: SharedPolicy, steps: u64) -> Result<ActorWorker> {
    Ok(ActorWorker::new(policy, actor_config(cfg, steps), 2)?)
}

/// The actor's worker config: `actor_rollout_ref.actor`, with `use_remove_padding` and
/// `use_fused_kernels` from their verl place, `actor_rollout_ref.model`.
/// The actor's config, its LR schedule spanning the run's `steps`.
fn actor_config(cfg: &ExperimentConfig, steps: u64) -> rl_workers::roles::ActorConfig {
    let arr = &cfg.actor_rollout_ref;
    rl_workers::roles::ActorConfig {
        use_remove_padding: arr.model.use_remove_padding,
        use_fused_kernels: arr.model.use_fused_kernels,
        optim: arr.actor.optim.clone().spanning(steps),
        ..arr.actor.clone()
    }
}

fn frozen_reference(
    cfg: &ExperimentConfig,
    policy: &SharedPolicy,
    group: Option<&SharedCollective>,
) -> Result<Option<Box<dyn Reference>>> {
    if cfg.dpo.0.reference_free {
        return Ok(None);
    }
    let arr = &cfg.actor_rollout_ref;
    Ok(Some(Box::new(shard_reference(
        ReferenceWorker::from_policy(policy, arr.ref_micro_batch_size)?
            .with_packing(arr.model.use_remove_padding, arr.actor.use_prefix_grouper),
        cfg,
        group,
    )?)))
}

/// The reference sharded over `group` as the actor is under ZeRO stage 3 (its forwards then
/// gather a layer at a time); otherwise as it is.
fn shard_reference(
    reference: ReferenceWorker,
    cfg: &ExperimentConfig,
    group: Option<&SharedCollective>,
) -> Result<ReferenceWorker> {
    Ok(match group {
        Some(g) if cfg.actor_rollout_ref.actor.zero_stage == 3 => {
            reference.shard_params(g.clone())?
        }
        _ => reference,
    })
}

/// Builds offline DPO on `preference_data`.
pub fn build_dpo(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    tokenizer: &Arc<Tokenizer>,
) -> Result<DpoTrainer> {
    build_dpo_in(cfg, policy, tokenizer, None)
}

/// [`build_dpo`] as one rank of `group`: `preference_data.train_batch_size` pairs is the
/// global batch, each rank trains on its contiguous share of the pairs.
pub fn build_dpo_in(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    tokenizer: &Arc<Tokenizer>,
    group: Option<&SharedCollective>,
) -> Result<DpoTrainer> {
    check_groups(cfg, TrainerKind::Dpo)?;
    let (source, val_batches) = preference_sources(cfg, tokenizer, group)?;
    let dcfg = dpo_config(cfg, source.sampler.batches_per_epoch())?;
    let mut actor = pair_actor(cfg, policy, dcfg.total_training_steps)?;
    let reference = frozen_reference(cfg, &actor.policy(), group)?;
    if let Some(g) = group {
        actor = actor.with_group(g.clone())?;
    }
    let trainer = DpoTrainer::new(
        dcfg,
        Box::new(actor),
        reference,
        Box::new(source),
        val_batches,
    )?;
    Ok(match group {
        Some(g) => trainer.with_group(g.clone(), cfg.preference_data.train_batch_size)?,
        None => trainer,
    })
}

fn with_progress(rollout: RolloutWorker, progress: Option<ProgressHook>) -> RolloutWorker {
    match progress {
        Some(hook) => rollout.with_progress(hook),
        None => rollout,
    }
}

fn rollout_worker(
    cfg: &ExperimentConfig,
    policy: &SharedPolicy,
    tokenizer: &Tokenizer,
    n: usize,
    progress: Option<ProgressHook>,
) -> Result<RolloutWorker> {
    let arr = &cfg.actor_rollout_ref;
    let eos = tokenizer
        .eos_token_id()
        .ok_or_else(|| anyhow!("the tokenizer has no eos token (tokenizer_config.json)"))?;
    let mut rollout = arr.rollout.clone();
    rollout.n = n;
    Ok(with_progress(
        RolloutWorker::new(
            policy.clone(),
            rollout,
            arr.val_kwargs.clone(),
            vec![i64::from(eos)],
            i64::from(tokenizer.pad_id_or_eos()?),
        )?,
        progress,
    ))
}

/// Builds online DPO on the `data` prompts: `dpo.n` generations each, ranked by the rule
/// reward, `actor_rollout_ref.actor.ppo_mini_batch_size` pairs per update.
pub fn build_online_dpo(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    tokenizer: &Arc<Tokenizer>,
    progress: Option<ProgressHook>,
) -> Result<OnlineDpoTrainer> {
    build_online_dpo_in(cfg, policy, tokenizer, progress, None)
}

/// [`build_online_dpo`] as one rank of `group`: `data.train_batch_size` prompts is the global
/// batch, each rank generates for its contiguous share, the pairs are shared out evenly.
pub fn build_online_dpo_in(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    tokenizer: &Arc<Tokenizer>,
    progress: Option<ProgressHook>,
    group: Option<&SharedCollective>,
) -> Result<OnlineDpoTrainer> {
    check_groups(cfg, TrainerKind::OnlineDpo)?;
    let (mut train, val) = loaders(cfg, tokenizer)?;
    let (rank, world) = rank_world(group)?;
    if group.is_some() {
        train.0 = train.0.with_shard(rank, world)?;
    }
    let dcfg = dpo_config(cfg, train.0.batches_per_epoch())?;
    let rollout = rollout_worker(cfg, &policy, tokenizer, dcfg.n, progress)?;
    let pairs = cfg.actor_rollout_ref.actor.ppo_mini_batch_size;
    let mut actor = pair_actor(cfg, policy, dcfg.total_training_steps)?;
    let reference = frozen_reference(cfg, &actor.policy(), group)?;
    if let Some(g) = group {
        actor = actor.with_group(g.clone())?;
    }
    let reward = RuleReward::new(tokenizer.clone(), rule_rewards(cfg)?);
    let trainer = OnlineDpoTrainer::new(
        dcfg,
        Box::new(actor),
        Box::new(rollout),
        reference,
        Box::new(reward),
        Box::new(train),
        val,
        pairs,
    )?;
    Ok(match group {
        Some(g) => trainer.with_group(g.clone(), cfg.data.train_batch_size)?,
        None => trainer,
    })
}

/// Builds SPIN: the rows' answers (`sft.response_key`) against one generation each, the
/// reference reloaded from the starting checkpoint at first and then set to the policy every
/// `dpo.ref_update_freq` steps.
pub fn build_spin(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    tokenizer: &Arc<Tokenizer>,
    device: Device,
    progress: Option<ProgressHook>,
) -> Result<SpinTrainer> {
    build_spin_in(cfg, policy, tokenizer, device, progress, None)
}

/// [`build_spin`] as one rank of `group`: `sft.train_batch_size` rows is the global batch, each
/// rank generates for and trains on its contiguous share.
pub fn build_spin_in(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    tokenizer: &Arc<Tokenizer>,
    device: Device,
    progress: Option<ProgressHook>,
    group: Option<&SharedCollective>,
) -> Result<SpinTrainer> {
    check_groups(cfg, TrainerKind::Spin)?;
    let (_, val) = loaders(cfg, tokenizer)?;
    let seed = cfg.data.seed.unwrap_or(cfg.trainer.seed);
    let mut train = SftSource::new(
        Arc::new(sft_train_rows(cfg)?),
        tokenizer.clone(),
        cfg.sft.train_batch_size,
        seed,
    )?;
    let (rank, world) = rank_world(group)?;
    if group.is_some() {
        train
            .sampler
            .set_shard(rank, world)
            .map_err(|e| anyhow!("sft.train_batch_size: {e}"))?;
    }
    let dcfg = dpo_config(cfg, train.batches_per_epoch())?;
    let rollout = rollout_worker(cfg, &policy, tokenizer, 1, progress)?;
    let mut actor = pair_actor(cfg, policy.clone(), dcfg.total_training_steps)?;
    if let Some(g) = group {
        actor = actor.with_group(g.clone())?;
    }
    let start = cfg.actor_rollout_ref.model.path.clone();
    let kind = cfg.actor_rollout_ref.model.dtype.kind();
    let micro = cfg.actor_rollout_ref.ref_micro_batch_size;
    let packed = cfg.actor_rollout_ref.model.use_remove_padding;
    let prefix_grouper = cfg.actor_rollout_ref.actor.use_prefix_grouper;
    let make_reference: ReferenceFactory = Box::new(move |init| {
        Ok(Box::new(
            match init {
                RefInit::Initial => ReferenceWorker::from_pretrained(&start, device, kind, micro)?,
                RefInit::Policy => ReferenceWorker::from_policy(&policy, micro)?,
            }
            .with_packing(packed, prefix_grouper),
        ) as Box<dyn Reference>)
    });
    let reward = RuleReward::new(tokenizer.clone(), rule_rewards(cfg)?);
    let trainer = SpinTrainer::new(
        dcfg,
        Box::new(actor),
        Box::new(rollout),
        make_reference,
        Box::new(reward),
        Box::new(train),
        val,
    )?;
    Ok(match group {
        Some(g) => trainer.with_group(g.clone(), cfg.sft.train_batch_size)?,
        None => trainer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 18, item 13: a model holding a NaN weight is never exported.
    #[test]
    fn a_model_with_a_nan_weight_is_not_exported() {
        let lm = CausalLm::new(&tiny_llama_config(32), Device::Cpu, Kind::Float).unwrap();
        let model = TrainedModel::Policy(Arc::new(Mutex::new(lm)));
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(model.first_non_finite().unwrap(), None);
        export_model(&model, dir.path(), &dir.path().join("ok")).unwrap();
        assert!(dir.path().join("ok/model.safetensors").is_file());
        let TrainedModel::Policy(p) = &model else {
            unreachable!()
        };
        let name = {
            let lm = p.lock().unwrap();
            let vars = lm.var_store().variables();
            let mut names: Vec<String> = vars.keys().cloned().collect();
            names.sort();
            let name = names.last().unwrap().clone();
            tch::no_grad(|| {
                let _ = vars[&name].get(0).fill_(f64::NAN);
            });
            name
        };
        let err = export_model(&model, dir.path(), &dir.path().join("bad")).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("weight `{name}` holds NaN or infinite values")),
            "{err:#}"
        );
        assert!(!dir.path().join("bad/model.safetensors").exists());
    }

    fn write_toml(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("exp.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn the_reward_group_maps_data_sources_to_configured_rule_rewards() {
        let dir = tempfile::tempdir().unwrap();
        let file = write_toml(
            dir.path(),
            "[reward.prefixes.searchR1_]\nname = 'qa_em'\nformat_score = 0.2\n\
             [reward.sources.'my/sums']\nname = 'arithmetic'\n",
        );
        let cfg = crate::config::load(&crate::config::Sources {
            file: Some(file),
            env: false,
            overrides: vec![],
        })
        .unwrap();
        let rewards = rule_rewards(&cfg).unwrap();
        let gt = serde_json::json!({"target": ["blue"]});
        let none = serde_json::Value::Null;
        let score = |source: &str, response: &str, gt: &serde_json::Value| {
            rewards.score(source, response, gt, &none).unwrap().score
        };
        // the configured format score replaces verl's 0 for a well-formed miss
        assert_eq!(
            score("searchR1_synthetic", "<answer>red</answer>", &gt),
            0.2
        );
        assert_eq!(
            score("searchR1_synthetic", "<answer>Blue</answer>", &gt),
            1.0
        );
        assert_eq!(score("my/sums", "so 12", &serde_json::json!("12")), 1.0);

        let bad = write_toml(
            dir.path(),
            "[reward.sources.x]\nname = 'custom'\nfunction = 'nowhere'\n",
        );
        let err = format!(
            "{:#}",
            crate::config::load(&crate::config::Sources {
                file: Some(bad),
                env: false,
                overrides: vec![]
            })
            .unwrap_err()
        );
        assert!(err.contains("reward") && err.contains("nowhere"), "{err}");
    }
}
