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
fn split_top_level(s: &str) -> Vec<String> {
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
const REF_MB: &str = "the reference computes log-probabilities in micro-batches of \
                      `actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu`";
const LOG_PROB_MB: &str = "log-probabilities are computed in micro-batches of the actor's \
                           `ppo_micro_batch_size_per_gpu`";

/// verl's keys that have no counterpart here: an exact key, or a prefix ending in `.` for a
/// whole group. Kept sorted by key.
const FOREIGN: &[(&str, Foreign)] = &[
    (
        "actor_rollout_ref.actor.checkpoint.",
        Foreign::NoEffect(
            "checkpoints always hold the whole state (model, optimiser, data position, RNG)",
        ),
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
    (
        "ray_init.",
        Foreign::NoEffect(
            "there is no Ray: ranks are processes started by `--nproc-per-node` or torchrun",
        ),
    ),
    (
        "reward_model.model.fsdp_config.",
        Foreign::NoEffect(NO_FSDP),
    ),
    (
        "reward_model.reward_manager",
        Foreign::NoEffect(
            "rows are scored one by one as verl's naive manager scores them: by custom_reward_function (run in a Python worker pool), reward.remote_url, or the rule reward of each row's data_source (with reward_model.overlong_buffer, DAPO's manager), and the reward model; there are no reward managers to pick (docs/rewards.md)",
        ),
    ),
    ("reward_model.strategy", Foreign::NoEffect(NO_FSDP)),
    (
        "trainer.balance_batch",
        Foreign::NoEffect(
            "each rank takes a consecutive share of the batch (no length balancing yet)",
        ),
    ),
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

/// What verl key `key` (one this harness does not know) does here, if it is one of verl's.
pub fn foreign(key: &str) -> Option<Foreign> {
    FOREIGN
        .iter()
        .find(|(k, _)| match k.strip_suffix('.') {
            Some(group) => key == group || key.starts_with(k),
            None => key == *k,
        })
        .map(|(_, f)| *f)
}

/// Every key [`foreign`] knows (for a test that none shadows one of ours).
pub fn foreign_keys() -> impl Iterator<Item = &'static str> {
    FOREIGN.iter().map(|(k, _)| *k)
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
