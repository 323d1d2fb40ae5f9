//! The part of the job this launcher is responsible for: the layout, the rendezvous address
//! and port, the job secret, threads per worker, and the machines' rendezvous (machine 0
//! hosts the store for the job's whole life).

use std::time::Duration;

use anyhow::{Context, Result, bail};
use fsdp::config::ResolvedConfig;
use fsdp_comm::{StoreClient, StoreServer};

use super::args::LaunchArgs;

/// Default rendezvous port, as torchrun's.
const DEFAULT_PORT: u16 = 29500;

/// The job layout this launcher is responsible for.
pub(super) struct Plan {
    /// Processes in the job.
    pub world: usize,
    /// Processes on this machine.
    pub local: usize,
    /// This machine's rank.
    pub machine_rank: usize,
    num_machines: usize,
    /// The rendezvous address (machine 0).
    pub addr: String,
    /// The rendezvous port.
    pub port: u16,
    /// The job secret every process presents.
    pub secret: String,
    /// Compute threads per worker.
    pub threads: usize,
}

impl Plan {
    /// The plan for `config` and the launcher's flags.
    pub(super) fn new(config: &ResolvedConfig, args: &LaunchArgs) -> Result<Plan> {
        let l = &config.launch;
        if l.num_machines > 1 && args.max_restarts > 0 {
            bail!(
                "--max_restarts is supported for single-machine jobs only (got num_machines: {})",
                l.num_machines
            );
        }
        let addr = l
            .main_process_ip
            .clone()
            .unwrap_or_else(|| "127.0.0.1".into());
        let port = match l.main_process_port {
            // One machine and no port asked for: a free one, so jobs never collide.
            None if l.num_machines == 1 => free_port(&addr)?,
            None => DEFAULT_PORT,
            Some(0) if l.num_machines > 1 => {
                bail!(
                    "--main_process_port 0 (pick a free port) only works on one machine: the others must know the port"
                )
            }
            Some(0) => free_port(&addr)?,
            Some(p) => p,
        };
        let secret = match std::env::var(fsdp_comm::SECRET_ENV) {
            Ok(s) if !s.is_empty() => s,
            // A secret derived from public facts keeps nobody out: machine 0 makes one and
            // says how to pass it; the other machines must be given it.
            _ if l.num_machines > 1 && l.machine_rank > 0 => bail!(
                "{} is not set: the machines of a job must share a secret. Set the value machine 0 printed (or your own, on every machine): {}=... fsdp launch ...",
                fsdp_comm::SECRET_ENV,
                fsdp_comm::SECRET_ENV
            ),
            _ if l.num_machines > 1 => {
                let secret = random_secret();
                eprintln!(
                    "[fsdp launch] {} is not set: generated this job's secret. Start the other machines with\n[fsdp launch]   {}={secret}",
                    fsdp_comm::SECRET_ENV,
                    fsdp_comm::SECRET_ENV
                );
                secret
            }
            _ => random_secret(),
        };
        let local = l.processes_per_machine();
        check_worker_count(local)?;
        let threads = l
            .num_cpu_threads_per_process
            .unwrap_or_else(|| (crate::system::available_cores() / local.max(1)).max(1));
        Ok(Plan {
            world: l.num_processes,
            local,
            machine_rank: l.machine_rank,
            num_machines: l.num_machines,
            addr,
            port,
            secret,
            threads,
        })
    }

    /// The global rank of this machine's first worker.
    pub(super) fn first_rank(&self) -> usize {
        self.machine_rank * self.local
    }

    /// Machine 0 hosts the store for the job's lifetime (restarts included); every machine
    /// registers its machine rank, so a duplicate or missing machine is reported by number.
    pub(super) fn rendezvous(&self, say: &dyn Fn(String)) -> Result<Rendezvous> {
        let timeout = rendezvous_timeout()?;
        let server = if self.machine_rank == 0 {
            Some(
                StoreServer::bind((self.addr.as_str(), self.port), self.secret.as_bytes())
                    .with_context(|| {
                        format!("hosting the rendezvous on {}:{}", self.addr, self.port)
                    })?,
            )
        } else {
            None
        };
        if self.num_machines == 1 {
            return Ok(Rendezvous {
                _server: server,
                client: None,
                machine_rank: 0,
            });
        }
        say(format!(
            "machine {} of {}: rendezvous at {}:{}",
            self.machine_rank, self.num_machines, self.addr, self.port
        ));
        let client = StoreClient::connect(
            &self.addr,
            self.port,
            self.secret.as_bytes(),
            self.first_rank(),
            timeout,
        )
        .with_context(|| {
            format!(
                "machine rank {} could not reach machine rank 0 at {}:{}",
                self.machine_rank, self.addr, self.port
            )
        })?;
        let layout = format!("{} processes on {} machines", self.world, self.num_machines);
        let agreed = client.compare_set("launch/layout", None, layout.as_bytes())?;
        if agreed.as_deref() != Some(layout.as_bytes()) {
            bail!(
                "machine rank {} was launched for {layout}, but another machine registered {}",
                self.machine_rank,
                String::from_utf8_lossy(&agreed.unwrap_or_default())
            );
        }
        let token = format!("{}-{}", hostname(), std::process::id());
        let key = format!("launch/machine/{}", self.machine_rank);
        let owner = client.compare_set(&key, None, token.as_bytes())?;
        if owner.as_deref() != Some(token.as_bytes()) {
            bail!(
                "machine rank {} is already taken by another launch ({}) at {}:{}: give each machine its own --machine_rank",
                self.machine_rank,
                String::from_utf8_lossy(&owner.unwrap_or_default()),
                self.addr,
                self.port
            );
        }
        let keys: Vec<String> = (0..self.num_machines)
            .map(|m| format!("launch/machine/{m}"))
            .collect();
        if let Err(missing) = client.wait(&keys, timeout)? {
            let ranks: Vec<&str> = missing
                .iter()
                .filter_map(|k| k.rsplit('/').next())
                .collect();
            bail!(
                "machine rank(s) {} never joined the rendezvous at {}:{} within {timeout:?}",
                ranks.join(", "),
                self.addr,
                self.port
            );
        }
        Ok(Rendezvous {
            _server: server,
            client: Some(std::sync::Arc::new(client)),
            machine_rank: self.machine_rank,
        })
    }
}

/// How long a failing launcher waits for the store to take its stop message.
const STOP_JOINING_WAIT: Duration = Duration::from_secs(2);

/// This launcher's part in the job's rendezvous: the store it hosts (machine 0), and with
/// several machines its connection to the store, through which it stops the others' ranks
/// still joining when its own part fails.
pub(super) struct Rendezvous {
    /// The store (machine 0 only), held for the job's lifetime: dropping it stops it.
    _server: Option<StoreServer>,
    client: Option<std::sync::Arc<StoreClient>>,
    machine_rank: usize,
}

impl Rendezvous {
    /// Tells the ranks of attempt `attempt` on every machine that are still joining that
    /// this machine's part failed (`reason`), so they fail at once naming it instead of
    /// waiting out the rendezvous timeout. Best effort: the job is failing already.
    pub(super) fn stop_joining(&self, attempt: u32, reason: &str) {
        let Some(client) = &self.client else {
            return;
        };
        let key = format!("attempt{attempt}/{}", fsdp_comm::ABORT_KEY);
        let text = format!("machine {} failed: {reason}", self.machine_rank);
        // At most a couple of seconds (the store's host may be the machine that vanished):
        // the request goes on in a thread of its own, which the launcher does not wait for.
        let (done, wait) = std::sync::mpsc::channel();
        let client = client.clone();
        let setter = std::thread::Builder::new()
            .name("fsdp-stop-joining".into())
            .spawn(move || {
                let _ = client.set(&key, text.as_bytes());
                let _ = done.send(());
            });
        if setter.is_ok() {
            let _ = wait.recv_timeout(STOP_JOINING_WAIT);
        }
    }
}

/// A port on `addr` that is free now.
fn free_port(addr: &str) -> Result<u16> {
    Ok(std::net::TcpListener::bind((addr, 0))
        .and_then(|l| l.local_addr())
        .with_context(|| format!("picking a free port on {addr}"))?
        .port())
}

/// The rendezvous timeout workers use too (`FSDP_RENDEZVOUS_TIMEOUT_SECS`); the workers'
/// other `FSDP_*` group settings are checked here too, so a bad value fails the launch
/// naming the variable before any worker starts.
fn rendezvous_timeout() -> Result<Duration> {
    Ok(fsdp_comm::GroupOptions::from_env()?.rendezvous_timeout)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_or_else(|_| "?".into(), |h| h.trim().to_string())
}

fn random_secret() -> String {
    let mut bytes = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut bytes);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{}{nanos:x}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

/// Workers per core a machine may be given: training processes beyond this only wait for
/// cores (tests oversubscribe by 2-4; one process per GPU is far below it).
const WORKERS_PER_CORE: usize = 16;

/// Refuses to start more workers on this machine than `WORKERS_PER_CORE` per core or than
/// the user may still start processes (`ulimit -u`, less what runs), with the reason.
fn check_worker_count(local: usize) -> Result<()> {
    let cores = crate::system::available_cores();
    let most = cores.saturating_mul(WORKERS_PER_CORE);
    if local > most {
        bail!(
            "{local} worker processes on this machine are more than it can run: at most {most} ({WORKERS_PER_CORE} per core on its {cores} core(s)); lower --num_processes, or spread them with --num_machines"
        );
    }
    // SAFETY: getrlimit fills the struct it is given.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    let known = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut limit) } == 0;
    if known && limit.rlim_cur != libc::RLIM_INFINITY && local as u64 >= limit.rlim_cur {
        bail!(
            "{local} worker processes reach this user's process limit (ulimit -u: {}); lower --num_processes or raise the limit",
            limit.rlim_cur
        );
    }
    Ok(())
}
