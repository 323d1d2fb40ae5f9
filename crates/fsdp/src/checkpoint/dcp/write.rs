//! Writing PyTorch distributed checkpoints as `torch.distributed.checkpoint`'s file system
//! writer does: each `.distcp` file a sequence of `torch.save` records (a zip archive per
//! tensor chunk or value), and `.metadata` a pickle of DCP's `Metadata` written with only
//! DCP's data classes, torch's `Size`, dtype and layout, and `_MEM_FORMAT_ENCODING`.

use std::io::{Cursor, Write};
use std::path::Path;

use zip::write::SimpleFileOptions;

use super::pickle::{Py, dump};
use crate::checkpoint::error::CheckpointError;
use crate::checkpoint::format::FileSum;

const DCP: &str = "torch.distributed.checkpoint.metadata";

/// The DCP version Accelerate 1.15 + PyTorch 2.15 write.
const VERSION: &str = "1.0.0";

/// A part of a state-dict path: a key, or a list index (`param_groups`, 0, `lr`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum PathPart {
    Key(String),
    Index(usize),
}

/// Where a record is: the file (relative to the checkpoint folder), its offset and length.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stored {
    pub file: String,
    pub at: u64,
    pub length: u64,
}

/// One chunk of a tensor as stored: its offsets and sizes in the full tensor.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StoredChunk {
    pub offsets: Vec<usize>,
    pub sizes: Vec<usize>,
    pub stored: Stored,
}

/// An entry of the checkpoint: an f32 tensor in chunks, or a plain value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Entry {
    Tensor {
        path: Vec<PathPart>,
        shape: Vec<usize>,
        chunks: Vec<StoredChunk>,
    },
    Value {
        path: Vec<PathPart>,
        stored: Stored,
    },
}

impl Entry {
    fn path(&self) -> &[PathPart] {
        match self {
            Entry::Tensor { path, .. } | Entry::Value { path, .. } => path,
        }
    }

    /// Its flattened name (`optimizer.param_groups.0.lr`), as DCP's planner makes it.
    pub(crate) fn fqn(&self) -> String {
        let parts: Vec<String> = self
            .path()
            .iter()
            .map(|p| match p {
                PathPart::Key(k) => k.clone(),
                PathPart::Index(i) => i.to_string(),
            })
            .collect();
        parts.join(".")
    }
}

/// The `torch.save` record of an f32 tensor of shape `sizes` (row-major `values`).
pub(crate) fn tensor_record(values: &[f32], sizes: &[usize]) -> Result<Vec<u8>, CheckpointError> {
    let numel: usize = sizes.iter().product();
    if numel != values.len() {
        return Err(CheckpointError::Internal {
            what: format!("a tensor of shape {sizes:?} given {} values", values.len()),
        });
    }
    let mut strides = vec![1usize; sizes.len()];
    for d in (0..sizes.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * sizes[d + 1];
    }
    let storage = Py::Persistent(Box::new(Py::Tuple(vec![
        Py::str("storage"),
        Py::Global("torch", "FloatStorage"),
        Py::str("0"),
        Py::str("cpu"),
        Py::Int(numel as i64),
    ])));
    let tensor = Py::Call(
        Box::new(Py::Global("torch._utils", "_rebuild_tensor_v2")),
        vec![
            storage,
            Py::Int(0),
            Py::ints(sizes),
            Py::ints(&strides),
            Py::Bool(false),
            Py::Call(Box::new(Py::Global("collections", "OrderedDict")), vec![]),
        ],
    );
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    record(&dump(&tensor), Some(&bytes))
}

/// The `torch.save` record of a plain value (DCP stores non-tensors as such records).
pub(crate) fn value_record(value: &Py) -> Result<Vec<u8>, CheckpointError> {
    record(&dump(value), None)
}

/// A `torch.save` archive: its pickle, the storage `data/0` when given, and the small
/// records torch writes, in torch's order; entries stored, storage 64-byte aligned.
fn record(pickle: &[u8], storage: Option<&[u8]>) -> Result<Vec<u8>, CheckpointError> {
    let large = storage.is_some_and(|s| s.len() as u64 >= u32::MAX as u64);
    let options = SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .with_alignment(64)
        .large_file(large);
    let id = {
        let mut crc = crc32fast::Hasher::new();
        crc.update(pickle);
        crc.update(storage.unwrap_or_default());
        // torch writes 40 decimal digits; ours is a digest of the record's contents.
        format!(
            "{:040}",
            u64::from(crc.finalize()) * 1_000_003 + pickle.len() as u64
        )
    };
    let mut entries: Vec<(&str, &[u8])> = vec![
        ("archive/data.pkl", pickle),
        ("archive/.format_version", b"1"),
        ("archive/.storage_alignment", b"64"),
        ("archive/byteorder", b"little"),
    ];
    if let Some(s) = storage {
        entries.push(("archive/data/0", s));
    }
    entries.push(("archive/version", b"3\n"));
    entries.push(("archive/.data/serialization_id", id.as_bytes()));
    let size: usize = entries.iter().map(|(_, b)| b.len() + 200).sum();
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::with_capacity(size)));
    for (name, bytes) in entries {
        zip.start_file(name, options)?;
        zip.write_all(bytes).map_err(zip::result::ZipError::from)?;
    }
    Ok(zip.finish()?.into_inner())
}

fn size(dims: &[usize]) -> Py {
    Py::Call(Box::new(Py::Global("torch", "Size")), vec![Py::ints(dims)])
}

fn new(name: &'static str, fields: Vec<(&str, Py)>) -> Py {
    Py::New(DCP, name, Box::new(Py::fields(fields)))
}

fn index(fqn: &str, offsets: Option<&[usize]>, i: Option<usize>) -> Py {
    new(
        "MetadataIndex",
        vec![
            ("fqn", Py::str(fqn)),
            ("offset", offsets.map_or(Py::None, size)),
            ("index", i.map_or(Py::None, |i| Py::Int(i as i64))),
        ],
    )
}

fn storage_info(s: &Stored) -> Py {
    Py::New(
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        Box::new(Py::fields(vec![
            ("relative_path", Py::str(&s.file)),
            ("offset", Py::Int(s.at as i64)),
            ("length", Py::Int(s.length as i64)),
        ])),
    )
}

/// F32, strided, no grad, contiguous, not pinned: `TensorProperties.__getstate__`'s tuple.
fn f32_properties() -> Py {
    Py::New(
        DCP,
        "TensorProperties",
        Box::new(Py::Tuple(vec![
            Py::Global("torch", "float32"),
            Py::Call(
                Box::new(Py::Global("torch.serialization", "_get_layout")),
                vec![Py::str("torch.strided")],
            ),
            Py::Bool(false),
            Py::Call(
                Box::new(Py::Global(DCP, "_MEM_FORMAT_ENCODING")),
                vec![Py::Int(0)],
            ),
            Py::Bool(false),
            Py::None,
        ])),
    )
}

/// `.metadata` for `entries`.
pub(crate) fn metadata(entries: &[Entry]) -> Vec<u8> {
    let mut state_dict = Vec::new();
    let mut planner = Vec::new();
    let mut storage = Vec::new();
    for e in entries {
        let fqn = e.fqn();
        let path = Py::Tuple(
            e.path()
                .iter()
                .map(|p| match p {
                    PathPart::Key(k) => Py::str(k),
                    PathPart::Index(i) => Py::Int(*i as i64),
                })
                .collect(),
        );
        planner.push((Py::str(&fqn), path));
        let md = match e {
            Entry::Tensor { shape, chunks, .. } => {
                let listed = chunks
                    .iter()
                    .map(|c| {
                        new(
                            "ChunkStorageMetadata",
                            vec![("offsets", size(&c.offsets)), ("sizes", size(&c.sizes))],
                        )
                    })
                    .collect();
                for (i, c) in chunks.iter().enumerate() {
                    storage.push((
                        index(&fqn, Some(&c.offsets), Some(i)),
                        storage_info(&c.stored),
                    ));
                }
                new(
                    "TensorStorageMetadata",
                    vec![
                        ("properties", f32_properties()),
                        ("size", size(shape)),
                        ("chunks", Py::List(listed)),
                    ],
                )
            }
            Entry::Value { stored, .. } => {
                storage.push((index(&fqn, None, None), storage_info(stored)));
                new("BytesStorageMetadata", vec![])
            }
        };
        state_dict.push((Py::str(&fqn), md));
    }
    dump(&new(
        "Metadata",
        vec![
            ("state_dict_metadata", Py::Dict(state_dict)),
            ("planner_data", Py::Dict(planner)),
            ("storage_data", Py::Dict(storage)),
            ("storage_meta", Py::None),
            ("version", Py::str(VERSION)),
        ],
    ))
}

/// Writes `records` one after another into `path` (created, synced); returns where each
/// one is, and the file's size and checksum.
pub(crate) fn write_records(
    folder: &Path,
    file: &str,
    records: impl IntoIterator<Item = Result<Vec<u8>, CheckpointError>>,
) -> Result<(Vec<Stored>, FileSum), CheckpointError> {
    let path = folder.join(file);
    let mut out =
        std::fs::File::create_new(&path).map_err(|e| CheckpointError::io("creating", &path, e))?;
    let mut at = 0u64;
    let mut placed = Vec::new();
    let mut crc = crc32fast::Hasher::new();
    for r in records {
        let bytes = r?;
        crc.update(&bytes);
        out.write_all(&bytes)
            .map_err(|e| CheckpointError::io("writing", &path, e))?;
        placed.push(Stored {
            file: file.to_string(),
            at,
            length: bytes.len() as u64,
        });
        at += bytes.len() as u64;
    }
    out.sync_all()
        .map_err(|e| CheckpointError::io("syncing", &path, e))?;
    let sum = FileSum {
        bytes: at,
        crc32: crc.finalize(),
    };
    Ok((placed, sum))
}
