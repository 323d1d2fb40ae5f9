//! Saving as a PyTorch distributed checkpoint (`fsdp_checkpoint_format: torch-dcp`), the
//! layout Accelerate's `save_state` writes with SHARDED_STATE_DICT, so that
//! `accelerator.load_state` in PyTorch resumes it (FSDP1 or FSDP2, any world size):
//!
//! * `pytorch_model_fsdp_{i}/`: the model's state dict under `model.`; each rank writes the
//!   rows it owns as chunks in `__{rank}_0.distcp`;
//! * `optimizer_{i}/`: `optimizer.state.{param}.{exp_avg,...}` in chunks the same way, and
//!   from rank 0 (`__0_1.distcp`, written once every rank has reported) each parameter's
//!   `step` and `optimizer.param_groups.{g}.{setting}` with PyTorch's names and defaults;
//! * `.metadata` in each folder, written by rank 0 last;
//! * `scheduler.bin` (`scheduler_{i}.bin`) for each scheduler: a `LambdaLR` state;
//! * beside them, what only fsdp-rs reads back — the run state (`fsdp_run_state.json`:
//!   step, data position, loss scalers, listed documents), `scheduler_{i}.json` and
//!   `random_states_{rank}.json` — so that resuming here is exact.
//!
//! The folder is published atomically like every other checkpoint.

use std::collections::BTreeMap;
use std::path::Path;

use super::RunState;
use super::atomic;
use super::dcp::{
    self, Entry, PathPart, Py, Stored, StoredChunk, metadata, tensor_record, value_record,
    write_records,
};
use super::error::CheckpointError;
use super::format::{self, FileDoc, FileSum, GroupDoc, OptimizerDoc};
use super::report::{self, DocInputs, RankFolder, RankPiece, RankReport, write_run_document};
use super::save_parts::{Part, PartSource, RankParts};

/// Rank 0's file of each optimizer folder: step counts and group settings.
const VALUES_FILE: &str = "__0_1.distcp";

/// This rank's DCP file of a folder (`__{rank}_0.distcp`).
fn rank_file(rank: usize) -> String {
    format!("__{rank}_0.distcp")
}

/// A part's chunk: its rows of the full shape.
fn chunk_of(shape: &[usize], rows: [usize; 2]) -> (Vec<usize>, Vec<usize>) {
    if shape.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut offsets = vec![0; shape.len()];
    let mut sizes = shape.to_vec();
    offsets[0] = rows[0];
    sizes[0] = rows[1] - rows[0];
    (offsets, sizes)
}

/// Writes `parts` as one DCP file in `folder` and describes it as a rank's folder report.
fn write_parts<V: PartSource>(
    folder: &Path,
    rank: usize,
    parts: &[Part<V>],
) -> Result<RankFolder, CheckpointError> {
    if parts.is_empty() {
        return Ok(RankFolder::default());
    }
    let file = rank_file(rank);
    let records = parts.iter().map(|p| {
        let (_, sizes) = chunk_of(&p.shape, p.rows);
        tensor_record(&p.values.get()?, &sizes)
    });
    let (placed, sum) = write_records(folder, &file, records)?;
    Ok(RankFolder {
        file: Some((
            file,
            FileDoc {
                bytes: sum.bytes,
                header_crc32: 0,
                rank,
            },
        )),
        crc32: sum.crc32,
        pieces: parts
            .iter()
            .zip(placed)
            .map(|(p, s)| RankPiece {
                tensor: p.name.clone(),
                shape: p.shape.clone(),
                rows: p.rows,
                offset: s.at,
                bytes: s.length,
                crc32: 0,
            })
            .collect(),
        steps: BTreeMap::new(),
    })
}

/// Writes this rank's files into `staging`: its random state, and one DCP file per model
/// folder, then per optimizer folder.
pub(super) fn write_rank<V: PartSource>(
    staging: &Path,
    parts: &RankParts<V>,
) -> Result<RankReport, CheckpointError> {
    let rank = parts.rank;
    let mut report = RankReport {
        random: report::write_random(staging, rank, &parts.random)?,
        ..Default::default()
    };
    let mut optimizer_folders = Vec::new();
    for (i, m) in parts.models.iter().enumerate() {
        let model_dir = staging.join(format::model_folder(i));
        report
            .folders
            .push(write_parts(&model_dir, rank, &m.params)?);
        if let Some((states, steps)) = &m.optimizer {
            let opt_dir = staging.join(format::optimizer_folder(i));
            let mut folder = write_parts(&opt_dir, rank, states)?;
            folder.steps = steps.clone();
            optimizer_folders.push(folder);
        }
    }
    report.folders.extend(optimizer_folders);
    Ok(report)
}

fn key(k: &str) -> PathPart {
    PathPart::Key(k.to_string())
}

/// Every tensor of folder `f` from the ranks' reports, its chunks in row order, at the
/// state-dict path `path_of` gives its name.
fn tensor_entries(
    reports: &[RankReport],
    f: usize,
    path_of: &dyn Fn(&str) -> Vec<PathPart>,
) -> Vec<Entry> {
    let mut tensors: BTreeMap<&str, (Vec<usize>, Vec<StoredChunk>)> = BTreeMap::new();
    for report in reports {
        let Some(RankFolder {
            file: Some((file, _)),
            pieces,
            ..
        }) = report.folders.get(f)
        else {
            continue;
        };
        for RankPiece {
            tensor: name,
            shape,
            rows,
            offset: at,
            bytes: length,
            ..
        } in pieces
        {
            let (offsets, sizes) = chunk_of(shape, *rows);
            let entry = tensors
                .entry(name.as_str())
                .or_insert_with(|| (shape.clone(), Vec::new()));
            entry.1.push(StoredChunk {
                offsets,
                sizes,
                stored: Stored {
                    file: file.clone(),
                    at: *at,
                    length: *length,
                },
            });
        }
    }
    tensors
        .into_iter()
        .map(|(name, (shape, mut chunks))| {
            chunks.sort_by(|a, b| a.offsets.cmp(&b.offsets));
            Entry::Tensor {
                path: path_of(name),
                shape,
                chunks,
            }
        })
        .collect()
}

/// A JSON setting as the Python value PyTorch keeps (lists as tuples: `betas`).
fn py_of(v: &serde_json::Value) -> Py {
    match v {
        serde_json::Value::Null => Py::None,
        serde_json::Value::Bool(b) => Py::Bool(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) if !n.is_f64() => Py::Int(i),
            _ => Py::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Py::str(s.as_str()),
        serde_json::Value::Array(items) => Py::Tuple(items.iter().map(py_of).collect()),
        serde_json::Value::Object(m) => Py::Dict(
            m.iter()
                .map(|(k, v)| (Py::str(k.as_str()), py_of(v)))
                .collect(),
        ),
    }
}

/// PyTorch's settings of a group that no optimizer here has, with PyTorch's defaults.
fn pytorch_defaults(optimizer: &str) -> Vec<(&'static str, Py)> {
    let adam = |decoupled| {
        vec![
            ("amsgrad", Py::Bool(false)),
            ("maximize", Py::Bool(false)),
            ("foreach", Py::None),
            ("capturable", Py::Bool(false)),
            ("differentiable", Py::Bool(false)),
            ("fused", Py::None),
            ("decoupled_weight_decay", Py::Bool(decoupled)),
        ]
    };
    match optimizer {
        "AdamW" => adam(true),
        "Adam" => adam(false),
        _ => vec![
            ("maximize", Py::Bool(false)),
            ("foreach", Py::None),
            ("differentiable", Py::Bool(false)),
            ("fused", Py::None),
        ],
    }
}

/// A group's `param_groups` entries: our settings (PyTorch's names), PyTorch's other
/// settings, and the parameters by name, as `FSDP.optim_state_dict` writes them.
fn group_values(optimizer: &str, group: &GroupDoc) -> Vec<(PathPart, Py)> {
    let mut values: Vec<(String, Py)> = group
        .settings
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), py_of(v)))
        .collect();
    for (k, v) in pytorch_defaults(optimizer) {
        if !values.iter().any(|(have, _)| have == k) {
            values.push((k.to_string(), v));
        }
    }
    values.push((
        "params".into(),
        Py::List(group.params.iter().map(|p| Py::str(p.as_str())).collect()),
    ));
    values.into_iter().map(|(k, v)| (key(&k), v)).collect()
}

/// Rank 0: optimizer folder `dir`'s values file (steps, group settings) and its entries.
fn write_values(
    dir: &Path,
    optimizer: &OptimizerDoc,
    steps: &BTreeMap<String, u64>,
) -> Result<(Vec<Entry>, FileSum), CheckpointError> {
    let optim = || vec![key("optimizer")];
    let mut paths = Vec::new();
    let mut records = Vec::new();
    for (param, step) in steps {
        let mut path = optim();
        path.extend([key("state"), key(param), key("step")]);
        paths.push((path, true));
        records.push(tensor_record(&[*step as f32], &[]));
    }
    for (g, group) in optimizer.groups.iter().enumerate() {
        for (setting, value) in group_values(&optimizer.name, group) {
            let mut path = optim();
            path.extend([key("param_groups"), PathPart::Index(g), setting]);
            paths.push((path, false));
            records.push(value_record(&value));
        }
    }
    let (placed, sum) = write_records(dir, VALUES_FILE, records)?;
    let entries = paths
        .into_iter()
        .zip(placed)
        .map(|((path, is_tensor), stored)| match is_tensor {
            true => Entry::Tensor {
                path,
                shape: Vec::new(),
                chunks: vec![StoredChunk {
                    offsets: Vec::new(),
                    sizes: Vec::new(),
                    stored,
                }],
            },
            false => Entry::Value { path, stored },
        })
        .collect();
    Ok((entries, sum))
}

/// `scheduler` as the state of PyTorch's `LambdaLR` over `optimizer`'s groups (its base
/// rates are the groups' initial rates, its last rates the current ones).
fn lambda_lr_state(scheduler: &serde_json::Value, optimizer: &OptimizerDoc) -> Py {
    let steps = scheduler["steps"].as_i64().unwrap_or(0);
    let base: Vec<Py> = optimizer
        .groups
        .iter()
        .zip(&optimizer.lrs)
        .map(|(g, lr)| Py::Float(g.settings["initial_lr"].as_f64().unwrap_or(*lr)))
        .collect();
    let last = optimizer.lrs.iter().map(|lr| Py::Float(*lr)).collect();
    Py::fields(vec![
        ("base_lrs", Py::List(base)),
        ("last_epoch", Py::Int(steps)),
        ("_step_count", Py::Int(steps + 1)),
        ("_is_initial", Py::Bool(false)),
        ("_get_lr_called_within_step", Py::Bool(false)),
        ("_last_lr", Py::List(last)),
        (
            "lr_lambdas",
            Py::List(optimizer.lrs.iter().map(|_| Py::Dict(Vec::new())).collect()),
        ),
    ])
}

/// Accelerate's name of scheduler `i`'s file.
pub(crate) fn scheduler_bin(i: usize) -> String {
    match i {
        0 => "scheduler.bin".into(),
        i => format!("scheduler_{i}.bin"),
    }
}

/// Rank 0: every folder's `.metadata` (and optimizer values) from the ranks' reports, the
/// schedulers for PyTorch, and last the run state.
pub(super) fn write_documents(
    staging: &Path,
    reports: &[RankReport],
    inputs: &DocInputs,
    run: &RunState,
) -> Result<(), CheckpointError> {
    let models = inputs.models;
    let mut own = BTreeMap::new();
    for f in 0..models + inputs.optimizers.len() {
        let (folder, entries) = if f < models {
            let entries = tensor_entries(reports, f, &|name| vec![key("model"), key(name)]);
            (format::model_folder(f), entries)
        } else {
            let folder = format::optimizer_folder(f - models);
            let dir = staging.join(&folder);
            let mut entries = tensor_entries(reports, f, &|name| {
                // `{param}.{state}`: state names have no dots, parameter names do.
                let (param, state) = name.rsplit_once('.').unwrap_or((name, ""));
                vec![key("optimizer"), key("state"), key(param), key(state)]
            });
            let steps: BTreeMap<String, u64> = reports
                .iter()
                .filter_map(|r| r.folders.get(f))
                .flat_map(|folder| folder.steps.clone())
                .collect();
            std::fs::create_dir_all(&dir).map_err(|e| CheckpointError::io("creating", &dir, e))?;
            let (values, sum) = write_values(&dir, &inputs.optimizers[f - models], &steps)?;
            entries.extend(values);
            own.insert(format!("{folder}/{VALUES_FILE}"), sum);
            (folder, entries)
        };
        let dir = staging.join(&folder);
        std::fs::create_dir_all(&dir).map_err(|e| CheckpointError::io("creating", &dir, e))?;
        let sum = atomic::write_synced(&dir.join(dcp::METADATA), &metadata(&entries))?;
        atomic::sync_dir(&dir)?;
        own.insert(format!("{folder}/{}", dcp::METADATA), sum);
    }
    for (i, (s, o)) in run.schedulers.iter().zip(&inputs.optimizers).enumerate() {
        let record = value_record(&lambda_lr_state(s, o))?;
        let sum = atomic::write_synced(&staging.join(scheduler_bin(i)), &record)?;
        own.insert(scheduler_bin(i), sum);
    }
    write_run_document(
        staging,
        reports,
        inputs,
        run,
        ("SHARDED_STATE_DICT", format::RUN_STATE_FILE),
        own,
    )
}

/// PyTorch would read a quantized weight's words as f32 values: a model with one is refused
/// before anything is written (every rank sees the same models), naming it.
pub(super) fn refuse_quantized(models: &[&crate::engine::Fsdp]) -> Result<(), CheckpointError> {
    let quantized = models.iter().find_map(|m| {
        m.parameters()
            .into_iter()
            .find_map(|(n, _)| Some((n.to_string(), m.packing(n)?)))
    });
    match quantized {
        Some((name, p)) => Err(CheckpointError::QuantizedInTorchDcp {
            name: name.to_string(),
            format: p.format.to_string(),
        }),
        None => Ok(()),
    }
}
