//! Putting a checkpoint in place atomically: a save writes into a staging folder beside the
//! destination, syncs every file and folder, and then renames it into place — swapping it
//! with an existing checkpoint in one `renameat2(RENAME_EXCHANGE)` — so a process killed at
//! any moment leaves the previous checkpoint (or none) at the destination, never half a new
//! one. A save replaces only what is its own: a destination that holds anything but a
//! complete checkpoint of ours, whose manifest lists every file in it (`owned.rs`), is
//! refused untouched, and a staging folder is removed as
//! stale only when the job that made it no longer holds its lock. Also automatic naming
//! (`checkpoint_<n>`) and rotation (`total_limit`), which likewise removes only checkpoints.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::error::CheckpointError;
use super::format;
use super::owned::{Depth, Owned, check_owned, check_owned_as};

/// Prefix of staging folders (`.{name}.partial-{nonce}` beside the destination).
const STAGING: &str = ".partial-";
/// The lock file inside a staging folder, held (`flock`) by the saving process until the
/// folder is sealed for publishing.
const LOCK_FILE: &str = ".lock";

/// The staging folder for a save to `dest`.
fn staging_dir(dest: &Path, nonce: u64) -> PathBuf {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    dest.with_file_name(format!(".{name}{STAGING}{nonce:016x}"))
}

/// A staging folder this process made and holds locked: no other job's save removes it
/// while this process lives (the lock goes with the process, so a killed save's folder is
/// removed by the next save). Dropped, it removes what is left at its path: everything
/// when the save failed, nothing when the folder was published (renamed away).
pub(crate) struct Staging {
    path: PathBuf,
    /// Held for the flock; released after the folder is removed.
    _lock: File,
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Takes an exclusive `flock` on `file` without waiting: false when another holds it.
fn try_lock(file: &File) -> bool {
    // SAFETY: flock on a descriptor this process owns.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

impl Staging {
    /// Makes and locks a new staging folder for a save to `dest`.
    pub(crate) fn create(dest: &Path) -> Result<Staging, CheckpointError> {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ ((std::process::id() as u64) << 32);
        let path = staging_dir(dest, nonce);
        std::fs::create_dir(&path).map_err(|e| CheckpointError::io("creating", &path, e))?;
        let lock_path = path.join(LOCK_FILE);
        let lock =
            File::create(&lock_path).map_err(|e| CheckpointError::io("creating", &lock_path, e))?;
        if !try_lock(&lock) {
            return Err(CheckpointError::io(
                "locking",
                &lock_path,
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Staging { path, _lock: lock })
    }

    /// The folder.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the lock file before the folder is published (the lock itself is kept
    /// until this value is dropped): the published folder holds only what the save wrote.
    pub(crate) fn seal(&mut self) -> Result<(), CheckpointError> {
        let lock_path = self.path.join(LOCK_FILE);
        std::fs::remove_file(&lock_path).map_err(|e| CheckpointError::io("removing", &lock_path, e))
    }
}

/// What a save to `dest` replaces: nothing when it does not exist or is an empty folder, a
/// checkpoint of ours holding nothing but what its save wrote (`owned::check_owned`), or
/// else the reason it may not be replaced.
fn replaceable(dest: &Path, depth: Depth) -> Result<Option<Owned>, String> {
    let meta = match std::fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot be examined ({e})")),
        Ok(m) => m,
    };
    if meta.file_type().is_symlink() {
        return Err("is a symbolic link; save to the folder it points to".into());
    }
    if !meta.is_dir() {
        return Err("exists and is not a folder".into());
    }
    match std::fs::read_dir(dest) {
        Ok(mut e) => {
            if e.next().is_none() {
                return Ok(None);
            }
        }
        Err(e) => return Err(format!("cannot be listed ({e})")),
    }
    check_owned_as(dest, depth).map(Some).map_err(|n| {
        let inside = n.path.strip_prefix(dest).ok().filter(|p| !p.as_os_str().is_empty());
        match inside {
            Some(inner) => format!(
                "holds `{}`: {} (a checkpoint is replaced only when it holds nothing but what its save wrote)",
                inner.display(),
                n.reason
            ),
            None => format!("is not a checkpoint a save may replace: {}", n.reason),
        }
    })
}

/// Checks that a save may replace `dest` (see `replaceable`): what it holds, or an error
/// naming what is in the way, before anything is written. `Depth::Sizes` when the save
/// begins (an asynchronous save's caller waits for it), `Depth::Contents` right before the
/// new checkpoint takes the old one's place.
pub(crate) fn check_replaceable(
    dest: &Path,
    depth: Depth,
) -> Result<Option<Owned>, CheckpointError> {
    replaceable(dest, depth).map_err(|reason| CheckpointError::Occupied {
        path: dest.to_path_buf(),
        reason,
    })
}

/// Removes staging folders left by saves to `dest` whose process is gone (their lock is
/// free); folders another live job is writing, and folders without our lock file, stay.
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
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if !is_dir || !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let path = entry.path();
        let Ok(lock) = File::open(path.join(LOCK_FILE)) else {
            continue;
        };
        if try_lock(&lock) {
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

/// Writes a small file and syncs it; returns its size and checksum.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<format::FileSum, CheckpointError> {
    use std::io::Write;
    let mut f =
        std::fs::File::create(path).map_err(|e| CheckpointError::io("creating", path, e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| CheckpointError::io("writing", path, e))?;
    Ok(format::FileSum::of(bytes))
}

fn c_path(path: &Path) -> Result<CString, CheckpointError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| CheckpointError::InvalidPath { path: path.into() })
}

/// Moves the complete `staging` folder to `dest`: a rename when `dest` does not exist, an
/// atomic exchange when it does (the old checkpoint is then removed) — only after checking
/// again that `dest` is a checkpoint a save may replace. On file systems without exchange
/// the old folder is moved aside first (a crash in between leaves it beside the staging
/// folder's name with `.old` appended).
pub(crate) fn publish(staging: &mut Staging, dest: &Path) -> Result<(), CheckpointError> {
    let previous = check_replaceable(dest, Depth::Contents)?;
    // After the exchange (or the move aside) the previous folder is at `at`: only what its
    // save wrote is removed from it.
    let remove_previous = |at: &Path| match &previous {
        Some(owned) => owned.remove_at(at),
        None => std::fs::remove_dir(at)
            .map_err(|e| CheckpointError::io("removing the previous (empty) folder", at, e)),
    };
    staging.seal()?;
    let staging = staging.path.clone();
    let staging = staging.as_path();
    let parent = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if std::fs::symlink_metadata(dest).is_err() {
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
        let mut aside = staging.as_os_str().to_owned();
        aside.push(".old");
        let aside = PathBuf::from(aside);
        std::fs::rename(dest, &aside).map_err(|e| CheckpointError::io("renaming", dest, e))?;
        std::fs::rename(staging, dest).map_err(|e| CheckpointError::io("renaming", staging, e))?;
        sync_dir(parent)?;
        return remove_previous(&aside);
    }
    sync_dir(parent)?;
    // `staging` now holds the previous checkpoint.
    remove_previous(staging)
}

/// Names a save that replaces or joins a model folder writes (transformers'
/// `save_pretrained` names): a new save removes those of an earlier one it does not write.
fn is_weights_entry(name: &str) -> bool {
    name == "model.safetensors"
        || name == "model.safetensors.index.json"
        || name
            .strip_prefix("model-")
            .and_then(|r| r.strip_suffix(".safetensors"))
            .and_then(|r| r.split_once("-of-"))
            .is_some_and(|(a, b)| {
                [a, b]
                    .iter()
                    .all(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
            })
}

/// Moves the files of the complete `staging` folder into the folder `dest` (made when it
/// does not exist), each replacing the file of that name atomically, and then removes the
/// weight files of an earlier save that this one did not write. Everything else in `dest`
/// (a tokenizer, a README) stays: `dest` is the user's folder, not ours.
pub(crate) fn publish_into(staging: &mut Staging, dest: &Path) -> Result<(), CheckpointError> {
    staging.seal()?;
    let parent = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let from = staging.path.clone();
    match std::fs::metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::rename(&from, dest).map_err(|e| CheckpointError::io("renaming", &from, e))?;
            return sync_dir(parent);
        }
        Err(e) => return Err(CheckpointError::io("examining", dest, e)),
        Ok(m) if !m.is_dir() => {
            return Err(CheckpointError::Occupied {
                path: dest.to_path_buf(),
                reason: "exists and is not a folder".into(),
            });
        }
        Ok(_) => {}
    }
    let list = |dir: &Path| -> Result<Vec<String>, CheckpointError> {
        Ok(std::fs::read_dir(dir)
            .map_err(|e| CheckpointError::io("listing", dir, e))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect())
    };
    let new = list(&from)?;
    if let Some(taken) = new.iter().find(|n| dest.join(n).is_dir()) {
        return Err(CheckpointError::Occupied {
            path: dest.join(taken),
            reason: "is a folder where the save writes a file".into(),
        });
    }
    // Weights first, the index and config.json after, so the documents never name files
    // that are not there yet.
    let mut order = new.clone();
    order.sort_by_key(|n| (!n.ends_with(".safetensors"), n.clone()));
    for name in &order {
        let src = from.join(name);
        std::fs::rename(&src, dest.join(name))
            .map_err(|e| CheckpointError::io("renaming", &src, e))?;
    }
    for old in list(dest)? {
        let path = dest.join(&old);
        if is_weights_entry(&old) && !new.contains(&old) && path.is_file() {
            std::fs::remove_file(&path)
                .map_err(|e| CheckpointError::io("removing an earlier weights file", path, e))?;
        }
    }
    sync_dir(dest)?;
    std::fs::remove_dir(&from).map_err(|e| CheckpointError::io("removing", &from, e))
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

/// Removes the oldest automatic checkpoints so at most `limit` remain. Folders named like
/// them without a checkpoint document of ours are neither counted nor removed; one that
/// holds anything its save did not write stays, with a warning naming it.
pub(crate) fn rotate(project: &Path, limit: usize) -> Result<(), CheckpointError> {
    let all: Vec<(u64, PathBuf)> = numbered(project)
        .into_iter()
        .filter(|(_, p)| {
            format::run_document(p)
                .is_some_and(|d| format::read_document::<format::CheckpointDoc>(&d).is_ok())
        })
        .collect();
    let excess = all.len().saturating_sub(limit);
    for (_, path) in all.into_iter().take(excess) {
        match check_owned(&path) {
            Ok(owned) => owned.remove_at(&path)?,
            Err(n) => tracing::warn!(
                "total_limit: keeping {}: {}: {}",
                path.display(),
                n.path.display(),
                n.reason
            ),
        }
    }
    Ok(())
}
