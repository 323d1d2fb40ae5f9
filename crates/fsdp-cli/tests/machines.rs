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
        let pid = std::process::id();
        let net = 20 + pid % 200;
        let m = Machines {
            names: [format!("fsdp-{pid}-m0"), format!("fsdp-{pid}-m1")],
            addrs: [format!("10.231.{net}.1"), format!("10.231.{net}.2")],
        };
        let veth = [format!("fv{pid}a"), format!("fv{pid}b")];
        for n in &m.names {
            ip(&["netns", "add", n])?;
        }
        ip(&[
            "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1],
        ])?;
        for ((ns, dev), addr) in m.names.iter().zip(&veth).zip(&m.addrs) {
            ip(&["link", "set", dev, "netns", ns])?;
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
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

impl Drop for Machines {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

#[test]
fn two_machines_over_a_network_train_like_one_process() {
    let machines = match Machines::new() {
        Ok(m) => m,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    for strategy in ["FULL_SHARD", "HYBRID_SHARD"] {
        let start = |i: usize| {
            let rank = i.to_string();
            machines
                .fsdp(
                    i,
                    &[
                        "launch",
                        "--num_machines",
                        "2",
                        "--num_processes",
                        "4",
                        "--main_process_ip",
                        &machines.addrs[0],
                        "--main_process_port",
                        "29500",
                        "--machine_rank",
                        &rank,
                        "--fsdp_sharding_strategy",
                        strategy,
                        EXE,
                        "test",
                        "--worker",
                    ],
                )
                .env("FSDP_JOB_SECRET", "two-machines-over-veth")
                .spawn()
                .unwrap()
        };
        let (m0, m1) = (start(0), start(1));
        let (r0, r1) = (
            finish(m0, Duration::from_secs(90)),
            finish(m1, Duration::from_secs(90)),
        );
        assert_eq!(
            (r0.code, r1.code),
            (Some(0), Some(0)),
            "{strategy}\nmachine 0:\n{}\nmachine 1:\n{}",
            r0.out,
            r1.out
        );
        assert!(
            r0.out.contains(&format!("strategy {strategy}"))
                && r0.out.contains("training ok: 8 steps on 4 processes"),
            "{}",
            r0.out
        );
        assert!(
            r1.out
                .contains("[rank3]: rank 3 of 4 (local 1 of 2, machine 1)"),
            "{}",
            r1.out
        );
    }
    // Machine 1's workers fail before they join: machine 0's ranks, waiting for them, fail
    // within seconds naming machine 1, not after the 120 s rendezvous timeout.
    let start = |i: usize, program: &[&str]| {
        let rank = i.to_string();
        let mut args = vec![
            "launch",
            "--num_machines",
            "2",
            "--num_processes",
            "4",
            "--main_process_ip",
            &machines.addrs[0],
            "--main_process_port",
            "29501",
            "--machine_rank",
            &rank,
        ];
        args.extend_from_slice(program);
        machines
            .fsdp(i, &args)
            .env("FSDP_JOB_SECRET", "two-machines-over-veth")
            .spawn()
            .unwrap()
    };
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
