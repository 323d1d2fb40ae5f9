//! Merging a checkpoint's model into one `model.safetensors` with Hugging Face names — from
//! a checkpoint `save_state` wrote, or from a PyTorch distributed checkpoint (what
//! Accelerate's SHARDED_STATE_DICT writes). Tensors are read one at a time, when the writer
//! reaches them (every checksum verified), so memory stays at the largest tensor; the file
//! is written by the `safetensors` crate, byte for byte what Python's `safetensors` (and so
//! `accelerate merge-weights`) writes for the same tensors.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, View};

use super::dcp;
use super::error::CheckpointError;
use super::format::{self, FolderDoc, read_document};
use super::tensor_file::{TensorReader, f32_bytes};

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

/// A tensor whose bytes are read when the writer asks for them.
struct Lazy<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    load: Box<dyn Fn() -> Result<Vec<u8>, CheckpointError> + 'a>,
    failed: &'a RefCell<Option<CheckpointError>>,
}

impl View for &Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match (self.load)() {
            Ok(bytes) if bytes.len() == self.len => Cow::Owned(bytes),
            // The merge fails and its partial file is removed: nothing needs writing.
            Ok(_) => {
                self.fail(CheckpointError::Internal {
                    what: "a tensor of the wrong size".into(),
                });
                Cow::Borrowed(&[])
            }
            Err(e) => {
                self.fail(e);
                Cow::Borrowed(&[])
            }
        }
    }

    fn data_len(&self) -> usize {
        self.len
    }
}

impl Lazy<'_> {
    fn fail(&self, e: CheckpointError) {
        self.failed.borrow_mut().get_or_insert(e);
    }
}

/// What `src` is: a distributed checkpoint folder, or our model folder.
enum Source {
    Dcp(PathBuf),
    Ours(PathBuf),
}

/// The model folder to merge: `path` itself, or `path/pytorch_model_fsdp_0` (a checkpoint's
/// root, as users often give).
fn source(path: &Path) -> Result<Source, CheckpointError> {
    for dir in [path.to_path_buf(), path.join(format::model_folder(0))] {
        if dir.join(dcp::METADATA).is_file() {
            return Ok(Source::Dcp(dir));
        }
        if dir.join(format::METADATA_FILE).is_file() {
            return Ok(Source::Ours(dir));
        }
    }
    Err(CheckpointError::Missing {
        path: path.join(format::model_folder(0)),
        what: format!(
            "{} is neither a checkpoint (with {}) nor its model folder (with {} or {})",
            path.display(),
            format::model_folder(0),
            format::METADATA_FILE,
            dcp::METADATA
        ),
    })
}

/// Merges the model of checkpoint `src` (its root or the model folder itself; ours or a
/// PyTorch distributed checkpoint) into `out_dir/model.safetensors`, written under a
/// temporary name and renamed into place.
pub fn merge_weights(src: &Path, out_dir: &Path) -> Result<MergeReport, CheckpointError> {
    // Declared before the views that borrow them, so they outlive the views.
    let ours_doc;
    let reader;
    let checkpoint;
    let failed = RefCell::new(None);
    let mut tensors: Vec<(String, Lazy)> = Vec::new();
    match source(src)? {
        Source::Ours(dir) => {
            let meta_path = dir.join(format::METADATA_FILE);
            let mut doc: FolderDoc = read_document(&meta_path)?;
            if doc.kind != "model" {
                return Err(CheckpointError::corrupt(
                    &meta_path,
                    format!("a {} folder, not a model folder", doc.kind),
                ));
            }
            doc.validate(&meta_path, doc.state_dict_type == "LOCAL_STATE_DICT")?;
            // Local shards repeat the rows every rank holds: keep one copy of each row range.
            for t in doc.tensors.values_mut() {
                let mut seen = std::collections::HashSet::new();
                t.pieces.retain(|p| seen.insert(p.rows));
            }
            ours_doc = doc;
            // Every file's real size checked before the output's header declares any tensor.
            let mut checked = TensorReader::new(&dir, &ours_doc.files);
            checked.check_files()?;
            reader = RefCell::new(checked);
            for (name, t) in &ours_doc.tensors {
                let rows = t.shape.first().copied().unwrap_or(1);
                let row_elems: usize = t.shape.iter().skip(1).product();
                // A quantized weight is written as the f32 weight it stands for.
                let packing = match &t.packing {
                    Some(p) => Some(p.packing(&meta_path, name)?),
                    None => None,
                };
                let shape = match packing {
                    Some(p) => vec![rows, p.cols],
                    None => t.shape.clone(),
                };
                let reader = &reader;
                let path = meta_path.clone();
                let load = move || {
                    let values = reader.borrow_mut().read_rows(name, t, 0..rows, row_elems)?;
                    let values = match packing {
                        Some(p) => p.dequantize(&values).map_err(|e| {
                            CheckpointError::corrupt(&path, format!("`{name}`: {e}"))
                        })?,
                        None => values,
                    };
                    Ok(f32_bytes(&values).to_vec())
                };
                tensors.push((
                    name.clone(),
                    Lazy {
                        dtype: Dtype::F32,
                        len: shape.iter().product::<usize>() * 4,
                        shape,
                        load: Box::new(load),
                        failed: &failed,
                    },
                ));
            }
        }
        Source::Dcp(dir) => {
            checkpoint = dcp::open(&dir)?;
            if let Some(name) = checkpoint.values.keys().next() {
                return Err(CheckpointError::corrupt(
                    dir.join(dcp::METADATA),
                    format!("`{name}` is not a tensor: a model folder holds tensors only"),
                ));
            }
            for (name, t) in &checkpoint.tensors {
                let c = &checkpoint;
                tensors.push((
                    name.clone(),
                    Lazy {
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                        len: t.shape.iter().product::<usize>() * t.size,
                        load: Box::new(move || c.read(name, t)),
                        failed: &failed,
                    },
                ));
            }
        }
    }
    std::fs::create_dir_all(out_dir).map_err(|e| CheckpointError::io("creating", out_dir, e))?;
    let output = out_dir.join(format::FULL_MODEL_FILE);
    let partial = out_dir.join(format!(".{}.partial", format::FULL_MODEL_FILE));
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let count = tensors.len();
    let views = tensors.iter().map(|(n, t)| (n.as_str(), t));
    let written = safetensors::serialize_to_file(views, Some(metadata), &partial);
    drop(tensors);
    if let Some(e) = failed.borrow_mut().take() {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    written.map_err(|e| CheckpointError::corrupt(&partial, e.to_string()))?;
    // A merged model is for others to load: not the 0600 of the temporary file it went through.
    super::files::make_shareable(&partial)?;
    std::fs::rename(&partial, &output).map_err(|e| CheckpointError::io("renaming", &partial, e))?;
    super::atomic::sync_dir(out_dir)?;
    let bytes = std::fs::metadata(&output)
        .map_err(|e| CheckpointError::io("reading", &output, e))?
        .len();
    Ok(MergeReport {
        output,
        tensors: count,
        bytes,
    })
}
