//! Depending on fsdp like any crate, from a fresh crate to a merged model: a crate outside the
//! workspace that names only `fsdp` (and anyhow) in its manifest, with no `[patch]`, whose
//! `src/main.rs` is the guide's program (`crates/fsdp/src/guide.md`, the README's "Train your
//! own model") taken verbatim, resolves to the patched candle-core (`fsdp-candle-core`),
//! never the registry's `candle-core` (`cargo tree`); the same program, compiled by the
//! workspace as the example `guide` (`examples/guide/program.rs`, checked to be the guide's
//! text) against the same crates, trains under `fsdp launch` on 2 processes, and
//! `fsdp merge-weights` turns its checkpoint into a model with the names its modules declared.
//! (Compiling the fresh crate's whole tree a second time, even only `cargo check`, cost a
//! clean CI run 50 s to a minute; `tools/check-package.sh` builds each package from its
//! tarball, as a user gets it.)

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::fsdp;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// Runs `cmd` to its end within `limit` (killed past it), returning (success, output).
fn run(cmd: &mut Command, limit: Duration) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = format!(
        "{}{}",
        std::fs::read_to_string(&out).unwrap_or_default(),
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    match status {
        Some(s) => (s.success(), text),
        None => panic!("{cmd:?} ran past {limit:?}:\n{text}"),
    }
}

/// The workspace's build of the guide's program (the example `guide`), checked to be the
/// guide's text and built from it.
fn guide_example() -> PathBuf {
    let source = workspace_root().join("crates/fsdp/examples/guide/program.rs");
    assert_eq!(
        std::fs::read_to_string(&source).unwrap(),
        guide_program(),
        "{} differs from the guide's program: copy it from crates/fsdp/src/guide.md",
        source.display()
    );
    crate::common::built::built_example("guide", &source)
}

/// The first ```rust,no_run block (compiled by rustdoc, run here under `fsdp launch`) of the guide.
fn guide_program() -> String {
    let guide = std::fs::read_to_string(workspace_root().join("crates/fsdp/src/guide.md")).unwrap();
    let start = guide
        .find("```rust,no_run\n")
        .expect("the guide has a program")
        + "```rust,no_run\n".len();
    let len = guide[start..].find("\n```").unwrap() + 1;
    guide[start..start + len].to_string()
}

#[test]
fn a_fresh_crate_with_the_guides_program_builds_without_a_patch_trains_and_merges() {
    let root = workspace_root();
    let scratch = tempfile::tempdir().unwrap();
    let manifest = format!(
        "[package]\nname = \"my-model\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
         [dependencies]\nfsdp = {{ path = \"{}\" }}\nanyhow = \"1\"\n\n\
         # Its own workspace: nothing of fsdp-rs's (profiles, patches) applies.\n[workspace]\n",
        root.join("crates/fsdp").display()
    );
    assert!(!manifest.contains("[patch"));
    std::fs::write(scratch.path().join("Cargo.toml"), &manifest).unwrap();
    std::fs::create_dir(scratch.path().join("src")).unwrap();
    std::fs::write(scratch.path().join("src/main.rs"), guide_program()).unwrap();
    // The versions this workspace resolved (all in cargo's cache: no network needed).
    std::fs::copy(root.join("Cargo.lock"), scratch.path().join("Cargo.lock")).unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut tree = Command::new(&cargo);
    tree.args(["tree", "--offline", "-e", "normal", "--prefix", "none"])
        .current_dir(scratch.path());
    let (ok, tree) = run(&mut tree, Duration::from_secs(120));
    assert!(ok, "cargo tree failed:\n{tree}");
    let vendored = format!(
        "fsdp-candle-core v0.11.1 ({})",
        root.join("vendor/candle-core").display()
    );
    assert!(tree.lines().any(|l| l.starts_with(&vendored)), "{tree}");
    assert!(
        !tree.lines().any(|l| l.starts_with("candle-core ")),
        "the registry's candle-core is in the tree:\n{tree}"
    );

    // As the guide says: fsdp launch on 2 processes, then fsdp merge-weights.
    let out = scratch.path().join("out");
    let mut launch = fsdp();
    launch
        .args(["launch", "--num_processes", "2"])
        .arg(guide_example())
        .arg(&out);
    let (ok, log) = run(&mut launch, Duration::from_secs(120));
    assert!(ok, "the guide's program failed under fsdp launch:\n{log}");
    let losses: Vec<f32> = log
        .lines()
        .filter_map(|l| {
            l.strip_prefix("[rank0]: step ")?
                .split("loss ")
                .nth(1)?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(losses.len(), 3, "{log}");
    // ln(64) at the start (uniform over 64 ids), lower after AdamW steps.
    assert!((losses[0] - 64f32.ln()).abs() < 0.1, "{log}");
    assert!(losses[2] < losses[0], "{log}");
    let mut merge = fsdp();
    merge
        .arg("merge-weights")
        .arg(out.join("checkpoint"))
        .arg(out.join("merged"));
    let (ok, log) = run(&mut merge, Duration::from_secs(60));
    assert!(ok, "{log}");
    let merged = std::fs::read(out.join("merged/model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(merged[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&merged[8..8 + header_len]).unwrap();
    let mut names: Vec<&str> = header
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .filter(|k| *k != "__metadata__")
        .collect();
    names.sort();
    let mut want = vec!["embed.weight", "head.weight", "head.bias"];
    let blocks: Vec<String> = (0..2)
        .flat_map(|i| {
            ["ln.weight", "ln.bias", "fc.weight", "fc.bias"].map(|l| format!("blocks.{i}.{l}"))
        })
        .collect();
    want.extend(blocks.iter().map(String::as_str));
    want.sort();
    assert_eq!(names, want);
}
