//! Running the `fsdp` binary in tests: a clean environment, bounded waits, worker pids and
//! the processes they leave.

#![allow(dead_code)]

#[macro_use]
#[path = "../../../fsdp/tests/common/skip.rs"]
pub mod skip;

#[path = "../../../fsdp/tests/common/built.rs"]
pub mod built;

pub mod machines;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `fsdp` with a clean environment: no `FSDP_*`/`ACCELERATE_*` variables, and a `HOME` of
/// this test process's own under cargo's target tmp dir (so caches such as the measured core
/// peak start empty, and nothing is left in the system's temporary directory).
pub fn fsdp() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fsdp"));
    let home = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("launch-test-home-{}", std::process::id()));
    cmd.env("HOME", home)
        .env_remove("FSDP_CONFIG_FILE")
        .env_remove("FSDP_HOME")
        .env_remove("HF_HOME");
    for (var, _) in std::env::vars() {
        if var.starts_with("FSDP_") || var.starts_with("ACCELERATE_") {
            cmd.env_remove(var);
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// `fsdp bench WHAT ARGS --json FILE`: the JSON document it wrote (panics with the output
/// when the benchmark fails).
pub fn bench_json(what: &str, args: &[&str]) -> serde_json::Value {
    bench_json_env(what, args, &[])
}

/// [`bench_json`] with `env` set for the benchmark (and the workers it launches).
pub fn bench_json_env(what: &str, args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let out = fsdp()
        .args(["bench", what])
        .args(args)
        .envs(env.iter().copied())
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

/// Whether Open MPI's `mpirun` is installed (Debian's openmpi-bin): the tests that need it
/// skip without it.
pub fn has_mpirun() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A loopback port free now, for a job that its own rank 0 binds later (mpirun, srun): taken
/// from below Linux's ephemeral range (32768-60999), so no connection another test opens
/// meanwhile can be given it — a port from binding port 0 can, and a CI run once failed with
/// `Address already in use` that way. Each call of a test binary takes the next port of a
/// run of its own (the start depends on the process id).
pub fn port() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const COUNT: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(997) % COUNT;
    for _ in 0..COUNT {
        let p = (FIRST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % COUNT) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
            return p.to_string();
        }
    }
    panic!("no free loopback port in {FIRST}..{}", FIRST + COUNT)
}

pub struct Run {
    pub code: Option<i32>,
    pub out: String,
    pub elapsed: Duration,
}

/// Runs an `mpirun` of `processes` ranks of `fsdp test --worker`, made by `command` (afresh
/// for each try, so each gets its own port), to its end within `limit`. Open MPI 4.x now and
/// then fails such a job saying a process exited "improperly" (without finalizing MPI) when
/// it did finalize: a race in its runtime (open-mpi/ompi#7833, unfixed on the 4.x branches;
/// Debian 12 ships 4.1.4). A job that failed that way although every rank printed `rank N:
/// MPI finalized` runs once more, saying so; one whose rank did not finalize fails as it is.
pub fn finish_mpirun(
    processes: usize,
    limit: Duration,
    mut command: impl FnMut() -> Command,
) -> Run {
    let run = finish(command().spawn().unwrap(), limit);
    if !open_mpi_exit_race(&run, processes) {
        return run;
    }
    eprintln!(
        "Open MPI reported a process exiting without finalizing MPI though every rank did (its runtime's race, open-mpi/ompi#7833); running the job once more. Its output:\n{}",
        run.out
    );
    finish(command().spawn().unwrap(), limit)
}

/// Whether `run` failed only by Open MPI's exit race (see [`finish_mpirun`]).
pub fn open_mpi_exit_race(run: &Run, processes: usize) -> bool {
    run.code != Some(0)
        && run.out.contains("exiting improperly")
        && (0..processes).all(|r| run.out.contains(&format!("rank {r}: MPI finalized")))
}

/// Waits for a launcher (killing it after `limit`) and collects its output.
pub fn finish(mut child: Child, limit: Duration) -> Run {
    let start = Instant::now();
    // Streams the caller took already are not read here.
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let read = |stream: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut r) = stream {
                let _ = r.read_to_end(&mut bytes);
            }
            String::from_utf8_lossy(&bytes).into_owned()
        })
    };
    let out_t = read(stdout.map(|s| Box::new(s) as _));
    let err_t = read(stderr.map(|s| Box::new(s) as _));
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("launcher did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    let out = format!("{}{}", out_t.join().unwrap(), err_t.join().unwrap());
    Run { code, out, elapsed }
}

/// `fsdp launch` of `program` (its arguments after the launcher's, `--fsdp_*` flags
/// included) as a job of 2 machines of 2 processes on loopback: one launcher per machine
/// with `env` added, waited for within `limit` each (machine 0's run first).
pub fn launch_two_machines(program: &[&str], env: &[(&str, &str)], limit: Duration) -> (Run, Run) {
    launch_two_machines_each(|_| program.to_vec(), env, limit)
}

/// [`launch_two_machines`] with each machine's own program (`program(machine rank)`).
pub fn launch_two_machines_each<'a>(
    program: impl Fn(usize) -> Vec<&'a str>,
    env: &[(&str, &str)],
    limit: Duration,
) -> (Run, Run) {
    let p = port();
    let start = |rank: usize| {
        let mut cmd = fsdp();
        cmd.args(["launch", "--num_machines", "2", "--num_processes", "4"])
            .args(["--main_process_ip", "127.0.0.1", "--main_process_port", &p])
            .args(["--machine_rank", &rank.to_string()])
            .args(program(rank))
            .env("FSDP_JOB_SECRET", "two-loopback-machines")
            .envs(env.iter().copied());
        cmd.spawn().unwrap()
    };
    let (m0, m1) = (start(0), start(1));
    (finish(m0, limit), finish(m1, limit))
}

pub fn launch(args: &[&str], limit: Duration) -> Run {
    finish(fsdp().arg("launch").args(args).spawn().unwrap(), limit)
}

/// PIDs printed by workers as `pid N` or `rank R pid N`.
pub fn pids(out: &str) -> Vec<u32> {
    out.lines()
        .filter(|l| l.starts_with("[rank"))
        .filter_map(|l| {
            l.split("pid ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// Processes still alive in any of these process groups (workers and their children).
pub fn survivors(groups: &[u32]) -> Vec<u32> {
    let mut alive = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // Fields after the command name: state, ppid, pgrp.
        let rest: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        if rest.len() > 2 && rest[0] != "Z" && groups.iter().any(|g| rest[2] == g.to_string()) {
            alive.push(pid);
        }
    }
    alive
}

/// The binary under test.
pub const EXE: &str = env!("CARGO_BIN_EXE_fsdp");

/// Whether process `pid` exists and is not a zombie.
/// The pids of `fsdp test --worker` processes started without `fsdp launch` (lines
/// `rank R pid P`).
pub fn worker_pids(out: &str) -> Vec<u32> {
    out.lines()
        .filter_map(|l| {
            l.strip_prefix("rank ")?
                .split(" pid ")
                .nth(1)?
                .trim()
                .parse()
                .ok()
        })
        .collect()
}

/// Asserts that every process of `pids` is gone within `limit` (what the job's launcher
/// must ensure once it has ended); `out` is shown otherwise.
pub fn assert_gone(pids: &[u32], limit: Duration, out: &str) {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "left running: {left:?}\n{out}");
}

pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| !r.trim_start().starts_with('Z'))
    })
}

/// Checks the two launchers of a 2-machine, 4-process `fsdp test --worker` job: both
/// succeeded, machine 1 ran ranks 2 and 3, and training under `strategy` matched one process.
pub fn assert_two_machines_trained(r0: &Run, r1: &Run, strategy: &str) {
    assert_eq!(
        (r0.code, r1.code),
        (Some(0), Some(0)),
        "{strategy}\nmachine 0:\n{}\nmachine 1:\n{}",
        r0.out,
        r1.out
    );
    assert!(
        r1.out
            .contains("[rank3]: rank 3 of 4 (local 1 of 2, machine 1)"),
        "{}",
        r1.out
    );
    assert!(
        r0.out.contains(&format!("strategy {strategy}")),
        "{}",
        r0.out
    );
    assert!(
        r0.out.contains(&format!(
            "training ok: 8 steps on 4 processes ({})",
            mesh_of(strategy)
        )),
        "{}",
        r0.out
    );
}

/// How `fsdp test` reports the mesh of `strategy` on 2 machines of 2 processes: hybrid
/// strategies shard inside each machine and replicate across the two; the others shard over
/// all four, gathering and reducing in two hops (inside each machine, then across).
pub fn mesh_of(strategy: &str) -> &'static str {
    if strategy.starts_with("HYBRID") {
        "shard groups of 2 x 2 replicas"
    } else {
        "shard groups of 4 x 1 replicas, two hops across 2 machines"
    }
}

/// An example of the fsdp crate, built by `cargo test --workspace` beside this test binary.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let built = exe
        .parent()
        .and_then(std::path::Path::parent)
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        built.is_file(),
        "{} is missing: run `cargo test --workspace` (it builds the examples)",
        built.display()
    );
    built
}
