//! verl's SFT trainers in this harness's keys, for `harness config from-verl`: the legacy one
//! (`verl.trainer.fsdp_sft_trainer`, `sft_trainer.yaml`: single-turn columns or
//! `data.multiturn`) and the engine one (`verl.trainer.sft_trainer`, `sft_trainer_engine.yaml`:
//! conversations in `data.messages_key`, `model` as verl's `hf_model`, `engine` its FSDP
//! engine). Their `data`, `model`, `optim` and `engine` groups are laid out unlike the RL
//! trainer's, so their keys are renamed here before the shared mapping checks them. verl's SFT
//! defaults that differ from this harness's (a batch of 256, micro-batches of 4, 1024 tokens, 4
//! epochs; the legacy trainer's lr 1e-5, cosine with 10% warmup, betas (0.9, 0.95) and
//! `question`/`answer` columns; the engine's lr 1e-3 and token-budget micro-batches) are
//! written out where the config leaves them to verl.

use std::collections::BTreeMap;

use super::from_verl::{Pairs, last};
use super::verl::parse_value;

/// verl's SFT keys renamed to this harness's, with a word on each where it helps.
const RENAMED: &[(&str, &str, &str)] = &[
    ("data.train_batch_size", "sft.train_batch_size", ""),
    (
        "data.micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "; the loss here is the whole batch's token mean over all ranks, as verl's engine SFT \
         trainer takes it, so no result depends on it: verl's legacy trainer averaged each \
         micro-batch's own token mean",
    ),
    ("data.max_length", "sft.max_length", ""),
    ("data.truncation", "sft.truncation", ""),
    ("model.partial_pretrain", "actor_rollout_ref.model.path", ""),
    ("model.tokenizer_path", "data.tokenizer", ""),
    (
        "data.use_dynamic_bsz",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "",
    ),
    (
        "data.max_token_len_per_gpu",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "",
    ),
    ("model.strategy", "actor_rollout_ref.actor.strategy", ""),
    ("optim.clip_grad", "actor_rollout_ref.actor.grad_clip", ""),
    (
        "optim.lr_scheduler",
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
        "",
    ),
    (
        "use_remove_padding",
        "actor_rollout_ref.model.use_remove_padding",
        "",
    ),
    (
        "ulysses_sequence_parallel_size",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "",
    ),
];

/// Whole groups renamed by prefix (the first that matches).
const RENAMED_GROUPS: &[(&str, &str)] = &[
    ("model.fsdp_config.", "actor_rollout_ref.actor.fsdp_config."),
    ("model.", "actor_rollout_ref.model."),
    ("optim.", "actor_rollout_ref.actor.optim."),
    ("engine.", "actor_rollout_ref.actor.fsdp_config."),
];

/// verl's SFT keys with no effect here, and why: an exact key, or a prefix ending in `.`.
const NO_EFFECT: &[(&str, &str)] = &[
    (
        "engine",
        "Hydra's choice of verl's training engine (FSDP, Megatron, VeOmni): there is one engine \
         here, its sharding set by actor_rollout_ref.actor.zero_stage",
    ),
    (
        "optim",
        "Hydra's choice of verl's optimiser config: the optimiser here is AdamW, set by \
         actor_rollout_ref.actor.optim.*",
    ),
    (
        "checkpoint.",
        "checkpoints always hold the whole state (model, optimiser, data position, RNG)",
    ),
    (
        "data.balance_dp_token",
        "the SFT loss here is always the token mean of the whole batch over all ranks (as verl's \
         engine SFT trainer normalises it)",
    ),
    (
        "data.enable_thinking_default",
        "the chat template is rendered with its own defaults; a row's thinking switch is not read",
    ),
    (
        "data.enable_thinking_key",
        "the chat template is rendered with its own defaults; a row's thinking switch is not read",
    ),
    (
        "data.ignore_input_ids_mismatch",
        "a conversation is tokenised from renders of its growing prefixes; a chat template that \
         does not preserve them is an error naming it",
    ),
    (
        "data.micro_batch_size",
        "deprecated in verl, which reads `data.micro_batch_size_per_gpu`",
    ),
    (
        "data.num_workers",
        "rows are tokenised in the trainer's process as batches are drawn",
    ),
    (
        "data.pad_mode",
        "the batch layout follows actor_rollout_ref.model.use_remove_padding (verl's \
         model.use_remove_padding): packed rows, or padded ones",
    ),
    (
        "data.tools_key",
        "the conversations are rendered with the chat template alone; a row's tool schemas are \
         not read",
    ),
    ("data.use_shm", "files are read where they are"),
    (
        "engine.dtype",
        "verl's FSDP engine computes in this dtype under mixed precision; here the compute dtype \
         is actor_rollout_ref.actor.mixed_precision.param_dtype (float32 unless set)",
    ),
    (
        "trainer.profile_interval",
        "verl's profiler: profiling changes no result; profile here with `perf` or `scripts/bench`",
    ),
    (
        "profiler.",
        "verl's profiler: profiling changes no result; profile here with `perf` or `scripts/bench`",
    ),
];

/// Which of verl's SFT trainers a config is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SftTrainer {
    /// `verl.trainer.fsdp_sft_trainer` (`sft_trainer.yaml`).
    Legacy,
    /// `verl.trainer.sft_trainer` (`sft_trainer_engine.yaml`).
    Engine,
}

/// The engine trainer's defaults where this harness's differ (optim from verl's `optim/fsdp.yaml`).
const ENGINE_DEFAULTS: &[(&str, &str, &str)] = &[
    ("data.train_batch_size", "sft.train_batch_size", "256"),
    (
        "data.micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "4",
    ),
    (
        "data.use_dynamic_bsz",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "true",
    ),
    (
        "data.max_token_len_per_gpu",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "8192",
    ),
    ("data.max_length", "sft.max_length", "1024"),
    ("optim.lr", "actor_rollout_ref.actor.optim.lr", "1e-3"),
    ("trainer.total_epochs", "trainer.total_epochs", "4"),
];

/// The legacy trainer's defaults where this harness's differ (`sft_trainer.yaml`).
const DEFAULTS: &[(&str, &str, &str)] = &[
    ("data.train_batch_size", "sft.train_batch_size", "256"),
    (
        "data.micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "4",
    ),
    ("data.max_length", "sft.max_length", "1024"),
    ("optim.lr", "actor_rollout_ref.actor.optim.lr", "1e-5"),
    (
        "optim.betas",
        "actor_rollout_ref.actor.optim.betas",
        "[0.9, 0.95]",
    ),
    (
        "optim.lr_warmup_steps_ratio",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        "0.1",
    ),
    (
        "optim.lr_scheduler",
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
        "cosine",
    ),
    ("trainer.total_epochs", "trainer.total_epochs", "4"),
];

/// An SFT config in this harness's keys.
#[derive(Debug, Default)]
pub(super) struct SftKeys {
    /// `key` (ours) -> the value as a command line writes it, in order.
    pub pairs: Pairs,
    /// Our key -> where its value came from, said after the mapped line.
    pub notes: BTreeMap<String, String>,
    /// `key: why` for verl keys with no effect here.
    pub ignored: Vec<String>,
    /// `key: why` for verl keys refused.
    pub refused: Vec<String>,
}

impl SftKeys {
    fn push(&mut self, key: &str, raw: String, note: String) {
        self.pairs.push((key.to_owned(), raw));
        self.notes.insert(key.to_owned(), note);
    }
}

/// Which SFT trainer's config this is, if any (for a YAML, which names no entry point): the
/// legacy one names its model `model.partial_pretrain`, the engine one reads conversations from
/// `data.messages_key` and has no RL groups.
pub(super) fn sft_config_kind(pairs: &Pairs) -> Option<SftTrainer> {
    let has = |key: &str| pairs.iter().any(|(k, _)| k == key);
    if has("model.partial_pretrain") {
        Some(SftTrainer::Legacy)
    } else if has("data.messages_key")
        && !pairs
            .iter()
            .any(|(k, _)| k.starts_with("actor_rollout_ref."))
    {
        Some(SftTrainer::Engine)
    } else {
        None
    }
}

/// verl's SFT trainer keys `pairs` (of trainer `kind`) in this harness's keys.
pub(super) fn to_harness_keys(kind: SftTrainer, pairs: &Pairs) -> SftKeys {
    let get = |key: &str| last(pairs, key);
    let mut out = SftKeys::default();
    let multiturn = kind == SftTrainer::Engine
        || matches!(
            get("data.multiturn.enable").and_then(parse_value),
            Some(toml::Value::Boolean(true))
        );
    let messages_key = match kind {
        SftTrainer::Legacy => "data.multiturn.messages_key",
        SftTrainer::Engine => "data.messages_key",
    };
    if multiturn {
        let (raw, note) = match get(messages_key) {
            Some(raw) => (raw.to_owned(), format!("verl's {messages_key}")),
            None => ("messages".to_owned(), "verl's SFT default".to_owned()),
        };
        out.push("sft.messages_key", raw, note);
    } else {
        for side in ["prompt", "response"] {
            column_path(pairs, side, &mut out);
        }
    }
    for (key, raw) in pairs {
        if let Some(rest) = key.strip_prefix("data.multiturn.") {
            match rest {
                "enable" if !multiturn => out.ignored.push(format!(
                    "{key}: single-turn, read from the prompt and response columns \
                     (sft.prompt_key, sft.response_key)"
                )),
                "enable" | "messages_key" => {}
                _ if !multiturn => out.ignored.push(format!(
                    "{key}: under `data.multiturn`, which the config switches off"
                )),
                "tools_key" => out.ignored.push(format!(
                    "{key}: the conversations are rendered with the chat template alone; a row's \
                     tool schemas are not read"
                )),
                "enable_thinking_key" => out.ignored.push(format!(
                    "{key}: the chat template is rendered with its own defaults; a row's \
                     thinking switch is not read"
                )),
                _ => out.pairs.push((key.clone(), raw.clone())),
            }
            continue;
        }
        if [
            "data.prompt_key",
            "data.prompt_dict_keys",
            "data.response_key",
            "data.response_dict_keys",
        ]
        .contains(&key.as_str())
        {
            if multiturn {
                out.ignored
                    .push(format!("{key}: a multi-turn config reads `{messages_key}`"));
            }
            continue;
        }
        if key == "data.messages_key" {
            continue;
        }
        if key == "trainer.test_freq"
            && let Some(toml::Value::String(when)) = parse_value(raw)
        {
            out.refused.push(format!(
                "{key}: `{when}` is not followed here: trainer.test_freq counts steps; set it to \
                 the steps of an epoch (rows / sft.train_batch_size) to validate after each"
            ));
            continue;
        }
        if let Some((_, why)) = NO_EFFECT
            .iter()
            .find(|(k, _)| k == key || (k.ends_with('.') && key.starts_with(k)))
        {
            out.ignored.push(format!("{key}: {why}"));
            continue;
        }
        if key == "model.fsdp_config.model_dtype" || key == "engine.model_dtype" {
            model_dtype(key, raw, &mut out);
            continue;
        }
        if let Some(rest) = key.strip_prefix("model.lora.") {
            // Megatron-Core's LoRA table of verl's hf_model: switched off unless its rank is set
            let rank = get("model.lora.rank").and_then(parse_value);
            if matches!(rank, None | Some(toml::Value::Integer(0))) {
                out.ignored.push(format!(
                    "{key}: verl's Megatron LoRA table, off (rank 0); LoRA here is model.lora_rank"
                ));
            } else if rest == "rank" {
                out.refused.push(format!(
                    "{key}: verl's Megatron LoRA is not followed here; set model.lora_rank (PEFT's \
                     LoRA on the linear layers) instead"
                ));
            }
            continue;
        }
        if let Some((_, ours, why)) = RENAMED.iter().find(|(k, _, _)| k == key) {
            out.push(ours, raw.clone(), format!("verl's {key}{why}"));
            continue;
        }
        if let Some((from, to)) = RENAMED_GROUPS.iter().find(|(p, _)| key.starts_with(p)) {
            let ours = format!("{to}{}", &key[from.len()..]);
            out.push(&ours, raw.clone(), format!("verl's {key}"));
            continue;
        }
        out.pairs.push((key.clone(), raw.clone()));
    }
    if kind == SftTrainer::Engine && get("data.val_files").is_none() {
        out.push(
            "data.val_files",
            "[]".to_owned(),
            "verl's engine SFT default, null: no validation".to_owned(),
        );
    }
    let defaults = match kind {
        SftTrainer::Legacy => DEFAULTS,
        SftTrainer::Engine => ENGINE_DEFAULTS,
    };
    for (verl_key, ours, value) in defaults {
        if get(verl_key).is_none() {
            out.push(ours, (*value).to_owned(), "verl's SFT default".to_owned());
        }
    }
    // one optimiser step per batch, as verl's SFT trainer takes
    if let Some(batch) = last(&out.pairs, "sft.train_batch_size").map(str::to_owned) {
        out.push(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            batch,
            "the batch: verl's SFT trainer takes one optimiser step per batch".to_owned(),
        );
    }
    out
}

/// `key` (`model.fsdp_config.model_dtype`, or the engine's `engine.model_dtype`), the dtype
/// verl's SFT trainer loads the weights in.
fn model_dtype(key: &str, raw: &str, out: &mut SftKeys) {
    let given = match parse_value(raw) {
        Some(toml::Value::String(s)) => s,
        other => format!("{other:?}"),
    };
    match given.as_str() {
        "fp32" | "float32" => out.ignored.push(format!(
            "{key}: the weights load in float32 here too (actor_rollout_ref.model.dtype); verl's \
             SFT trainers then compute in bf16 under FSDP's mixed precision, which is \
             actor_rollout_ref.actor.mixed_precision.param_dtype = \"bf16\" here (float32 \
             unless set)"
        )),
        "bf16" | "bfloat16" => out.push(
            "actor_rollout_ref.model.dtype",
            "bfloat16".into(),
            format!("verl's {key}"),
        ),
        _ => out.refused.push(format!(
            "{key}: `{given}` is not a dtype the weights load in here (float32 or bfloat16)"
        )),
    }
}

/// `data.<side>_key` with `data.<side>_dict_keys` as `sft.<side>_key`, a `column.field…` path.
fn column_path(pairs: &Pairs, side: &str, out: &mut SftKeys) {
    let key = format!("data.{side}_key");
    let dict_key = format!("data.{side}_dict_keys");
    let get = |k: &str| last(pairs, k);
    let default = if side == "prompt" {
        "question"
    } else {
        "answer"
    };
    let (column, mut from) = match get(&key).map(parse_value) {
        None | Some(None) => (default.to_owned(), "verl's SFT default".to_owned()),
        Some(Some(toml::Value::String(s))) => (s, format!("verl's {key}")),
        Some(Some(other)) => {
            out.refused.push(format!(
                "{key}: {other} is not one column; give the column that holds the {side}"
            ));
            return;
        }
    };
    let fields = match get(&dict_key).map(parse_value) {
        None | Some(None) => Vec::new(),
        Some(Some(toml::Value::String(s))) => vec![s],
        Some(Some(toml::Value::Array(items))) => {
            let names: Option<Vec<String>> = items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect();
            let Some(names) = names else {
                out.refused.push(format!(
                    "{dict_key}: {} is not a list of field names",
                    toml::Value::Array(items)
                ));
                return;
            };
            names
        }
        Some(Some(other)) => {
            out.refused
                .push(format!("{dict_key}: {other} is not a list of field names"));
            return;
        }
    };
    if !fields.is_empty() {
        from = format!("{from} with {dict_key}");
    }
    let path = std::iter::once(column).chain(fields).collect::<Vec<_>>();
    out.push(
        &format!("sft.{side}_key"),
        format!("'{}'", path.join(".")),
        from,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(words: &[(&str, &str)]) -> Pairs {
        words
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn value<'a>(keys: &'a SftKeys, key: &str) -> Option<&'a str> {
        last(&keys.pairs, key)
    }

    /// verl's gsm8k example: the question and answer inside `extra_info`, a model, an lr; what
    /// it leaves out takes verl's SFT defaults, and the mini-batch is the batch.
    #[test]
    fn verls_gsm8k_sft_example_renames_and_fills_verls_defaults() {
        let k = to_harness_keys(
            SftTrainer::Legacy,
            &pairs(&[
                ("data.prompt_key", "extra_info"),
                ("data.response_key", "extra_info"),
                ("optim.lr", "1e-4"),
                ("data.prompt_dict_keys", "['question']"),
                ("data.response_dict_keys", "['answer']"),
                ("data.micro_batch_size_per_gpu", "4"),
                ("model.partial_pretrain", "Qwen/Qwen2.5-0.5B-Instruct"),
                ("model.lora_rank", "32"),
                ("model.fsdp_config.cpu_offload", "False"),
                ("trainer.total_epochs", "1"),
                ("use_remove_padding", "true"),
            ]),
        );
        assert!(k.refused.is_empty() && k.ignored.is_empty(), "{k:?}");
        for (key, v) in [
            ("sft.prompt_key", "'extra_info.question'"),
            ("sft.response_key", "'extra_info.answer'"),
            ("actor_rollout_ref.actor.optim.lr", "1e-4"),
            ("actor_rollout_ref.model.path", "Qwen/Qwen2.5-0.5B-Instruct"),
            ("actor_rollout_ref.model.lora_rank", "32"),
            ("actor_rollout_ref.actor.fsdp_config.cpu_offload", "False"),
            ("actor_rollout_ref.model.use_remove_padding", "true"),
            ("trainer.total_epochs", "1"),
            ("sft.train_batch_size", "256"),
            ("actor_rollout_ref.actor.ppo_mini_batch_size", "256"),
            ("actor_rollout_ref.actor.optim.lr_scheduler_type", "cosine"),
            ("actor_rollout_ref.actor.optim.betas", "[0.9, 0.95]"),
            ("sft.max_length", "1024"),
        ] {
            assert_eq!(value(&k, key), Some(v), "{key}: {k:?}");
        }
        assert_eq!(
            k.notes["sft.prompt_key"],
            "verl's data.prompt_key with data.prompt_dict_keys"
        );
        assert_eq!(k.notes["sft.train_batch_size"], "verl's SFT default");
        // nothing given: verl's columns
        let k = to_harness_keys(
            SftTrainer::Legacy,
            &pairs(&[("model.partial_pretrain", "m")]),
        );
        assert_eq!(value(&k, "sft.prompt_key"), Some("'question'"));
        assert_eq!(value(&k, "sft.response_key"), Some("'answer'"));
    }

    /// verl's engine SFT trainer (its e2e script's FSDP variant): conversations in
    /// `data.messages_key`, `model.path`, the engine's keys as FSDP's, token-budget
    /// micro-batches; verl's engine defaults where the command line leaves them (lr 1e-3, no
    /// validation files); Megatron's LoRA table off; `after_each_epoch` refused with the way.
    #[test]
    fn verls_engine_sft_trainer_reads_conversations() {
        let k = to_harness_keys(
            SftTrainer::Engine,
            &pairs(&[
                ("data.train_files", "a.parquet"),
                ("data.use_dynamic_bsz", "True"),
                ("data.max_token_len_per_gpu", "2048"),
                ("data.messages_key", "messages"),
                ("data.pad_mode", "no_padding"),
                ("model.path", "m"),
                ("model.use_remove_padding", "True"),
                ("model.lora.rank", "0"),
                ("model.lora.alpha", "32"),
                ("engine", "fsdp"),
                ("optim", "fsdp"),
                ("optim.lr", "1e-5"),
                ("optim.clip_grad", "1.0"),
                ("engine.strategy", "fsdp"),
                ("engine.model_dtype", "bf16"),
                ("trainer.test_freq", "after_each_epoch"),
            ]),
        );
        for (key, v) in [
            ("sft.messages_key", "messages"),
            ("actor_rollout_ref.model.path", "m"),
            ("actor_rollout_ref.model.use_remove_padding", "True"),
            ("actor_rollout_ref.actor.use_dynamic_bsz", "True"),
            ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "2048"),
            ("actor_rollout_ref.actor.optim.lr", "1e-5"),
            ("actor_rollout_ref.actor.grad_clip", "1.0"),
            ("actor_rollout_ref.actor.fsdp_config.strategy", "fsdp"),
            ("actor_rollout_ref.model.dtype", "bfloat16"),
            ("data.val_files", "[]"),
            ("sft.train_batch_size", "256"),
            ("actor_rollout_ref.actor.ppo_mini_batch_size", "256"),
        ] {
            assert_eq!(value(&k, key), Some(v), "{key}: {k:?}");
        }
        assert_eq!(value(&k, "sft.prompt_key"), None);
        let (ignored, refused) = (k.ignored.join("\n"), k.refused.join("\n"));
        for line in [
            "data.pad_mode: the batch layout",
            "model.lora.rank: verl's Megatron LoRA table, off",
            "model.lora.alpha: verl's Megatron LoRA table, off",
            "engine: Hydra's choice",
            "optim: Hydra's choice",
        ] {
            assert!(ignored.contains(line), "{line}: {ignored}");
        }
        assert!(
            refused.contains("trainer.test_freq: `after_each_epoch` is not followed here")
                && k.refused.len() == 1,
            "{refused}"
        );
        // the command line leaves the lr to verl: its engine's default
        let k = to_harness_keys(SftTrainer::Engine, &pairs(&[("model.path", "m")]));
        assert_eq!(value(&k, "actor_rollout_ref.actor.optim.lr"), Some("1e-3"));
        assert_eq!(value(&k, "sft.messages_key"), Some("messages"));
        // Megatron's LoRA switched on is refused
        let k = to_harness_keys(SftTrainer::Engine, &pairs(&[("model.lora.rank", "8")]));
        assert!(k.refused.join("").contains("set model.lora_rank"), "{k:?}");
    }

    /// A multi-turn config reads its messages column; the single-turn keys and the tools key
    /// are said to have no effect; a list of prompt columns is refused.
    #[test]
    fn multi_turn_and_unreadable_column_keys() {
        let k = to_harness_keys(
            SftTrainer::Legacy,
            &pairs(&[
                ("data.multiturn.enable", "true"),
                ("data.multiturn.messages_key", "conversation"),
                ("data.multiturn.tools_key", "tools"),
                ("data.prompt_key", "question"),
                ("data.train_batch_size", "16"),
            ]),
        );
        assert_eq!(value(&k, "sft.messages_key"), Some("conversation"));
        assert_eq!(value(&k, "sft.prompt_key"), None);
        assert_eq!(
            value(&k, "actor_rollout_ref.actor.ppo_mini_batch_size"),
            Some("16")
        );
        let ignored = k.ignored.join("\n");
        assert!(
            ignored.contains("data.multiturn.tools_key: the conversations")
                && ignored.contains("data.prompt_key: a multi-turn config"),
            "{ignored}"
        );
        let k = to_harness_keys(
            SftTrainer::Legacy,
            &pairs(&[
                ("data.multiturn.enable", "false"),
                ("data.multiturn.tools_key", "tools"),
                ("data.prompt_key", "[a,b]"),
                ("data.response_dict_keys", "[1]"),
            ]),
        );
        assert_eq!(value(&k, "sft.messages_key"), None);
        let (ignored, refused) = (k.ignored.join("\n"), k.refused.join("\n"));
        assert!(
            ignored.contains(
                "data.multiturn.tools_key: under `data.multiturn`, which the config switches off"
            ) && ignored.contains("data.multiturn.enable: single-turn"),
            "{ignored}"
        );
        assert!(
            refused.contains("data.prompt_key: [\"a\", \"b\"] is not one column")
                && refused.contains("data.response_dict_keys: [1] is not a list of field names"),
            "{refused}"
        );
    }
}
