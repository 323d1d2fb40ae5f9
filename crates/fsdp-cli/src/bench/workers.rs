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

/// Runs this binary with `args` as `n` processes that Open MPI's `mpirun` starts on this
/// machine (`env` passed to them, threads split between them) and returns their standard
/// output (rank 0 alone prints its report).
pub(crate) fn spawn_mpi_workers(args: &[String], n: usize, env: &[(&str, &str)]) -> Result<String> {
    let exe = std::env::current_exe()?;
    let threads = (crate::system::available_cores() / n).max(1).to_string();
    let mut cmd = Command::new("mpirun");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd.args(["--oversubscribe", "--bind-to", "none", "-n", &n.to_string()]);
    for (k, v) in env
        .iter()
        .copied()
        .chain([("RAYON_NUM_THREADS", threads.as_str())])
    {
        cmd.arg("-x").arg(format!("{k}={v}"));
    }
    let out = cmd
        .arg(&exe)
        .args(args)
        .output()
        .context("starting the benchmark workers with mpirun (Debian: openmpi-bin)")?;
    if !out.status.success() {
        bail!(
            "mpirun of the benchmark workers failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
