//! `fsdp bench checkpoint`: wall time and memory of `save_state` (sharded, as a PyTorch
//! distributed checkpoint, and full),
//! `save_state_async` (the time the caller is blocked, and until the files are written),
//! `load_state` (of ours and of the DCP one) and `merge-weights` for a BERT trained one step with AdamW on local
//! processes: the reference BERT by default, BERT-base with `--hidden 768 --layers 12
//! --vocab 30522`.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use fsdp::checkpoint::{self, CheckpointOptions, RunState};
use fsdp::config::{CheckpointFormat, FsdpPlugin, Layer, StateDictType};
use fsdp::engine::Fsdp;
use fsdp::memory;
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::candle::{DType, Device, Tensor};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{AdamW, AdamWConfig};
use fsdp_comm::ProcessGroup;

/// Options of `fsdp bench checkpoint`.
#[derive(Args, Clone)]
pub struct CheckpointArgs {
    /// Number of processes.
    #[arg(
        long = "num_processes",
        visible_alias = "num-processes",
        default_value_t = 2
    )]
    num_processes: usize,
    /// The BERT.
    #[command(flatten)]
    shape: super::BertShape,
    /// Timed repetitions of each operation (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Folder to write checkpoints in (default: a temporary folder, removed after).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Write the JSON results to this file too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Internal: run as one of the benchmark's workers, writing into this folder.
    #[arg(long, hide = true)]
    worker: Option<std::path::PathBuf>,
}

/// Runs `fsdp bench checkpoint`.
pub fn run(a: CheckpointArgs) -> Result<()> {
    match &a.worker {
        Some(dir) => worker(&a, dir),
        None => launch(&a),
    }
}

fn launch(a: &CheckpointArgs) -> Result<()> {
    let tmp;
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let mut args: Vec<String> = [
        "bench",
        "checkpoint",
        "--worker",
        dir.to_str().context("a folder path that is UTF-8")?,
        "--reps",
        &a.reps.to_string(),
    ]
    .map(String::from)
    .to_vec();
    args.extend(a.shape.flags());
    let out = super::workers::spawn_workers(&args, a.num_processes, 1, &[])?;
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .with_context(|| format!("no result from the workers:\n{out}"))?;
    let mut result: serde_json::Value = serde_json::from_str(line)?;
    // The command a user runs: a fresh process, reading the sharded checkpoint.
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let status = std::process::Command::new(&exe)
        .args(["merge-weights"])
        .arg(dir.join("sharded"))
        .arg(dir.join("merged-cli"))
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "fsdp merge-weights failed");
    result["merge_weights_cli_s"] = started.elapsed().as_secs_f64().into();
    let mib = |k: &str| result[k].as_f64().unwrap_or(f64::NAN) / (1u64 << 20) as f64;
    println!(
        "{} processes, {}: {:.1} MiB of parameters, {:.1} MiB checkpoint",
        a.num_processes,
        a.shape,
        mib("params_bytes"),
        mib("checkpoint_bytes")
    );
    for (label, key) in [
        ("save_state SHARDED", "save_sharded_s"),
        ("save_state_async blocked", "save_async_blocked_s"),
        ("save_state_async until written", "save_async_total_s"),
        ("save_state FULL", "save_full_s"),
        ("load_state SHARDED", "load_sharded_s"),
        ("save_state torch-dcp", "save_torch_dcp_s"),
        ("load_state torch-dcp", "load_torch_dcp_s"),
        ("merge_weights (in process)", "merge_s"),
        ("fsdp merge-weights (CLI)", "merge_weights_cli_s"),
    ] {
        println!(
            "{label:<31} {:>8.3} s",
            result[key].as_f64().unwrap_or(f64::NAN)
        );
    }
    println!(
        "an asynchronous save blocks for {:.1}% of the synchronous one's time, staging {:.1} MiB per rank",
        100.0
            * result["save_async_blocked_vs_sync"]
                .as_f64()
                .unwrap_or(f64::NAN),
        mib("save_async_staged_bytes")
    );
    println!(
        "peak above state while saving (worst rank): {:.1} MiB sharded, {:.1} MiB asynchronous, {:.1} MiB torch-dcp, {:.1} MiB full; largest unit {:.1} MiB; peak RSS {:.1} MiB",
        mib("save_sharded_peak_above_bytes"),
        mib("save_async_peak_above_bytes"),
        mib("save_torch_dcp_peak_above_bytes"),
        mib("save_full_peak_above_bytes"),
        mib("largest_unit_bytes"),
        mib("peak_rss_bytes")
    );
    println!("{result}");
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)?;
    }
    Ok(())
}

/// Median of `reps` runs of `f` (seconds), with the largest rise of live bytes above what
/// was live before each run.
fn timed(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, usize)> {
    let (mut times, mut peak_above) = (Vec::new(), 0usize);
    for _ in 0..reps.max(1) {
        let before = memory::resident_bytes();
        memory::reset_peak();
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
        peak_above = peak_above.max(memory::peak_bytes().saturating_sub(before));
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], peak_above))
}

/// A BERT classifier of `shape` (heads of 64) sharded over the job
/// this process belongs to (FULL_SHARD, one unit per layer), with AdamW; with `trained`, one
/// step taken so the optimizer has its moments.
pub(super) fn bert_engine(shape: super::BertShape, trained: bool) -> Result<(Fsdp, AdamW)> {
    let super::BertShape {
        hidden,
        layers,
        vocab,
    } = shape;
    let pg = ProcessGroup::from_env()?;
    let plugin = FsdpPlugin::builder().resolve(&Layer::new(), None)?.fsdp;
    let config = BertConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        num_hidden_layers: layers,
        num_attention_heads: (hidden / 64).max(1),
        intermediate_size: 4 * hidden,
        max_position_embeddings: 128,
        ..BertConfig::default()
    };
    let model = BertForSequenceClassification::new(config)?;
    let init = LocalParams::init(&model.info(), 42, DType::F32, &Device::Cpu)?;
    let mut fsdp = Fsdp::wrap(&model, &init.tensors(), &plugin, Arc::new(pg))?;
    drop(init);
    let mut adamw = AdamW::new(AdamWConfig::default())?;
    if trained {
        let ids = Tensor::zeros((2, 16), DType::U32, &Device::Cpu)?;
        let labels = Tensor::zeros(2, DType::U32, &Device::Cpu)?;
        let params = fsdp.begin_step()?;
        let loss = cross_entropy(
            &model.forward(&params, &ids, None, None)?,
            &labels,
            CrossEntropy::default(),
        )?;
        fsdp.backward(params, loss, true)?;
        fsdp.step(&mut adamw)?;
    }
    Ok((fsdp, adamw))
}

fn worker(a: &CheckpointArgs, dir: &std::path::Path) -> Result<()> {
    memory::CountingAllocator::mark_installed();
    let (mut fsdp, mut adamw) = bert_engine(a.shape, true)?;
    let rank = fsdp.mesh().rank();

    let run = RunState::default();
    let sharded = dir.join("sharded");
    let (save_sharded, sharded_peak) = timed(a.reps, || {
        fsdp::checkpoint::save_state(&sharded, &[&fsdp], &[&adamw], &run, &Default::default())?;
        Ok(())
    })?;
    // Asynchronous: what the caller is blocked for (the staging copy), and until written.
    let async_dir = dir.join("async");
    let (mut blocked, mut staged) = (Vec::new(), 0u64);
    let (save_async_total, async_peak) = timed(a.reps, || {
        let t = Instant::now();
        let pending = fsdp::checkpoint::save_state_async(
            &async_dir,
            &[&fsdp],
            &[&adamw],
            &run,
            &Default::default(),
        )?;
        blocked.push(t.elapsed().as_secs_f64());
        staged = pending.staged_bytes();
        pending.wait()?;
        Ok(())
    })?;
    blocked.sort_by(f64::total_cmp);
    let save_async_blocked = blocked[blocked.len() / 2];
    // Time and peak of saving into `dest` with `options`.
    let save_with = |dest: &std::path::Path, options: CheckpointOptions| {
        timed(a.reps, || {
            checkpoint::save_state(dest, &[&fsdp], &[&adamw], &run, &options)?;
            Ok(())
        })
    };
    let full = dir.join("full");
    let (save_full, full_peak) = save_with(
        &full,
        CheckpointOptions {
            state_dict_type: Some(StateDictType::FullStateDict),
            ..Default::default()
        },
    )?;
    // The same save as a PyTorch distributed checkpoint (fsdp_checkpoint_format: torch-dcp).
    let dcp = dir.join("torch_dcp");
    let (save_dcp, dcp_peak) = save_with(
        &dcp,
        CheckpointOptions {
            format: Some(CheckpointFormat::TorchDcp),
            ..Default::default()
        },
    )?;
    let mut load = |from: &std::path::Path| {
        timed(a.reps, || {
            fsdp::checkpoint::load_state(
                from,
                &mut [&mut fsdp],
                &mut [&mut adamw],
                &Default::default(),
            )?;
            Ok(())
        })
    };
    let (load_sharded, _) = load(&sharded)?;
    let (load_dcp, _) = load(&dcp)?;
    let merged = dir.join("merged");
    let (merge, _) = if rank == 0 {
        timed(a.reps, || {
            checkpoint::merge_weights(&sharded, &merged)?;
            Ok(())
        })?
    } else {
        (0.0, 0)
    };
    let checkpoint_bytes: u64 = walk_bytes(&sharded);
    let mine = vec![
        sharded_peak as f64,
        full_peak as f64,
        memory::peak_rss_bytes().unwrap_or(0) as f64,
        async_peak as f64,
        staged as f64,
        dcp_peak as f64,
    ];
    let all = fsdp.mesh().all_gather_vec(mine)?;
    if rank == 0 {
        let worst = |k: usize| all.chunks(6).map(|c| c[k]).fold(0f64, f64::max);
        let plan = fsdp.plan();
        println!(
            "RESULT {}",
            serde_json::json!({
                "params_bytes": plan.units.iter().map(|u| u.numel() * 4).sum::<usize>(),
                "largest_unit_bytes": plan.units.iter().map(|u| u.numel() * 4).max().unwrap_or(0),
                "checkpoint_bytes": checkpoint_bytes,
                "save_sharded_s": save_sharded,
                "save_full_s": save_full,
                "save_async_blocked_s": save_async_blocked,
                "save_async_total_s": save_async_total,
                "save_async_blocked_vs_sync": save_async_blocked / save_sharded,
                "save_async_peak_above_bytes": worst(3),
                "save_async_staged_bytes": worst(4),
                "load_sharded_s": load_sharded,
                "save_torch_dcp_s": save_dcp,
                "save_torch_dcp_peak_above_bytes": worst(5),
                "load_torch_dcp_s": load_dcp,
                "torch_dcp_bytes": walk_bytes(&dcp),
                "merge_s": merge,
                "save_sharded_peak_above_bytes": worst(0),
                "save_full_peak_above_bytes": worst(1),
                "peak_rss_bytes": worst(2),
            })
        );
    }
    Ok(())
}

/// Bytes of every file under `dir`.
pub(super) fn walk_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                walk_bytes(&p)
            } else {
                e.metadata().map_or(0, |m| m.len())
            }
        })
        .sum()
}
