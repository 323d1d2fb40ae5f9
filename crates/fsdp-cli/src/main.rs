//! `fsdp`: configure, inspect and (as the engine lands) launch fully sharded data-parallel
//! training, the way `accelerate` does.

#[cfg(feature = "bench")]
mod bench;
mod config_cmd;
mod env_cmd;
mod estimate_cmd;
mod launch;
mod merge_cmd;
mod prompt;
mod questionnaire;
mod system;
mod test_cmd;
mod test_train;
mod trace_cmd;

use std::path::PathBuf;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

/// Live bytes are counted so `fsdp bench memory` can measure what FSDP holds and frees.
#[global_allocator]
static ALLOCATOR: fsdp::memory::CountingAllocator = fsdp::memory::CountingAllocator;

/// Fully sharded data-parallel training for Rust.
///
/// Start with `fsdp config` to answer a few questions about your setup (or point any command
/// at an existing Accelerate config file with --config_file), then check what will be used
/// with `fsdp env`.
#[derive(Parser)]
#[command(name = "fsdp", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or update a config file (Accelerate's YAML format).
    Config(config_cmd::ConfigArgs),
    /// Print the machine, the launch environment and the resolved configuration.
    Env(env_cmd::EnvArgs),
    /// Start a training program on this machine's processes (like `accelerate launch`).
    Launch(Box<launch::LaunchArgs>),
    /// Check that a job with this configuration starts and communicates.
    Test(test_cmd::TestArgs),
    /// Print a model's FSDP units and the memory each rank needs.
    #[command(name = "estimate-memory")]
    EstimateMemory(estimate_cmd::EstimateArgs),
    /// Merge a sharded checkpoint into one `model.safetensors`.
    #[command(name = "merge-weights")]
    MergeWeights(merge_cmd::MergeArgs),
    /// Measure collectives, one layer, training memory and checkpoints.
    #[cfg(feature = "bench")]
    Bench(bench::BenchArgs),
    /// Benchmarks (collectives, kernels, memory, checkpoints): in a build with `--features
    /// bench`.
    #[cfg(not(feature = "bench"))]
    Bench(NoBench),
    /// Draw the timelines a job wrote with `fsdp_trace_dir` (`FSDP_TRACE`).
    Trace(trace_cmd::TraceArgs),
}

/// `fsdp bench ...` in a build without the benchmarks: whatever follows is taken, and the
/// command says how to build them.
#[cfg(not(feature = "bench"))]
#[derive(Args)]
struct NoBench {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    _args: Vec<String>,
}

#[cfg(not(feature = "bench"))]
impl NoBench {
    const MESSAGE: &'static str = "this fsdp was built without its benchmarks (3,600 lines kept out of the command users install): build it with `cargo build --release -p fsdp-cli --features bench`, or run `cargo run --release -p fsdp-cli --features bench -- bench ...`";
}

/// The `--config_file` option every command that reads or writes a config file takes.
#[derive(Args, Clone, Debug, Default)]
pub struct ConfigFileArg {
    /// Config file [default: $FSDP_CONFIG_FILE, else ~/.cache/fsdp-rs/default_config.yaml;
    /// when reading and that is absent, Accelerate's default file].
    #[arg(
        long = "config_file",
        visible_alias = "config-file",
        value_name = "PATH"
    )]
    pub config_file: Option<PathBuf>,
}

impl ConfigFileArg {
    /// The file to read: the one given, else the default (fsdp-rs's, then Accelerate's).
    pub fn path(&self) -> Option<PathBuf> {
        self.config_file
            .clone()
            .or_else(fsdp::config::existing_default_config)
    }

    /// Resolves `stronger` layers (strongest first) over the environment, this file and the
    /// defaults.
    pub fn resolve(
        &self,
        stronger: &[&fsdp::config::Layer],
    ) -> anyhow::Result<fsdp::config::ResolvedConfig> {
        let file = self
            .path()
            .as_deref()
            .map(fsdp::config::Layer::from_yaml_file)
            .transpose()?;
        let mut env = fsdp::config::Layer::from_process_env()?;
        // These commands launch or describe jobs; they are not a cluster launcher's workers.
        env.drop_cluster_layout();
        let mut layers = stronger.to_vec();
        layers.push(&env);
        layers.extend(file.as_ref());
        Ok(fsdp::config::ResolvedConfig::resolve(&layers)?)
    }
}

fn main() -> std::process::ExitCode {
    // `fsdp launch` takes one `--fsdp_*` flag per FSDP key of the schema.
    let matches = Cli::command()
        .mut_subcommand("launch", launch::augment)
        .get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // Commands that only print (and write their file first, for `config`) end quietly when
    // their output's reader goes away (`fsdp env | head -1`), as Unix tools do, instead of
    // panicking in `println!`. The launcher, the test job, the benchmarks and the merge
    // keep Rust's ignored SIGPIPE: they have processes or files to finish.
    if matches!(
        cli.command,
        Command::Config(_) | Command::Env(_) | Command::EstimateMemory(_) | Command::Trace(_)
    ) {
        // SAFETY: restores the default disposition of one signal before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.command {
        Command::Config(args) => config_cmd::run(args).map(|()| 0),
        Command::Env(args) => env_cmd::run(args).map(|()| 0),
        Command::Launch(_) => match matches.subcommand_matches("launch") {
            Some(m) => launch::LaunchArgs::from_matches(m).and_then(launch::run),
            None => Ok(2),
        },
        Command::Test(args) => test_cmd::run(args),
        Command::EstimateMemory(args) => estimate_cmd::run(args).map(|()| 0),
        Command::MergeWeights(args) => merge_cmd::run(args).map(|()| 0),
        #[cfg(feature = "bench")]
        Command::Bench(args) => bench::run(args).map(|()| 0),
        #[cfg(not(feature = "bench"))]
        Command::Bench(_) => Err(anyhow::anyhow!(NoBench::MESSAGE)),
        Command::Trace(args) => trace_cmd::run(args).map(|()| 0),
    };
    match result {
        Ok(code) => std::process::ExitCode::from(code.clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("error: {}", error_text(&err));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause once: a message that already quotes
/// its cause (`cannot read X: No such file`) is not followed by it again.
fn error_text(err: &anyhow::Error) -> String {
    let mut text = err.to_string();
    for cause in err.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}
