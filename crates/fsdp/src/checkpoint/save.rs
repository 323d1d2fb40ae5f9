//! Saving: every rank writes its own files into a staging folder (its rows with
//! SHARDED_STATE_DICT, everything gathered unit by unit onto rank 0 with FULL_STATE_DICT),
//! one exchange of small documents gives rank 0 what it needs for the metadata, and rank 0
//! puts the synced folder in place atomically.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::atomic;
use super::collect::{agree, all_gather_bytes, broadcast_bytes, join};
use super::error::CheckpointError;
use super::format::{self, FolderDoc, OptimizerDoc, PieceDoc, TensorDoc};
use super::report::{
    DocInputs, RankFolder, RankReport, describe, report_folder, state_dict_name, write_random,
    write_run_document,
};
use super::save_full::{state_keys, write_full, write_full_state};
use super::save_parts::{Part, PartSource, RankParts, random_bytes, rank_parts};
use super::tensor_file::{PlannedTensor, TensorFileWriter};
use super::{CheckpointOptions, RunState};
use crate::config::{CheckpointFormat, StateDictType};
use crate::engine::Fsdp;
use crate::optim::Optimizer;
use fsdp_comm::Mesh;

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
        random: write_random(staging, rank, &random_bytes(run)?)?,
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
            let mut folder = write_full_state(m, o, &opt_dir, &keys, tensors)?;
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
        random: write_random(staging, rank, &parts.random)?,
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
    let mut own = BTreeMap::new();
    let folders = models + inputs.optimizers.len();
    for f in 0..folders {
        let is_model = f < models;
        let folder = report_folder(f, models);
        let kind_name = if is_model { "model" } else { "optimizer" };
        let dir = staging.join(&folder);
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
            for piece in &folder.pieces {
                let name = &piece.tensor;
                let entry = doc
                    .tensors
                    .entry(name.clone())
                    .or_insert_with(|| TensorDoc {
                        shape: piece.shape.clone(),
                        dtype: "F32".into(),
                        pieces: Vec::new(),
                        packing: is_model
                            .then(|| inputs.packings[f].get(name).cloned())
                            .flatten(),
                    });
                entry.pieces.push(PieceDoc {
                    file: file.clone(),
                    rows: piece.rows,
                    offset: piece.offset,
                    bytes: piece.bytes,
                    crc32: piece.crc32,
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
        let sum = atomic::write_synced(
            &dir.join(format::METADATA_FILE),
            &format::document_bytes(&doc)?,
        )?;
        atomic::sync_dir(&dir)?;
        own.insert(format!("{folder}/{}", format::METADATA_FILE), sum);
    }
    write_run_document(
        staging,
        reports,
        inputs,
        run,
        (type_name, format::CHECKPOINT_FILE),
        own,
    )
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
        return Err(CheckpointError::NoModel { op: "save_state" });
    };
    if optimizers.len() > models.len() {
        return Err(CheckpointError::OptimizersWithoutModels {
            optimizers: optimizers.len(),
            models: models.len(),
        });
    }
    let mesh = first.mesh().clone();
    join(&mesh, "save_state", options.join_timeout)?;
    let kind = options.state_dict_type.unwrap_or(first.state_dict_type());
    let files = options.format.unwrap_or(first.checkpoint_format());
    if files == CheckpointFormat::TorchDcp && kind != StateDictType::ShardedStateDict {
        return Err(CheckpointError::TorchDcpNeedsSharded {
            state_dict_type: state_dict_name(kind),
        });
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
    let (dest, staging): (PathBuf, PathBuf) =
        serde_json::from_slice(&shared).map_err(|e| CheckpointError::json("staging folder", e))?;
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
        serde_json::to_vec(&r).map_err(|e| CheckpointError::json("this rank's save report", e))
    });
    // On failure rank 0's staging folder goes with `held`.
    let report_text = agree(mesh, written)?;
    let reports = all_gather_bytes(mesh, &report_text)?;
    let published = match begun.held.as_mut() {
        Some(held) => {
            let reports: Result<Vec<RankReport>, _> =
                reports.iter().map(|r| serde_json::from_slice(r)).collect();
            reports
                .map_err(|e| CheckpointError::json("rank report", e))
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
    atomic::check_replaceable(&dest, super::owned::Depth::Sizes)?;
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
