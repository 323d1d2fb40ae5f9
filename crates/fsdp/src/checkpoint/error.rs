//! [`CheckpointError`]: why saving, loading or merging a checkpoint failed, naming the file,
//! the tensor and the rank involved.

use std::path::PathBuf;

use fsdp_comm::CommError;

use crate::engine::EngineError;
use crate::optim::OptimError;

/// Why a checkpoint could not be saved, loaded or merged.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file system operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done (`writing`, `reading`, `renaming`, ...).
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A file is not what the checkpoint's metadata says: truncated, altered, or not a
    /// checkpoint file at all.
    #[error("{}: {reason}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file the checkpoint needs is not there.
    #[error("{}: missing ({what})", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
        /// What it holds.
        what: String,
    },
    /// The checkpoint and what it is loaded into do not match (a parameter one lacks, a shape,
    /// a layout).
    #[error("{}: {reason}", path.display())]
    Mismatch {
        /// The checkpoint folder.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// A save's destination holds something the save did not write (a user's folder, a
    /// file): it is left as it is and nothing is written there.
    #[error("{}: {reason}; nothing was written or removed", path.display())]
    Occupied {
        /// The destination.
        path: PathBuf,
        /// What is there.
        reason: String,
    },
    /// Another rank failed during the collective save or load; every rank reports it.
    #[error("rank {rank} failed: {message}")]
    OnRank {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// The arguments cannot work (no model, optimizers without models, ...).
    #[error("{0}")]
    Usage(String),
    /// A collective failed, or a rank did not join.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The engine refused the values read.
    #[error(transparent)]
    Engine(Box<EngineError>),
    /// The optimizer refused the state read.
    #[error(transparent)]
    Optimizer(#[from] OptimError),
}

impl From<EngineError> for CheckpointError {
    fn from(e: EngineError) -> Self {
        CheckpointError::Engine(Box::new(e))
    }
}

impl CheckpointError {
    /// An I/O error on `path`.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CheckpointError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// A corrupt file.
    pub(crate) fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        CheckpointError::Corrupt {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
