//! verl's command lines, as they are written: Hydra's spellings of values (`True`, `None`,
//! `[a,b]`), its `+key=value`, and the infrastructure keys of verl's configs that have no
//! counterpart here (FSDP, vLLM, Ray, node counts). Each such key is either mapped to ours,
//! accepted with a one-line note saying why it has no effect, or refused with the reason;
//! never taken for a typo of an unrelated key.

use anyhow::{Result, bail};

/// A command-line or environment value as verl's (Hydra's, YAML's) command lines spell them:
/// TOML first (`3`, `0.1`, `5e-4`, `true`, `'x y'`, `[1, 2]`), then `True`/`False`,
/// `null`/`None`/`~` (`None`: unset an optional key), a list of bare words `[a,b]`, a number
/// TOML does not take (`.5`), and anything else as a plain string.
pub fn parse_value(raw: &str) -> Option<toml::Value> {
    let raw = raw.trim();
    if matches!(raw, "null" | "Null" | "NULL" | "None" | "~") {
        return None;
    }
    match raw {
        "True" | "TRUE" => return Some(toml::Value::Boolean(true)),
        "False" | "FALSE" => return Some(toml::Value::Boolean(false)),
        _ => {}
    }
    if let Ok(mut t) = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        && let Some(v) = t.remove("v")
    {
        return Some(v);
    }
    if let Some(inner) = raw.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        let items = split_top_level(inner);
        let values: Vec<toml::Value> = items
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| parse_value(s).unwrap_or_else(|| toml::Value::String(s.trim().into())))
            .collect();
        return Some(toml::Value::Array(values));
    }
    if let Ok(i) = raw.parse::<i64>() {
        return Some(toml::Value::Integer(i));
    }
    if let Ok(f) = raw.parse::<f64>()
        && f.is_finite()
    {
        return Some(toml::Value::Float(f));
    }
    Some(toml::Value::String(raw.into()))
}

/// `a, [b, c], 'd,e'` split at the commas outside brackets and quotes.
pub(super) fn split_top_level(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth, mut quote) = (Vec::new(), String::new(), 0i32, None);
    for ch in s.chars() {
        match (quote, ch) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(ch),
            (None, '[' | '{') => depth += 1,
            (None, ']' | '}') => depth -= 1,
            (None, ',') if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    out.push(cur);
    out
}

/// What a verl key that this harness does not have does here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Foreign {
    /// Accepted, with a note: it has no effect here, and why.
    NoEffect(&'static str),
}

const NO_FSDP: &str = "FSDP is set here by `zero_stage` alone \
                       (`actor_rollout_ref.actor.`, `critic.` or `reward_model.train.`), which \
                       shards the optimizer state (1), the gradients (2) and the weights (3, \
                       FSDP's FULL_SHARD) over the ranks (docs/distributed.md, \"Sharding\")";
const NO_VLLM: &str = "rollout runs on the built-in engine inside the trainer's process; to \
                       generate on a server instead (harness serve, vLLM or SGLang, the API \
                       chosen by actor_rollout_ref.rollout.name) set \
                       actor_rollout_ref.rollout.server_url";
const NO_SP: &str = "there is no sequence parallelism here";
const NO_MEGATRON: &str = "verl's Megatron engine (tensor, pipeline, context and expert \
                           parallelism, offloading, recomputation, fused kernels, its checkpoint \
                           format and weight bridge): each rank here holds the whole model, or \
                           its shard under `zero_stage`, and computes the same math; MoE \
                           settings apply to no model here (Llama and Qwen2 are dense)";
const VLLM_ENGINE: &str = "arguments of verl's vLLM or SGLang engine: rollout here runs on \
                           the built-in engine, or on a server at \
                           actor_rollout_ref.rollout.server_url configured on its own side";
const REF_MB: &str = "the reference computes log-probabilities in micro-batches of \
                      `actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu`";
const LOG_PROB_MB: &str = "log-probabilities are computed in micro-batches of the actor's \
                           `ppo_micro_batch_size_per_gpu`";

const COPY_OF_N: &str = "verl's config copies it from actor_rollout_ref.rollout.n, which sets \
                         it here";
const NO_COMPILE: &str = "the model runs in libtorch's eager mode (no torch.compile); the fused \
                          head is actor_rollout_ref.model.use_fused_kernels";
const NO_MODEL_PARALLEL: &str = "there is no model parallelism here: each rank holds the whole \
                                 model (a rollout server parallelises as it is started)";
const WHOLE_CHECKPOINT: &str =
    "checkpoints always hold the whole state (model, optimiser, data position, RNG)";
const REWARD_MANAGER: &str = "rows are scored one by one as verl's naive manager scores them: by custom_reward_function (run in a Python worker pool), reward.remote_url, or the rule reward of each row's data_source (with reward_model.overlong_buffer, DAPO's manager), and the reward model; there are no reward managers to pick (docs/rewards.md)";
const TEXT_ONLY: &str = "the models here read text only: no image or video inputs";
const NO_RAY: &str =
    "there is no Ray: ranks are processes started by `--nproc-per-node` or torchrun";

/// verl's keys this harness follows for one value only, matched by their last parts (`optim.
/// optimizer` in any group): the value, and why it is the only one.
const ONE_VALUE: &[(&str, &str, &str)] = &[
    (
        "optim.optimizer",
        "AdamW",
        "the optimiser here is AdamW (torch's update rule)",
    ),
    (
        "reward_manager.name",
        "naive",
        "rows are scored one by one, as verl's naive manager scores them (docs/rewards.md)",
    ),
    (
        "router_replay.mode",
        "disabled",
        "there are no mixture-of-experts routers to replay",
    ),
];

/// A verl key this harness follows for one value only ([`ONE_VALUE`]): `Some(Ok(why))` when
/// `value` is that value (it then has no effect), `Some(Err(why))` when it is another.
pub fn one_value(key: &str, value: Option<&toml::Value>) -> Option<Result<&'static str, String>> {
    let (_, only, why) = ONE_VALUE
        .iter()
        .find(|(k, _, _)| key == *k || key.ends_with(&format!(".{k}")))?;
    let given = match value {
        Some(toml::Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => return Some(Ok(why)),
    };
    Some(if given.eq_ignore_ascii_case(only) {
        Ok(why)
    } else {
        Err(format!(
            "only `{only}` is followed here ({why}), not `{given}`"
        ))
    })
}

/// verl's keys that have no counterpart here: an exact key, or a prefix ending in `.` for a
/// whole group. Kept sorted by key.
const FOREIGN: &[(&str, Foreign)] = &[
    (
        "actor_rollout_ref.actor.checkpoint.",
        Foreign::NoEffect(WHOLE_CHECKPOINT),
    ),
    (
        "actor_rollout_ref.actor.fsdp_config.",
        Foreign::NoEffect(NO_FSDP),
    ),
    (
        "actor_rollout_ref.actor.strategy",
        Foreign::NoEffect(NO_FSDP),
    ),
    (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        Foreign::NoEffect(NO_SP),
    ),
    (
        "actor_rollout_ref.hybrid_engine",
        Foreign::NoEffect("the policy and its rollout share one model in one process"),
    ),
    (
        "actor_rollout_ref.model.enable_activation_offload",
        Foreign::NoEffect("activations stay on the device"),
    ),
    (
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        Foreign::NoEffect(
            "activations are kept for the backward pass (no gradient checkpointing yet): the result is the same, the memory use higher",
        ),
    ),
    (
        "actor_rollout_ref.model.trust_remote_code",
        Foreign::NoEffect("only the built-in Llama and Qwen2 model code is ever run"),
    ),
    (
        "actor_rollout_ref.ref.fsdp_config.",
        Foreign::NoEffect(NO_FSDP),
    ),
    (
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        Foreign::NoEffect(REF_MB),
    ),
    (
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        Foreign::NoEffect(REF_MB),
    ),
    ("actor_rollout_ref.ref.strategy", Foreign::NoEffect(NO_FSDP)),
    (
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        Foreign::NoEffect(NO_SP),
    ),
    (
        "actor_rollout_ref.rollout.disable_log_stats",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.dtype",
        Foreign::NoEffect("the rollout uses the policy's own weights and dtype"),
    ),
    (
        "actor_rollout_ref.rollout.enable_chunked_prefill",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.enforce_eager",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.free_cache_engine",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.load_format",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        Foreign::NoEffect(LOG_PROB_MB),
    ),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        Foreign::NoEffect(LOG_PROB_MB),
    ),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        Foreign::NoEffect(LOG_PROB_MB),
    ),
    (
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        Foreign::NoEffect(LOG_PROB_MB),
    ),
    (
        "actor_rollout_ref.rollout.max_model_len",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.max_num_batched_tokens",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.max_num_seqs",
        Foreign::NoEffect(NO_VLLM),
    ),
    ("actor_rollout_ref.rollout.mode", Foreign::NoEffect(NO_VLLM)),
    (
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        Foreign::NoEffect("there is no tensor parallelism here: each rank holds the whole model"),
    ),
    (
        "critic.model.enable_gradient_checkpointing",
        Foreign::NoEffect(
            "activations are kept for the backward pass (no gradient checkpointing yet)",
        ),
    ),
    ("critic.model.fsdp_config.", Foreign::NoEffect(NO_FSDP)),
    (
        "critic.model.trust_remote_code",
        Foreign::NoEffect("only the built-in Llama and Qwen2 model code is ever run"),
    ),
    ("critic.strategy", Foreign::NoEffect(NO_FSDP)),
    (
        "critic.ulysses_sequence_parallel_size",
        Foreign::NoEffect(NO_SP),
    ),
    (
        "data.gen_batch_size",
        Foreign::NoEffect(
            "dynamic sampling (algorithm.filter_groups) generates batches of data.train_batch_size prompts until enough groups are kept",
        ),
    ),
    ("ray_init.", Foreign::NoEffect(NO_RAY)),
    (
        "reward_model.model.fsdp_config.",
        Foreign::NoEffect(NO_FSDP),
    ),
    (
        "reward_model.reward_manager",
        Foreign::NoEffect(REWARD_MANAGER),
    ),
    ("reward_model.strategy", Foreign::NoEffect(NO_FSDP)),
    (
        "trainer.balance_batch",
        Foreign::NoEffect(
            "each rank takes a consecutive share of the batch (no length balancing yet)",
        ),
    ),
    ("trainer.checkpoint.", Foreign::NoEffect(WHOLE_CHECKPOINT)),
    (
        "trainer.default_hdfs_dir",
        Foreign::NoEffect("checkpoints go to <trainer.runs_dir>/<run>/checkpoints"),
    ),
    (
        "trainer.default_local_dir",
        Foreign::NoEffect("checkpoints go to <trainer.runs_dir>/<run>/checkpoints"),
    ),
    (
        "trainer.n_gpus_per_node",
        Foreign::NoEffect(
            "the number of ranks is `harness train --nproc-per-node N` (or torchrun's)",
        ),
    ),
    (
        "trainer.nnodes",
        Foreign::NoEffect(
            "a multi-node run starts its ranks under torchrun or Slurm on each node (docs/distributed.md)",
        ),
    ),
    (
        "trainer.resume_from_path",
        Foreign::NoEffect("a run continues with `harness resume RUN [--from-step N]`"),
    ),
    (
        "trainer.resume_mode",
        Foreign::NoEffect("a run continues with `harness resume RUN [--from-step N]`"),
    ),
];

/// verl's newer keys (its config of 2026) that have no counterpart here, as [`FOREIGN`]. Kept
/// sorted by key.
const FOREIGN_NEWER: &[(&str, Foreign)] = &[
    (
        "actor_rollout_ref.actor.megatron.",
        Foreign::NoEffect(NO_MEGATRON),
    ),
    (
        "actor_rollout_ref.actor.optim.optimizer_impl",
        Foreign::NoEffect(
            "AdamW is torch's update rule here, written out (rl_workers::roles::optim)",
        ),
    ),
    (
        "actor_rollout_ref.actor.rollout_n",
        Foreign::NoEffect(COPY_OF_N),
    ),
    (
        "actor_rollout_ref.actor.use_fused_kernels",
        Foreign::NoEffect(
            "verl's config copies it from actor_rollout_ref.model.use_fused_kernels, which sets it here",
        ),
    ),
    (
        "actor_rollout_ref.actor.use_remove_padding",
        Foreign::NoEffect(
            "verl's config copies it from actor_rollout_ref.model.use_remove_padding, which sets it here",
        ),
    ),
    (
        "actor_rollout_ref.actor.use_torch_compile",
        Foreign::NoEffect(NO_COMPILE),
    ),
    (
        "actor_rollout_ref.model.fused_kernel_options.",
        Foreign::NoEffect(
            "the fused head has one implementation here (actor_rollout_ref.model.use_fused_kernels)",
        ),
    ),
    (
        "actor_rollout_ref.nccl_timeout",
        Foreign::NoEffect(
            "a collective that waits too long fails the run through the launcher's own checks (docs/distributed.md)",
        ),
    ),
    (
        "actor_rollout_ref.ref.megatron.",
        Foreign::NoEffect(NO_MEGATRON),
    ),
    (
        "actor_rollout_ref.ref.rollout_n",
        Foreign::NoEffect(COPY_OF_N),
    ),
    (
        "actor_rollout_ref.ref.use_torch_compile",
        Foreign::NoEffect(NO_COMPILE),
    ),
    (
        "actor_rollout_ref.rollout.agent.",
        Foreign::NoEffect(
            "agent loops run in the trainer's process: multi-turn tool use is actor_rollout_ref.rollout.multi_turn",
        ),
    ),
    (
        "actor_rollout_ref.rollout.checkpoint_engine.",
        Foreign::NoEffect(
            "a rollout server loads the weights the trainer writes to actor_rollout_ref.rollout.weight_sync_dir (docs/serving.md)",
        ),
    ),
    (
        "actor_rollout_ref.rollout.data_parallel_size",
        Foreign::NoEffect(NO_MODEL_PARALLEL),
    ),
    (
        "actor_rollout_ref.rollout.enable_prefix_caching",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.engine_kwargs.",
        Foreign::NoEffect(VLLM_ENGINE),
    ),
    (
        "actor_rollout_ref.rollout.expert_parallel_size",
        Foreign::NoEffect(NO_MODEL_PARALLEL),
    ),
    (
        "actor_rollout_ref.rollout.layered_summon",
        Foreign::NoEffect(
            "the rollout reads the trained weights in place (verl gathers FSDP shards for vLLM layer by layer)",
        ),
    ),
    (
        "actor_rollout_ref.rollout.logprobs_mode",
        Foreign::NoEffect(
            "the rollout's log-probs are those of the sampled distribution (after temperature), as verl's default",
        ),
    ),
    (
        "actor_rollout_ref.rollout.over_sample_rate",
        Foreign::NoEffect("every rollout runs to its end: nothing is over-sampled and aborted"),
    ),
    (
        "actor_rollout_ref.rollout.pipeline_model_parallel_size",
        Foreign::NoEffect(NO_MODEL_PARALLEL),
    ),
    (
        "actor_rollout_ref.rollout.prompt_length",
        Foreign::NoEffect(
            "verl's config copies it from data.max_prompt_length, which sets it here",
        ),
    ),
    (
        "actor_rollout_ref.rollout.scheduling_policy",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.skip_dump_dir",
        Foreign::NoEffect(NO_VLLM),
    ),
    (
        "actor_rollout_ref.rollout.skip_tokenizer_init",
        Foreign::NoEffect(NO_VLLM),
    ),
    ("critic.checkpoint.", Foreign::NoEffect(WHOLE_CHECKPOINT)),
    (
        "critic.forward_max_token_len_per_gpu",
        Foreign::NoEffect(
            "the critic computes values in its update's micro-batches: critic.ppo_micro_batch_size_per_gpu, or critic.ppo_max_token_len_per_gpu with use_dynamic_bsz",
        ),
    ),
    ("critic.megatron.", Foreign::NoEffect(NO_MEGATRON)),
    (
        "critic.model.tokenizer_path",
        Foreign::NoEffect("the critic reads the token ids of the batch: it needs no tokenizer"),
    ),
    (
        "critic.optim.optimizer_impl",
        Foreign::NoEffect(
            "AdamW is torch's update rule here, written out (rl_workers::roles::optim)",
        ),
    ),
    ("critic.rollout_n", Foreign::NoEffect(COPY_OF_N)),
    (
        "data.filter_overlong_prompts_workers",
        Foreign::NoEffect("prompts are filtered by the loader in this process"),
    ),
    ("data.image_key", Foreign::NoEffect(TEXT_ONLY)),
    ("data.image_patch_size", Foreign::NoEffect(TEXT_ONLY)),
    (
        "data.return_multi_modal_inputs",
        Foreign::NoEffect(TEXT_ONLY),
    ),
    ("data.video_key", Foreign::NoEffect(TEXT_ONLY)),
    ("reward_manager.", Foreign::NoEffect(REWARD_MANAGER)),
    ("reward_model.megatron.", Foreign::NoEffect(NO_MEGATRON)),
    (
        "trainer.esi_redundant_time",
        Foreign::NoEffect(
            "checkpoints are taken at trainer.save_freq and when a signal stops the run",
        ),
    ),
    (
        "trainer.ray_wait_register_center_timeout",
        Foreign::NoEffect(NO_RAY),
    ),
    (
        "trainer.use_legacy_worker_impl",
        Foreign::NoEffect("there is one worker implementation here"),
    ),
];

/// What verl key `key` (one this harness does not know) does here, if it is one of verl's.
pub fn foreign(key: &str) -> Option<Foreign> {
    FOREIGN
        .iter()
        .chain(FOREIGN_NEWER)
        .find(|(k, _)| match k.strip_suffix('.') {
            Some(group) => key == group || key.starts_with(k),
            None => key == *k,
        })
        .map(|(_, f)| *f)
}

/// verl's keys that are one of this harness's under another name: (verl's prefix, ours).
/// verl's DAPO reward manager now takes its overlong buffer in `reward_kwargs` (its recipe's
/// earlier config, `reward_model.overlong_buffer`, is this harness's name).
const ALIASES: &[(&str, &str)] = &[(
    "reward_model.reward_kwargs.overlong_buffer_cfg.",
    "reward_model.overlong_buffer.",
)];

/// This harness's name for a key verl names otherwise ([`ALIASES`]).
pub fn alias(key: &str) -> Option<String> {
    ALIASES
        .iter()
        .find_map(|(verl, ours)| key.strip_prefix(verl).map(|rest| format!("{ours}{rest}")))
}

/// Every key [`foreign`] knows (for a test that none shadows one of ours).
pub fn foreign_keys() -> impl Iterator<Item = &'static str> {
    FOREIGN.iter().chain(FOREIGN_NEWER).map(|(k, _)| *k)
}

/// The sinks verl's `trainer.logger` names, beside the run store and the console.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sinks {
    /// `mlflow`: `trainer.tracker.kind = "mlflow"`.
    pub mlflow: bool,
    /// `tensorboard`: `trainer.tensorboard = true`.
    pub tensorboard: bool,
}

impl Sinks {
    /// The keys of the `trainer` group the sinks set: `tracker.kind` and `tensorboard`.
    pub fn settings(&self) -> [(&'static str, toml::Value); 2] {
        let kind = if self.mlflow { "mlflow" } else { "none" };
        [
            ("tracker.kind", toml::Value::String(kind.into())),
            ("tensorboard", toml::Value::Boolean(self.tensorboard)),
        ]
    }

    /// `the run store, the console and MLflow`.
    pub fn describe(&self) -> String {
        let mut s = vec!["the run store", "the console"];
        if self.mlflow {
            s.push("MLflow (trainer.tracker)");
        }
        if self.tensorboard {
            s.push("TensorBoard event files (trainer.tensorboard)");
        }
        s.join(", ")
    }
}

/// verl's `trainer.logger` (`["console", "mlflow", "tensorboard"]`, or one name): the sinks it
/// maps to, or an error naming the sinks this harness does not write.
pub fn logger(value: Option<&toml::Value>) -> Result<Sinks> {
    let names: Vec<String> = match value {
        None => Vec::new(),
        Some(toml::Value::String(s)) => vec![s.clone()],
        Some(toml::Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                toml::Value::String(s) => Ok(s.clone()),
                other => bail!("config key `trainer.logger`: expected names, found {other}"),
            })
            .collect::<Result<_>>()?,
        Some(other) => {
            bail!("config key `trainer.logger`: expected a list of names, found {other}")
        }
    };
    let mut sinks = Sinks::default();
    for n in &names {
        match n.as_str() {
            "console" => {}
            "mlflow" => sinks.mlflow = true,
            "tensorboard" => sinks.tensorboard = true,
            other => bail!(
                "config key `trainer.logger`: `{other}` is not written by this harness; it \
                 writes `console`, `mlflow` (trainer.tracker, an MLflow server at \
                 trainer.tracker.uri) and `tensorboard` (event files), and the run store \
                 keeps every metric either way"
            ),
        }
    }
    Ok(sinks)
}
