//! Machines on a real network for tests, from `tools/netns-machines.sh`: network namespaces
//! joined through a bridge, each with its own address on its `eth0`, its own hostname for
//! the processes started in it, and a hosts file naming all; everything is removed on drop.
//! Needs root.

use std::process::Command;

use super::fsdp;

const EXE: &str = env!("CARGO_BIN_EXE_fsdp");
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/netns-machines.sh");

/// Namespaced machines on one bridge; removed on drop.
pub struct Machines {
    /// The namespaces, which are also the machines' host names.
    pub names: Vec<String>,
    /// Their addresses.
    pub addrs: Vec<String>,
    /// The script's name for the set.
    set: String,
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
    /// Two machines.
    pub fn new() -> Result<Machines, String> {
        Machines::with(2)
    }

    /// `n` machines, or why they cannot be made here.
    pub fn with(n: usize) -> Result<Machines, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: network namespaces cannot be made".into());
        }
        // Tests of one binary run at once: each set gets a name of its own.
        static SETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = SETS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let set = format!("fsdp-{}-{k}", std::process::id());
        let out = Command::new("bash")
            .args([SCRIPT, "up", &set, &n.to_string()])
            .output()
            .map_err(|e| format!("{SCRIPT}: {e}"))?;
        let mut m = Machines {
            names: Vec::new(),
            addrs: Vec::new(),
            set,
        };
        if !out.status.success() {
            panic!(
                "setting up the namespaced machines: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some((name, addr)) = line.split_once(' ') {
                m.names.push(name.to_string());
                m.addrs.push(addr.to_string());
            }
        }
        assert_eq!(m.names.len(), n, "{}", String::from_utf8_lossy(&out.stdout));
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
        Machines::new().inspect_err(|why| skipped!("{why}")).ok()
    }

    /// Takes machine `i`'s link `up` or `down` (down: the machine vanishes from the network
    /// without closing a connection).
    pub fn set_link(&self, i: usize, state: &str) {
        ip(&["-n", &self.names[i], "link", "set", "eth0", state]).unwrap();
    }
}

impl Drop for Machines {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .args([SCRIPT, "down", &self.set, &self.names.len().to_string()])
            .status();
    }
}
