//! The rule-reward role: decodes `responses`, scores them by `data_source` with a
//! [`RewardRegistry`], and places each score on the row's last response token, as verl's
//! `NaiveRewardManager` does.

use std::sync::Arc;

use rl_core::roles::Reward;
use rl_core::{Batch, keys};
use serde_json::Value;
use tch::{Kind, Tensor};

use super::{RewardRegistry, ScoreRow};
use crate::tokenizer::Tokenizer;

/// Column with each row's score (f64), next to `token_level_scores`.
pub const SCORE: &str = "score";
/// Column with each row's accuracy (bool as 0/1) when the reward function reports `acc`.
pub const ACC: &str = "acc";
/// Column with each row's decoded response text.
pub const RESPONSE_TEXT: &str = "response_text";
/// Column with each row's decoded prompt text.
pub const PROMPT_TEXT: &str = "prompt_text";
/// Column, when a reward can fail per row (Python, remote): 1 for a row whose reward failed
/// and scored 0 under `reward.on_error = "zero"`, else 0; its name ends in `_score`, so the
/// trainers report its mean, the failed fraction, as `reward/failed_score/mean`.
pub const FAILED_SCORE: &str = "failed_score";
/// Prefix of the columns holding the extra keys of a Python reward's dict return (verl's
/// `reward_extra_info`): `reward_extra_info.<key>`, `null` on rows without it.
pub const EXTRA_INFO_PREFIX: &str = "reward_extra_info.";

/// Rule rewards as a role: `token_level_scores` `[batch, response_len]` f32 with the score on
/// each row's last response token, plus the columns [`SCORE`], [`ACC`], [`RESPONSE_TEXT`] and
/// [`PROMPT_TEXT`].
#[derive(Debug, Clone)]
pub struct RuleReward {
    tokenizer: Arc<Tokenizer>,
    registry: RewardRegistry,
}

impl RuleReward {
    /// Scores with `registry`, decoding with `tokenizer` (special tokens skipped).
    pub fn new(tokenizer: Arc<Tokenizer>, registry: RewardRegistry) -> Self {
        Self {
            tokenizer,
            registry,
        }
    }

    fn decode_rows(&self, ids: &Tensor, mask: &Tensor) -> rl_core::Result<Vec<String>> {
        let rows = ids.size()[0];
        let ids = Vec::<i64>::try_from(ids.flatten(0, -1))?;
        let mask = Vec::<i64>::try_from(mask.ne(0).to_kind(Kind::Int64).flatten(0, -1))?;
        let width = ids.len() / rows.max(1) as usize;
        (0..rows as usize)
            .map(|r| {
                let toks: Vec<u32> = (0..width)
                    .filter(|&j| mask[r * width + j] != 0)
                    .map(|j| ids[r * width + j] as u32)
                    .collect();
                self.tokenizer.decode(&toks, true).map_err(role_err)
            })
            .collect()
    }
}

fn role_err(e: crate::Error) -> rl_core::Error {
    rl_core::Error::Role {
        role: "reward",
        source: Box::new(e),
    }
}

impl Reward for RuleReward {
    fn score(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let responses = batch.get(keys::RESPONSES)?;
        let mask = batch.get(keys::RESPONSE_MASK)?;
        rl_core::shape::expect_same_shape(keys::RESPONSE_MASK, mask, keys::RESPONSES, responses)?;
        let texts = self.decode_rows(responses, mask)?;
        let prompts = batch.get(keys::PROMPTS)?;
        let prompt_len = prompts.size()[1];
        let prompt_mask = batch.get(keys::ATTENTION_MASK)?.narrow(1, 0, prompt_len);
        let prompt_texts = self.decode_rows(prompts, &prompt_mask)?;
        let sources = batch.column(keys::DATA_SOURCE)?;
        let truths = batch.column(keys::GROUND_TRUTH)?;
        let null = vec![Value::Null; batch.len()];
        let extras = batch.column(keys::EXTRA_INFO).unwrap_or(&null);
        let rows: Vec<ScoreRow<'_>> = (0..batch.len())
            .map(|i| ScoreRow {
                data_source: sources[i].as_str().unwrap_or_default(),
                prompt: &prompt_texts[i],
                response: &texts[i],
                ground_truth: &truths[i],
                extra_info: &extras[i],
            })
            .collect();
        let outs = self.registry.score_batch(&rows).map_err(role_err)?;
        drop(rows);
        let mut scores = Vec::with_capacity(batch.len());
        let mut accs = Vec::with_capacity(batch.len());
        let mut failed = Vec::with_capacity(batch.len());
        // a Python function's dict return: its other keys, as verl's reward_extra_info
        let mut extra_keys = std::collections::BTreeSet::new();
        for out in &outs {
            let acc = match out.extra.get("acc") {
                Some(Value::Bool(b)) => f64::from(u8::from(*b)),
                Some(v) => v.as_f64().unwrap_or(out.score),
                None => out.score,
            };
            scores.push(out.score);
            accs.push(acc);
            failed.push(f64::from(u8::from(
                out.extra.contains_key(super::python::FAILED),
            )));
            if self.registry.every_row().is_some() {
                extra_keys.extend(out.extra.keys().filter(|k| *k != "acc").cloned());
            }
        }
        let lengths =
            mask.ne(0.0)
                .to_kind(Kind::Int64)
                .sum_dim_intlist([1].as_slice(), false, Kind::Int64);
        let last = (&lengths - 1).clamp_min(0).unsqueeze(-1);
        let values = Tensor::from_slice(&scores)
            .to_kind(Kind::Float)
            .to_device(mask.device())
            .unsqueeze(-1)
            * lengths.gt(0).unsqueeze(-1).to_kind(Kind::Float);
        let token_level_scores = mask
            .zeros_like()
            .to_kind(Kind::Float)
            .scatter_add(1, &last, &values);
        let mut out = Batch::new();
        out.insert(keys::TOKEN_LEVEL_SCORES, token_level_scores)?;
        out.insert_column(SCORE, scores.into_iter().map(Value::from).collect())?;
        out.insert_column(ACC, accs.into_iter().map(Value::from).collect())?;
        out.insert_column(RESPONSE_TEXT, texts.into_iter().map(Value::from).collect())?;
        out.insert_column(
            PROMPT_TEXT,
            prompt_texts.into_iter().map(Value::from).collect(),
        )?;
        if self.registry.may_fail_rows() {
            out.insert_column(FAILED_SCORE, failed.into_iter().map(Value::from).collect())?;
        }
        for key in extra_keys {
            let column = outs
                .iter()
                .map(|o| o.extra.get(&key).cloned().unwrap_or(Value::Null))
                .collect();
            out.insert_column(format!("{EXTRA_INFO_PREFIX}{key}"), column)?;
        }
        Ok(out)
    }
}
