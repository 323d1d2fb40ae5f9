//! Starting a benchmark's worker processes on this machine.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use fsdp_comm::LocalJob;

/// Runs this binary with `args` as `n` local worker processes (torchrun environment, a fresh
/// port and job secret, threads split between them) and returns rank 0's standard output.
/// The processes are laid out as `machines` machines of consecutive ranks, as `fsdp launch
/// --num_machines` numbers them (what hybrid sharding groups by).
pub(crate) fn spawn_workers(
    args: &[String],
    n: usize,
    machines: usize,
    env: &[(&str, &str)],
) -> Result<String> {
    let exe = std::env::current_exe()?;
    let threads = (crate::system::available_cores() / n).max(1);
    let per_machine = (n / machines.max(1)).max(1);
    let job = LocalJob::start(n, 0..n, Some(threads), |rank| {
        let mut cmd = Command::new(&exe);
        cmd.args(args).envs(env.iter().copied());
        if machines > 1 {
            let node = (rank / per_machine).to_string();
            cmd.env("LOCAL_RANK", (rank % per_machine).to_string())
                .env("LOCAL_WORLD_SIZE", per_machine.to_string())
                .env("NODE_RANK", &node)
                .env("GROUP_RANK", &node);
        }
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
