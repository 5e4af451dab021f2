//! The one error type of rl-core: every batch and shape failure names the key and the sizes.

use tch::Kind;

/// Result alias for rl-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in rl-core. Messages are lowercase and name the key at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A key was asked for that the batch does not hold.
    #[error("missing key `{key}` (present: {present})")]
    MissingKey {
        /// The key asked for.
        key: String,
        /// The keys the batch holds, comma-separated, to spot typos.
        present: String,
    },
    /// A tensor or column whose leading (batch) dimension disagrees with the batch's.
    #[error("`{key}` has {got} rows but the batch has {expected}")]
    BatchSize {
        /// The key at fault.
        key: String,
        /// The batch's row count.
        expected: usize,
        /// The row count of the offending value.
        got: usize,
    },
    /// A tensor whose shape is not the documented one.
    #[error("`{key}` has shape {got:?}, expected {expected}")]
    Shape {
        /// The key or argument at fault.
        key: String,
        /// The expected shape, in the doc's notation (`[batch, response_len]`).
        expected: String,
        /// The actual shape.
        got: Vec<i64>,
    },
    /// A tensor whose dtype is not the documented one.
    #[error("`{key}` has dtype {got:?}, expected {expected}")]
    Dtype {
        /// The key or argument at fault.
        key: String,
        /// The accepted dtype(s), in words.
        expected: String,
        /// The actual dtype.
        got: Kind,
    },
    /// A key that would name both a tensor and a column.
    #[error("`{key}` already exists as a {existing}")]
    DuplicateKey {
        /// The key at fault.
        key: String,
        /// What the key already names ("tensor" or "column").
        existing: &'static str,
    },
    /// An error raised by a role implementation in another crate (a worker or an objective).
    #[error("{role}: {source}")]
    Role {
        /// The role or component that failed (`actor`, `rollout`, `policy loss`, ...).
        role: &'static str,
        /// The underlying error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// `union` found the same key on both sides with different contents.
    #[error("union conflict on `{key}`: both batches hold it with different values")]
    Conflict {
        /// The key at fault.
        key: String,
    },
    /// `concat` parts that do not hold the same keys.
    #[error("concat part {part} {problem} `{key}`")]
    KeyMismatch {
        /// Index of the part that differs from part 0.
        part: usize,
        /// The key that is missing or extra.
        key: String,
        /// "lacks" or "has the extra key".
        problem: &'static str,
    },
    /// `chunk` asked for a number of chunks that does not divide the batch.
    #[error("cannot chunk {len} rows into {chunks} equal chunks")]
    UnevenChunk {
        /// The batch's row count.
        len: usize,
        /// The number of chunks asked for.
        chunks: usize,
    },
    /// A mini-batch size that does not divide the batch.
    #[error("mini-batch size {size} does not divide the batch of {len} rows")]
    UnevenMiniBatch {
        /// The batch's row count.
        len: usize,
        /// The mini-batch size asked for.
        size: usize,
    },
    /// A row index outside `0..len`.
    #[error("index {index} is out of range for a batch of {len} rows")]
    IndexOutOfRange {
        /// The offending index.
        index: i64,
        /// The batch's row count.
        len: usize,
    },
    /// An argument outside its documented range.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument {
        /// The argument's name.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A saved batch that cannot be read back.
    #[error("{path}: {reason}")]
    Format {
        /// The file at fault.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file at fault.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An error raised by libtorch.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

impl Error {
    pub(crate) fn missing<'a>(key: &str, present: impl IntoIterator<Item = &'a String>) -> Self {
        let present: Vec<&str> = present.into_iter().map(String::as_str).collect();
        Error::MissingKey {
            key: key.to_owned(),
            present: if present.is_empty() {
                "none".to_owned()
            } else {
                present.join(", ")
            },
        }
    }
}
