//! The LLM experiment's config groups under verl's names, composed from the crates' own config
//! structs: `actor_rollout_ref.{model, actor, rollout, ref}`, `critic`, `reward_model` and
//! `sft`. verl puts keys that two crates read into one table (`actor_rollout_ref.actor` holds
//! both the worker's batch sizes and the loss's clip ratios); [`Merged`] reads such a table into
//! the two structs, every key going to the one that knows it, an unknown key named with the
//! nearest known one.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use rl_algos::OverlongBufferConfig;
use rl_algos::trainer::{ActorLossConfig, CriticLossConfig, RmTrainerConfig};
use rl_workers::roles::{
    ActorConfig, CriticConfig, MixedPrecision, OptimConfig, RewardModelConfig, RmWorkerConfig,
    ValKwargs,
};
use rl_workers::{LoraConfig, MultiTurnConfig, RolloutConfig, TargetModules};

/// How [`Merged`] starts the message of a value its struct refuses: ``bad value at `PATH`: WHY``
/// with the path below the table (the config loader adds the table's own path).
pub const BAD_VALUE: &str = "bad value at `";

/// The dotted path, below `table`, of the first value `T` refuses on its own (narrowed into
/// nested tables as far as it goes), for an error that names the key, not the table.
fn refused_path<T: DeserializeOwned>(table: &Map<String, Value>) -> Option<String> {
    fn nest(path: &[String], leaf: Value) -> Value {
        path.iter()
            .rev()
            .fold(leaf, |v, k| Value::Object(Map::from_iter([(k.clone(), v)])))
    }
    fn walk<T: DeserializeOwned>(path: &mut Vec<String>, map: &Map<String, Value>) -> bool {
        for (k, child) in map {
            path.push(k.clone());
            if serde_json::from_value::<T>(nest(path, child.clone())).is_err() {
                if let Value::Object(inner) = child {
                    walk::<T>(path, inner);
                }
                return true;
            }
            path.pop();
        }
        false
    }
    let mut path = Vec::new();
    walk::<T>(&mut path, table).then(|| path.join("."))
}

/// `T` from `table`, an error naming the refused key's path (see [`BAD_VALUE`]).
fn from_table<T: DeserializeOwned, E: serde::de::Error>(table: Map<String, Value>) -> Result<T, E> {
    serde_json::from_value(Value::Object(table.clone())).map_err(|e| {
        let msg = e.to_string();
        // a nested Merged has named the path already
        if msg.starts_with(BAD_VALUE) {
            return E::custom(msg);
        }
        match refused_path::<T>(&table) {
            Some(path) => E::custom(format!("{BAD_VALUE}{path}`: {msg}")),
            None => E::custom(msg),
        }
    })
}

/// How [`Merged`] starts the message of a key neither struct knows (the config loader turns
/// it into the full key path with the nearest known key).
pub const UNKNOWN_KEY: &str = "unknown key `";

/// Two config structs read from, and written to, one table.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Merged<A, B>(pub A, pub B);

fn object_of<T: Serialize>(value: &T) -> Map<String, Value> {
    match serde_json::to_value(value) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    }
}

fn keys_of<T: Serialize + Default>() -> BTreeSet<String> {
    object_of(&T::default()).keys().cloned().collect()
}

fn drop_nulls(map: Map<String, Value>) -> Map<String, Value> {
    map.into_iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| match v {
            Value::Object(inner) => (k, Value::Object(drop_nulls(inner))),
            other => (k, other),
        })
        .collect()
}

thread_local! {
    static KEEP_NULLS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with absent optional keys serialised as `null` instead of left out (for listing
/// every key: the config reference, the nearest-key suggestions).
pub fn with_optional_keys<T>(f: impl FnOnce() -> T) -> T {
    KEEP_NULLS.with(|k| k.set(true));
    let out = f();
    KEEP_NULLS.with(|k| k.set(false));
    out
}

fn absent_left_out(map: Map<String, Value>) -> Map<String, Value> {
    if KEEP_NULLS.with(std::cell::Cell::get) {
        map
    } else {
        drop_nulls(map)
    }
}

impl<A: Serialize, B: Serialize> Serialize for Merged<A, B> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Absent optional keys are left out, as TOML has no null.
        let mut map = absent_left_out(object_of(&self.0));
        map.extend(absent_left_out(object_of(&self.1)));
        map.serialize(s)
    }
}

/// Which side of a [`Merged`] takes `key`: the one whose defaults have it, else the one that
/// accepts it alone (an optional key absent from the defaults).
fn side_of<A, B>(
    key: &str,
    value: &Value,
    a: &BTreeSet<String>,
    b: &BTreeSet<String>,
) -> Option<bool>
where
    A: DeserializeOwned,
    B: DeserializeOwned,
{
    if a.contains(key) {
        return Some(true);
    }
    if b.contains(key) {
        return Some(false);
    }
    let alone = Value::Object(Map::from_iter([(key.to_string(), value.clone())]));
    if serde_json::from_value::<A>(alone.clone()).is_ok() {
        Some(true)
    } else if serde_json::from_value::<B>(alone).is_ok() {
        Some(false)
    } else {
        None
    }
}

impl<'de, A, B> Deserialize<'de> for Merged<A, B>
where
    A: DeserializeOwned + Serialize + Default,
    B: DeserializeOwned + Serialize + Default,
{
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let table = match Value::deserialize(d)? {
            Value::Object(map) => map,
            other => {
                return Err(D::Error::custom(format!("expected a table, found {other}")));
            }
        };
        let (ka, kb) = (keys_of::<A>(), keys_of::<B>());
        let (mut ma, mut mb) = (Map::new(), Map::new());
        for (key, value) in table {
            match side_of::<A, B>(&key, &value, &ka, &kb) {
                Some(true) => ma.insert(key, value),
                Some(false) => mb.insert(key, value),
                None => {
                    let known: Vec<String> = ka.iter().chain(&kb).cloned().collect();
                    let hint = crate::suggest::nearest_key(&key, &known)
                        .map(|k| format!("; did you mean `{k}`?"))
                        .unwrap_or_default();
                    return Err(D::Error::custom(format!("{UNKNOWN_KEY}{key}`{hint}")));
                }
            };
        }
        Ok(Merged(from_table(ma)?, from_table(mb)?))
    }
}

/// Compute precision of a model's weights (`actor_rollout_ref.model.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// 32-bit floats (the default; the only exact choice on CPU).
    #[default]
    Float32,
    /// bfloat16 (GPU training).
    Bfloat16,
}

impl Dtype {
    /// The tch kind.
    pub fn kind(self) -> tch::Kind {
        match self {
            Dtype::Float32 => tch::Kind::Float,
            Dtype::Bfloat16 => tch::Kind::BFloat16,
        }
    }
}

/// `actor_rollout_ref.model`: the Hugging Face checkpoint the policy starts from, and LoRA.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// A Hugging Face model folder (`config.json`, `model.safetensors` or a sharded index,
    /// `tokenizer.json`, `tokenizer_config.json`).
    pub path: PathBuf,
    /// Weight precision. Default `float32`.
    pub dtype: Dtype,
    /// LoRA rank; 0 = full fine-tuning, > 0 = train PEFT-style adapters of this rank on a
    /// frozen base (docs/lora.md). Default 0.
    pub lora_rank: i64,
    /// LoRA alpha: the adapters' update is scaled by `lora_alpha / lora_rank`. Default 16.
    pub lora_alpha: f64,
    /// The layers that get adapters: `"all-linear"` (the decoder's linear layers) or a list
    /// of module names (`["q_proj", "v_proj"]`, PEFT's matching), which may name the vocabulary
    /// layers `lm_head` and `embed_tokens` (docs/lora.md). Default `"all-linear"`.
    pub target_modules: TargetModules,
    /// Layers left without adapters among the targeted ones (PEFT's matching). Default none.
    pub exclude_modules: Option<Vec<String>>,
    /// Dropout on the adapters' input during updates, in `[0, 1)`. Default 0.
    pub lora_dropout: f64,
    /// A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) to continue
    /// training from; its rank, alpha and targets are used. Default none.
    pub lora_adapter_path: Option<PathBuf>,
    /// verl's `use_remove_padding`: the actor's and the reference's forward passes run on the
    /// real tokens packed into rows (each sequence attending only to itself, positions
    /// restarting), and the LM head only where a response token is read; the same log-probs
    /// up to rounding, less work when lengths differ (docs/perf.md). Default false.
    pub use_remove_padding: bool,
    /// verl's `use_fused_kernels`: the actor's update computes its log-probs and entropies
    /// through the fused head (row chunks of the LM head, recomputed in the backward), so no
    /// full-vocabulary tensor is kept for the backward; the same update up to rounding, less
    /// memory and time (docs/perf.md). Not with `actor.zero_stage = 3`. Default false.
    pub use_fused_kernels: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        let lora = LoraKeys::default();
        ModelConfig {
            path: PathBuf::new(),
            dtype: Dtype::default(),
            lora_rank: lora.rank,
            lora_alpha: lora.alpha,
            target_modules: lora.target_modules,
            exclude_modules: None,
            lora_dropout: lora.dropout,
            lora_adapter_path: None,
            use_remove_padding: false,
            use_fused_kernels: false,
        }
    }
}

/// verl's LoRA defaults.
struct LoraKeys {
    rank: i64,
    alpha: f64,
    target_modules: TargetModules,
    dropout: f64,
}

impl Default for LoraKeys {
    fn default() -> Self {
        LoraKeys {
            rank: 0,
            alpha: 16.0,
            target_modules: TargetModules::AllLinear,
            dropout: 0.0,
        }
    }
}

/// The LoRA configuration of `lora_*` keys, `None` when `lora_rank` is 0; `prefix` names the
/// group in errors.
fn lora_config(
    prefix: &str,
    rank: i64,
    alpha: f64,
    target_modules: &TargetModules,
    exclude_modules: &Option<Vec<String>>,
    dropout: f64,
) -> Result<Option<LoraConfig>, rl_workers::Error> {
    if rank == 0 {
        return Ok(None);
    }
    let cfg = LoraConfig {
        rank,
        alpha,
        target_modules: target_modules.clone(),
        exclude_modules: exclude_modules.clone().unwrap_or_default(),
        dropout,
        use_rslora: false,
    };
    cfg.validate(prefix)?;
    Ok(Some(cfg))
}

impl ModelConfig {
    /// The policy's LoRA configuration (`None`: full fine-tuning); a bad value names its key.
    pub fn lora(&self) -> Result<Option<LoraConfig>, rl_workers::Error> {
        lora_config(
            "actor_rollout_ref.model",
            self.lora_rank,
            self.lora_alpha,
            &self.target_modules,
            &self.exclude_modules,
            self.lora_dropout,
        )
    }
}

/// `critic.model`: where the critic starts, and LoRA; absent path = the policy's checkpoint
/// with a fresh value head (verl's default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriticModelConfig {
    /// A Hugging Face folder; absent = `actor_rollout_ref.model.path`.
    pub path: Option<PathBuf>,
    /// LoRA rank; 0 = full fine-tuning. With LoRA the value or score head trains in full beside
    /// the adapters (PEFT's `modules_to_save`). Default 0.
    pub lora_rank: i64,
    /// LoRA alpha. Default 16.
    pub lora_alpha: f64,
    /// `"all-linear"` or a list of module names (`embed_tokens` too; a critic has no
    /// `lm_head`). Default `"all-linear"`.
    pub target_modules: TargetModules,
    /// Layers left without adapters. Default none.
    pub exclude_modules: Option<Vec<String>>,
    /// Dropout on the adapters' input during updates. Default 0.
    pub lora_dropout: f64,
    /// verl's `use_remove_padding` for the critic's forward passes (see
    /// `actor_rollout_ref.model.use_remove_padding`). Default false.
    pub use_remove_padding: bool,
}

impl Default for CriticModelConfig {
    fn default() -> Self {
        let lora = LoraKeys::default();
        CriticModelConfig {
            path: None,
            lora_rank: lora.rank,
            lora_alpha: lora.alpha,
            target_modules: lora.target_modules,
            exclude_modules: None,
            lora_dropout: lora.dropout,
            use_remove_padding: false,
        }
    }
}

impl CriticModelConfig {
    /// The LoRA configuration; `prefix` is this group's path (`critic.model`).
    pub fn lora(&self, prefix: &str) -> Result<Option<LoraConfig>, rl_workers::Error> {
        lora_config(
            prefix,
            self.lora_rank,
            self.lora_alpha,
            &self.target_modules,
            &self.exclude_modules,
            self.lora_dropout,
        )
    }
}

/// The keys of `critic` beyond the worker's and the loss's.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriticModelGroup {
    /// `critic.model`.
    pub model: CriticModelConfig,
}

/// The keys of `actor_rollout_ref.rollout` beyond the sampler's: `val_kwargs` and `multi_turn`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValKwargsGroup {
    /// Sampling settings of validation.
    pub val_kwargs: ValKwargs,
    /// Multi-turn rollouts with tools.
    pub multi_turn: MultiTurn,
}

/// `actor_rollout_ref.rollout.multi_turn`: Search-R1-style rollouts that call tools between
/// turns (`docs/algos/multi_turn.md`). Training and validation generations both use it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MultiTurn {
    /// Generate in turns and call `tools` between them. Default false.
    pub enable: bool,
    /// Tool calls allowed per response, >= 1; a row that closes one more call tag stops there.
    /// Default 4.
    pub max_turns: usize,
    /// Tokens kept of each observation, >= 1. Default 512.
    pub max_obs_length: i64,
    /// The tools, e.g. `[{type = "search", url = "http://127.0.0.1:8000/retrieve", topk = 3}]`
    /// (rl-tools' `ToolSpec`); at least one when enabled, names distinct.
    pub tools: Vec<rl_tools::ToolSpec>,
}

impl Default for MultiTurn {
    fn default() -> Self {
        let limits = MultiTurnConfig::default();
        MultiTurn {
            enable: false,
            max_turns: limits.max_turns,
            max_obs_length: limits.max_obs_length,
            tools: Vec::new(),
        }
    }
}

impl MultiTurn {
    /// The limits the rollout reads.
    pub fn limits(&self) -> MultiTurnConfig {
        MultiTurnConfig {
            max_turns: self.max_turns,
            max_obs_length: self.max_obs_length,
        }
    }
}

/// `actor_rollout_ref.ref`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RefConfig {
    /// Rows per reference forward; absent = all at once (on a CPU, parts whose activations fit
    /// the caches are faster for long sequences, as for the actor's old log-probs).
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ActorRolloutRefWire {
    model: ModelConfig,
    actor: Merged<ActorConfig, ActorLossConfig>,
    rollout: Merged<RolloutConfig, ValKwargsGroup>,
    #[serde(rename = "ref")]
    reference: RefConfig,
}

/// verl's `actor_rollout_ref` group: the policy's checkpoint, the actor's worker and loss keys,
/// the rollout's sampling and the reference's batch size.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(from = "ActorRolloutRefWire", into = "ActorRolloutRefWire")]
pub struct ActorRolloutRef {
    /// `actor_rollout_ref.model`.
    pub model: ModelConfig,
    /// `actor_rollout_ref.actor` (the worker's keys: batch sizes, optimiser, clipping).
    pub actor: ActorConfig,
    /// `actor_rollout_ref.actor` (the loss's keys: clip ratios, aggregation, KL loss).
    pub actor_loss: ActorLossConfig,
    /// `actor_rollout_ref.rollout`.
    pub rollout: RolloutConfig,
    /// `actor_rollout_ref.rollout.val_kwargs`.
    pub val_kwargs: ValKwargs,
    /// `actor_rollout_ref.rollout.multi_turn`.
    pub multi_turn: MultiTurn,
    /// `actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu`.
    pub ref_micro_batch_size: Option<usize>,
}

impl From<ActorRolloutRefWire> for ActorRolloutRef {
    fn from(w: ActorRolloutRefWire) -> Self {
        ActorRolloutRef {
            model: w.model,
            actor: w.actor.0,
            actor_loss: w.actor.1,
            rollout: w.rollout.0,
            val_kwargs: w.rollout.1.val_kwargs,
            multi_turn: w.rollout.1.multi_turn,
            ref_micro_batch_size: w.reference.log_prob_micro_batch_size_per_gpu,
        }
    }
}

impl From<ActorRolloutRef> for ActorRolloutRefWire {
    fn from(a: ActorRolloutRef) -> Self {
        ActorRolloutRefWire {
            model: a.model,
            actor: Merged(a.actor, a.actor_loss),
            rollout: Merged(
                a.rollout,
                ValKwargsGroup {
                    val_kwargs: a.val_kwargs,
                    multi_turn: a.multi_turn,
                },
            ),
            reference: RefConfig {
                log_prob_micro_batch_size_per_gpu: a.ref_micro_batch_size,
            },
        }
    }
}

/// verl's `critic` group: the worker's keys, the value loss's keys and `critic.model`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(
    from = "Merged<CriticConfig, Merged<CriticLossConfig, CriticModelGroup>>",
    into = "Merged<CriticConfig, Merged<CriticLossConfig, CriticModelGroup>>"
)]
pub struct CriticGroup {
    /// The worker's keys (batch sizes, optimiser, clipping).
    pub worker: CriticConfig,
    /// The loss's keys (`cliprange_value`, `loss_agg_mode`).
    pub loss: CriticLossConfig,
    /// `critic.model`.
    pub model: CriticModelConfig,
}

impl From<Merged<CriticConfig, Merged<CriticLossConfig, CriticModelGroup>>> for CriticGroup {
    fn from(m: Merged<CriticConfig, Merged<CriticLossConfig, CriticModelGroup>>) -> Self {
        CriticGroup {
            worker: m.0,
            loss: m.1.0,
            model: m.1.1.model,
        }
    }
}

impl From<CriticGroup> for Merged<CriticConfig, Merged<CriticLossConfig, CriticModelGroup>> {
    fn from(c: CriticGroup) -> Self {
        Merged(
            c.worker,
            Merged(c.loss, CriticModelGroup { model: c.model }),
        )
    }
}

/// `reward_model.model`: the scoring reward model's folder. (Training one reads LoRA from
/// `actor_rollout_ref.model`, the model it trains.)
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmModelConfig {
    /// A Hugging Face `*ForSequenceClassification` folder.
    pub path: Option<PathBuf>,
}

/// The keys of `reward_model` beyond the scoring worker's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardModelOwn {
    /// Score responses with a reward model too. Default false.
    pub enable: bool,
    /// `reward_model.model.path`: a Hugging Face `*ForSequenceClassification` folder.
    pub model: RmModelConfig,
    /// Weight of the reward model's score in the combined reward. Default 1.
    pub rm_coef: f64,
    /// Weight of the rule reward (`data.reward_fn_key`) in the combined reward; 0 trains on
    /// the reward model alone while the rule score is still logged. Default 1.
    pub rule_coef: f64,
    /// DAPO's overlong-response penalty.
    pub overlong_buffer: OverlongBufferConfig,
    /// Training a reward model (`trainer.algorithm = "reward_model"`).
    pub train: RmTrainGroup,
}

impl Default for RewardModelOwn {
    fn default() -> Self {
        RewardModelOwn {
            enable: false,
            model: RmModelConfig::default(),
            rm_coef: 1.0,
            rule_coef: 1.0,
            overlong_buffer: OverlongBufferConfig::default(),
            train: RmTrainGroup::default(),
        }
    }
}

/// `reward_model.train`: the Bradley–Terry reward-model trainer's settings
/// (`trainer.algorithm = "reward_model"`, docs/algos/reward_model.md). The pairs are
/// `preference_data`'s, `preference_data.train_batch_size` a step, for
/// `trainer.total_training_steps` steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmTrainGroup {
    /// A margin every pair's reward gap must clear, >= 0. Default 0 (plain Bradley–Terry).
    pub margin: f64,
    /// TRL's `center_rewards_coefficient`, >= 0: adds `c * mean((r_chosen + r_rejected)^2)`.
    /// Default 0 (off).
    pub center_rewards_coefficient: f64,
    /// Pairs per micro-batch (gradient accumulation); none = the whole step. Default none.
    pub micro_train_batch_size: Option<usize>,
    /// Global gradient-norm clip, > 0. Default 1.0.
    pub grad_clip: f64,
    /// AdamW and LR schedule (verl's `optim` keys); defaults `lr` 9e-6 and `weight_decay` 0
    /// (OpenRLHF's).
    pub optim: OptimConfig,
    /// Mixed precision of the reward model's weights (`param_dtype = "bf16"`). Default off.
    pub mixed_precision: MixedPrecision,
    /// ZeRO stage over the data-parallel ranks: 0 replicated, 1 optimizer state sharded, 2
    /// gradients too (docs/distributed.md, "Sharding"; stage 3 is built for the policy and the
    /// critic, not for reward-model training). Default 0.
    pub zero_stage: u8,
}

impl Default for RmTrainGroup {
    fn default() -> Self {
        let (w, t) = (RmWorkerConfig::default(), RmTrainerConfig::default());
        RmTrainGroup {
            margin: t.margin,
            center_rewards_coefficient: t.center_rewards_coefficient,
            micro_train_batch_size: w.micro_train_batch_size,
            grad_clip: w.grad_clip,
            optim: w.optim,
            mixed_precision: w.mixed_precision,
            zero_stage: w.zero_stage,
        }
    }
}

impl RmTrainGroup {
    /// The worker's config for `pairs` pairs a step.
    pub fn worker(&self, pairs: usize) -> RmWorkerConfig {
        RmWorkerConfig {
            train_batch_size: pairs,
            micro_train_batch_size: self.micro_train_batch_size,
            grad_clip: self.grad_clip,
            optim: self.optim.clone(),
            mixed_precision: self.mixed_precision.clone(),
            zero_stage: self.zero_stage,
        }
    }

    /// The trainer's config for `steps` steps.
    pub fn trainer(&self, steps: u64) -> RmTrainerConfig {
        RmTrainerConfig {
            total_training_steps: steps,
            margin: self.margin,
            center_rewards_coefficient: self.center_rewards_coefficient,
        }
    }
}

/// verl's `reward_model` group: the rule reward of each row's `data_source`, and when
/// `enable`d a reward model, combined as `rm_coef * rm_score + rule_coef * rule_score` on each
/// response's last token; DAPO's overlong penalty.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(
    from = "Merged<RewardModelConfig, RewardModelOwn>",
    into = "Merged<RewardModelConfig, RewardModelOwn>"
)]
pub struct RewardModelGroup {
    /// The scoring worker's keys (`micro_batch_size_per_gpu`, `use_dynamic_bsz`,
    /// `forward_max_token_len_per_gpu`).
    pub worker: RewardModelConfig,
    /// `enable`, `model.path`, `rm_coef`, `rule_coef`, `overlong_buffer`, `train`.
    pub own: RewardModelOwn,
}

impl From<Merged<RewardModelConfig, RewardModelOwn>> for RewardModelGroup {
    fn from(m: Merged<RewardModelConfig, RewardModelOwn>) -> Self {
        RewardModelGroup {
            worker: m.0,
            own: m.1,
        }
    }
}

impl From<RewardModelGroup> for Merged<RewardModelConfig, RewardModelOwn> {
    fn from(g: RewardModelGroup) -> Self {
        Merged(g.worker, g.own)
    }
}

/// `sft`: supervised fine-tuning on the `data` group's files (`trainer.algorithm = "sft"`), read
/// as verl's SFT datasets read them: a prompt and a response per row, or a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftGroup {
    /// Where each row's prompt is: a column holding a string (one user message) or a list of
    /// `{role, content}` messages, or `column.field…` inside a struct column
    /// (`extra_info.question`: verl's `prompt_key = extra_info` with `prompt_dict_keys =
    /// [question]`). Unset = `data.prompt_key` (verl's RL `prompt` messages).
    pub prompt_key: Option<String>,
    /// Where each row's target response is: a column or `column.field…` holding a string (or a
    /// number): `extra_info.answer` (verl's GSM8K and arithmetic parquet keep the worked answer
    /// there), `reward_model.ground_truth`, or a plain column (`answer`). Default
    /// `extra_info.answer`.
    pub response_key: String,
    /// Multi-turn SFT (verl's `data.multiturn.messages_key` with `multiturn.enable`): the column
    /// of each row's whole conversation, a list of `{role, content}` messages; every assistant
    /// turn is trained, the other turns are not. Unset = single-turn (`prompt_key` and
    /// `response_key`).
    pub messages_key: Option<String>,
    /// Prompt + response limit in tokens, after the chat template (verl's `data.max_length`).
    /// Unset = no limit.
    pub max_length: Option<usize>,
    /// What to do with a longer example (verl's `data.truncation`): `error` (naming the file and
    /// row), `left` (drop its first tokens, from the prompt) or `right` (drop its last).
    pub truncation: rl_data::Truncation,
    /// Rows per optimiser step. Default 32.
    pub train_batch_size: usize,
    /// Tags whose `<tag>…</tag>` spans in the responses (with the whitespace around them, as a
    /// tool emits them) are tool observations, masked out of the SFT loss: `["information"]`
    /// for Search-R1 traces. Default none.
    pub mask_tags: Vec<String>,
}

impl Default for SftGroup {
    fn default() -> Self {
        SftGroup {
            prompt_key: None,
            response_key: "extra_info.answer".into(),
            messages_key: None,
            max_length: None,
            truncation: rl_data::Truncation::Error,
            train_batch_size: 32,
            mask_tags: Vec::new(),
        }
    }
}

/// `dpo`: the preference trainers' settings (offline DPO, online DPO, SPIN) under TRL's names.
/// The step count is `trainer.total_training_steps`, so `dpo.total_training_steps` is refused.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DpoGroup(pub rl_algos::trainer::DpoTrainerConfig);

const DPO_STEPS_KEY: &str = "total_training_steps";

impl Serialize for DpoGroup {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = absent_left_out(object_of(&self.0));
        map.remove(DPO_STEPS_KEY);
        map.serialize(s)
    }
}

impl<'de> Deserialize<'de> for DpoGroup {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut value = Value::deserialize(d)?;
        if let Value::Object(map) = &mut value {
            if map.contains_key(DPO_STEPS_KEY) {
                return Err(D::Error::custom(
                    "`dpo.total_training_steps` is not read: set `trainer.total_training_steps`",
                ));
            }
            // the harness fills it from trainer.total_training_steps when it builds the trainer
            map.insert(DPO_STEPS_KEY.into(), Value::from(1));
        }
        serde_json::from_value(value)
            .map(DpoGroup)
            .map_err(D::Error::custom)
    }
}
