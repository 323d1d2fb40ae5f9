//! Opening what a checkpoint's documents name, as an untrusted file would need: names are
//! plain file names inside the folder (never `..`, a path, or an absolute name), only
//! regular files are opened (a FIFO or device in a shard's place is an error at once, not
//! a hang), and whole-file reads are bounded before anything is allocated.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path};

use super::error::CheckpointError;

/// Checks that `name`, read from document `doc`, is one plain file name: a single normal
/// path component, so joining it to the folder stays inside the folder.
pub(crate) fn plain_name(doc: &Path, name: &str) -> Result<(), CheckpointError> {
    let mut parts = Path::new(name).components();
    let ok = matches!(
        (parts.next(), parts.next()),
        (Some(Component::Normal(_)), None)
    ) && !name.contains(['/', '\\', '\0']);
    if ok {
        Ok(())
    } else {
        Err(CheckpointError::corrupt(
            doc,
            format!(
                "names the file `{}`, which is not a plain file name inside the checkpoint folder",
                name.escape_debug()
            ),
        ))
    }
}

/// What kind of thing is at a path, for messages.
fn kind_of(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a folder"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading if it is a regular file (symbolic links followed), without
/// blocking on a FIFO; `what` says what the file holds, for a missing file's error.
pub(crate) fn open_regular(path: &Path, what: &str) -> Result<File, CheckpointError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => CheckpointError::Missing {
                path: path.to_path_buf(),
                what: what.to_string(),
            },
            _ => CheckpointError::io("opening", path, e),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| CheckpointError::io("reading", path, e))?;
    if !meta.is_file() {
        return Err(CheckpointError::corrupt(
            path,
            format!(
                "{} where {what} should be: only regular files are read",
                kind_of(meta.file_type())
            ),
        ));
    }
    Ok(file)
}

/// The whole of regular file `path`, refused when it is larger than `limit` bytes.
pub(crate) fn read_bounded(
    path: &Path,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>, CheckpointError> {
    let file = open_regular(path, what)?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| CheckpointError::io("reading", path, e))?;
    if bytes.len() as u64 > limit {
        return Err(CheckpointError::corrupt(
            path,
            format!("larger than {limit} bytes, which no {what} is"),
        ));
    }
    Ok(bytes)
}

/// The process's file mode creation mask (`Umask:` in `/proc/self/status`, which reads it
/// without changing it; 022, the usual one, where that is unreadable).
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find_map(|l| l.strip_prefix("Umask:"))?;
            u32::from_str_radix(line.trim(), 8).ok()
        })
        .unwrap_or(0o022)
}

/// Gives `path` the permissions an ordinarily created file gets (0666 less the umask: 0644
/// as a rule): for outputs meant to be shared, such as a merged model, which the temporary
/// file it was written through would leave readable by its owner only.
pub(crate) fn make_shareable(path: &Path) -> Result<(), CheckpointError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666 & !umask()))
        .map_err(|e| CheckpointError::io("setting the permissions of", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_pass() {
        let doc = Path::new("m/metadata.json");
        for ok in ["rank_0.safetensors", "__0_0.distcp", "a..b", ".hidden"] {
            assert!(plain_name(doc, ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            "/etc/passwd",
            "a\\b",
            "x\0y",
            "./x",
            "x/",
        ] {
            let err = plain_name(doc, bad).unwrap_err().to_string();
            assert!(err.contains("m/metadata.json"), "{bad}: {err}");
        }
    }

    #[test]
    fn fifos_and_devices_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("rank_0.safetensors");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = open_regular(&fifo, "a shard").unwrap_err().to_string();
        assert!(err.contains("a FIFO") && err.contains("rank_0"), "{err}");
        let err = read_bounded(Path::new("/dev/zero"), 1 << 20, "document")
            .unwrap_err()
            .to_string();
        assert!(err.contains("a device"), "{err}");
        let err = open_regular(dir.path(), "a shard").unwrap_err().to_string();
        assert!(err.contains("a folder"), "{err}");
        let big = dir.path().join("big.json");
        std::fs::write(&big, vec![b' '; 100]).unwrap();
        let err = read_bounded(&big, 99, "document").unwrap_err().to_string();
        assert!(err.contains("larger than 99 bytes"), "{err}");
        assert_eq!(read_bounded(&big, 100, "document").unwrap().len(), 100);
    }
}
