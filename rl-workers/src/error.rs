//! The one error type of rl-workers: every failure names the file, tensor or key at fault.

use std::path::Path;

use tch::Kind;

/// Result alias for rl-workers.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in rl-workers. Messages are lowercase and name what is at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A config.json whose `architectures` is not one this crate implements.
    #[error("{path}: unsupported `architectures` {got:?} (supported: {supported})")]
    UnsupportedArchitecture {
        /// The config file.
        path: String,
        /// The `architectures` (or `model_type`) found.
        got: Vec<String>,
        /// The supported class names, comma-separated.
        supported: String,
    },
    /// A config value outside what the model supports.
    #[error("invalid config `{key}`: {reason}")]
    Config {
        /// The config key at fault.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A weight the model needs that the checkpoint does not hold.
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor {
        /// The checkpoint file or directory searched.
        path: String,
        /// The Hugging Face weight name.
        name: String,
    },
    /// A weight whose shape differs from the one the config implies.
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        /// The checkpoint file.
        path: String,
        /// The Hugging Face weight name.
        name: String,
        /// The shape the config implies.
        expected: Vec<i64>,
        /// The shape in the file.
        got: Vec<i64>,
    },
    /// An argument tensor whose shape is not the documented one.
    #[error("`{key}` has shape {got:?}, expected {expected}")]
    Shape {
        /// The argument at fault.
        key: String,
        /// The expected shape, in the doc's notation (`[batch, seq_len]`).
        expected: String,
        /// The actual shape.
        got: Vec<i64>,
    },
    /// An argument tensor whose dtype is not the documented one.
    #[error("`{key}` has dtype {got:?}, expected {expected}")]
    Dtype {
        /// The argument at fault.
        key: String,
        /// The accepted dtype(s), in words.
        expected: String,
        /// The actual dtype.
        got: Kind,
    },
    /// An argument outside its documented range.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument {
        /// The argument's name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file whose contents cannot be parsed (JSON, safetensors header, GGUF).
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
    /// An error from rl-core (batch keys and shapes).
    #[error(transparent)]
    Core(#[from] rl_core::Error),
    /// An error raised by libtorch.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

impl Error {
    pub(crate) fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }

    pub(crate) fn format(path: impl AsRef<Path>, reason: impl Into<String>) -> Self {
        Error::Format {
            path: path.as_ref().display().to_string(),
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid(name: &str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.to_owned(),
            reason: reason.into(),
        }
    }
}

/// Checks that `t` has `dims.len()` dimensions matching `dims` (`None` = any size, named in
/// `doc`); returns its size.
pub(crate) fn expect_dims(
    key: &str,
    t: &tch::Tensor,
    dims: &[Option<i64>],
    doc: &str,
) -> Result<Vec<i64>> {
    let got = t.size();
    let ok =
        got.len() == dims.len() && got.iter().zip(dims).all(|(g, d)| d.is_none_or(|d| d == *g));
    if ok {
        Ok(got)
    } else {
        Err(Error::Shape {
            key: key.to_owned(),
            expected: doc.to_owned(),
            got,
        })
    }
}

/// Checks that `t` has one of the `allowed` dtypes.
pub(crate) fn expect_kind(key: &str, t: &tch::Tensor, allowed: &[Kind]) -> Result<()> {
    let got = t.kind();
    if allowed.contains(&got) {
        Ok(())
    } else {
        let expected: Vec<String> = allowed.iter().map(|k| format!("{k:?}")).collect();
        Err(Error::Dtype {
            key: key.to_owned(),
            expected: expected.join(" or "),
            got,
        })
    }
}
