//! Jobs over two machines on a real network (issue 21, point 0): each machine is a network
//! namespace of its own (with its own hostname, so the two are different hosts to the job)
//! on a bridge with its own address (tools/netns-machines.sh), and runs its own `fsdp launch
//! --num_machines 2 --machine_rank i --main_process_ip <machine 0's address>`: TCP between
//! the machines, shared memory inside each. Every rank must listen on its own machine's
//! address (binding every listener to MASTER_ADDR failed on machine 1 with "Cannot assign
//! requested address"). When one machine's workers fail before joining, the other's fail
//! within seconds naming that machine. Needs root; skips with a reason otherwise. The
//! namespaces are removed at the end, whatever happens.

use std::time::Duration;

use crate::common;

use crate::common::finish;
use crate::common::machines::Machines;

const EXE: &str = env!("CARGO_BIN_EXE_fsdp");

/// Starts `fsdp launch` of machine `i` of a 2-machine job of `processes` processes on
/// `port`, running `rest` (launcher flags, then the program; the vanish worker's role is
/// set, which other programs ignore).
fn launch(
    m: &Machines,
    i: usize,
    processes: &str,
    port: &str,
    rest: &[&str],
) -> std::process::Child {
    let rank = i.to_string();
    let mut args = vec![
        "launch",
        "--num_machines",
        "2",
        "--num_processes",
        processes,
        "--main_process_ip",
        &m.addrs[0],
        "--main_process_port",
        port,
        "--machine_rank",
        &rank,
    ];
    args.extend_from_slice(rest);
    m.fsdp(i, &args)
        .env("FSDP_JOB_SECRET", "two-machines-over-veth")
        .env(VANISH_ROLE, "1")
        .spawn()
        .unwrap()
}

/// Set for the test binary re-run as a worker of `a_machine_that_vanishes_...`.
const VANISH_ROLE: &str = "FSDP_TEST_VANISH_WORKER";

/// A worker that all-reduces 16 MiB again and again, saying each round, until a
/// collective fails (which it prints and exits with).
#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn vanish_worker() {
    if std::env::var(VANISH_ROLE).is_err() {
        return;
    }
    let pg = fsdp_comm::ProcessGroup::from_env().unwrap();
    for round in 0..100_000 {
        match pg
            .all_reduce(vec![1.0f32; 4 << 20], fsdp_comm::ReduceOp::Sum)
            .wait()
        {
            Ok(_) => println!("round {round}"),
            Err(e) => {
                println!("collective failed: {e}");
                std::process::exit(3);
            }
        }
    }
}

/// Run by `all_scenarios_that_mostly_wait_run_side_by_side`.
pub fn a_machine_that_vanishes_mid_transfer_is_named_within_seconds() {
    let Some(machines) = Machines::or_skip() else {
        return;
    };
    // One process per machine (their one connection carries the transfer, so only the
    // unacknowledged-data timeout can notice), then two.
    for processes in ["2", "4"] {
        vanish(&machines, processes);
    }
}

/// Starts the all-reduce job on both machines, takes machine 1's link down once transfers
/// run, and checks that machine 0 fails within seconds naming the lost ranks.
fn vanish(machines: &Machines, processes: &str) {
    let test_exe = std::env::current_exe().unwrap();
    let exe = test_exe.to_str().unwrap();
    let port = format!("2950{processes}");
    let start = |i: usize| {
        let program = [
            exe,
            "--exact",
            "machines::vanish_worker",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ];
        launch(machines, i, processes, &port, &program)
    };
    let (mut m0, m1) = (start(0), start(1));
    // If this test fails before machine 1's launcher is waited for, it is killed (its
    // workers die with it, PR_SET_PDEATHSIG).
    let m1_guard = KillOnDrop(Some(m1.id()));
    // Once transfers run, machine 1 vanishes: its link goes down, no connection is closed.
    let mut out = m0.stdout.take().unwrap();
    let mut seen = String::new();
    let started = std::time::Instant::now();
    while !seen.contains("round 3") {
        let mut buf = [0u8; 4096];
        let n = std::io::Read::read(&mut out, &mut buf).unwrap();
        assert!(
            n > 0 && started.elapsed() < Duration::from_secs(60),
            "{seen}"
        );
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    machines.set_link(1, "down");
    let cut = std::time::Instant::now();
    let drain = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut rest);
        rest
    });
    let r0 = finish(m0, Duration::from_secs(60));
    let failed_after = cut.elapsed();
    let all = format!("{seen}{}{}", drain.join().unwrap(), r0.out);
    assert_ne!(r0.code, Some(0), "{all}");
    assert!(
        failed_after < Duration::from_secs(25),
        "machine 0 took {failed_after:?} to fail after machine 1 vanished:\n{all}"
    );
    let lost = if processes == "2" { "rank 1" } else { "rank 2" };
    assert!(
        all.contains(lost) || all.contains("rank 3"),
        "the lost ranks are not named:\n{all}"
    );
    eprintln!("{processes} processes: machine 0 failed {failed_after:?} after machine 1 vanished");
    let r1 = finish(m1, Duration::from_secs(60));
    std::mem::forget(m1_guard);
    assert_ne!(r1.code, Some(0), "{}", r1.out);
    machines.set_link(1, "up");
}

#[test]
fn two_machines_over_a_network_train_like_one_process() {
    let Some(machines) = Machines::or_skip() else {
        return;
    };
    for strategy in ["FULL_SHARD", "HYBRID_SHARD"] {
        let start = |i: usize| {
            let program = [
                "--fsdp_sharding_strategy",
                strategy,
                EXE,
                "test",
                "--worker",
            ];
            launch(&machines, i, "4", "29500", &program)
        };
        let (m0, m1) = (start(0), start(1));
        let (r0, r1) = (
            finish(m0, Duration::from_secs(90)),
            finish(m1, Duration::from_secs(90)),
        );
        common::assert_two_machines_trained(&r0, &r1, strategy);
    }
    // ZeRO++'s communication (issue 57): int8 gathers and gradients, and backward's gathers
    // from a secondary partition of each machine's 2 processes, over the network.
    let zero_pp = [
        "--fsdp_sharding_strategy",
        "FULL_SHARD",
        "--fsdp_all_gather_dtype",
        "int8",
        "--fsdp_reduce_dtype",
        "int8",
        "--fsdp_hpz_partition_size",
        "2",
        EXE,
        "test",
        "--worker",
    ];
    let (m0, m1) = (
        launch(&machines, 0, "4", "29502", &zero_pp),
        launch(&machines, 1, "4", "29502", &zero_pp),
    );
    let (r0, r1) = (
        finish(m0, Duration::from_secs(90)),
        finish(m1, Duration::from_secs(90)),
    );
    assert_eq!(
        (r0.code, r1.code),
        (Some(0), Some(0)),
        "{}\n{}",
        r0.out,
        r1.out
    );
    assert!(
        r0.out.contains("training ok: 8 steps on 4 processes (shard groups of 4 x 1 replicas, int8 communication, two hops across 2 machines, secondary partition of 2)"),
        "{}",
        r0.out
    );
    // Machine 1's workers fail before they join: machine 0's ranks, waiting for them, fail
    // within seconds naming machine 1, not after the 120 s rendezvous timeout.
    let start = |i: usize, program: &[&str]| launch(&machines, i, "4", "29501", program);
    let m0 = start(0, &[EXE, "test", "--worker"]);
    let m1 = start(1, &["sh", "-c", "echo cannot start; exit 7"]);
    let (r0, r1) = (
        finish(m0, Duration::from_secs(60)),
        finish(m1, Duration::from_secs(60)),
    );
    assert_eq!(r1.code, Some(7), "{}", r1.out);
    assert_ne!(r0.code, Some(0), "{}", r0.out);
    assert!(
        r0.out.contains("machine 1 failed") && r0.out.contains("never joined"),
        "{}",
        r0.out
    );
    assert!(
        r0.elapsed < Duration::from_secs(20),
        "machine 0 took {:?} to fail:\n{}",
        r0.elapsed,
        r0.out
    );

    // Each machine listens on its own address, as `fsdp env` shows.
    for i in 0..2 {
        let out = machines
            .fsdp(i, &["env"])
            .env("MASTER_ADDR", &machines.addrs[0])
            .env("MASTER_PORT", "29500")
            .env("RANK", "0")
            .env("WORLD_SIZE", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let want = if i == 0 {
            format!("Listens for peers on: {} (chosen by", machines.addrs[0])
        } else {
            format!(
                "Listens for peers on: {} (chosen by the route",
                machines.addrs[1]
            )
        };
        assert!(text.contains(&want), "machine {i}: {text}");
    }
}

/// Kills a launcher this test started and has not waited for yet, when dropped.
struct KillOnDrop(Option<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            // SAFETY: a child of this process not yet reaped (its pid cannot be reused).
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
    }
}

/// `mpirun` across the two machines (Open MPI starts machine 1's processes through
/// `tools/netns-rsh.sh`, as it would through ssh): FULL_SHARD and HYBRID_SHARD train equal
/// to one process, over MPI (auto picks it: several machines, started under MPI) and, asked
/// for, over our TCP ring between the machines.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_across_two_machines_trains_over_mpi_and_over_tcp() {
    let Some(machines) = Machines::or_skip() else {
        return;
    };
    if !common::has_mpirun() {
        skipped!("no mpirun (install Debian's openmpi-bin)");
        return;
    }
    let agent = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/netns-rsh.sh");
    let subnet = format!("{}/24", machines.addrs[0]);
    let hosts = format!("{}:2,{}:2", machines.names[0], machines.names[1]);
    for (strategy, backend, transport) in [
        ("FULL_SHARD", "auto", "transport mpi"),
        ("HYBRID_SHARD", "auto", "transport mpi"),
        ("HYBRID_SHARD", "tcp", "transport tcp"),
    ] {
        let args = [
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            "-n",
            "4",
            "--host",
            &hosts,
            "--mca",
            "plm_rsh_agent",
            agent,
            "--mca",
            "oob_tcp_if_include",
            &subnet,
            "--mca",
            "btl_tcp_if_include",
            &subnet,
        ];
        let run = common::finish_mpirun(4, Duration::from_secs(120), || {
            let mut cmd = machines.command(0, "mpirun", &args);
            for e in [
                format!("MASTER_ADDR={}", machines.addrs[0]),
                format!("MASTER_PORT={}", common::port()),
                format!("FSDP_SHARDING_STRATEGY={strategy}"),
                format!("FSDP_COMM_BACKEND={backend}"),
            ] {
                cmd.arg("-x").arg(e);
            }
            cmd.args([EXE, "test", "--worker"]);
            cmd
        });
        let what = format!("{strategy} over {backend}");
        assert_eq!(run.code, Some(0), "{what}: {}", run.out);
        assert!(run.out.contains(transport), "{what}: {}", run.out);
        let finalized = (0..4)
            .filter(|r| run.out.contains(&format!("rank {r}: MPI finalized")))
            .count();
        let want = if transport == "transport mpi" { 4 } else { 0 };
        assert_eq!(finalized, want, "{what}: {}", run.out);
        assert!(
            run.out
                .contains("ranks (rank:local@machine): 0:0@0 1:1@0 2:0@1 3:1@1")
                && run.out.contains(&format!(
                    "training ok: 8 steps on 4 processes ({})",
                    common::mesh_of(strategy)
                )),
            "{what}: {}",
            run.out
        );
    }
}
