//! What a rank reports about the files it wrote into a checkpoint's staging folder, what
//! rank 0 takes from the models for the documents, and the run document rank 0 writes last:
//! the pieces every checkpoint format's writer (ours, FULL_STATE_DICT's, PyTorch DCP's)
//! shares.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::RunState;
use super::atomic;
use super::error::CheckpointError;
use super::format::{self, CheckpointDoc, FileDoc, FileSum, LayoutDoc, OptimizerDoc, PackingDoc};
use super::tensor_file::WrittenFile;
use crate::config::StateDictType;
use crate::engine::Fsdp;
use crate::optim::Optimizer;

/// One piece of a tensor as a rank reports it: rows of the full tensor, and where they lie in
/// the rank's file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RankPiece {
    /// The tensor's name.
    pub(super) tensor: String,
    /// The full tensor's shape.
    pub(super) shape: Vec<usize>,
    /// The rows `[start, end)` of dimension 0 this piece holds.
    pub(super) rows: [usize; 2],
    /// Its first byte in the file.
    pub(super) offset: u64,
    /// Its length in bytes.
    pub(super) bytes: u64,
    /// The CRC-32 of its bytes (0 in a DCP file, whose records carry none).
    pub(super) crc32: u32,
}

/// What one rank wrote into one folder: its file and the pieces in it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct RankFolder {
    pub(super) file: Option<(String, FileDoc)>,
    /// The CRC-32 of the whole file (its size is the `FileDoc`'s).
    pub(super) crc32: u32,
    pub(super) pieces: Vec<RankPiece>,
    pub(super) steps: BTreeMap<String, u64>,
}

/// What one rank reports after writing: one entry per model folder, then per optimizer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct RankReport {
    pub(super) folders: Vec<RankFolder>,
    /// This rank's `random_states_{rank}.json`.
    pub(super) random: FileSum,
}

/// The name `kind` has in the documents (PyTorch's `StateDictType` member).
pub(super) fn state_dict_name(t: StateDictType) -> &'static str {
    match t {
        StateDictType::FullStateDict => "FULL_STATE_DICT",
        StateDictType::LocalStateDict => "LOCAL_STATE_DICT",
        StateDictType::ShardedStateDict => "SHARDED_STATE_DICT",
    }
}

/// The layout of `model`'s shards (what a LOCAL_STATE_DICT checkpoint must be loaded into).
pub(crate) fn layout_of(model: &Fsdp) -> LayoutDoc {
    LayoutDoc {
        world_size: model.mesh().world_size(),
        shard_size: model.mesh().shard_size(),
        units: model
            .plan()
            .units
            .iter()
            .map(|u| {
                (
                    u.path.clone(),
                    u.params.iter().map(|p| p.name.clone()).collect(),
                )
            })
            .collect(),
    }
}

/// Describes `written`, one file of `rank`'s, for its report: each tensor's full shape and rows
/// from `shapes`.
pub(super) fn describe(
    file: &str,
    rank: usize,
    written: &WrittenFile,
    shapes: impl Iterator<Item = (Vec<usize>, [usize; 2])>,
) -> RankFolder {
    RankFolder {
        file: Some((
            file.to_string(),
            FileDoc {
                bytes: written.bytes,
                header_crc32: written.header_crc32,
                rank,
            },
        )),
        crc32: written.crc32,
        pieces: written
            .tensors
            .iter()
            .zip(shapes)
            .map(|((name, offset, bytes, crc), (shape, rows))| RankPiece {
                tensor: name.clone(),
                shape,
                rows,
                offset: *offset,
                bytes: *bytes,
                crc32: *crc,
            })
            .collect(),
        steps: BTreeMap::new(),
    }
}

/// Writes `random_states_{rank}.json` into `staging`.
pub(super) fn write_random(
    staging: &Path,
    rank: usize,
    random: &[u8],
) -> Result<FileSum, CheckpointError> {
    atomic::write_synced(&staging.join(format::random_states_file(rank)), random)
}

/// What rank 0 takes from the models and optimizers for the documents, captured when the
/// save begins (an asynchronous save writes them after training has moved on).
pub(super) struct DocInputs {
    /// The number of models.
    pub(super) models: usize,
    /// The first model's layout (its world size; recorded by LOCAL_STATE_DICT).
    pub(super) layout: LayoutDoc,
    /// Each optimizer's name, rates and groups (steps come from the ranks' reports).
    pub(super) optimizers: Vec<OptimizerDoc>,
    /// Each model's quantized weights, by name.
    pub(super) packings: Vec<BTreeMap<String, PackingDoc>>,
}

impl DocInputs {
    /// Captures them from `models` and `optimizers` (optimizer i of model i).
    pub(super) fn of(models: &[&Fsdp], optimizers: &[&dyn Optimizer]) -> DocInputs {
        DocInputs {
            models: models.len(),
            layout: layout_of(models[0]),
            optimizers: optimizers
                .iter()
                .zip(models)
                .map(|(o, m)| OptimizerDoc {
                    name: o.name().into(),
                    lrs: (0..o.num_groups()).map(|g| o.lr(g)).collect(),
                    steps: BTreeMap::new(),
                    groups: super::groups::recorded(m, *o),
                })
                .collect(),
            packings: models
                .iter()
                .map(|m| {
                    m.parameters()
                        .into_iter()
                        .filter_map(|(n, _)| Some((n.to_string(), PackingDoc::of(m.packing(n)?))))
                        .collect()
                })
                .collect(),
        }
    }
}

/// The folder of a report's `f`-th entry: the models' folders first, then their optimizers'.
pub(super) fn report_folder(f: usize, models: usize) -> String {
    if f < models {
        format::model_folder(f)
    } else {
        format::optimizer_folder(f - models)
    }
}

/// Every file the ranks' `reports` say they wrote, by its path in the checkpoint.
fn files_of(reports: &[RankReport], models: usize) -> BTreeMap<String, FileSum> {
    let mut files = BTreeMap::new();
    for (rank, r) in reports.iter().enumerate() {
        files.insert(format::random_states_file(rank), r.random);
        for (f, folder) in r.folders.iter().enumerate() {
            let Some((name, doc)) = &folder.file else {
                continue;
            };
            let dir = report_folder(f, models);
            let sum = FileSum {
                bytes: doc.bytes,
                crc32: folder.crc32,
            };
            files.insert(format!("{dir}/{name}"), sum);
        }
    }
    files
}

/// Rank 0: the schedulers' documents and the checkpoint document `file` (the run state,
/// every other document listed with its checksum, and every file of the checkpoint —
/// the ranks' from their `reports`, rank 0's documents in `own` — with its size and
/// checksum), written last.
pub(super) fn write_run_document(
    staging: &Path,
    reports: &[RankReport],
    inputs: &DocInputs,
    run: &RunState,
    (type_name, file): (&str, &str),
    mut own: BTreeMap<String, FileSum>,
) -> Result<(), CheckpointError> {
    let mut documents: BTreeMap<String, u32> = reports
        .iter()
        .enumerate()
        .map(|(rank, r)| (format::random_states_file(rank), r.random.crc32))
        .collect();
    for (i, s) in run.schedulers.iter().enumerate() {
        let bytes = serde_json::to_vec_pretty(s)
            .map_err(|e| CheckpointError::json(format!("scheduler {i}"), e))?;
        let sum = atomic::write_synced(&staging.join(format::scheduler_file(i)), &bytes)?;
        documents.insert(format::scheduler_file(i), sum.crc32);
        own.insert(format::scheduler_file(i), sum);
    }
    let mut files = files_of(reports, inputs.models);
    files.append(&mut own);
    let doc = CheckpointDoc {
        format: format::FORMAT.into(),
        version: format::VERSION,
        state_dict_type: type_name.into(),
        world_size: inputs.layout.world_size,
        models: inputs.models,
        optimizers: inputs.optimizers.len(),
        schedulers: run.schedulers.len(),
        step: run.step,
        data: run.data.clone(),
        grad_scalers: run.grad_scalers.clone(),
        documents,
        files,
    };
    atomic::write_synced(&staging.join(file), &format::document_bytes(&doc)?)?;
    atomic::sync_dir(staging)
}
