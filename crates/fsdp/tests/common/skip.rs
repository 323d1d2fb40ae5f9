//! A test that cannot run here (a tool, an asset or a privilege missing) says so in a line
//! of its own and appends it to `target/tmp/skipped-tests.log`, which `.ci/run` prints after
//! the tests: a skip is visible, never a quiet pass. Shared by the workspace's test crates
//! (`#[path]`).

/// Records why the running test skips (or skips part of itself): `skipped!("no mpirun")`.
#[allow(unused_macros)]
macro_rules! skipped {
    ($($arg:tt)*) => { $crate::common::skip::record(&format!($($arg)*)) };
}

/// Prints `SKIPPED <test>: <why>` and appends it to the log (the test's name from libtest's
/// thread name).
#[allow(dead_code)]
pub fn record(why: &str) {
    use std::io::Write;
    let test = std::thread::current()
        .name()
        .unwrap_or("(unnamed)")
        .to_string();
    let line = format!("SKIPPED {test}: {why}");
    eprintln!("{line}");
    let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.log");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
    {
        let _ = writeln!(f, "{line}");
    }
}
