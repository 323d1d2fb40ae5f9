//! `fsdp bench offload`: FSDP training of a GPT-2-shaped model (GPT-2 XL, 1.56 B parameters,
//! by default) on local processes with parameter shards, gradients and AdamW state in
//! `fsdp_offload_dir`, and/or in memory side by side: seconds per step, bytes each rank
//! read and wrote per step, the disk bandwidth that reached against the disk's own
//! sequential bandwidth measured in the same run, peak RSS per rank, and whether the losses
//! of the two runs are bitwise equal. Prints a table and one JSON line.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp::config::{FsdpPlugin, Layer, ShardingStrategy};
use fsdp::engine::Fsdp;
use fsdp::memory;
use fsdp::models::{Gpt2Config, Gpt2LmHeadModel};
use fsdp::nn::{Module, SeededWeights};
use fsdp::optim::{AdamW, AdamWConfig};
use fsdp_comm::{CommunicatorExt, ProcessGroup};

/// Options of `fsdp bench offload`.
#[derive(Args, Clone)]
pub struct OffloadArgs {
    /// Model shape: gpt2-xl (1.56 B parameters), gpt2-large (774 M), gpt2-medium (355 M),
    /// gpt2 (124 M) or tiny.
    #[arg(long, default_value = "gpt2-xl", value_parser = ["gpt2-xl", "gpt2-large", "gpt2-medium", "gpt2", "tiny"])]
    model: String,
    /// Blocks instead of the shape's own number (`--model gpt2-xl --layers 64`: 2.0 B
    /// parameters, 32.8 GB of training state).
    #[arg(long)]
    layers: Option<usize>,
    /// Processes.
    #[arg(long = "num_processes", default_value_t = 2)]
    num_processes: usize,
    /// Optimizer steps (all reported; the first includes the first writes of state).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Sequences per rank and step.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// The offload folder (default: ./fsdp-offload-bench).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// `offload`, `memory`, or `both` (side by side, for a model that fits in memory).
    #[arg(long, default_value = "offload", value_parser = ["offload", "memory", "both"])]
    mode: String,
    /// Keep every activation (activation checkpointing is on by default).
    #[arg(long)]
    no_activation_checkpointing: bool,
    /// Internal: run as one of the benchmark's workers in this mode.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

fn config(name: &str, layers: Option<usize>) -> Gpt2Config {
    let (n_embd, n_layer, n_head, vocab_size, n_positions) = match name {
        "gpt2-xl" => (1600, 48, 25, 50257, 1024),
        "gpt2-large" => (1280, 36, 20, 50257, 1024),
        "gpt2-medium" => (1024, 24, 16, 50257, 1024),
        "gpt2" => (768, 12, 12, 50257, 1024),
        _ => (64, 2, 2, 1000, 128),
    };
    Gpt2Config {
        vocab_size,
        n_positions,
        n_embd,
        n_layer: layers.unwrap_or(n_layer),
        n_head,
        n_inner: None,
        layer_norm_epsilon: 1e-5,
        initializer_range: 0.02,
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        resid_pdrop: 0.0,
    }
}

/// Runs `fsdp bench offload`.
pub fn run(a: OffloadArgs) -> Result<()> {
    match &a.worker {
        Some(mode) => worker(&a, mode),
        None => launch(&a),
    }
}

fn free_bytes(dir: &Path) -> Result<u64> {
    fsdp::engine::free_bytes(dir).with_context(|| format!("statvfs {}", dir.display()))
}

/// The disk's sequential bandwidth under `dir`: a file of `bytes` written in 8 MiB requests
/// and synced, its pages dropped from the cache, then read back (bytes per second).
fn disk_bandwidth(dir: &Path, bytes: usize) -> Result<(f64, f64)> {
    let path = dir.join("fsdp-bench-disk-probe");
    let piece = vec![0x5au8; 8 << 20];
    let mut f = std::fs::File::create(&path)?;
    let t = Instant::now();
    let mut written = 0;
    while written < bytes {
        f.write_all(&piece)?;
        written += piece.len();
    }
    f.sync_all()?;
    let write = written as f64 / t.elapsed().as_secs_f64();
    drop(f);
    let f = std::fs::File::open(&path)?;
    // SAFETY: plain fd calls; the pages are clean after the sync, so dropping them is safe.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    let mut buf = vec![0u8; 8 << 20];
    let t = Instant::now();
    let mut at = 0u64;
    while (at as usize) < written {
        f.read_exact_at(&mut buf, at)?;
        at += buf.len() as u64;
    }
    let read = written as f64 / t.elapsed().as_secs_f64();
    std::fs::remove_file(&path)?;
    Ok((write, read))
}

/// [`disk_bandwidth`] through `O_DIRECT` (no page cache; 4 KiB-aligned 8 MiB requests):
/// what the device does without the kernel's copies, to compare the buffered path with.
fn direct_bandwidth(dir: &Path, bytes: usize) -> Result<(f64, f64)> {
    use std::os::unix::fs::OpenOptionsExt;
    const PIECE: usize = 8 << 20;
    let layout = std::alloc::Layout::from_size_align(PIECE, 4096)?;
    // SAFETY: the layout has a non-zero size; the pointer is checked, filled before use,
    // viewed as exactly PIECE bytes and freed with the same layout below.
    let ptr = unsafe { std::alloc::alloc(layout) };
    if ptr.is_null() {
        bail!("allocating an aligned buffer");
    }
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, PIECE) };
    buf.fill(0x5a);
    let path = dir.join("fsdp-bench-direct-probe");
    let result = (|| -> Result<(f64, f64)> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .with_context(|| format!("opening {} with O_DIRECT", path.display()))?;
        let t = Instant::now();
        let mut at = 0;
        while at < bytes {
            f.write_all_at(buf, at as u64)?;
            at += PIECE;
        }
        f.sync_all()?;
        let write = at as f64 / t.elapsed().as_secs_f64();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)?;
        let t = Instant::now();
        let mut done = 0;
        while done < at {
            f.read_exact_at(buf, done as u64)?;
            done += PIECE;
        }
        Ok((write, done as f64 / t.elapsed().as_secs_f64()))
    })();
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };
    let _ = std::fs::remove_file(&path);
    result
}

fn launch(a: &OffloadArgs) -> Result<()> {
    let model = Gpt2LmHeadModel::new(config(&a.model, a.layers))?;
    let params: usize = model
        .info()
        .all_params()
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let dir = a
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("fsdp-offload-bench"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // f32 parameters, gradients and AdamW's two buffers, split over the ranks.
    let state = params as u64 * 16;
    let free = free_bytes(&dir)?;
    let modes: Vec<&str> = match a.mode.as_str() {
        "both" => vec!["memory", "offload"],
        m => vec![m],
    };
    if modes.contains(&"offload") && free < state + state / 10 {
        bail!(
            "{}: the offloaded state of {} ({params} parameters) needs {:.1} GB (f32 parameters, gradients and AdamW state, plus 10%), {:.1} GB are free",
            dir.display(),
            a.model,
            (state + state / 10) as f64 / 1e9,
            free as f64 / 1e9
        );
    }
    let (disk_write, disk_read) = disk_bandwidth(&dir, 1 << 30)?;
    let (direct_write, direct_read) = direct_bandwidth(&dir, 1 << 30)?;
    println!(
        "{}: {params} parameters, {:.1} GB of training state (f32 parameters, gradients, AdamW); {} processes; disk under {}, sequential 8 MiB requests: {:.2} GB/s write, {:.2} GB/s read buffered (what the tier uses), {:.2} / {:.2} GB/s with O_DIRECT",
        a.model,
        state as f64 / 1e9,
        a.num_processes,
        dir.display(),
        disk_write / 1e9,
        disk_read / 1e9,
        direct_write / 1e9,
        direct_read / 1e9
    );
    let mut results = Vec::new();
    for mode in &modes {
        let mut args = vec![
            "bench".to_string(),
            "offload".into(),
            "--model".into(),
            a.model.clone(),
            "--steps".into(),
            a.steps.to_string(),
            "--batch".into(),
            a.batch.to_string(),
            "--seq".into(),
            a.seq.to_string(),
            "--dir".into(),
            dir.display().to_string(),
            "--worker".into(),
            mode.to_string(),
        ];
        if let Some(n) = a.layers {
            args.extend(["--layers".into(), n.to_string()]);
        }
        if a.no_activation_checkpointing {
            args.push("--no-activation-checkpointing".into());
        }
        let out = super::workers::spawn_workers(&args, a.num_processes, 1, &[])?;
        let line = out
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .with_context(|| format!("no result from the {mode} workers:\n{out}"))?;
        results.push(serde_json::from_str::<serde_json::Value>(line)?);
    }
    // Model FLOPs of a step (fsdp::models::TransformerShape's count: every sequence `seq` tokens, the tied head
    // per token) and MFU over all cores, for each step's time.
    let gpt2 = config(&a.model, a.layers);
    let shape = fsdp::models::TransformerShape::dense(
        gpt2.n_layer,
        gpt2.n_embd,
        4 * gpt2.n_embd,
        gpt2.vocab_size,
    );
    let step_flops = shape.training_flops(std::iter::repeat_n(a.seq, a.batch * a.num_processes));
    let core_peak = fsdp::perf::core_peak().f32;
    let cores = crate::system::available_cores().max(1);
    let mfu = |secs: f64| fsdp::perf::utilisation(step_flops, secs, cores, core_peak).mfu;
    println!(
        "{:<8} {:>6} {:>10} {:>12} {:>12} {:>12} {:>14} {:>7}",
        "mode", "step", "seconds", "read GB*", "written GB*", "disk GB/s*", "peak RSS GiB", "MFU%"
    );
    for r in &results {
        let peak = r["peak_rss_bytes"]
            .as_array()
            .map(|v| v.iter().filter_map(|x| x.as_f64()).fold(0f64, f64::max))
            .unwrap_or(0.0);
        for s in r["steps"].as_array().into_iter().flatten() {
            let secs = s["seconds"].as_f64().unwrap_or(0.0);
            let (rd, wr) = (
                s["bytes_read"].as_f64().unwrap_or(0.0),
                s["bytes_written"].as_f64().unwrap_or(0.0),
            );
            println!(
                "{:<8} {:>6} {:>10.2} {:>12.2} {:>12.2} {:>12.2} {:>14.2} {:>7.1}",
                r["mode"].as_str().unwrap_or(""),
                s["step"],
                secs,
                rd / 1e9,
                wr / 1e9,
                (rd + wr) / secs / 1e9,
                peak / f64::from(1 << 30),
                100.0 * mfu(secs)
            );
        }
    }
    println!("* all ranks together; peak RSS: the largest rank's");
    for r in &results {
        let peak = r["peak_rss_bytes"]
            .as_array()
            .map(|v| v.iter().filter_map(|x| x.as_f64()).fold(0f64, f64::max))
            .unwrap_or(0.0);
        let live = r["peak_live_bytes"]
            .as_array()
            .map(|v| v.iter().filter_map(|x| x.as_f64()).fold(0f64, f64::max))
            .unwrap_or(0.0);
        let plan = r["plan_memory_bytes"].as_f64().unwrap_or(0.0);
        let gib = |b: f64| b / f64::from(1 << 30);
        println!(
            "{}: the plan's memory per rank {:.2} GiB (disk {:.2} GiB); measured peak RSS {:.2} GiB ({:+.0}%), peak of live allocations {:.2} GiB ({:+.0}%)",
            r["mode"].as_str().unwrap_or(""),
            gib(plan),
            gib(r["plan_disk_bytes"].as_f64().unwrap_or(0.0)),
            gib(peak),
            100.0 * (peak - plan) / plan.max(1.0),
            gib(live),
            100.0 * (live - plan) / plan.max(1.0)
        );
    }
    let equal = (results.len() == 2).then(|| results[0]["losses"] == results[1]["losses"]);
    if let Some(equal) = equal {
        println!("losses bitwise equal in memory and offloaded: {equal}");
    }
    let json = serde_json::json!({
        "bench": "offload",
        "model": a.model,
        "layers": a.layers,
        "parameters": params,
        "state_bytes": state,
        "processes": a.num_processes,
        "tokens_per_rank_step": a.batch * a.seq,
        "model_flops_per_step": step_flops,
        "core_peak_flops": core_peak,
        "cores": cores,
        "disk_sequential_write_bytes_per_s": disk_write,
        "disk_sequential_read_bytes_per_s": disk_read,
        "disk_direct_write_bytes_per_s": direct_write,
        "disk_direct_read_bytes_per_s": direct_read,
        "results": results,
        "losses_bitwise_equal": equal,
    });
    println!("{json}");
    Ok(())
}

fn worker(a: &OffloadArgs, mode: &str) -> Result<()> {
    memory::CountingAllocator::mark_installed();
    let pg = Arc::new(ProcessGroup::from_env()?);
    let rank = pg.rank();
    let mut builder = FsdpPlugin::builder()
        .sharding_strategy(ShardingStrategy::FullShard)
        .activation_checkpointing(!a.no_activation_checkpointing);
    if mode == "offload" {
        let dir = a.dir.as_ref().context("--dir")?;
        builder = builder
            .offload_params(true)
            .offload_dir(dir.to_str().context("a UTF-8 folder name")?);
    }
    let plugin = builder.resolve(&Layer::from_process_env()?, None)?.fsdp;
    let cfg = config(&a.model, a.layers);
    let vocab = cfg.vocab_size as u64;
    let model = Gpt2LmHeadModel::new(cfg)?;
    let built = Instant::now();
    let mut fsdp = Fsdp::wrap(&model, &SeededWeights(42), &plugin, pg.clone())?;
    let setup = built.elapsed().as_secs_f64();
    let estimate = fsdp.plan().memory_estimate();
    let mut opt = AdamW::new(AdamWConfig {
        lr: 1e-4,
        ..Default::default()
    })?;
    let stats = |f: &Fsdp| f.offload().map(|(_, s)| s).unwrap_or_default();
    let mut steps = Vec::new();
    let mut losses = Vec::new();
    for step in 0..a.steps {
        let ids = super::random_ids(rank, step, (a.batch, a.seq), vocab)?;
        let before = stats(&fsdp);
        let t = Instant::now();
        let params = fsdp.begin_step()?;
        let logits = model.forward(&params, &ids)?;
        let loss = model.loss(&logits, &ids)?;
        drop(logits);
        losses.push(loss.to_scalar::<f32>()?.to_bits());
        let forward = t.elapsed().as_secs_f64();
        fsdp.backward(params, loss, true)?;
        let backward = t.elapsed().as_secs_f64() - forward;
        fsdp.clip_grad_norm(Some(1.0))?;
        fsdp.step(&mut opt)?;
        let seconds = t.elapsed().as_secs_f64();
        let after = stats(&fsdp);
        steps.push(serde_json::json!({
            "step": step,
            "seconds": seconds,
            "forward_seconds": forward,
            "backward_seconds": backward,
            "optimizer_seconds": seconds - forward - backward,
            "bytes_read": after.bytes_read - before.bytes_read,
            "bytes_written": after.bytes_written - before.bytes_written,
            "io_read_seconds": after.read_seconds - before.read_seconds,
            "io_write_seconds": after.write_seconds - before.write_seconds,
        }));
    }
    let peak = memory::peak_rss_bytes().unwrap_or(0) as f64;
    // Every rank's peaks (RSS, and live bytes the counting allocator saw), and the steps'
    // traffic summed over ranks.
    let both = pg
        .all_gather_vec(vec![peak, memory::peak_bytes() as f64])
        .wait()?;
    let peaks: Vec<f64> = both.iter().step_by(2).copied().collect();
    let live: Vec<f64> = both.iter().skip(1).step_by(2).copied().collect();
    let mut traffic: Vec<f64> = steps
        .iter()
        .flat_map(|s| [s["bytes_read"].as_f64(), s["bytes_written"].as_f64()])
        .map(|x| x.unwrap_or(0.0))
        .collect();
    traffic = pg
        .all_reduce_vec(traffic, fsdp_comm::ReduceOp::Sum)
        .wait()?;
    for (s, rw) in steps.iter_mut().zip(traffic.chunks(2)) {
        s["bytes_read"] = rw[0].into();
        s["bytes_written"] = rw[1].into();
    }
    drop(fsdp);
    if rank == 0 {
        let json = serde_json::json!({
            "mode": mode,
            "setup_seconds": setup,
            "steps": steps,
            "losses": losses,
            "peak_rss_bytes": peaks,
            "peak_live_bytes": live,
            "plan_memory_bytes": estimate.total(),
            "plan_disk_bytes": estimate.disk,
        });
        println!("{json}");
    }
    Ok(())
}
