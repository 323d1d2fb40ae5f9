//! Reading PyTorch distributed checkpoints (`torch.distributed.checkpoint`, what Accelerate
//! writes for SHARDED_STATE_DICT): `.metadata` is a pickle of DCP's `Metadata` (every
//! tensor's size, dtype and chunks, and where each chunk is stored), and each `.distcp` file
//! is a sequence of `torch.save` records (zip archives holding a tensor's pickle and its
//! storage bytes). Both pickles are read by a restricted reader that runs nothing and accepts
//! only the classes these files use.

mod pickle;
mod record;
mod write;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub(crate) use pickle::{Py, Value};
pub(crate) use record::read_saved_value;
pub(crate) use write::{
    Entry, PathPart, Stored, StoredChunk, metadata, tensor_record, value_record, write_records,
};

use super::error::CheckpointError;
use super::files::{open_regular, plain_name, read_bounded};

/// The metadata file of a distributed checkpoint.
pub(crate) const METADATA: &str = ".metadata";
/// The largest `.metadata` read.
const METADATA_LIMIT: u64 = 1 << 30;

/// Classes and functions `.metadata` refers to.
fn metadata_globals(module: &str, name: &str) -> bool {
    matches!(
        (module, name),
        (
            "torch.distributed.checkpoint.metadata",
            "Metadata"
                | "TensorStorageMetadata"
                | "BytesStorageMetadata"
                | "ChunkStorageMetadata"
                | "TensorProperties"
                | "MetadataIndex"
                | "StorageMeta"
                | "_MEM_FORMAT_ENCODING"
        ) | ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
            | ("torch", "Size")
            | ("torch.serialization", "_get_layout")
            | ("pathlib", "PosixPath" | "PurePosixPath" | "Path")
            | ("collections", "OrderedDict")
    ) || (module == "torch" && dtype_of(name).is_some())
}

/// The safetensors dtype of a torch dtype name, and its size in bytes.
fn dtype_of(name: &str) -> Option<(safetensors::Dtype, usize)> {
    use safetensors::Dtype::*;
    Some(match name {
        "float32" => (F32, 4),
        "float64" => (F64, 8),
        "float16" => (F16, 2),
        "bfloat16" => (BF16, 2),
        "int64" => (I64, 8),
        "int32" => (I32, 4),
        "int16" => (I16, 2),
        "int8" => (I8, 1),
        "uint8" => (U8, 1),
        "bool" => (BOOL, 1),
        _ => return None,
    })
}

/// Where one chunk of a tensor is stored.
#[derive(Debug, Clone)]
struct Chunk {
    offsets: Vec<usize>,
    sizes: Vec<usize>,
    file: String,
    at: u64,
    length: u64,
}

/// One tensor of a distributed checkpoint.
#[derive(Debug, Clone)]
pub(crate) struct DcpTensor {
    /// Its element type.
    pub dtype: safetensors::Dtype,
    /// Bytes per element.
    pub size: usize,
    /// Its full shape.
    pub shape: Vec<usize>,
    chunks: Vec<Chunk>,
}

/// One non-tensor value of a distributed checkpoint (an optimizer's group settings): a
/// `torch.save` record of a plain Python value.
#[derive(Debug, Clone)]
pub(crate) struct DcpBytes {
    file: String,
    at: u64,
    length: u64,
}

/// A distributed checkpoint's tensors and other values, by the names a merged state dict
/// gives them (the top-level `model` key dropped, as Accelerate's merge does).
#[derive(Debug)]
pub(crate) struct DcpCheckpoint {
    dir: PathBuf,
    /// Tensors by name.
    pub tensors: BTreeMap<String, DcpTensor>,
    /// Values that are not tensors, by name.
    pub values: BTreeMap<String, DcpBytes>,
}

fn bad(path: &Path, what: impl Into<String>) -> CheckpointError {
    CheckpointError::corrupt(path, what)
}

fn usizes(v: Option<&Value>) -> Option<Vec<usize>> {
    v?.ints()?
        .into_iter()
        .map(|i| usize::try_from(i).ok())
        .collect()
}

/// Where a stored item is: (file, offset, length).
type Place = (String, u64, u64);

/// Reads `dir/.metadata`.
pub(crate) fn open(dir: &Path) -> Result<DcpCheckpoint, CheckpointError> {
    let path = dir.join(METADATA);
    let bytes = read_bounded(&path, METADATA_LIMIT, "distributed checkpoint metadata")?;
    let meta = pickle::load(&bytes, &metadata_globals).map_err(|e| bad(&path, e.to_string()))?;
    let entries = meta
        .get("state_dict_metadata")
        .and_then(Value::fields)
        .ok_or_else(|| bad(&path, "no state_dict_metadata"))?;
    let storage = meta
        .get("storage_data")
        .and_then(Value::fields)
        .ok_or_else(|| bad(&path, "no storage_data"))?;
    // (fqn, chunk offsets) -> (file, offset, length)
    let mut places: BTreeMap<(String, Option<Vec<usize>>), Place> = BTreeMap::new();
    for (index, info) in storage {
        let fqn = index.get("fqn").and_then(Value::str);
        // A value that is not a tensor is stored whole: no chunk offsets.
        let offsets = match index.get("offset") {
            None | Some(Value::None) => Some(None),
            v => usizes(v).map(Some),
        };
        let file = info.get("relative_path").and_then(Value::str);
        let at = info
            .get("offset")
            .and_then(|v| v.ints())
            .or_else(|| match info.get("offset") {
                Some(Value::Int(i)) => Some(vec![*i]),
                _ => None,
            });
        let length = match info.get("length") {
            Some(Value::Int(i)) => Some(*i),
            _ => None,
        };
        let (Some(fqn), Some(offsets), Some(file), Some(at), Some(length)) =
            (fqn, offsets, file, at, length)
        else {
            return Err(bad(
                &path,
                "a storage entry without fqn, offset, path or length",
            ));
        };
        if info
            .get("transform_descriptors")
            .is_some_and(|t| *t != Value::None)
        {
            return Err(bad(
                &path,
                format!(
                    "`{fqn}` is stored with transforms (compression), which this reader does not undo"
                ),
            ));
        }
        plain_name(&path, file)?;
        let (Ok(at), Ok(length)) = (
            u64::try_from(at.first().copied().unwrap_or(0)),
            u64::try_from(length),
        ) else {
            return Err(bad(&path, format!("`{fqn}`: a negative offset or length")));
        };
        places.insert((fqn.to_string(), offsets), (file.to_string(), at, length));
    }
    let names: BTreeMap<String, String> = meta
        .get("planner_data")
        .and_then(Value::fields)
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| {
            let Value::Tuple(parts) = v else { return None };
            // Keys and list indices (`param_groups`, 0, `lr`).
            let parts: Vec<String> = parts
                .iter()
                .filter_map(|p| match p {
                    Value::Int(i) => Some(i.to_string()),
                    other => other.str().map(str::to_string),
                })
                .collect();
            let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
            let name = match parts.as_slice() {
                ["model", rest @ ..] if !rest.is_empty() => rest.join("."),
                all => all.join("."),
            };
            Some((k.str()?.to_string(), name))
        })
        .collect();
    let name_of = |fqn: &str| {
        names
            .get(fqn)
            .cloned()
            .unwrap_or_else(|| fqn.strip_prefix("model.").unwrap_or(fqn).to_string())
    };
    let mut tensors = BTreeMap::new();
    let mut values = BTreeMap::new();
    for (key, entry) in entries {
        let fqn = key.str().ok_or_else(|| bad(&path, "a non-string key"))?;
        let Value::Object { class, .. } = entry else {
            return Err(bad(
                &path,
                format!("`{fqn}`: not a storage metadata object"),
            ));
        };
        if class.1 == "BytesStorageMetadata" {
            let (file, at, length) = places
                .get(&(fqn.to_string(), None))
                .cloned()
                .ok_or_else(|| bad(&path, format!("`{fqn}` is stored nowhere")))?;
            values.insert(name_of(fqn), DcpBytes { file, at, length });
            continue;
        }
        if class.1 != "TensorStorageMetadata" {
            return Err(bad(
                &path,
                format!("`{fqn}` is a {}, neither a tensor nor a value", class.1),
            ));
        }
        let dtype = match entry.get("properties") {
            Some(Value::Object { state: Some(s), .. }) => match &**s {
                Value::Tuple(t) => t.first().cloned(),
                other => other.get("dtype").cloned(),
            },
            _ => None,
        };
        let Some(Value::Global(_, dtype_name)) = dtype else {
            return Err(bad(&path, format!("`{fqn}`: no dtype")));
        };
        let (dtype, size) = dtype_of(&dtype_name)
            .ok_or_else(|| bad(&path, format!("`{fqn}`: dtype torch.{dtype_name}")))?;
        let shape =
            usizes(entry.get("size")).ok_or_else(|| bad(&path, format!("`{fqn}`: no size")))?;
        let mut chunks = Vec::new();
        let listed = match entry.get("chunks") {
            Some(Value::List(l)) => l.as_slice(),
            _ => return Err(bad(&path, format!("`{fqn}`: no chunks"))),
        };
        for c in listed {
            let (Some(offsets), Some(sizes)) = (usizes(c.get("offsets")), usizes(c.get("sizes")))
            else {
                return Err(bad(
                    &path,
                    format!("`{fqn}`: a chunk without offsets and sizes"),
                ));
            };
            let (file, at, length) = places
                .get(&(fqn.to_string(), Some(offsets.clone())))
                .cloned()
                .ok_or_else(|| {
                    bad(
                        &path,
                        format!("`{fqn}`: chunk at {offsets:?} is stored nowhere"),
                    )
                })?;
            if offsets.len() != shape.len()
                || sizes.len() != shape.len()
                || offsets
                    .iter()
                    .zip(&sizes)
                    .zip(&shape)
                    .any(|((o, s), d)| o.checked_add(*s).is_none_or(|end| end > *d))
            {
                return Err(bad(
                    &path,
                    format!("`{fqn}`: chunk {offsets:?}+{sizes:?} outside {shape:?}"),
                ));
            }
            // torch.save stores a chunk's storage uncompressed inside its record.
            if numel_bytes(&sizes, size).is_none_or(|b| b as u64 > length) {
                return Err(bad(
                    &path,
                    format!(
                        "`{fqn}`: chunk {offsets:?} of {sizes:?} cannot fit in its record of {length} bytes"
                    ),
                ));
            }
            chunks.push(Chunk {
                offsets,
                sizes,
                file,
                at,
                length,
            });
        }
        let covered = chunks
            .iter()
            .try_fold(0usize, |sum, c| sum.checked_add(numel_bytes(&c.sizes, 1)?));
        if numel_bytes(&shape, size).is_none() || covered != numel_bytes(&shape, 1) {
            return Err(bad(
                &path,
                format!("`{fqn}`: the chunks do not cover the tensor"),
            ));
        }
        tensors.insert(
            name_of(fqn),
            DcpTensor {
                dtype,
                size,
                shape,
                chunks,
            },
        );
    }
    let records = tensors
        .iter()
        .flat_map(|(name, t)| {
            t.chunks
                .iter()
                .map(move |c| (c.file.as_str(), c.at, c.length, name))
        })
        .chain(
            values
                .iter()
                .map(|(name, v)| (v.file.as_str(), v.at, v.length, name)),
        );
    check_records(dir, &path, records)?;
    Ok(DcpCheckpoint {
        dir: dir.to_path_buf(),
        tensors,
        values,
    })
}

/// The elements of `shape` times `size` bytes, `None` past `usize`.
fn numel_bytes(shape: &[usize], size: usize) -> Option<usize> {
    shape.iter().try_fold(size, |a, &d| a.checked_mul(d))
}

/// Checks that every chunk's record lies inside its file, a regular file, and overlaps no
/// other record: what the tensors declare is then no larger than the files are.
fn check_records<'a>(
    dir: &Path,
    metadata: &Path,
    records: impl Iterator<Item = (&'a str, u64, u64, &'a String)>,
) -> Result<(), CheckpointError> {
    let mut by_file: BTreeMap<&str, Vec<(u64, u64, &str)>> = BTreeMap::new();
    for (file, at, length, name) in records {
        by_file
            .entry(file)
            .or_default()
            .push((at, length, name.as_str()));
    }
    for (file, mut records) in by_file {
        let path = dir.join(file);
        let size = open_regular(&path, "a file of the distributed checkpoint")?
            .metadata()
            .map_err(|e| CheckpointError::io("reading", &path, e))?
            .len();
        records.sort_unstable();
        let mut end_of_last = 0u64;
        for (at, length, name) in records {
            let end = at.checked_add(length).filter(|&e| e <= size).ok_or_else(|| {
                bad(
                    metadata,
                    format!(
                        "`{name}`: a record at bytes {at}+{length} reaches past the end of `{file}` ({size} bytes)"
                    ),
                )
            })?;
            if at < end_of_last {
                return Err(bad(
                    metadata,
                    format!("`{name}`: its record at byte {at} of `{file}` overlaps another"),
                ));
            }
            end_of_last = end;
        }
    }
    Ok(())
}
