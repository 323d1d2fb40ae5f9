//! `fsdp launch`: start the workers of a job on this machine with the torchrun environment
//! contract and the resolved configuration, relay their output, and tear everything down
//! when one fails or the launcher is interrupted.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{ArgMatches, Args, FromArgMatches};
use fsdp::config::{
    DistributedType, Key, Layer, ResolvedConfig, Section, Source, Value, parse_text,
};
use fsdp_comm::store::{StoreClient, StoreServer};

use crate::ConfigFileArg;

/// Default rendezvous port, as torchrun's.
const DEFAULT_PORT: u16 = 29500;
/// How long workers get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(5);
/// Lines of each worker's output kept for the failure report.
const TAIL_LINES: usize = 20;

/// Launch a training program on this machine's share of the job's processes.
///
/// Every flag overrides the config file (and the FSDP_* environment); the program's own
/// arguments follow it. Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK,
/// MASTER_ADDR, MASTER_PORT, the job secret, and ACCELERATE_USE_FSDP / FSDP_* /
/// ACCELERATE_MIXED_PRECISION from the resolved configuration.
#[derive(Args, Debug)]
pub struct LaunchArgs {
    #[command(flatten)]
    file: ConfigFileArg,
    /// Total number of processes over all machines.
    #[arg(long = "num_processes", visible_alias = "num-processes")]
    num_processes: Option<String>,
    /// Number of machines.
    #[arg(long = "num_machines", visible_alias = "num-machines")]
    num_machines: Option<String>,
    /// This machine's rank (0 hosts the rendezvous).
    #[arg(long = "machine_rank", visible_alias = "machine-rank")]
    machine_rank: Option<String>,
    /// Address of machine rank 0.
    #[arg(long = "main_process_ip", visible_alias = "main-process-ip")]
    main_process_ip: Option<String>,
    /// Rendezvous port on machine rank 0 (0 picks a free port; one machine only).
    #[arg(long = "main_process_port", visible_alias = "main-process-port")]
    main_process_port: Option<String>,
    /// no, fp16 or bf16.
    #[arg(long = "mixed_precision", visible_alias = "mixed-precision")]
    mixed_precision: Option<String>,
    /// Use FSDP (sets distributed_type FSDP).
    #[arg(long = "use_fsdp", visible_alias = "use-fsdp")]
    use_fsdp: bool,
    /// Train on CPU even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    /// Compute threads per worker [default: cores / local processes].
    #[arg(
        long = "num_cpu_threads_per_process",
        visible_alias = "num-cpu-threads-per-process"
    )]
    num_cpu_threads_per_process: Option<String>,
    /// GPU ids for this machine, comma-separated, or `all`.
    #[arg(long = "gpu_ids", visible_alias = "gpu-ids")]
    gpu_ids: Option<String>,
    /// Rendezvous backend (static).
    #[arg(long = "rdzv_backend", visible_alias = "rdzv-backend")]
    rdzv_backend: Option<String>,
    /// Machines share a network (no effect with static rendezvous; accepted for Accelerate).
    #[arg(long = "same_network", visible_alias = "same-network")]
    same_network: bool,
    /// Restart the whole worker group up to N times after a failure (one machine only).
    #[arg(
        long = "max_restarts",
        visible_alias = "max-restarts",
        default_value_t = 0
    )]
    max_restarts: u32,
    /// Also write streams to the per-rank files in --log_dir: 0 none, 1 stdout, 2 stderr,
    /// 3 both (torchrun's --tee).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    tee: u8,
    /// Directory for per-rank log files (rank{N}.stdout / rank{N}.stderr).
    #[arg(long = "log_dir", visible_alias = "log-dir")]
    log_dir: Option<PathBuf>,
    /// Local ranks whose output is shown on the console, comma-separated [default: all].
    #[arg(long = "local_ranks_filter", visible_alias = "local-ranks-filter")]
    local_ranks_filter: Option<String>,
    /// Print only the workers' output, not the launcher's messages.
    #[arg(short, long)]
    quiet: bool,
    /// Run with collective and FSDP state checks.
    #[arg(long)]
    debug: bool,
    /// Build this example of the workspace with cargo (release) and run it; PROGRAM ARGS are
    /// then the example's arguments.
    #[arg(long)]
    example: Option<String>,
    /// The program to run, then its arguments.
    #[arg(
        required_unless_present = "example",
        trailing_var_arg = true,
        value_name = "PROGRAM"
    )]
    program: Vec<String>,
    /// `--fsdp_*` flags, one per FSDP key of the schema (filled from the matches).
    #[arg(skip)]
    fsdp_flags: Vec<(Key, String)>,
}

/// Adds a `--<key>` flag for every key of the FSDP section.
pub fn augment(cmd: clap::Command) -> clap::Command {
    Key::all()
        .filter(|k| k.spec().section == Section::Fsdp)
        .fold(cmd, |cmd, key| {
            cmd.arg(
                clap::Arg::new(key.name())
                    .long(key.name())
                    .value_name("VALUE")
                    .help(key.spec().help),
            )
        })
}

impl LaunchArgs {
    /// Reads the derived fields and the generated `--fsdp_*` flags.
    pub fn from_matches(matches: &ArgMatches) -> Result<LaunchArgs> {
        let mut args = LaunchArgs::from_arg_matches(matches)?;
        for key in Key::all().filter(|k| k.spec().section == Section::Fsdp) {
            if let Some(v) = matches.get_one::<String>(key.name()) {
                args.fsdp_flags.push((key, v.clone()));
            }
        }
        Ok(args)
    }

    /// The flags as the strongest configuration layer.
    fn cli_layer(&self) -> Result<Layer> {
        let mut layer = Layer::new();
        let mut errors = Vec::new();
        let mut set = |key: Key, text: &str| {
            let flag = format!("--{}", key.name());
            match parse_text(key.spec(), text) {
                Ok(value) => layer.set(key, value, Source::Cli { flag }),
                Err(reason) => errors.push(format!("invalid value `{text}` for {flag}: {reason}")),
            }
        };
        let pairs = [
            (Key::NumProcesses, &self.num_processes),
            (Key::NumMachines, &self.num_machines),
            (Key::MachineRank, &self.machine_rank),
            (Key::MainProcessIp, &self.main_process_ip),
            (Key::MainProcessPort, &self.main_process_port),
            (Key::MixedPrecision, &self.mixed_precision),
            (
                Key::NumCpuThreadsPerProcess,
                &self.num_cpu_threads_per_process,
            ),
            (Key::GpuIds, &self.gpu_ids),
            (Key::RdzvBackend, &self.rdzv_backend),
        ];
        for (key, value) in pairs {
            if let Some(v) = value {
                set(key, v);
            }
        }
        for (key, v) in &self.fsdp_flags {
            set(*key, v);
        }
        if self.use_fsdp {
            set(Key::DistributedType, "FSDP");
        }
        if self.cpu {
            set(Key::UseCpu, "true");
        }
        if self.debug {
            set(Key::Debug, "true");
        }
        if self.same_network {
            set(Key::SameNetwork, "true");
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("\n"));
        }
        Ok(layer)
    }
}

/// Set by the signal handler: the signal to forward to the workers.
static INTERRUPTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    INTERRUPTED.store(sig, Ordering::SeqCst);
}

fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// Runs `fsdp launch ...`; returns the exit code for the launcher.
pub fn run(mut args: LaunchArgs) -> Result<i32> {
    if let Some(example) = args.example.clone() {
        let exe = build_example(&example)?;
        args.program.insert(0, exe);
    }
    let config = args.file.resolve(&[&args.cli_layer()?])?;
    let plan = Plan::new(&config, &args)?;
    let say = |msg: String| {
        if !args.quiet {
            eprintln!("[fsdp launch] {msg}");
        }
    };
    for (key, setting, reason) in config.not_applicable() {
        say(format!(
            "note: `{}: {}` ({}) has no effect: {reason}",
            key.name(),
            setting.value,
            setting.source
        ));
    }
    install_signal_handlers();
    let store = plan.rendezvous(&say)?;
    let mut attempt = 0;
    loop {
        say(format!(
            "attempt {attempt}: starting {} worker(s) (ranks {}..{} of {}) of `{}`",
            plan.local,
            plan.first_rank(),
            plan.first_rank() + plan.local,
            plan.world,
            args.program.join(" ")
        ));
        let outcome = run_workers(&plan, &config, &args, attempt, &say)?;
        match outcome {
            Outcome::Success => return Ok(0),
            Outcome::Interrupted(code) => return Ok(code),
            Outcome::Failed(code) if attempt < args.max_restarts => {
                attempt += 1;
                say(format!(
                    "worker group failed with exit code {code}; restarting ({attempt} of {})",
                    args.max_restarts
                ));
            }
            Outcome::Failed(code) => {
                drop(store);
                return Ok(code);
            }
        }
    }
}

/// The job layout this launcher is responsible for.
struct Plan {
    world: usize,
    local: usize,
    machine_rank: usize,
    num_machines: usize,
    addr: String,
    port: u16,
    secret: String,
    threads: usize,
}

impl Plan {
    fn new(config: &ResolvedConfig, args: &LaunchArgs) -> Result<Plan> {
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
            _ if l.num_machines > 1 => {
                eprintln!(
                    "[fsdp launch] warning: {} is not set; machines share a secret derived from the rendezvous address, which does not keep other processes out. Set the same {} on every machine.",
                    fsdp_comm::SECRET_ENV,
                    fsdp_comm::SECRET_ENV
                );
                format!("fsdp-static-{addr}-{port}")
            }
            _ => random_secret(),
        };
        let local = l.processes_per_machine();
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

    fn first_rank(&self) -> usize {
        self.machine_rank * self.local
    }

    /// Machine 0 hosts the store for the job's lifetime (restarts included); every machine
    /// registers its machine rank, so a duplicate or missing machine is reported by number.
    fn rendezvous(&self, say: &dyn Fn(String)) -> Result<Option<StoreServer>> {
        let timeout = rendezvous_timeout();
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
            return Ok(server);
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
        Ok(server)
    }
}

/// `cargo build --release --example NAME` in the current workspace; returns the executable.
fn build_example(name: &str) -> Result<String> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "build",
            "--release",
            "--example",
            name,
            "--message-format=json-render-diagnostics",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo to build the example (is this a checkout of the workspace?)")?;
    if !out.status.success() {
        bail!("cargo could not build example `{name}`");
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(String::from))
        .with_context(|| format!("cargo built no executable for example `{name}`"))
}

/// A port on `addr` that is free now.
fn free_port(addr: &str) -> Result<u16> {
    Ok(std::net::TcpListener::bind((addr, 0))
        .and_then(|l| l.local_addr())
        .with_context(|| format!("picking a free port on {addr}"))?
        .port())
}

fn rendezvous_timeout() -> Duration {
    std::env::var("FSDP_RENDEZVOUS_TIMEOUT_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map_or(Duration::from_secs(120), Duration::from_secs_f64)
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

enum Outcome {
    Success,
    Failed(i32),
    Interrupted(i32),
}

/// The environment every worker gets from the configuration: every value that is not the
/// default (workers apply the same defaults table), and whether to use FSDP.
fn config_env(config: &ResolvedConfig) -> Vec<(String, String)> {
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

struct Worker {
    child: std::process::Child,
    pid: u32,
    rank: usize,
    tail: Arc<Mutex<VecDeque<String>>>,
    relays: Vec<std::thread::JoinHandle<()>>,
    waiter: Option<std::thread::JoinHandle<()>>,
    done: Option<std::process::ExitStatus>,
}

/// Exits as waiter threads see them, in the order they happened.
type Exits = std::sync::mpsc::Receiver<(usize, std::process::ExitStatus)>;

fn run_workers(
    plan: &Plan,
    config: &ResolvedConfig,
    args: &LaunchArgs,
    attempt: u32,
    say: &dyn Fn(String),
) -> Result<Outcome> {
    if let Some(dir) = &args.log_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating --log_dir {}", dir.display()))?;
    }
    let shown: Option<Vec<usize>> = args
        .local_ranks_filter
        .as_ref()
        .map(|f| {
            f.split(',')
                .map(|r| r.trim().parse::<usize>())
                .collect::<Result<_, _>>()
        })
        .transpose()
        .context("--local_ranks_filter takes comma-separated local ranks")?;
    let env = config_env(config);
    let mut workers: Vec<Worker> = Vec::new();
    let (exit_tx, exits) = std::sync::mpsc::channel();
    for local_rank in 0..plan.local {
        let rank = plan.first_rank() + local_rank;
        let mut cmd = Command::new(&args.program[0]);
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
            store_prefix: Some(format!("attempt{attempt}/")),
            comm_timeout: None,
        };
        cmd.args(&args.program[1..])
            .envs(env.iter().map(|(k, v)| (k, v)));
        worker_env
            .apply(&mut cmd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let (false, Some(ids)) = (config.launch.use_cpu, &config.launch.gpu_ids) {
            let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
            cmd.env("CUDA_VISIBLE_DEVICES", ids.join(","));
        }
        // Each worker leads its own process group: the launcher decides when it is stopped
        // (a terminal's Ctrl-C reaches only the launcher, which forwards it).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut workers, &exits, libc::SIGTERM);
                bail!("cannot start `{}` for rank {rank}: {e}", args.program[0]);
            }
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let show = shown.as_ref().is_none_or(|s| s.contains(&local_rank));
        let mut relays = Vec::new();
        for (stream, name, tee_bit) in [
            (
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
                "stdout",
                1u8,
            ),
            (
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
                "stderr",
                2u8,
            ),
        ] {
            let Some(stream) = stream else { continue };
            let log = match &args.log_dir {
                Some(dir) if args.tee & tee_bit != 0 || args.tee == 0 => Some(
                    std::fs::File::create(dir.join(format!("rank{rank}.{name}"))).with_context(
                        || format!("creating the rank {rank} log in {}", dir.display()),
                    )?,
                ),
                _ => None,
            };
            let tail = tail.clone();
            let to_stderr = name == "stderr";
            relays.push(std::thread::spawn(move || {
                relay(stream, rank, show, to_stderr, log, tail)
            }));
        }
        let pid = child.id();
        let tx = exit_tx.clone();
        let waiter = std::thread::spawn(move || {
            if let Some(status) = wait_without_reaping(pid) {
                let _ = tx.send((rank, status));
            }
        });
        workers.push(Worker {
            child,
            pid,
            rank,
            tail,
            relays,
            waiter: Some(waiter),
            done: None,
        });
    }
    supervise(&mut workers, &exits, say)
}

/// Copies a worker's lines to the console (prefixed with its rank) and its log file, keeping
/// the last lines for a failure report.
fn relay(
    stream: Box<dyn std::io::Read + Send>,
    rank: usize,
    show: bool,
    to_stderr: bool,
    mut log: Option<std::fs::File>,
    tail: Arc<Mutex<VecDeque<String>>>,
) {
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        if show {
            if to_stderr {
                eprintln!("[rank{rank}]: {line}");
            } else {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "[rank{rank}]: {line}");
                let _ = out.flush();
            }
        }
        if let Some(f) = log.as_mut() {
            let _ = writeln!(f, "{line}");
        }
        let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
        if t.len() == TAIL_LINES {
            t.pop_front();
        }
        t.push_back(line);
    }
}

fn supervise(workers: &mut [Worker], exits: &Exits, say: &dyn Fn(String)) -> Result<Outcome> {
    loop {
        let sig = INTERRUPTED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            say(format!("received signal {sig}; stopping the workers"));
            stop_all(workers, exits, sig);
            return Ok(Outcome::Interrupted(128 + sig));
        }
        let (rank, status) = match exits.recv_timeout(Duration::from_millis(50)) {
            Ok(exit) => exit,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(Outcome::Success),
        };
        let Some(w) = workers.iter_mut().find(|w| w.rank == rank) else {
            continue;
        };
        w.done = Some(status);
        if status.success() {
            if workers.iter().all(|w| w.done.is_some()) {
                stop_all(workers, exits, libc::SIGTERM);
                return Ok(Outcome::Success);
            }
            continue;
        }
        let (code, how) = describe_status(status);
        // Let its relays drain, so the report has its last words.
        for r in w.relays.drain(..) {
            let _ = r.join();
        }
        let last: Vec<String> = w
            .tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        eprintln!(
            "[fsdp launch] rank {rank} (pid {}) {how}; stopping the other workers.",
            w.pid
        );
        if !last.is_empty() {
            eprintln!("[fsdp launch] last output of rank {rank}:");
            for line in &last {
                eprintln!("[fsdp launch]   {line}");
            }
        }
        stop_all(workers, exits, libc::SIGTERM);
        return Ok(Outcome::Failed(code));
    }
}

/// Blocks until process `pid` exits and returns its status, leaving it unreaped (a zombie
/// keeps its pid and process group id from being reused until the launcher is done with them).
fn wait_without_reaping(pid: u32) -> Option<std::process::ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    loop {
        // SAFETY: waitid fills `info` for our own child.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 {
            // SAFETY: for WEXITED the kernel filled si_status.
            let status = unsafe { info.si_status() };
            let raw = match info.si_code {
                libc::CLD_EXITED => (status & 0xff) << 8,
                _ => status & 0x7f,
            };
            return Some(std::process::ExitStatus::from_raw(raw));
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return None;
        }
    }
}

fn describe_status(status: std::process::ExitStatus) -> (i32, String) {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => (code, format!("exited with code {code}")),
        (None, Some(sig)) => (128 + sig, format!("was killed by signal {sig}")),
        _ => (1, "ended abnormally".into()),
    }
}

/// Sends `sig` to every running worker's process group, waits up to the grace period, then
/// kills what is left; reaps everything and drains the output relays. Cleans up shared memory
/// a crashed worker may have left.
fn stop_all(workers: &mut [Worker], exits: &Exits, sig: i32) {
    let signal_running = |workers: &[Worker], sig: i32| {
        for w in workers.iter().filter(|w| w.done.is_none()) {
            // SAFETY: signalling a process group we created (its leader is not reaped yet).
            unsafe {
                libc::kill(-(w.pid as i32), sig);
            }
        }
    };
    signal_running(workers, sig);
    let deadline = Instant::now() + GRACE;
    let mut killed = false;
    while workers.iter().any(|w| w.done.is_none()) {
        if !killed && Instant::now() >= deadline {
            signal_running(workers, libc::SIGKILL);
            killed = true;
        }
        if let Ok((rank, status)) = exits.recv_timeout(Duration::from_millis(20))
            && let Some(w) = workers.iter_mut().find(|w| w.rank == rank)
        {
            w.done = Some(status);
        }
    }
    for w in workers.iter_mut() {
        // The leader has exited but is not reaped yet, so its group id cannot have been
        // reused: stragglers in its group (its children) go too, then it is reaped.
        // SAFETY: as above.
        unsafe {
            libc::kill(-(w.pid as i32), libc::SIGKILL);
        }
        let _ = w.child.wait();
        if let Some(t) = w.waiter.take() {
            let _ = t.join();
        }
        for r in w.relays.drain(..) {
            let _ = r.join();
        }
        remove_shared_memory(w.pid);
    }
}

/// Removes /dev/shm segments named after a worker (a worker killed between creating and
/// sharing its segment leaves one).
fn remove_shared_memory(pid: u32) {
    let prefix = format!("fsdp-{pid}-");
    if let Ok(entries) = std::fs::read_dir("/dev/shm") {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}
