//! The `data:` config group with verl's names and defaults, plus the SFT and preference variants.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Error, Result};

/// What to do with a prompt longer than `max_prompt_length` (verl's `data.truncation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Truncation {
    /// Fail, naming the file, row and column (verl's default).
    #[default]
    Error,
    /// Keep the last `max_prompt_length` tokens.
    Left,
    /// Keep the first `max_prompt_length` tokens.
    Right,
    /// Keep the first `max/2` and the last `max - max/2` tokens.
    Middle,
}

impl Truncation {
    /// Applies the rule to `ids`; `Ok(None)` means the prompt is too long and the rule is `Error`.
    pub fn apply(self, ids: &[u32], max_len: usize) -> Option<Vec<u32>> {
        if ids.len() <= max_len {
            return Some(ids.to_vec());
        }
        match self {
            Truncation::Error => None,
            Truncation::Left => Some(ids[ids.len() - max_len..].to_vec()),
            Truncation::Right => Some(ids[..max_len].to_vec()),
            Truncation::Middle => {
                let left = max_len / 2;
                let right = max_len - left;
                let mut out = ids[..left].to_vec();
                out.extend_from_slice(&ids[ids.len() - right..]);
                Some(out)
            }
        }
    }
}

/// One path or a list of paths (verl accepts both for `train_files`).
fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<PathBuf>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(PathBuf),
        Many(Vec<PathBuf>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(p) => vec![p],
        OneOrMany::Many(v) => v,
    })
}

/// A list that verl's YAML may leave `null` (read as empty).
fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<String>, D::Error> {
    Ok(Option::<Vec<String>>::deserialize(d)?.unwrap_or_default())
}

/// verl's `data:` group for RL trainers (PPO, GRPO, ...). Defaults are verl's
/// (`verl/trainer/config/data/legacy_data.yaml`) except where a field says otherwise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Tokenizer directory; `None` = the model's directory.
    pub tokenizer: Option<PathBuf>,
    /// Training parquet file(s), concatenated in order.
    #[serde(deserialize_with = "one_or_many")]
    pub train_files: Vec<PathBuf>,
    /// Validation parquet file(s).
    #[serde(deserialize_with = "one_or_many")]
    pub val_files: Vec<PathBuf>,
    /// Cap on training rows (the first N after concatenation); -1 = all.
    pub train_max_samples: i64,
    /// Cap on validation rows; -1 = all.
    pub val_max_samples: i64,
    /// Column holding the prompt: a list of `{role, content}` messages, or a plain string
    /// (rendered as one user message).
    pub prompt_key: String,
    /// Column that selects the reward function.
    pub reward_fn_key: String,
    /// Prompt length limit in tokens, after the chat template.
    pub max_prompt_length: usize,
    /// Response length limit in tokens (read by rollout).
    pub max_response_length: usize,
    /// Prompts per training step.
    pub train_batch_size: usize,
    /// Prompts per validation batch; `None` = the whole validation set in one batch.
    pub val_batch_size: Option<usize>,
    /// Carry the raw chat messages along (`raw_prompt`).
    pub return_raw_chat: bool,
    /// Carry the rendered prompt string along (`full_prompts`).
    pub return_full_prompt: bool,
    /// Shuffle training rows, with a new order every epoch.
    pub shuffle: bool,
    /// Shuffle seed; `None` means 1 here (verl leaves torch's generator unseeded).
    pub seed: Option<u64>,
    /// Shuffle the validation set.
    pub validation_shuffle: bool,
    /// Drop rows whose rendered prompt is longer than `max_prompt_length` at load time.
    pub filter_overlong_prompts: bool,
    /// What to do with an over-long prompt that was not filtered.
    pub truncation: Truncation,
    /// Drop the last incomplete batch of an epoch (verl's train dataloader does).
    pub drop_last: bool,
    /// Pad every batch to `max_prompt_length` as verl does (`true`), or only to the longest
    /// prompt in the batch (`false`, less compute on small models). Ours; verl always pads.
    pub pad_to_max_prompt_length: bool,
    /// Extra variables for the chat template (`enable_thinking`, `tools`, `chat_template`).
    pub apply_chat_template_kwargs: BTreeMap<String, serde_json::Value>,
    /// Accepted for verl compatibility; the loader here reads in process.
    pub dataloader_num_workers: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            tokenizer: None,
            train_files: vec![PathBuf::from("~/data/rlhf/gsm8k/train.parquet")],
            val_files: vec![PathBuf::from("~/data/rlhf/gsm8k/test.parquet")],
            train_max_samples: -1,
            val_max_samples: -1,
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_prompt_length: 512,
            max_response_length: 512,
            train_batch_size: 1024,
            val_batch_size: None,
            return_raw_chat: true,
            return_full_prompt: false,
            shuffle: true,
            seed: None,
            validation_shuffle: false,
            filter_overlong_prompts: false,
            truncation: Truncation::Error,
            drop_last: true,
            pad_to_max_prompt_length: true,
            apply_chat_template_kwargs: BTreeMap::new(),
            dataloader_num_workers: 8,
        }
    }
}

impl DataConfig {
    /// Checks ranges and cross-field rules; every message names the key.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, message: String| {
            Err(Error::Config {
                key: key.into(),
                message,
            })
        };
        if self.max_prompt_length == 0 {
            return bad("data.max_prompt_length", "must be at least 1".into());
        }
        if self.train_batch_size == 0 {
            return bad("data.train_batch_size", "must be at least 1".into());
        }
        if self.val_batch_size == Some(0) {
            return bad("data.val_batch_size", "must be at least 1 (or null)".into());
        }
        if self.prompt_key.is_empty() {
            return bad("data.prompt_key", "must not be empty".into());
        }
        for (key, n) in [
            ("data.train_max_samples", self.train_max_samples),
            ("data.val_max_samples", self.val_max_samples),
        ] {
            if n < -1 || n == 0 {
                return bad(
                    key,
                    format!("must be -1 (all rows) or a positive count, got {n}"),
                );
            }
        }
        Ok(())
    }

    /// `train_max_samples` as an optional cap.
    pub fn train_cap(&self) -> Option<usize> {
        usize::try_from(self.train_max_samples).ok()
    }

    /// `val_max_samples` as an optional cap.
    pub fn val_cap(&self) -> Option<usize> {
        usize::try_from(self.val_max_samples).ok()
    }

    /// The shuffle seed actually used.
    pub fn effective_seed(&self) -> u64 {
        self.seed.unwrap_or(1)
    }
}

/// verl's multi-turn SFT switch (`data.multiturn`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MultiturnConfig {
    /// Read conversations from `messages_key` instead of prompt/response columns.
    pub enable: bool,
    /// Column of `{role, content}` lists.
    pub messages_key: String,
}

impl Default for MultiturnConfig {
    fn default() -> Self {
        Self {
            enable: false,
            messages_key: "messages".into(),
        }
    }
}

/// verl's SFT `data:` group (`verl/trainer/config/sft_trainer.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftDataConfig {
    /// Training parquet file(s).
    #[serde(deserialize_with = "one_or_many")]
    pub train_files: Vec<PathBuf>,
    /// Validation parquet file(s).
    #[serde(deserialize_with = "one_or_many")]
    pub val_files: Vec<PathBuf>,
    /// Prompt column (single-turn); a string or a message list.
    pub prompt_key: String,
    /// Fields to descend into inside the prompt column's value, in order (verl's
    /// `prompt_dict_keys`: `prompt_key = extra_info`, `["question"]` reads
    /// `extra_info.question`); empty = the column itself.
    #[serde(deserialize_with = "null_as_empty")]
    pub prompt_dict_keys: Vec<String>,
    /// Response column (single-turn); a string (or a number, written as text).
    pub response_key: String,
    /// Fields to descend into inside the response column's value (verl's
    /// `response_dict_keys`); empty = the column itself.
    #[serde(deserialize_with = "null_as_empty")]
    pub response_dict_keys: Vec<String>,
    /// Multi-turn mode.
    pub multiturn: MultiturnConfig,
    /// Sequence limit in tokens (prompt + response).
    pub max_length: usize,
    /// What to do with a longer sequence (`error`, `left`, `right`; `middle` is treated as right).
    pub truncation: Truncation,
    /// Sequences per optimiser step.
    pub train_batch_size: usize,
    /// Cap on training rows; -1 = all.
    pub train_max_samples: i64,
}

impl Default for SftDataConfig {
    fn default() -> Self {
        Self {
            train_files: vec![PathBuf::from("~/data/gsm8k/train.parquet")],
            val_files: vec![PathBuf::from("~/data/gsm8k/test.parquet")],
            prompt_key: "question".into(),
            prompt_dict_keys: Vec::new(),
            response_key: "answer".into(),
            response_dict_keys: Vec::new(),
            multiturn: MultiturnConfig::default(),
            max_length: 1024,
            truncation: Truncation::Error,
            train_batch_size: 256,
            train_max_samples: -1,
        }
    }
}

/// Preference data for DPO-family trainers (TRL's `prompt`/`chosen`/`rejected` columns).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PreferenceDataConfig {
    /// Training parquet file(s).
    #[serde(deserialize_with = "one_or_many")]
    pub train_files: Vec<PathBuf>,
    /// Validation parquet file(s).
    #[serde(deserialize_with = "one_or_many")]
    pub val_files: Vec<PathBuf>,
    /// Prompt column: a string or a message list.
    pub prompt_key: String,
    /// Preferred response column: a string.
    pub chosen_key: String,
    /// Dispreferred response column: a string.
    pub rejected_key: String,
    /// Prompt limit in tokens (left-truncated beyond it when truncation is not `error`).
    pub max_prompt_length: usize,
    /// Prompt + response limit in tokens.
    pub max_length: usize,
    /// What to do with over-long prompts/sequences.
    pub truncation: Truncation,
    /// Pairs per optimiser step.
    pub train_batch_size: usize,
    /// Cap on training rows; -1 = all.
    pub train_max_samples: i64,
}

impl Default for PreferenceDataConfig {
    fn default() -> Self {
        Self {
            train_files: vec![],
            val_files: vec![],
            prompt_key: "prompt".into(),
            chosen_key: "chosen".into(),
            rejected_key: "rejected".into(),
            max_prompt_length: 512,
            max_length: 1024,
            truncation: Truncation::Error,
            train_batch_size: 64,
            train_max_samples: -1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verl_names_parse_and_unknown_keys_fail() {
        let cfg: DataConfig = toml::from_str(
            "train_files = 'a.parquet'\nval_files = ['b.parquet', 'c.parquet']\n\
             truncation = 'middle'\nmax_prompt_length = 64\nseed = 7",
        )
        .unwrap();
        assert_eq!(cfg.train_files, vec![PathBuf::from("a.parquet")]);
        assert_eq!(cfg.val_files.len(), 2);
        assert_eq!(cfg.truncation, Truncation::Middle);
        assert_eq!(cfg.prompt_key, "prompt");
        cfg.validate().unwrap();
        let err = toml::from_str::<DataConfig>("max_promt_length = 3")
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_promt_length"), "{err}");
    }

    #[test]
    fn validate_names_the_key() {
        let cfg = DataConfig {
            train_batch_size: 0,
            ..DataConfig::default()
        };
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("data.train_batch_size")
        );
        let cfg = DataConfig {
            train_max_samples: 0,
            ..DataConfig::default()
        };
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("data.train_max_samples")
        );
    }

    #[test]
    fn truncation_matches_verl_postprocess_data() {
        let ids: Vec<u32> = (0..10).collect();
        assert_eq!(Truncation::Left.apply(&ids, 4).unwrap(), vec![6, 7, 8, 9]);
        assert_eq!(Truncation::Right.apply(&ids, 4).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(
            Truncation::Middle.apply(&ids, 5).unwrap(),
            vec![0, 1, 7, 8, 9]
        );
        assert_eq!(Truncation::Error.apply(&ids, 4), None);
        assert_eq!(Truncation::Error.apply(&ids, 10).unwrap(), ids);
    }
}
