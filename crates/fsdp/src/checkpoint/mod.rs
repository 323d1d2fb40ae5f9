//! Checkpoints: `save_state` / `load_state` of models, optimizers, schedulers, random state
//! and data position, in Accelerate's layout (`pytorch_model_fsdp_{i}/`, `optimizer_{i}/`,
//! `scheduler_{i}.json`, `random_states_{rank}.json`), cut as `fsdp_state_dict_type` says:
//!
//! * `SHARDED_STATE_DICT`: each rank writes the rows it owns; loading at any world size and
//!   strategy reads exactly the rows each rank then owns, by parameter and state name.
//! * `FULL_STATE_DICT`: gathered unit by unit onto rank 0 into one `model.safetensors` (Hugging
//!   Face names) and one `optimizer.safetensors`; loads the same way.
//! * `LOCAL_STATE_DICT`: each rank's own state; loads only into the same layout.
//!
//! Saving is atomic (a staging folder synced and renamed into place) and collective with a
//! fail-fast join; every file is checksummed and verified on load. The format is specified
//! in `docs/CHECKPOINT_FORMAT.md`.

mod atomic;
mod collect;
mod dcp;
mod error;
mod files;
#[doc(hidden)] // the documents' types, for tests that craft hostile checkpoints
pub mod format;
mod from_accelerate;
mod groups;
mod latest;
mod load;
mod merge;
mod owned;
mod pretrained;
mod report;
mod save;
mod save_async;
mod save_dcp;
mod save_full;
mod save_parts;
mod tensor_file;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use error::CheckpointError;
pub(crate) use from_accelerate::PYTORCH_SCHEDULER;
pub(crate) use latest::remove_earlier_checkpoints;
pub use latest::{earlier_run_outputs, latest_checkpoint};
pub use merge::{MergeReport, merge_weights};
pub use owned::{check_removable, remove_checkpoint};
pub use pretrained::{Emit, WriteTensor, save_adapter, save_pretrained, save_pretrained_as};
pub use save_async::PendingSave;

use crate::config::{CheckpointFormat, StateDictType};
use crate::engine::Fsdp;
use crate::optim::Optimizer;

/// How a save is named and cut.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointOptions {
    /// The cut; `None` takes the model's `fsdp_state_dict_type`.
    pub state_dict_type: Option<StateDictType>,
    /// The files of a SHARDED_STATE_DICT save; `None` takes the model's
    /// `fsdp_checkpoint_format`.
    pub format: Option<CheckpointFormat>,
    /// Save into `dir/checkpoints/checkpoint_<n>` (the next free `n`) instead of `dir`, as
    /// Accelerate's `ProjectConfiguration(automatic_checkpoint_naming=True)`.
    pub automatic_naming: bool,
    /// With automatic naming, keep at most this many checkpoints (the oldest are removed).
    pub total_limit: Option<usize>,
    /// How long every rank waits for the others to enter the save or load before failing
    /// with the ranks that did not.
    pub join_timeout: Duration,
}

impl Default for CheckpointOptions {
    fn default() -> Self {
        CheckpointOptions {
            state_dict_type: None,
            format: None,
            automatic_naming: false,
            total_limit: None,
            join_timeout: Duration::from_secs(60),
        }
    }
}

/// What a checkpoint holds beside models and optimizers: the training step, each
/// scheduler's state, this rank's random generators, and the data pipeline's position.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// The step the state belongs to.
    pub step: u64,
    /// Each scheduler's state (`scheduler_{i}.json`).
    pub schedulers: Vec<serde_json::Value>,
    /// This rank's random generator state (`random_states_{rank}.json`); on load, `Null` when
    /// the world size changed (per-rank generators do not map onto other ranks).
    pub random: serde_json::Value,
    /// Where the data pipeline is (epoch, batch), restored as saved.
    pub data: serde_json::Value,
    /// Each model's fp16 loss-scaler state (`Null` for a model without one; empty when no
    /// model has one), in `fsdp_checkpoint.json`.
    pub grad_scalers: Vec<serde_json::Value>,
}

/// Saves `models` (model i in `pytorch_model_fsdp_{i}`), `optimizers` (optimizer i of model
/// i) and `run` to `dir` — collective: every rank calls it. Returns the folder written (the
/// numbered one with automatic naming). The previous checkpoint at that folder, if any,
/// stays intact until the new one is complete.
pub fn save_state(
    dir: &Path,
    models: &[&Fsdp],
    optimizers: &[&dyn Optimizer],
    run: &RunState,
    options: &CheckpointOptions,
) -> Result<PathBuf, CheckpointError> {
    let began = std::time::Instant::now();
    let saved = save::save(dir, models, optimizers, run, options);
    trace_save(models, "save_state", began, dir);
    saved
}

/// Records a save that blocked training from `began` until now in the first model's
/// timeline, when it has one.
fn trace_save(models: &[&Fsdp], what: &str, began: std::time::Instant, dir: &Path) {
    if let Some(t) = models.first().and_then(|m| m.tracer()) {
        t.since(what, "checkpoint", began, serde_json::json!({ "dir": dir }));
    }
}

/// [`save_state`] that returns as soon as every rank has copied its state (its parameter
/// rows and their optimizer state, see [`PendingSave::staged_bytes`]) — collective — while a
/// background thread per rank writes, checksums and syncs the files and rank 0 publishes the
/// checkpoint. Training may change the models and optimizers at once. Call
/// [`PendingSave::wait`] (collective) before the next save or load of the same destination
/// and before the program ends: it returns the folder, or on every rank the error that
/// stopped the save, in which case the previous checkpoint at the destination is untouched.
/// SHARDED_STATE_DICT and LOCAL_STATE_DICT only (FULL_STATE_DICT gathers through the
/// training's collectives).
pub fn save_state_async(
    dir: &Path,
    models: &[&Fsdp],
    optimizers: &[&dyn Optimizer],
    run: &RunState,
    options: &CheckpointOptions,
) -> Result<PendingSave, CheckpointError> {
    let began = std::time::Instant::now();
    let pending = save_async::save_async(dir, models, optimizers, run, options);
    trace_save(models, "save_state_async (staging)", began, dir);
    pending
}

/// Loads what [`save_state`] wrote at `dir` (the checkpoint folder, or a folder inside it)
/// into `models` and `optimizers` — collective — and returns the run state. `dir` may also
/// be a checkpoint Accelerate's `save_state` wrote with SHARDED_STATE_DICT (FSDP1 or FSDP2:
/// `pytorch_model_fsdp_{i}/` and `optimizer_{i}/` in PyTorch DCP): the models, the
/// optimizers' state, groups (checked, settings restored) and step counts are read, each
/// rank taking the rows it owns; the run state's step is the optimizers' count, and holds
/// no schedulers, random state or data position (PyTorch pickles; a `scheduler.bin` is
/// refused). Such a checkpoint is checked whole before anything is loaded.
pub fn load_state(
    dir: &Path,
    models: &mut [&mut Fsdp],
    optimizers: &mut [&mut dyn Optimizer],
    options: &CheckpointOptions,
) -> Result<RunState, CheckpointError> {
    let Some(first) = models.first() else {
        return Err(CheckpointError::NoModel { op: "load_state" });
    };
    let mesh = first.mesh().clone();
    collect::join(&mesh, "load_state", options.join_timeout)?;
    let result = if from_accelerate::is_accelerate_checkpoint(dir) {
        from_accelerate::read_all(dir, models, optimizers)
    } else {
        load::read_all(dir, models, optimizers)
    };
    collect::agree(&mesh, result)
}
