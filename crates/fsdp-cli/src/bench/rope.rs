//! `fsdp bench rope`: the fused rotary embedding (`ops::rope`, one pass forward and one
//! backward) against transformers' formula composed from candle ops (`x * cos +
//! cat(-x2, x1) * sin`, what a model without the op would run), forward and
//! forward+backward, on one thread; prints a table and one JSON line.

use anyhow::Result;
use clap::Args;
use fsdp::nn::candle::{DType, Device, Tensor, Var};
use fsdp::nn::ops::{RopeTable, rope};

use super::best;

/// Options of `fsdp bench rope`.
#[derive(Args, Clone)]
pub struct RopeArgs {
    /// Batch size.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 9)]
    heads: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Head size (SmolLM2-135M's 64).
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// `f32` or `bf16`.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// Timed repetitions (after two warm-ups); the minimum is reported.
    #[arg(long, default_value_t = 20)]
    reps: usize,
}

/// transformers' `apply_rotary_pos_emb` from candle ops.
fn composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> fsdp::nn::candle::Result<Tensor> {
    let d = x.dim(3)?;
    let (x1, x2) = (x.narrow(3, 0, d / 2)?, x.narrow(3, d / 2, d / 2)?);
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// Runs `fsdp bench rope`.
pub fn run(a: RopeArgs) -> Result<()> {
    if super::rerun_as_in_training(1, "rope")? {
        return Ok(());
    }
    let dtype = if a.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let dims = (a.batch, a.heads, a.seq, a.head_dim);
    let x = Tensor::randn(0f32, 1.0, dims, &Device::Cpu)?.to_dtype(dtype)?;
    let table = RopeTable::new(a.head_dim, 10000.0, None)?;
    let positions: Vec<u32> = (0..a.seq as u32).collect();
    // The composed formula's cos and sin [1, 1, seq, head_dim], made once (as a model caches
    // them); the fused op makes its angles on each call, and that time is counted.
    let angles: Vec<f32> = positions
        .iter()
        .flat_map(|&p| table.inv_freq.iter().map(move |f| f * p as f32))
        .collect();
    let half = Tensor::from_vec(angles, (1, 1, a.seq, a.head_dim / 2), &Device::Cpu)?;
    let full = Tensor::cat(&[&half, &half], 3)?;
    let (cos, sin) = (full.cos()?.to_dtype(dtype)?, full.sin()?.to_dtype(dtype)?);
    let var = Var::from_tensor(&x)?;
    let grad_out = Tensor::randn(0f32, 1.0, dims, &Device::Cpu)?.to_dtype(dtype)?;
    let train = |f: &dyn Fn(&Tensor) -> fsdp::nn::candle::Result<Tensor>| -> Result<()> {
        let y = f(var.as_tensor())?;
        let g = (y * &grad_out)?.sum_all()?.backward()?;
        anyhow::ensure!(g.get(&var).is_some(), "no gradient");
        Ok(())
    };
    let fused = |x: &Tensor| rope(x, &table, &positions);
    let plain = |x: &Tensor| composed(x, &cos, &sin);
    // The loss `sum(y * g)` and its backward, timed alone and taken off the
    // forward+backward rows, so they compare the rotations only.
    let loss = best(a.reps, || train(&|x: &Tensor| Ok(x.clone())))?;
    let rows = [
        (
            "fused forward",
            best(a.reps, || {
                fused(&x)?;
                Ok(())
            })?,
        ),
        (
            "composed forward",
            best(a.reps, || {
                plain(&x)?;
                Ok(())
            })?,
        ),
        (
            "fused forward+backward",
            best(a.reps, || train(&fused))? - loss,
        ),
        (
            "composed forward+backward",
            best(a.reps, || train(&plain))? - loss,
        ),
    ];
    let bytes = x.elem_count() * dtype.size_in_bytes();
    println!(
        "rope on [{}, {}, {}, {}] {} (1 thread): {:.1} MiB",
        a.batch,
        a.heads,
        a.seq,
        a.head_dim,
        a.dtype,
        bytes as f64 / (1 << 20) as f64
    );
    for (name, s) in &rows {
        println!(
            "  {name:<27} {:>8.3} ms  {:>6.2} GB/s of x",
            s * 1e3,
            bytes as f64 / s / 1e9
        );
    }
    println!(
        "  fused / composed: forward {:.2}x faster, forward+backward {:.2}x faster",
        rows[1].1 / rows[0].1,
        rows[3].1 / rows[2].1
    );
    let json = serde_json::json!({
        "bench": "rope",
        "shape": [a.batch, a.heads, a.seq, a.head_dim],
        "dtype": a.dtype,
        "threads": 1,
        "results": rows.iter().map(|(name, s)| serde_json::json!({"case": name, "seconds": s})).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
