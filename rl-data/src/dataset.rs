//! verl's `RLHFDataset`: prompts from parquet files, rendered with the chat template and tokenised.
//!
//! The files are read once into Arrow record batches holding only the columns used (the prompt
//! column, `data_source`, `ability`, `reward_model`, `extra_info`), so memory is about the
//! uncompressed size of those columns; rows become Rust values only when a batch asks for them.
//! For a single pass without holding the file, use [`stream_rows`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Schema};
use serde_json::Value;

use crate::config::{DataConfig, Truncation};
use crate::error::{Error, Result};
use crate::parquet_io::{
    column_list, is_json_readable, is_message_list, is_string, json_at, messages_at, read_columns,
    string_at, type_name,
};
use crate::tokenizer::{Message, TemplateValue, Tokenizer};

/// Where a row came from: its file and its 0-based row within that file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowSource {
    /// The parquet file.
    pub path: Arc<Path>,
    /// Row index within the file.
    pub row: usize,
}

/// One dataset row in verl's RL schema.
#[derive(Debug, Clone, PartialEq)]
pub struct RlRow {
    /// Where it came from.
    pub source: RowSource,
    /// `data_source` (or whatever `reward_fn_key` names).
    pub data_source: String,
    /// The prompt messages (a plain-string prompt becomes one user message).
    pub prompt: Vec<Message>,
    /// `ability`, when the column exists.
    pub ability: Option<String>,
    /// `reward_model.style`, when present.
    pub reward_style: Option<String>,
    /// `reward_model.ground_truth` as JSON (`Null` when the column is absent).
    pub ground_truth: Value,
    /// `extra_info` as JSON (`Null` when absent).
    pub extra_info: Value,
}

/// Which column of the projected batch holds what.
#[derive(Debug, Clone)]
struct Columns {
    prompt: usize,
    data_source: usize,
    ability: Option<usize>,
    reward_model: Option<usize>,
    extra_info: Option<usize>,
}

#[derive(Debug)]
struct FileData {
    path: Arc<Path>,
    batches: Vec<RecordBatch>,
    /// First file row of each batch.
    starts: Vec<usize>,
    cols: Columns,
}

/// What to read from the files: the prompt and reward-key column names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOptions {
    /// Prompt column (`data.prompt_key`).
    pub prompt_key: String,
    /// Reward dispatch column (`data.reward_fn_key`).
    pub reward_fn_key: String,
    /// Keep only the first N rows over all files.
    pub max_samples: Option<usize>,
}

impl ReadOptions {
    /// Training-set options from `cfg`.
    pub fn train(cfg: &DataConfig) -> Self {
        Self {
            prompt_key: cfg.prompt_key.clone(),
            reward_fn_key: cfg.reward_fn_key.clone(),
            max_samples: cfg.train_cap(),
        }
    }
    /// Validation-set options from `cfg`.
    pub fn val(cfg: &DataConfig) -> Self {
        Self {
            max_samples: cfg.val_cap(),
            ..Self::train(cfg)
        }
    }
}

/// Checks the projected schema of one file and says where each column lives.
fn check_schema(
    path: &Path,
    schema: &Schema,
    opts: &ReadOptions,
    wanted: &[&str],
) -> Result<Columns> {
    let idx = |name: &str| wanted.iter().position(|w| *w == name);
    let ty = |name: &str| {
        schema
            .field_with_name(name)
            .map(|f| f.data_type().clone())
            .ok()
    };
    let col_type_err = |column: &str, expected: &str, got: &DataType| Error::ColumnType {
        path: path.to_path_buf(),
        row: 0,
        column: column.to_string(),
        expected: expected.to_string(),
        got: type_name(got),
    };
    let pk = &opts.prompt_key;
    if let Some(dt) = ty(pk)
        && !is_string(&dt)
        && !is_message_list(&dt)
    {
        return Err(col_type_err(
            pk,
            "list<struct<role, content>> or string",
            &dt,
        ));
    }
    if let Some(dt) = ty(&opts.reward_fn_key)
        && !is_string(&dt)
    {
        return Err(col_type_err(&opts.reward_fn_key, "string", &dt));
    }
    if let Some(dt) = ty("ability")
        && !is_string(&dt)
        && dt != DataType::Null
    {
        return Err(col_type_err("ability", "string", &dt));
    }
    if let Some(dt) = ty("reward_model") {
        match &dt {
            DataType::Struct(fields) => {
                let gt = fields
                    .iter()
                    .find(|f| f.name() == "ground_truth")
                    .ok_or_else(|| Error::MissingColumn {
                        path: path.to_path_buf(),
                        column: "reward_model.ground_truth".into(),
                        present: format!(
                            "reward_model.{{{}}}",
                            fields
                                .iter()
                                .map(|f| f.name().as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    })?;
                if !is_json_readable(gt.data_type()) {
                    return Err(col_type_err(
                        "reward_model.ground_truth",
                        "string, number, list or struct",
                        gt.data_type(),
                    ));
                }
            }
            other => {
                return Err(col_type_err(
                    "reward_model",
                    "struct<style, ground_truth>",
                    other,
                ));
            }
        }
    }
    if let Some(dt) = ty("extra_info")
        && !is_json_readable(&dt)
    {
        return Err(col_type_err(
            "extra_info",
            "struct of strings/numbers/lists",
            &dt,
        ));
    }
    Ok(Columns {
        prompt: idx(pk).unwrap_or_default(),
        data_source: idx(&opts.reward_fn_key).unwrap_or_default(),
        ability: idx("ability").filter(|_| ty("ability").is_some()),
        reward_model: idx("reward_model").filter(|_| ty("reward_model").is_some()),
        extra_info: idx("extra_info").filter(|_| ty("extra_info").is_some()),
    })
}

/// Opens one file: checks required columns, projects the ones we use, checks their types.
fn open_file(path: &Path, opts: &ReadOptions) -> Result<(Columns, BatchReader)> {
    let builder = crate::parquet_io::open_builder(path)?;
    let full = builder.schema().clone();
    drop(builder);
    for required in [opts.prompt_key.as_str(), opts.reward_fn_key.as_str()] {
        if full.index_of(required).is_err() {
            return Err(Error::MissingColumn {
                path: path.to_path_buf(),
                column: required.to_string(),
                present: column_list(&full),
            });
        }
    }
    let mut wanted: Vec<&str> = vec![opts.prompt_key.as_str()];
    if opts.reward_fn_key != opts.prompt_key {
        wanted.push(opts.reward_fn_key.as_str());
    }
    for optional in ["ability", "reward_model", "extra_info"] {
        if full.index_of(optional).is_ok() && !wanted.contains(&optional) {
            wanted.push(optional);
        }
    }
    // The projected batches keep the file's column order; index by name in that order.
    let mut in_file_order = wanted.clone();
    in_file_order.sort_by_key(|c| full.index_of(c).unwrap_or(usize::MAX));
    let (schema, reader) = read_columns(path, &in_file_order)?;
    let cols = check_schema(path, &schema, opts, &in_file_order)?;
    Ok((cols, Box::new(reader)))
}

/// Checks the null-free columns of one batch, naming the first bad row.
fn check_batch(
    path: &Path,
    batch: &RecordBatch,
    cols: &Columns,
    start: usize,
    opts: &ReadOptions,
) -> Result<()> {
    for (idx, name) in [
        (cols.prompt, &opts.prompt_key),
        (cols.data_source, &opts.reward_fn_key),
    ] {
        let arr = batch.column(idx);
        if arr.null_count() > 0 {
            let row = (0..arr.len()).find(|&i| arr.is_null(i)).unwrap_or(0);
            return Err(Error::ColumnType {
                path: path.to_path_buf(),
                row: start + row,
                column: name.clone(),
                expected: "a value".into(),
                got: "null".into(),
            });
        }
    }
    Ok(())
}

fn row_from(
    path: &Arc<Path>,
    cols: &Columns,
    batch: &RecordBatch,
    r: usize,
    row_in_file: usize,
    opts: &ReadOptions,
) -> Result<RlRow> {
    let bad = |column: &str, expected: &str, got: String| Error::ColumnType {
        path: path.to_path_buf(),
        row: row_in_file,
        column: column.to_string(),
        expected: expected.to_string(),
        got,
    };
    let prompt = messages_at(batch.column(cols.prompt).as_ref(), r).map_err(|got| {
        bad(
            &opts.prompt_key,
            "list<struct<role, content>> or string",
            got,
        )
    })?;
    let data_source = string_at(batch.column(cols.data_source).as_ref(), r)
        .map_err(|got| bad(&opts.reward_fn_key, "string", got))?
        .ok_or_else(|| bad(&opts.reward_fn_key, "string", "null".into()))?
        .to_string();
    let ability = match cols.ability {
        Some(i) => string_at(batch.column(i).as_ref(), r)
            .map_err(|got| bad("ability", "string", got))?
            .map(str::to_string),
        None => None,
    };
    let (reward_style, ground_truth) = match cols.reward_model {
        Some(i) => {
            let rm = batch.column(i);
            if rm.is_null(r) {
                (None, Value::Null)
            } else {
                let st = rm.as_struct();
                let style = match st.column_by_name("style") {
                    Some(c) => string_at(c.as_ref(), r)
                        .map_err(|got| bad("reward_model.style", "string", got))?
                        .map(str::to_string),
                    None => None,
                };
                let gt_col: &ArrayRef = st
                    .column_by_name("ground_truth")
                    .ok_or_else(|| bad("reward_model.ground_truth", "a field", "nothing".into()))?;
                let gt = json_at(gt_col.as_ref(), r)
                    .map_err(|got| bad("reward_model.ground_truth", "a JSON-like value", got))?;
                (style, gt)
            }
        }
        None => (None, Value::Null),
    };
    let extra_info = match cols.extra_info {
        Some(i) => json_at(batch.column(i).as_ref(), r)
            .map_err(|got| bad("extra_info", "a JSON-like value", got))?,
        None => Value::Null,
    };
    Ok(RlRow {
        source: RowSource {
            path: path.clone(),
            row: row_in_file,
        },
        data_source,
        prompt,
        ability,
        reward_style,
        ground_truth,
        extra_info,
    })
}

/// Reads every row of `files` one at a time without keeping the files in memory (one Arrow
/// batch of at most 8192 rows at a time). Errors are yielded in place; iteration stops after
/// the first one.
pub fn stream_rows(files: &[PathBuf], opts: &ReadOptions) -> RowStream {
    RowStream {
        files: files.iter().cloned().collect(),
        opts: opts.clone(),
        current: None,
        remaining: opts.max_samples.unwrap_or(usize::MAX),
        failed: false,
    }
}

use crate::parquet_io::BatchIter as BatchReader;

struct OpenFile {
    path: Arc<Path>,
    cols: Columns,
    reader: BatchReader,
    /// File row of the next batch.
    next_start: usize,
    /// The batch being read, its first file row, and the next row in it.
    batch: Option<(RecordBatch, usize, usize)>,
}

/// The iterator returned by [`stream_rows`].
pub struct RowStream {
    files: std::collections::VecDeque<PathBuf>,
    opts: ReadOptions,
    current: Option<OpenFile>,
    remaining: usize,
    failed: bool,
}

impl std::fmt::Debug for RowStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowStream")
            .field("remaining", &self.remaining)
            .finish()
    }
}

impl RowStream {
    fn step(&mut self) -> Result<Option<RlRow>> {
        loop {
            if self.remaining == 0 {
                return Ok(None);
            }
            let Some(cur) = self.current.as_mut() else {
                let Some(path) = self.files.pop_front() else {
                    return Ok(None);
                };
                let (cols, reader) = open_file(&path, &self.opts)?;
                self.current = Some(OpenFile {
                    path: Arc::from(path.as_path()),
                    cols,
                    reader,
                    next_start: 0,
                    batch: None,
                });
                continue;
            };
            if let Some((batch, start, next)) = cur.batch.as_mut()
                && *next < batch.num_rows()
            {
                let r = *next;
                *next += 1;
                self.remaining -= 1;
                let row = row_from(&cur.path, &cur.cols, batch, r, *start + r, &self.opts)?;
                return Ok(Some(row));
            }
            match cur.reader.next() {
                Some(b) => {
                    let b = b?;
                    check_batch(&cur.path, &b, &cur.cols, cur.next_start, &self.opts)?;
                    let start = cur.next_start;
                    cur.next_start += b.num_rows();
                    cur.batch = Some((b, start, 0));
                }
                None => {
                    if cur.next_start == 0 {
                        return Err(Error::EmptyFile {
                            path: cur.path.to_path_buf(),
                        });
                    }
                    self.current = None;
                }
            }
        }
    }
}

impl Iterator for RowStream {
    type Item = Result<RlRow>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.step() {
            Ok(row) => row.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

/// The RL prompt dataset: rows of one or more verl-schema parquet files, concatenated.
#[derive(Debug)]
pub struct RlDataset {
    files: Vec<FileData>,
    /// Kept rows as (file, batch, row in batch); filtering removes entries.
    index: Vec<(u32, u32, u32)>,
    opts: ReadOptions,
}

impl RlDataset {
    /// Reads `files` (at least one) with `opts`. Every file is checked: a missing file, an empty
    /// or corrupt one, a missing column, a column of the wrong type, or a null prompt is an
    /// error naming the file, row and column.
    pub fn open(files: &[PathBuf], opts: &ReadOptions) -> Result<Self> {
        if files.is_empty() {
            return Err(Error::Config {
                key: "data.train_files".into(),
                message: "no files given".into(),
            });
        }
        let cap = opts.max_samples.unwrap_or(usize::MAX);
        let mut out = Self {
            files: Vec::new(),
            index: Vec::new(),
            opts: opts.clone(),
        };
        for (fi, path) in files.iter().enumerate() {
            let (cols, reader) = open_file(path, opts)?;
            let mut fd = FileData {
                path: Arc::from(path.as_path()),
                batches: Vec::new(),
                starts: Vec::new(),
                cols,
            };
            let mut start = 0;
            for b in reader {
                if out.index.len() >= cap {
                    break;
                }
                let b = b?;
                check_batch(path, &b, &fd.cols, start, opts)?;
                let take = b.num_rows().min(cap - out.index.len());
                let bi = fd.batches.len() as u32;
                out.index
                    .extend((0..take as u32).map(|r| (fi as u32, bi, r)));
                fd.starts.push(start);
                start += b.num_rows();
                fd.batches.push(if take < b.num_rows() {
                    b.slice(0, take)
                } else {
                    b
                });
            }
            if start == 0 && out.index.len() < cap {
                return Err(Error::EmptyFile { path: path.clone() });
            }
            out.files.push(fd);
        }
        Ok(out)
    }

    /// Opens `cfg.train_files` with the training options.
    pub fn train(cfg: &DataConfig) -> Result<Self> {
        Self::open(&cfg.train_files, &ReadOptions::train(cfg))
    }

    /// Opens `cfg.val_files` with the validation options.
    pub fn val(cfg: &DataConfig) -> Result<Self> {
        if cfg.val_files.is_empty() {
            return Err(Error::Config {
                key: "data.val_files".into(),
                message: "no files given".into(),
            });
        }
        Self::open(&cfg.val_files, &ReadOptions::val(cfg))
    }

    /// Number of rows (after the cap and any filtering).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no rows are left.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The `i`-th row.
    pub fn row(&self, i: usize) -> Result<RlRow> {
        let &(f, b, r) = self.index.get(i).ok_or_else(|| Error::Config {
            key: "index".into(),
            message: format!("row {i} out of range for a dataset of {} rows", self.len()),
        })?;
        let file = &self.files[f as usize];
        let batch = &file.batches[b as usize];
        let row_in_file = file.starts[b as usize] + r as usize;
        row_from(
            &file.path,
            &file.cols,
            batch,
            r as usize,
            row_in_file,
            &self.opts,
        )
    }

    /// The prompt column name.
    pub fn prompt_key(&self) -> &str {
        &self.opts.prompt_key
    }

    /// Drops rows whose rendered prompt is longer than `max_prompt_length` tokens (verl's
    /// `filter_overlong_prompts`). Returns how many were dropped.
    pub fn filter_overlong_prompts(&mut self, encoder: &PromptEncoder<'_>) -> Result<usize> {
        let before = self.index.len();
        let mut keep = Vec::with_capacity(before);
        const CHUNK: usize = 1024;
        for start in (0..before).step_by(CHUNK) {
            let end = (start + CHUNK).min(before);
            let rows = (start..end)
                .map(|i| self.row(i))
                .collect::<Result<Vec<_>>>()?;
            let lens = encoder.token_lens(&rows)?;
            for (i, len) in (start..end).zip(lens) {
                if len <= encoder.max_prompt_length {
                    keep.push(self.index[i]);
                }
            }
        }
        self.index = keep;
        Ok(before - self.index.len())
    }
}

/// Renders rows with the chat template and tokenises them under verl's truncation rule.
#[derive(Debug, Clone, Copy)]
pub struct PromptEncoder<'a> {
    /// The tokenizer (and its chat template).
    pub tokenizer: &'a Tokenizer,
    /// Prompt limit in tokens.
    pub max_prompt_length: usize,
    /// What to do beyond the limit.
    pub truncation: Truncation,
    /// Extra chat-template variables.
    pub template_kwargs: &'a std::collections::BTreeMap<String, TemplateValue>,
}

/// One rendered, tokenised (and possibly truncated) prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedPrompt {
    /// Token ids, at most `max_prompt_length` of them.
    pub ids: Vec<u32>,
    /// The rendered prompt string.
    pub text: String,
}

impl PromptEncoder<'_> {
    fn render(&self, row: &RlRow) -> Result<String> {
        let tmpl = self
            .tokenizer
            .chat_template()
            .ok_or(crate::Error::NoChatTemplate)?;
        tmpl.render_with(&row.prompt, true, self.template_kwargs)
            .map_err(|e| match e {
                Error::ChatTemplate(m) => Error::ChatTemplate(format!(
                    "{}: row {}: {m}",
                    row.source.path.display(),
                    row.source.row
                )),
                other => other,
            })
    }

    /// Token counts of the rendered prompts (no truncation).
    pub fn token_lens(&self, rows: &[RlRow]) -> Result<Vec<usize>> {
        let texts = rows
            .iter()
            .map(|r| self.render(r))
            .collect::<Result<Vec<_>>>()?;
        Ok(self
            .tokenizer
            .encode_batch(&texts, false)?
            .iter()
            .map(Vec::len)
            .collect())
    }

    /// Renders (`add_generation_prompt = true`), tokenises without adding special tokens (the
    /// template has them), and applies the truncation rule; `truncation = error` on an over-long
    /// prompt names the file, row and prompt column.
    pub fn encode(&self, rows: &[RlRow], prompt_key: &str) -> Result<Vec<EncodedPrompt>> {
        let texts = rows
            .iter()
            .map(|r| self.render(r))
            .collect::<Result<Vec<_>>>()?;
        let ids = self.tokenizer.encode_batch(&texts, false)?;
        rows.iter()
            .zip(texts)
            .zip(ids)
            .map(|((row, text), ids)| {
                let ids = self
                    .truncation
                    .apply(&ids, self.max_prompt_length)
                    .ok_or_else(|| Error::PromptTooLong {
                        path: row.source.path.to_path_buf(),
                        row: row.source.row,
                        column: prompt_key.to_string(),
                        len: ids.len(),
                        max: self.max_prompt_length,
                    })?;
                Ok(EncodedPrompt { ids, text })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
