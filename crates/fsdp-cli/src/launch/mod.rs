//! `fsdp launch`: start the workers of a job on this machine with the torchrun environment
//! contract and the resolved configuration, relay their output, and tear everything down
//! when one fails or the launcher is interrupted — the way torchrun separates its agent:
//! `args` (the command line), `plan` (layout, secret, rendezvous), `spawn` (one worker),
//! `relay` (its output), `supervise` (an attempt of the group, and its teardown).

mod args;
mod exits;
mod orphans;
mod plan;
mod relay;
mod slurm;
mod spawn;
mod supervise;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{Context, Result, bail};

pub use args::{LaunchArgs, augment};
use plan::Plan;
use spawn::{Attempt, config_env};

/// Set by the signal handler: the signal to forward to the workers.
static INTERRUPTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    INTERRUPTED.store(sig, Ordering::SeqCst);
}

/// Interrupts, termination, a closed terminal (SIGHUP) and SIGQUIT all stop the workers
/// before the launcher exits.
fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

/// How an attempt of the worker group ended.
enum Outcome {
    Success,
    Failed(i32),
    Interrupted(i32),
}

/// Runs `fsdp launch ...`; returns the exit code for the launcher.
pub fn run(mut args: LaunchArgs) -> Result<i32> {
    if let Some(example) = args.example.clone() {
        let exe = build_example(&example)?;
        args.set_program_path(exe);
    }
    let env: std::collections::HashMap<String, String> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    let step = slurm::step_layer(&env)?;
    let config = args.file.resolve(&[&args.cli_layer()?, &step])?;
    if !step.is_empty()
        && config.launch.num_machines > 1
        && env.get(fsdp_comm::SECRET_ENV).is_none_or(|s| s.is_empty())
    {
        bail!(
            "{secret} is not set: the launchers srun starts on each node must share the job's secret. Set it before srun, which passes it on: export {secret}=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')",
            secret = fsdp_comm::SECRET_ENV
        );
    }
    let plan = Plan::new(&config, &args)?;
    let say = |msg: String| {
        if !args.quiet {
            relay::say(&msg);
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
    let shown = args.shown_local_ranks(plan.local)?;
    install_signal_handlers();
    if let Err(e) = orphans::become_subreaper() {
        say(format!(
            "note: cannot become the subreaper of the workers' children ({e}): processes they move out of their process group are not stopped with them"
        ));
    }
    let rendezvous = plan.rendezvous(&say)?;
    if let Some(dir) = &args.log_dir
        && let Err(e) = spawn::prepare_log_dir(dir)
    {
        rendezvous.stop_joining(0, &format!("{e:#}"));
        return Err(e);
    }
    let mut number = 0;
    loop {
        say(format!(
            "attempt {number}: starting {} worker(s) (ranks {}..{} of {}) of `{}`",
            plan.local,
            plan.first_rank(),
            plan.first_rank() + plan.local,
            plan.world,
            args.program().join(" ")
        ));
        let attempt = Attempt {
            plan: &plan,
            config: &config,
            args: &args,
            env: config_env(&config),
            number,
            shown: shown.clone(),
            log_dir: args.log_dir.as_deref(),
        };
        let outcome = supervise::run_attempt(&attempt, &say).inspect_err(|e| {
            rendezvous.stop_joining(number, &format!("{e:#}"));
        })?;
        match &outcome {
            Outcome::Success => {}
            Outcome::Interrupted(code) => {
                rendezvous.stop_joining(number, &format!("interrupted (exit code {code})"))
            }
            Outcome::Failed(code) => rendezvous.stop_joining(
                number,
                &format!("its worker group failed with exit code {code}"),
            ),
        }
        match outcome {
            Outcome::Success => return Ok(0),
            Outcome::Interrupted(code) => return Ok(code),
            Outcome::Failed(code) if number < args.max_restarts => {
                number += 1;
                say(format!(
                    "worker group failed with exit code {code}; restarting ({number} of {})",
                    args.max_restarts
                ));
            }
            Outcome::Failed(code) => {
                drop(rendezvous);
                return Ok(code);
            }
        }
    }
}

/// The examples of the Cargo workspace around the current folder, or an error that says
/// what `--example` needs when there is none (after `cargo install`, outside the checkout,
/// cargo's own error named no way out).
fn workspace_examples(cargo: &str) -> Result<Vec<String>> {
    let here = std::env::current_dir().context("reading the current folder")?;
    let outside = || {
        anyhow::anyhow!(
            "--example builds an example of the Cargo workspace in the current folder, and {} is in none: run it inside the fsdp-rs checkout (`cd fsdp-rs && fsdp launch ... --example NAME`), or build your program and give its path (`fsdp launch ... target/release/NAME`)",
            here.display()
        )
    };
    let out = Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .output()
        .with_context(|| format!("running `{cargo} metadata` to find the example"))?;
    if !out.status.success() {
        let error = String::from_utf8_lossy(&out.stderr);
        if error.contains("could not find `Cargo.toml`") {
            return Err(outside());
        }
        bail!(
            "`{cargo} metadata` failed, finding the example: {}",
            error.trim()
        );
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("reading `cargo metadata`'s output")?;
    let mut examples: Vec<String> = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "example"))
        })
        .filter_map(|t| t["name"].as_str().map(String::from))
        .collect();
    examples.sort();
    Ok(examples)
}

/// `cargo build --release --example NAME` in the current workspace; returns the executable.
fn build_example(name: &str) -> Result<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let examples = workspace_examples(&cargo)?;
    if !examples.iter().any(|e| e == name) {
        bail!(
            "the Cargo workspace here has no example `{name}`; its examples: {}",
            if examples.is_empty() {
                "none".to_string()
            } else {
                examples.join(", ")
            }
        );
    }
    let out = Command::new(&cargo)
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
