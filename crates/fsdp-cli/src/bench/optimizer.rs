//! `fsdp bench optimizer`: one optimizer step over a rank's shard (100 M f32 elements by
//! default), against this machine's memory bandwidth measured in the same run and, with
//! `--torch PYTHON`, against `torch.optim` (single-tensor, `foreach`, `fused`) on the same
//! shard and threads; prints a table and one JSON line.

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp::optim::{AdamConfig, AdamWConfig, Grouped, Optimizer, SgdConfig};

/// Options of `fsdp bench optimizer`.
#[derive(Args, Clone)]
pub struct OptimizerArgs {
    /// Elements of the shard.
    #[arg(long, default_value_t = 100_000_000)]
    elements: usize,
    /// Timed steps (after two warm-ups); the median is reported.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Threads (ours and PyTorch's); all cores by default.
    #[arg(long)]
    threads: Option<usize>,
    /// `adamw`, `adam` or `sgd` (momentum 0.9).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "adam", "sgd"])]
    optimizer: String,
    /// A Python with torch: also time torch.optim on the same shard with
    /// `tools/bench_optimizer_pytorch.py`.
    #[arg(long)]
    torch: Option<String>,
}

/// Bytes one element moves in an update: read parameter, gradient and state, write
/// parameter and state.
fn bytes_per_element(optimizer: &str) -> usize {
    match optimizer {
        "sgd" => 4 * (3 + 2),
        _ => 4 * (4 + 3),
    }
}

fn optimizer(name: &str) -> Result<Box<dyn Optimizer>> {
    Ok(match name {
        "adamw" => Box::new(Grouped::new(AdamWConfig::default())?),
        "adam" => Box::new(Grouped::new(AdamConfig {
            weight_decay: 0.01,
            ..AdamConfig::default()
        })?),
        _ => Box::new(Grouped::new(SgdConfig {
            lr: 1e-3,
            momentum: 0.9,
            ..SgdConfig::default()
        })?),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Deterministic values in [-scale/2, scale/2).
fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = fsdp::rng::XorShift64::seeded(seed);
    (0..n)
        .map(|_| {
            let x = rng.next_u64();
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

/// The memory bandwidth of this machine for the optimizer's access pattern on `threads`:
/// streams that read four arrays and write three of them back (`p, m, v += g`), and plain
/// copies (read one, write one); bytes per second of each, best of `reps`.
fn memory_bandwidth(n: usize, threads: usize, reps: usize) -> (f64, f64) {
    let mut arrays: Vec<Vec<f32>> = (0..4).map(|s| noise(n, 11 + s, 1.0)).collect();
    let g = arrays.pop().unwrap_or_default();
    let per = n.div_ceil(threads);
    let (mut stream, mut copy) = (0f64, 0f64);
    for _ in 0..reps {
        let t = Instant::now();
        {
            let [p, m, v] = &mut arrays[..] else { break };
            std::thread::scope(|s| {
                for (((p, m), v), g) in p
                    .chunks_mut(per)
                    .zip(m.chunks_mut(per))
                    .zip(v.chunks_mut(per))
                    .zip(g.chunks(per))
                {
                    s.spawn(move || {
                        for i in 0..p.len() {
                            p[i] += g[i];
                            m[i] += g[i];
                            v[i] += g[i];
                        }
                    });
                }
            });
        }
        stream = stream.max((n * 4 * 7) as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        std::thread::scope(|s| {
            for (dst, src) in arrays[0].chunks_mut(per).zip(g.chunks(per)) {
                s.spawn(move || dst.copy_from_slice(src));
            }
        });
        copy = copy.max((n * 4 * 2) as f64 / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&arrays);
    (stream, copy)
}

/// Runs `fsdp bench optimizer`.
pub fn run(a: OptimizerArgs) -> Result<()> {
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    // The update's threads follow candle's count (RAYON_NUM_THREADS): re-run with it set.
    if std::env::var("RAYON_NUM_THREADS").ok() != Some(threads.to_string()) {
        let status = Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env("RAYON_NUM_THREADS", threads.to_string())
            .status()
            .context("re-running with the thread count set")?;
        if !status.success() {
            bail!("optimizer benchmark failed");
        }
        return Ok(());
    }
    let n = a.elements;
    let (stream, copy) = memory_bandwidth(n, threads, 3);
    let mut opt = optimizer(&a.optimizer)?;
    let mut param = noise(n, 1, 2.0);
    let grad = noise(n, 2, 1e-2);
    let mut times = Vec::new();
    for step in 0..a.steps + 2 {
        let t = Instant::now();
        opt.update("shard", &mut param, &grad)?;
        if step >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    std::hint::black_box(&param);
    drop((param, grad, opt));
    let ours = median(times);
    let moved = (n * bytes_per_element(&a.optimizer)) as f64;
    let mut rows = vec![("fsdp-rs".to_string(), ours)];
    if let Some(python) = &a.torch {
        rows.extend(torch(python, &a, threads)?);
    }
    println!(
        "{} step over {n} f32 elements, {threads} thread(s); memory bandwidth {:.1} GB/s (4-read 3-write streams), {:.1} GB/s (copy)",
        a.optimizer,
        stream / 1e9,
        copy / 1e9
    );
    println!(
        "{:<28} {:>10} {:>10} {:>12} {:>12}",
        "implementation", "ms/step", "GB/s", "of stream bw", "ours faster"
    );
    for (name, s) in &rows {
        println!(
            "{name:<28} {:>10.1} {:>10.1} {:>11.0}% {:>11.2}x",
            s * 1e3,
            moved / s / 1e9,
            100.0 * moved / s / stream,
            s / ours
        );
    }
    let json = serde_json::json!({
        "bench": "optimizer",
        "optimizer": a.optimizer,
        "elements": n,
        "threads": threads,
        "bytes_per_step": moved,
        "memory_bandwidth": {"stream_4r3w_bytes_per_s": stream, "copy_bytes_per_s": copy},
        "results": rows.iter().map(|(name, s)| serde_json::json!({
            "implementation": name,
            "seconds_per_step": s,
            "bytes_per_s": moved / s,
            "fraction_of_stream_bandwidth": moved / s / stream,
        })).collect::<Vec<_>>(),
        "ratio_best_torch_over_ours": rows.iter().skip(1).map(|(_, s)| *s).reduce(f64::min).map(|t| t / ours),
    });
    println!("{json}");
    Ok(())
}

/// torch.optim's timings from the anchor script: (variant, median seconds per step).
fn torch(python: &str, a: &OptimizerArgs, threads: usize) -> Result<Vec<(String, f64)>> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tools/bench_optimizer_pytorch.py"
    );
    let out = Command::new(python)
        .arg(script)
        .args(["--elements", &a.elements.to_string()])
        .args(["--steps", &a.steps.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--optimizer", &a.optimizer])
        .output()
        .with_context(|| format!("running {python} {script}"))?;
    if !out.status.success() {
        bail!(
            "{script} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON line from the PyTorch script")?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let results = v["results"].as_object().context("no results")?;
    Ok(results
        .iter()
        .filter_map(|(k, s)| s.as_f64().map(|s| (format!("torch {k}"), s)))
        .collect())
}
