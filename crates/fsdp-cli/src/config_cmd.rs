//! `fsdp config`: the questionnaire, `default` and `update`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use fsdp::config::{
    Key, Layer, MixedPrecision, ResolvedConfig, Section, Source, Value, default_config_path,
};

use crate::ConfigFileArg;
use crate::prompt::{LinePrompter, Prompter, TerminalPrompter};
use crate::questionnaire;
use crate::system::{SystemInfo, available_cores};

/// Create or update a config file.
///
/// Without a subcommand, asks questions (arrow keys on a terminal; numbered answers, one per
/// line, when input is piped) and writes an Accelerate-compatible YAML file. Accelerate's own
/// config files can be used as they are.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ConfigArgs {
    #[command(subcommand)]
    action: Option<ConfigAction>,
    #[command(flatten)]
    file: ConfigFileArg,
}

#[derive(Subcommand)]
enum ConfigAction {
    /// Write a sensible FSDP config for this machine without asking questions.
    Default {
        #[command(flatten)]
        file: ConfigFileArg,
        /// Mixed precision: no, fp16 or bf16.
        #[arg(
            long = "mixed_precision",
            visible_alias = "mixed-precision",
            default_value = "no"
        )]
        mixed_precision: MixedPrecision,
        /// Number of processes [default: 2 when this machine has 2 or more cores, else 1].
        #[arg(long = "num_processes", visible_alias = "num-processes")]
        num_processes: Option<u64>,
        /// Replace an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Check a config file against the schema and rewrite it in canonical form (aliases
    /// replaced, menu numbers turned into names, keys sorted); other sections are kept.
    Update {
        #[command(flatten)]
        file: ConfigFileArg,
    },
}

/// Runs `fsdp config ...`.
pub fn run(args: ConfigArgs) -> Result<()> {
    match args.action {
        None => interactive(args.file.config_file.unwrap_or_else(default_config_path)),
        Some(ConfigAction::Default {
            file,
            mixed_precision,
            num_processes,
            force,
        }) => write_default(
            &file.config_file.unwrap_or_else(default_config_path),
            mixed_precision,
            num_processes,
            force,
        ),
        Some(ConfigAction::Update { file }) => {
            update(&file.config_file.unwrap_or_else(default_config_path))
        }
    }
}

fn interactive(path: PathBuf) -> Result<()> {
    let layer = if std::io::stdin().is_terminal() && std::io::stderr().is_terminal() {
        questionnaire::ask(&mut TerminalPrompter)?
    } else {
        let mut prompter = LinePrompter::new(std::io::stdin().lock(), std::io::stdout());
        let layer = questionnaire::ask(&mut prompter as &mut dyn Prompter)?;
        drop(prompter);
        layer
    };
    save(&layer, &path)
}

/// Validates the whole configuration, then writes it.
fn save(layer: &Layer, path: &Path) -> Result<()> {
    ResolvedConfig::resolve(&[layer]).context("the answers do not make a valid configuration")?;
    layer.write_yaml_file(path)?;
    println!("fsdp configuration saved at {}", path.display());
    Ok(())
}

fn write_default(
    path: &Path,
    mixed_precision: MixedPrecision,
    num_processes: Option<u64>,
    force: bool,
) -> Result<()> {
    if path.exists() && !force {
        bail!(
            "{} already exists; pass --force to replace it, or `fsdp config update` to check it",
            path.display()
        );
    }
    let use_cpu = !SystemInfo::collect().cuda_usable();
    let num_processes = num_processes.unwrap_or(if available_cores() >= 2 { 2 } else { 1 });
    let source = || Source::Cli {
        flag: "fsdp config default".into(),
    };
    let mut layer = Layer::new();
    for key in Key::all() {
        // The FSDP section with every default spelt out, so users see what they can change.
        let wanted = key.spec().section == Section::Fsdp || BASE_KEYS.contains(&key);
        if let (true, Some(value)) = (wanted, Value::from_default(key.spec().default)) {
            layer.set(key, value, source());
        }
    }
    layer.set(Key::UseCpu, Value::Bool(use_cpu), source());
    layer.set(Key::NumProcesses, Value::UInt(num_processes), source());
    layer.set(
        Key::MixedPrecision,
        Value::Text(mixed_precision.to_string()),
        source(),
    );
    // `fsdp_min_num_params` only applies to size-based wrapping.
    layer.unset(Key::FsdpMinNumParams);
    save(&layer, path)
}

/// The top-level keys every written file carries, as Accelerate writes them.
const BASE_KEYS: &[Key] = &[
    Key::ComputeEnvironment,
    Key::Debug,
    Key::DistributedType,
    Key::DowncastBf16,
    Key::MachineRank,
    Key::MainTrainingFunction,
    Key::MixedPrecision,
    Key::NumMachines,
    Key::NumProcesses,
    Key::RdzvBackend,
    Key::SameNetwork,
    Key::TpuEnv,
    Key::TpuUseCluster,
    Key::TpuUseSudo,
    Key::UseCpu,
];

fn update(path: &Path) -> Result<()> {
    let layer = Layer::from_yaml_file(path)?;
    ResolvedConfig::resolve(&[&layer])?;
    layer.write_yaml_file(path)?;
    println!(
        "fsdp configuration at {} checked and rewritten",
        path.display()
    );
    Ok(())
}
