//! Reading a distributed checkpoint's `torch.save` records: a zip archive per tensor chunk or
//! value, its pickle read by the restricted reader and its storage bytes gathered into place.

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::pickle::{self, Value};
use super::{Chunk, DcpCheckpoint, DcpTensor, METADATA, bad, dtype_of, usizes};
use crate::checkpoint::error::CheckpointError;
use crate::checkpoint::files::open_regular;

/// Classes and functions a `torch.save` record of a tensor refers to.
fn record_globals(module: &str, name: &str) -> bool {
    matches!(
        (module, name),
        ("torch._utils", "_rebuild_tensor_v2") | ("collections", "OrderedDict")
    ) || (module == "torch" && storage_dtype(name).is_some())
}

/// The dtype of a typed storage class (`FloatStorage`).
fn storage_dtype(name: &str) -> Option<(safetensors::Dtype, usize)> {
    dtype_of(match name {
        "FloatStorage" => "float32",
        "DoubleStorage" => "float64",
        "HalfStorage" => "float16",
        "BFloat16Storage" => "bfloat16",
        "LongStorage" => "int64",
        "IntStorage" => "int32",
        "ShortStorage" => "int16",
        "CharStorage" => "int8",
        "ByteStorage" => "uint8",
        "BoolStorage" => "bool",
        _ => return None,
    })
}

/// A `torch.save` record opened: its zip archive, the prefix of its entries, and how far
/// any entry may be read.
struct RecordArchive {
    zip: zip::ZipArchive<std::io::Cursor<Vec<u8>>>,
    prefix: String,
    limit: u64,
}

impl DcpCheckpoint {
    /// The full tensor `t`'s bytes (row-major), assembled from its chunks.
    pub fn read(&self, name: &str, t: &DcpTensor) -> Result<Vec<u8>, CheckpointError> {
        let numel: usize = t.shape.iter().product();
        let mut out = vec![0u8; numel * t.size];
        for c in &t.chunks {
            let path = self.dir.join(&c.file);
            let chunk = self.read_record(&path, c, t)?;
            copy_block(&chunk, &mut out, &t.shape, &c.offsets, &c.sizes, t.size);
        }
        let _ = name;
        Ok(out)
    }

    /// Rows `rows` of tensor `t` (its first dimension; a 0-d tensor is one row) as
    /// row-major bytes, read from the chunks that hold them only: a rank reading the rows it
    /// owns never reads or holds the whole tensor.
    pub fn read_rows(
        &self,
        name: &str,
        t: &DcpTensor,
        rows: std::ops::Range<usize>,
    ) -> Result<Vec<u8>, CheckpointError> {
        if t.shape.is_empty() && rows == (0..1) {
            return self.read(name, t);
        }
        if t.shape.first().is_none_or(|&n| rows.end > n) || rows.start > rows.end {
            return Err(CheckpointError::Internal {
                what: format!("`{name}`: rows {rows:?} outside {:?}", t.shape),
            });
        }
        let row_bytes: usize = t.shape[1..].iter().product::<usize>() * t.size;
        let mut shape = t.shape.clone();
        shape[0] = rows.len();
        let mut out = vec![0u8; rows.len() * row_bytes];
        for c in &t.chunks {
            let (first, last) = (c.offsets[0], c.offsets[0] + c.sizes[0]);
            let (from, to) = (first.max(rows.start), last.min(rows.end));
            if from >= to {
                continue;
            }
            let chunk = self.read_record(&self.dir.join(&c.file), c, t)?;
            let chunk_row: usize = c.sizes[1..].iter().product::<usize>() * t.size;
            let block = &chunk[(from - first) * chunk_row..(to - first) * chunk_row];
            let mut offsets = c.offsets.clone();
            offsets[0] = from - rows.start;
            let mut sizes = c.sizes.clone();
            sizes[0] = to - from;
            copy_block(block, &mut out, &shape, &offsets, &sizes, t.size);
        }
        Ok(out)
    }

    /// The plain Python value `name` (numbers, strings, booleans, `None`, tuples, lists and
    /// dicts of them: nothing else is accepted).
    pub fn read_value(&self, name: &str) -> Result<Value, CheckpointError> {
        let v = self
            .values
            .get(name)
            .ok_or_else(|| CheckpointError::Missing {
                path: self.dir.join(METADATA),
                what: format!("the value `{name}`"),
            })?;
        let path = self.dir.join(&v.file);
        let (pkl, _) = record_pickle(&path, v.at, v.length)?;
        pickle::load(&pkl, &|_, _| false).map_err(|e| bad(&path, format!("`{name}`: {e}")))
    }

    /// One chunk's bytes (row-major) out of its `torch.save` record.
    fn read_record(
        &self,
        path: &Path,
        c: &Chunk,
        t: &DcpTensor,
    ) -> Result<Vec<u8>, CheckpointError> {
        let (pkl, archive) = record_pickle(path, c.at, c.length)?;
        let RecordArchive {
            mut zip,
            prefix,
            limit,
        } = archive;
        let v = pickle::load(&pkl, &record_globals).map_err(|e| bad(path, e.to_string()))?;
        let Value::Object { class, args, .. } = v else {
            return Err(bad(path, "a record that is not a tensor"));
        };
        if class.1 != "_rebuild_tensor_v2" || args.len() < 4 {
            return Err(bad(
                path,
                format!("a record of {}.{}, not a tensor", class.0, class.1),
            ));
        }
        let Value::Persistent(pid) = &args[0] else {
            return Err(bad(path, "a tensor without a storage"));
        };
        let (key, storage_class) = match &**pid {
            Value::Tuple(p) if p.len() >= 3 => (p[2].str(), &p[1]),
            _ => (None, &Value::None),
        };
        let Value::Global(_, storage_name) = storage_class else {
            return Err(bad(path, "a storage of unknown type"));
        };
        let (dtype, size) = storage_dtype(storage_name)
            .ok_or_else(|| bad(path, format!("storage type {storage_name}")))?;
        if dtype != t.dtype {
            return Err(bad(
                path,
                format!("a {dtype:?} chunk of a {:?} tensor", t.dtype),
            ));
        }
        let key = key.ok_or_else(|| bad(path, "a storage without a key"))?;
        let mut storage = Vec::new();
        zip.by_name(&format!("{prefix}data/{key}"))
            .and_then(|f| f.take(limit).read_to_end(&mut storage).map_err(Into::into))
            .map_err(|e| bad(path, format!("storage {key}: {e}")))?;
        let offset = match &args[1] {
            Value::Int(i) => {
                usize::try_from(*i).map_err(|_| bad(path, "a negative storage offset"))?
            }
            _ => return Err(bad(path, "a storage offset that is not an integer")),
        };
        let (Some(shape), Some(stride)) = (usizes(Some(&args[2])), usizes(Some(&args[3]))) else {
            return Err(bad(path, "a tensor without size and stride"));
        };
        if shape != c.sizes {
            return Err(bad(
                path,
                format!("a {shape:?} record for a {:?} chunk", c.sizes),
            ));
        }
        gather_strided(&storage, offset, &shape, &stride, size)
            .ok_or_else(|| bad(path, "a tensor reaching past its storage"))
    }
}

/// The largest `torch.save` file read whole (a scheduler's state).
const SAVED_VALUE_LIMIT: u64 = 64 << 20;

/// The plain Python value a `torch.save` file at `path` holds (numbers, strings, booleans,
/// `None`, tuples, lists and dicts of them: nothing else is accepted).
pub(crate) fn read_saved_value(path: &Path) -> Result<Value, CheckpointError> {
    let length = open_regular(path, "a torch.save file")?
        .metadata()
        .map_err(|e| CheckpointError::io("reading", path, e))?
        .len();
    if length > SAVED_VALUE_LIMIT {
        return Err(bad(
            path,
            format!("{length} bytes, more than the {SAVED_VALUE_LIMIT} read"),
        ));
    }
    let (pkl, _) = record_pickle(path, 0, length)?;
    pickle::load(&pkl, &|_, _| false).map_err(|e| bad(path, e.to_string()))
}

/// A `torch.save` record's pickle (at `at`, `length` bytes of `path`) and its archive.
fn record_pickle(
    path: &Path,
    at: u64,
    length: u64,
) -> Result<(Vec<u8>, RecordArchive), CheckpointError> {
    let file = open_regular(path, "a file of the distributed checkpoint")?;
    let mut record = vec![0u8; length as usize];
    file.read_exact_at(&mut record, at).map_err(|e| {
        bad(
            path,
            format!("bytes {}..{}: {e} (truncated?)", at, at + length),
        )
    })?;
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(record))
        .map_err(|e| bad(path, format!("record at byte {at}: {e}")))?;
    let pkl_name = (0..zip.len())
        .filter_map(|i| zip.name_for_index(i)?.ok().map(|n| n.to_string()))
        .find(|n| n.ends_with("data.pkl"))
        .ok_or_else(|| bad(path, format!("record at byte {at}: no data.pkl")))?;
    let prefix = pkl_name.trim_end_matches("data.pkl").to_string();
    // Entries are read no further than the record is long (a compressed entry could
    // otherwise inflate without bound).
    let mut pkl = Vec::new();
    zip.by_name(&pkl_name)
        .and_then(|f| f.take(length).read_to_end(&mut pkl).map_err(Into::into))
        .map_err(|e| bad(path, format!("record at byte {at}: {e}")))?;
    Ok((
        pkl,
        RecordArchive {
            zip,
            prefix,
            limit: length,
        },
    ))
}

/// The elements of a strided view (`offset`, `shape`, `stride` in elements of `size` bytes)
/// as contiguous bytes; `None` when the view reaches past `storage`.
fn gather_strided(
    storage: &[u8],
    offset: usize,
    shape: &[usize],
    stride: &[usize],
    size: usize,
) -> Option<Vec<u8>> {
    let numel: usize = shape.iter().product();
    let mut out = Vec::with_capacity(numel * size);
    let mut index = vec![0usize; shape.len()];
    for _ in 0..numel {
        let at = index
            .iter()
            .zip(stride)
            .try_fold(offset, |a, (i, s)| a.checked_add(i.checked_mul(*s)?))?;
        let start = at.checked_mul(size)?;
        out.extend_from_slice(storage.get(start..start.checked_add(size)?)?);
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Some(out)
}

/// Copies a row-major block of `sizes` at `offsets` into the row-major `out` of `shape`.
fn copy_block(
    block: &[u8],
    out: &mut [u8],
    shape: &[usize],
    offsets: &[usize],
    sizes: &[usize],
    size: usize,
) {
    if shape.is_empty() {
        out.copy_from_slice(&block[..size]);
        return;
    }
    let d = shape.len();
    let inner = sizes[d - 1] * size;
    let rows: usize = sizes[..d - 1].iter().product();
    let mut index = vec![0usize; d - 1];
    for r in 0..rows {
        let mut at = 0;
        for k in 0..d - 1 {
            at = at * shape[k] + offsets[k] + index[k];
        }
        at = (at * shape[d - 1] + offsets[d - 1]) * size;
        out[at..at + inner].copy_from_slice(&block[r * inner..(r + 1) * inner]);
        for k in (0..d - 1).rev() {
            index[k] += 1;
            if index[k] < sizes[k] {
                break;
            }
            index[k] = 0;
        }
    }
}
