//! Depending on fsdp like any crate: a crate outside the workspace (`downstream_crate/`) that
//! names only `fsdp` (and anyhow) in its manifest, with no `[patch]`, builds against the
//! patched candle-core (`fsdp-candle-core`, reached through `fsdp::nn::candle`), never the
//! registry's `candle-core`, and trains its own model for two steps.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

#[test]
fn a_crate_outside_the_workspace_depends_on_fsdp_without_a_patch_and_trains() {
    let root = workspace_root();
    let scratch = tempfile::tempdir().unwrap();
    let manifest = format!(
        "[package]\nname = \"fsdp-downstream-check\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
         [dependencies]\nfsdp = {{ path = \"{}\" }}\nanyhow = \"1\"\n\n\
         # Its own workspace: nothing of fsdp-rs's (profiles, patches) applies.\n[workspace]\n",
        root.join("crates/fsdp").display()
    );
    assert!(!manifest.contains("[patch"));
    std::fs::write(scratch.path().join("Cargo.toml"), &manifest).unwrap();
    std::fs::create_dir(scratch.path().join("src")).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/downstream_crate/src/main.rs"),
        scratch.path().join("src/main.rs"),
    )
    .unwrap();
    // The versions this workspace resolved (all in cargo's cache: the build needs no network).
    std::fs::copy(root.join("Cargo.lock"), scratch.path().join("Cargo.lock")).unwrap();
    let target = root.join("target/downstream-check");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let cargo_in_scratch = |args: &[&str]| {
        let mut cmd = Command::new(&cargo);
        cmd.args(args)
            .current_dir(scratch.path())
            .env("CARGO_TARGET_DIR", &target)
            // Unoptimised and without debug info: the quickest build of the whole tree.
            .env("CARGO_PROFILE_DEV_DEBUG", "false")
            .env_remove("RUSTFLAGS");
        cmd
    };

    let (ok, tree) = run(
        &mut cargo_in_scratch(&["tree", "--offline", "-e", "normal", "--prefix", "none"]),
        Duration::from_secs(120),
    );
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

    let (ok, build) = run(
        &mut cargo_in_scratch(&["build", "--offline", "--quiet"]),
        Duration::from_secs(900),
    );
    assert!(ok, "the downstream crate does not build:\n{build}");

    let mut program = Command::new(target.join("debug/fsdp-downstream-check"));
    // One process of its own, whatever launched the tests.
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        program.env_remove(var);
    }
    let (ok, out) = run(&mut program, Duration::from_secs(120));
    assert!(ok, "the downstream program failed:\n{out}");
    let losses: Vec<f32> = out
        .lines()
        .filter_map(|l| l.strip_prefix("loss "))
        .map(|l| l.split(' ').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(losses.len(), 2, "{out}");
    assert!(losses.iter().all(|l| l.is_finite()), "{out}");
    // ln(32) at the start (uniform over 32 classes), lower after one AdamW step.
    assert!((losses[0] - 32f32.ln()).abs() < 0.1, "{out}");
    assert!(losses[1] < losses[0], "{out}");
}
