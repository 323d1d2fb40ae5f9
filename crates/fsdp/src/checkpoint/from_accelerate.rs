//! Resuming what Accelerate's `save_state` wrote with SHARDED_STATE_DICT (FSDP1 or FSDP2):
//! `pytorch_model_fsdp_{i}/` and `optimizer_{i}/` are PyTorch distributed checkpoints of the
//! model's state dict and of `FSDP.optim_state_dict` (state by parameter name, the groups'
//! settings and members as values). Each rank takes the rows it owns, at any world size and
//! strategy; the groups are checked and their settings restored as for our own checkpoints.
//! Read through the restricted pickle reader only (nothing is executed).

use std::collections::BTreeMap;
use std::path::Path;

use super::dcp::{self, DcpCheckpoint, Value};
use super::error::CheckpointError;
use super::format::{CheckpointDoc, GroupDoc, OptimizerDoc};
use super::load::{check_groups, check_params, load_optimizer_state, load_params};
use super::save_dcp::scheduler_bin;
use super::{RunState, format};
use crate::engine::Fsdp;
use crate::optim::Optimizer;

/// Accelerate's folder of model `i`.
fn model_folder(i: usize) -> String {
    format!("pytorch_model_fsdp_{i}")
}

/// Whether `root` holds a checkpoint Accelerate wrote with SHARDED_STATE_DICT (and none of
/// ours).
pub(crate) fn is_accelerate_checkpoint(root: &Path) -> bool {
    root.join(model_folder(0)).join(dcp::METADATA).is_file()
        && !root.join(format::CHECKPOINT_FILE).exists()
}

/// A DCP tensor's rows `rows` as f32 (F32 tensors only; `load_params` refuses the others,
/// and `check_params` made the shapes agree).
fn rows_of(
    ckpt: &DcpCheckpoint,
    name: &str,
    rows: std::ops::Range<usize>,
) -> Result<Vec<f32>, CheckpointError> {
    Ok(ckpt
        .read_rows(name, &ckpt.tensors[name], rows)?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Each tensor's dtype and shape, as `check_params` takes them.
fn saved_of(ckpt: &DcpCheckpoint) -> BTreeMap<&str, (&'static str, &[usize])> {
    ckpt.tensors
        .iter()
        .map(|(n, t)| (n.as_str(), (dtype_name(t), t.shape.as_slice())))
        .collect()
}

fn dtype_name(t: &dcp::DcpTensor) -> &'static str {
    match t.dtype {
        safetensors::Dtype::F32 => "F32",
        safetensors::Dtype::F64 => "F64",
        safetensors::Dtype::BF16 => "BF16",
        safetensors::Dtype::F16 => "F16",
        _ => "a non-float dtype",
    }
}

/// Loads Accelerate's checkpoint at `root` into `models` and `optimizers` (this rank's part;
/// collective agreement is the caller's). The run state carries the optimizers' step count
/// (Accelerate's own `step` counts something else); schedulers, random state and data
/// position are Accelerate's pickles and are not read.
pub(crate) fn read_all(
    root: &Path,
    models: &mut [&mut Fsdp],
    optimizers: &mut [&mut dyn Optimizer],
) -> Result<RunState, CheckpointError> {
    let saved_models = (0..)
        .take_while(|i| root.join(model_folder(*i)).is_dir())
        .count();
    let saved_optimizers = (0..)
        .take_while(|i| root.join(format::optimizer_folder(*i)).is_dir())
        .count();
    if saved_models != models.len() || saved_optimizers != optimizers.len() {
        return Err(CheckpointError::Mismatch {
            path: root.to_path_buf(),
            reason: format!(
                "Accelerate saved {saved_models} model(s) and {saved_optimizers} optimizer(s); {} and {} given to load into",
                models.len(),
                optimizers.len()
            ),
        });
    }
    // fsdp-rs wrote it (torch-dcp): the run state is ours, exact; else PyTorch's schedulers.
    let run_doc = root.join(format::RUN_STATE_FILE);
    let ours: Option<CheckpointDoc> = match run_doc.is_file() {
        true => Some(format::read_document(&run_doc)?),
        false => None,
    };
    let schedulers = match &ours {
        Some(_) => Vec::new(),
        None => pytorch_schedulers(root, optimizers.len())?,
    };
    // Everything checked before anything is loaded: a mismatch leaves the models and
    // optimizers as they were.
    let mut saved_models = Vec::new();
    for (i, m) in models.iter().enumerate() {
        let dir = root.join(model_folder(i));
        let ckpt = dcp::open(&dir)?;
        if let Some(name) = ckpt.values.keys().next() {
            return Err(CheckpointError::corrupt(
                dir.join(dcp::METADATA),
                format!("`{name}` is not a tensor: a model folder holds tensors only"),
            ));
        }
        check_params(&dir, &saved_of(&ckpt), m)?;
        saved_models.push((dir, ckpt));
    }
    let mut saved_optimizers = Vec::new();
    for (i, o) in optimizers.iter().enumerate() {
        let dir = root.join(format::optimizer_folder(i));
        let ckpt = dcp::open(&dir)?;
        let (meta, tensors) = optimizer_doc(&dir, &ckpt, models[i], &**o)?;
        check_groups(&dir, &meta, models[i], &**o)?;
        saved_optimizers.push((dir, ckpt, meta, tensors));
    }
    for ((dir, ckpt), m) in saved_models.iter().zip(models.iter_mut()) {
        load_params(dir, &saved_of(ckpt), m, &mut |name, rows, _| {
            rows_of(ckpt, name, rows)
        })?;
    }
    let mut step = 0;
    for (i, (dir, ckpt, meta, tensors)) in saved_optimizers.iter().enumerate() {
        step = step.max(meta.steps.values().copied().max().unwrap_or(0));
        load_optimizer_state(
            dir,
            meta,
            tensors,
            models[i],
            &mut *optimizers[i],
            &mut |name, rows, _| rows_of(ckpt, &format!("optimizer.state.{name}"), rows),
        )?;
    }
    match ours {
        Some(doc) => super::load::run_state(&run_doc, doc, models[0]),
        None => Ok(RunState {
            step,
            schedulers,
            ..Default::default()
        }),
    }
}

/// The key of a scheduler's state read from PyTorch (a `LambdaLR`'s `last_epoch` and
/// `base_lrs`): the schedule itself is code, so the scheduler given to load into keeps its
/// schedule and takes the step.
pub(crate) const PYTORCH_SCHEDULER: &str = "pytorch_lr_scheduler";

/// Each optimizer's scheduler state from Accelerate's `scheduler.bin` / `scheduler_{i}.bin`
/// (`Null` for one without; empty when there are none).
fn pytorch_schedulers(
    root: &Path,
    optimizers: usize,
) -> Result<Vec<serde_json::Value>, CheckpointError> {
    if let Some(extra) = (optimizers..optimizers + 8)
        .map(scheduler_bin)
        .find(|f| root.join(f).exists())
    {
        return Err(CheckpointError::Mismatch {
            path: root.join(extra),
            reason: format!(
                "a scheduler beyond the {optimizers} optimizer(s) given to load into (a scheduler here belongs to the optimizer of its number)"
            ),
        });
    }
    let mut found = Vec::new();
    for i in 0..optimizers {
        let path = root.join(scheduler_bin(i));
        if !path.exists() {
            found.push(serde_json::Value::Null);
            continue;
        }
        let state = dcp::read_saved_value(&path)?;
        let bad = |what: &str| CheckpointError::corrupt(&path, format!("a scheduler state {what}"));
        let last_epoch = match state.get("last_epoch") {
            Some(Value::Int(i)) if *i >= 0 => *i as u64,
            _ => return Err(bad("without a last_epoch count")),
        };
        let base_lrs: Option<Vec<f64>> = match state.get("base_lrs") {
            Some(Value::List(l)) => l
                .iter()
                .map(|v| match v {
                    Value::Float(f) => Some(*f),
                    Value::Int(i) => Some(*i as f64),
                    _ => None,
                })
                .collect(),
            _ => None,
        };
        let base_lrs = base_lrs.ok_or_else(|| bad("without base_lrs"))?;
        found.push(serde_json::json!({ PYTORCH_SCHEDULER: {
            "file": path,
            "last_epoch": last_epoch,
            "base_lrs": base_lrs,
        }}));
    }
    if found.iter().all(serde_json::Value::is_null) {
        found.clear();
    }
    Ok(found)
}

/// An optimizer's state tensors (`{parameter}.{state}`) with their shapes.
type StateTensors = Vec<(String, Vec<usize>)>;

/// PyTorch's `param_groups` settings that change the update and that no optimizer here
/// implements: refused when on.
const UNSUPPORTED_FLAGS: [&str; 2] = ["amsgrad", "maximize"];

/// The optimizer record of an `FSDP.optim_state_dict` checkpoint in our terms (groups with
/// their members in the model's order and their settings, rates, per-parameter steps), and
/// its state tensors (`{parameter}.{state}`, without the step counts).
fn optimizer_doc(
    dir: &Path,
    ckpt: &DcpCheckpoint,
    model: &Fsdp,
    o: &dyn Optimizer,
) -> Result<(OptimizerDoc, StateTensors), CheckpointError> {
    let meta_path = dir.join(dcp::METADATA);
    let bad = |what: String| CheckpointError::corrupt(&meta_path, what);
    let mut settings: BTreeMap<usize, serde_json::Map<String, serde_json::Value>> = BTreeMap::new();
    let mut members: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for name in ckpt.values.keys() {
        let rest = name
            .strip_prefix("optimizer.param_groups.")
            .ok_or_else(|| {
                bad(format!(
                    "`{name}`: a value outside the optimizer's param_groups"
                ))
            })?;
        let (g, key) = rest
            .split_once('.')
            .and_then(|(g, k)| Some((g.parse::<usize>().ok()?, k)))
            .ok_or_else(|| bad(format!("`{name}`: not param_groups.<n>.<setting>")))?;
        let value = ckpt.read_value(name)?;
        if key == "params" {
            let Value::List(list) = &value else {
                return Err(bad(format!("`{name}` is not a list of parameter names")));
            };
            let names: Option<Vec<String>> =
                list.iter().map(|v| v.str().map(str::to_string)).collect();
            members.insert(
                g,
                names.ok_or_else(|| bad(format!("`{name}` is not a list of parameter names")))?,
            );
            continue;
        }
        if UNSUPPORTED_FLAGS.contains(&key) && value == Value::Bool(true) {
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                reason: format!(
                    "parameter group {g} has `{key}` on, which no optimizer here implements"
                ),
            });
        }
        settings
            .entry(g)
            .or_default()
            .insert(key.to_string(), json_of(&value));
    }
    let groups = settings.len().max(members.len());
    if (0..groups).any(|g| !settings.contains_key(&g) || !members.contains_key(&g)) {
        return Err(bad(format!(
            "param_groups 0..{groups} are not each listed with settings and parameters"
        )));
    }
    // PyTorch's Adam with decoupled weight decay is AdamW; SGD says nothing of it.
    let decoupled = settings[&0].get("decoupled_weight_decay");
    let saved_name = match (decoupled, settings[&0].contains_key("betas")) {
        (Some(serde_json::Value::Bool(true)), _) => "AdamW",
        (_, true) => "Adam",
        _ => "SGD",
    };
    if saved_name != o.name() {
        return Err(CheckpointError::Mismatch {
            path: dir.to_path_buf(),
            reason: format!(
                "the checkpoint holds {saved_name} state; the optimizer is {}",
                o.name()
            ),
        });
    }
    let order: BTreeMap<&str, usize> = model
        .parameters()
        .into_iter()
        .enumerate()
        .map(|(i, (n, _))| (n, i))
        .collect();
    let groups: Vec<GroupDoc> = (0..groups)
        .map(|g| {
            let mut params = members[&g].clone();
            // Membership is what PyTorch checks; we list members in the model's order.
            params.sort_by_key(|p| order.get(p.as_str()).copied().unwrap_or(usize::MAX));
            GroupDoc {
                params,
                settings: serde_json::Value::Object(settings[&g].clone()),
            }
        })
        .collect();
    let lrs = groups
        .iter()
        .enumerate()
        .map(|(g, d)| {
            d.settings["lr"]
                .as_f64()
                .ok_or_else(|| bad(format!("param_groups.{g}.lr is not a number")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut steps = BTreeMap::new();
    let mut tensors = Vec::new();
    for (name, t) in &ckpt.tensors {
        let rest = name
            .strip_prefix("optimizer.state.")
            .ok_or_else(|| bad(format!("`{name}`: a tensor outside the optimizer's state")))?;
        match rest.strip_suffix(".step") {
            Some(param) => {
                let value = rows_of(ckpt, name, 0..1)?;
                let step = value.first().copied().unwrap_or(f32::NAN);
                if !(step >= 0.0 && step.fract() == 0.0) {
                    return Err(bad(format!("`{name}` is {step}, not a step count")));
                }
                steps.insert(param.to_string(), step as u64);
            }
            None => tensors.push((rest.to_string(), t.shape.clone())),
        }
    }
    let meta = OptimizerDoc {
        name: saved_name.into(),
        lrs,
        steps,
        groups,
    };
    Ok((meta, tensors))
}

/// A plain Python value as JSON (tuples as arrays; other values as `null`).
fn json_of(v: &Value) -> serde_json::Value {
    match v {
        Value::Bool(b) => (*b).into(),
        Value::Int(i) => (*i).into(),
        Value::Float(f) => (*f).into(),
        Value::Str(s) => s.clone().into(),
        Value::Tuple(items) | Value::List(items) => items.iter().map(json_of).collect(),
        _ => serde_json::Value::Null,
    }
}
