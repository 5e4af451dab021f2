//! The crate's one error type: every variant names the file, row, column or key at fault.

use std::path::PathBuf;

/// Everything that can go wrong while loading, rendering, tokenising, collating or scoring data.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be opened, read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file at fault.
        path: PathBuf,
        /// The underlying IO error.
        source: std::io::Error,
    },
    /// A parquet file is unreadable (corrupt footer, bad page, not parquet at all).
    #[error("{}: not a readable parquet file: {message}", path.display())]
    Parquet {
        /// The file at fault.
        path: PathBuf,
        /// What the parquet reader said.
        message: String,
    },
    /// A parquet file has no rows.
    #[error("{}: the file has no rows", path.display())]
    EmptyFile {
        /// The file at fault.
        path: PathBuf,
    },
    /// A column the config asks for is not in the file.
    #[error("{}: missing column `{column}` (columns present: {present})", path.display())]
    MissingColumn {
        /// The file at fault.
        path: PathBuf,
        /// The column that was asked for.
        column: String,
        /// The columns the file does have, comma separated.
        present: String,
    },
    /// A column (or a value in one row of it) has a type we cannot use.
    #[error("{}: row {row}, column `{column}`: expected {expected}, got {got}", path.display())]
    ColumnType {
        /// The file at fault.
        path: PathBuf,
        /// Row index within the file (0-based); the first row when the whole column is wrong.
        row: usize,
        /// The column at fault (`reward_model.ground_truth` for a nested field).
        column: String,
        /// What we can read.
        expected: String,
        /// What the file holds.
        got: String,
    },
    /// A rendered and tokenised prompt is longer than `max_prompt_length` with `truncation = error`.
    #[error(
        "{}: row {row}, column `{column}`: prompt is {len} tokens, longer than max_prompt_length = {max} \
         (set data.truncation to left, right or middle, or data.filter_overlong_prompts = true)",
        path.display()
    )]
    PromptTooLong {
        /// The file the row came from.
        path: PathBuf,
        /// Row index within the file (0-based).
        row: usize,
        /// The prompt column.
        column: String,
        /// Tokens after rendering.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// A tokenised SFT example (prompt and response) is longer than its limit with
    /// `truncation = error`.
    #[error(
        "{}: row {row}: the example is {len} tokens (prompt and response), longer than \
         {group}.max_length = {max} (set {group}.truncation to left or right to cut it)",
        path.display()
    )]
    ExampleTooLong {
        /// The file the row came from.
        path: PathBuf,
        /// Row index within the file (0-based).
        row: usize,
        /// The config group whose `max_length` and `truncation` apply (`data`, `sft`).
        group: String,
        /// Tokens after rendering.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// Something in tokenizer.json / tokenizer_config.json is missing or malformed.
    #[error("{}: {message}", path.display())]
    Tokenizer {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Encoding or decoding failed inside the tokenizer.
    #[error("tokenizer: {0}")]
    Encode(String),
    /// The chat template failed to parse or render (including `raise_exception` in the template).
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The tokenizer has no chat template and one was needed.
    #[error("the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")]
    NoChatTemplate,
    /// A config value is out of range or inconsistent.
    #[error("config `{key}`: {message}")]
    Config {
        /// The config key at fault (`data.train_batch_size`).
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// A saved loader state does not fit the dataset it is restored into.
    #[error("loader state: {0}")]
    LoaderState(String),
    /// No reward function is registered for a `data_source`.
    #[error("no reward function for data_source `{data_source}` (registered: {registered})")]
    UnknownDataSource {
        /// The data source asked for.
        data_source: String,
        /// The names that are registered, comma separated.
        registered: String,
    },
    /// A reward function got a ground truth it cannot read.
    #[error("reward `{reward}`: bad ground truth {ground_truth}: {message}")]
    GroundTruth {
        /// The reward function.
        reward: String,
        /// The value at fault, as JSON.
        ground_truth: String,
        /// What is wrong.
        message: String,
    },
    /// A line of an input JSONL file is malformed.
    #[error("{}: line {line}: {message}", path.display())]
    Jsonl {
        /// The file at fault.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A Python reward (a `custom_reward_function` file, or a scorer run through the Python
    /// bridge) could not start, raised, returned something that is not a score, or timed out.
    #[error("{what}: {message}")]
    PythonReward {
        /// The function and its file (`compute_score in /path/reward.py`).
        what: String,
        /// What went wrong: the row and data source, the traceback or the value returned.
        message: String,
    },
    /// The remote scorer of `reward.remote_url` failed or answered something unreadable.
    #[error("reward.remote_url {url}: {message}")]
    RemoteReward {
        /// The scorer's URL.
        url: String,
        /// What went wrong, with the server's own text for an HTTP error.
        message: String,
    },
    /// A tensor operation failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
    /// The shared Batch type refused an insert.
    #[error(transparent)]
    Core(#[from] rl_core::Error),
}

/// The crate's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
