//! Merging a checkpoint's model folder into one `model.safetensors` with Hugging Face names:
//! one tensor at a time (every piece's checksum verified), so memory stays at the largest
//! tensor whatever the model's size.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::error::CheckpointError;
use super::format::{self, FolderDoc, check_version, read_json};
use super::tensor_file::{PlannedTensor, TensorFileWriter, TensorReader};

/// What a merge wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeReport {
    /// The file written.
    pub output: PathBuf,
    /// Tensors in it.
    pub tensors: usize,
    /// Its size in bytes.
    pub bytes: u64,
}

/// The model folder to merge: `path` itself when it holds a model folder's metadata, else
/// `path/pytorch_model_fsdp_0` (a checkpoint's root).
fn model_dir(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(format::METADATA_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let inner = path.join(format::model_folder(0));
    if inner.join(format::METADATA_FILE).is_file() {
        return Ok(inner);
    }
    Err(CheckpointError::Missing {
        path: inner.join(format::METADATA_FILE),
        what: format!(
            "{} is neither a checkpoint (with {}) nor its model folder",
            path.display(),
            format::model_folder(0)
        ),
    })
}

/// Merges the model folder of checkpoint `src` (its root or the model folder itself) into
/// `out_dir/model.safetensors`, written atomically (a temporary file renamed into place).
pub fn merge_weights(src: &Path, out_dir: &Path) -> Result<MergeReport, CheckpointError> {
    let dir = model_dir(src)?;
    let meta_path = dir.join(format::METADATA_FILE);
    let mut doc: FolderDoc = read_json(&meta_path)?;
    check_version(&meta_path, &doc.format, doc.version)?;
    if doc.kind != "model" {
        return Err(CheckpointError::corrupt(
            &meta_path,
            format!("a {} folder, not a model folder", doc.kind),
        ));
    }
    // Local shards repeat the rows every rank holds: keep one copy of each row range.
    for t in doc.tensors.values_mut() {
        let mut seen = std::collections::HashSet::new();
        t.pieces.retain(|p| seen.insert(p.rows));
    }
    std::fs::create_dir_all(out_dir).map_err(|e| CheckpointError::io("creating", out_dir, e))?;
    let output = out_dir.join(format::FULL_MODEL_FILE);
    let partial = out_dir.join(format!(".{}.partial", format::FULL_MODEL_FILE));
    let tensors: BTreeMap<&String, _> = doc.tensors.iter().collect();
    let plan = tensors
        .iter()
        .map(|(name, t)| PlannedTensor {
            name: (*name).clone(),
            shape: t.shape.clone(),
        })
        .collect();
    let mut writer = TensorFileWriter::create(&partial, plan)?;
    let mut reader = TensorReader::new(&dir, &doc.files);
    for (name, t) in &tensors {
        let rows = t.shape.first().copied().unwrap_or(1);
        let row_elems: usize = t.shape.iter().skip(1).product();
        let values = reader.read_rows(name, t, 0..rows, row_elems)?;
        writer.write_next(&values)?;
    }
    let written = writer.finish()?;
    std::fs::rename(&partial, &output).map_err(|e| CheckpointError::io("renaming", &partial, e))?;
    super::atomic::sync_dir(out_dir)?;
    Ok(MergeReport {
        output,
        tensors: tensors.len(),
        bytes: written.bytes,
    })
}
