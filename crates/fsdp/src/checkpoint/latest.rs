//! Finding the checkpoint a restarted job resumes from: the complete checkpoint of ours (in
//! our format, or a PyTorch distributed checkpoint we wrote, with its run state) with
//! the highest saved step among a folder's subfolders (and its `checkpoints/`, where automatic
//! naming puts them), whatever they are called (`checkpoint_<n>`, `step_<n>`, `epoch_<n>`).
//! Saves are atomic, so a save killed midway left only a staging folder, which is not a
//! candidate; a checkpoint whose document cannot be read is skipped with a warning naming it.

use std::path::{Path, PathBuf};

use super::error::CheckpointError;
use super::format::{self, CheckpointDoc};

/// The newest complete checkpoint under `folder` and its step, or `None` when there is none
/// (a job's first attempt). A folder that does not exist holds none; one that cannot be
/// listed is an error.
pub fn latest_checkpoint(folder: &Path) -> Result<Option<(PathBuf, u64)>, CheckpointError> {
    let mut best: Option<(PathBuf, u64)> = None;
    for (path, doc) in checkpoints_in(folder)? {
        match format::read_document::<CheckpointDoc>(&doc) {
            Ok(d) => {
                let newer = best
                    .as_ref()
                    .is_none_or(|(p, step)| (d.step, modified(&path)) > (*step, modified(p)));
                if newer {
                    best = Some((path, d.step));
                }
            }
            Err(e) => tracing::warn!("not resuming from {}: {e}", path.display()),
        }
    }
    Ok(best)
}

/// The subfolders of `folder` and of its `checkpoints/` that hold a checkpoint document
/// (staging folders, `.name.partial-...`, left out), with the document's path.
fn checkpoints_in(folder: &Path) -> Result<Vec<(PathBuf, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    for parent in [folder.to_path_buf(), folder.join("checkpoints")] {
        let entries = match std::fs::read_dir(&parent) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(CheckpointError::io("listing", &parent, e)),
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            if let Some(doc) = format::run_document(&path) {
                out.push((path, doc));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// What an earlier training run left in `folder` that a new one would replace or resume by
/// mistake: a saved model (`model/` with `model.safetensors` or its index) and every
/// checkpoint [`latest_checkpoint`] could pick. Empty for a new or unrelated folder.
pub fn earlier_run_outputs(folder: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let model = folder.join("model");
    let saved = ["model.safetensors", "model.safetensors.index.json"]
        .iter()
        .any(|f| model.join(f).is_file());
    let mut out: Vec<PathBuf> = saved.then_some(model).into_iter().collect();
    out.extend(checkpoints_in(folder)?.into_iter().map(|(p, _)| p));
    Ok(out)
}

/// Removes every checkpoint [`earlier_run_outputs`] finds in `folder` (the saved model
/// stays: a new run's save replaces it), once each is found to hold nothing but what its
/// save wrote; otherwise an error naming the first file that is not, and nothing is removed.
pub(crate) fn remove_earlier_checkpoints(folder: &Path) -> Result<(), CheckpointError> {
    let owned = checkpoints_in(folder)?
        .into_iter()
        .map(|(path, _)| {
            super::owned::check_owned(&path)
                .map(|o| (path, o))
                .map_err(super::owned::NotOwned::refusal)
        })
        .collect::<Result<Vec<_>, _>>()?;
    for (path, o) in owned {
        o.remove_at(&path)?;
    }
    Ok(())
}

/// When the checkpoint's document was written (ties of step go to the newer save).
fn modified(checkpoint: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(format::run_document(checkpoint)?)
        .and_then(|m| m.modified())
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder with a checkpoint document of step `step` (what `latest_checkpoint` reads).
    fn checkpoint(at: &Path, step: u64) {
        std::fs::create_dir_all(at).unwrap();
        let doc = CheckpointDoc {
            format: format::FORMAT.into(),
            version: format::VERSION,
            state_dict_type: "SHARDED_STATE_DICT".into(),
            world_size: 2,
            models: 1,
            optimizers: 1,
            schedulers: 0,
            step,
            data: serde_json::Value::Null,
            grad_scalers: Vec::new(),
            documents: Default::default(),
            files: Default::default(),
        };
        let bytes = format::document_bytes(&doc).unwrap();
        std::fs::write(at.join(format::CHECKPOINT_FILE), bytes).unwrap();
    }

    #[test]
    fn the_highest_saved_step_wins_whatever_the_names() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        assert_eq!(latest_checkpoint(&root.join("missing")).unwrap(), None);
        assert_eq!(latest_checkpoint(root).unwrap(), None);
        checkpoint(&root.join("step_10"), 10);
        checkpoint(&root.join("step_9"), 9); // a name that sorts after step_10
        checkpoint(&root.join("checkpoints/checkpoint_0"), 4); // automatic naming
        // Not candidates: a save's staging folder, a folder of the user's, a damaged document.
        checkpoint(&root.join(".step_20.partial-00ff"), 20);
        std::fs::create_dir_all(root.join("notes")).unwrap();
        checkpoint(&root.join("step_30"), 30);
        let doc = root.join("step_30").join(format::CHECKPOINT_FILE);
        let edited = std::fs::read_to_string(&doc)
            .unwrap()
            .replace("\"step\": 30", "\"step\": 31");
        std::fs::write(&doc, edited).unwrap();
        assert_eq!(
            latest_checkpoint(root).unwrap(),
            Some((root.join("step_10"), 10))
        );
        checkpoint(&root.join("checkpoints/checkpoint_1"), 12);
        assert_eq!(
            latest_checkpoint(root).unwrap(),
            Some((root.join("checkpoints/checkpoint_1"), 12))
        );
    }
}
