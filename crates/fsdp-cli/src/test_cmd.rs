//! `fsdp test`: launches a short distributed sanity check with the user's configuration, as
//! `accelerate test` does: every worker joins the group, checks its environment and the
//! configuration it received, runs a few collectives, then trains a small model for a few
//! steps under that configuration (see `test_train`).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp::config::FsdpPlugin;
use fsdp_comm::{CommunicatorExt, ReduceOp, WorldInfo};

use crate::ConfigFileArg;

/// Check that a job with this configuration can start and communicate.
#[derive(Args)]
pub struct TestArgs {
    #[command(flatten)]
    file: ConfigFileArg,
    /// Override the number of processes.
    #[arg(long = "num_processes", visible_alias = "num-processes")]
    num_processes: Option<usize>,
    /// Internal: run as one worker of the check.
    #[arg(long, hide = true)]
    worker: bool,
    /// Internal, for the launcher's tests: `die:RANK` makes that rank exit with code 3 while
    /// the others wait in a collective; `hang:RANK` makes it stop responding instead;
    /// `die-in-step:RANK` makes it exit in the third training step, between its forward and
    /// its backward.
    #[arg(long, hide = true)]
    fault: Option<String>,
}

/// Runs `fsdp test`; returns the exit code.
pub fn run(args: TestArgs) -> Result<i32> {
    if args.worker {
        worker(args.fault.as_deref())?;
        return Ok(0);
    }
    let exe: PathBuf = std::env::current_exe()?;
    let mut cmd = Command::new(&exe);
    cmd.arg("launch");
    if let Some(f) = &args.file.config_file {
        cmd.arg("--config_file").arg(f);
    }
    if let Some(n) = args.num_processes {
        cmd.args(["--num_processes", &n.to_string()]);
    }
    cmd.arg(&exe).args(["test", "--worker"]);
    let status = cmd.status().context("running fsdp launch")?;
    let code = status.code().unwrap_or(1);
    if code == 0 {
        println!(
            "Test is a success! The job starts, communicates and trains with this configuration."
        );
    }
    Ok(code)
}

fn worker(fault: Option<&str>) -> Result<()> {
    let world = WorldInfo::from_env()?;
    let plugin = FsdpPlugin::builder()
        .build()
        .context("reading the configuration from the environment")?;
    let joined = fsdp_comm::join_job()?;
    if let Some(notice) = &joined.selection.notice
        && world.rank == 0
    {
        eprintln!("fsdp: {notice}");
    }
    let pg = joined.group;
    println!("rank {} pid {}", world.rank, std::process::id());
    let faulty = |kind: &str| {
        fault
            .and_then(|f| f.strip_prefix(kind))
            .and_then(|r| r.parse::<usize>().ok())
            == Some(world.rank)
    };
    if faulty("die:") {
        std::thread::sleep(std::time::Duration::from_millis(500));
        eprintln!("rank {} exits on purpose", world.rank);
        std::process::exit(3);
    }
    if faulty("hang:") {
        eprintln!("rank {} hangs on purpose", world.rank);
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
    let n = pg.size();
    if n != world.world_size || pg.rank() != world.rank {
        bail!(
            "group rank {} of {} does not match the environment's rank {} of {}",
            pg.rank(),
            n,
            world.rank,
            world.world_size
        );
    }
    let sum = pg
        .all_reduce_vec(vec![world.rank as i64], ReduceOp::Sum)
        .wait()?[0];
    let want = (n * (n - 1) / 2) as i64;
    if sum != want {
        bail!("all_reduce of ranks gave {sum}, expected {want}");
    }
    let ranks = pg
        .all_gather_vec(vec![
            world.rank as i64,
            world.local_rank as i64,
            world.node_rank as i64,
        ])
        .wait()?;
    let strategies = pg
        .all_gather_vec(vec![plugin.sharding_strategy as u8])
        .wait()?;
    if strategies.iter().any(|s| *s != strategies[0]) {
        bail!("ranks received different sharding strategies: {strategies:?}");
    }
    pg.barrier().wait()?;
    println!(
        "rank {} of {} (local {} of {}, machine {}): all_reduce ok, transport {}, strategy {}",
        world.rank,
        n,
        world.local_rank,
        world.local_world_size,
        world.node_rank,
        pg.backend(),
        plugin.sharding_strategy
    );
    if world.rank == 0 {
        let layout: Vec<String> = ranks
            .chunks(3)
            .map(|c| format!("{}:{}@{}", c[0], c[1], c[2]))
            .collect();
        println!("ranks (rank:local@machine): {}", layout.join(" "));
    }
    crate::test_train::train(pg, faulty("die-in-step:"))?;
    // Every group is gone, so under MPI this process has finalized MPI: saying so lets a
    // launcher's complaint that it exited without finalizing be told from the truth.
    if fsdp_comm::mpi_finalized() {
        println!("rank {}: MPI finalized", world.rank);
    }
    Ok(())
}
