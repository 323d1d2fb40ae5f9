//! PyTorch distributed checkpoints (what Accelerate's SHARDED_STATE_DICT writes) merged into
//! the same `model.safetensors` as `accelerate merge-weights` makes, byte for byte, from
//! fixtures PyTorch wrote (`tests/data/dcp`, see its README); damaged or hostile files are
//! errors naming the file.

use std::path::{Path, PathBuf};

use fsdp::checkpoint::merge_weights;

use crate::common;

fn fixture(version: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/dcp/{version}"))
}

/// A writable copy of a fixture's checkpoint folder.
fn copy(version: &str, to: &Path) -> PathBuf {
    let from = fixture(version).join("pytorch_model_fsdp_0");
    let dir = to.join(version).join("pytorch_model_fsdp_0");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    dir
}

#[test]
fn merges_fsdp1_and_fsdp2_checkpoints_exactly_as_accelerate() {
    let tmp = tempfile::tempdir().unwrap();
    for version in ["fsdp1", "fsdp2"] {
        // From the checkpoint's root and from its model folder.
        for src in [
            fixture(version),
            fixture(version).join("pytorch_model_fsdp_0"),
        ] {
            let out = tmp.path().join(version);
            let report = merge_weights(&src, &out).unwrap();
            let ours = std::fs::read(&report.output).unwrap();
            let theirs =
                std::fs::read(fixture(version).join("accelerate_merged.safetensors")).unwrap();
            assert_eq!(report.tensors, 41, "{version}");
            assert!(
                ours == theirs,
                "{version}: merged file differs from Accelerate's"
            );
        }
    }
}

#[test]
fn damaged_or_hostile_distributed_checkpoints_are_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let err = |dir: &Path| merge_weights(dir, &out).unwrap_err().to_string();

    // A truncated chunk file.
    let dir = copy("fsdp2", &tmp.path().join("truncated"));
    let file = dir.join("__1_0.distcp");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = err(&dir);
    assert!(e.contains("__1_0.distcp"), "{e}");
    assert!(
        !out.join("model.safetensors").exists(),
        "no merged file from a damaged checkpoint"
    );

    // A missing chunk file.
    let dir = copy("fsdp1", &tmp.path().join("missing"));
    std::fs::remove_file(dir.join("__0_0.distcp")).unwrap();
    let e = err(&dir);
    assert!(e.contains("__0_0.distcp") && e.contains("missing"), "{e}");

    // Metadata that refers to something other than DCP's data classes: refused, never run.
    let dir = copy("fsdp2", &tmp.path().join("hostile"));
    let meta = dir.join(".metadata");
    let bytes = std::fs::read(&meta).unwrap();
    let needle = b"\x8c\x08Metadata";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    let mut hostile = bytes.clone();
    hostile[at..at + needle.len()].copy_from_slice(b"\x8c\x08Popen___");
    std::fs::write(&meta, hostile).unwrap();
    let e = err(&dir);
    assert!(e.contains(".metadata") && e.contains("not allowed"), "{e}");

    // A record that is not a zip archive (its header overwritten).
    let dir = copy("fsdp2", &tmp.path().join("garbled"));
    let file = dir.join("__0_0.distcp");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[0..4].copy_from_slice(b"JUNK");
    std::fs::write(&file, bytes).unwrap();
    let e = err(&dir);
    assert!(e.contains("__0_0.distcp"), "{e}");
}

/// `.metadata` of a copy of the fsdp2 fixture with `from` replaced by `to` wherever it
/// occurs (the pickle's frame lengths are not checked by readers, so lengths may change).
fn crafted(tmp: &Path, case: &str, from: &[u8], to: &[u8]) -> PathBuf {
    let dir = copy("fsdp2", &tmp.join(case));
    let meta = dir.join(".metadata");
    let bytes = std::fs::read(&meta).unwrap();
    let mut out = Vec::new();
    let mut i = 0;
    let mut found = false;
    while i < bytes.len() {
        if bytes[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
            found = true;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    assert!(found, "{case}: pattern not in the fixture");
    std::fs::write(&meta, out).unwrap();
    dir
}

#[test]
fn crafted_distributed_checkpoints_are_refused_before_anything_is_allocated() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let err = |dir: &Path| merge_weights(dir, &out).unwrap_err().to_string();
    std::fs::write(tmp.path().join("passwd"), vec![0u8; 70000]).unwrap();
    // A chunk file outside the checkpoint (same length, so the pickle stays well formed).
    let dir = crafted(
        tmp.path(),
        "outside",
        b"\x8c\x0c__0_0.distcp",
        b"\x8c\x0c../../passwd",
    );
    let e = err(&dir);
    assert!(
        e.contains(".metadata") && e.contains("not a plain file name"),
        "{e}"
    );
    let dir = crafted(
        tmp.path(),
        "absolute",
        b"\x8c\x0c__0_0.distcp",
        b"\x8c\x0c/etc/x.dcpxx",
    );
    let e = err(&dir);
    assert!(e.contains("not a plain file name"), "{e}");
    // A record claiming 2^50 bytes: refused against the file's length, not allocated.
    let mut huge = b"\x8c\x06length\x94\x8a\x08".to_vec();
    huge.extend_from_slice(&(1u64 << 50).to_le_bytes());
    // (The first record's length, 2473, is a BININT2 in the fixture.)
    let dir = crafted(tmp.path(), "huge", b"\x8c\x06length\x94M\xa9\x09", &huge);
    let e = err(&dir);
    assert!(
        e.contains(".metadata") && e.contains("reaches past the end"),
        "{e}"
    );
    assert!(!out.join("model.safetensors").exists());
    assert!(
        std::fs::read_dir(&out).map_or(true, |d| d.count() == 0),
        "a merge of a crafted checkpoint left files"
    );
    // A FIFO in place of a chunk file: an error at once.
    let dir = copy("fsdp1", &tmp.path().join("fifo"));
    let file = dir.join("__1_0.distcp");
    std::fs::remove_file(&file).unwrap();
    common::mkfifo(&file);
    let e = err(&dir);
    assert!(e.contains("__1_0.distcp") && e.contains("FIFO"), "{e}");
}
