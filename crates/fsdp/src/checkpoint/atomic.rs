//! Putting a checkpoint in place atomically: a save writes into a staging folder beside the
//! destination, syncs every file and folder, and then renames it into place — swapping it
//! with an existing checkpoint in one `renameat2(RENAME_EXCHANGE)` — so a process killed at
//! any moment leaves the previous checkpoint (or none) at the destination, never half a new
//! one. Also automatic naming (`checkpoint_<n>`) and rotation (`total_limit`).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::error::CheckpointError;

/// Prefix of staging folders (`.{name}.partial-{nonce}` beside the destination).
const STAGING: &str = ".partial-";

/// The staging folder for a save to `dest`.
pub(crate) fn staging_dir(dest: &Path, nonce: u64) -> PathBuf {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    dest.with_file_name(format!(".{name}{STAGING}{nonce:016x}"))
}

/// Removes staging folders left by saves to `dest` that were killed.
pub(crate) fn remove_stale(dest: &Path) -> Result<(), CheckpointError> {
    let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) else {
        return Ok(());
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let prefix = format!(".{}{STAGING}", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let path = entry.path();
            std::fs::remove_dir_all(&path)
                .map_err(|e| CheckpointError::io("removing a stale staging folder", path, e))?;
        }
    }
    Ok(())
}

/// Syncs a folder's entries to disk, so files created and renamed in it survive a crash.
pub(crate) fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| CheckpointError::io("syncing", path, e))
}

/// Writes a small file and syncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    use std::io::Write;
    let mut f =
        std::fs::File::create(path).map_err(|e| CheckpointError::io("creating", path, e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| CheckpointError::io("writing", path, e))
}

fn c_path(path: &Path) -> Result<CString, CheckpointError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| CheckpointError::Usage(format!("{}: a path with a NUL byte", path.display())))
}

/// Moves the complete `staging` folder to `dest`: a rename when `dest` does not exist, an
/// atomic exchange when it does (the old checkpoint is then removed). On file systems
/// without exchange the old folder is moved aside first (a crash in between leaves it at
/// `.{name}.partial-*`, removed by the next save).
pub(crate) fn publish(staging: &Path, dest: &Path) -> Result<(), CheckpointError> {
    let parent = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dest.exists() {
        std::fs::rename(staging, dest).map_err(|e| CheckpointError::io("renaming", staging, e))?;
        return sync_dir(parent);
    }
    let (from, to) = (c_path(staging)?, c_path(dest)?);
    // SAFETY: both paths are NUL-terminated C strings that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if !matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) {
            return Err(CheckpointError::io("exchanging", dest, err));
        }
        // No atomic exchange here: move the old one aside, then the new one in.
        let aside = staging.with_extension("old");
        std::fs::rename(dest, &aside).map_err(|e| CheckpointError::io("renaming", dest, e))?;
        std::fs::rename(staging, dest).map_err(|e| CheckpointError::io("renaming", staging, e))?;
        sync_dir(parent)?;
        return std::fs::remove_dir_all(&aside)
            .map_err(|e| CheckpointError::io("removing the previous checkpoint", aside, e));
    }
    sync_dir(parent)?;
    // `staging` now holds the previous checkpoint.
    std::fs::remove_dir_all(staging)
        .map_err(|e| CheckpointError::io("removing the previous checkpoint", staging, e))
}

/// `checkpoint_<n>` folders in `project`, by `n`.
fn numbered(project: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(project)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("checkpoint_")?.parse::<u64>().ok()?;
            e.path().is_dir().then(|| (n, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// The next automatic checkpoint folder in `project` (`checkpoint_<n>`, after the highest).
pub(crate) fn next_numbered(project: &Path) -> PathBuf {
    let n = numbered(project).last().map_or(0, |(n, _)| n + 1);
    project.join(format!("checkpoint_{n}"))
}

/// Removes the oldest automatic checkpoints so at most `limit` remain.
pub(crate) fn rotate(project: &Path, limit: usize) -> Result<(), CheckpointError> {
    let all = numbered(project);
    let excess = all.len().saturating_sub(limit);
    for (_, path) in all.into_iter().take(excess) {
        std::fs::remove_dir_all(&path)
            .map_err(|e| CheckpointError::io("removing an old checkpoint", path, e))?;
    }
    Ok(())
}
