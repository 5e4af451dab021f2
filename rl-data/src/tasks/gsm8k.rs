//! GSM8K's official JSONL (`question`, `answer` ending in `#### N`) into verl's parquet, as
//! verl's `examples/data_preprocess/gsm8k.py` writes it.

use std::io::BufRead;
use std::path::Path;
use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use super::GeneratedFiles;
use crate::error::{Error, Result};
use crate::parquet_io::{RlRecord, write_rl_parquet};
use crate::tokenizer::Message;

/// verl's instruction, appended to every question after a space.
pub const GSM8K_INSTRUCTION: &str =
    "Let's think step by step and output the final answer after \"####\".";

static HASHES: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"#### (\-?[0-9\.\,]+)").expect("static regex"));

/// verl's preprocessing `extract_solution`: the first `#### N`, commas removed.
pub fn gsm8k_extract_answer(answer: &str) -> Option<String> {
    HASHES.captures(answer).map(|c| c[1].replace(',', ""))
}

/// Converts one GSM8K JSONL file into verl-schema parquet at `out`; `split` goes into
/// `extra_info.split`. Returns the row count. A malformed line is an error naming the file and
/// line.
pub fn preprocess_gsm8k(jsonl: &Path, split: &str, out: &Path) -> Result<usize> {
    let file = std::fs::File::open(jsonl).map_err(|source| Error::Io {
        path: jsonl.to_path_buf(),
        source,
    })?;
    let mut records = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| Error::Io {
            path: jsonl.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| Error::Jsonl {
            path: jsonl.to_path_buf(),
            line: i + 1,
            message,
        };
        let v: Value = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
        let field = |k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("missing string field `{k}`")))
        };
        let question = field("question")?;
        let answer = field("answer")?;
        let solution = gsm8k_extract_answer(answer)
            .ok_or_else(|| bad("`answer` has no `#### N` final answer".into()))?;
        let index = records.len();
        let mut extra = serde_json::Map::new();
        extra.insert("split".into(), split.into());
        extra.insert("index".into(), index.into());
        extra.insert("answer".into(), answer.into());
        extra.insert("question".into(), question.into());
        records.push(RlRecord {
            data_source: "openai/gsm8k".into(),
            prompt: vec![Message::user(format!("{question} {GSM8K_INSTRUCTION}"))],
            ability: "math".into(),
            style: "rule".into(),
            ground_truth: Value::String(solution),
            extra_info: extra,
        });
    }
    if records.is_empty() {
        return Err(Error::EmptyFile {
            path: jsonl.to_path_buf(),
        });
    }
    write_rl_parquet(out, &records)?;
    Ok(records.len())
}

/// Converts `train.jsonl` and `test.jsonl` of GSM8K's `main` config in `src` into
/// `dst/train.parquet` and `dst/test.parquet`.
pub fn preprocess_gsm8k_dir(src: &Path, dst: &Path) -> Result<GeneratedFiles> {
    let files = GeneratedFiles {
        train: dst.join("train.parquet"),
        test: dst.join("test.parquet"),
    };
    preprocess_gsm8k(&src.join("train.jsonl"), "train", &files.train)?;
    preprocess_gsm8k(&src.join("test.jsonl"), "test", &files.test)?;
    Ok(files)
}
