//! `fsdp bench gemm`: the engine's matrix products as the layers call them (`ops::linear_no_bias`:
//! forward `x Wᵀ`, backward `dY W` and `dYᵀ x`), on square and transformer shapes, in f32
//! or bf16 on one thread: GFLOP/s and the share of this core's instruction peak
//! (`fsdp::perf::instruction_peak`); prints a table and one JSON line.

use anyhow::Result;
use clap::Args;
use fsdp::nn::candle::{DType, Device, Tensor, Var};
use fsdp::nn::ops::linear_no_bias;

use super::best;

/// Options of `fsdp bench gemm`.
#[derive(Args, Clone)]
pub struct GemmArgs {
    /// `f32` or `bf16`.
    #[arg(long, default_value = "bf16", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// Timed repetitions (after two warm-ups); the minimum is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Only these shapes, as `TOKENSxOUTxIN` (comma-separated); the default set otherwise.
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<String>,
}

/// A product as a layer computes it: `tokens` rows through a weight `[out, in]`.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    tokens: usize,
    out: usize,
    inp: usize,
}

/// Square products, then the reference BERT's (1024 tokens, hidden 256, feed-forward 1024),
/// BERT-base's and SmolLM2-135M's (hidden 576, 9/3 heads of 64, MLP 1536, 2048 tokens).
const SHAPES: &[Shape] = &[
    Shape {
        name: "square 256",
        tokens: 256,
        out: 256,
        inp: 256,
    },
    Shape {
        name: "square 512",
        tokens: 512,
        out: 512,
        inp: 512,
    },
    Shape {
        name: "square 1024",
        tokens: 1024,
        out: 1024,
        inp: 1024,
    },
    Shape {
        name: "square 2048",
        tokens: 2048,
        out: 2048,
        inp: 2048,
    },
    Shape {
        name: "BERT ref qkv/out",
        tokens: 1024,
        out: 256,
        inp: 256,
    },
    Shape {
        name: "BERT ref up",
        tokens: 1024,
        out: 1024,
        inp: 256,
    },
    Shape {
        name: "BERT ref down",
        tokens: 1024,
        out: 256,
        inp: 1024,
    },
    Shape {
        name: "BERT-base qkv/out",
        tokens: 512,
        out: 768,
        inp: 768,
    },
    Shape {
        name: "BERT-base up",
        tokens: 512,
        out: 3072,
        inp: 768,
    },
    Shape {
        name: "BERT-base down",
        tokens: 512,
        out: 768,
        inp: 3072,
    },
    Shape {
        name: "SmolLM2 q/o",
        tokens: 2048,
        out: 576,
        inp: 576,
    },
    Shape {
        name: "SmolLM2 k/v",
        tokens: 2048,
        out: 192,
        inp: 576,
    },
    Shape {
        name: "SmolLM2 gate/up",
        tokens: 2048,
        out: 1536,
        inp: 576,
    },
    Shape {
        name: "SmolLM2 down",
        tokens: 2048,
        out: 576,
        inp: 1536,
    },
];

fn parse_shape(s: &str) -> Result<Shape> {
    let dims: Vec<usize> = s
        .split('x')
        .map(|d| d.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("--shapes {s:?}: {e} (expected TOKENSxOUTxIN)"))?;
    let [tokens, out, inp] = dims[..] else {
        anyhow::bail!("--shapes {s:?}: expected three sizes, TOKENSxOUTxIN");
    };
    anyhow::ensure!(
        tokens > 0 && out > 0 && inp > 0,
        "--shapes {s:?}: sizes must be positive"
    );
    Ok(Shape {
        name: "custom",
        tokens,
        out,
        inp,
    })
}

/// Runs `fsdp bench gemm`.
pub fn run(a: GemmArgs) -> Result<()> {
    if super::rerun_as_in_training(1, "gemm")? {
        return Ok(());
    }
    let dtype = if a.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let shapes = if a.shapes.is_empty() {
        SHAPES.to_vec()
    } else {
        a.shapes
            .iter()
            .map(|s| parse_shape(s))
            .collect::<Result<_>>()?
    };
    let peak = fsdp::perf::instruction_peak().for_dtype(dtype);
    let kernel = if dtype == DType::BF16 {
        fsdp::nn::ops::bf16_matmul_kernel()
    } else {
        fsdp::nn::ops::f32_matmul_kernel()
    };
    println!(
        "{} products on 1 thread ({kernel}); instruction peak {:.1} GFLOP/s",
        a.dtype,
        peak / 1e9
    );
    println!(
        "  {:<20} {:>16}  {:>9} {:>6}  {:>9} {:>6}",
        "shape", "tokens x out x in", "fwd GF/s", "%peak", "bwd GF/s", "%peak"
    );
    let mut rows = Vec::new();
    for s in &shapes {
        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (s.tokens, s.inp), &Device::Cpu)?.to_dtype(dtype)?,
        )?;
        let w = Var::from_tensor(
            &Tensor::randn(0f32, 0.05, (s.out, s.inp), &Device::Cpu)?.to_dtype(dtype)?,
        )?;
        let forward = best(a.reps, || {
            linear_no_bias(x.as_tensor(), w.as_tensor())?;
            Ok(())
        })?;
        // Backward from the product itself: candle seeds it with ones (a fill of the output,
        // the only work besides the two products dX = dY W and dW = dYᵀ x). Timed alone in
        // each repetition: the difference of two minima (forward + backward, forward) came
        // near zero when the forward's fastest run was slower than the pair's.
        let backward = super::best_timed(a.reps, || {
            let y = linear_no_bias(x.as_tensor(), w.as_tensor())?;
            let started = std::time::Instant::now();
            let g = y.backward()?;
            let took = started.elapsed();
            anyhow::ensure!(g.get(&x).is_some() && g.get(&w).is_some(), "no gradient");
            Ok(took)
        })?;
        let flops = 2.0 * (s.tokens * s.out * s.inp) as f64;
        let (fwd_rate, bwd_rate) = (flops / forward, 2.0 * flops / backward);
        println!(
            "  {:<20} {:>16}  {:>9.1} {:>5.1}%  {:>9.1} {:>5.1}%",
            s.name,
            format!("{}x{}x{}", s.tokens, s.out, s.inp),
            fwd_rate / 1e9,
            100.0 * fwd_rate / peak,
            bwd_rate / 1e9,
            100.0 * bwd_rate / peak
        );
        rows.push(serde_json::json!({
            "shape": s.name, "tokens": s.tokens, "out": s.out, "in": s.inp,
            "forward_seconds": forward, "backward_seconds": backward,
            "forward_gflops": fwd_rate / 1e9, "backward_gflops": bwd_rate / 1e9,
        }));
    }
    let json = serde_json::json!({
        "bench": "gemm",
        "dtype": a.dtype,
        "threads": 1,
        "kernel": kernel,
        "instruction_peak_gflops": peak / 1e9,
        "results": rows,
    });
    println!("{json}");
    Ok(())
}
