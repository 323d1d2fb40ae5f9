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
    /// A removal (an overwritten output folder, `--remove_checkpoint_dir`, rotation) found
    /// something in a checkpoint folder that no save wrote, or a folder that is no
    /// checkpoint of ours: it is left whole.
    #[error("{}: {reason}; nothing was removed", path.display())]
    NotOurs {
        /// What is not ours (a file inside the folder, or the folder).
        path: PathBuf,
        /// Why.
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
    /// A save or load was called without a model.
    #[error("{op} needs at least one model")]
    NoModel {
        /// The call (`save_state`, `load_state`).
        op: &'static str,
    },
    /// More optimizers than models: optimizer i belongs to model i.
    #[error("{optimizers} optimizers for {models} models: optimizer i belongs to model i")]
    OptimizersWithoutModels {
        /// Optimizers given.
        optimizers: usize,
        /// Models given.
        models: usize,
    },
    /// `fsdp_checkpoint_format: torch-dcp` asked for another state dict type than
    /// SHARDED_STATE_DICT, the one Accelerate's DCP checkpoints have.
    #[error(
        "the torch-dcp checkpoint format writes SHARDED_STATE_DICT checkpoints only (as Accelerate's are), not {state_dict_type}"
    )]
    TorchDcpNeedsSharded {
        /// The state dict type asked for.
        state_dict_type: &'static str,
    },
    /// A torch-dcp save of a model with a quantized weight, which PyTorch would read as floats.
    #[error(
        "the torch-dcp checkpoint format cannot hold `{name}`, kept quantized in {format}: PyTorch would read its blocks as float values; save QLoRA models in the fsdp-rs format (fsdp_checkpoint_format: fsdp-rs), or save the adapters with save_adapter"
    )]
    QuantizedInTorchDcp {
        /// The quantized parameter.
        name: String,
        /// Its format.
        format: String,
    },
    /// An asynchronous save of FULL_STATE_DICT, which gathers through the training's
    /// collectives.
    #[error(
        "an asynchronous save writes SHARDED_STATE_DICT or LOCAL_STATE_DICT: FULL_STATE_DICT gathers every unit onto rank 0 through the training's collectives, so save it with save_state"
    )]
    AsyncFullStateDict,
    /// A document or a rank's report could not be written or read as JSON.
    #[error("{what}: {source}")]
    Json {
        /// What it was (`random state`, `rank 1's report`, ...).
        what: String,
        /// The serialiser's error.
        source: serde_json::Error,
    },
    /// A torch.save record (a zip archive in memory) could not be written.
    #[error("a torch.save record: {0}")]
    Record(#[from] zip::result::ZipError),
    /// A path the system cannot take (a NUL byte in it).
    #[error("{}: a path with a NUL byte", path.display())]
    InvalidPath {
        /// The path.
        path: PathBuf,
    },
    /// A LoRA adapter whose base layer has no `[rows, columns]` weight to merge it into.
    #[error(
        "merging adapters: `{name}` has no [rows, columns] weight `{layer}.weight` to merge into"
    )]
    AdapterWithoutBase {
        /// The adapter's tensor.
        name: String,
        /// The layer it adapts.
        layer: String,
    },
    /// An asynchronous save's writer thread panicked.
    #[error("the writer of {} panicked", dest.display())]
    WriterPanicked {
        /// The checkpoint it was writing.
        dest: PathBuf,
    },
    /// What fsdp-rs's own code guarantees did not hold (a tensor file written against
    /// another plan than its own, a tensor of another size than its shape): a bug, named.
    #[error("{what}")]
    Internal {
        /// What broke.
        what: String,
    },
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
    /// A JSON (de)serialisation failure of `what`.
    pub(crate) fn json(what: impl Into<String>, source: serde_json::Error) -> Self {
        CheckpointError::Json {
            what: what.into(),
            source,
        }
    }

    /// A broken invariant of fsdp-rs's own code.
    pub(crate) fn internal(what: String) -> Self {
        CheckpointError::Internal { what }
    }

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
