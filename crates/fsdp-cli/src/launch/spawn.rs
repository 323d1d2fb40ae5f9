//! Starting one worker: its environment (the torchrun contract from fsdp-comm's
//! `WorkerEnv`, and the configuration's `FSDP_*` variables), its own process group, death
//! with the launcher (`PR_SET_PDEATHSIG`), its output relays, and watching its exit.

use std::os::fd::{AsFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use fsdp::config::{DistributedType, Key, ResolvedConfig, Source, Value};

use super::args::LaunchArgs;
use super::exits::ExitWatcher;
use super::plan::Plan;
use super::relay::{Relay, Route, Tail};

/// A started worker.
pub(super) struct Worker {
    pub child: std::process::Child,
    pub pid: u32,
    pub rank: usize,
    pub tail: Arc<Mutex<Tail>>,
    pub relays: Vec<Relay>,
    pub done: Option<std::process::ExitStatus>,
}

/// The environment every worker gets from the configuration: every value that is not the
/// default (workers apply the same defaults table), and whether to use FSDP.
pub(super) fn config_env(config: &ResolvedConfig) -> Vec<(String, String)> {
    let mut vars = Vec::new();
    for (key, setting) in config.iter() {
        let Some(var) = key.spec().env else { continue };
        if key == Key::DistributedType {
            let fsdp = config.launch.distributed_type == DistributedType::Fsdp;
            vars.push((var.to_string(), fsdp.to_string()));
        } else if setting.source != Source::Default && !matches!(setting.value, Value::Yaml(_)) {
            vars.push((var.to_string(), setting.value.to_env_text()));
        }
    }
    vars
}

/// What is the same for every worker of an attempt.
pub(super) struct Attempt<'a> {
    pub plan: &'a Plan,
    pub config: &'a ResolvedConfig,
    pub args: &'a LaunchArgs,
    pub env: Vec<(String, String)>,
    pub number: u32,
    pub shown: Option<Vec<usize>>,
    /// `--log_dir`, checked to hold no earlier job's logs.
    pub log_dir: Option<&'a std::path::Path>,
}

/// Starts local rank `local_rank`. On error nothing of this worker is left running.
pub(super) fn spawn(a: &Attempt<'_>, local_rank: usize, exits: &mut ExitWatcher) -> Result<Worker> {
    let (plan, args) = (a.plan, a.args);
    let rank = plan.first_rank() + local_rank;
    let program = args.program();
    let mut cmd = Command::new(&program[0]);
    let worker_env = fsdp_comm::WorkerEnv {
        rank,
        local_rank,
        world_size: plan.world,
        local_world_size: plan.local,
        node_rank: plan.machine_rank,
        master_addr: plan.addr.clone(),
        master_port: plan.port,
        secret: plan.secret.clone(),
        threads: Some(plan.threads),
        store_hosted: true,
        store_prefix: Some(format!("attempt{}/", a.number)),
        comm_timeout: args.comm_timeout,
        // The relay starts every console line with `[rankN]: `.
        output_prefixed: true,
        restart_count: a.number,
    };
    cmd.args(&program[1..])
        .envs(a.env.iter().map(|(k, v)| (k, v)));
    worker_env
        .apply(&mut cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let (false, Some(ids)) = (a.config.launch.use_cpu, &a.config.launch.gpu_ids) {
        let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
        cmd.env("CUDA_VISIBLE_DEVICES", ids.join(","));
    }
    // Each worker leads its own process group: the launcher decides when it is stopped
    // (a terminal's Ctrl-C reaches only the launcher, which forwards it).
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    die_with_launcher(&mut cmd);
    let logs = open_logs(a.log_dir, args.tee, rank, a.number)?;
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start `{}` for rank {rank}", program[0]))?;
    let pid = child.id();
    let outputs = output_duplicates(&child);
    let started = start_relays(&mut child, a, local_rank, rank, logs)
        .and_then(|started| exits.watch(rank, pid, outputs).map(|()| started));
    match started {
        Ok((tail, relays)) => Ok(Worker {
            child,
            pid,
            rank,
            tail,
            relays,
            done: None,
        }),
        Err(e) => {
            // SAFETY: signalling the process group of a child we have not reaped.
            unsafe {
                libc::kill(-(pid as i32), libc::SIGKILL);
            }
            let _ = child.wait();
            Err(e)
        }
    }
}

/// The worker gets SIGKILL when the launcher dies, however it dies (`kill -9` included);
/// a worker whose launcher is already gone when it starts exits at once.
fn die_with_launcher(cmd: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe system calls between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// The rank's log files in this job's log folder (stdout, stderr), as `--tee` says; files of
/// earlier attempts are kept (`rank{N}.attempt{K}.stdout` after the first).
fn open_logs(
    dir: Option<&std::path::Path>,
    tee: u8,
    rank: usize,
    attempt: u32,
) -> Result<[Option<std::fs::File>; 2]> {
    let mut out = [None, None];
    let Some(dir) = dir else {
        return Ok(out);
    };
    for (i, (name, bit)) in [("stdout", 1u8), ("stderr", 2u8)].into_iter().enumerate() {
        if tee & bit != 0 || tee == 0 {
            let path = dir.join(log_file_name(rank, name, attempt));
            out[i] = Some(
                std::fs::File::create(&path)
                    .with_context(|| format!("creating the rank {rank} log {}", path.display()))?,
            );
        }
    }
    Ok(out)
}

/// Prepares `--log_dir`: made if missing, and refused when it holds log files of an earlier
/// job (`rank{N}.stdout`, ...), whose files would otherwise mix with this job's — a job of
/// fewer ranks would leave the others' files looking like its own.
pub(super) fn prepare_log_dir(log_dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(log_dir)
        .with_context(|| format!("creating --log_dir {}", log_dir.display()))?;
    let mut earlier: Vec<String> = std::fs::read_dir(log_dir)
        .with_context(|| format!("reading --log_dir {}", log_dir.display()))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| is_log_file_name(n))
        .collect();
    earlier.sort();
    if let Some(first) = earlier.first() {
        bail!(
            "--log_dir {} holds the logs of an earlier job ({first}{}): give each job a folder of its own, or remove them",
            log_dir.display(),
            if earlier.len() > 1 {
                format!(" and {} more", earlier.len() - 1)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// Whether `name` is one `log_file_name` gives.
fn is_log_file_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("rank") else {
        return false;
    };
    let Some((stem, stream)) = rest.rsplit_once('.') else {
        return false;
    };
    let rank = stem.split_once(".attempt").map_or(stem, |(r, _)| r);
    matches!(stream, "stdout" | "stderr")
        && !rank.is_empty()
        && rank.bytes().all(|b| b.is_ascii_digit())
}

/// `rank{N}.{stream}` for the first attempt, `rank{N}.attempt{K}.{stream}` for restarts.
pub(super) fn log_file_name(rank: usize, stream: &str, attempt: u32) -> String {
    match attempt {
        0 => format!("rank{rank}.{stream}"),
        k => format!("rank{rank}.attempt{k}.{stream}"),
    }
}

type Started = (Arc<Mutex<Tail>>, Vec<Relay>);

/// Second descriptors for the read ends of `child`'s output pipes, for the exit watcher to
/// see them hang up as the worker begins to exit (one that cannot be made is left out).
fn output_duplicates(child: &std::process::Child) -> Vec<OwnedFd> {
    let stdout = child
        .stdout
        .as_ref()
        .map(|s| s.as_fd().try_clone_to_owned());
    let stderr = child
        .stderr
        .as_ref()
        .map(|s| s.as_fd().try_clone_to_owned());
    [stdout, stderr].into_iter().flatten().flatten().collect()
}

fn start_relays(
    child: &mut std::process::Child,
    a: &Attempt<'_>,
    local_rank: usize,
    rank: usize,
    logs: [Option<std::fs::File>; 2],
) -> Result<Started> {
    let tail = Arc::new(Mutex::new(Tail::default()));
    let show = a.shown.as_ref().is_none_or(|s| s.contains(&local_rank));
    let [out_log, err_log] = logs;
    let mut relays = Vec::new();
    let stdout = child
        .stdout
        .take()
        .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>);
    let stderr = child
        .stderr
        .take()
        .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>);
    for (stream, to_stderr, log) in [(stdout, false, out_log), (stderr, true, err_log)] {
        let Some(stream) = stream else { continue };
        let route = Route {
            rank,
            show,
            to_stderr,
            log,
            tail: tail.clone(),
        };
        relays.push(
            Relay::start(stream, route)
                .with_context(|| format!("starting a thread to relay rank {rank}'s output"))?,
        );
    }
    if relays.len() != 2 {
        bail!("rank {rank}'s output pipes were not created");
    }
    Ok((tail, relays))
}

#[cfg(test)]
mod tests {
    use super::{is_log_file_name, log_file_name};

    #[test]
    fn log_file_names_are_recognised() {
        for (rank, attempt) in [(0, 0), (12, 0), (3, 2)] {
            for stream in ["stdout", "stderr"] {
                assert!(is_log_file_name(&log_file_name(rank, stream, attempt)));
            }
        }
        for other in [
            "rank.stdout",
            "rankx.stdout",
            "rank0.log",
            "notes.txt",
            "rank0",
        ] {
            assert!(!is_log_file_name(other), "{other}");
        }
    }
}
