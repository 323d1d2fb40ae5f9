//! Two machines on a real network for tests: network namespaces, each with its own address
//! on one end of a veth pair, its own hostname for the processes started in it, and a hosts
//! file naming both; everything is removed on drop. Needs root.

use std::process::Command;

use super::fsdp;

const EXE: &str = env!("CARGO_BIN_EXE_fsdp");

/// Two namespaces joined by a veth pair, `10.231.<net>.1` and `.2`; removed on drop.
pub struct Machines {
    /// The namespaces, which are also the machines' host names.
    pub names: [String; 2],
    /// Their addresses on the veth pair.
    pub addrs: [String; 2],
    veth: [String; 2],
}

pub fn ip(args: &[&str]) -> Result<(), String> {
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
    pub fn new() -> Result<Machines, String> {
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
            // `ip netns exec` shows /etc/netns/NAME/hosts as /etc/hosts: the machines know
            // each other by name, as cluster nodes do.
            let hosts = format!(
                "127.0.0.1 localhost\n{} {}\n{} {}\n",
                m.addrs[0], m.names[0], m.addrs[1], m.names[1]
            );
            for n in &m.names {
                let d = format!("/etc/netns/{n}");
                std::fs::create_dir_all(&d).map_err(|e| format!("{d}: {e}"))?;
                std::fs::write(format!("{d}/hosts"), &hosts).map_err(|e| format!("{d}: {e}"))?;
            }
            Ok(())
        };
        if let Err(e) = setup() {
            panic!("setting up the namespaced machines: {e}");
        }
        Ok(m)
    }

    /// `fsdp ARGS` on machine `i`, in its namespace and under its own hostname.
    pub fn fsdp(&self, i: usize, args: &[&str]) -> Command {
        self.command(i, EXE, args)
    }

    /// `program ARGS` on machine `i`, in its namespace and under its own hostname, with the
    /// test environment of `fsdp()` (HOME, no FSDP_* variables).
    pub fn command(&self, i: usize, program: &str, args: &[&str]) -> Command {
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
            .arg(program)
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
    pub fn or_skip() -> Option<Machines> {
        Machines::new()
            .inspect_err(|why| eprintln!("SKIPPED: {why}"))
            .ok()
    }

    /// Takes machine `i`'s link `up` or `down` (down: the machine vanishes from the network
    /// without closing a connection).
    pub fn set_link(&self, i: usize, state: &str) {
        ip(&["-n", &self.names[i], "link", "set", &self.veth[i], state]).unwrap();
    }
}

impl Drop for Machines {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
            let _ = std::fs::remove_dir_all(format!("/etc/netns/{n}"));
        }
    }
}
