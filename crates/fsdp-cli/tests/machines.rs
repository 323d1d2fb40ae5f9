//! Jobs over two machines on a real network (issue 21, point 0): each machine is a network
//! namespace of its own (with its own hostname, so the two are different hosts to the job)
//! with one end of a veth pair and its own address on it, and runs its own `fsdp launch
//! --num_machines 2 --machine_rank i --main_process_ip <machine 0's address>`: TCP between
//! the machines, shared memory inside each. Every rank must listen on its own machine's
//! address (binding every listener to MASTER_ADDR failed on machine 1 with "Cannot assign
//! requested address"). When one machine's workers fail before joining, the other's fail
//! within seconds naming that machine. Needs root; skips with a reason otherwise. The
//! namespaces are removed at the end, whatever happens.

use std::process::Command;
use std::time::Duration;

mod common;

use common::{finish, fsdp};

const EXE: &str = env!("CARGO_BIN_EXE_fsdp");

/// Two namespaces joined by a veth pair, `10.231.<net>.1` and `.2`; removed on drop.
struct Machines {
    names: [String; 2],
    addrs: [String; 2],
    veth: [String; 2],
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Machines {
    fn new() -> Result<Machines, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: network namespaces cannot be made".into());
        }
        // Tests of this binary run at once: each pair of machines gets names and a subnet
        // of its own.
        static PAIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = PAIRS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let pid = std::process::id();
        let net = 20 + (pid % 50) * 4 + k % 4;
        let m = Machines {
            names: [format!("fsdp-{pid}-{k}-m0"), format!("fsdp-{pid}-{k}-m1")],
            addrs: [format!("10.231.{net}.1"), format!("10.231.{net}.2")],
            veth: [format!("fv{pid}{k}a"), format!("fv{pid}{k}b")],
        };
        // The first namespace says whether this machine can make them at all.
        ip(&["netns", "add", &m.names[0]])?;
        let setup = || -> Result<(), String> {
            let veth = &m.veth;
            ip(&["netns", "add", &m.names[1]])?;
            ip(&[
                "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1],
            ])?;
            for ((ns, dev), addr) in m.names.iter().zip(veth).zip(&m.addrs) {
                ip(&["link", "set", dev, "netns", ns])?;
                ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
                ip(&["-n", ns, "link", "set", dev, "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
            }
            Ok(())
        };
        if let Err(e) = setup() {
            panic!("setting up the namespaced machines: {e}");
        }
        Ok(m)
    }

    /// `fsdp ARGS` on machine `i`, in its namespace and under its own hostname.
    fn fsdp(&self, i: usize, args: &[&str]) -> Command {
        // The test environment of `fsdp()` (HOME, no FSDP_* variables), around `ip netns exec`.
        let cmd = fsdp();
        let script = format!("hostname {}; exec \"$@\"", self.names[i]);
        let mut wrapped = Command::new("ip");
        wrapped
            .args([
                "netns",
                "exec",
                &self.names[i],
                "unshare",
                "--uts",
                "sh",
                "-c",
            ])
            .arg(script)
            .arg("sh")
            .arg(EXE)
            .args(args);
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => wrapped.env(k, v),
                None => wrapped.env_remove(k),
            };
        }
        wrapped
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        wrapped
    }
}

impl Machines {
    /// The machines, or `None` after a one-line reason where they cannot be made.
    fn or_skip() -> Option<Machines> {
        Machines::new()
            .inspect_err(|why| eprintln!("SKIPPED: {why}"))
            .ok()
    }

    /// Takes machine `i`'s link `up` or `down` (down: the machine vanishes from the network
    /// without closing a connection).
    fn set_link(&self, i: usize, state: &str) {
        ip(&["-n", &self.names[i], "link", "set", &self.veth[i], state]).unwrap();
    }

    /// Starts `fsdp launch` of machine `i` of a 2-machine job of `processes` processes on
    /// `port`, running `rest` (launcher flags, then the program; the vanish worker's role is
    /// set, which other programs ignore).
    fn launch(&self, i: usize, processes: &str, port: &str, rest: &[&str]) -> std::process::Child {
        let rank = i.to_string();
        let mut args = vec![
            "launch",
            "--num_machines",
            "2",
            "--num_processes",
            processes,
            "--main_process_ip",
            &self.addrs[0],
            "--main_process_port",
            port,
            "--machine_rank",
            &rank,
        ];
        args.extend_from_slice(rest);
        self.fsdp(i, &args)
            .env("FSDP_JOB_SECRET", "two-machines-over-veth")
            .env(VANISH_ROLE, "1")
            .spawn()
            .unwrap()
    }
}

impl Drop for Machines {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// Set for the test binary re-run as a worker of `a_machine_that_vanishes_...`.
const VANISH_ROLE: &str = "FSDP_TEST_VANISH_WORKER";

/// A worker that all-reduces 16 MiB again and again, saying each round, until a
/// collective fails (which it prints and exits with).
#[test]
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

#[test]
fn a_machine_that_vanishes_mid_transfer_is_named_within_seconds() {
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
            "vanish_worker",
            "--nocapture",
            "--test-threads=1",
        ];
        machines.launch(i, processes, &port, &program)
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
            machines.launch(i, "4", "29500", &program)
        };
        let (m0, m1) = (start(0), start(1));
        let (r0, r1) = (
            finish(m0, Duration::from_secs(90)),
            finish(m1, Duration::from_secs(90)),
        );
        common::assert_two_machines_trained(&r0, &r1, strategy);
    }
    // Machine 1's workers fail before they join: machine 0's ranks, waiting for them, fail
    // within seconds naming machine 1, not after the 120 s rendezvous timeout.
    let start = |i: usize, program: &[&str]| machines.launch(i, "4", "29501", program);
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
