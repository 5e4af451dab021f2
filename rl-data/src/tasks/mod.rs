//! Task data: the GSM8K and Search-R1 QA preprocessors and seeded synthetic generators writing
//! verl-schema parquet.
//!
//! Every generator takes a seed and writes `train.parquet` and `test.parquet` into a directory;
//! the same seed and options give byte-identical files. Test prompts never repeat a train prompt.

mod arithmetic;
mod countdown;
mod gsm8k;
mod search;
pub mod tiny_vocab;
mod word_problems;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

pub use arithmetic::{ArithmeticConfig, generate_arithmetic};
pub use countdown::{CountdownConfig, countdown_prompt, generate_countdown};
pub use gsm8k::{GSM8K_INSTRUCTION, gsm8k_extract_answer, preprocess_gsm8k, preprocess_gsm8k_dir};
pub use search::{
    SEARCH_TASK_ATTRIBUTES, SEARCH_TASK_DATA_SOURCE, SEARCH_TASK_INSTRUCTION, SearchQuestion,
    SearchTask, SearchTaskConfig, SearchTaskFiles, preprocess_search_r1_qa, search_r1_prompt,
};
pub use word_problems::{
    WORD_PROBLEM_KINDS, WORD_PROBLEM_PHRASINGS, WordProblemsConfig, generate_word_problems,
};

use crate::error::{Error, Result};
use crate::parquet_io::{RlRecord, write_rl_parquet};

/// How many rows to generate per split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitSizes {
    /// Rows in `train.parquet`.
    pub train: usize,
    /// Rows in `test.parquet`.
    pub test: usize,
}

/// The files a generator or preprocessor wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedFiles {
    /// `<dir>/train.parquet`.
    pub train: PathBuf,
    /// `<dir>/test.parquet`.
    pub test: PathBuf,
}

/// The generators' random source: ChaCha8 from the seed, with helpers for bounded integers.
pub(crate) struct TaskRng(ChaCha8Rng);

impl TaskRng {
    pub(crate) fn new(seed: u64) -> Self {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        Self(ChaCha8Rng::from_seed(key))
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: i64, hi: i64) -> i64 {
        let span = (hi - lo + 1) as u128;
        lo + ((u128::from(self.0.next_u64()) * span) >> 64) as i64
    }

    /// Uniform index below `n`.
    pub(crate) fn index(&mut self, n: usize) -> usize {
        self.range(0, n as i64 - 1) as usize
    }

    /// A uniformly chosen element.
    pub(crate) fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.index(items.len())]
    }
}

/// Draws rows with `make` until both splits are full, keeping test prompts out of train, and
/// writes them. `make(rng, split, index)` returns a record, or `None` to draw again.
pub(crate) fn generate_splits(
    dir: &Path,
    sizes: SplitSizes,
    seed: u64,
    task: &str,
    mut make: impl FnMut(&mut TaskRng, &str, usize) -> Option<RlRecord>,
) -> Result<GeneratedFiles> {
    let mut rng = TaskRng::new(seed);
    let mut seen: HashSet<String> = HashSet::new();
    let mut out = Vec::new();
    for (split, n) in [("train", sizes.train), ("test", sizes.test)] {
        let mut rows = Vec::with_capacity(n);
        let mut tries = 0usize;
        while rows.len() < n {
            tries += 1;
            if tries > 100 * n + 10_000 {
                return Err(Error::Config {
                    key: format!("{task}.{split}"),
                    message: format!(
                        "could only make {} distinct rows of {n}; widen the task's ranges",
                        rows.len()
                    ),
                });
            }
            let Some(rec) = make(&mut rng, split, rows.len()) else {
                continue;
            };
            let key = rec
                .prompt
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n");
            if seen.insert(key) {
                rows.push(rec);
            }
        }
        let path = dir.join(format!("{split}.parquet"));
        write_rl_parquet(&path, &rows)?;
        out.push(path);
    }
    let test = out.pop().unwrap_or_default();
    let train = out.pop().unwrap_or_default();
    Ok(GeneratedFiles { train, test })
}

#[cfg(test)]
mod tests;
