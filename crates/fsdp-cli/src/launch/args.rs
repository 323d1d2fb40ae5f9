//! `fsdp launch`'s command line: its flags (one `--fsdp_*` flag per FSDP key of the schema)
//! as the strongest configuration layer, and the program to run.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{ArgMatches, Args, FromArgMatches};
use fsdp::config::{Key, Layer, Section, Source, parse_text};

use crate::ConfigFileArg;

/// Launch a training program on this machine's share of the job's processes.
///
/// Every flag overrides the config file (and the FSDP_* environment); the program's own
/// arguments follow it (a `--` right after PROGRAM, or after the flags with --example, is
/// dropped: `fsdp launch PROGRAM -- --flag` passes `--flag`). Workers get RANK, LOCAL_RANK,
/// WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT, the job secret, and
/// ACCELERATE_USE_FSDP / FSDP_* / ACCELERATE_MIXED_PRECISION from the resolved configuration.
///
/// A collective that waits longer than the collective timeout (--comm_timeout, or
/// FSDP_COMM_TIMEOUT_SECS; 300 s by default) fails on every rank, naming the rank it waited
/// for; joining the job waits up to FSDP_RENDEZVOUS_TIMEOUT_SECS (120 s). Workers die with
/// the launcher, however it ends.
#[derive(Args, Debug)]
pub struct LaunchArgs {
    #[command(flatten)]
    pub(super) file: ConfigFileArg,
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
    pub(super) max_restarts: u32,
    /// Also write streams to the per-rank files in --log_dir: 0 none, 1 stdout, 2 stderr,
    /// 3 both (torchrun's --tee).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub(super) tee: u8,
    /// Directory for per-rank log files (rank{N}.stdout / rank{N}.stderr); one holding an
    /// earlier job's log files is refused.
    #[arg(long = "log_dir", visible_alias = "log-dir")]
    pub(super) log_dir: Option<PathBuf>,
    /// Local ranks whose output is shown on the console, comma-separated [default: all].
    #[arg(long = "local_ranks_filter", visible_alias = "local-ranks-filter")]
    pub(super) local_ranks_filter: Option<String>,
    /// Print only the workers' output, not the launcher's messages.
    #[arg(short, long)]
    pub(super) quiet: bool,
    /// Seconds a collective may wait for a peer before failing on every rank
    /// (FSDP_COMM_TIMEOUT_SECS for the workers) [default: 300].
    #[arg(long = "comm_timeout", visible_alias = "comm-timeout", value_parser = fsdp_comm::parse_seconds)]
    pub(super) comm_timeout: Option<Duration>,
    /// Run with collective and FSDP state checks.
    #[arg(long)]
    debug: bool,
    /// Build this example of the workspace with cargo (release) and run it; PROGRAM ARGS are
    /// then the example's arguments.
    #[arg(long)]
    pub(super) example: Option<String>,
    /// The program to run, then its arguments.
    #[arg(
        required_unless_present = "example",
        trailing_var_arg = true,
        value_name = "PROGRAM"
    )]
    pub(super) program: Vec<String>,
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

    /// The program and its arguments (a leading `--` among them dropped).
    pub(super) fn program(&self) -> Vec<String> {
        let mut p = self.program.clone();
        let first_arg = usize::from(self.example.is_none());
        if p.get(first_arg).map(String::as_str) == Some("--") {
            p.remove(first_arg);
        }
        p
    }

    /// Runs `exe` (a built example) with the arguments given.
    pub(super) fn set_program_path(&mut self, exe: String) {
        self.program.insert(0, exe);
        self.example = None;
    }

    /// The local ranks `--local_ranks_filter` shows (all when unset), each one of the `local`
    /// ranks this machine runs.
    pub(super) fn shown_local_ranks(&self, local: usize) -> Result<Option<Vec<usize>>> {
        let Some(f) = &self.local_ranks_filter else {
            return Ok(None);
        };
        let ranks: Vec<usize> = match f.split(',').map(|r| r.trim().parse::<usize>()).collect() {
            Ok(r) => r,
            Err(_) => bail!("--local_ranks_filter takes comma-separated local ranks, got `{f}`"),
        };
        if let Some(r) = ranks.iter().find(|&&r| r >= local) {
            bail!(
                "--local_ranks_filter {f}: there is no local rank {r}; this machine runs local ranks 0..{local}"
            );
        }
        Ok(Some(ranks))
    }

    /// The flags as the strongest configuration layer.
    pub(super) fn cli_layer(&self) -> Result<Layer> {
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
