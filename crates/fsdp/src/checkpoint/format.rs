//! The on-disk format (version 1, specified in `docs/CHECKPOINT_FORMAT.md`): the names of a
//! checkpoint's files and folders, and the JSON documents that describe them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::error::CheckpointError;

/// The `format` field of every metadata document.
pub const FORMAT: &str = "fsdp-rs-checkpoint";
/// The version this build writes and reads.
pub const VERSION: u32 = 1;
/// The document whose presence makes a folder a complete checkpoint (written last).
pub const CHECKPOINT_FILE: &str = "fsdp_checkpoint.json";
/// A model or optimizer folder's description of its tensors.
pub const METADATA_FILE: &str = "metadata.json";

/// `pytorch_model_fsdp_{i}`, as Accelerate names a model's folder.
pub fn model_folder(i: usize) -> String {
    format!("pytorch_model_fsdp_{i}")
}

/// `optimizer_{i}`.
pub fn optimizer_folder(i: usize) -> String {
    format!("optimizer_{i}")
}

/// `scheduler_{i}.json`.
pub fn scheduler_file(i: usize) -> String {
    format!("scheduler_{i}.json")
}

/// `random_states_{rank}.json`.
pub fn random_states_file(rank: usize) -> String {
    format!("random_states_{rank}.json")
}

/// The tensor file rank `rank` writes in a folder.
pub fn rank_file(rank: usize) -> String {
    format!("rank_{rank}.safetensors")
}

/// The single file of a full (consolidated) state dict.
pub const FULL_MODEL_FILE: &str = "model.safetensors";
/// The single file of a full optimizer state dict.
pub const FULL_OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// What a checkpoint holds, written last: its presence means the checkpoint is complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointDoc {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// `SHARDED_STATE_DICT`, `FULL_STATE_DICT` or `LOCAL_STATE_DICT`.
    pub state_dict_type: String,
    /// Ranks of the job that saved it.
    pub world_size: usize,
    /// Models saved (`pytorch_model_fsdp_{i}`).
    pub models: usize,
    /// Optimizers saved (`optimizer_{i}`, optimizer i of model i).
    pub optimizers: usize,
    /// Schedulers saved (`scheduler_{i}.json`).
    pub schedulers: usize,
    /// The training step the state belongs to.
    pub step: u64,
    /// Free-form position of the data pipeline (sampler epoch and index), as given.
    pub data: serde_json::Value,
    /// Each model's fp16 loss-scaler state, as given (absent when no model has one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grad_scalers: Vec<serde_json::Value>,
}

/// A model or optimizer folder's `metadata.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FolderDoc {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// `model` or `optimizer`.
    pub kind: String,
    /// How the tensors were cut (see [`CheckpointDoc::state_dict_type`]).
    pub state_dict_type: String,
    /// Every tensor: its full shape and dtype, and which files hold which rows.
    pub tensors: BTreeMap<String, TensorDoc>,
    /// Every file with its size and the checksum of its header.
    pub files: BTreeMap<String, FileDoc>,
    /// Optimizer folders: the optimizer and each parameter's update count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerDoc>,
    /// `LOCAL_STATE_DICT` folders: the layout the shards were cut for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<LayoutDoc>,
}

/// One tensor of a folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorDoc {
    /// The full shape.
    pub shape: Vec<usize>,
    /// The element type (`F32`).
    pub dtype: String,
    /// Row ranges of dim 0 and where they are, covering every row once.
    pub pieces: Vec<PieceDoc>,
}

/// Some rows of a tensor, stored contiguously in one file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PieceDoc {
    /// The file, relative to the folder.
    pub file: String,
    /// The rows `[start, end)` of dim 0.
    pub rows: [usize; 2],
    /// Where the bytes start in the file.
    pub offset: u64,
    /// How many bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of those bytes.
    pub crc32: u32,
}

/// One file of a folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileDoc {
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC-32 of its safetensors header (the bytes before the data).
    pub header_crc32: u32,
    /// The rank that wrote it.
    pub rank: usize,
}

/// An optimizer folder's non-tensor state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerDoc {
    /// The optimizer (`AdamW`).
    pub name: String,
    /// Each parameter group's learning rate when saved.
    pub lrs: Vec<f64>,
    /// Each parameter's update count (`state[p]["step"]`), for parameters with state.
    pub steps: BTreeMap<String, u64>,
}

/// The layout local (raw, padded) shards were cut for: loading needs the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutDoc {
    /// Ranks that saved.
    pub world_size: usize,
    /// Ranks a parameter is split over.
    pub shard_size: usize,
    /// Each unit's path and its parameters' names.
    pub units: Vec<(String, Vec<String>)>,
}

impl std::fmt::Display for LayoutDoc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rank(s), sharded over {}, {} unit(s)",
            self.world_size,
            self.shard_size,
            self.units.len()
        )
    }
}

/// Reads and parses a JSON document, naming the file in every error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, CheckpointError> {
    let text = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::Missing {
            path: path.to_path_buf(),
            what: "a checkpoint document".into(),
        },
        _ => CheckpointError::io("reading", path, e),
    })?;
    serde_json::from_slice(&text).map_err(|e| CheckpointError::corrupt(path, e.to_string()))
}

/// Checks a document's format and version.
pub fn check_version(path: &Path, format: &str, version: u32) -> Result<(), CheckpointError> {
    if format != FORMAT {
        return Err(CheckpointError::corrupt(
            path,
            format!("format `{format}`, not `{FORMAT}`"),
        ));
    }
    if version != VERSION {
        return Err(CheckpointError::corrupt(
            path,
            format!("format version {version}; this build reads version {VERSION}"),
        ));
    }
    Ok(())
}

/// Finds the checkpoint folder from a path that is the checkpoint itself or a folder inside
/// it (`.../pytorch_model_fsdp_0`): users point at either.
pub fn checkpoint_root(path: &Path) -> Option<PathBuf> {
    if path.join(CHECKPOINT_FILE).is_file() {
        return Some(path.to_path_buf());
    }
    let parent = path.parent()?;
    parent
        .join(CHECKPOINT_FILE)
        .is_file()
        .then(|| parent.to_path_buf())
}
