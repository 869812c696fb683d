//! Why ranks could not agree, and what a grouped call returns when it does not succeed.

use std::fmt;
use std::time::Duration;

/// Why ranks could not agree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// A launcher variable is missing or malformed.
    #[error("toma::dist: {var} {problem}; launch with torchrun, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (or use Config::new)")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A configuration that cannot work (a rank not below the world size, a world of 0).
    #[error("toma::dist: {0}")]
    Config(String),
    /// The store could not be reached (or hosted).
    #[error("toma::dist: rank {rank} could not reach the store at {addr} within {waited:?}: {message}")]
    Connect {
        /// This rank.
        rank: usize,
        /// `host:port`.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// c10d's message.
        message: String,
    },
    /// Ranks did not arrive in time: dead, hung, or slower than the timeout.
    #[error(
        "toma::dist: rank(s) {missing:?} did not reach `{key}` within {waited:?} (rank {rank} waited); \
         a rank died or hangs, or the timeout is too short for the slowest rank (Config::timeout)"
    )]
    Timeout {
        /// The round's key prefix.
        key: String,
        /// The ranks that did not arrive (empty when the store could not say).
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
        /// This rank.
        rank: usize,
    },
    /// A store operation failed (the store went away: the rank hosting it ended, or the agent).
    #[error("toma::dist: the store failed in {op}: {message}")]
    Store {
        /// The operation.
        op: &'static str,
        /// c10d's message.
        message: String,
    },
    /// Ranks called with settings that cannot agree.
    #[error("toma::dist: ranks disagree: {0}")]
    Mismatch(String),
    /// The Gloo process group failed, or toma was built without gloo's headers.
    #[error("toma::dist: gloo: {0}")]
    Gloo(String),
}

/// What a grouped call returns when it does not succeed.
#[derive(Debug)]
#[non_exhaustive]
pub enum GroupError<E> {
    /// This rank failed for good: the body's error (its out-of-memory at size 1, or another
    /// error). Every other rank returned [`GroupError::Peer`].
    Local(E),
    /// Another rank failed for good; this rank stopped with it.
    Peer {
        /// The rank that failed (the lowest, when several did).
        rank: usize,
        /// Its message (an error's [`message`](crate::OutOfMemory::message) or `Display`, or a
        /// panic's text).
        message: String,
        /// Whether it ran out of memory at size 1.
        out_of_memory: bool,
    },
    /// The ranks could not agree (a rank died or hangs, or the store went away).
    Dist(DistError),
}

impl<E: fmt::Display> fmt::Display for GroupError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupError::Local(err) => write!(f, "{err}"),
            GroupError::Peer { rank, message, out_of_memory: true } => {
                write!(f, "toma::dist: rank {rank} ran out of memory at size 1: {message}")
            }
            GroupError::Peer { rank, message, .. } => write!(f, "toma::dist: rank {rank} failed: {message}"),
            GroupError::Dist(err) => write!(f, "{err}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for GroupError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            GroupError::Local(err) => Some(err),
            GroupError::Dist(err) => Some(err),
            GroupError::Peer { .. } => None,
        }
    }
}

impl<E> From<DistError> for GroupError<E> {
    fn from(err: DistError) -> Self {
        GroupError::Dist(err)
    }
}

impl<E> GroupError<E> {
    /// This rank's own error, if it was this rank that failed.
    pub fn into_local(self) -> Option<E> {
        match self {
            GroupError::Local(err) => Some(err),
            _ => None,
        }
    }
}
