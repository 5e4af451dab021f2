//! The rule-reward role: decodes `responses`, scores them by `data_source` with a
//! [`RewardRegistry`], and places each score on the row's last response token, as verl's
//! `NaiveRewardManager` does.

use std::sync::Arc;

use rl_core::roles::Reward;
use rl_core::{Batch, keys};
use serde_json::Value;
use tch::{Kind, Tensor};

use super::RewardRegistry;
use crate::tokenizer::Tokenizer;

/// Column with each row's score (f64), next to `token_level_scores`.
pub const SCORE: &str = "score";
/// Column with each row's accuracy (bool as 0/1) when the reward function reports `acc`.
pub const ACC: &str = "acc";
/// Column with each row's decoded response text.
pub const RESPONSE_TEXT: &str = "response_text";
/// Column with each row's decoded prompt text.
pub const PROMPT_TEXT: &str = "prompt_text";

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
        let mut scores = Vec::with_capacity(batch.len());
        let mut accs = Vec::with_capacity(batch.len());
        for i in 0..batch.len() {
            let source = sources[i].as_str().unwrap_or_default();
            let out = self
                .registry
                .score(source, &texts[i], &truths[i], &extras[i])
                .map_err(role_err)?;
            let acc = match out.extra.get("acc") {
                Some(Value::Bool(b)) => f64::from(u8::from(*b)),
                Some(v) => v.as_f64().unwrap_or(out.score),
                None => out.score,
            };
            scores.push(out.score);
            accs.push(acc);
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
        Ok(out)
    }
}
