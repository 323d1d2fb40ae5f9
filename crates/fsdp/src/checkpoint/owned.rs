//! Removing only what a save wrote. A checkpoint folder is replaced, rotated away or removed
//! only when its run document (`fsdp_checkpoint.json`, or `fsdp_run_state.json` of a PyTorch
//! distributed checkpoint we wrote) verifies and its manifest lists every file in the folder
//! with the size and CRC-32 the file has now. Anything else present — a user's file or
//! folder, a link, a FIFO, an edited file, a second document — refuses the removal, naming
//! it, before anything is removed; and a removal then deletes the listed files one by one
//! and only empty folders, so what appears meanwhile stays too.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use super::error::CheckpointError;
use super::format::{self, CheckpointDoc, FileSum};

/// A checkpoint folder found to hold nothing but what a save wrote: what removing it deletes.
#[derive(Debug)]
pub(crate) struct Owned {
    /// The run document, relative to the folder.
    document: PathBuf,
    /// Every other file, relative to the folder.
    files: Vec<PathBuf>,
    /// Every folder inside it, relative, deepest first.
    folders: Vec<PathBuf>,
}

/// Why a folder is not provably ours: the entry that is not, and what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NotOwned {
    /// The entry (the folder itself when its document is at fault).
    pub(crate) path: PathBuf,
    /// What is wrong.
    pub(crate) reason: String,
}

impl NotOwned {
    fn new(path: impl Into<PathBuf>, reason: impl Into<String>) -> NotOwned {
        NotOwned {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// The error a removal that was refused reports.
    pub(crate) fn refusal(self) -> CheckpointError {
        CheckpointError::NotOurs {
            path: self.path,
            reason: self.reason,
        }
    }
}

/// The CRC-32 and size of the file at `path`, read in blocks.
fn sum_of_file(path: &Path) -> std::io::Result<FileSum> {
    let mut file = std::fs::File::open(path)?;
    let mut crc = crc32fast::Hasher::new();
    let mut block = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut block)?;
        if n == 0 {
            break;
        }
        crc.update(&block[..n]);
        bytes += n as u64;
    }
    Ok(FileSum {
        bytes,
        crc32: crc.finalize(),
    })
}

/// The run document of `checkpoint` and its manifest, or why there is none to trust.
fn manifest(checkpoint: &Path) -> Result<(PathBuf, BTreeMap<String, FileSum>), NotOwned> {
    let Some(document) = format::run_document(checkpoint) else {
        return Err(NotOwned::new(
            checkpoint,
            format!(
                "holds no {} or {}: it is not a checkpoint written by save_state",
                format::CHECKPOINT_FILE,
                format::RUN_STATE_FILE
            ),
        ));
    };
    let doc: CheckpointDoc = format::read_document(&document)
        .map_err(|e| NotOwned::new(&document, format!("cannot be trusted ({e})")))?;
    if doc.files.is_empty() {
        return Err(NotOwned::new(
            &document,
            "lists no files: the checkpoint was written by an fsdp-rs without file manifests, so what it holds cannot be told from what someone added; remove it yourself if it is yours",
        ));
    }
    let name = document.file_name().map(PathBuf::from).unwrap_or_default();
    Ok((name, doc.files))
}

/// How much of each file [`check_owned_as`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Depth {
    /// Names and sizes only (a first look that costs no reading, before the real check).
    Sizes,
    /// Every byte, against the listed checksum.
    Contents,
}

/// Checks that `checkpoint` holds nothing but the files its manifest lists, each with its
/// listed size and checksum (listed files that are gone are allowed: removing the rest is
/// still removing only ours). Reads every file.
pub(crate) fn check_owned(checkpoint: &Path) -> Result<Owned, NotOwned> {
    check_owned_as(checkpoint, Depth::Contents)
}

/// [`check_owned`], reading as much of each file as `depth` says.
pub(crate) fn check_owned_as(checkpoint: &Path, depth: Depth) -> Result<Owned, NotOwned> {
    match std::fs::symlink_metadata(checkpoint) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(NotOwned::new(
                checkpoint,
                "is a symbolic link: only a folder a save wrote is removed",
            ));
        }
        Ok(m) if !m.is_dir() => return Err(NotOwned::new(checkpoint, "is not a folder")),
        Ok(_) => {}
        Err(e) => {
            return Err(NotOwned::new(
                checkpoint,
                format!("cannot be examined ({e})"),
            ));
        }
    }
    let (document, listed) = manifest(checkpoint)?;
    let listed_folders: BTreeSet<PathBuf> = listed
        .keys()
        .flat_map(|f| Path::new(f).ancestors().skip(1).map(Path::to_path_buf))
        .filter(|p| !p.as_os_str().is_empty())
        .collect();
    let mut owned = Owned {
        document,
        files: Vec::new(),
        folders: Vec::new(),
    };
    let mut pending = vec![PathBuf::new()];
    while let Some(rel) = pending.pop() {
        let dir = checkpoint.join(&rel);
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| NotOwned::new(&dir, format!("cannot be listed ({e})")))?;
        for entry in entries {
            let entry =
                entry.map_err(|e| NotOwned::new(&dir, format!("cannot be listed ({e})")))?;
            let path = entry.path();
            let inner = rel.join(entry.file_name());
            let kind = entry
                .file_type()
                .map_err(|e| NotOwned::new(&path, format!("cannot be examined ({e})")))?;
            if inner == owned.document {
                continue;
            }
            if kind.is_dir() && listed_folders.contains(&inner) {
                owned.folders.push(inner.clone());
                pending.push(inner);
                continue;
            }
            let key = inner.to_string_lossy().into_owned();
            let Some(want) = listed.get(&key).filter(|_| kind.is_file()) else {
                let what = if kind.is_dir() { "a folder" } else { "a file" };
                return Err(NotOwned::new(
                    &path,
                    format!(
                        "{what} the checkpoint's manifest does not list: no save wrote it, so the checkpoint is not removed"
                    ),
                ));
            };
            let got = match depth {
                Depth::Contents => sum_of_file(&path),
                Depth::Sizes => std::fs::symlink_metadata(&path).map(|m| FileSum {
                    bytes: m.len(),
                    crc32: want.crc32,
                }),
            }
            .map_err(|e| NotOwned::new(&path, format!("cannot be read ({e})")))?;
            if got != *want {
                return Err(NotOwned::new(
                    &path,
                    format!(
                        "{} bytes with CRC-32 {:08x} where the manifest lists {} bytes with {:08x}: it was changed after the save, so the checkpoint is not removed",
                        got.bytes, got.crc32, want.bytes, want.crc32
                    ),
                ));
            }
            owned.files.push(inner);
        }
    }
    // Deepest first, so each is empty when its turn comes.
    owned
        .folders
        .sort_by_key(|f| std::cmp::Reverse(f.components().count()));
    Ok(owned)
}

impl Owned {
    /// Removes the checked files from the folder now at `root` (the checked one, or where it
    /// was moved): the run document first, so a removal cut short leaves no checkpoint that
    /// looks complete, then the files, then the folders, each only if empty.
    pub(crate) fn remove_at(&self, root: &Path) -> Result<(), CheckpointError> {
        let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
        for rel in std::iter::once(&self.document).chain(&self.files) {
            let path = root.join(rel);
            match std::fs::remove_file(&path) {
                Err(e) if !gone(&e) => return Err(CheckpointError::io("removing", path, e)),
                _ => {}
            }
        }
        for rel in self.folders.iter().chain(std::iter::once(&PathBuf::new())) {
            let path = root.join(rel);
            match std::fs::remove_dir(&path) {
                Err(e) if !gone(&e) => {
                    return Err(CheckpointError::io(
                        "removing (something was added while it was removed, and stays)",
                        path,
                        e,
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// `checkpoint` checked as a whole checkpoint that holds nothing but what its save wrote;
/// a folder inside a checkpoint (its `pytorch_model_fsdp_0`) is refused: removing it alone
/// would leave the checkpoint naming a missing folder.
fn whole_checkpoint(checkpoint: &Path) -> Result<Owned, CheckpointError> {
    let parent = checkpoint.parent().filter(|p| !p.as_os_str().is_empty());
    if format::run_document(checkpoint).is_none()
        && let Some(root) = parent.filter(|p| format::run_document(p).is_some())
    {
        return Err(CheckpointError::NotOurs {
            path: checkpoint.to_path_buf(),
            reason: format!(
                "is a folder inside the checkpoint {}: removing it alone would leave that checkpoint naming a missing folder; pass {} to remove the whole checkpoint",
                root.display(),
                root.display()
            ),
        });
    }
    check_owned(checkpoint).map_err(NotOwned::refusal)
}

/// Checks that [`remove_checkpoint`] would remove `checkpoint`, removing nothing: an error
/// naming what stands in the way otherwise (`fsdp merge-weights --remove_checkpoint_dir`
/// asks before it merges).
pub fn check_removable(checkpoint: &Path) -> Result<(), CheckpointError> {
    whole_checkpoint(checkpoint).map(|_| ())
}

/// Removes the checkpoint folder `checkpoint` (`fsdp merge-weights --remove_checkpoint_dir`)
/// if it is a whole checkpoint written by `save_state` that holds nothing but what its save
/// wrote: its manifest lists every file in it with the size and checksum the file has.
/// Otherwise an error naming the file or folder in the way, and nothing is removed.
pub fn remove_checkpoint(checkpoint: &Path) -> Result<(), CheckpointError> {
    whole_checkpoint(checkpoint)?.remove_at(checkpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint folder whose manifest lists `files` (path, contents), written as a save
    /// would.
    fn checkpoint(root: &Path, files: &[(&str, &[u8])]) {
        std::fs::create_dir_all(root).unwrap();
        let mut listed = BTreeMap::new();
        for (rel, bytes) in files {
            let path = root.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, bytes).unwrap();
            listed.insert(rel.to_string(), FileSum::of(bytes));
        }
        let doc = CheckpointDoc {
            format: format::FORMAT.into(),
            version: format::VERSION,
            state_dict_type: "SHARDED_STATE_DICT".into(),
            world_size: 1,
            models: 1,
            optimizers: 0,
            schedulers: 0,
            step: 3,
            data: serde_json::Value::Null,
            grad_scalers: Vec::new(),
            documents: BTreeMap::new(),
            files: listed,
        };
        let bytes = format::document_bytes(&doc).unwrap();
        std::fs::write(root.join(format::CHECKPOINT_FILE), bytes).unwrap();
    }

    const FILES: &[(&str, &[u8])] = &[
        ("random_states_0.json", b"{}"),
        ("pytorch_model_fsdp_0/metadata.json", b"{\"a\": 1}"),
        ("pytorch_model_fsdp_0/rank_0.safetensors", b"0123456789"),
    ];

    #[test]
    fn a_folder_of_listed_files_is_removed_whole() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("step_3");
        checkpoint(&ckpt, FILES);
        remove_checkpoint(&ckpt).unwrap();
        assert!(!ckpt.exists());
    }

    #[test]
    fn anything_unlisted_or_changed_refuses_the_removal_and_stays() {
        type Edit = fn(&Path);
        let cases: &[(&str, Edit, &str)] = &[
            (
                "a user's file at the top",
                |c| std::fs::write(c.join("notes.txt"), "mine").unwrap(),
                "notes.txt",
            ),
            (
                "a user's file in a model folder",
                |c| std::fs::write(c.join("pytorch_model_fsdp_0/extra.bin"), "x").unwrap(),
                "extra.bin",
            ),
            (
                "a user's folder",
                |c| std::fs::create_dir(c.join("mine")).unwrap(),
                "mine",
            ),
            (
                "a listed file edited, same size",
                |c| {
                    std::fs::write(
                        c.join("pytorch_model_fsdp_0/rank_0.safetensors"),
                        "0123456780",
                    )
                    .unwrap()
                },
                "changed after the save",
            ),
            (
                "a listed file replaced by a link",
                |c| {
                    let f = c.join("random_states_0.json");
                    std::fs::remove_file(&f).unwrap();
                    std::os::unix::fs::symlink("/etc/hostname", &f).unwrap();
                },
                "random_states_0.json",
            ),
            (
                "the document edited",
                |c| {
                    let d = c.join(format::CHECKPOINT_FILE);
                    let t = std::fs::read_to_string(&d)
                        .unwrap()
                        .replace("\"step\": 3", "\"step\": 4");
                    std::fs::write(d, t).unwrap();
                },
                "cannot be trusted",
            ),
        ];
        for (what, edit, needle) in cases {
            let dir = tempfile::tempdir().unwrap();
            let ckpt = dir.path().join("step_3");
            checkpoint(&ckpt, FILES);
            edit(&ckpt);
            let before = listing(&ckpt);
            let e = remove_checkpoint(&ckpt).expect_err(what).to_string();
            assert!(e.contains(needle), "{what}: {e}");
            assert!(e.contains("nothing was removed"), "{what}: {e}");
            assert_eq!(listing(&ckpt), before, "{what}: something was removed");
        }
    }

    #[test]
    fn a_folder_without_a_manifest_or_document_is_never_ours() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("c");
        checkpoint(&ckpt, &[]);
        let e = remove_checkpoint(&ckpt).unwrap_err().to_string();
        assert!(e.contains("lists no files"), "{e}");
        std::fs::remove_file(ckpt.join(format::CHECKPOINT_FILE)).unwrap();
        let e = remove_checkpoint(&ckpt).unwrap_err().to_string();
        assert!(e.contains("not a checkpoint written by save_state"), "{e}");
        assert!(ckpt.is_dir());
    }

    /// Every path under `root` with its contents (links as their target).
    fn listing(root: &Path) -> Vec<(PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        let mut pending = vec![root.to_path_buf()];
        while let Some(d) = pending.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let t = e.file_type().unwrap();
                let p = e.path();
                if t.is_dir() {
                    pending.push(p.clone());
                    out.push((p, Vec::new()));
                } else if t.is_symlink() {
                    let target = std::fs::read_link(&p).unwrap();
                    out.push((p, target.to_string_lossy().as_bytes().to_vec()));
                } else {
                    let bytes = std::fs::read(&p).unwrap();
                    out.push((p, bytes));
                }
            }
        }
        out.sort();
        out
    }
}
