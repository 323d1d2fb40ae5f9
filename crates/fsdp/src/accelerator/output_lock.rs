//! One run per output folder: a run holds an exclusive `flock` on `.fsdp_run.lock` in its
//! output folder for its whole life (the lock goes with the process, so a killed run frees
//! it), and a second run into the same folder is refused naming the first's process,
//! instead of both writing checkpoints, models and metrics into one place.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// The lock file a run holds in its output folder.
pub(super) const LOCK_FILE: &str = ".fsdp_run.lock";

/// An output folder this process holds.
#[derive(Debug)]
pub(super) struct OutputLock {
    dir: PathBuf,
    /// Held for the flock; the lock is released when it closes.
    _file: File,
}

impl OutputLock {
    /// The folder held.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }
}

/// This process and host, as the lock file records them.
fn holder() -> String {
    let host = super::host_name().unwrap_or_else(|| "this host".into());
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "process {} on {host}, since {} UTC",
        std::process::id(),
        super::tracking::run_name_at(since)
    )
}

/// Takes `dir` (made if missing) for this process, or says which run holds it.
pub(super) fn lock(dir: &Path) -> Result<OutputLock, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating it: {e}"))?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    // SAFETY: flock on a descriptor this process owns.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 };
    if !locked {
        let mut who = String::new();
        let _ = file.take(256).read_to_string(&mut who);
        let who = who.trim();
        let who = if who.is_empty() {
            "a process that has not yet said which"
        } else {
            who
        };
        return Err(format!(
            "another run is writing into it ({who}): two runs into one folder would mix their checkpoints, model and records; wait for that run, stop it, or choose another output folder"
        ));
    }
    let wrote = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", holder()));
    wrote.map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(OutputLock {
        dir: dir.to_path_buf(),
        _file: file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_naming_the_first_until_it_lets_go() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        let first = lock(&dir).unwrap();
        assert_eq!(first.dir(), dir);
        let e = lock(&dir).unwrap_err();
        assert!(
            e.contains(&format!("process {}", std::process::id())) && e.contains("another run"),
            "{e}"
        );
        drop(first);
        let again = lock(&dir).unwrap();
        let text = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        drop(again);
    }
}
