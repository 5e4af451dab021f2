//! SFT (prompt + response, or multi-turn messages) and preference (prompt, chosen, rejected)
//! datasets, tokenised with the chat template and right-padded like verl's SFT datasets.
//!
//! `loss_mask` marks the tokens the model is trained to predict: every token of an assistant
//! turn's content and its end-of-turn marker, never the template's `<|im_start|>assistant\n`
//! header, system or user turns, or padding. A trainer applies it to labels `input_ids[:, 1:]`
//! as `loss_mask[:, 1:]`, which is what verl's SFT trainer does. (verl's single-turn
//! `SFTDataset` shifts its mask by one token and drops the final eos; we use the multi-turn
//! dataset's convention for both.)

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, RecordBatch};
use serde::Deserialize;
use serde_json::Value;
use tch::Tensor;

use crate::config::{PreferenceDataConfig, SftDataConfig, Truncation};
use crate::error::{Error, Result};
use crate::parquet_io::{json_at, messages_at, read_columns, string_at};
use crate::tokenizer::{Message, Tokenizer};

/// The columns of one parquet file held in memory (projected) with their file.
#[derive(Debug)]
struct Table {
    path: Arc<Path>,
    batches: Vec<RecordBatch>,
    /// (batch, row in batch) for every row of every file, in order.
    rows: Vec<(u32, u32)>,
}

/// Reads `columns` of each file (at most `cap` rows in total).
fn read_tables(files: &[PathBuf], columns: &[&str], cap: Option<usize>) -> Result<Vec<Table>> {
    let cap = cap.unwrap_or(usize::MAX);
    let mut total = 0;
    let mut out = Vec::new();
    for path in files {
        let (_, reader) = read_columns(path, columns)?;
        let mut t = Table {
            path: Arc::from(path.as_path()),
            batches: Vec::new(),
            rows: Vec::new(),
        };
        let mut rows_in_file = 0;
        for b in reader {
            let b = b?;
            rows_in_file += b.num_rows();
            let take = b.num_rows().min(cap - total);
            let bi = t.batches.len() as u32;
            t.rows.extend((0..take as u32).map(|r| (bi, r)));
            total += take;
            t.batches.push(b);
            if total >= cap {
                break;
            }
        }
        if rows_in_file == 0 {
            return Err(Error::EmptyFile { path: path.clone() });
        }
        out.push(t);
        if total >= cap {
            break;
        }
    }
    Ok(out)
}

/// Finds global row `i` across tables: (table, batch, row in batch, row in file).
fn locate(tables: &[Table], mut i: usize) -> Option<(&Table, &RecordBatch, usize, usize)> {
    for t in tables {
        if i < t.rows.len() {
            let (b, r) = t.rows[i];
            return Some((t, &t.batches[b as usize], r as usize, i));
        }
        i -= t.rows.len();
    }
    None
}

/// The value of `arr` at `row` with `keys` descended into (struct fields or map keys), and its
/// name (`column.key…`); `Err((name so far, expected, found))` where a key is missing.
fn descend(
    arr: &dyn Array,
    row: usize,
    column: &str,
    keys: &[String],
) -> std::result::Result<(String, Value), (String, String, String)> {
    let mut name = column.to_string();
    let mut value =
        json_at(arr, row).map_err(|got| (name.clone(), "a readable value".into(), got))?;
    for k in keys {
        let got = match value {
            Value::Object(mut m) => match m.remove(k) {
                Some(next) => {
                    name = format!("{name}.{k}");
                    value = next;
                    continue;
                }
                None => format!(
                    "the fields {}",
                    m.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            },
            other => other.to_string(),
        };
        return Err((name, format!("a field `{k}`"), got));
    }
    Ok((name, value))
}

/// A prompt read as JSON: a string (one user message) or a list of `{role, content}`.
fn messages_of(value: &Value) -> std::result::Result<Vec<Message>, String> {
    match value {
        Value::String(s) => Ok(vec![Message::user(s.clone())]),
        Value::Array(items) => items
            .iter()
            .map(|m| {
                Message::deserialize(m)
                    .map_err(|e| format!("{m} (not a {{role, content}} message: {e})"))
            })
            .collect(),
        other => Err(other.to_string()),
    }
}

fn bad_value(t: &Table, row: usize, column: &str, expected: &str, got: String) -> Error {
    Error::ColumnType {
        path: t.path.to_path_buf(),
        row,
        column: column.into(),
        expected: expected.into(),
        got,
    }
}

/// One tokenised SFT example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    /// Token ids (truncated to `max_length`).
    pub input_ids: Vec<u32>,
    /// 1 where the token is a trained assistant token.
    pub loss_mask: Vec<u8>,
}

/// Renders a conversation and marks assistant content: each message's text is the difference
/// between renders of growing prefixes, so any prefix-preserving template works.
pub fn tokenize_conversation(tok: &Tokenizer, messages: &[Message]) -> Result<SftExample> {
    let tmpl = tok.chat_template().ok_or(Error::NoChatTemplate)?;
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    let mut prev = String::new();
    let push = |text: &str, trained: bool, ids: &mut Vec<u32>, mask: &mut Vec<u8>| -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let t = tok.encode(text, false)?;
        mask.extend(std::iter::repeat_n(u8::from(trained), t.len()));
        ids.extend(t);
        Ok(())
    };
    let not_prefix = || {
        Error::ChatTemplate(
            "the chat template is not prefix-preserving (rendering more messages changed earlier \
             text), so assistant tokens cannot be located"
                .into(),
        )
    };
    for i in 0..messages.len() {
        let upto = &messages[..=i];
        let full = tmpl.render(upto, false)?;
        if messages[i].role == "assistant" {
            let header_end = tmpl.render(&messages[..i], true)?;
            let header = header_end
                .strip_prefix(prev.as_str())
                .ok_or_else(not_prefix)?;
            let body = full
                .strip_prefix(header_end.as_str())
                .ok_or_else(not_prefix)?;
            push(header, false, &mut ids, &mut mask)?;
            push(body, true, &mut ids, &mut mask)?;
        } else {
            let delta = full.strip_prefix(prev.as_str()).ok_or_else(not_prefix)?;
            push(delta, false, &mut ids, &mut mask)?;
        }
        prev = full;
    }
    Ok(SftExample {
        input_ids: ids,
        loss_mask: mask,
    })
}

/// Single-turn SFT as verl's `SFTDataset`: the prompt rendered with the generation prompt,
/// then `response + eos_token`, tokenised separately and concatenated.
pub fn tokenize_prompt_response(
    tok: &Tokenizer,
    prompt: &[Message],
    response: &str,
) -> Result<SftExample> {
    let p = tok.apply_chat_template(prompt, true)?;
    let eos = tok.special_tokens().eos.clone().unwrap_or_default();
    let p_ids = tok.encode(&p, false)?;
    let r_ids = tok.encode(&format!("{response}{eos}"), false)?;
    let mut loss_mask = vec![0u8; p_ids.len()];
    loss_mask.extend(std::iter::repeat_n(1u8, r_ids.len()));
    let mut input_ids = p_ids;
    input_ids.extend(r_ids);
    Ok(SftExample {
        input_ids,
        loss_mask,
    })
}

/// Splits a multi-turn trace into `(text, generated)` segments: each `<tag>…</tag>` span of
/// `tags` (an observation a tool appended), together with the whitespace around it, as tools
/// emit it (`\n\n<information>…</information>\n\n`), is a segment with `generated = false`;
/// the text between them is generated. An opening tag without its closing tag runs to the end.
pub fn observation_segments<'a>(text: &'a str, tags: &[String]) -> Vec<(&'a str, bool)> {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        let next = tags
            .iter()
            .filter_map(|t| rest.find(&format!("<{t}>")).map(|i| (i, t)))
            .min_by_key(|(i, _)| *i);
        let Some((open, tag)) = next else { break };
        let close = format!("</{tag}>");
        let end = rest[open..]
            .find(&close)
            .map_or(rest.len(), |j| open + j + close.len());
        let start = rest[..open].trim_end().len();
        let end = end + (rest[end..].len() - rest[end..].trim_start().len());
        if start > 0 {
            out.push((&rest[..start], true));
        }
        out.push((&rest[start..end], false));
        rest = &rest[end..];
    }
    if !rest.is_empty() {
        out.push((rest, true));
    }
    out
}

/// [`tokenize_prompt_response`] for a multi-turn trace: the response's segments (see
/// [`observation_segments`]) are tokenised one by one, as the multi-turn rollout appends
/// observations, and `loss_mask` is 0 on the observation segments, so SFT trains only what the
/// model itself writes. With no `tags` it is [`tokenize_prompt_response`].
pub fn tokenize_prompt_trace(
    tok: &Tokenizer,
    prompt: &[Message],
    response: &str,
    tags: &[String],
) -> Result<SftExample> {
    if tags.is_empty() {
        return tokenize_prompt_response(tok, prompt, response);
    }
    let p = tok.apply_chat_template(prompt, true)?;
    let eos = tok.special_tokens().eos.clone().unwrap_or_default();
    let mut input_ids = tok.encode(&p, false)?;
    let mut loss_mask = vec![0u8; input_ids.len()];
    let mut segments = observation_segments(response, tags);
    segments.push((eos.as_str(), true));
    for (text, generated) in segments {
        if text.is_empty() {
            continue;
        }
        let ids = tok.encode(text, false)?;
        loss_mask.extend(std::iter::repeat_n(u8::from(generated), ids.len()));
        input_ids.extend(ids);
    }
    Ok(SftExample {
        input_ids,
        loss_mask,
    })
}

/// Applies SFT truncation to `max_length` (`middle` counts as `right`).
fn truncate(
    ex: SftExample,
    max_length: usize,
    truncation: Truncation,
    err: impl FnOnce(usize) -> Error,
) -> Result<SftExample> {
    let n = ex.input_ids.len();
    if n <= max_length {
        return Ok(ex);
    }
    match truncation {
        Truncation::Error => Err(err(n)),
        Truncation::Left => Ok(SftExample {
            input_ids: ex.input_ids[n - max_length..].to_vec(),
            loss_mask: ex.loss_mask[n - max_length..].to_vec(),
        }),
        Truncation::Right | Truncation::Middle => Ok(SftExample {
            input_ids: ex.input_ids[..max_length].to_vec(),
            loss_mask: ex.loss_mask[..max_length].to_vec(),
        }),
    }
}

/// A right-padded batch of sequences with a loss mask.
#[derive(Debug)]
pub struct SftBatch {
    /// `[batch, seq_len]` i64, right-padded with the pad id.
    pub input_ids: Tensor,
    /// `[batch, seq_len]` i64, 1 = real token.
    pub attention_mask: Tensor,
    /// `[batch, seq_len]` i64, `clip(cumsum(mask) - 1, 0)`.
    pub position_ids: Tensor,
    /// `[batch, seq_len]` i64, 1 = trained token.
    pub loss_mask: Tensor,
}

impl SftBatch {
    /// Moves the tensors into an [`rl_core::Batch`] under `prefix` + `input_ids`,
    /// `attention_mask`, `position_ids`, `loss_mask` (`prefix` is `""` for SFT).
    ///
    /// # Shapes
    /// - every tensor: `[batch, seq_len]` i64
    pub fn insert_into(self, batch: &mut rl_core::Batch, prefix: &str) -> Result<()> {
        use rl_core::keys;
        use rl_core::shape::{expect_2d, expect_same_shape};
        expect_2d(keys::INPUT_IDS, &self.input_ids)?;
        for (k, t) in [
            (keys::ATTENTION_MASK, &self.attention_mask),
            (keys::POSITION_IDS, &self.position_ids),
            (keys::LOSS_MASK, &self.loss_mask),
        ] {
            expect_same_shape(k, t, keys::INPUT_IDS, &self.input_ids)?;
        }
        batch.insert(format!("{prefix}{}", keys::INPUT_IDS), self.input_ids)?;
        batch.insert(
            format!("{prefix}{}", keys::ATTENTION_MASK),
            self.attention_mask,
        )?;
        batch.insert(format!("{prefix}{}", keys::POSITION_IDS), self.position_ids)?;
        batch.insert(format!("{prefix}{}", keys::LOSS_MASK), self.loss_mask)?;
        Ok(())
    }

    /// An [`rl_core::Batch`] with `input_ids`, `attention_mask`, `position_ids`, `loss_mask`.
    pub fn into_batch(self) -> Result<rl_core::Batch> {
        let mut b = rl_core::Batch::new();
        self.insert_into(&mut b, "")?;
        Ok(b)
    }
}

impl PreferenceBatch {
    /// An [`rl_core::Batch`] with `chosen_input_ids`, `chosen_attention_mask`,
    /// `chosen_position_ids`, `chosen_loss_mask` and the same four `rejected_*` keys.
    pub fn into_batch(self) -> Result<rl_core::Batch> {
        let mut b = rl_core::Batch::new();
        self.chosen.insert_into(&mut b, "chosen_")?;
        self.rejected.insert_into(&mut b, "rejected_")?;
        Ok(b)
    }
}

/// Right-pads examples to `pad_to` (or the longest).
///
/// # Shapes
/// - `examples`: `batch` sequences of at most `seq_len` tokens
/// - returns [`SftBatch`] tensors: `[batch, seq_len]` i64 each
pub fn collate_right_padded(
    examples: &[SftExample],
    pad_id: u32,
    pad_to: Option<usize>,
) -> Result<SftBatch> {
    let longest = examples
        .iter()
        .map(|e| e.input_ids.len())
        .max()
        .unwrap_or(0);
    let seq_len = pad_to.unwrap_or(longest);
    if longest > seq_len {
        return Err(Error::Config {
            key: "max_length".into(),
            message: format!("a sequence of {longest} tokens does not fit in {seq_len}"),
        });
    }
    let b = examples.len();
    let mut ids = vec![i64::from(pad_id); b * seq_len];
    let mut att = vec![0i64; b * seq_len];
    let mut pos = vec![0i64; b * seq_len];
    let mut loss = vec![0i64; b * seq_len];
    for (i, e) in examples.iter().enumerate() {
        if e.loss_mask.len() != e.input_ids.len() {
            return Err(Error::Config {
                key: "loss_mask".into(),
                message: format!(
                    "example {i}: {} ids but {} mask entries",
                    e.input_ids.len(),
                    e.loss_mask.len()
                ),
            });
        }
        for (j, (&t, &m)) in e.input_ids.iter().zip(&e.loss_mask).enumerate() {
            let k = i * seq_len + j;
            ids[k] = i64::from(t);
            att[k] = 1;
            pos[k] = j as i64;
            loss[k] = i64::from(m);
        }
        // Padding positions repeat the last real position, as clip(cumsum - 1) gives.
        let last = e.input_ids.len().saturating_sub(1) as i64;
        for j in e.input_ids.len()..seq_len {
            pos[i * seq_len + j] = last;
        }
    }
    let shape = [b as i64, seq_len as i64];
    Ok(SftBatch {
        input_ids: Tensor::from_slice(&ids).view(shape),
        attention_mask: Tensor::from_slice(&att).view(shape),
        position_ids: Tensor::from_slice(&pos).view(shape),
        loss_mask: Tensor::from_slice(&loss).view(shape),
    })
}

/// verl's SFT datasets: single-turn (`prompt_key` + `response_key`, each optionally descended
/// into by `prompt_dict_keys`/`response_dict_keys`) or multi-turn (`multiturn.messages_key`).
#[derive(Debug)]
pub struct SftDataset {
    tables: Vec<Table>,
    cfg: SftDataConfig,
    len: usize,
    /// The config group errors name (`data` as verl's SFT config; `sft` in the harness).
    group: String,
}

impl SftDataset {
    /// Reads `files` with `cfg`'s columns; a missing column or empty file names the file.
    pub fn open(files: &[PathBuf], cfg: &SftDataConfig) -> Result<Self> {
        let cols: Vec<&str> = if cfg.multiturn.enable {
            vec![cfg.multiturn.messages_key.as_str()]
        } else {
            vec![cfg.prompt_key.as_str(), cfg.response_key.as_str()]
        };
        let tables = read_tables(files, &cols, usize::try_from(cfg.train_max_samples).ok())?;
        let len = tables.iter().map(|t| t.rows.len()).sum();
        Ok(Self {
            tables,
            cfg: cfg.clone(),
            len,
            group: "data".into(),
        })
    }

    /// Names `group` as the config group of `max_length` and `truncation` in errors.
    pub fn in_group(mut self, group: &str) -> Self {
        self.group = group.into();
        self
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file and the row in it of example `i`.
    pub fn source(&self, i: usize) -> Result<(&Path, usize)> {
        let (t, _, _, row) = self.locate(i)?;
        Ok((&t.path, row))
    }

    fn locate(&self, i: usize) -> Result<(&Table, &RecordBatch, usize, usize)> {
        locate(&self.tables, i).ok_or_else(|| Error::Config {
            key: "index".into(),
            message: format!("row {i} out of range"),
        })
    }

    /// The messages of example `i` (single-turn: the prompt, a string as one user message, then
    /// an assistant response).
    pub fn messages(&self, i: usize) -> Result<Vec<Message>> {
        let (t, b, r, row) = self.locate(i)?;
        let column = |key: &str| {
            b.column_by_name(key)
                .ok_or_else(|| bad_value(t, row, key, "a column", "nothing".into()))
        };
        if self.cfg.multiturn.enable {
            let key = &self.cfg.multiturn.messages_key;
            return messages_at(column(key)?.as_ref(), r)
                .map_err(|got| bad_value(t, row, key, "list<struct<role, content>>", got));
        }
        let (pk, rk) = (&self.cfg.prompt_key, &self.cfg.response_key);
        let (pcol, rcol) = (column(pk)?, column(rk)?);
        let mut msgs = if self.cfg.prompt_dict_keys.is_empty() {
            messages_at(pcol.as_ref(), r)
                .map_err(|got| bad_value(t, row, pk, "string or messages", got))?
        } else {
            let (name, value) = descend(pcol.as_ref(), r, pk, &self.cfg.prompt_dict_keys)
                .map_err(|(name, want, got)| bad_value(t, row, &name, &want, got))?;
            messages_of(&value)
                .map_err(|got| bad_value(t, row, &name, "string or messages", got))?
        };
        let (name, value) = descend(rcol.as_ref(), r, rk, &self.cfg.response_dict_keys)
            .map_err(|(name, want, got)| bad_value(t, row, &name, &want, got))?;
        let response = match value {
            Value::String(s) => s,
            Value::Number(n) => n.to_string(),
            other => return Err(bad_value(t, row, &name, "string", other.to_string())),
        };
        msgs.push(Message::assistant(response));
        Ok(msgs)
    }

    /// Tokenises example `i` under `max_length` and `truncation`.
    pub fn example(&self, i: usize, tok: &Tokenizer) -> Result<SftExample> {
        self.example_masking(i, tok, &[])
    }

    /// [`example`](Self::example) with the `<tag>…</tag>` spans of `tags` in a single-turn
    /// response masked out of the loss ([`tokenize_prompt_trace`]); a multi-turn conversation
    /// trains its assistant turns ([`tokenize_conversation`]).
    pub fn example_masking(
        &self,
        i: usize,
        tok: &Tokenizer,
        tags: &[String],
    ) -> Result<SftExample> {
        let msgs = self.messages(i)?;
        let ex = if self.cfg.multiturn.enable {
            tokenize_conversation(tok, &msgs)?
        } else {
            let (prompt, resp) = msgs.split_at(msgs.len() - 1);
            tokenize_prompt_trace(tok, prompt, &resp[0].content, tags)?
        };
        let (path, row) = self.source(i)?;
        truncate(ex, self.cfg.max_length, self.cfg.truncation, |len| {
            Error::ExampleTooLong {
                path: path.to_path_buf(),
                row,
                group: self.group.clone(),
                len,
                max: self.cfg.max_length,
            }
        })
    }

    /// Tokenises and right-pads rows `idx` to `max_length` (verl pads SFT to `max_length`).
    pub fn batch(&self, idx: &[usize], tok: &Tokenizer) -> Result<SftBatch> {
        let ex = idx
            .iter()
            .map(|&i| self.example(i, tok))
            .collect::<Result<Vec<_>>>()?;
        collate_right_padded(&ex, tok.pad_id_or_eos()?, Some(self.cfg.max_length))
    }
}

/// One tokenised preference pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferenceExample {
    /// Prompt + chosen response, with the loss mask on the response.
    pub chosen: SftExample,
    /// Prompt + rejected response.
    pub rejected: SftExample,
}

/// A batch of preference pairs: both sides padded to one `seq_len`.
#[derive(Debug)]
pub struct PreferenceBatch {
    /// The chosen sequences.
    pub chosen: SftBatch,
    /// The rejected sequences.
    pub rejected: SftBatch,
}

/// Preference pairs for DPO-family trainers: `prompt` (string or messages), `chosen` and
/// `rejected` (strings, or message lists whose assistant turns are the response).
#[derive(Debug)]
pub struct PreferenceDataset {
    tables: Vec<Table>,
    cfg: PreferenceDataConfig,
    len: usize,
}

impl PreferenceDataset {
    /// Reads `files` with `cfg`'s columns.
    pub fn open(files: &[PathBuf], cfg: &PreferenceDataConfig) -> Result<Self> {
        let cols = [
            cfg.prompt_key.as_str(),
            cfg.chosen_key.as_str(),
            cfg.rejected_key.as_str(),
        ];
        let tables = read_tables(files, &cols, usize::try_from(cfg.train_max_samples).ok())?;
        let len = tables.iter().map(|t| t.rows.len()).sum();
        Ok(Self {
            tables,
            cfg: cfg.clone(),
            len,
        })
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// (prompt, chosen response, rejected response) of pair `i`.
    pub fn texts(&self, i: usize) -> Result<(Vec<Message>, String, String)> {
        let (t, b, r, row) = locate(&self.tables, i).ok_or_else(|| Error::Config {
            key: "index".into(),
            message: format!("row {i} out of range"),
        })?;
        let col = |k: &String| {
            b.column_by_name(k)
                .ok_or_else(|| bad_value(t, row, k, "a column", "nothing".into()))
        };
        let prompt = messages_at(col(&self.cfg.prompt_key)?.as_ref(), r)
            .map_err(|got| bad_value(t, row, &self.cfg.prompt_key, "string or messages", got))?;
        let response = |k: &String| -> Result<String> {
            let c = col(k)?;
            match string_at(c.as_ref(), r) {
                Ok(Some(s)) => Ok(s.to_string()),
                Ok(None) => Err(bad_value(t, row, k, "string", "null".into())),
                Err(_) => {
                    let msgs = messages_at(c.as_ref(), r)
                        .map_err(|got| bad_value(t, row, k, "string or messages", got))?;
                    Ok(msgs
                        .into_iter()
                        .filter(|m| m.role == "assistant")
                        .map(|m| m.content)
                        .collect::<Vec<_>>()
                        .join(""))
                }
            }
        };
        Ok((
            prompt,
            response(&self.cfg.chosen_key)?,
            response(&self.cfg.rejected_key)?,
        ))
    }

    /// Tokenises pair `i`: prompt rendered with the generation prompt (left-truncated to
    /// `max_prompt_length` unless `truncation = error`), each response + eos, the whole
    /// sequence cut to `max_length` on the right.
    pub fn example(&self, i: usize, tok: &Tokenizer) -> Result<PreferenceExample> {
        let (prompt, chosen, rejected) = self.texts(i)?;
        let (t, _, _, row) = locate(&self.tables, i).ok_or_else(|| Error::Config {
            key: "index".into(),
            message: format!("row {i} out of range"),
        })?;
        let too_long = |len: usize, max: usize| Error::PromptTooLong {
            path: t.path.to_path_buf(),
            row,
            column: self.cfg.prompt_key.clone(),
            len,
            max,
        };
        let mut p_ids = tok.encode(&tok.apply_chat_template(&prompt, true)?, false)?;
        if p_ids.len() > self.cfg.max_prompt_length {
            if self.cfg.truncation == Truncation::Error {
                return Err(too_long(p_ids.len(), self.cfg.max_prompt_length));
            }
            p_ids = p_ids[p_ids.len() - self.cfg.max_prompt_length..].to_vec();
        }
        let eos = tok.special_tokens().eos.clone().unwrap_or_default();
        let side = |resp: &str| -> Result<SftExample> {
            let r_ids = tok.encode(&format!("{resp}{eos}"), false)?;
            let mut input_ids = p_ids.clone();
            let mut loss_mask = vec![0u8; p_ids.len()];
            input_ids.extend(&r_ids);
            loss_mask.extend(std::iter::repeat_n(1u8, r_ids.len()));
            let ex = SftExample {
                input_ids,
                loss_mask,
            };
            let rule = if self.cfg.truncation == Truncation::Error {
                Truncation::Error
            } else {
                Truncation::Right
            };
            truncate(ex, self.cfg.max_length, rule, |len| {
                too_long(len, self.cfg.max_length)
            })
        };
        Ok(PreferenceExample {
            chosen: side(&chosen)?,
            rejected: side(&rejected)?,
        })
    }

    /// Tokenises pairs `idx` and pads chosen and rejected to one common length.
    pub fn batch(&self, idx: &[usize], tok: &Tokenizer) -> Result<PreferenceBatch> {
        let ex = idx
            .iter()
            .map(|&i| self.example(i, tok))
            .collect::<Result<Vec<_>>>()?;
        let longest = ex
            .iter()
            .map(|e| e.chosen.input_ids.len().max(e.rejected.input_ids.len()))
            .max()
            .unwrap_or(0);
        let pad = tok.pad_id_or_eos()?;
        let chosen: Vec<SftExample> = ex.iter().map(|e| e.chosen.clone()).collect();
        let rejected: Vec<SftExample> = ex.into_iter().map(|e| e.rejected).collect();
        Ok(PreferenceBatch {
            chosen: collate_right_padded(&chosen, pad, Some(longest))?,
            rejected: collate_right_padded(&rejected, pad, Some(longest))?,
        })
    }
}

#[cfg(test)]
mod tests;
