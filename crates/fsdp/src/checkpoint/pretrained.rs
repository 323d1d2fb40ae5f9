//! Full weights for sharing, as transformers' `save_pretrained` writes them: the parameters
//! gathered unit by unit onto rank 0 and streamed into `model.safetensors` — or, above a size
//! limit, into `model-0000i-of-0000n.safetensors` files with a `model.safetensors.index.json`
//! — beside the model's `config.json`, so `from_pretrained` loads them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::atomic;
use super::collect::agree;
use super::error::CheckpointError;
use super::tensor_file::{PlannedTensor, TensorFileWriter};
use crate::engine::Fsdp;

/// Files of one `save_pretrained`: tensors (in gathering order) assigned to files of at most
/// `max_bytes` each (a larger tensor gets a file of its own).
fn assign(names: &[(String, Vec<usize>)], max_bytes: u64) -> Vec<Vec<PlannedTensor>> {
    let mut files: Vec<Vec<PlannedTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for (name, shape) in names {
        let bytes = shape.iter().product::<usize>() as u64 * 4;
        if size > 0 && size + bytes > max_bytes {
            files.push(Vec::new());
            size = 0;
        }
        size += bytes;
        if let Some(last) = files.last_mut() {
            last.push(PlannedTensor {
                name: name.clone(),
                shape: shape.clone(),
            });
        }
    }
    files
}

/// Writes `model`'s full weights and `config` (the model's `config.json`) to `dir` on rank
/// 0 — collective: every rank calls it; rank 0 holds at most one unit beyond its shards.
/// Files above `max_shard_bytes` are split as transformers does. Written into a staging
/// folder beside `dir`, then each file moved into `dir`, replacing the file of its name;
/// other files in `dir` (a tokenizer, a README) stay, and weight files of an earlier save
/// that this one does not write are removed. Returns `dir`.
pub fn save_pretrained(
    model: &Fsdp,
    dir: &Path,
    config: &serde_json::Value,
    max_shard_bytes: u64,
) -> Result<PathBuf, CheckpointError> {
    save_pretrained_as(model, dir, config, max_shard_bytes, &mut WriteAsGathered)
}

/// Writes the next planned tensor, given as consecutive chunks of its values.
pub type WriteTensor<'a> = dyn FnMut(&[&[f32]]) -> Result<(), CheckpointError> + 'a;

/// What a save writes for each gathered parameter: zero or more of the planned tensors, in
/// the plan's order, through `write` (rank 0 only).
pub trait Emit {
    /// The names and shapes written, in order, for parameters `names` in gathering order.
    fn plan(&mut self, names: Vec<(String, Vec<usize>)>) -> Vec<(String, Vec<usize>)>;
    /// Parameter `name` arrived as `values` (its exported values).
    fn emit(
        &mut self,
        name: &str,
        values: &[&[f32]],
        write: &mut WriteTensor,
    ) -> Result<(), CheckpointError>;
}

/// Every parameter written as it is gathered.
struct WriteAsGathered;

impl Emit for WriteAsGathered {
    fn plan(&mut self, names: Vec<(String, Vec<usize>)>) -> Vec<(String, Vec<usize>)> {
        names
    }

    fn emit(
        &mut self,
        _: &str,
        values: &[&[f32]],
        write: &mut WriteTensor,
    ) -> Result<(), CheckpointError> {
        write(values)
    }
}

/// [`save_pretrained`] of the tensors `emit` makes of the gathered parameters (a LoRA
/// model's weights with its adapters merged in: [`crate::peft::MergingEmit`]).
pub fn save_pretrained_as(
    model: &Fsdp,
    dir: &Path,
    config: &serde_json::Value,
    max_shard_bytes: u64,
    emit: &mut dyn Emit,
) -> Result<PathBuf, CheckpointError> {
    // A quantized weight is written as the f32 weight it stands for.
    let names: Vec<(String, Vec<usize>)> = emit.plan(
        model
            .exported_parameters()
            .into_iter()
            .map(|(n, s)| (n.to_string(), s))
            .collect(),
    );
    let files = assign(&names, max_shard_bytes.max(1));
    let n = files.len();
    let file_name = |i: usize| {
        if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        }
    };
    let documents = |staging: &Path| write_documents(staging, config, &files, &file_name);
    save_selected(model, dir, &files, &file_name, &|_| true, &documents, emit)
}

/// Saves the parameters `keep` selects as PEFT saves an adapter: one
/// `adapter_model.safetensors` whose tensors are named by `saved_name`, and
/// `adapter_config.json`, put in place atomically in `dir` as [`save_pretrained`] does
/// (collective; rank 0 writes).
pub fn save_adapter(
    model: &Fsdp,
    dir: &Path,
    adapter_config: &serde_json::Value,
    keep: &dyn Fn(&str) -> bool,
    saved_name: &dyn Fn(&str) -> String,
) -> Result<PathBuf, CheckpointError> {
    let plan: Vec<PlannedTensor> = model
        .parameters()
        .into_iter()
        .filter(|(n, _)| keep(n))
        .map(|(n, s)| PlannedTensor {
            name: saved_name(n),
            shape: s.to_vec(),
        })
        .collect();
    let files = [plan];
    let file_name = |_| "adapter_model.safetensors".to_string();
    let documents = |staging: &Path| {
        let text = serde_json::to_string_pretty(adapter_config)
            .map_err(|e| CheckpointError::json("adapter_config.json", e))?;
        atomic::write_synced(&staging.join("adapter_config.json"), text.as_bytes()).map(|_| ())
    };
    let emit = &mut WriteAsGathered;
    save_selected(model, dir, &files, &file_name, keep, &documents, emit)
}

/// Streams the parameters `keep` selects, in gathering order, through `emit` into `files`
/// (named by `file_name`) in a staging folder beside `dir`, adds `documents`, and moves it
/// into `dir`.
fn save_selected(
    model: &Fsdp,
    dir: &Path,
    files: &[Vec<PlannedTensor>],
    file_name: &dyn Fn(usize) -> String,
    keep: &dyn Fn(&str) -> bool,
    documents: &dyn Fn(&Path) -> Result<(), CheckpointError>,
    emit: &mut dyn Emit,
) -> Result<PathBuf, CheckpointError> {
    let first = model.mesh().rank() == 0;
    // Rank 0 stages the files beside `dir` (the others only send it their rows).
    let prepared = if first {
        let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
        parent
            .map_or(Ok(()), |p| {
                std::fs::create_dir_all(p).map_err(|e| CheckpointError::io("creating", p, e))
            })
            .and_then(|()| atomic::remove_stale(dir))
            .and_then(|()| atomic::Staging::create(dir))
            .map(Some)
    } else {
        Ok(None)
    };
    let mut held = agree(model.mesh(), prepared)?;
    let staging = held
        .as_ref()
        .map_or_else(PathBuf::new, |s| s.path().to_path_buf());
    // Rank 0 streams the tensors, in gathering order, file after file.
    let mut current: Option<(usize, TensorFileWriter)> = None;
    let mut next_file = 0usize;
    let mut left_in_file = 0usize;
    let mut failed: Option<CheckpointError> = None;
    let mut write = |chunks: &[&[f32]]| -> Result<(), CheckpointError> {
        if left_in_file == 0 {
            if let Some((_, w)) = current.take() {
                w.finish()?;
            }
            let plan = files[next_file].clone();
            left_in_file = plan.len();
            current = Some((
                next_file,
                TensorFileWriter::create(&staging.join(file_name(next_file)), plan)?,
            ));
            next_file += 1;
        }
        left_in_file -= 1;
        match current.as_mut() {
            Some((_, w)) => w.write_chunks(chunks),
            None => Ok(()),
        }
    };
    model.gather_rows_to_first(
        &|name, _| match keep(name) {
            true => model.local_values_of(name).map(Some),
            false => Ok(None),
        },
        &mut |name, chunks| {
            if first && failed.is_none() {
                let written = match model.packing(name) {
                    None => emit.emit(name, chunks, &mut write),
                    Some(_) => match model.exported_values(name, chunks) {
                        Ok(values) => emit.emit(name, &[&values], &mut write),
                        Err(e) => Err(CheckpointError::Engine(Box::new(e))),
                    },
                };
                failed = written.err();
            }
            Ok(())
        },
    )?;
    let finished = match (failed, current) {
        (Some(e), _) => Err(e),
        (None, Some((_, w))) => w.finish().map(|_| ()),
        (None, None) => Ok(()),
    };
    // On rank 0 the staging folder goes when `held` is dropped, published or not.
    let published = match held.as_mut() {
        Some(held) => finished
            .and_then(|()| documents(&staging))
            .and_then(|()| atomic::sync_dir(&staging))
            .and_then(|()| atomic::publish_into(held, dir)),
        None => Ok(()),
    };
    agree(model.mesh(), published)?;
    Ok(dir.to_path_buf())
}

/// `config.json`, and the index when the weights span several files.
fn write_documents(
    staging: &Path,
    config: &serde_json::Value,
    files: &[Vec<PlannedTensor>],
    file_name: &dyn Fn(usize) -> String,
) -> Result<(), CheckpointError> {
    let text =
        serde_json::to_vec_pretty(config).map_err(|e| CheckpointError::json("config.json", e))?;
    atomic::write_synced(&staging.join("config.json"), &text)?;
    if files.len() > 1 {
        let mut weight_map = BTreeMap::new();
        let mut total = 0u64;
        for (i, plan) in files.iter().enumerate() {
            for t in plan {
                total += t.shape.iter().product::<usize>() as u64 * 4;
                weight_map.insert(t.name.clone(), file_name(i));
            }
        }
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let text =
            serde_json::to_vec_pretty(&index).map_err(|e| CheckpointError::json("index", e))?;
        atomic::write_synced(&staging.join("model.safetensors.index.json"), &text)?;
    }
    Ok(())
}
