//! `fsdp bench memory`: trains a BERT classifier with FSDP on local processes, once per
//! sharding strategy (fresh processes each, so peak RSS is per strategy), and reports per
//! rank, side by side:
//!
//! * model state at the optimizer step (parameters + gradients + optimizer state), counted by
//!   the counting allocator, against the plan's formula;
//! * the peak during forward and backward above that state (full parameters and gradients
//!   of the units in flight, communication buffers, activations), against the largest unit;
//! * bytes sent per step against the ring algorithms' theory, inside the shard groups
//!   (FULL_SHARD: all-gather in forward, again in backward for resharded units,
//!   reduce-scatter: about 3 x parameter bytes x (N-1)/N) and across replicas (NO_SHARD's
//!   all-reduce; hybrid sharding's all-reduce of each rank's reduced rows between machines);
//! * samples/s and peak RSS.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp::config::{Choice, FsdpPlugin, Layer, MixedPrecision, ReduceDtype, ShardingStrategy};
use fsdp::engine::{Fsdp, StepShape};
use fsdp::memory;
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::candle::{DType, Device, Tensor};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{AdamW, AdamWConfig};
use fsdp_comm::ProcessGroup;

/// Options of `fsdp bench memory`.
#[derive(Args, Clone)]
pub struct MemoryArgs {
    /// Number of processes.
    #[arg(
        long = "num_processes",
        visible_alias = "num-processes",
        default_value_t = 2
    )]
    num_processes: usize,
    /// Strategies to measure, comma-separated (HYBRID_SHARD and HYBRID_SHARD_ZERO2 need
    /// --num_machines).
    #[arg(long, default_value = "FULL_SHARD,SHARD_GRAD_OP,NO_SHARD")]
    strategies: String,
    /// Machines the processes are split into, as hybrid sharding sees them (on loopback:
    /// each "machine" is num_processes / num_machines local processes).
    #[arg(
        long = "num_machines",
        visible_alias = "num-machines",
        default_value_t = 1
    )]
    num_machines: usize,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// The BERT.
    #[command(flatten)]
    shape: super::BertShape,
    /// FSDP backward prefetch (BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH).
    #[arg(long = "backward_prefetch", default_value = "BACKWARD_PRE")]
    backward_prefetch: String,
    /// FSDP forward prefetch (unset: the environment's `FSDP_FORWARD_PREFETCH`, else off).
    #[arg(long = "forward_prefetch")]
    forward_prefetch: bool,
    /// Micro-batches per optimizer step (of --batch each); above 1 each strategy is measured
    /// twice: reducing every micro-batch (sync_each_batch) and keeping whole gradients until
    /// the last (no_sync).
    #[arg(long, default_value_t = 1)]
    accumulation: usize,
    /// Internal (workers): micro-batches before the last run without sync.
    #[arg(long = "no_sync", hide = true)]
    no_sync: bool,
    /// Activation checkpointing (fsdp_activation_checkpointing): off, on, or both (each
    /// strategy measured without and with, side by side).
    #[arg(long = "activation_checkpointing", value_enum, default_value_t = Toggle::Off)]
    activation_checkpointing: Toggle,
    /// Mixed precision: off (f32), on (bf16: parameters gathered and computed in bf16,
    /// gradients reduced in f32), or both side by side.
    #[arg(long = "mixed_precision", value_enum, default_value_t = Toggle::Off)]
    mixed_precision: Toggle,
    /// What gradients are reduced in (fsdp_reduce_dtype: fp32, bf16, fp16, int8); unset, the
    /// environment's `FSDP_REDUCE_DTYPE` (as `fsdp launch` passes it), else fp32.
    #[arg(long = "reduce_dtype", value_parser = str::parse::<ReduceDtype>)]
    reduce_dtype: Option<ReduceDtype>,
    /// Write the JSON results to this file too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Internal: run as one of the benchmark's workers with this strategy.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

/// A setting measured off, on, or both ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Toggle {
    /// Off.
    Off,
    /// On.
    On,
    /// Off, then on.
    Both,
}

impl Toggle {
    fn values(self) -> &'static [bool] {
        match self {
            Toggle::Off => &[false],
            Toggle::On => &[true],
            Toggle::Both => &[false, true],
        }
    }
}

/// Runs `fsdp bench memory`.
pub fn run(a: MemoryArgs) -> Result<()> {
    match &a.worker {
        Some(strategy) => worker(&a, strategy),
        None => launch(&a),
    }
}

fn launch(a: &MemoryArgs) -> Result<()> {
    if a.num_processes < 1 {
        bail!("--num_processes must be at least 1");
    }
    if a.num_machines == 0 || !a.num_processes.is_multiple_of(a.num_machines) {
        bail!(
            "--num_machines {} does not divide --num_processes {}",
            a.num_machines,
            a.num_processes
        );
    }
    if a.accumulation == 0 {
        bail!("--accumulation must be at least 1");
    }
    let modes: &[bool] = if a.accumulation > 1 {
        &[false, true]
    } else {
        &[false]
    };
    let mut results = Vec::new();
    for strategy in a.strategies.split(',').map(str::trim) {
        let parsed = strategy
            .parse::<ShardingStrategy>()
            .map_err(|e| anyhow::anyhow!("--strategies: {e}"))?;
        if parsed.is_hybrid() && a.num_machines < 2 {
            bail!(
                "{strategy} shards within machines and replicates across them: add --num_machines 2 (or more)"
            );
        }
        let args: Vec<String> = [
            "bench",
            "memory",
            "--worker",
            strategy,
            "--steps",
            &a.steps.to_string(),
            "--batch",
            &a.batch.to_string(),
            "--seq",
            &a.seq.to_string(),
            "--backward_prefetch",
            &a.backward_prefetch,
        ]
        .map(String::from)
        .to_vec();
        let mut args = args;
        args.extend(a.shape.flags());
        if a.forward_prefetch {
            args.push("--forward_prefetch".into());
        }
        args.extend(["--accumulation".into(), a.accumulation.to_string()]);
        if let Some(d) = a.reduce_dtype {
            args.extend(["--reduce_dtype".into(), d.name().into()]);
        }
        let runs = modes.iter().flat_map(|&no_sync| {
            let checkpointing = a.activation_checkpointing.values();
            checkpointing.iter().flat_map(move |&ckpt| {
                let bf16 = a.mixed_precision.values();
                bf16.iter().map(move |&bf16| (no_sync, ckpt, bf16))
            })
        });
        for (no_sync, checkpointing, bf16) in runs {
            let mut args = args.clone();
            if no_sync {
                args.push("--no_sync".into());
            }
            if checkpointing {
                args.extend(["--activation_checkpointing".into(), "on".into()]);
            }
            if bf16 {
                args.extend(["--mixed_precision".into(), "on".into()]);
            }
            let env = [("ACCELERATE_USE_FSDP", "true")];
            let out = super::workers::spawn_workers(&args, a.num_processes, a.num_machines, &env)
                .with_context(|| format!("measuring {strategy}"))?;
            let line = out
                .lines()
                .find_map(|l| l.strip_prefix("RESULT "))
                .with_context(|| format!("no result from the {strategy} workers:\n{out}"))?;
            let mut result = serde_json::from_str::<serde_json::Value>(line)?;
            // Model FLOPs (fsdp::models::TransformerShape's count; every sequence `seq` tokens, no padding) and
            // MFU over the cores the workers ran on.
            let shape = fsdp::models::TransformerShape::dense(
                a.shape.layers,
                a.shape.hidden,
                4 * a.shape.hidden,
                0,
            );
            let samples_per_s = result["samples_per_s"].as_f64().unwrap_or(0.0);
            let cores =
                a.num_processes * (crate::system::available_cores() / a.num_processes).max(1);
            let dtype = if bf16 { DType::BF16 } else { DType::F32 };
            let u = fsdp::perf::utilisation(
                samples_per_s * shape.training_flops([a.seq]),
                1.0,
                cores,
                fsdp::perf::core_peak().for_dtype(dtype),
            );
            result["model_flops_per_s"] = u.flops_per_second.into();
            result["mfu"] = u.mfu.into();
            results.push(result);
        }
    }
    let mib = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN) / (1u64 << 20) as f64;
    println!(
        "{} processes on {} machine(s), BERT hidden {} x {} layers, vocab {}, batch {}/rank x {} micro-batch(es), seq {}, backward prefetch {}, forward prefetch {}; MiB per rank (sent: inside shard groups + across replicas; kept: whole gradients held without sync)",
        a.num_processes,
        a.num_machines,
        a.shape.hidden,
        a.shape.layers,
        a.shape.vocab,
        a.batch,
        a.accumulation,
        a.seq,
        a.backward_prefetch,
        a.forward_prefetch
    );
    println!(
        "{:>32} {:>9} {:>9} {:>6} {:>10} {:>9} {:>6} {:>10} {:>10} {:>6} {:>8} {:>8} {:>8} {:>9} {:>5} {:>8}",
        "strategy",
        "state",
        "formula",
        "ratio",
        "peak+",
        "unit",
        "units",
        "sent/step",
        "theory",
        "ratio",
        "across",
        "theory",
        "kept",
        "samples/s",
        "MFU%",
        "peakRSS"
    );
    for r in &results {
        println!(
            "{:>32} {:>9.2} {:>9.2} {:>6.3} {:>10.2} {:>9.2} {:>6.2} {:>10.2} {:>10.2} {:>6.3} {:>8.2} {:>8.2} {:>8.2} {:>9.1} {:>5.1} {:>8.1}",
            r["label"].as_str().unwrap_or("?"),
            mib(&r["state_bytes"]),
            mib(&r["state_formula_bytes"]),
            r["state_bytes"].as_f64().unwrap_or(0.0)
                / r["state_formula_bytes"].as_f64().unwrap_or(f64::NAN),
            mib(&r["peak_above_state_bytes"]),
            mib(&r["largest_unit_bytes"]),
            r["peak_above_state_bytes"].as_f64().unwrap_or(0.0)
                / r["largest_unit_bytes"].as_f64().unwrap_or(f64::NAN),
            mib(&r["bytes_sent_per_step"]),
            mib(&r["bytes_theory_per_step"]),
            r["bytes_sent_per_step"].as_f64().unwrap_or(0.0)
                / r["bytes_theory_per_step"].as_f64().unwrap_or(f64::NAN),
            mib(&r["bytes_across_replicas_per_step"]),
            mib(&r["bytes_across_replicas_theory"]),
            mib(&r["kept_unreduced_bytes"]),
            r["samples_per_s"].as_f64().unwrap_or(f64::NAN),
            100.0 * r["mfu"].as_f64().unwrap_or(f64::NAN),
            mib(&r["peak_rss_bytes"]),
        );
    }
    let doc = serde_json::json!({"benchmark": "memory", "num_processes": a.num_processes, "results": results});
    println!("{doc}");
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

fn worker(a: &MemoryArgs, strategy: &str) -> Result<()> {
    memory::CountingAllocator::mark_installed();
    let pg = ProcessGroup::from_env()?;
    let (rank, n) = (pg.rank(), pg.size());
    // The environment gives the layout (machines of LOCAL_WORLD_SIZE processes), as it does
    // to any launched program; the strategy and backward prefetch are set here.
    let mut builder = FsdpPlugin::builder()
        .sharding_strategy(strategy.parse().map_err(anyhow::Error::msg)?)
        .backward_prefetch(a.backward_prefetch.parse().map_err(anyhow::Error::msg)?)
        .activation_checkpointing(a.activation_checkpointing == Toggle::On)
        .mixed_precision(if a.mixed_precision == Toggle::On {
            MixedPrecision::Bf16
        } else {
            MixedPrecision::No
        });
    if a.forward_prefetch {
        builder = builder.forward_prefetch(true);
    }
    if let Some(d) = a.reduce_dtype {
        builder = builder.reduce_dtype(d);
    }
    let plugin = builder.resolve(&Layer::from_process_env()?, None)?.fsdp;
    let config = BertConfig {
        vocab_size: a.shape.vocab,
        hidden_size: a.shape.hidden,
        num_hidden_layers: a.shape.layers,
        num_attention_heads: (a.shape.hidden / 64).max(1),
        intermediate_size: 4 * a.shape.hidden,
        max_position_embeddings: a.seq,
        ..BertConfig::default()
    };
    let model = BertForSequenceClassification::new(config)?;
    let base = memory::resident_bytes();
    let init = LocalParams::init(&model.info(), 42, DType::F32, &Device::Cpu)?;
    let mut fsdp = Fsdp::wrap(&model, &init.tensors(), &plugin, Arc::new(pg))?;
    drop(init);
    let plan = fsdp.plan().clone();
    let estimate = plan.memory_estimate();
    let formula = estimate.params + estimate.grads + estimate.optimizer;
    let largest_unit = plan.units.iter().map(|u| u.numel() * 4).max().unwrap_or(0);
    let mut optimizer = AdamW::new(AdamWConfig {
        lr: 1e-4,
        ..Default::default()
    })?;
    let bytes_sent = |f: &Fsdp| {
        let (inside, across) = f.mesh().bytes_sent();
        let (hops_within, hops_across) = f.mesh().two_hop_bytes_sent();
        (
            inside,
            across,
            f.mesh().secondary_bytes_sent(),
            hops_within,
            hops_across,
        )
    };
    let mut rng = fsdp::rng::XorShift64::new(fsdp::rng::GOLDEN_GAMMA ^ rank as u64);
    let mut next = move || rng.next_u64();
    let (mut state, mut peak_above, mut sent, mut sent_across) = (0usize, 0usize, 0u64, 0u64);
    let mut sent_secondary = 0u64;
    let mut sent_hops = (0u64, 0u64);
    let micro = a.accumulation.max(1);
    // Bytes of whole gradients held between micro-batches without sync.
    let mut kept = 0usize;
    let mut timed = 0f64;
    // Seconds in forward, backward and the optimizer step, over the timed steps.
    let mut phases = [0f64; 3];
    // A step's bytes are counted from the end of the previous step's backward to the end of
    // its own: the optimizer step issues the next forward's first gather, which that forward
    // waits for, so each such span holds one step's collectives, all of them finished.
    let mut sent_before = bytes_sent(&fsdp);
    for step in 0..=a.steps {
        let started = Instant::now();
        memory::reset_peak();
        let (mut forward_s, mut backward_s) = (0f64, 0f64);
        for m in 0..micro {
            let ids: Vec<u32> = (0..a.batch * a.seq)
                .map(|_| (next() % a.shape.vocab as u64) as u32)
                .collect();
            let labels: Vec<u32> = (0..a.batch).map(|_| (next() % 2) as u32).collect();
            let ids = Tensor::from_vec(ids, (a.batch, a.seq), &Device::Cpu)?;
            let labels = Tensor::from_vec(labels, a.batch, &Device::Cpu)?;
            let t = Instant::now();
            let params = fsdp.begin_step()?;
            let logits = model.forward(&params, &ids, None, None)?;
            let loss = (cross_entropy(&logits, &labels, CrossEntropy::default())? / micro as f64)?;
            drop(logits);
            let forward_done = Instant::now();
            let sync = !(a.no_sync && m + 1 < micro);
            fsdp.backward(params, loss, sync)?;
            if !sync {
                kept = kept.max(fsdp.unreduced_bytes());
            }
            forward_s += (forward_done - t).as_secs_f64();
            backward_s += forward_done.elapsed().as_secs_f64();
        }
        let backward_done = Instant::now();
        let sent_now = bytes_sent(&fsdp);
        if step > 0 {
            sent += sent_now.0 - sent_before.0;
            sent_across += sent_now.1 - sent_before.1;
            sent_secondary += sent_now.2 - sent_before.2;
            sent_hops.0 += sent_now.3 - sent_before.3;
            sent_hops.1 += sent_now.4 - sent_before.4;
        }
        sent_before = sent_now;
        let peak = memory::peak_bytes();
        fsdp.clip_grad_norm(Some(1.0))?;
        let report = fsdp.step(&mut optimizer)?;
        // Resident at the optimizer step: parameters, gradients and optimizer state.
        let at_step = report.resident_bytes.unwrap_or(0);
        if step > 0 {
            timed += started.elapsed().as_secs_f64();
            phases[0] += forward_s;
            phases[1] += backward_s;
            phases[2] += backward_done.elapsed().as_secs_f64();
            peak_above = peak_above.max(peak.saturating_sub(at_step));
            state = state.max(at_step.saturating_sub(base));
        }
    }
    let steps = a.steps.max(1) as f64;
    // Every rank reports; rank 0 prints the worst rank's figures.
    let mine = vec![
        state as f64,
        peak_above as f64,
        sent as f64 / steps,
        memory::peak_rss_bytes().unwrap_or(0) as f64,
        timed,
        sent_across as f64 / steps,
        kept as f64,
        sent_secondary as f64 / steps,
        sent_hops.0 as f64 / steps,
        sent_hops.1 as f64 / steps,
    ];
    let per_step_ms = phases.map(|s| s / steps * 1e3);
    let metrics = mine.len();
    let all = fsdp.mesh().all_gather_vec(mine)?;
    if rank == 0 {
        let worst = |k: usize| (0..n).map(|r| all[r * metrics + k]).fold(0f64, f64::max);
        let mesh = fsdp.mesh();
        let bf16 = a.mixed_precision == Toggle::On;
        let theory = plan.traffic_per_step(StepShape {
            shard_size: mesh.shard_size(),
            replicas: mesh.replicas(),
            micro_batches: micro,
            no_sync: a.no_sync,
            machine_size: mesh
                .machines
                .as_ref()
                .map_or(1, |m| m.gathers.machine_size()),
        });
        let (theory_inside, theory_across) = (theory.inside, theory.across);
        let samples_per_s = steps * (a.batch * micro * n) as f64 / worst(4);
        let mut label = match (micro, a.no_sync) {
            (1, _) => strategy.to_string(),
            (k, false) => format!("{strategy} x{k} sync_each"),
            (k, true) => format!("{strategy} x{k} no_sync"),
        };
        let checkpointing = a.activation_checkpointing == Toggle::On;
        if checkpointing {
            label.push_str(" +ckpt");
        }
        if bf16 {
            label.push_str(" bf16");
        }
        if plugin.reduce_dtype != ReduceDtype::Fp32 {
            label.push_str(&format!(" reduce {}", plugin.reduce_dtype.name()));
        }
        if plan.secondary_partition > 1 {
            label.push_str(&format!(" hpz {}", plan.secondary_partition));
        }
        let machines = mesh.machines.as_ref().map_or(1, |m| m.gathers.machines());
        if machines > 1 {
            label.push_str(" two hops");
        }
        println!(
            "RESULT {}",
            serde_json::json!({
                "strategy": strategy,
                "label": label,
                "accumulation": micro,
                "no_sync": a.no_sync,
                "kept_unreduced_bytes": worst(6),
                "activation_checkpointing": checkpointing,
                "mixed_precision": if bf16 { "bf16" } else { "no" },
                "reduce_dtype": plugin.reduce_dtype.name(),
                "all_gather_dtype": plugin.all_gather_dtype.name(),
                "recomputed_units_per_step": fsdp.recomputed_units() as f64 / (steps + 1.0),
                "state_bytes": worst(0),
                "state_formula_bytes": formula,
                "peak_above_state_bytes": worst(1),
                "largest_unit_bytes": largest_unit,
                "bytes_sent_per_step": worst(2),
                "bytes_theory_per_step": theory_inside,
                "bytes_across_replicas_per_step": worst(5),
                "bytes_secondary_per_step": worst(7),
                "bytes_secondary_theory": theory.secondary,
                "hpz_partition_size": plan.secondary_partition,
                "bytes_across_replicas_theory": theory_across,
                "two_hop_machines": machines,
                "bytes_two_hops_within_machine_per_step": worst(8),
                "bytes_two_hops_within_machine_theory": theory.within_machine,
                "bytes_two_hops_across_machines_per_step": worst(9),
                "bytes_two_hops_across_machines_theory": theory.across_machines,
                "shard_group_size": mesh.shard_size(),
                "replicas": mesh.replicas(),
                "params_bytes": plan.units.iter().map(|u| u.numel() * 4).sum::<usize>(),
                "samples_per_s": samples_per_s,
                "peak_rss_bytes": worst(3),
                "shared_gather_bytes": fsdp.shared_gather_bytes(),
                "units": plan.units.len(),
                "rank0_forward_ms": per_step_ms[0],
                "rank0_backward_ms": per_step_ms[1],
                "rank0_optimizer_ms": per_step_ms[2],
            })
        );
    }
    Ok(())
}
