//! Tensor files: standard safetensors files (readable by the `safetensors` crate and by
//! Hugging Face), written as a stream — the header is planned from the names and shapes,
//! then each tensor's bytes are appended as they become available, so a full state dict
//! never has to be in memory at once — with a CRC-32 of the header and of each tensor, and
//! read back piece by piece with those checksums verified.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::error::CheckpointError;
use super::format::{FileDoc, PieceDoc, TensorDoc};

#[cfg(not(target_endian = "little"))]
compile_error!("checkpoint files store little-endian f32; big-endian targets are not supported");

/// The bytes of f32 values as stored (little-endian, which is this machine's order).
pub(crate) fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any initialised f32 is valid as bytes; the length is
    // the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), std::mem::size_of_val(values)) }
}

/// A tensor to be written: its name, shape and byte size (f32).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlannedTensor {
    pub name: String,
    pub shape: Vec<usize>,
}

impl PlannedTensor {
    fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * 4
    }
}

/// What was written: the file's size, its header's checksum, and each tensor's place.
#[derive(Debug, Clone)]
pub(crate) struct WrittenFile {
    pub bytes: u64,
    pub header_crc32: u32,
    /// CRC-32 of the whole file.
    pub crc32: u32,
    /// (name, offset, bytes, crc32) in writing order.
    pub tensors: Vec<(String, u64, u64, u32)>,
}

/// A safetensors file being written tensor by tensor, in the planned order.
pub(crate) struct TensorFileWriter {
    path: PathBuf,
    out: BufWriter<File>,
    plan: Vec<PlannedTensor>,
    next: usize,
    offset: u64,
    header_crc32: u32,
    /// CRC-32 of everything written so far (the pieces' sums combined, not computed again).
    file_crc: crc32fast::Hasher,
    written: Vec<(String, u64, u64, u32)>,
}

impl TensorFileWriter {
    /// Creates `path` and writes the header for `plan` (f32 tensors, in this order).
    pub fn create(path: &Path, plan: Vec<PlannedTensor>) -> Result<Self, CheckpointError> {
        let mut header = serde_json::Map::new();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({ "format": "pt", "writer": "fsdp-rs" }),
        );
        let mut at = 0u64;
        for t in &plan {
            let end = at + t.bytes();
            header.insert(
                t.name.clone(),
                serde_json::json!({ "dtype": "F32", "shape": t.shape, "data_offsets": [at, end] }),
            );
            at = end;
        }
        let mut json = serde_json::to_vec(&header)
            .map_err(|e| CheckpointError::corrupt(path, format!("header: {e}")))?;
        // Data starts 8-byte aligned, as the format asks (the header is padded with spaces).
        while (8 + json.len()) % 8 != 0 {
            json.push(b' ');
        }
        let mut head = (json.len() as u64).to_le_bytes().to_vec();
        head.extend_from_slice(&json);
        let file = File::create(path).map_err(|e| CheckpointError::io("creating", path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&head)
            .map_err(|e| CheckpointError::io("writing", path, e))?;
        Ok(TensorFileWriter {
            path: path.to_path_buf(),
            out,
            plan,
            next: 0,
            offset: head.len() as u64,
            header_crc32: crc32fast::hash(&head),
            file_crc: {
                let mut h = crc32fast::Hasher::new();
                h.update(&head);
                h
            },
            written: Vec::new(),
        })
    }

    /// Appends the next planned tensor's values.
    pub fn write_next(&mut self, values: &[f32]) -> Result<(), CheckpointError> {
        self.write_chunks(&[values])
    }

    /// Appends the next planned tensor's values, given as consecutive chunks.
    pub fn write_chunks(&mut self, chunks: &[&[f32]]) -> Result<(), CheckpointError> {
        let t = self.plan.get(self.next).ok_or_else(|| {
            CheckpointError::internal(format!(
                "{}: more tensors written than planned",
                self.path.display()
            ))
        })?;
        let len: usize = chunks.iter().map(|c| c.len()).sum();
        if len as u64 * 4 != t.bytes() {
            return Err(CheckpointError::internal(format!(
                "{}: `{}` has {len} values, its shape {:?} needs {}",
                self.path.display(),
                t.name,
                t.shape,
                t.bytes() / 4
            )));
        }
        let mut crc = crc32fast::Hasher::new();
        for chunk in chunks {
            let bytes = f32_bytes(chunk);
            crc.update(bytes);
            self.out
                .write_all(bytes)
                .map_err(|e| CheckpointError::io("writing", &self.path, e))?;
        }
        self.file_crc.combine(&crc);
        self.written
            .push((t.name.clone(), self.offset, len as u64 * 4, crc.finalize()));
        self.offset += len as u64 * 4;
        self.next += 1;
        Ok(())
    }

    /// Flushes and syncs the file to disk; every planned tensor must have been written.
    pub fn finish(self) -> Result<WrittenFile, CheckpointError> {
        if self.next != self.plan.len() {
            return Err(CheckpointError::internal(format!(
                "{}: {} of {} planned tensors written",
                self.path.display(),
                self.next,
                self.plan.len()
            )));
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| CheckpointError::io("writing", &self.path, e.into_error()))?;
        file.sync_all()
            .map_err(|e| CheckpointError::io("syncing", &self.path, e))?;
        Ok(WrittenFile {
            bytes: self.offset,
            header_crc32: self.header_crc32,
            crc32: self.file_crc.finalize(),
            tensors: self.written,
        })
    }
}

/// Reads rows of tensors out of a folder's files described by a validated
/// [`FolderDoc`](super::format::FolderDoc), checking each file's size and header and each
/// piece's checksum before using it.
pub(crate) struct TensorReader<'a> {
    folder: PathBuf,
    files: &'a std::collections::BTreeMap<String, FileDoc>,
    open: HashMap<String, File>,
}

impl<'a> TensorReader<'a> {
    /// A reader of the files of `folder` described by `files`.
    pub fn new(folder: &Path, files: &'a std::collections::BTreeMap<String, FileDoc>) -> Self {
        TensorReader {
            folder: folder.to_path_buf(),
            files,
            open: HashMap::new(),
        }
    }

    fn file(&mut self, name: &str) -> Result<&File, CheckpointError> {
        if !self.open.contains_key(name) {
            let path = self.folder.join(name);
            let doc = self.files.get(name).ok_or_else(|| {
                CheckpointError::corrupt(
                    self.folder.join(super::format::METADATA_FILE),
                    format!("a piece refers to `{name}`, which the file list does not have"),
                )
            })?;
            let file = super::files::open_regular(&path, &format!("written by rank {}", doc.rank))?;
            let size = file
                .metadata()
                .map_err(|e| CheckpointError::io("reading", &path, e))?
                .len();
            if size != doc.bytes {
                return Err(CheckpointError::corrupt(
                    &path,
                    format!(
                        "{size} bytes where the checkpoint's metadata says {} (truncated or replaced)",
                        doc.bytes
                    ),
                ));
            }
            let mut len = [0u8; 8];
            read_at(&file, &path, &mut len, 0)?;
            let header_len = u64::from_le_bytes(len);
            if header_len > size.saturating_sub(8) {
                return Err(CheckpointError::corrupt(
                    &path,
                    "header length out of range",
                ));
            }
            let mut head = vec![0u8; 8 + header_len as usize];
            read_at(&file, &path, &mut head, 0)?;
            if crc32fast::hash(&head) != doc.header_crc32 {
                return Err(CheckpointError::corrupt(
                    &path,
                    "the header's checksum does not match: the file was altered",
                ));
            }
            self.open.insert(name.to_string(), file);
        }
        Ok(&self.open[name])
    }

    /// Opens every listed file, checking that each is a regular file of the size and header
    /// the metadata gives: after this (and [`FolderDoc::validate`](super::format::FolderDoc::validate)),
    /// nothing the metadata declares is larger than the files really are.
    pub fn check_files(&mut self) -> Result<(), CheckpointError> {
        let files = self.files;
        for name in files.keys() {
            self.file(name)?;
        }
        Ok(())
    }

    /// Rows `rows` of tensor `name` (described by `doc`), each row `row_elems` values.
    pub fn read_rows(
        &mut self,
        name: &str,
        doc: &TensorDoc,
        rows: Range<usize>,
        row_elems: usize,
    ) -> Result<Vec<f32>, CheckpointError> {
        let mut out = vec![0f32; rows.len() * row_elems];
        let mut covered = 0;
        for piece in &doc.pieces {
            let [a, b] = piece.rows;
            let (start, end) = (a.max(rows.start), b.min(rows.end));
            if start >= end {
                continue;
            }
            let elems = (b - a).checked_mul(row_elems).ok_or_else(|| {
                CheckpointError::corrupt(
                    self.folder.join(super::format::METADATA_FILE),
                    format!("`{name}`: a piece of rows {a}..{b} is too large"),
                )
            })?;
            let values = self.read_piece(name, piece, elems)?;
            out[(start - rows.start) * row_elems..(end - rows.start) * row_elems]
                .copy_from_slice(&values[(start - a) * row_elems..(end - a) * row_elems]);
            covered += end - start;
        }
        if covered != rows.len() {
            return Err(CheckpointError::corrupt(
                self.folder.join(super::format::METADATA_FILE),
                format!(
                    "`{name}`: the pieces cover {covered} of rows {rows:?} (overlapping or missing pieces)"
                ),
            ));
        }
        Ok(out)
    }

    /// One piece's values, its checksum verified.
    fn read_piece(
        &mut self,
        name: &str,
        piece: &PieceDoc,
        elems: usize,
    ) -> Result<Vec<f32>, CheckpointError> {
        let path = self.folder.join(&piece.file);
        if Some(piece.bytes) != (elems as u64).checked_mul(4) {
            return Err(CheckpointError::corrupt(
                &path,
                format!(
                    "`{name}` rows {:?}: {} bytes listed for {elems} values",
                    piece.rows, piece.bytes
                ),
            ));
        }
        // The file first: its real length is checked against the one the (validated)
        // metadata gives, which bounds the piece, before the piece is allocated.
        let file = self.file(&piece.file)?;
        let mut values = vec![0f32; elems];
        // SAFETY: any byte pattern is a valid f32; the slice covers exactly the vector.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), elems * 4) };
        read_at(file, &path, bytes, piece.offset)?;
        if crc32fast::hash(bytes) != piece.crc32 {
            return Err(CheckpointError::corrupt(
                &path,
                format!(
                    "`{name}` rows {:?}: checksum mismatch (the file was altered or damaged)",
                    piece.rows
                ),
            ));
        }
        Ok(values)
    }
}

fn read_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<(), CheckpointError> {
    file.read_exact_at(buf, offset).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => CheckpointError::corrupt(
            path,
            format!("ends before byte {}", offset + buf.len() as u64),
        ),
        _ => CheckpointError::io("reading", path, e),
    })
}
