//! The per-job scratch folder offloaded state lives in: private to this process (0700, files
//! 0600), named after the host, process and rank, checked for free space against the plan
//! before anything is written, and removed when dropped. Folders left by a process that
//! died (a crash, SIGKILL) are never read — each job makes its own — and are removed by the
//! next job on the same host that finds their process gone.

use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Names every scratch folder starts with.
const PREFIX: &str = "fsdp-offload-";

/// A file inside each scratch folder saying what it is (only folders holding it are ever
/// removed as stale).
const MARKER: &str = "FSDP_OFFLOAD_SCRATCH";

/// Why offloaded state could not be kept on disk.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// The folder could not be made or written.
    #[error("offload folder {path}: {what}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What was being done.
        what: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// An earlier write failed, so the files no longer hold a consistent state: every later
    /// use of the tier fails too.
    #[error("offload folder {path}: unusable after an earlier failure: {first}")]
    Failed {
        /// The folder.
        path: PathBuf,
        /// The first failure.
        first: String,
    },
    /// The disk holding the folder has too little free space for the plan.
    #[error(
        "offload folder {path}: {needed} bytes are needed for this rank's offloaded state ({what}) but only {available} are free on its file system"
    )]
    NoSpace {
        /// The folder.
        path: PathBuf,
        /// Bytes the plan needs.
        needed: u64,
        /// Bytes free.
        available: u64,
        /// What the bytes are for.
        what: String,
    },
}

/// This process's scratch folder; removed with everything in it when dropped.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Makes `parent/fsdp-offload-<host>-<pid>-rank<rank>-<n>` (`n` counts this process's
    /// engines; `parent` is made if missing), after
    /// removing stale folders of dead processes of this host and checking that `needed`
    /// bytes (`what`) are free there.
    pub fn create(
        parent: &Path,
        rank: usize,
        needed: u64,
        what: &str,
    ) -> Result<ScratchDir, OffloadError> {
        let io = |path: &Path, what: &str| {
            let path = path.to_path_buf();
            let what = what.to_string();
            move |source| OffloadError::Io { path, what, source }
        };
        std::fs::create_dir_all(parent).map_err(io(parent, "creating the folder"))?;
        let host = host_name();
        remove_stale(parent, &host);
        let available = free_bytes(parent).map_err(io(parent, "reading its free space"))?;
        if available < needed {
            return Err(OffloadError::NoSpace {
                path: parent.to_path_buf(),
                needed,
                available,
                what: what.to_string(),
            });
        }
        static ENGINES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = ENGINES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let path = parent.join(format!("{PREFIX}{host}-{pid}-rank{rank}-{n}"));
        // `create` fails on an existing folder: nothing of another engine is ever reused.
        DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(io(&path, "creating the scratch folder"))?;
        let dir = ScratchDir { path };
        dir.create_file(MARKER)?;
        Ok(dir)
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates (or truncates) file `name` inside, readable and writable by this user only.
    pub fn create_file(&self, name: &str) -> Result<File, OffloadError> {
        let path = self.path.join(name);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(|source| OffloadError::Io {
                path,
                what: "creating the file".into(),
                source,
            })
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!("removing offload folder {}: {e}", self.path.display());
        }
    }
}

/// This host's name (scratch folders of several hosts may share a network file system).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length; gethostname NUL-terminates within it
    // or truncates, and the last byte stays 0.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    let name = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(0);
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    let clean: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if clean.is_empty() {
        "host".into()
    } else {
        clean
    }
}

/// Bytes free for this user on the file system holding `dir` (what the disk tier checks the
/// plan against).
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("the path holds a NUL byte"))?;
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statvfs.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Removes `parent`'s scratch folders of this host whose process no longer exists (and that
/// carry the marker); anything else is left alone.
fn remove_stale(parent: &Path, host: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let mine = format!("{PREFIX}{host}-");
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&mine) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        let path = entry.path();
        if pid_alive(pid) || !path.join(MARKER).is_file() {
            continue;
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => tracing::info!(
                "removed offload folder {} left by process {pid}, which is gone",
                path.display()
            ),
            Err(e) => tracing::warn!("stale offload folder {}: {e}", path.display()),
        }
    }
}

/// Whether process `pid` exists on this host.
fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn private_folder_removed_on_drop_and_stale_ones_of_dead_processes_removed() {
        let parent = std::env::temp_dir().join(format!("fsdp-scratch-test-{}", std::process::id()));
        let host = host_name();
        // A folder a crashed process left (pid 0x7fff_fff0 does not exist), one without the
        // marker (not ours: kept), and a user's folder (kept).
        let stale = parent.join(format!("{PREFIX}{host}-{}-rank0-0", 0x7fff_fff0));
        let foreign = parent.join(format!("{PREFIX}{host}-{}-rank1-0", 0x7fff_fff1));
        let user = parent.join("data");
        for d in [&stale, &foreign, &user] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(stale.join(MARKER), b"").unwrap();
        let dir = ScratchDir::create(&parent, 3, 1, "test").unwrap();
        let second = ScratchDir::create(&parent, 3, 1, "test").unwrap();
        assert_ne!(
            dir.path(),
            second.path(),
            "two engines of one rank in one process"
        );
        drop(second);
        assert!(
            dir.path().is_dir(),
            "dropping one engine's folder left the other's"
        );
        assert!(
            !stale.exists(),
            "a dead process's scratch folder is removed"
        );
        assert!(
            foreign.exists() && user.exists(),
            "folders without the marker are kept"
        );
        let mode = std::fs::metadata(dir.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        dir.create_file("unit-0.params").unwrap();
        let mode = std::fs::metadata(dir.path().join("unit-0.params"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
        let path = dir.path().to_path_buf();
        drop(dir);
        assert!(!path.exists(), "the scratch folder is removed when dropped");
        let err = ScratchDir::create(&parent, 0, u64::MAX, "the plan").unwrap_err();
        assert!(
            matches!(&err, OffloadError::NoSpace { path, .. } if path == &parent),
            "{err}"
        );
        assert!(err.to_string().contains(&format!("{}", u64::MAX)), "{err}");
        std::fs::remove_dir_all(&parent).unwrap();
    }
}
