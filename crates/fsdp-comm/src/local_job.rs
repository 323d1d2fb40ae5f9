//! Starting workers on this machine: [`WorkerEnv`] writes the torchrun environment a worker
//! reads back with [`crate::WorldInfo::from_env`] (the launcher, the benchmarks and the tests
//! all go through it), and [`LocalJob`] runs a job's processes with a deadline, drains their
//! output as they write it, and kills what is left when it goes away.

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::options::{
    OUTPUT_PREFIXED_ENV, PREFIX_ENV, RESTART_COUNT_ENV, SECRET_ENV, STORE_HOSTED_ENV, TIMEOUT_ENV,
};

/// The environment of one worker: the torchrun contract (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
/// `LOCAL_WORLD_SIZE`, `NODE_RANK`, `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`), the job secret,
/// and the settings a launcher passes along.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerEnv {
    /// Global rank.
    pub rank: usize,
    /// Rank on this machine.
    pub local_rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// This machine's index.
    pub node_rank: usize,
    /// Address of the rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// The per-job secret every process presents.
    pub secret: String,
    /// Compute threads (`RAYON_NUM_THREADS`, `CANDLE_NUM_THREADS`, `OMP_NUM_THREADS`).
    pub threads: Option<usize>,
    /// The launcher hosts the rendezvous store (rank 0 does not start one).
    pub store_hosted: bool,
    /// Prefix of this attempt's store keys.
    pub store_prefix: Option<String>,
    /// Collective timeout.
    pub comm_timeout: Option<Duration>,
    /// The launcher starts each line of the worker's output with its rank.
    pub output_prefixed: bool,
    /// Which attempt of the job this is (0: the first; a restart after a failure counts up).
    pub restart_count: u32,
}

impl WorkerEnv {
    /// Rank `rank` of a `world_size`-process job on this machine, whose store listens on
    /// loopback `port`.
    pub fn local(rank: usize, world_size: usize, port: u16, secret: &str) -> WorkerEnv {
        WorkerEnv {
            rank,
            local_rank: rank,
            world_size,
            local_world_size: world_size,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            secret: secret.into(),
            threads: None,
            store_hosted: false,
            store_prefix: None,
            comm_timeout: None,
            output_prefixed: false,
            restart_count: 0,
        }
    }

    /// The variables, in a fixed order.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![
            ("RANK", self.rank.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
            ("NODE_RANK", self.node_rank.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            (SECRET_ENV, self.secret.clone()),
        ];
        if let Some(t) = self.threads {
            for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS", "OMP_NUM_THREADS"] {
                out.push((var, t.to_string()));
            }
        }
        if self.store_hosted {
            out.push((STORE_HOSTED_ENV, "1".into()));
        }
        if let Some(p) = &self.store_prefix {
            out.push((PREFIX_ENV, p.clone()));
        }
        if let Some(t) = self.comm_timeout {
            out.push((TIMEOUT_ENV, t.as_secs_f64().to_string()));
        }
        if self.output_prefixed {
            out.push((OUTPUT_PREFIXED_ENV, "1".into()));
        }
        // torchrun's name too, for programs written against it.
        for var in [RESTART_COUNT_ENV, "TORCHELASTIC_RESTART_COUNT"] {
            out.push((var, self.restart_count.to_string()));
        }
        out
    }

    /// Sets the variables on `cmd`.
    pub fn apply<'a>(&self, cmd: &'a mut Command) -> &'a mut Command {
        cmd.envs(self.vars())
    }
}

/// A free TCP port on loopback (for a local job's store).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// What one worker of a finished (or stopped) job did.
#[derive(Debug, Clone)]
pub struct WorkerOutput {
    /// The worker's rank.
    pub rank: usize,
    /// How it ended; `None` if it was killed at the deadline.
    pub status: Option<ExitStatus>,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

impl WorkerOutput {
    /// Standard output followed by standard error.
    pub fn combined(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }

    /// Whether it exited with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

struct Worker {
    rank: usize,
    child: Child,
    stdout: Option<JoinHandle<Vec<u8>>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
    status: Option<ExitStatus>,
}

/// The processes of a job on this machine (see the module docs). Dropping it kills and reaps
/// every process still running.
pub struct LocalJob {
    workers: Vec<Worker>,
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> Option<JoinHandle<Vec<u8>>> {
    let mut pipe = pipe?;
    std::thread::Builder::new()
        .name("fsdp-job-output".into())
        .spawn(move || {
            let mut out = Vec::new();
            let _ = pipe.read_to_end(&mut out);
            out
        })
        .ok()
}

impl LocalJob {
    /// Starts `ranks` of a `world_size`-process job on this machine: `command(rank)` with
    /// [`WorkerEnv::local`] (a fresh port and a secret; variables the command already sets
    /// are left as they are), `threads` compute threads each, and stdout and stderr captured.
    /// On an error the processes already started are killed.
    pub fn start(
        world_size: usize,
        ranks: impl IntoIterator<Item = usize>,
        threads: Option<usize>,
        mut command: impl FnMut(usize) -> Command,
    ) -> std::io::Result<LocalJob> {
        let port = free_port()?;
        let secret = format!("job-{}-{port}", std::process::id());
        let mut job = LocalJob {
            workers: Vec::new(),
        };
        for rank in ranks {
            let mut cmd = command(rank);
            let mut env = WorkerEnv::local(rank, world_size, port, &secret);
            env.threads = threads;
            // Variables the caller set on the command win (a wrong secret on purpose, say).
            let set: Vec<std::ffi::OsString> =
                cmd.get_envs().map(|(k, _)| k.to_os_string()).collect();
            for (k, v) in env.vars() {
                if !set.iter().any(|s| s == k) {
                    cmd.env(k, v);
                }
            }
            cmd.stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = cmd.spawn()?;
            let stdout = drain(child.stdout.take());
            let stderr = drain(child.stderr.take());
            job.workers.push(Worker {
                rank,
                child,
                stdout,
                stderr,
                status: None,
            });
        }
        Ok(job)
    }

    /// Waits up to `limit` for every process; kills those still running at the deadline.
    /// Returns each worker's outcome and whether the deadline struck.
    pub fn wait(self, limit: Duration) -> (Vec<WorkerOutput>, bool) {
        let all: Vec<usize> = self.workers.iter().map(|w| w.rank).collect();
        self.wait_for(&all, limit)
    }

    /// Waits up to `limit` for the workers of `ranks`, then kills every process still
    /// running (the others too: a peer left hanging on purpose, say). Returns each worker's
    /// outcome and whether the deadline struck before `ranks` were done.
    pub fn wait_for(mut self, ranks: &[usize], limit: Duration) -> (Vec<WorkerOutput>, bool) {
        let deadline = Instant::now() + limit;
        loop {
            for w in &mut self.workers {
                if w.status.is_none()
                    && let Ok(Some(status)) = w.child.try_wait()
                {
                    w.status = Some(status);
                }
            }
            let pending = self
                .workers
                .iter()
                .any(|w| w.status.is_none() && ranks.contains(&w.rank));
            if !pending || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let timed_out = self
            .workers
            .iter()
            .any(|w| w.status.is_none() && ranks.contains(&w.rank));
        let mut outputs = Vec::new();
        for mut w in std::mem::take(&mut self.workers) {
            if w.status.is_none() {
                let _ = w.child.kill();
                let _ = w.child.wait();
            }
            let text = |h: Option<JoinHandle<Vec<u8>>>| {
                h.and_then(|h| h.join().ok())
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default()
            };
            outputs.push(WorkerOutput {
                rank: w.rank,
                status: w.status,
                stdout: text(w.stdout.take()),
                stderr: text(w.stderr.take()),
            });
        }
        (outputs, timed_out)
    }
}

impl Drop for LocalJob {
    fn drop(&mut self) {
        for w in &mut self.workers {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}
