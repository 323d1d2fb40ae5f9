//! The on-disk format (version 2, specified in `docs/CHECKPOINT_FORMAT.md`): the names of a
//! checkpoint's files and folders, the JSON documents that describe them, their checksums,
//! and the checks a document passes before anything it declares is opened or allocated.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::error::CheckpointError;
use super::files::{plain_name, read_bounded};

/// The `format` field of every metadata document.
pub const FORMAT: &str = "fsdp-rs-checkpoint";
/// The version this build writes.
pub const VERSION: u32 = 2;
/// The oldest version this build reads (version 1 documents carry no checksums).
pub const OLDEST_VERSION: u32 = 1;
/// The largest JSON document read (a model of a million tensors fits).
pub const DOCUMENT_LIMIT: u64 = 256 << 20;
/// The field of a version-2 document holding the CRC-32 of the rest of it.
const CHECKSUM_FIELD: &str = "crc32";
/// The document whose presence makes a folder a complete checkpoint (written last).
pub const CHECKPOINT_FILE: &str = "fsdp_checkpoint.json";
/// The same document in a PyTorch distributed checkpoint we wrote (`torch-dcp`; a
/// `fsdp_checkpoint.json` would make it a checkpoint of our format).
pub const RUN_STATE_FILE: &str = "fsdp_run_state.json";

/// The document that makes `checkpoint` a complete checkpoint of ours, in our format or
/// PyTorch's, when it has one.
pub fn run_document(checkpoint: &Path) -> Option<PathBuf> {
    [CHECKPOINT_FILE, RUN_STATE_FILE]
        .into_iter()
        .map(|f| checkpoint.join(f))
        .find(|d| d.is_file())
}
/// A model or optimizer folder's description of its tensors.
pub const METADATA_FILE: &str = "metadata.json";

/// `pytorch_model_fsdp_{i}`, as Accelerate names a model's folder.
pub fn model_folder(i: usize) -> String {
    format!("pytorch_model_fsdp_{i}")
}

/// `optimizer_{i}`.
pub fn optimizer_folder(i: usize) -> String {
    format!("optimizer_{i}")
}

/// `scheduler_{i}.json`.
pub fn scheduler_file(i: usize) -> String {
    format!("scheduler_{i}.json")
}

/// `random_states_{rank}.json`.
pub fn random_states_file(rank: usize) -> String {
    format!("random_states_{rank}.json")
}

/// The tensor file rank `rank` writes in a folder.
pub fn rank_file(rank: usize) -> String {
    format!("rank_{rank}.safetensors")
}

/// The single file of a full (consolidated) state dict.
pub const FULL_MODEL_FILE: &str = "model.safetensors";
/// The single file of a full optimizer state dict.
pub const FULL_OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// What a checkpoint holds, written last: its presence means the checkpoint is complete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointDoc {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// `SHARDED_STATE_DICT`, `FULL_STATE_DICT` or `LOCAL_STATE_DICT`.
    pub state_dict_type: String,
    /// Ranks of the job that saved it.
    pub world_size: usize,
    /// Models saved (`pytorch_model_fsdp_{i}`).
    pub models: usize,
    /// Optimizers saved (`optimizer_{i}`, optimizer i of model i).
    pub optimizers: usize,
    /// Schedulers saved (`scheduler_{i}.json`).
    pub schedulers: usize,
    /// The training step the state belongs to.
    pub step: u64,
    /// Free-form position of the data pipeline (sampler epoch and index), as given.
    pub data: serde_json::Value,
    /// Each model's fp16 loss-scaler state, as given (absent when no model has one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grad_scalers: Vec<serde_json::Value>,
    /// Version 2: the CRC-32 of each document written as given (`scheduler_{i}.json`,
    /// `random_states_{rank}.json`), by file name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub documents: BTreeMap<String, u32>,
    /// Every other file of the checkpoint (by its path inside it, `/`-separated) with its
    /// size and the CRC-32 of its bytes: what proves a folder holds nothing but what a save
    /// wrote before it is replaced or removed. Absent in checkpoints of earlier builds, which
    /// are therefore never removed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, FileSum>,
}

/// A written file's size and the CRC-32 (IEEE) of its bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC-32 of all its bytes.
    pub crc32: u32,
}

impl FileSum {
    /// The sum of `bytes`.
    pub fn of(bytes: &[u8]) -> FileSum {
        FileSum {
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(bytes),
        }
    }
}

/// A model or optimizer folder's `metadata.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FolderDoc {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// `model` or `optimizer`.
    pub kind: String,
    /// How the tensors were cut (see [`CheckpointDoc::state_dict_type`]).
    pub state_dict_type: String,
    /// Every tensor: its full shape and dtype, and which files hold which rows.
    pub tensors: BTreeMap<String, TensorDoc>,
    /// Every file with its size and the checksum of its header.
    pub files: BTreeMap<String, FileDoc>,
    /// Optimizer folders: the optimizer and each parameter's update count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerDoc>,
    /// `LOCAL_STATE_DICT` folders: the layout the shards were cut for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<LayoutDoc>,
}

/// One tensor of a folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorDoc {
    /// The full shape.
    pub shape: Vec<usize>,
    /// The element type (`F32`).
    pub dtype: String,
    /// Row ranges of dim 0 and where they are, covering every row once.
    pub pieces: Vec<PieceDoc>,
    /// A quantized weight (QLoRA's base): its rows are the 32-bit words of blocks in this
    /// format, standing for rows of `columns` values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packing: Option<PackingDoc>,
}

/// How a quantized weight's words stand for its values ([`crate::nn::quant::Packing`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackingDoc {
    /// The block format (`NF4`, `Q4_1`, ...).
    pub format: String,
    /// Values per row.
    pub columns: usize,
}

impl PackingDoc {
    /// The document of `p`.
    pub fn of(p: crate::nn::quant::Packing) -> PackingDoc {
        PackingDoc {
            format: p.format.to_string(),
            columns: p.cols,
        }
    }

    /// The packing it describes; an error naming `path` and `name` for a format this build
    /// does not know or rows that are not whole blocks.
    pub fn packing(
        &self,
        path: &Path,
        name: &str,
    ) -> Result<crate::nn::quant::Packing, CheckpointError> {
        let bad = |e: crate::nn::quant::QuantError| {
            CheckpointError::corrupt(path, format!("`{name}`: {e}"))
        };
        let format = crate::nn::quant::QuantFormat::parse(&self.format).map_err(bad)?;
        crate::nn::quant::Packing::new(name, format, self.columns).map_err(bad)
    }
}

/// Some rows of a tensor, stored contiguously in one file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PieceDoc {
    /// The file, relative to the folder.
    pub file: String,
    /// The rows `[start, end)` of dim 0.
    pub rows: [usize; 2],
    /// Where the bytes start in the file.
    pub offset: u64,
    /// How many bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of those bytes.
    pub crc32: u32,
}

/// One file of a folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileDoc {
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC-32 of its safetensors header (the bytes before the data).
    pub header_crc32: u32,
    /// The rank that wrote it.
    pub rank: usize,
}

/// An optimizer folder's non-tensor state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerDoc {
    /// The optimizer (`AdamW`).
    pub name: String,
    /// Each parameter group's learning rate when saved.
    pub lrs: Vec<f64>,
    /// Each parameter's update count (`state[p]["step"]`), for parameters with state.
    pub steps: BTreeMap<String, u64>,
    /// Each parameter group's members and settings (PyTorch's `param_groups`); absent in
    /// checkpoints written before groups were recorded, which are then checked by count only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupDoc>,
}

/// One parameter group of a saved optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupDoc {
    /// The model's parameters in the group, in the model's order (empty when the optimizer
    /// does not say which group a parameter is in).
    pub params: Vec<String>,
    /// The group's settings under PyTorch's names (`lr`, `betas`, `weight_decay`,
    /// `initial_lr`, ...), `null` when the optimizer records none.
    pub settings: serde_json::Value,
}

/// The layout local (raw, padded) shards were cut for: loading needs the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutDoc {
    /// Ranks that saved.
    pub world_size: usize,
    /// Ranks a parameter is split over.
    pub shard_size: usize,
    /// Each unit's path and its parameters' names.
    pub units: Vec<(String, Vec<String>)>,
}

impl std::fmt::Display for LayoutDoc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rank(s), sharded over {}, {} unit(s)",
            self.world_size,
            self.shard_size,
            self.units.len()
        )
    }
}

/// The CRC-32 of a document's canonical text (compact, keys sorted) without its checksum
/// field: what the field must hold.
fn canonical_crc(doc: &serde_json::Map<String, serde_json::Value>) -> u32 {
    let mut body = doc.clone();
    body.remove(CHECKSUM_FIELD);
    let text = serde_json::to_vec(&serde_json::Value::Object(body)).unwrap_or_default();
    crc32fast::hash(&text)
}

/// A metadata document as written: its JSON with a checksum field over the rest.
pub fn document_bytes<T: Serialize>(doc: &T) -> Result<Vec<u8>, CheckpointError> {
    let value =
        serde_json::to_value(doc).map_err(|e| CheckpointError::json("a checkpoint document", e))?;
    let serde_json::Value::Object(mut map) = value else {
        return Err(CheckpointError::Internal {
            what: "a checkpoint document that is not a JSON object".into(),
        });
    };
    let crc = canonical_crc(&map);
    map.insert(CHECKSUM_FIELD.into(), crc.into());
    serde_json::to_vec_pretty(&serde_json::Value::Object(map))
        .map_err(|e| CheckpointError::json("a checkpoint document", e))
}

/// Reads a metadata document (`fsdp_checkpoint.json`, `metadata.json`), bounded in size,
/// and from version 2 on verifies its checksum; its format and version are checked too.
pub fn read_document<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, CheckpointError> {
    let bytes = read_bounded(path, DOCUMENT_LIMIT, "checkpoint document")?;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| CheckpointError::corrupt(path, e.to_string()))?;
    let serde_json::Value::Object(map) = &value else {
        return Err(CheckpointError::corrupt(path, "not a JSON object"));
    };
    let format = map.get("format").and_then(|v| v.as_str()).unwrap_or("");
    let version = map.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
    check_version(path, format, u32::try_from(version).unwrap_or(u32::MAX))?;
    if version >= 2 {
        let stored = map.get(CHECKSUM_FIELD).and_then(|v| v.as_u64());
        let want = canonical_crc(map);
        match stored {
            None => {
                return Err(CheckpointError::corrupt(
                    path,
                    format!(
                        "no `{CHECKSUM_FIELD}` field, which every version-{version} document has"
                    ),
                ));
            }
            Some(got) if got != want as u64 => {
                return Err(CheckpointError::corrupt(
                    path,
                    "the document's checksum does not match: it was edited or damaged",
                ));
            }
            Some(_) => {}
        }
    }
    serde_json::from_value(value).map_err(|e| CheckpointError::corrupt(path, e.to_string()))
}

/// Reads a document written as given (a scheduler's or random generator's state), bounded
/// in size, verifying its bytes against `crc32` (listed in `fsdp_checkpoint.json` from
/// version 2 on; `None` for version 1).
pub fn read_listed(path: &Path, crc32: Option<u32>) -> Result<serde_json::Value, CheckpointError> {
    let bytes = read_bounded(path, DOCUMENT_LIMIT, "checkpoint document")?;
    if let Some(want) = crc32
        && crc32fast::hash(&bytes) != want
    {
        return Err(CheckpointError::corrupt(
            path,
            "its checksum does not match the one in fsdp_checkpoint.json: it was edited or damaged",
        ));
    }
    serde_json::from_slice(&bytes).map_err(|e| CheckpointError::corrupt(path, e.to_string()))
}

/// Checks a document's format and version.
pub fn check_version(path: &Path, format: &str, version: u32) -> Result<(), CheckpointError> {
    if format != FORMAT {
        return Err(CheckpointError::corrupt(
            path,
            format!("format `{format}`, not `{FORMAT}`"),
        ));
    }
    if !(OLDEST_VERSION..=VERSION).contains(&version) {
        return Err(CheckpointError::corrupt(
            path,
            format!(
                "format version {version}; this build reads versions {OLDEST_VERSION} to {VERSION}"
            ),
        ));
    }
    Ok(())
}

impl FolderDoc {
    /// Checks everything the folder declares before any of it is opened or allocated: every
    /// file name is a plain name listed in `files`; every tensor is F32 with a size that
    /// fits in memory arithmetic; every piece holds rows inside its tensor, exactly the
    /// bytes those rows take, inside the declared length of its file, overlapping no other
    /// piece; and each tensor's pieces cover its rows once (`local`: rows several ranks
    /// hold appear once per rank file). With the files' real lengths checked against
    /// `files` when they are opened, nothing read can be larger than the files are.
    pub fn validate(&self, path: &Path, local: bool) -> Result<(), CheckpointError> {
        let bad = |reason: String| CheckpointError::corrupt(path, reason);
        for name in self.files.keys() {
            plain_name(path, name)?;
        }
        let mut extents: BTreeMap<&str, Vec<(u64, u64, &str)>> = BTreeMap::new();
        for (name, t) in &self.tensors {
            if t.dtype != "F32" {
                return Err(bad(format!("`{name}`: dtype {}, not F32", t.dtype)));
            }
            let rows = t.shape.first().copied().unwrap_or(1);
            let row_bytes = t
                .shape
                .iter()
                .skip(1)
                .try_fold(4usize, |a, &d| a.checked_mul(d))
                .filter(|b| b.checked_mul(rows).is_some())
                .ok_or_else(|| bad(format!("`{name}`: shape {:?} is too large", t.shape)))?;
            let mut ranges = Vec::with_capacity(t.pieces.len());
            for p in &t.pieces {
                plain_name(path, &p.file)?;
                let file = self.files.get(&p.file).ok_or_else(|| {
                    bad(format!(
                        "`{name}` has a piece in `{}`, which the file list does not have",
                        p.file
                    ))
                })?;
                let [a, b] = p.rows;
                if a >= b || b > rows {
                    return Err(bad(format!(
                        "`{name}`: a piece of rows {a}..{b} of a tensor of {rows} rows"
                    )));
                }
                let want = ((b - a) as u64).checked_mul(row_bytes as u64);
                if want != Some(p.bytes) {
                    return Err(bad(format!(
                        "`{name}` rows {a}..{b}: {} bytes listed where the rows take {}",
                        p.bytes,
                        want.map_or("more than 2^64".into(), |w| w.to_string())
                    )));
                }
                let end = p.offset.checked_add(p.bytes).filter(|&e| e <= file.bytes);
                let end = end.ok_or_else(|| {
                    bad(format!(
                        "`{name}` rows {a}..{b}: bytes from {} reach past the end of `{}` ({} bytes)",
                        p.offset, p.file, file.bytes
                    ))
                })?;
                extents
                    .entry(p.file.as_str())
                    .or_default()
                    .push((p.offset, end, name));
                ranges.push((a, b));
            }
            ranges.sort_unstable();
            if local {
                ranges.dedup();
            }
            let mut next = 0;
            for (a, b) in ranges {
                if a != next {
                    return Err(bad(format!(
                        "`{name}`: its pieces {} row {next}",
                        if a < next { "overlap at" } else { "miss" }
                    )));
                }
                next = b;
            }
            if next != rows {
                return Err(bad(format!(
                    "`{name}`: its pieces cover rows 0..{next} of {rows}"
                )));
            }
        }
        for (file, mut spans) in extents {
            spans.sort_unstable();
            for w in spans.windows(2) {
                if w[1].0 < w[0].1 {
                    return Err(bad(format!(
                        "`{}` and `{}` overlap in `{file}` (bytes {}..{})",
                        w[0].2, w[1].2, w[1].0, w[0].1
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Finds the checkpoint folder from a path that is the checkpoint itself or a folder inside
/// it (`.../pytorch_model_fsdp_0`): users point at either. Whatever stands at the
/// document's name counts (reading it then says what is wrong with it).
pub fn checkpoint_root(path: &Path) -> Option<PathBuf> {
    if path.join(CHECKPOINT_FILE).exists() {
        return Some(path.to_path_buf());
    }
    let parent = path.parent()?;
    parent
        .join(CHECKPOINT_FILE)
        .exists()
        .then(|| parent.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A document holding `values` where floats live in checkpoints: the data position (free
    /// JSON) and an optimizer's rates.
    fn doc_with(values: &[f64]) -> CheckpointDoc {
        CheckpointDoc {
            format: FORMAT.into(),
            version: VERSION,
            state_dict_type: "SHARDED_STATE_DICT".into(),
            world_size: 2,
            models: 1,
            optimizers: 1,
            schedulers: 1,
            step: 4,
            data: serde_json::json!({ "lrs": values, "first": values.first() }),
            grad_scalers: vec![serde_json::json!({ "scale": values.last() })],
            documents: BTreeMap::new(),
            files: BTreeMap::new(),
        }
    }

    /// Finite doubles of every kind: random bit patterns (so every exponent, subnormals
    /// included), 17-digit decimals, a linear schedule's rates, and the values that were
    /// refused before (a parser one ULP off made their checksum fail).
    fn awkward_values() -> Vec<f64> {
        let mut v = vec![
            0.00018749999999999998,
            1.8181818181818182e-05,
            5e-324,
            f64::MIN_POSITIVE,
            f64::MAX,
            -0.0,
            0.1 + 0.2,
            1e-310,
        ];
        v.extend((0..=11).map(|s| 5e-5 * (11 - s) as f64 / 11.0));
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        while v.len() < 4000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let x = f64::from_bits(state);
            if x.is_finite() {
                v.push(x);
                v.push(x * 1e-300);
            }
        }
        v
    }

    #[test]
    fn documents_of_any_finite_doubles_read_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let values = awkward_values();
        for (i, chunk) in values.chunks(40).enumerate() {
            let doc = doc_with(chunk);
            let path = dir.path().join(format!("doc_{i}.json"));
            std::fs::write(&path, document_bytes(&doc).unwrap()).unwrap();
            let read: CheckpointDoc = read_document(&path)
                .unwrap_or_else(|e| panic!("values {chunk:?} were refused: {e}"));
            assert_eq!(read, doc, "values {chunk:?} came back otherwise");
        }
    }

    #[test]
    fn an_edited_value_still_fails_the_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("doc.json");
        let text = String::from_utf8(document_bytes(&doc_with(&[1.8181818181818182e-05])).unwrap())
            .unwrap();
        let edited = text.replacen("0.000018181818181818182", "0.000028181818181818182", 1);
        assert_ne!(edited, text, "the value is written as expected");
        std::fs::write(&path, edited).unwrap();
        let e = read_document::<CheckpointDoc>(&path)
            .unwrap_err()
            .to_string();
        assert!(e.contains("checksum does not match"), "{e}");
    }
}
