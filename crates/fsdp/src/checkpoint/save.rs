//! Saving: every rank writes its own files into a staging folder (its rows with
//! SHARDED_STATE_DICT, everything gathered unit by unit onto rank 0 with FULL_STATE_DICT),
//! one exchange of small documents gives rank 0 what it needs for the metadata, and rank 0
//! puts the synced folder in place atomically.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::atomic;
use super::collect::{agree, all_gather_bytes, broadcast_bytes, join};
use super::error::CheckpointError;
use super::format::{
    self, CheckpointDoc, FileDoc, FolderDoc, LayoutDoc, OptimizerDoc, PackingDoc, PieceDoc,
    TensorDoc,
};
use super::save_full::{state_keys, write_full, write_full_state};
use super::save_parts::{Part, PartSource, RankParts, random_bytes, rank_parts};
use super::tensor_file::{PlannedTensor, TensorFileWriter, WrittenFile};
use super::{CheckpointOptions, RunState};
use crate::config::{CheckpointFormat, StateDictType};
use crate::engine::Fsdp;
use crate::optim::Optimizer;
use fsdp_comm::Mesh;

/// A piece as a rank reports it: (tensor, full shape, rows, offset, bytes, crc32).
pub(super) type RankPiece = (String, Vec<usize>, [usize; 2], u64, u64, u32);

/// What one rank wrote into one folder: its file and the pieces in it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct RankFolder {
    pub(super) file: Option<(String, FileDoc)>,
    pub(super) pieces: Vec<RankPiece>,
    pub(super) steps: BTreeMap<String, u64>,
}

/// What one rank reports after writing: one entry per model folder, then per optimizer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct RankReport {
    pub(super) folders: Vec<RankFolder>,
    /// The CRC-32 of this rank's `random_states_{rank}.json`.
    pub(super) random_crc32: u32,
}

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

/// Writes `parts` as one tensor file and describes it.
fn write_parts<V: PartSource>(
    folder: &Path,
    file: &str,
    rank: usize,
    parts: &[Part<V>],
) -> Result<RankFolder, CheckpointError> {
    if parts.is_empty() {
        return Ok(RankFolder::default());
    }
    let plan = parts
        .iter()
        .map(|p| {
            let mut shape = p.shape.clone();
            if let Some(d) = shape.first_mut() {
                *d = p.rows[1] - p.rows[0];
            }
            PlannedTensor {
                name: p.name.clone(),
                shape,
            }
        })
        .collect();
    let mut w = TensorFileWriter::create(&folder.join(file), plan)?;
    for p in parts {
        w.write_next(&p.values.get()?)?;
    }
    let written = w.finish()?;
    Ok(describe(
        file,
        rank,
        &written,
        parts.iter().map(|p| (p.shape.clone(), p.rows)),
    ))
}

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
        pieces: written
            .tensors
            .iter()
            .zip(shapes)
            .map(|((name, offset, bytes, crc), (shape, rows))| {
                (name.clone(), shape, rows, *offset, *bytes, *crc)
            })
            .collect(),
        steps: BTreeMap::new(),
    }
}

/// Writes this rank's files for every model and optimizer into `staging`.
fn write_rank(
    staging: &Path,
    models: &[&Fsdp],
    optimizers: &[&dyn Optimizer],
    run: &RunState,
    kind: StateDictType,
    files: CheckpointFormat,
) -> Result<RankReport, CheckpointError> {
    if kind != StateDictType::FullStateDict {
        let parts = rank_parts(
            models,
            optimizers,
            run,
            kind == StateDictType::LocalStateDict,
        )?;
        return write_rank_parts(staging, &parts, files);
    }
    let rank = models[0].mesh().rank();
    let mut report = RankReport {
        random_crc32: write_random(staging, rank, &random_bytes(run)?)?,
        ..Default::default()
    };
    let mut optimizer_folders = Vec::new();
    for (i, m) in models.iter().enumerate() {
        let opt = optimizers.get(i).copied();
        let model_dir = staging.join(format::model_folder(i));
        let opt_dir = staging.join(format::optimizer_folder(i));
        let names: Vec<(String, Vec<usize>)> = m
            .parameters()
            .into_iter()
            .map(|(n, s)| (n.to_string(), s.to_vec()))
            .collect();
        report.folders.push(write_full(
            m,
            &model_dir,
            format::FULL_MODEL_FILE,
            names.clone(),
            &|name, _| m.local_values_of(name).map(Some),
        )?);
        if let Some(o) = opt {
            let mut folder = RankFolder::default();
            let keys: Vec<String> = state_keys(m, o, &names);
            let mut tensors = Vec::new();
            for key in &keys {
                for (n, s) in &names {
                    let info = m.optimizer_state_info(o, n);
                    if info.is_some_and(|(_, keys)| keys.contains(key)) {
                        tensors.push((format!("{n}.{key}"), s.clone()));
                    }
                }
            }
            let mut written = write_full_state(m, o, &opt_dir, &keys, tensors)?;
            folder.file = written.file.take();
            folder.pieces = written.pieces;
            folder.steps = names
                .iter()
                .filter_map(|(n, _)| m.optimizer_state_info(o, n).map(|(s, _)| (n.clone(), s)))
                .collect();
            optimizer_folders.push(folder);
        }
    }
    report.folders.extend(optimizer_folders);
    Ok(report)
}

/// Writes `random_states_{rank}.json` into `staging`; returns its CRC-32.
pub(super) fn write_random(
    staging: &Path,
    rank: usize,
    random: &[u8],
) -> Result<u32, CheckpointError> {
    atomic::write_synced(&staging.join(format::random_states_file(rank)), random)?;
    Ok(crc32fast::hash(random))
}

/// Writes a sharded or local save's files of this rank into `staging`: one file per model
/// folder, then one per optimizer folder (PyTorch DCP files with `TorchDcp`).
pub(super) fn write_rank_parts<V: PartSource>(
    staging: &Path,
    parts: &RankParts<V>,
    files: CheckpointFormat,
) -> Result<RankReport, CheckpointError> {
    if files == CheckpointFormat::TorchDcp {
        return super::save_dcp::write_rank(staging, parts);
    }
    let rank = parts.rank;
    let mut report = RankReport {
        random_crc32: write_random(staging, rank, &parts.random)?,
        ..Default::default()
    };
    let mut optimizer_folders = Vec::new();
    for (i, m) in parts.models.iter().enumerate() {
        let file = format::rank_file(rank);
        let model_dir = staging.join(format::model_folder(i));
        report
            .folders
            .push(write_parts(&model_dir, &file, rank, &m.params)?);
        if let Some((states, steps)) = &m.optimizer {
            let opt_dir = staging.join(format::optimizer_folder(i));
            let mut folder = write_parts(&opt_dir, &file, rank, states)?;
            folder.steps = steps.clone();
            optimizer_folders.push(folder);
        }
    }
    report.folders.extend(optimizer_folders);
    Ok(report)
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

/// Rank 0: the folders' metadata from every rank's report, the schedulers, and last the
/// checkpoint document.
fn write_documents(
    staging: &Path,
    reports: &[RankReport],
    inputs: &DocInputs,
    run: &RunState,
    kind: StateDictType,
) -> Result<(), CheckpointError> {
    let type_name = state_dict_name(kind);
    let models = inputs.models;
    let folders = models + inputs.optimizers.len();
    for f in 0..folders {
        let is_model = f < models;
        let (dir, kind_name) = if is_model {
            (staging.join(format::model_folder(f)), "model")
        } else {
            (
                staging.join(format::optimizer_folder(f - models)),
                "optimizer",
            )
        };
        let mut doc = FolderDoc {
            format: format::FORMAT.into(),
            version: format::VERSION,
            kind: kind_name.into(),
            state_dict_type: type_name.into(),
            tensors: BTreeMap::new(),
            files: BTreeMap::new(),
            optimizer: None,
            layout: (kind == StateDictType::LocalStateDict).then(|| inputs.layout.clone()),
        };
        let mut steps = BTreeMap::new();
        for report in reports {
            let Some(folder) = report.folders.get(f) else {
                continue;
            };
            let Some((file, file_doc)) = &folder.file else {
                continue;
            };
            doc.files.insert(file.clone(), file_doc.clone());
            for (name, shape, rows, offset, bytes, crc32) in &folder.pieces {
                let entry = doc
                    .tensors
                    .entry(name.clone())
                    .or_insert_with(|| TensorDoc {
                        shape: shape.clone(),
                        dtype: "F32".into(),
                        pieces: Vec::new(),
                        packing: is_model
                            .then(|| inputs.packings[f].get(name).cloned())
                            .flatten(),
                    });
                entry.pieces.push(PieceDoc {
                    file: file.clone(),
                    rows: *rows,
                    offset: *offset,
                    bytes: *bytes,
                    crc32: *crc32,
                });
            }
            steps.extend(folder.steps.iter().map(|(k, v)| (k.clone(), *v)));
        }
        for t in doc.tensors.values_mut() {
            t.pieces.sort_by_key(|p| (p.rows[0], p.file.clone()));
        }
        if !is_model {
            doc.optimizer = Some(OptimizerDoc {
                steps,
                ..inputs.optimizers[f - models].clone()
            });
        }
        std::fs::create_dir_all(&dir).map_err(|e| CheckpointError::io("creating", &dir, e))?;
        atomic::write_synced(
            &dir.join(format::METADATA_FILE),
            &format::document_bytes(&doc)?,
        )?;
        atomic::sync_dir(&dir)?;
    }
    write_run_document(
        staging,
        reports,
        inputs,
        run,
        type_name,
        format::CHECKPOINT_FILE,
    )
}

/// Rank 0: the schedulers' documents and the checkpoint document `file` (the run state,
/// every other document listed with its checksum), written last.
pub(super) fn write_run_document(
    staging: &Path,
    reports: &[RankReport],
    inputs: &DocInputs,
    run: &RunState,
    type_name: &str,
    file: &str,
) -> Result<(), CheckpointError> {
    let mut documents: BTreeMap<String, u32> = reports
        .iter()
        .enumerate()
        .map(|(rank, r)| (format::random_states_file(rank), r.random_crc32))
        .collect();
    for (i, s) in run.schedulers.iter().enumerate() {
        let bytes = serde_json::to_vec_pretty(s)
            .map_err(|e| CheckpointError::Usage(format!("scheduler {i}: {e}")))?;
        atomic::write_synced(&staging.join(format::scheduler_file(i)), &bytes)?;
        documents.insert(format::scheduler_file(i), crc32fast::hash(&bytes));
    }
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
    };
    atomic::write_synced(&staging.join(file), &format::document_bytes(&doc)?)?;
    atomic::sync_dir(staging)
}

/// A save under way, after its first phase: every rank joined and knows the destination
/// and the staging folder, which rank 0 holds.
pub(super) struct Begun {
    pub(super) mesh: Mesh,
    pub(super) dest: PathBuf,
    pub(super) staging: PathBuf,
    /// Rank 0's staging folder (`None` on the others).
    pub(super) held: Option<atomic::Staging>,
    pub(super) kind: StateDictType,
    /// The files a sharded save writes.
    pub(super) files: CheckpointFormat,
}

/// The first phase of every save (collective): the arguments checked, every rank joined,
/// and rank 0's destination and staging folder made and shared.
pub(super) fn begin(
    dest: &Path,
    models: &[&Fsdp],
    optimizers: &[&dyn Optimizer],
    options: &CheckpointOptions,
) -> Result<Begun, CheckpointError> {
    let Some(first) = models.first() else {
        return Err(CheckpointError::Usage(
            "save_state needs at least one model".into(),
        ));
    };
    if optimizers.len() > models.len() {
        return Err(CheckpointError::Usage(format!(
            "{} optimizers for {} models: optimizer i belongs to model i",
            optimizers.len(),
            models.len()
        )));
    }
    let mesh = first.mesh().clone();
    join(&mesh, "save_state", options.join_timeout)?;
    let kind = options.state_dict_type.unwrap_or(first.state_dict_type());
    let files = options.format.unwrap_or(first.checkpoint_format());
    if files == CheckpointFormat::TorchDcp && kind != StateDictType::ShardedStateDict {
        return Err(CheckpointError::Usage(format!(
            "the torch-dcp checkpoint format writes SHARDED_STATE_DICT checkpoints only (as Accelerate's are), not {}",
            state_dict_name(kind)
        )));
    }
    if files == CheckpointFormat::TorchDcp {
        super::save_dcp::refuse_quantized(models)?;
    }
    // Rank 0 chooses the destination and makes (and holds) the staging folder; the others
    // learn where.
    let prepared = if mesh.rank() == 0 {
        prepare(dest, options, models.len(), optimizers.len()).map(Some)
    } else {
        Ok(None)
    };
    let text = match &prepared {
        Ok(Some((d, s))) => serde_json::json!([d, s.path()]).to_string(),
        _ => String::new(),
    };
    let held = agree(&mesh, prepared)?;
    let shared = broadcast_bytes(&mesh, text.as_bytes())?;
    let (dest, staging): (PathBuf, PathBuf) = serde_json::from_slice(&shared)
        .map_err(|e| CheckpointError::Usage(format!("staging folder: {e}")))?;
    Ok(Begun {
        mesh,
        dest,
        staging,
        held: held.map(|(_, s)| s),
        kind,
        files,
    })
}

/// Rank 0's last phase of every save: the documents from every rank's report, the folder
/// published at `dest`, and rotation with automatic naming.
pub(super) fn publish(
    held: &mut atomic::Staging,
    dest: &Path,
    reports: &[RankReport],
    inputs: &DocInputs,
    run: &RunState,
    (kind, files): (StateDictType, CheckpointFormat),
    options: &CheckpointOptions,
) -> Result<(), CheckpointError> {
    match files {
        CheckpointFormat::TorchDcp => {
            super::save_dcp::write_documents(held.path(), reports, inputs, run)?
        }
        CheckpointFormat::FsdpRs => write_documents(held.path(), reports, inputs, run, kind)?,
    }
    atomic::publish(held, dest)?;
    match (options.automatic_naming, options.total_limit) {
        (true, Some(limit)) => atomic::rotate(dest.parent().unwrap_or(dest), limit),
        _ => Ok(()),
    }
}

/// See [`super::save_state`].
pub(crate) fn save(
    dest: &Path,
    models: &[&Fsdp],
    optimizers: &[&dyn Optimizer],
    run: &RunState,
    options: &CheckpointOptions,
) -> Result<PathBuf, CheckpointError> {
    let mut begun = begin(dest, models, optimizers, options)?;
    let mesh = &begun.mesh;
    let written = write_rank(
        &begun.staging,
        models,
        optimizers,
        run,
        begun.kind,
        begun.files,
    );
    // A report that cannot be serialised fails the save on every rank (never an empty one).
    let written = written.and_then(|r| {
        serde_json::to_vec(&r)
            .map_err(|e| CheckpointError::Usage(format!("this rank's save report: {e}")))
    });
    // On failure rank 0's staging folder goes with `held`.
    let report_text = agree(mesh, written)?;
    let reports = all_gather_bytes(mesh, &report_text)?;
    let published = match begun.held.as_mut() {
        Some(held) => {
            let reports: Result<Vec<RankReport>, _> =
                reports.iter().map(|r| serde_json::from_slice(r)).collect();
            reports
                .map_err(|e| CheckpointError::Usage(format!("rank report: {e}")))
                .and_then(|reports| {
                    let inputs = DocInputs::of(models, optimizers);
                    publish(
                        held,
                        &begun.dest,
                        &reports,
                        &inputs,
                        run,
                        (begun.kind, begun.files),
                        options,
                    )
                })
        }
        None => Ok(()),
    };
    agree(mesh, published)?;
    Ok(begun.dest)
}

/// Rank 0: the destination (the next `checkpoint_<n>` with automatic naming), checked to be
/// one a save may replace, stale staging folders removed, and a fresh staging folder (held
/// locked) with the model and optimizer folders.
fn prepare(
    dest: &Path,
    options: &CheckpointOptions,
    models: usize,
    optimizers: usize,
) -> Result<(PathBuf, atomic::Staging), CheckpointError> {
    let dest = if options.automatic_naming {
        let project = dest.join("checkpoints");
        std::fs::create_dir_all(&project)
            .map_err(|e| CheckpointError::io("creating", &project, e))?;
        atomic::next_numbered(&project)
    } else {
        dest.to_path_buf()
    };
    atomic::check_replaceable(&dest)?;
    if let Some(parent) = dest.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| CheckpointError::io("creating", parent, e))?;
    }
    atomic::remove_stale(&dest)?;
    let staging = atomic::Staging::create(&dest)?;
    for sub in (0..models)
        .map(format::model_folder)
        .chain((0..optimizers).map(format::optimizer_folder))
    {
        let dir = staging.path().join(sub);
        std::fs::create_dir_all(&dir).map_err(|e| CheckpointError::io("creating", &dir, e))?;
    }
    Ok((dest, staging))
}
