//! `fsdp bench`: collectives between processes, the GEMMs, one BERT layer, FSDP training memory,
//! checkpoints and their resharding, loading pretrained weights, the optimizer step, training offloaded to disk, QLoRA, the
//! rotary embedding, causal grouped-query attention and SwiGLU ops, each printing a table and machine-readable JSON.

mod attention;
mod checkpoint;
mod collectives;
mod gemm;
mod layer;
mod loading;
mod memory;
mod offload;
mod optimizer;
mod qlora;
mod reshard;
mod rope;
mod swiglu;
mod workers;

use anyhow::Result;
use clap::{Args, Subcommand};

/// Run benchmarks.
#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Median time and bandwidth of all_reduce, all_gather (out of place and in place),
    /// reduce_scatter, all_to_all and broadcast (f32) between local processes, sizes 4 KiB to 64 MiB; prints a table and JSON.
    Collectives(collectives::CollectiveArgs),
    /// The engine's matrix products as layers call them (forward, both backward products) on
    /// square and transformer shapes, f32 or bf16, one thread: GFLOP/s and % of the core's
    /// instruction peak.
    Gemm(gemm::GemmArgs),
    /// One BERT encoder layer, forward and forward+backward, with a per-part breakdown.
    Layer(layer::LayerArgs),
    /// FSDP training of a BERT classifier per sharding strategy: model-state bytes per rank
    /// against the formula, peak above it during forward/backward against the largest unit,
    /// bytes sent per step against theory, samples/s and peak RSS.
    Memory(memory::MemoryArgs),
    /// save_state (sharded and full), load_state and merge-weights of a BERT trained one
    /// step: wall time, memory while saving, checkpoint size.
    Checkpoint(checkpoint::CheckpointArgs),
    /// A sharded checkpoint saved by one number of processes and loaded by others (16 → 8
    /// and 32): load time, heap and bytes read per rank against its share.
    Reshard(reshard::ReshardArgs),
    /// Building the sharded model from a pretrained safetensors file, every rank reading it
    /// against fsdp_cpu_ram_efficient_loading: per-rank peak memory, seconds, equality.
    Loading(loading::LoadingArgs),
    /// One optimizer step over a rank's shard (100 M elements) against this machine's memory
    /// bandwidth and, with --torch, torch.optim's implementations on the same shard.
    Optimizer(optimizer::OptimizerArgs),
    /// GPT-2-shaped FSDP training (GPT-2 XL by default) with parameters, gradients and AdamW
    /// state offloaded to disk and/or in memory: seconds and bytes per step, disk bandwidth
    /// against the disk's own, peak RSS per rank, losses compared.
    Offload(offload::OffloadArgs),
    /// LoRA on a Llama-shaped model (Llama-2-7B's by default) whose linear layers are kept
    /// quantized (NF4 by default) and sharded: seconds and tokens per step, peak RSS per
    /// rank, bytes stored and all-gathered per rank against f32 and bf16.
    Qlora(qlora::QloraArgs),
    /// The fused rotary position embedding against transformers' formula composed from
    /// candle ops, forward and forward+backward, one thread.
    Rope(rope::RopeArgs),
    /// Causal grouped-query attention against the fused op on repeated K/V under a causal
    /// mask and against the formula composed from candle ops, one thread.
    Attention(attention::AttentionArgs),
    /// The fused `silu(gate) * up` against the formula composed from candle ops, one thread.
    Swiglu(swiglu::SwigluArgs),
}

/// Runs `fsdp bench ...`.
pub fn run(args: BenchArgs) -> Result<()> {
    match args.what {
        BenchWhat::Collectives(a) => collectives::run(a),
        BenchWhat::Gemm(a) => gemm::run(a),
        BenchWhat::Layer(a) => layer::run(a),
        BenchWhat::Memory(a) => memory::run(a),
        BenchWhat::Checkpoint(a) => checkpoint::run(a),
        BenchWhat::Reshard(a) => reshard::run(a),
        BenchWhat::Loading(a) => loading::run(a),
        BenchWhat::Optimizer(a) => optimizer::run(a),
        BenchWhat::Offload(a) => offload::run(a),
        BenchWhat::Qlora(a) => qlora::run(a),
        BenchWhat::Rope(a) => rope::run(a),
        BenchWhat::Attention(a) => attention::run(a),
        BenchWhat::Swiglu(a) => swiglu::run(a),
    }
}

/// Kernels timed as training runs them: on `threads` threads (candle sizes its thread pools
/// from `RAYON_NUM_THREADS` at first use, so the benchmark re-runs itself with it set), with
/// glibc keeping freed memory as a training process does
/// ([`fsdp::memory::retain_freed_memory`]; with glibc's defaults, a kernel's fresh outputs of
/// 128 KiB and more were faulted in anew at every call). True when that run was made (and
/// succeeded), false when this is that run.
fn rerun_as_in_training(threads: usize, what: &str) -> Result<bool> {
    if std::env::var("RAYON_NUM_THREADS").ok() == Some(threads.to_string()) {
        fsdp::memory::retain_freed_memory();
        return Ok(false);
    }
    let status = std::process::Command::new(std::env::current_exe()?)
        .args(std::env::args_os().skip(1))
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("CANDLE_NUM_THREADS", threads.to_string())
        .status()
        .map_err(|e| {
            anyhow::anyhow!("re-running the {what} benchmark with the thread count set: {e}")
        })?;
    anyhow::ensure!(status.success(), "{what} benchmark failed");
    Ok(true)
}

/// The minimum over `reps` repetitions (after two warm-ups) of the time each call of `f`
/// measures itself and returns: for a part of a repetition timed alone (a backward pass
/// without the forward that builds its graph).
fn best_timed(reps: usize, mut f: impl FnMut() -> Result<std::time::Duration>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for i in 0..reps + 2 {
        let took = f()?;
        if i >= 2 {
            best = best.min(took.as_secs_f64());
        }
    }
    Ok(best)
}

/// Minimum seconds of `f` over `reps` runs after two warm-ups (the kernel benchmarks' timer).
fn best(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    best_timed(reps, || {
        let started = std::time::Instant::now();
        f()?;
        Ok(started.elapsed())
    })
}

/// The BERT a benchmark builds (the reference BERT by default; BERT-base with
/// `--hidden 768 --layers 12 --vocab 30522`).
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct BertShape {
    /// Hidden size (the reference BERT: 256; BERT-base: 768).
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Encoder layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 8192)]
    pub vocab: usize,
}

impl BertShape {
    /// The flags that give a benchmark's worker the same shape.
    pub fn flags(&self) -> Vec<String> {
        [
            ("--hidden", self.hidden),
            ("--layers", self.layers),
            ("--vocab", self.vocab),
        ]
        .into_iter()
        .flat_map(|(flag, n)| [flag.to_string(), n.to_string()])
        .collect()
    }
}

impl std::fmt::Display for BertShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BERT hidden {} x {} layers, vocab {}",
            self.hidden, self.layers, self.vocab
        )
    }
}

/// Rank `rank`'s token ids `[batch, seq]` of step `step` below `vocab`, drawn from a xorshift
/// stream keyed by both (the training benchmarks' batches: every rank its own, every run
/// the same).
fn random_ids(
    rank: usize,
    step: usize,
    (batch, seq): (usize, usize),
    vocab: u64,
) -> Result<fsdp::nn::candle::Tensor> {
    let mut rng =
        fsdp::rng::XorShift64::new(fsdp::rng::GOLDEN_GAMMA ^ ((rank as u64) << 32 | step as u64));
    let ids: Vec<u32> = (0..batch * seq)
        .map(|_| (rng.next_u64() % vocab) as u32)
        .collect();
    Ok(fsdp::nn::candle::Tensor::from_vec(
        ids,
        (batch, seq),
        &fsdp::nn::candle::Device::Cpu,
    )?)
}
