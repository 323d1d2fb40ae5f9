//! Fine-tune a BERT classifier with FSDP, like Accelerate's `nlp_example.py`:
//!
//! ```sh
//! fsdp launch --num_processes 2 --example nlp_example -- --steps 20
//! ```
//!
//! The configuration comes from the environment `fsdp launch` sets (FSDP_* variables from the
//! config file and flags). The data is a synthetic two-class token task generated here (model
//! hubs are out of reach): class 0 draws body tokens from the lower half of the vocabulary,
//! class 1 from the upper half, and the first token marks the class — learnable in a few
//! dozen steps. Each rank takes its slice of every global batch.

use anyhow::{Context, Result};
use fsdp::config::{FsdpPlugin, Layer};
use fsdp::engine::Fsdp;
use std::sync::Arc;

use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::candle::{DType, Device, Tensor};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{AdamW, AdamWConfig, LrSchedule};
use fsdp_comm::{ProcessGroup, ReduceOp};

struct Args {
    steps: usize,
    global_batch: usize,
    seq: usize,
    lr: f64,
    seed: u64,
}

fn args() -> Result<Args> {
    let mut a = Args {
        steps: 20,
        global_batch: 16,
        seq: 64,
        lr: 2e-4,
        seed: 42,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--steps" => a.steps = value()?.parse()?,
            "--global_batch" => a.global_batch = value()?.parse()?,
            "--seq" => a.seq = value()?.parse()?,
            "--lr" => a.lr = value()?.parse()?,
            "--seed" => a.seed = value()?.parse()?,
            other => anyhow::bail!(
                "unknown argument {other} (use --steps, --global_batch, --seq, --lr, --seed)"
            ),
        }
    }
    Ok(a)
}

/// Global batch `step`: (input ids [batch, seq], labels [batch]), identical on every rank.
fn batch(step: usize, a: &Args, vocab: u32) -> Result<(Tensor, Tensor)> {
    let mut state = a.seed ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let half = (vocab - 5) / 2;
    let mut ids = Vec::with_capacity(a.global_batch * a.seq);
    let mut labels = Vec::with_capacity(a.global_batch);
    for _ in 0..a.global_batch {
        let label = (next() % 2) as u32;
        labels.push(label);
        ids.push(2 + label);
        for _ in 1..a.seq {
            ids.push(5 + label * half + (next() % half as u64) as u32);
        }
    }
    let device = Device::Cpu;
    Ok((
        Tensor::from_vec(ids, (a.global_batch, a.seq), &device)?,
        Tensor::from_vec(labels, a.global_batch, &device)?,
    ))
}

fn main() -> Result<()> {
    let a = args()?;
    let plugin = FsdpPlugin::builder()
        .resolve(&Layer::from_process_env()?, None)?
        .fsdp;
    let pg = ProcessGroup::from_env()?;
    let (rank, world) = (pg.rank(), pg.size());
    anyhow::ensure!(
        a.global_batch % world == 0,
        "--global_batch {} is not divisible by {world} processes",
        a.global_batch
    );
    let config = BertConfig {
        max_position_embeddings: a.seq,
        ..BertConfig::default()
    };
    let model = BertForSequenceClassification::new(config)?;
    // Same seed on every rank: identical initial weights, then each rank keeps its shards.
    let init = LocalParams::init(&model.info(), a.seed, DType::F32, &Device::Cpu)?;
    let mut fsdp = Fsdp::wrap(&model, &init.tensors(), &plugin, Arc::new(pg))?;
    drop(init);
    if rank == 0 {
        let plan = fsdp.plan();
        let m = plan.memory_estimate();
        println!(
            "{} units over {} ranks; estimated model state per rank {:.1} MiB (+{:.1} MiB gathered at peak)",
            plan.units.len(),
            plan.group_size,
            (m.params + m.grads + m.optimizer) as f64 / (1 << 20) as f64,
            m.gathered_peak as f64 / (1 << 20) as f64
        );
        println!(
            "strategy {:?}, {world} processes, global batch {}, {} steps",
            plugin.sharding_strategy, a.global_batch, a.steps
        );
    }
    // Linear warmup over the first tenth of the steps, then linear decay (transformers').
    let schedule = LrSchedule::Linear {
        warmup: (a.steps / 10) as u64,
        total: a.steps as u64,
    };
    let mut adamw = AdamW::new(AdamWConfig {
        lr: a.lr,
        ..Default::default()
    })?;
    let per_rank = a.global_batch / world;
    let started = std::time::Instant::now();
    for step in 0..a.steps {
        let (ids, labels) = batch(step, &a, 8192)?;
        let ids = ids.narrow(0, rank * per_rank, per_rank)?;
        let labels = labels.narrow(0, rank * per_rank, per_rank)?;
        let params = fsdp.begin_step()?;
        let logits = model.forward(&params, &ids, None, None)?;
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default())?;
        let correct = logits
            .argmax(1)?
            .eq(&labels)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        let local_loss = loss.to_scalar::<f32>()?;
        drop(logits);
        let grads = fsdp.backward(params, loss)?;
        schedule.apply(&mut adamw, step as u64 + 1)?;
        fsdp.step(grads, &mut adamw, Some(1.0))?;
        let stats = fsdp
            .mesh()
            .all_reduce_vec(vec![local_loss, correct], ReduceOp::Sum)?;
        if rank == 0 {
            println!(
                "step {:>3}: loss {:.4}, accuracy {:.3}",
                step + 1,
                stats[0] / world as f32,
                stats[1] / a.global_batch as f32
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let peaks = fsdp.mesh().all_gather_vec(vec![peak_rss_mib()])?;
    if rank == 0 {
        println!(
            "{:.1} samples/s over {} steps; peak RSS per rank (MiB): {:?}",
            (a.steps * a.global_batch) as f64 / secs,
            a.steps,
            peaks
        );
    }
    Ok(())
}

/// This process's peak resident set size (VmHWM), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| (kb / 1024.0 * 10.0).round() / 10.0)
}
