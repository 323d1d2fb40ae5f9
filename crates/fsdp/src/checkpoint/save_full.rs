//! Saving with FULL_STATE_DICT: every parameter's rows, and each optimizer buffer's,
//! gathered unit by unit onto rank 0, which streams them into one file.

use std::path::Path;

use super::error::CheckpointError;
use super::format;
use super::report::{RankFolder, describe};
use super::tensor_file::{PlannedTensor, TensorFileWriter};
use crate::engine::{Fsdp, LocalRows};
use crate::optim::Optimizer;

/// Rank 0's file of a FULL save: planned from the tensors' names and shapes, written as the
/// gathers hand it their rows (the first write error kept, later rows dropped, so every rank
/// still takes part in the gathers), described when finished. Other ranks hold none.
struct FullFile<'a> {
    name: &'a str,
    writer: Option<TensorFileWriter>,
    failed: Option<CheckpointError>,
    shapes: Vec<Vec<usize>>,
}

impl<'a> FullFile<'a> {
    fn create(
        m: &Fsdp,
        folder: &Path,
        name: &'a str,
        tensors: Vec<(String, Vec<usize>)>,
    ) -> Result<FullFile<'a>, CheckpointError> {
        let plan: Vec<PlannedTensor> = tensors
            .iter()
            .map(|(n, shape)| PlannedTensor {
                name: n.clone(),
                shape: shape.clone(),
            })
            .collect();
        let writer = if m.mesh().rank() == 0 && !plan.is_empty() {
            Some(TensorFileWriter::create(&folder.join(name), plan)?)
        } else {
            None
        };
        Ok(FullFile {
            name,
            writer,
            failed: None,
            shapes: tensors.into_iter().map(|(_, s)| s).collect(),
        })
    }

    /// The next tensor's rows, in the planned order.
    fn write(&mut self, chunks: &[&[f32]]) {
        if let (Some(w), None) = (self.writer.as_mut(), &self.failed)
            && let Err(e) = w.write_chunks(chunks)
        {
            self.failed = Some(e);
        }
    }

    fn finish(self) -> Result<RankFolder, CheckpointError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        match self.writer {
            None => Ok(RankFolder::default()),
            Some(w) => {
                let written = w.finish()?;
                let shapes = self.shapes.into_iter().map(|s| {
                    let rows = [0, s.first().copied().unwrap_or(1)];
                    (s, rows)
                });
                Ok(describe(self.name, 0, &written, shapes))
            }
        }
    }
}

/// FULL_STATE_DICT: `local(name, owned)` rows of every parameter gathered unit by unit onto
/// rank 0, which streams them into one file (the header planned from the names and shapes).
pub(super) fn write_full(
    m: &Fsdp,
    folder: &Path,
    file: &str,
    names: Vec<(String, Vec<usize>)>,
    local: &LocalRows<'_>,
) -> Result<RankFolder, CheckpointError> {
    let mut out = FullFile::create(m, folder, file, names)?;
    m.gather_rows_to_first(local, &mut |_, chunks| {
        out.write(chunks);
        Ok(())
    })?;
    out.finish()
}

/// The state names (`exp_avg`, ...) the optimizer holds for any of `names`, sorted.
pub(super) fn state_keys(
    m: &Fsdp,
    o: &dyn Optimizer,
    names: &[(String, Vec<usize>)],
) -> Vec<String> {
    let mut keys: Vec<String> = names
        .iter()
        .filter_map(|(n, _)| m.optimizer_state_info(o, n))
        .flat_map(|(_, keys)| keys)
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// FULL_STATE_DICT optimizer state: each state name's rows gathered like the parameters.
pub(super) fn write_full_state(
    m: &Fsdp,
    o: &dyn Optimizer,
    folder: &Path,
    keys: &[String],
    tensors: Vec<(String, Vec<usize>)>,
) -> Result<RankFolder, CheckpointError> {
    let mut out = FullFile::create(m, folder, format::FULL_OPTIMIZER_FILE, tensors)?;
    for key in keys {
        m.gather_rows_to_first(
            &|name, _| m.optimizer_state_buffer(o, name, key),
            &mut |_, chunks| {
                out.write(chunks);
                Ok(())
            },
        )?;
    }
    out.finish()
}
