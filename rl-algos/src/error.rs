//! The one error type of rl-algos: bad shapes, dtypes, masks, arguments and config names.

/// Result alias for rl-algos.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in rl-algos. Messages are lowercase and name the argument at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A shape, dtype or batch check from rl-core failed (the message names the argument).
    #[error(transparent)]
    Core(#[from] rl_core::Error),
    /// A mask that holds values other than 0 and 1.
    #[error("`{name}` must be binary (0 or 1 everywhere), found {value}")]
    NonBinaryMask {
        /// The mask argument at fault.
        name: &'static str,
        /// One offending value.
        value: f64,
    },
    /// A mask with too few ones for the statistic asked for (verl raises here too).
    #[error("`{name}` selects {count} element(s); {reason}")]
    EmptyMask {
        /// The mask argument at fault.
        name: &'static str,
        /// How many elements the mask selects.
        count: i64,
        /// What needed more elements.
        reason: &'static str,
    },
    /// An argument outside its documented range.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument {
        /// The argument's name.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A config string that names no known choice.
    #[error("unknown {what} `{got}`; expected one of: {valid}")]
    UnknownName {
        /// The config key or kind of choice (`loss_agg_mode`, `adv_estimator`, ...).
        what: &'static str,
        /// The string given.
        got: String,
        /// The accepted strings, comma-separated.
        valid: String,
    },
    /// An error raised by libtorch.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

impl Error {
    pub(crate) fn invalid(name: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name,
            reason: reason.into(),
        }
    }
}
