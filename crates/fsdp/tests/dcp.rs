//! PyTorch distributed checkpoints (what Accelerate's SHARDED_STATE_DICT writes) merged into
//! the same `model.safetensors` as `accelerate merge-weights` makes, byte for byte, from
//! fixtures PyTorch wrote (`tests/data/dcp`, see its README); damaged or hostile files are
//! errors naming the file.

use std::path::{Path, PathBuf};

use fsdp::checkpoint::merge_weights;

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
