//! Starting a benchmark's worker processes on this machine.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use fsdp_comm::LocalJob;

/// Runs this binary with `args` as `n` local worker processes (torchrun environment, a fresh
/// port and job secret, threads split between them) and returns rank 0's standard output.
pub(crate) fn spawn_workers(args: &[String], n: usize, env: &[(&str, &str)]) -> Result<String> {
    let exe = std::env::current_exe()?;
    let threads = (crate::system::available_cores() / n).max(1);
    let job = LocalJob::start(n, 0..n, Some(threads), |_| {
        let mut cmd = Command::new(&exe);
        cmd.args(args).envs(env.iter().copied());
        cmd
    })
    .context("starting the benchmark workers")?;
    // A benchmark has no deadline of its own: wait for as long as it runs.
    let (outputs, _) = job.wait(Duration::from_secs(u32::MAX as u64));
    if let Some(failed) = outputs.iter().find(|o| !o.success()) {
        bail!(
            "benchmark worker {} failed ({:?}):\n{}",
            failed.rank,
            failed.status,
            failed.stderr
        );
    }
    Ok(outputs
        .into_iter()
        .next()
        .map(|o| o.stdout)
        .unwrap_or_default())
}
