//! Multi-turn rollouts with tools (Search-R1 style): each row generates until it closes a
//! tool's tag (`</search>`), the answer tag (`</answer>`), emits EOS or runs out of its response
//! budget; the calls of all rows of a turn go to each tool in one [`Tool::call`]; each
//! observation is tokenised, cut to `max_obs_length` tokens, prefilled into the KV cache, and
//! generation resumes. The history is never re-encoded.
//!
//! # The cache across turns
//! Turns are synchronous over the batch. Within a turn every row still generating decodes
//! one token per step; a row that has stopped for its tool call (or for good) stays in the
//! compute batch with masked columns (attention mask 0: no one attends to them), so rows of
//! different lengths leave holes in the middle of the cache. Positions count real tokens only,
//! so a row's positions continue across the holes. The observations of a turn are prefilled
//! in one forward, right-aligned in a block as wide as the longest (shorter ones leave masked
//! holes on the left), so the last column holds every row's next-token logits. Before the next
//! turn [`KvCache::gather_columns`] squeezes the holes and the finished rows out (keys are
//! stored after RoPE, so moving a column changes nothing), which bounds the cache by the
//! longest row plus one turn.
//!
//! # Reproducibility
//! Row `r` draws one uniform per generated token from the same ChaCha8 stream as
//! [`generate`](crate::generate) (seed, stream `row_offset + r`) and picks with the same code,
//! so a multi-turn rollout in which no row calls a tool samples exactly what `generate` does,
//! and a row's tokens never depend on when the other rows stop.
//!
//! # Output
//! [`MultiTurnOutput`]: verl's rollout keys with every row compacted (no holes): `responses`
//! holds generated and observation tokens in order, right-padded; `response_mask` is 1 on both
//! (so lengths, the reward's last token and decoding stay those of the whole response);
//! `loss_mask` (`[rows, prompt_len + response_len]`, verl's `response_mask` of multi-turn
//! rollouts) is 1 on generated tokens only; `rollout_log_probs` is 0 on observation tokens.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use rl_core::{Observation, Tool};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::gemm::PackedWeights;
use crate::heads::CausalLm;
use crate::model::KvCache;
use crate::rollout::{
    GenerateOptions, Progress, RolloutConfig, RolloutOutput, assemble, check_prompts, pick,
    row_rngs, step_uniforms,
};

/// The tag that ends a row for good: `<answer>…</answer>`.
pub const ANSWER_TAG: &str = "answer";

/// Text to token ids and back, for the rollout's stop tags and observations (the harness
/// hands over the run's tokenizer).
pub trait TextCodec: Send + Sync + fmt::Debug {
    /// The ids of `text`, without special tokens added (no BOS).
    fn encode(&self, text: &str) -> std::result::Result<Vec<i64>, String>;
    /// The text of `ids`, special tokens kept.
    fn decode(&self, ids: &[i64]) -> std::result::Result<String, String>;
}

impl TextCodec for tokenizers::Tokenizer {
    fn encode(&self, text: &str) -> std::result::Result<Vec<i64>, String> {
        // `**self` is the tokenizers crate's own `TokenizerImpl`, whose inherent methods these are
        let enc = (**self).encode(text, false).map_err(|e| e.to_string())?;
        Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    fn decode(&self, ids: &[i64]) -> std::result::Result<String, String> {
        (**self)
            .decode(&token_ids_u32(ids)?, false)
            .map_err(|e| e.to_string())
    }
}

/// Tensor token ids as a tokenizer's `u32` ids, naming the first that is not one (for
/// [`TextCodec::decode`] implementations).
pub fn token_ids_u32(ids: &[i64]) -> std::result::Result<Vec<u32>, String> {
    ids.iter()
        .map(|&i| u32::try_from(i).map_err(|_| format!("token id {i} is not a u32")))
        .collect()
}

/// The multi-turn keys of `actor_rollout_ref.rollout.multi_turn` that the rollout reads
/// (Search-R1's names and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MultiTurnConfig {
    /// Tool calls allowed per response, >= 1. A row that closes one more call tag stops there,
    /// without the call.
    pub max_turns: usize,
    /// Tokens kept of each observation (the rest is cut), >= 1.
    pub max_obs_length: i64,
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        MultiTurnConfig {
            max_turns: 4,
            max_obs_length: 512,
        }
    }
}

impl MultiTurnConfig {
    /// Checks the ranges documented on each field.
    pub fn validate(&self) -> Result<()> {
        if self.max_turns == 0 {
            return Err(Error::invalid(
                "multi_turn.max_turns",
                "must be at least 1 (disable multi_turn for no tool calls)",
            ));
        }
        if self.max_obs_length < 1 {
            return Err(Error::invalid(
                "multi_turn.max_obs_length",
                format!("must be at least 1, got {}", self.max_obs_length),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Tool(usize),
    Answer,
}

/// The tools of a multi-turn rollout, the codec that reads their tags, and the limits.
#[derive(Debug)]
pub struct ToolEnv {
    tools: Vec<Box<dyn Tool>>,
    codec: Arc<dyn TextCodec>,
    cfg: MultiTurnConfig,
    /// The closing tags that stop a turn, with what they mean.
    stops: Vec<(String, Tag)>,
    /// Tokens decoded from the end of a turn to look for a closing tag.
    window: usize,
}

fn valid_tag_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl ToolEnv {
    /// Tools called by their tag names; errors name a tool whose name is empty, not a plain tag
    /// name (letters, digits, `_`, `-`), taken twice or `answer`.
    pub fn new(
        tools: Vec<Box<dyn Tool>>,
        codec: Arc<dyn TextCodec>,
        cfg: MultiTurnConfig,
    ) -> Result<ToolEnv> {
        cfg.validate()?;
        let mut stops = Vec::new();
        for (i, tool) in tools.iter().enumerate() {
            let name = tool.name();
            if !valid_tag_name(name) {
                return Err(Error::invalid(
                    "multi_turn.tools",
                    format!("tool {i} is named {name:?}, not a tag name (letters, digits, _ or -)"),
                ));
            }
            if name == ANSWER_TAG {
                return Err(Error::invalid(
                    "multi_turn.tools",
                    format!("tool {i} is named `{ANSWER_TAG}`, the tag that ends a response"),
                ));
            }
            if tools[..i].iter().any(|t| t.name() == name) {
                return Err(Error::invalid(
                    "multi_turn.tools",
                    format!("two tools are named `{name}`"),
                ));
            }
            stops.push((format!("</{name}>"), Tag::Tool(i)));
        }
        stops.push((format!("</{ANSWER_TAG}>"), Tag::Answer));
        let window = stops
            .iter()
            .map(|(s, _)| s.chars().count())
            .max()
            .unwrap_or(0)
            + 1;
        Ok(ToolEnv {
            tools,
            codec,
            cfg,
            stops,
            window,
        })
    }

    /// The tools' names, in order.
    pub fn tool_names(&self) -> Vec<&str> {
        self.tools.iter().map(|t| t.name()).collect()
    }

    /// The limits.
    pub fn config(&self) -> &MultiTurnConfig {
        &self.cfg
    }

    fn decode(&self, ids: &[i64]) -> Result<String> {
        self.codec
            .decode(ids)
            .map_err(|e| Error::invalid("tokenizer", format!("cannot decode {ids:?}: {e}")))
    }

    fn encode(&self, text: &str) -> Result<Vec<i64>> {
        self.codec
            .encode(text)
            .map_err(|e| Error::invalid("tokenizer", format!("cannot encode {text:?}: {e}")))
    }

    /// The closing tag the turn `segment` ends with, if any: the first one found in the text of
    /// its last `window` tokens (the turn is checked after every token, so a tag is found by
    /// the token that completes it).
    fn stop_tag(&self, segment: &[i64]) -> Result<Option<Tag>> {
        let tail = &segment[segment.len().saturating_sub(self.window)..];
        let text = self.decode(tail)?;
        Ok(self
            .stops
            .iter()
            .filter_map(|(s, tag)| text.find(s.as_str()).map(|p| (p + s.len(), *tag)))
            .min_by_key(|(end, _)| *end)
            .map(|(_, tag)| tag))
    }
}

/// Why a row's response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StopReason {
    /// It closed `</answer>`.
    Answer,
    /// It emitted an EOS token.
    Eos,
    /// The response budget (`response_length`) ran out.
    #[default]
    Length,
    /// It closed one more call tag than `max_turns` allows.
    MaxTurns,
}

/// What one row did, for the `env/*` metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnStats {
    /// Model turns (stretches of generated tokens).
    pub turns: usize,
    /// Calls per tool name (closed call tags that got an observation).
    pub calls: BTreeMap<String, usize>,
    /// Failed calls per tool name (unparsable call, tool error): observations with `valid`
    /// false.
    pub failed_calls: BTreeMap<String, usize>,
    /// Turns that ended in a valid action: a call whose observation is valid, or an answer.
    pub valid_actions: usize,
    /// Tokens the model generated.
    pub generated_tokens: usize,
    /// Observation tokens appended.
    pub observation_tokens: usize,
    /// Why the response ended.
    pub stop: StopReason,
}

impl TurnStats {
    /// Calls over all tools.
    pub fn total_calls(&self) -> usize {
        self.calls.values().sum()
    }
}

/// A multi-turn generation: verl's rollout keys, the loss mask and per-row statistics.
#[derive(Debug)]
pub struct MultiTurnOutput {
    /// The rollout keys; `response_mask` is 1 on generated and observation tokens.
    pub rollout: RolloutOutput,
    /// `[rows, prompt_len + response_len]` i64: 1 on generated response tokens, 0 on the
    /// prompt, observations and padding.
    pub loss_mask: Tensor,
    /// One entry per row.
    pub stats: Vec<TurnStats>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Decoding,
    Calling(usize),
    Done,
}

#[derive(Debug)]
struct Row {
    tokens: Vec<i64>,
    log_probs: Vec<f32>,
    generated: Vec<bool>,
    /// Index in `tokens` of the current turn's first token.
    segment: usize,
    /// Trailing tokens not yet in the cache.
    pending: usize,
    /// Position of the next token.
    pos: i64,
    state: State,
    /// Next-token logits of a row whose last token is already in the cache while it waits.
    saved: Option<Tensor>,
    stats: TurnStats,
}

impl Row {
    fn push(&mut self, token: i64, log_prob: f32, generated: bool) {
        self.tokens.push(token);
        self.log_probs.push(log_prob);
        self.generated.push(generated);
        self.pending += 1;
        if generated {
            self.stats.generated_tokens += 1;
        } else {
            self.stats.observation_tokens += 1;
        }
    }

    fn finish(&mut self, why: StopReason) {
        self.state = State::Done;
        self.stats.stop = why;
    }
}

/// Generates up to `cfg.response_length` response tokens (generated and observation) for each
/// of `cfg.n` copies of every prompt, calling `env`'s tools between turns; see the module doc.
/// Runs without gradients.
///
/// # Shapes
/// - `input_ids`: `[prompts, prompt_len]` i64, left-padded
/// - `attention_mask`: `[prompts, prompt_len]` i64, 1 = real token; the last column must be 1
/// - `position_ids`: `[prompts, prompt_len]` i64
/// - returns a [`MultiTurnOutput`] of `prompts * n` rows
pub fn generate_multi_turn(
    lm: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    position_ids: &Tensor,
    cfg: &RolloutConfig,
    env: &ToolEnv,
    opts: &mut GenerateOptions<'_>,
) -> Result<MultiTurnOutput> {
    check_prompts(input_ids, attention_mask, position_ids, cfg)?;
    if lm.model().param_shards().is_some() {
        // every turn's forwards would be collectives, and the ranks' turns differ
        return Err(Error::invalid(
            "actor_rollout_ref.actor.zero_stage",
            "multi-turn rollouts with tools are not built for ZeRO stage 3 yet: use 0, 1 or 2",
        ));
    }
    PackedWeights::default().scope(|| {
        Rollout::start(lm, input_ids, attention_mask, position_ids, cfg, env, opts)?.run()
    })
}

/// The state of one multi-turn generation.
struct Rollout<'a, 'o> {
    lm: &'a CausalLm,
    cfg: &'a RolloutConfig,
    env: &'a ToolEnv,
    opts: &'a mut GenerateOptions<'o>,
    rows: Vec<Row>,
    rngs: Vec<rand_chacha::ChaCha8Rng>,
    cache: KvCache,
    /// Output row at each compute-batch position.
    active: Vec<usize>,
    /// `[active, cache.len()]` i64.
    mask: Tensor,
    /// `[active, vocab]` f32: next-token logits of the rows that are decoding.
    logits: Tensor,
    prompt: (Tensor, Tensor, Tensor),
    budget: usize,
    finished: i64,
    generated: i64,
}

impl<'a, 'o> Rollout<'a, 'o> {
    fn start(
        lm: &'a CausalLm,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        cfg: &'a RolloutConfig,
        env: &'a ToolEnv,
        opts: &'a mut GenerateOptions<'o>,
    ) -> Result<Self> {
        let (prompts, prompt_len) = (input_ids.size()[0], input_ids.size()[1]);
        let n = cfg.n as i64;
        let rows = (prompts * n) as usize;
        let budget = cfg.response_length;
        // prefill once per prompt, then repeat the cache rows for the n samples; the first turn
        // holds at most the budget's decode steps and one observation block
        let capacity = prompt_len + budget + env.cfg.max_obs_length + 1;
        let crate::rollout::Prefilled {
            cache,
            logits,
            prompt,
        } = crate::rollout::prefill_repeated(
            lm,
            (input_ids, attention_mask, position_ids),
            n,
            capacity,
        )?;
        let last_pos = Vec::<i64>::try_from(
            prompt
                .2
                .narrow(1, prompt_len - 1, 1)
                .flatten(0, -1)
                .to_device(tch::Device::Cpu),
        )?;
        let rows_state = last_pos
            .iter()
            .map(|&p| Row {
                tokens: Vec::new(),
                log_probs: Vec::new(),
                generated: Vec::new(),
                segment: 0,
                pending: 0,
                pos: p + 1,
                state: State::Decoding,
                saved: None,
                stats: TurnStats::default(),
            })
            .collect();
        let rngs = row_rngs(opts, rows);
        Ok(Rollout {
            lm,
            cfg,
            env,
            rows: rows_state,
            rngs,
            cache,
            active: (0..rows).collect(),
            mask: prompt.1.shallow_clone(),
            logits,
            prompt,
            budget: budget as usize,
            finished: 0,
            generated: 0,
            opts,
        })
    }

    fn run(mut self) -> Result<MultiTurnOutput> {
        let mut first = true;
        loop {
            if !first && !self.squeeze()? {
                break;
            }
            first = false;
            self.decode_turn()?;
            if !self.call_tools()? {
                break;
            }
            self.prefill_observations()?;
        }
        Ok(self.finish())
    }

    fn device(&self) -> tch::Device {
        self.lm.device()
    }

    /// Drops the finished rows and the masked columns from the cache (rows left-padded to the
    /// longest); its capacity becomes what one more turn can use. Returns false when no row is
    /// left.
    fn squeeze(&mut self) -> Result<bool> {
        let keep: Vec<i64> = (0..self.active.len() as i64)
            .filter(|&i| self.rows[self.active[i as usize]].state != State::Done)
            .collect();
        if keep.is_empty() {
            return Ok(false);
        }
        let device = self.device();
        let keep_t = Tensor::from_slice(&keep).to_device(device);
        let mask = self.mask.index_select(0, &keep_t);
        let len = mask.size()[1];
        let width = mask
            .sum_dim_intlist([1].as_slice(), false, Kind::Int64)
            .max()
            .int64_value(&[]);
        // a stable ascending sort puts each row's holes first and its real columns after, in order
        let columns = mask
            .argsort_stable(true, 1, false)
            .narrow(1, len - width, width);
        self.active = keep.iter().map(|&i| self.active[i as usize]).collect();
        let remaining = self
            .active
            .iter()
            .map(|&r| self.budget - self.rows[r].tokens.len())
            .max()
            .unwrap_or(0) as i64;
        let capacity = width + remaining + self.env.cfg.max_obs_length + 1;
        self.cache.gather_columns(&keep_t, &columns, capacity)?;
        self.mask = mask.gather(1, &columns, false);
        self.logits = self.logits.index_select(0, &keep_t);
        Ok(true)
    }

    /// Decodes until every row of the compute batch has stopped for this turn.
    fn decode_turn(&mut self) -> Result<()> {
        let device = self.device();
        loop {
            let draws: Vec<bool> = self
                .active
                .iter()
                .map(|&r| self.rows[r].state == State::Decoding)
                .collect();
            if !draws.iter().any(|&d| d) {
                return Ok(());
            }
            let uniforms = step_uniforms(
                self.cfg,
                &mut self.rngs,
                self.active.iter().copied().zip(draws.iter().copied()),
                device,
            );
            let (tokens, log_probs) = pick(&self.logits, self.cfg, uniforms.as_ref());
            let tokens = Vec::<i64>::try_from(&tokens.to_device(tch::Device::Cpu))?;
            let log_probs = Vec::<f32>::try_from(&log_probs.to_device(tch::Device::Cpu))?;
            for (i, &r) in self.active.iter().enumerate() {
                if !draws[i] {
                    continue;
                }
                self.generated += 1;
                let row = &mut self.rows[r];
                row.push(tokens[i], log_probs[i], true);
                let stop = if self.opts.eos_token_ids.contains(&tokens[i]) {
                    Some(State::Done)
                } else {
                    match self.env.stop_tag(&row.tokens[row.segment..])? {
                        Some(Tag::Answer) => {
                            row.stats.valid_actions += 1;
                            row.finish(StopReason::Answer);
                            Some(State::Done)
                        }
                        Some(Tag::Tool(t)) if row.stats.total_calls() < self.env.cfg.max_turns => {
                            row.state = State::Calling(t);
                            Some(row.state)
                        }
                        Some(Tag::Tool(_)) => {
                            row.finish(StopReason::MaxTurns);
                            Some(State::Done)
                        }
                        None if row.tokens.len() >= self.budget => {
                            row.finish(StopReason::Length);
                            Some(State::Done)
                        }
                        None => None,
                    }
                };
                if stop == Some(State::Done) && row.state != State::Done {
                    row.finish(StopReason::Eos);
                }
                if let Some(s) = stop {
                    row.stats.turns += 1;
                    if s == State::Done {
                        self.finished += 1;
                    }
                }
            }
            self.report();
            let still = self
                .active
                .iter()
                .any(|&r| self.rows[r].state == State::Decoding);
            if !still {
                // the tokens of this last step stay pending: the observation prefill feeds them
                return Ok(());
            }
            self.drop_finished_rows()?;
            self.feed_step()?;
        }
    }

    fn report(&mut self) {
        if let Some(hook) = self.opts.progress.as_mut() {
            let step = self.rows.iter().map(|r| r.tokens.len()).max().unwrap_or(0);
            hook(&Progress {
                step: step as i64,
                max_steps: self.budget as i64,
                total_rows: self.rows.len() as i64,
                finished_rows: self.finished,
                generated_tokens: self.generated,
            });
        }
    }

    /// Drops rows that are done from the compute batch once they are an eighth of it (rows
    /// waiting for a tool stay: the cache holds their history).
    fn drop_finished_rows(&mut self) -> Result<()> {
        let done = self
            .active
            .iter()
            .filter(|&&r| self.rows[r].state == State::Done)
            .count();
        if done == 0 || done * 8 < self.active.len() {
            return Ok(());
        }
        let keep: Vec<i64> = (0..self.active.len() as i64)
            .filter(|&i| self.rows[self.active[i as usize]].state != State::Done)
            .collect();
        let keep_t = Tensor::from_slice(&keep).to_device(self.device());
        self.cache.select_rows(&keep_t)?;
        self.mask = self.mask.index_select(0, &keep_t);
        self.logits = self.logits.index_select(0, &keep_t);
        self.active = keep.iter().map(|&i| self.active[i as usize]).collect();
        Ok(())
    }

    /// Feeds each row's pending token (the one it just generated) as one new cache column;
    /// rows without one get a masked column.
    fn feed_step(&mut self) -> Result<()> {
        let device = self.device();
        let a = self.active.len();
        let mut ids = vec![self.opts.pad_token_id; a];
        let mut col = vec![0i64; a];
        let mut pos = vec![0i64; a];
        for (i, &r) in self.active.iter().enumerate() {
            let row = &mut self.rows[r];
            pos[i] = row.pos;
            if row.pending > 0 && row.state != State::Done {
                debug_assert_eq!(row.pending, 1);
                ids[i] = *row.tokens.last().unwrap_or(&self.opts.pad_token_id);
                col[i] = 1;
                row.pos += 1;
                row.pending = 0;
            }
        }
        let col_t = Tensor::from_slice(&col)
            .view([a as i64, 1])
            .to_device(device);
        self.mask = Tensor::cat(&[&self.mask, &col_t], 1);
        let hidden = self.lm.model().forward(
            &Tensor::from_slice(&ids)
                .view([a as i64, 1])
                .to_device(device),
            &self.mask,
            &Tensor::from_slice(&pos)
                .view([a as i64, 1])
                .to_device(device),
            Some(&mut self.cache),
        )?;
        self.logits = self.lm.logits(&hidden.squeeze_dim(1)).to_kind(Kind::Float);
        for (i, &r) in self.active.iter().enumerate() {
            let row = &mut self.rows[r];
            if col[i] == 1 && matches!(row.state, State::Calling(_)) {
                row.saved = Some(self.logits.get(i as i64));
            }
        }
        Ok(())
    }

    /// Sends the calls of this turn, grouped per tool, and appends the observations. Returns
    /// whether any row goes on.
    fn call_tools(&mut self) -> Result<bool> {
        let env = self.env;
        // per tool: (row, arguments or None when the call cannot be parsed)
        let mut calls: Vec<Vec<(usize, Option<String>)>> = vec![Vec::new(); env.tools.len()];
        for &r in &self.active {
            let row = &mut self.rows[r];
            let State::Calling(t) = row.state else {
                continue;
            };
            if row.tokens.len() >= self.budget {
                // no room left for an observation
                row.finish(StopReason::Length);
                self.finished += 1;
                continue;
            }
            let name = env.tools[t].name();
            let text = env.decode(&row.tokens[row.segment..])?;
            let (open, close) = (format!("<{name}>"), format!("</{name}>"));
            let args = text.find(&close).and_then(|end| {
                text[..end]
                    .rfind(&open)
                    .map(|start| text[start + open.len()..end].to_owned())
            });
            calls[t].push((r, args));
        }
        for (t, tool_calls) in calls.into_iter().enumerate() {
            if tool_calls.is_empty() {
                continue;
            }
            let tool = &env.tools[t];
            let name = tool.name();
            let args: Vec<String> = tool_calls.iter().filter_map(|(_, a)| a.clone()).collect();
            let mut answers = if args.is_empty() {
                Vec::new()
            } else {
                tool.call(&args)
            };
            if answers.len() != args.len() {
                return Err(Error::invalid(
                    "multi_turn.tools",
                    format!(
                        "tool `{name}` answered {} observations for {} calls",
                        answers.len(),
                        args.len()
                    ),
                ));
            }
            answers.reverse();
            for (r, a) in tool_calls {
                let obs = match a {
                    Some(_) => answers.pop().unwrap_or_else(|| Observation::failed("")),
                    None => Observation::failed(format!(
                        "\n<error>a call is written <{name}>arguments</{name}></error>\n"
                    )),
                };
                let ids = env.encode(&obs.text)?;
                let row = &mut self.rows[r];
                *row.stats.calls.entry(name.to_owned()).or_default() += 1;
                if obs.valid {
                    row.stats.valid_actions += 1;
                } else {
                    *row.stats.failed_calls.entry(name.to_owned()).or_default() += 1;
                }
                let room = (self.budget - row.tokens.len()).min(env.cfg.max_obs_length as usize);
                for &id in ids.iter().take(room) {
                    row.push(id, 0.0, false);
                }
                if row.tokens.len() >= self.budget {
                    row.finish(StopReason::Length);
                    self.finished += 1;
                } else {
                    row.state = State::Decoding;
                    row.segment = row.tokens.len();
                }
            }
        }
        self.report();
        Ok(self
            .active
            .iter()
            .any(|&r| self.rows[r].state == State::Decoding))
    }

    /// Prefills the pending tokens (a turn's last generated token and the observation) of every
    /// row that goes on, right-aligned in one block, and takes each row's next-token logits.
    fn prefill_observations(&mut self) -> Result<()> {
        let device = self.device();
        let a = self.active.len();
        let going = |row: &Row| row.state == State::Decoding;
        let width = self
            .active
            .iter()
            .map(|&r| &self.rows[r])
            .filter(|row| going(row))
            .map(|row| row.pending)
            .max()
            .unwrap_or(0);
        let last = if width > 0 {
            let w = width as i64;
            let mut ids = vec![self.opts.pad_token_id; a * width];
            let mut block = vec![0i64; a * width];
            let mut pos = vec![0i64; a * width];
            for (i, &r) in self.active.iter().enumerate() {
                let row = &mut self.rows[r];
                let k = if going(row) { row.pending } else { 0 };
                let tail = &row.tokens[row.tokens.len() - k..];
                for j in 0..width {
                    pos[i * width + j] = row.pos;
                }
                for (j, &id) in tail.iter().enumerate() {
                    let c = i * width + width - k + j;
                    ids[c] = id;
                    block[c] = 1;
                    pos[c] = row.pos + j as i64;
                }
                row.pos += k as i64;
            }
            let shape = [a as i64, w];
            let block = Tensor::from_slice(&block).view(shape).to_device(device);
            self.mask = Tensor::cat(&[&self.mask, &block], 1);
            let hidden = self.lm.model().forward(
                &Tensor::from_slice(&ids).view(shape).to_device(device),
                &self.mask,
                &Tensor::from_slice(&pos).view(shape).to_device(device),
                Some(&mut self.cache),
            )?;
            Some(
                self.lm
                    .logits(&hidden.narrow(1, w - 1, 1).squeeze_dim(1))
                    .to_kind(Kind::Float),
            )
        } else {
            None
        };
        let mut per_row = Vec::with_capacity(a);
        for (i, &r) in self.active.iter().enumerate() {
            let row = &mut self.rows[r];
            let saved = row.saved.take();
            let logits = match (&last, going(row) && row.pending > 0) {
                (Some(l), true) => l.get(i as i64),
                _ => saved.unwrap_or_else(|| self.logits.get(i as i64)),
            };
            if going(row) {
                row.pending = 0;
            }
            per_row.push(logits);
        }
        self.logits = Tensor::stack(&per_row, 0);
        Ok(())
    }

    fn finish(self) -> MultiTurnOutput {
        let tokens: Vec<Vec<i64>> = self.rows.iter().map(|r| r.tokens.clone()).collect();
        let log_probs: Vec<Vec<f32>> = self.rows.iter().map(|r| r.log_probs.clone()).collect();
        let (ids, mask, pos) = &self.prompt;
        let rollout = assemble(
            &tokens,
            &log_probs,
            ids,
            mask,
            pos,
            self.budget as i64,
            self.opts.pad_token_id,
        );
        let prompt_len = ids.size()[1] as usize;
        let width = prompt_len + self.budget;
        let mut loss = vec![0i64; self.rows.len() * width];
        for (r, row) in self.rows.iter().enumerate() {
            for (t, &g) in row.generated.iter().enumerate() {
                loss[r * width + prompt_len + t] = i64::from(g);
            }
        }
        let loss_mask = Tensor::from_slice(&loss)
            .view([self.rows.len() as i64, width as i64])
            .to_device(ids.device());
        MultiTurnOutput {
            rollout,
            loss_mask,
            stats: self.rows.into_iter().map(|r| r.stats).collect(),
        }
    }
}

#[cfg(test)]
mod tests;
