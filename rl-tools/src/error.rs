//! The crate's error type.

use std::net::SocketAddr;
use std::path::PathBuf;

/// What went wrong building, opening or serving an index, or building a tool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or folder could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A corpus line is not `{"id": "...", "contents": "..."}`.
    #[error("{}:{line}: {message}", path.display())]
    CorpusLine {
        /// The corpus file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// tantivy failed on the index in `path`.
    #[error("index {}: {message}", path.display())]
    Index {
        /// The index folder.
        path: PathBuf,
        /// tantivy's message.
        message: String,
    },
    /// A config value is out of range.
    #[error("{key}: {message}")]
    Config {
        /// The key at fault (`search.url`).
        key: String,
        /// Why.
        message: String,
    },
    /// The server could not start on `addr`.
    #[error("serving on {addr}: {message}")]
    Serve {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        message: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
