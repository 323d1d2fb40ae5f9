//! `fsdp bench swiglu`: the fused `silu(gate) * up` (`ops::swiglu`) against the same formula
//! composed from candle ops (`gate * sigmoid(gate) * up`), forward and forward+backward, on
//! one thread; prints a table and one JSON line.

use anyhow::Result;
use clap::Args;
use fsdp::nn::candle::{DType, Device, Tensor, Var};
use fsdp::nn::ops::swiglu;

use super::best;

/// Options of `fsdp bench swiglu`.
#[derive(Args, Clone)]
pub struct SwigluArgs {
    /// Tokens (batch x sequence).
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// MLP width (SmolLM2-135M's `intermediate_size` 1536).
    #[arg(long, default_value_t = 1536)]
    intermediate: usize,
    /// `f32` or `bf16`.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// Timed repetitions (after two warm-ups); the minimum is reported.
    #[arg(long, default_value_t = 20)]
    reps: usize,
}

type Gated<'a> = dyn Fn(&Tensor, &Tensor) -> fsdp::nn::candle::Result<Tensor> + 'a;

/// Runs `fsdp bench swiglu`.
pub fn run(a: SwigluArgs) -> Result<()> {
    if super::rerun_as_in_training(1, "swiglu")? {
        return Ok(());
    }
    let dtype = if a.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let dims = (a.tokens, a.intermediate);
    let input = || -> Result<Var> {
        let t = Tensor::randn(0f32, 2.0, dims, &Device::Cpu)?.to_dtype(dtype)?;
        Ok(Var::from_tensor(&t)?)
    };
    let (gate, up) = (input()?, input()?);
    let grad_out = Tensor::randn(0f32, 1.0, dims, &Device::Cpu)?.to_dtype(dtype)?;
    let fused = |g: &Tensor, u: &Tensor| swiglu(g, u);
    let composed = |g: &Tensor, u: &Tensor| {
        let sigmoid = ((g.neg()?.exp()? + 1.0)?).recip()?;
        (g * sigmoid)? * u
    };
    let train = |f: &Gated| -> Result<()> {
        let y = f(gate.as_tensor(), up.as_tensor())?;
        let g = (y * &grad_out)?.sum_all()?.backward()?;
        anyhow::ensure!(g.get(&gate).is_some(), "no gradient");
        Ok(())
    };
    // The loss `sum(y * g)` and its backward, timed alone and taken off the training rows.
    let loss = best(a.reps, || train(&|g: &Tensor, _: &Tensor| Ok(g.clone())))?;
    let cases: [(&str, &Gated); 2] = [("fused", &fused), ("composed candle ops", &composed)];
    let mut rows = Vec::new();
    for (name, f) in cases {
        let forward = best(a.reps, || {
            f(gate.as_tensor(), up.as_tensor())?;
            Ok(())
        })?;
        rows.push((name, forward, best(a.reps, || train(f))? - loss));
    }
    let bytes = 3 * a.tokens * a.intermediate * dtype.size_in_bytes();
    println!(
        "swiglu on [{}, {}] {} (1 thread), forward moves {:.1} MiB",
        a.tokens,
        a.intermediate,
        a.dtype,
        bytes as f64 / (1 << 20) as f64
    );
    for (name, f, t) in &rows {
        println!(
            "  {name:<20} forward {:>7.3} ms ({:>5.2} GB/s)  forward+backward {:>7.3} ms",
            f * 1e3,
            bytes as f64 / f / 1e9,
            t * 1e3
        );
    }
    println!(
        "  fused / composed: forward {:.2}x faster, forward+backward {:.2}x faster",
        rows[1].1 / rows[0].1,
        rows[1].2 / rows[0].2
    );
    let json = serde_json::json!({
        "bench": "swiglu",
        "shape": [a.tokens, a.intermediate],
        "dtype": a.dtype,
        "threads": 1,
        "results": rows.iter().map(|(name, f, t)| serde_json::json!({
            "case": name, "forward_seconds": f, "train_seconds": t,
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
