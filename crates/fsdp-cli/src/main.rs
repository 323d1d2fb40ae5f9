//! `fsdp`: configure, inspect and (as the engine lands) launch fully sharded data-parallel
//! training, the way `accelerate` does.

mod bench;
mod config_cmd;
mod env_cmd;
mod prompt;
mod questionnaire;
mod system;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

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
    /// Measure collectives (and, as they land, layers and memory).
    Bench(bench::BenchArgs),
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

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Config(args) => config_cmd::run(args),
        Command::Env(args) => env_cmd::run(args),
        Command::Bench(args) => bench::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
