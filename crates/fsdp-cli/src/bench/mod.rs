//! `fsdp bench`: collectives between processes, one BERT layer, FSDP training memory,
//! checkpoints, loading pretrained weights, the optimizer step and training offloaded to disk, each printing a table and machine-readable JSON.

mod checkpoint;
mod collectives;
mod layer;
mod loading;
mod memory;
mod offload;
mod optimizer;
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
    /// Median time and bandwidth of all_reduce, all_gather, reduce_scatter and broadcast
    /// (f32) between local processes, sizes 4 KiB to 64 MiB; prints a table and JSON.
    Collectives(collectives::CollectiveArgs),
    /// One BERT encoder layer, forward and forward+backward, with a per-part breakdown.
    Layer(layer::LayerArgs),
    /// FSDP training of a BERT classifier per sharding strategy: model-state bytes per rank
    /// against the formula, peak above it during forward/backward against the largest unit,
    /// bytes sent per step against theory, samples/s and peak RSS.
    Memory(memory::MemoryArgs),
    /// save_state (sharded and full), load_state and merge-weights of a BERT trained one
    /// step: wall time, memory while saving, checkpoint size.
    Checkpoint(checkpoint::CheckpointArgs),
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
}

/// Runs `fsdp bench ...`.
pub fn run(args: BenchArgs) -> Result<()> {
    match args.what {
        BenchWhat::Collectives(a) => collectives::run(a),
        BenchWhat::Layer(a) => layer::run(a),
        BenchWhat::Memory(a) => memory::run(a),
        BenchWhat::Checkpoint(a) => checkpoint::run(a),
        BenchWhat::Loading(a) => loading::run(a),
        BenchWhat::Optimizer(a) => optimizer::run(a),
        BenchWhat::Offload(a) => offload::run(a),
    }
}
