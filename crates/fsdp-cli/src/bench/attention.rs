//! `fsdp bench attention`: causal grouped-query attention (`ops::grouped_query_attention`,
//! K/V heads read in place, the masked half skipped) against the two ways a model could run it
//! without: the same fused op on K/V repeated to every query head under an additive causal
//! mask (what the engine had before), and transformers' eager formula composed from candle
//! ops (`repeat_kv`, `Q K^T`, mask, softmax, `P V`); and the same sequences laid end to end
//! (`ops::varlen_attention`, packed batches' path), whose cost over the batched call is the
//! packing's. Forward and forward+backward on one CPU thread, or (`--device cuda`, a build
//! with `cuda`) on GPU 0, where the fused ops are fsdp-nn's CUDA kernels; prints a table and
//! one JSON line.

use anyhow::Result;
use clap::Args;
use fsdp::nn::candle::{D, DType, Device, Tensor, Var};
use fsdp::nn::ops::{
    AttentionHeads, PackedSequences, grouped_query_attention, scaled_dot_product_attention,
    varlen_attention,
};

use super::best;

/// Options of `fsdp bench attention`.
#[derive(Args, Clone)]
pub struct AttentionArgs {
    /// Batch size.
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Query heads (SmolLM2-135M's 9).
    #[arg(long, default_value_t = 9)]
    heads: usize,
    /// K/V heads (SmolLM2-135M's 3).
    #[arg(long, default_value_t = 3)]
    kv_heads: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Head size.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// `f32` or `bf16`.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// Timed repetitions (after two warm-ups); the minimum is reported.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// `cpu` (one thread) or `cuda` (GPU 0; a build with the `cuda` feature).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
}

type Attend<'a> = dyn Fn(&Tensor, &Tensor, &Tensor) -> fsdp::nn::candle::Result<Tensor> + 'a;

/// `[b, s, kv * d]` with each K/V head repeated for its query group (`repeat_kv`).
fn repeat_kv(t: &Tensor, a: &AttentionArgs) -> fsdp::nn::candle::Result<Tensor> {
    let group = a.heads / a.kv_heads;
    t.reshape((a.batch, a.seq, a.kv_heads, 1, a.head_dim))?
        .broadcast_as((a.batch, a.seq, a.kv_heads, group, a.head_dim))?
        .contiguous()?
        .reshape((a.batch, a.seq, a.heads * a.head_dim))
}

/// transformers' eager attention from candle ops.
fn eager(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    a: &AttentionArgs,
) -> fsdp::nn::candle::Result<Tensor> {
    let split = |t: &Tensor| {
        t.reshape((a.batch, a.seq, a.heads, a.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (k, v) = (repeat_kv(k, a)?, repeat_kv(v, a)?);
    let scores = (split(q)?.matmul(&split(&k)?.t()?.contiguous()?)? / (a.head_dim as f64).sqrt())?
        .broadcast_add(mask)?;
    let e = scores
        .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
        .exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&split(&v)?)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((a.batch, a.seq, a.heads * a.head_dim))
}

/// Runs `fsdp bench attention`.
pub fn run(a: AttentionArgs) -> Result<()> {
    if super::rerun_as_in_training(1, "attention")? {
        return Ok(());
    }
    anyhow::ensure!(
        a.kv_heads > 0 && a.heads.is_multiple_of(a.kv_heads),
        "--heads {} is not a multiple of --kv_heads {}",
        a.heads,
        a.kv_heads
    );
    let dtype = if a.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let device = match a.device.as_str() {
        "cuda" => fsdp::nn::device::cuda(0)?,
        _ => Device::Cpu,
    };
    let (qw, kw) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    let random = |w: usize| -> Result<Tensor> {
        let t = Tensor::randn(0f32, 1.0, (a.batch, a.seq, w), &Device::Cpu)?;
        Ok(t.to_dtype(dtype)?.to_device(&device)?)
    };
    let input = |w: usize| -> Result<Var> { Ok(Var::from_tensor(&random(w)?)?) };
    let (q, k, v) = (input(qw)?, input(kw)?, input(kw)?);
    let grad_out = random(qw)?;
    let s = a.seq;
    let causal: Vec<f32> = (0..s * s)
        .map(|i| if i % s > i / s { f32::MIN } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(causal, (1, 1, s, s), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(&device)?;
    let heads = AttentionHeads {
        heads: a.heads,
        kv_heads: a.kv_heads,
        causal: true,
    };
    let gqa =
        |q: &Tensor, k: &Tensor, v: &Tensor| grouped_query_attention(q, k, v, heads, None, None);
    let repeated = |q: &Tensor, k: &Tensor, v: &Tensor| {
        scaled_dot_product_attention(
            q,
            &repeat_kv(k, &a)?,
            &repeat_kv(v, &a)?,
            a.heads,
            Some(&mask),
            None,
        )
    };
    let composed = |q: &Tensor, k: &Tensor, v: &Tensor| eager(q, k, v, &mask, &a);
    let seqs = PackedSequences::from_lengths(&vec![s; a.batch], s)?;
    let packed = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let rows = |t: &Tensor| {
            let w = t.dim(2)?;
            t.reshape((a.batch * s, w))
        };
        varlen_attention(&rows(q)?, &rows(k)?, &rows(v)?, heads, &seqs, None)?
            .reshape((a.batch, s, qw))
    };
    // A GPU's work is queued: each timed call waits for it to finish.
    let forward = |f: &Attend| -> Result<()> {
        f(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
        Ok(device.synchronize()?)
    };
    let train = |f: &Attend| -> Result<()> {
        let y = f(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
        let g = (y * &grad_out)?.sum_all()?.backward()?;
        anyhow::ensure!(g.get(&q).is_some(), "no gradient");
        Ok(device.synchronize()?)
    };
    // The loss `sum(y * g)` and its backward, timed alone and taken off the training rows.
    let loss = best(a.reps, || {
        train(&|q: &Tensor, _: &Tensor, _: &Tensor| Ok(q.clone()))
    })?;
    let cases: [(&str, &Attend); 4] = [
        ("grouped-query causal", &gqa),
        ("repeated K/V + causal mask", &repeated),
        ("composed candle ops", &composed),
        ("packed sequences (varlen)", &packed),
    ];
    let mut rows = Vec::new();
    for (name, f) in cases {
        rows.push((
            name,
            best(a.reps, || forward(f))?,
            best(a.reps, || train(f))? - loss,
        ));
    }
    // Useful FLOPs: Q K^T and P V over the causal half (row i has i + 1 keys); training is
    // counted as 3x forward, the convention of model FLOPs.
    let forward_flops = 4.0 * (a.batch * a.heads * a.head_dim) as f64 * (s * (s + 1) / 2) as f64;
    let on = match a.device.as_str() {
        "cuda" => "GPU 0",
        _ => "1 thread",
    };
    println!(
        "causal attention, q [{}, {s}, {} x {}], {} K/V heads, {} ({on})",
        a.batch, a.heads, a.head_dim, a.kv_heads, a.dtype
    );
    println!(
        "  {:<28} {:>10} {:>8} {:>12} {:>8}",
        "", "forward", "GFLOP/s", "fwd+bwd", "GFLOP/s"
    );
    for (name, f, t) in &rows {
        println!(
            "  {name:<28} {:>7.2} ms {:>8.1} {:>9.2} ms {:>8.1}",
            f * 1e3,
            forward_flops / f / 1e9,
            t * 1e3,
            3.0 * forward_flops / t / 1e9
        );
    }
    for other in &rows[1..] {
        println!(
            "  grouped-query causal vs {}: forward {:.2}x faster, forward+backward {:.2}x faster",
            other.0,
            other.1 / rows[0].1,
            other.2 / rows[0].2
        );
    }
    let json = serde_json::json!({
        "bench": "attention",
        "batch": a.batch, "seq": s, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
        "dtype": a.dtype,
        "device": a.device,
        "threads": 1,
        "forward_flops": forward_flops,
        "results": rows.iter().map(|(name, f, t)| serde_json::json!({
            "case": name, "forward_seconds": f, "train_seconds": t,
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
