//! `fsdp bench qlora`: LoRA training of a Llama-shaped model (Llama-2-7B's shape by default,
//! whose f32 weights, 27 GB, exceed this machine's memory) with its linear layers kept
//! quantized (NF4 by default) and sharded over local processes, the weights seeded (each
//! parameter drawn and quantized on its own, so the model is never whole in f32): seconds per
//! step, tokens/s, peak RSS and live heap per rank, the bytes each rank stores and receives
//! by all-gathers per step against the same model in f32 and bf16. Prints a table and one
//! JSON line.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use fsdp::config::{FsdpPlugin, Layer, ShardingStrategy};
use fsdp::engine::Fsdp;
use fsdp::memory;
use fsdp::models::{LlamaConfig, LlamaForCausalLM};
use fsdp::nn::layers::quantize_linears;
use fsdp::nn::quant::QuantFormat;
use fsdp::nn::{Model, Module, SeededWeights};
use fsdp::optim::{AdamW, AdamWConfig};
use fsdp::peft::{LoraConfig, LoraModel, TargetModules};
use fsdp_comm::{CommunicatorExt, ProcessGroup};

/// Options of `fsdp bench qlora`.
#[derive(Args, Clone)]
pub struct QloraArgs {
    /// Model shape: llama-7b (Llama-2-7B: 6.7 B parameters), smollm2-135m, or tiny.
    #[arg(long, default_value = "llama-7b", value_parser = ["llama-7b", "smollm2-135m", "tiny"])]
    model: String,
    /// Decoder layers instead of the shape's own number.
    #[arg(long)]
    layers: Option<usize>,
    /// The base's format: nf4, q4_0, q4_1, q8_0, q4_k, ... or f32 (plain LoRA, to compare
    /// on shapes that fit).
    #[arg(long, default_value = "nf4")]
    format: String,
    /// Processes.
    #[arg(long = "num_processes", default_value_t = 2)]
    num_processes: usize,
    /// Optimizer steps (all reported).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Sequences per rank and step.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// LoRA's rank (adapters on every linear layer but lm_head).
    #[arg(long, default_value_t = 8)]
    lora_r: usize,
    /// Recompute each decoder layer in backward instead of keeping its activations.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Also write the JSON result to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Internal: run as one of the benchmark's workers.
    #[arg(long, hide = true)]
    worker: bool,
}

fn config(name: &str, layers: Option<usize>) -> Result<LlamaConfig> {
    let (hidden, inter, n_layer, heads, kv, vocab) = match name {
        "llama-7b" => (4096, 11008, 32, 32, 32, 32000),
        "smollm2-135m" => (576, 1536, 30, 9, 3, 49152),
        _ => (128, 256, 2, 2, 1, 1000),
    };
    Ok(LlamaConfig::from_value(&serde_json::json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers.unwrap_or(n_layer), "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": name == "smollm2-135m", "hidden_act": "silu",
        "rope_theta": 10000.0, "torch_dtype": "float32",
    }))?)
}

/// The LoRA model the benchmark trains, and the number of layers kept quantized.
fn model(a: &QloraArgs) -> Result<(LoraModel<LlamaForCausalLM>, usize)> {
    let mut llama = LlamaForCausalLM::new(config(&a.model, a.layers)?)?;
    let quantized = match a.format.as_str() {
        "f32" => 0,
        f => quantize_linears(&mut llama, QuantFormat::parse(f)?)?.len(),
    };
    let lora = LoraModel::new(
        llama,
        LoraConfig {
            r: a.lora_r,
            lora_alpha: 2.0 * a.lora_r as f64,
            lora_dropout: 0.0,
            target_modules: TargetModules::AllLinear,
            use_rslora: false,
            init_lora_weights: Default::default(),
        },
    )?;
    Ok((lora, quantized))
}

/// Runs `fsdp bench qlora`.
pub fn run(a: QloraArgs) -> Result<()> {
    if a.worker {
        return worker(&a);
    }
    let (lora, quantized) = model(&a)?;
    let info = lora.info();
    let params = info.num_params();
    println!(
        "{}: {params} parameters ({:.1} GB in f32), {quantized} linear layers in {}, LoRA r {} on every linear layer; {} processes, {} x {} tokens per rank and step",
        a.model,
        params as f64 * 4e-9,
        a.format,
        a.lora_r,
        a.num_processes,
        a.batch,
        a.seq
    );
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    args.push("--worker".into());
    let out = super::workers::spawn_workers(&args, a.num_processes, 1, &[])?;
    let line = out
        .lines()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow::anyhow!("the workers printed no result:\n{out}"))?;
    let r: serde_json::Value = serde_json::from_str(line)?;
    let mib = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN) / (1 << 20) as f64;
    println!(
        "setup {:.1} s (seeded weights drawn and quantized per parameter)",
        r["setup_seconds"].as_f64().unwrap_or(f64::NAN)
    );
    println!("| step | seconds | tokens/s | loss |\n|---|---|---|---|");
    for s in r["steps"].as_array().into_iter().flatten() {
        println!(
            "| {} | {:.2} | {:.1} | {:.4} |",
            s["step"],
            s["seconds"].as_f64().unwrap_or(f64::NAN),
            s["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
            s["loss"].as_f64().unwrap_or(f64::NAN)
        );
    }
    let list = |k: &str| {
        r[k].as_array()
            .into_iter()
            .flatten()
            .map(|v| format!("{:.0}", mib(v)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "per rank: peak RSS {} MiB, peak live heap {} MiB; stored parameters {:.0} MiB (f32 would be {:.0}); all-gathered per step {:.0} MiB (f32: {:.0}, bf16: {:.0})",
        list("peak_rss_bytes"),
        list("peak_live_bytes"),
        mib(&r["stored_bytes"]),
        mib(&r["stored_bytes_f32"]),
        mib(&r["gathered_bytes"]),
        mib(&r["gathered_bytes_f32"]),
        mib(&r["gathered_bytes_f32"]) / 2.0
    );
    let json = serde_json::json!({
        "bench": "qlora",
        "model": a.model,
        "layers": a.layers,
        "format": a.format,
        "parameters": params,
        "quantized_layers": quantized,
        "processes": a.num_processes,
        "tokens_per_rank_step": a.batch * a.seq,
        "lora_r": a.lora_r,
        "result": r,
    });
    println!("{json}");
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}

fn worker(a: &QloraArgs) -> Result<()> {
    memory::CountingAllocator::mark_installed();
    let pg = Arc::new(ProcessGroup::from_env()?);
    let rank = pg.rank();
    let plugin = FsdpPlugin::builder()
        .sharding_strategy(ShardingStrategy::FullShard)
        .activation_checkpointing(a.activation_checkpointing)
        .resolve(&Layer::from_process_env()?, None)?
        .fsdp;
    let (model, _) = model(a)?;
    let info = model.info();
    let vocab = model.config.vocab_size as u64;
    let built = Instant::now();
    let weights = model.weights(&SeededWeights(42), None, 3)?;
    let mut fsdp = Fsdp::new(
        &info,
        &weights,
        &plugin,
        model.no_split_modules(),
        pg.clone(),
    )?;
    let setup = built.elapsed().as_secs_f64();
    let plan = fsdp.plan();
    // The same plan's elements as f32 weights: a quantized one's unquantized count.
    let specs: std::collections::HashMap<&str, usize> = info
        .all_params()
        .into_iter()
        .map(|p| (p.name.as_str(), p.numel()))
        .collect();
    let logical = |u: &fsdp::engine::Unit| -> usize {
        u.params
            .iter()
            .map(|l| specs[l.name.as_str()].div_ceil(plan.group_size))
            .sum()
    };
    let stored: usize = plan.units.iter().map(|u| u.shard_numel() * 4).sum();
    let stored_f32: usize = plan.units.iter().map(|u| logical(u) * 4).sum();
    let gathered_bytes = plan.gathered_per_step(fsdp::engine::Unit::shard_numel) * 4;
    let gathered_f32 = plan.gathered_per_step(logical) * 4;
    let mut opt = AdamW::new(AdamWConfig {
        lr: 1e-4,
        ..Default::default()
    })?;
    let mut steps = Vec::new();
    for step in 0..a.steps {
        let ids = super::random_ids(rank, step, (a.batch, a.seq), vocab)?;
        let t = Instant::now();
        let params = fsdp.begin_step()?;
        let loss = model.forward_loss(&params, &ids, None, &ids)?;
        let value = loss.to_scalar::<f32>()?;
        fsdp.backward(params, loss, true)?;
        fsdp.clip_grad_norm(Some(1.0))?;
        fsdp.step(&mut opt)?;
        let seconds = t.elapsed().as_secs_f64();
        if !value.is_finite() {
            bail!("step {step}: the loss is {value}");
        }
        steps.push(serde_json::json!({
            "step": step,
            "seconds": seconds,
            "tokens_per_s": (a.num_processes * a.batch * a.seq) as f64 / seconds,
            "loss": value,
        }));
    }
    let peaks = pg
        .all_gather_vec(vec![
            memory::peak_rss_bytes().unwrap_or(0) as f64,
            memory::peak_bytes() as f64,
        ])
        .wait()?;
    if rank == 0 {
        let json = serde_json::json!({
            "setup_seconds": setup,
            "steps": steps,
            "peak_rss_bytes": peaks.iter().step_by(2).collect::<Vec<_>>(),
            "peak_live_bytes": peaks.iter().skip(1).step_by(2).collect::<Vec<_>>(),
            "stored_bytes": stored,
            "stored_bytes_f32": stored_f32,
            "gathered_bytes": gathered_bytes,
            "gathered_bytes_f32": gathered_f32,
        });
        println!("{json}");
    }
    Ok(())
}
