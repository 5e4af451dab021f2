//! The crate's one error type.

/// Everything that can go wrong setting up or running a collective.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A torchrun variable is not set.
    #[error(
        "environment variable {var} is not set (torchrun-style launchers set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)"
    )]
    MissingEnv {
        /// The variable's name.
        var: &'static str,
    },
    /// A torchrun variable is set but does not parse or is out of range.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    InvalidEnv {
        /// The variable's name.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The options passed to `ProcessGroup::init` (or a collective) are inconsistent.
    #[error("rank {rank}: {op}: invalid argument: {reason}")]
    InvalidArgument {
        /// This process's rank.
        rank: usize,
        /// The operation, e.g. `init` or `all_reduce`.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// c10d reported a failure: rendezvous or a collective timed out, a peer went away, ...
    /// The group is not usable afterwards; drop it.
    #[error("rank {rank} of {world_size}: {op} failed: {cause}")]
    Collective {
        /// The rank that observed the failure.
        rank: usize,
        /// The group's size.
        world_size: usize,
        /// The operation, e.g. `init`, `all_reduce`, `barrier`.
        op: &'static str,
        /// c10d's message (without its C++ backtrace).
        cause: String,
    },
    /// A tensor operation around a collective (flattening, averaging) failed.
    #[error("rank {rank}: {op}: {source}")]
    Tensor {
        /// This process's rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// tch's error.
        source: tch::TchError,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
