//! A test that cannot run here (a tool, an asset or a privilege missing) says so in a line
//! of its own and appends it to `target/tmp/skipped-tests.log`, which `.ci/run` prints after
//! the tests: a skip is visible, never a quiet pass. With `FSDP_REQUIRE_ALL=1` (set by
//! `.ci/run`, whose setup installs every tool and asset) such a skip fails the test instead;
//! only what no setup script can provide — a GPU, CPU instructions, an opt-in anchor like
//! `FSDP_TORCH_PYTHON` —
//! skips there too (`skipped_optional!`). Shared by the workspace's test crates and the
//! library crates' unit tests (`#[path]`).

/// The variable naming another log file (the skip policy's own test writes there).
#[allow(dead_code)]
pub const LOG_ENV: &str = "FSDP_SKIP_LOG";

/// The variable that turns a skip for something missing into a failure.
#[allow(dead_code)]
pub const REQUIRE_ALL_ENV: &str = "FSDP_REQUIRE_ALL";

/// Records why the running test skips (or skips part of itself) for something a machine can
/// be given (a tool, an asset, root): `skipped!("no mpirun")`; fails under
/// `FSDP_REQUIRE_ALL=1`.
#[allow(unused_macros)]
macro_rules! skipped {
    ($($arg:tt)*) => { $crate::common::skip::record(&format!($($arg)*), true) };
}

/// Records a skip that no setup can undo (no GPU, no AMX) or that runs only when asked
/// (`FSDP_TORCH_PYTHON`): logged, never a failure.
#[allow(unused_macros)]
macro_rules! skipped_optional {
    ($($arg:tt)*) => { $crate::common::skip::record(&format!($($arg)*), false) };
}

/// The variable under which a missing GPU fails a test instead of skipping it: set by
/// tools/gpu-check.sh on the machine that has one.
#[allow(dead_code)]
pub const REQUIRE_GPU_ENV: &str = "FSDP_REQUIRE_GPU";

/// Records a skip for want of a usable GPU (none, or its libraries missing): optional, but a
/// failure under `FSDP_REQUIRE_GPU=1`.
#[allow(unused_macros)]
macro_rules! skipped_gpu {
    ($($arg:tt)*) => { $crate::common::skip::record_gpu(&format!($($arg)*)) };
}

/// [`record`] for a skip without a GPU; panics under `FSDP_REQUIRE_GPU=1`.
#[allow(dead_code)]
pub fn record_gpu(why: &str) {
    if std::env::var(REQUIRE_GPU_ENV).is_ok_and(|v| v == "1") {
        panic!("no usable GPU ({REQUIRE_GPU_ENV}=1: this machine was to have one): {why}");
    }
    record(why, false);
}

/// Prints `SKIPPED <test>: <why>` and appends it to the log (the test's name from libtest's
/// thread name); a `required` skip panics when `FSDP_REQUIRE_ALL=1`.
#[allow(dead_code)]
pub fn record(why: &str, required: bool) {
    use std::io::Write;
    let test = std::thread::current()
        .name()
        .unwrap_or("(unnamed)")
        .to_string();
    let line = format!("SKIPPED {test}: {why}");
    eprintln!("{line}");
    // Integration tests get cargo's temporary folder; a library's unit tests (fsdp-nn's
    // kernels) do not, and log into the workspace's `target/tmp`, the same folder by default.
    let tmp = option_env!("CARGO_TARGET_TMPDIR").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp"),
        std::path::PathBuf::from,
    );
    let _ = std::fs::create_dir_all(&tmp);
    let log = std::env::var_os(LOG_ENV)
        .map_or_else(|| tmp.join("skipped-tests.log"), std::path::PathBuf::from);
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
    {
        let _ = writeln!(f, "{line}");
    }
    if required && std::env::var(REQUIRE_ALL_ENV).is_ok_and(|v| v == "1") {
        panic!("{line} ({REQUIRE_ALL_ENV}=1: this machine was to have everything the tests need)");
    }
}
