//! Saving with FULL_STATE_DICT: every parameter's rows, and each optimizer buffer's,
//! gathered unit by unit onto rank 0, which streams them into one file.

use std::path::Path;

use super::error::CheckpointError;
use super::format;
use super::save::{RankFolder, describe};
use super::tensor_file::{PlannedTensor, TensorFileWriter};
use crate::engine::{Fsdp, LocalRows};
use crate::optim::Optimizer;

/// FULL_STATE_DICT: `local(name, owned)` rows of every parameter gathered unit by unit onto
/// rank 0, which streams them into one file (the header planned from the names and shapes).
pub(super) fn write_full(
    m: &Fsdp,
    folder: &Path,
    file: &str,
    names: Vec<(String, Vec<usize>)>,
    local: &LocalRows<'_>,
) -> Result<RankFolder, CheckpointError> {
    let first = m.mesh().rank() == 0;
    let plan: Vec<PlannedTensor> = names
        .iter()
        .map(|(n, shape)| PlannedTensor {
            name: n.clone(),
            shape: shape.clone(),
        })
        .collect();
    let mut writer = if first && !plan.is_empty() {
        Some(TensorFileWriter::create(&folder.join(file), plan)?)
    } else {
        None
    };
    let mut failed = None;
    m.gather_rows_to_first(local, &mut |_, chunks| {
        if let (Some(w), None) = (writer.as_mut(), &failed)
            && let Err(e) = w.write_chunks(chunks)
        {
            failed = Some(e);
        }
        Ok(())
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    match writer {
        None => Ok(RankFolder::default()),
        Some(w) => {
            let written = w.finish()?;
            let shapes = names.into_iter().map(|(_, s)| {
                let rows = [0, s.first().copied().unwrap_or(1)];
                (s, rows)
            });
            Ok(describe(file, 0, &written, shapes))
        }
    }
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
    let first = m.mesh().rank() == 0;
    let plan: Vec<PlannedTensor> = tensors
        .iter()
        .map(|(n, s)| PlannedTensor {
            name: n.clone(),
            shape: s.clone(),
        })
        .collect();
    let mut writer = if first && !plan.is_empty() {
        Some(TensorFileWriter::create(
            &folder.join(format::FULL_OPTIMIZER_FILE),
            plan,
        )?)
    } else {
        None
    };
    let mut failed = None;
    for key in keys {
        m.gather_rows_to_first(
            &|name, _| m.optimizer_state_buffer(o, name, key),
            &mut |_, chunks| {
                if let (Some(w), None) = (writer.as_mut(), &failed)
                    && let Err(e) = w.write_chunks(chunks)
                {
                    failed = Some(e);
                }
                Ok(())
            },
        )?;
    }
    if let Some(e) = failed {
        return Err(e);
    }
    match writer {
        None => Ok(RankFolder::default()),
        Some(w) => {
            let written = w.finish()?;
            let shapes = tensors.into_iter().map(|(_, s)| {
                let rows = [0, s.first().copied().unwrap_or(1)];
                (s, rows)
            });
            Ok(describe(format::FULL_OPTIMIZER_FILE, 0, &written, shapes))
        }
    }
}
