//! Runs a test binary's worker entry as `world` real processes joined by the torchrun
//! environment, with a deadline; returns each rank's output.

#![allow(dead_code)]

pub mod built;
pub mod reference;
#[macro_use]
pub mod skip;
pub mod tiny;

use std::process::Command;
use std::time::Duration;

use candle_core::Tensor;
use fsdp_comm::LocalJob;

/// Starts `world` copies of this test binary running test `entry` with `role=1` set (one
/// compute thread each), waits up to `deadline` (killing all on expiry), and returns each
/// rank's stdout+stderr. Panics if a worker fails, with its output.
#[track_caller]
pub fn run_workers(
    entry: &str,
    role: &str,
    world: usize,
    env: &[(&str, &str)],
    deadline: Duration,
) -> Vec<String> {
    let entry = &test_name(std::panic::Location::caller().file(), entry);
    let job = LocalJob::start(world, 0..world, Some(1), |_| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            entry,
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(role, "1")
        .env("FSDP_COMM_TIMEOUT_SECS", "120")
        .envs(env.iter().copied());
        cmd
    })
    .unwrap();
    let (outputs, timed_out) = job.wait(deadline);
    let all: String = outputs.iter().map(|o| o.combined()).collect();
    assert!(
        !timed_out,
        "workers of {entry} did not finish within {deadline:?}:\n{all}"
    );
    for o in &outputs {
        assert!(o.success(), "worker {} failed:\n{}", o.rank, o.combined());
    }
    outputs.iter().map(|o| o.combined()).collect()
}

/// The name libtest knows test `entry` of the test file `file` by: `module::entry` in the
/// integration binary (whose modules are the files), `entry` in a binary of its own.
pub fn test_name(file: &str, entry: &str) -> String {
    let merged = std::env::current_exe()
        .ok()
        .and_then(|e| e.file_name().map(|n| n.to_string_lossy().into_owned()))
        .is_some_and(|n| n.starts_with("integration-"));
    let module = std::path::Path::new(file)
        .file_stem()
        .map(|s| s.to_string_lossy());
    match module {
        Some(m) if merged => format!("{m}::{entry}"),
        _ => entry.to_string(),
    }
}

/// The JSON a worker printed after `RESULT `.
pub fn result_of(output: &str) -> serde_json::Value {
    let line = output
        .lines()
        .find_map(|l| l.split("RESULT ").nth(1))
        .unwrap_or_else(|| panic!("no RESULT line in:\n{output}"));
    serde_json::from_str(line).unwrap()
}

/// The largest absolute difference between two tensors of one shape (f32).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Makes a FIFO at `path` (where a hostile user would put one in place of a file).
pub fn mkfifo(path: &std::path::Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "mkfifo {}",
        path.display()
    );
}

/// `model`'s full weights on rank 0 (`None` on the others) as flat vectors by name.
pub fn full_weights<M>(
    acc: &fsdp::accelerator::Accelerator,
    model: &fsdp::accelerator::PreparedModel<M>,
) -> Option<std::collections::BTreeMap<String, Vec<f32>>> {
    acc.get_state_dict(model).unwrap().map(|w| {
        w.into_iter()
            .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect()
    })
}

/// The largest |a - b| over the largest |b| (how far `a` is from the reference `b`).
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
        / scale
}

/// A tmpfs of `size` mounted at `at` for the test's life (root only).
pub struct SmallDisk(pub std::path::PathBuf);

impl SmallDisk {
    pub fn mount(at: &std::path::Path, size: &str) -> Option<SmallDisk> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        std::fs::create_dir_all(at).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| SmallDisk(at.to_path_buf()))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}
