//! Loading: every rank reads the metadata, checks that the checkpoint and the models hold
//! the same parameters (a tensor one side lacks is an error naming it), and reads exactly the
//! rows it now owns — whatever world size and strategy saved them — verifying sizes and
//! checksums; the optimizer state is matched by parameter and state name.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::RunState;
use super::error::CheckpointError;
use super::format::{self, CheckpointDoc, FolderDoc, OptimizerDoc, read_document, read_listed};
use super::report::layout_of;
use super::tensor_file::TensorReader;
use crate::engine::Fsdp;
use crate::optim::{Optimizer, ParamState};

/// Reads a folder's metadata, checking its format, kind and cut.
fn folder_doc(dir: &Path, kind: &str, state_dict_type: &str) -> Result<FolderDoc, CheckpointError> {
    let path = dir.join(format::METADATA_FILE);
    let doc: FolderDoc = read_document(&path)?;
    if doc.kind != kind || doc.state_dict_type != state_dict_type {
        return Err(CheckpointError::corrupt(
            &path,
            format!(
                "a {} folder of a {} checkpoint, where a {kind} folder of a {state_dict_type} one was expected",
                doc.kind, doc.state_dict_type
            ),
        ));
    }
    doc.validate(&path, state_dict_type == "LOCAL_STATE_DICT")?;
    Ok(doc)
}

/// For a LOCAL_STATE_DICT folder: keeps only this rank's file, after checking the layout.
fn local_only(dir: &Path, doc: &mut FolderDoc, model: &Fsdp) -> Result<(), CheckpointError> {
    let current = layout_of(model);
    match &doc.layout {
        Some(saved) if *saved == current => {}
        Some(saved) => {
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                reason: format!(
                    "LOCAL_STATE_DICT shards were cut for {saved}, and this job has {current}: load them with the same world size and wrapping, or save a SHARDED_STATE_DICT checkpoint"
                ),
            });
        }
        None => {
            return Err(CheckpointError::corrupt(
                dir.join(format::METADATA_FILE),
                "a LOCAL_STATE_DICT folder without its layout",
            ));
        }
    }
    let mine = format::rank_file(model.mesh().rank());
    for t in doc.tensors.values_mut() {
        t.pieces.retain(|p| p.file == mine);
    }
    Ok(())
}

/// Model `m` from folder `dir`: every parameter's owned rows.
fn load_model(dir: &Path, doc: &FolderDoc, m: &mut Fsdp) -> Result<(), CheckpointError> {
    // A quantized weight's words read as another format's would be garbage of the same shape.
    for (name, t) in &doc.tensors {
        let ours = m.packing(name).map(super::format::PackingDoc::of);
        if t.packing != ours {
            let describe = |p: &Option<super::format::PackingDoc>| match p {
                Some(p) => format!("kept in {} (rows of {})", p.format, p.columns),
                None => "not quantized".to_string(),
            };
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                reason: format!(
                    "`{name}` is {} in the checkpoint and {} in the model",
                    describe(&t.packing),
                    describe(&ours)
                ),
            });
        }
    }
    let saved: BTreeMap<&str, (&str, &[usize])> = doc
        .tensors
        .iter()
        .map(|(n, t)| (n.as_str(), (t.dtype.as_str(), t.shape.as_slice())))
        .collect();
    let mut reader = TensorReader::new(dir, &doc.files);
    load_params(dir, &saved, m, &mut |name, rows, row_elems| {
        reader.read_rows(name, &doc.tensors[name], rows, row_elems)
    })
}

/// How a checkpoint's tensor's rows are read: (name, rows, elements per row) → f32 values.
pub(super) type ReadRows<'a> =
    dyn FnMut(&str, Range<usize>, usize) -> Result<Vec<f32>, CheckpointError> + 'a;

/// Every parameter of `m` from the tensors of `dir` (`saved`: name → dtype and shape), each
/// rank's owned rows read by `read`. A tensor one side lacks, or of another shape or dtype
/// than F32, is an error naming it.
pub(super) fn load_params(
    dir: &Path,
    saved: &BTreeMap<&str, (&str, &[usize])>,
    m: &mut Fsdp,
    read: &mut ReadRows,
) -> Result<(), CheckpointError> {
    for (name, shape) in check_params(dir, saved, m)? {
        let rows = m.owned_rows(&name)?;
        let row_elems: usize = shape.iter().skip(1).product();
        let values = read(&name, rows, row_elems)?;
        m.load_local_shard(&name, &values)?;
    }
    Ok(())
}

/// Checks that `saved` (name → dtype and shape) holds exactly `m`'s parameters, in F32 and
/// their shapes, changing nothing; returns the parameters with their shapes.
pub(super) fn check_params(
    dir: &Path,
    saved: &BTreeMap<&str, (&str, &[usize])>,
    m: &Fsdp,
) -> Result<BTreeMap<String, Vec<usize>>, CheckpointError> {
    let names: BTreeMap<String, Vec<usize>> = m
        .parameters()
        .into_iter()
        .map(|(n, s)| (n.to_string(), s.to_vec()))
        .collect();
    if let Some(extra) = saved.keys().find(|t| !names.contains_key(**t)) {
        return Err(CheckpointError::Mismatch {
            path: dir.to_path_buf(),
            reason: format!(
                "the checkpoint holds `{extra}`, which is not a parameter of the model"
            ),
        });
    }
    for (name, shape) in &names {
        let &(dtype, saved_shape) =
            saved
                .get(name.as_str())
                .ok_or_else(|| CheckpointError::Mismatch {
                    path: dir.to_path_buf(),
                    reason: format!("parameter `{name}` of the model is not in the checkpoint"),
                })?;
        if saved_shape != shape.as_slice() || dtype != "F32" {
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                reason: format!(
                    "`{name}` is {dtype} {saved_shape:?} in the checkpoint and F32 {shape:?} in the model"
                ),
            });
        }
    }
    Ok(names)
}

/// Optimizer state for model `m` from folder `dir`, by parameter and state name.
fn load_optimizer(
    dir: &Path,
    doc: &FolderDoc,
    m: &mut Fsdp,
    o: &mut dyn Optimizer,
) -> Result<(), CheckpointError> {
    let meta = doc.optimizer.as_ref().ok_or_else(|| {
        CheckpointError::corrupt(dir.join(format::METADATA_FILE), "no optimizer section")
    })?;
    if meta.name != o.name() {
        return Err(CheckpointError::Mismatch {
            path: dir.to_path_buf(),
            reason: format!(
                "the checkpoint holds {} state; the optimizer is {}",
                meta.name,
                o.name()
            ),
        });
    }
    let tensors: Vec<(String, Vec<usize>)> = doc
        .tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shape.clone()))
        .collect();
    let mut reader = TensorReader::new(dir, &doc.files);
    load_optimizer_state(dir, meta, &tensors, m, o, &mut |name, rows, row_elems| {
        reader.read_rows(name, &doc.tensors[name], rows, row_elems)
    })
}

/// The optimizer `o` of model `m` from what `dir` holds: `meta`'s groups (checked, then
/// their settings restored), rates and step counts, and the state tensors `tensors`
/// (`{parameter}.{state}` with their shapes), each rank's owned rows read by `read`.
pub(super) fn load_optimizer_state(
    dir: &Path,
    meta: &OptimizerDoc,
    tensors: &[(String, Vec<usize>)],
    m: &mut Fsdp,
    o: &mut dyn Optimizer,
    read: &mut ReadRows,
) -> Result<(), CheckpointError> {
    check_groups(dir, meta, m, o)?;
    super::groups::restore(dir, meta, o)?;
    m.begin_optimizer_load(o);
    let shapes: BTreeMap<String, Vec<usize>> = m
        .parameters()
        .into_iter()
        .map(|(n, s)| (n.to_string(), s.to_vec()))
        .collect();
    let mut states: BTreeMap<String, ParamState> = BTreeMap::new();
    for (tensor, saved_shape) in tensors {
        let param = tensor
            .rsplit_once('.')
            .map(|(p, _)| p)
            .filter(|p| shapes.contains_key(*p))
            .ok_or_else(|| CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                reason: format!(
                    "the checkpoint holds optimizer state `{tensor}` for no parameter of the model"
                ),
            })?;
        let key = &tensor[param.len() + 1..];
        let shape = &shapes[param];
        if saved_shape != shape {
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                reason: format!("`{tensor}` is {saved_shape:?}, the parameter {shape:?}"),
            });
        }
        let rows = m.owned_rows(param)?;
        let row_elems: usize = shape.iter().skip(1).product();
        let values = read(tensor, rows, row_elems)?;
        if !m.load_state_buffer_on_disk(param, key, &values)? {
            let state = states.entry(param.to_string()).or_default();
            state.buffers.insert(key.to_string(), values);
        }
    }
    if let Some(p) = meta.steps.keys().find(|p| !shapes.contains_key(p.as_str())) {
        return Err(CheckpointError::Mismatch {
            path: dir.to_path_buf(),
            reason: format!("the checkpoint counts steps of `{p}`, which is not a parameter"),
        });
    }
    if let Some(p) = states.keys().find(|p| !meta.steps.contains_key(*p)) {
        return Err(CheckpointError::corrupt(
            dir.join(format::METADATA_FILE),
            format!("state tensors of `{p}` but no step count"),
        ));
    }
    // Every parameter with a step count has state (SGD without momentum: the count alone).
    for (param, &step) in &meta.steps {
        let mut state = states.remove(param).unwrap_or_default();
        state.step = step;
        o.set_state(param, state)?;
        if m.load_state_step_on_disk(param, step) {
            // The state is in the disk tier: the optimizer only checked the group.
            o.take_state(param);
        }
    }
    for (g, &lr) in meta.lrs.iter().enumerate() {
        o.set_lr(g, lr)?;
    }
    Ok(())
}

/// Refuses `meta` for `o` when their groups differ in number or membership; changes nothing.
pub(super) fn check_groups(
    dir: &Path,
    meta: &OptimizerDoc,
    m: &Fsdp,
    o: &dyn Optimizer,
) -> Result<(), CheckpointError> {
    if meta.lrs.len() != o.num_groups() {
        return Err(CheckpointError::Mismatch {
            path: dir.to_path_buf(),
            reason: format!(
                "{} parameter group(s) in the checkpoint, {} in the optimizer",
                meta.lrs.len(),
                o.num_groups()
            ),
        });
    }
    super::groups::check(dir, meta, m, o)
}

/// Reads the checkpoint of ours at `path` into `models` and `optimizers` (this rank's part).
pub(super) fn read_all(
    path: &Path,
    models: &mut [&mut Fsdp],
    optimizers: &mut [&mut dyn Optimizer],
) -> Result<RunState, CheckpointError> {
    let root: PathBuf = format::checkpoint_root(path).ok_or_else(|| CheckpointError::Missing {
        path: path.join(format::CHECKPOINT_FILE),
        what: "the document of a complete checkpoint (a folder written by save_state)".into(),
    })?;
    let doc_path = root.join(format::CHECKPOINT_FILE);
    let doc: CheckpointDoc = read_document(&doc_path)?;
    if doc.models != models.len() || doc.optimizers != optimizers.len() {
        return Err(CheckpointError::Mismatch {
            path: root.clone(),
            reason: format!(
                "{} model(s) and {} optimizer(s) saved, {} and {} given to load into",
                doc.models,
                doc.optimizers,
                models.len(),
                optimizers.len()
            ),
        });
    }
    let local = doc.state_dict_type == "LOCAL_STATE_DICT";
    for (i, m) in models.iter_mut().enumerate() {
        let dir = root.join(format::model_folder(i));
        let mut folder = folder_doc(&dir, "model", &doc.state_dict_type)?;
        if local {
            local_only(&dir, &mut folder, m)?;
        }
        load_model(&dir, &folder, m)?;
    }
    for (i, o) in optimizers.iter_mut().enumerate() {
        let dir = root.join(format::optimizer_folder(i));
        let mut folder = folder_doc(&dir, "optimizer", &doc.state_dict_type)?;
        if local {
            local_only(&dir, &mut folder, models[i])?;
        }
        load_optimizer(&dir, &folder, &mut *models[i], &mut **o)?;
    }
    run_state(&doc_path, doc, models[0])
}

/// The run state the checkpoint document at `doc_path` records, with the schedulers' and
/// (at the world size that saved it) `model`'s rank's random state read from the documents
/// it lists.
pub(super) fn run_state(
    doc_path: &Path,
    doc: CheckpointDoc,
    model: &Fsdp,
) -> Result<RunState, CheckpointError> {
    let root = doc_path.parent().unwrap_or(Path::new("."));
    // From version 2 on, every document written as given is listed with its checksum.
    let listed = |name: String| -> Result<serde_json::Value, CheckpointError> {
        let crc = match doc.version {
            1 => None,
            _ => Some(*doc.documents.get(&name).ok_or_else(|| {
                CheckpointError::corrupt(
                    doc_path,
                    format!("`{name}` is not listed among the documents"),
                )
            })?),
        };
        read_listed(&root.join(&name), crc)
    };
    let schedulers = (0..doc.schedulers)
        .map(|i| listed(format::scheduler_file(i)))
        .collect::<Result<Vec<_>, _>>()?;
    let rank = model.mesh().rank();
    let random = if doc.world_size == model.mesh().world_size() {
        listed(format::random_states_file(rank))?
    } else {
        // Per-rank generators of another world size do not map onto this one's ranks.
        serde_json::Value::Null
    };
    Ok(RunState {
        step: doc.step,
        schedulers,
        random,
        data: doc.data,
        grad_scalers: doc.grad_scalers,
    })
}
