//! `fsdp env`: what to paste into a bug report. The machine, the launch environment, and the
//! resolved configuration with where each value came from.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use fsdp::config::ResolvedConfig;
use fsdp_comm::{BackendChoice, WorldInfo};

use crate::ConfigFileArg;
use crate::system::{SystemInfo, gib};

/// Print the machine, the launch environment and the resolved configuration.
#[derive(Args)]
pub struct EnvArgs {
    #[command(flatten)]
    file: ConfigFileArg,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Measure the core peak again instead of reading the cached one (and cache the new one
    /// when the machine is idle enough): a peak measured under load overstates MFU.
    #[arg(long = "remeasure_peak", visible_alias = "remeasure-peak")]
    remeasure_peak: bool,
}

/// Runs `fsdp env`.
pub fn run(args: EnvArgs) -> Result<()> {
    let system = SystemInfo::collect();
    let world = WorldInfo::from_env();
    let file = args.file.path();
    let resolved = args.file.resolve(&[]);
    let peak = if args.remeasure_peak {
        fsdp::perf::remeasure_core_peak()
    } else {
        fsdp::perf::core_peak()
    };
    if args.json {
        print_json(&system, &world, file.as_ref(), &resolved, &peak);
    } else {
        print_text(&system, &world, file.as_ref(), &resolved, &peak);
    }
    resolved.map(|_| ())
}

fn cuda_line(s: &SystemInfo) -> String {
    let lib = |p: &Option<PathBuf>| {
        p.as_ref()
            .map_or("not found".to_string(), |p| p.display().to_string())
    };
    format!(
        "driver {}, libcuda {}, libnccl {}, built with NCCL support: {}; tensors: {}",
        s.nvidia_driver.as_deref().unwrap_or("not loaded"),
        lib(&s.libcuda),
        s.libnccl,
        if cfg!(feature = "nccl") { "yes" } else { "no" },
        gpu_tensors_line()
    )
}

/// Whether candle's CUDA backend can open a GPU here: how many, or why none (the build has
/// no `cuda` feature, or a library is missing, by name).
fn gpu_tensors_line() -> String {
    match fsdp::nn::device::cuda_device_count() {
        Ok(n) => format!("{n} CUDA device(s) usable"),
        Err(e) => format!("no GPU ({e})"),
    }
}

fn world_line(world: &Result<WorldInfo, fsdp_comm::WorldError>) -> String {
    match world {
        Ok(w) => format!(
            "{:?}: rank {} of {}, local rank {} of {}, node {}, rendezvous {}:{}",
            w.launcher,
            w.rank,
            w.world_size,
            w.local_rank,
            w.local_world_size,
            w.node_rank,
            w.master_addr,
            w.master_port
        ),
        Err(e) => format!("invalid: {e}"),
    }
}

/// The address this process would listen on for its peers, and why (the launch
/// environment's `MASTER_ADDR`, or 127.0.0.1 outside a job).
fn peer_address_line(world: &Result<WorldInfo, fsdp_comm::WorldError>) -> String {
    let (addr, port) = match world {
        Ok(w) => (w.master_addr.clone(), w.master_port),
        Err(_) => ("127.0.0.1".to_string(), 29500),
    };
    match fsdp_comm::listen_address(&addr, port) {
        Ok(a) => format!("{} (chosen by {})", a.ip, a.chosen_by),
        Err(e) => format!("none: {e}"),
    }
}

/// The engine collectives would run on here: the resolved `fsdp_comm_backend` (or
/// `FSDP_COMM_BACKEND` when the configuration does not resolve) for this launch environment.
fn backend_line(
    world: &Result<WorldInfo, fsdp_comm::WorldError>,
    resolved: &Result<ResolvedConfig>,
) -> String {
    let choice = match resolved {
        Ok(config) => config
            .get(fsdp::config::Key::FsdpCommBackend)
            .and_then(|s| BackendChoice::parse(&s.value.to_env_text()))
            .ok_or_else(|| "fsdp_comm_backend has no value".to_string()),
        Err(_) => BackendChoice::from_env(),
    };
    let single = WorldInfo {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 29500,
        launcher: fsdp_comm::Launcher::Standalone,
        output_prefixed: false,
        restart_count: 0,
    };
    let world = world.as_ref().unwrap_or(&single);
    let mpi = if fsdp_comm::MPI_BUILT {
        "MPI built in"
    } else {
        "built without MPI"
    };
    match choice.and_then(|c| fsdp_comm::select_backend(c, world, fsdp_comm::started_under_mpi())) {
        Ok(sel) if sel.engine == BackendChoice::Auto => format!("shm ({}; {mpi})", sel.why),
        Ok(sel) => format!("{} ({}; {mpi})", sel.engine.name(), sel.why),
        Err(e) => format!("none: {e}"),
    }
}

fn print_text(
    s: &SystemInfo,
    world: &Result<WorldInfo, fsdp_comm::WorldError>,
    file: Option<&PathBuf>,
    resolved: &Result<ResolvedConfig>,
    peak: &fsdp::perf::CorePeak,
) {
    println!("Copy-and-paste the text below in your issue.\n");
    println!("- `fsdp` version: {}", env!("CARGO_PKG_VERSION"));
    println!("- Platform: {} ({})", s.os, s.arch);
    println!(
        "- CPU: {}, {} cores available",
        s.cpu_model, s.available_cores
    );
    println!("- f32 matmul: {}", fsdp::nn::ops::f32_matmul_kernel());
    let measured = match fsdp::nn::ops::bf16_gemm_choice().measured() {
        Some((dot, fma)) => format!(
            " (one core here: vdpbf16ps {dot:.0}, f32 multiply-add {fma:.0} GFLOP/s; {} pins it)",
            fsdp::nn::ops::BF16_GEMM_ENV
        ),
        None => String::new(),
    };
    println!(
        "- bf16 matmul: {}{measured}",
        fsdp::nn::ops::bf16_matmul_kernel()
    );
    println!("- AMX: {}", fsdp::nn::ops::amx_support());
    println!(
        "- Core peak (the engine's GEMM on one thread, measured once, what MFU is against): f32 {:.1} GFLOP/s, bf16 {:.1} GFLOP/s; other work took {:.0}% of the machine while it was measured{}",
        peak.f32 / 1e9,
        peak.bf16 / 1e9,
        100.0 * peak.others_busy,
        if peak.measured_under_load() {
            " (not cached: --remeasure_peak on an idle machine)"
        } else {
            ""
        }
    );
    println!(
        "- Instruction peak (one core's widest multiply-add in registers, the hardware's limit): f32 {:.1} GFLOP/s, bf16 {:.1} GFLOP/s{}",
        peak.f32_instruction / 1e9,
        peak.bf16_instruction / 1e9,
        if peak.measured_under_load() {
            " (measured under the same load: a floor, not the limit; MFU lines leave it out)"
        } else {
            ""
        }
    );
    let mem = |m: Option<u64>| m.map_or("unknown".into(), gib);
    println!(
        "- Memory: {} total, {} available",
        mem(s.mem_total),
        mem(s.mem_available)
    );
    println!("- CUDA: {}", cuda_line(s));
    println!("- Launch environment: {}", world_line(world));
    println!("- Listens for peers on: {}", peer_address_line(world));
    println!("- Collectives backend: {}", backend_line(world, resolved));
    println!(
        "- Config file: {}",
        file.map_or("none (environment and defaults only)".to_string(), |p| p
            .display()
            .to_string())
    );
    match resolved {
        Ok(config) => {
            println!("- Resolved configuration:");
            let width = config
                .iter()
                .map(|(k, _)| k.name().len())
                .max()
                .unwrap_or(0);
            // Long values (a regex, a class list) spill over rather than widen every row.
            let value_width = config
                .iter()
                .map(|(_, s)| s.value.to_string().chars().count())
                .max()
                .unwrap_or(0)
                .min(40);
            for (key, setting) in config.iter() {
                println!(
                    "    {}  {}  [{}]",
                    pad(key.name(), width),
                    pad(&setting.value.to_string(), value_width),
                    setting.source
                );
            }
            for (key, setting, reason) in config.not_applicable() {
                println!(
                    "- Not applicable: `{}: {}` ({}): {reason}",
                    key.name(),
                    setting.value,
                    setting.source
                );
            }
            for note in notes(config) {
                println!("- Note: {note}");
            }
        }
        Err(e) => println!("- Configuration: INVALID: {}", crate::error_text(e)),
    }
}

fn print_json(
    s: &SystemInfo,
    world: &Result<WorldInfo, fsdp_comm::WorldError>,
    file: Option<&PathBuf>,
    resolved: &Result<ResolvedConfig>,
    peak: &fsdp::perf::CorePeak,
) {
    let config = match resolved {
        Ok(config) => serde_json::json!({
            "valid": true,
            "settings": config.iter().map(|(k, s)| serde_json::json!({
                "key": k.name(), "value": s.value.to_string(), "source": s.source.to_string(),
            })).collect::<Vec<_>>(),
            "not_applicable": config.not_applicable().iter().map(|(k, s, reason)| serde_json::json!({
                "key": k.name(), "value": s.value.to_string(), "reason": reason,
            })).collect::<Vec<_>>(),
            "notes": notes(config),
        }),
        Err(e) => serde_json::json!({ "valid": false, "error": crate::error_text(e) }),
    };
    let doc = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "os": s.os,
        "arch": s.arch,
        "cpu_model": s.cpu_model,
        "available_cores": s.available_cores,
        "f32_matmul_kernel": fsdp::nn::ops::f32_matmul_kernel(),
        "bf16_matmul_kernel": fsdp::nn::ops::bf16_matmul_kernel(),
        "amx": fsdp::nn::ops::amx_support().to_string(),
        "core_peak_flops": { "f32": peak.f32, "bf16": peak.bf16 },
        "core_peak_others_busy": peak.others_busy,
        "core_peak_cpu": peak.cpu,
        "instruction_peak_flops": { "f32": peak.f32_instruction, "bf16": peak.bf16_instruction },
        "mem_total_bytes": s.mem_total,
        "mem_available_bytes": s.mem_available,
        "cuda": {
            "nvidia_driver": s.nvidia_driver,
            "libcuda": s.libcuda,
            "libnccl": s.libnccl.path(),
            "libnccl_loadable": matches!(s.libnccl, crate::system::NcclLibrary::Loadable(_)),
            "nccl_support_built": cfg!(feature = "nccl"),
            "cuda_support_built": cfg!(feature = "cuda"),
            "gpu_tensors": gpu_tensors_line(),
        },
        "launch_environment": world_line(world),
        "peer_listen_address": peer_address_line(world),
        "collectives_backend": backend_line(world, resolved),
        "mpi_support_built": fsdp_comm::MPI_BUILT,
        "config_file": file,
        "config": config,
    });
    println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
}

/// Settings that act differently on this machine than their name suggests.
fn notes(config: &ResolvedConfig) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(dir) = &config.fsdp.offload_dir {
        let what = if config.fsdp.offload_params {
            "parameter shards, gradients and optimizer state"
        } else {
            "optimizer state"
        };
        out.push(format!(
            "offloaded to disk: {what} in private per-job files under {} (removed when training ends)",
            dir.display()
        ));
    } else if config.fsdp.offload_params {
        out.push(format!(
            "`fsdp_offload_params: true`: {}",
            fsdp::engine::OFFLOAD_ON_CPU
        ));
    }
    let (shard_group, _) = config.launch.mesh_shape(config.fsdp.sharding_strategy);
    if config.fsdp.all_gather_dtype == fsdp::config::AllGatherDtype::Int8 && shard_group < 2 {
        out.push(
            "`fsdp_all_gather_dtype: int8`: nothing is gathered (parameters are sharded over one process here), so nothing is quantized"
                .into(),
        );
    }
    if config.fsdp.hpz_partition_size > 1 && shard_group < 2 {
        out.push(
            "`fsdp_hpz_partition_size`: nothing is gathered (parameters are sharded over one process here), so no secondary partition is kept"
                .into(),
        );
    }
    let strategy = config.fsdp.sharding_strategy;
    let per_machine = config.launch.two_hop_machine_size(strategy);
    if per_machine > 1 && config.fsdp.hierarchical_collectives {
        out.push(format!(
            "`fsdp_hierarchical_collectives: true`: the shard group of {shard_group} gathers and reduces in two hops, inside each machine of {per_machine} processes, then across the {} machines",
            shard_group / per_machine
        ));
    }
    if config.fsdp.reduce_dtype.is_quantized() && config.launch.num_processes < 2 {
        out.push(format!(
            "`fsdp_reduce_dtype: {}`: nothing is reduced (one process), so no gradient is quantized",
            config.fsdp.reduce_dtype
        ));
    }
    out
}

/// `text` followed by spaces up to `width` characters (format's `{:width$}` panics above
/// 65,535).
fn pad(text: &str, width: usize) -> String {
    let n = text.chars().count();
    format!("{text}{}", " ".repeat(width.saturating_sub(n)))
}
