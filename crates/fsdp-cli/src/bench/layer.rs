//! `fsdp bench layer`: one BERT encoder layer, forward and forward+backward, on a fixed
//! number of threads, with a per-component breakdown; prints a table and JSON.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use fsdp::models::{BertConfig, BertModel};
use fsdp::nn::candle::{
    CpuStorage, CustomOp1, DType, Device, Layout, Shape, Storage, Tensor, Var,
    backend::BackendStorage,
};
use fsdp::nn::layers::Linear;
use fsdp::nn::ops::{GeluApprox, scaled_dot_product_attention};
use fsdp::nn::{Forward, LocalParams, Module, Params};

/// Options of `fsdp bench layer`.
#[derive(Args, Clone)]
pub struct LayerArgs {
    /// Batch size.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Feed-forward size.
    #[arg(long, default_value_t = 1024)]
    intermediate: usize,
    /// Compute threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Timed repetitions (after two warm-ups).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Time the whole layer only (no per-part breakdown).
    #[arg(long)]
    layer_only: bool,
    /// Parameters and activations in `f32`, or `bf16` (mixed precision's compute dtype;
    /// implies --layer-only).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
}

fn config(a: &LayerArgs) -> BertConfig {
    BertConfig {
        vocab_size: 16,
        hidden_size: a.hidden,
        num_hidden_layers: 1,
        num_attention_heads: a.heads,
        intermediate_size: a.intermediate,
        max_position_embeddings: a.seq,
        ..BertConfig::default()
    }
}

/// Back-propagates from `y` with output gradient `w`, like PyTorch's `y.backward(w)`: the
/// op's value is `sum(y * w)` and its backward hands `w` to `y` as is, so the timing holds the
/// layer's backward and no loss arithmetic.
struct SeedGradient(Tensor);

impl CustomOp1 for SeedGradient {
    fn name(&self) -> &'static str {
        "seed-gradient"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> fsdp::nn::candle::Result<(CpuStorage, Shape)> {
        if let CpuStorage::BF16(_) = s {
            // bf16 runs: the value is not used; only the seeded backward is timed.
            let zero = Tensor::zeros((), DType::BF16, &Device::Cpu)?;
            let (storage, _) = zero.storage_and_layout();
            if let Storage::Cpu(z) = &*storage {
                return Ok((z.clone(), Shape::from(())));
            }
        }
        let (CpuStorage::F32(y), Some((start, end))) = (s, l.contiguous_offsets()) else {
            return Err(fsdp::nn::candle::Error::Msg(format!(
                "seed-gradient: contiguous f32 expected, got {:?}",
                s.dtype()
            )));
        };
        // Read `w` in place: a copy would be timed with the layer.
        let (ws, wl) = self.0.storage_and_layout();
        let (Storage::Cpu(CpuStorage::F32(w)), Some((ws_start, ws_end))) =
            (&*ws, wl.contiguous_offsets())
        else {
            return Err(fsdp::nn::candle::Error::Msg(
                "seed-gradient: the gradient must be a contiguous f32 CPU tensor".into(),
            ));
        };
        let dot: f32 = y[start..end]
            .iter()
            .zip(&w[ws_start..ws_end])
            .map(|(a, b)| a * b)
            .sum();
        Ok((CpuStorage::F32(vec![dot]), Shape::from(())))
    }

    fn bwd(
        &self,
        _y: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> fsdp::nn::candle::Result<Option<Tensor>> {
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        Ok(Some(if g == 1.0 {
            self.0.clone()
        } else {
            (&self.0 * g as f64)?
        }))
    }
}

/// Runs backward from `y` with output gradient `w` (see [`SeedGradient`]).
fn backward_with(y: &Tensor, w: &Tensor) -> Result<()> {
    y.contiguous()?
        .apply_op1(SeedGradient(w.clone()))?
        .backward()?;
    Ok(())
}

/// (median, min) in milliseconds of `reps` runs of `f` after two warm-ups.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    f()?;
    f()?;
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok((ms[ms.len() / 2], ms[0]))
}

/// Runs `fsdp bench layer`.
pub fn run(a: LayerArgs) -> Result<()> {
    if super::rerun_as_in_training(a.threads, "layer")? {
        return Ok(());
    }
    let device = Device::Cpu;
    let model = BertModel::new(config(&a), "")?;
    let dtype = if a.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let params = LocalParams::init(&model.info(), 0, dtype, &device)?;
    let l = &model.encoder.layer[0];
    let x = Var::from_tensor(
        &(Tensor::randn(0f32, 1.0, (a.batch, a.seq, a.hidden), &device)?.to_dtype(dtype)?),
    )?;
    let p: &dyn Params = &params;
    let x_t = x.as_tensor().clone();
    let w = Tensor::randn(0f32, 1.0, (a.batch, a.seq, a.hidden), &device)?.to_dtype(dtype)?;

    let mut rows: Vec<(String, f64, f64, f64, f64)> = Vec::new();
    let unmasked = fsdp::models::bert::TokenLayout::Padded(None);
    let layer = |t: &Tensor| {
        l.forward(p, (t, &unmasked, None))
            .map_err(anyhow::Error::from)
    };
    let (fwd_med, fwd_min) = time(a.reps, || layer(&x_t).map(|_| ()))?;
    let (all_med, all_min) = time(a.reps, || {
        let y = layer(&x_t)?;
        backward_with(&y, &w)?;
        Ok(())
    })?;
    rows.push(("layer".into(), fwd_med, fwd_min, all_med, all_min));
    if a.layer_only || dtype != DType::F32 {
        return report(&a, &rows);
    }

    // Components, each measured alone on inputs of the shapes the layer gives it.
    let (b, s, h, i) = (a.batch, a.seq, a.hidden, a.intermediate);
    let rand = |dims: &[usize]| -> Result<Var> {
        Ok(Var::from_tensor(&Tensor::randn(0f32, 1.0, dims, &device)?)?)
    };
    let xh = rand(&[b, s, h])?;
    let xi = rand(&[b, s, i])?;
    let qkv = [rand(&[b, s, h])?, rand(&[b, s, h])?, rand(&[b, s, h])?];
    // The intermediate projection without its fused GELU, on the same weights.
    let plain_intermediate = Linear::new("encoder.layer.0.intermediate.dense".into(), h, i, 0.02);
    type Part<'a> = (&'static str, Box<dyn Fn() -> Result<Tensor> + 'a>);
    let parts: Vec<Part> = vec![
        (
            "3 x linear h->h (query, key, value)",
            Box::new(|| {
                let mut acc: Option<Tensor> = None;
                let sa = &l.attention.self_attention;
                for proj in [&sa.query, &sa.key, &sa.value] {
                    let y = proj.forward(p, xh.as_tensor())?;
                    acc = Some(match acc {
                        None => y,
                        Some(a) => (a + y)?,
                    });
                }
                acc.context("no projections")
            }),
        ),
        (
            "linear h->h (attention output)",
            Box::new(|| Ok(l.attention.output.dense.forward(p, xh.as_tensor())?)),
        ),
        (
            "attention (scores, softmax, context)",
            Box::new(|| {
                let [q, k, v] = &qkv;
                Ok(scaled_dot_product_attention(
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    a.heads,
                    None,
                    None,
                )?)
            }),
        ),
        (
            "linear h->i + gelu",
            Box::new(|| Ok(l.intermediate.dense.forward(p, xh.as_tensor())?)),
        ),
        (
            "  of which: linear h->i",
            Box::new(|| Ok(plain_intermediate.forward(p, xh.as_tensor())?)),
        ),
        (
            "  of which: gelu",
            Box::new(|| Ok(fsdp::nn::ops::gelu(xi.as_tensor(), GeluApprox::Erf)?)),
        ),
        (
            "linear i->h",
            Box::new(|| Ok(l.output.dense.forward(p, xi.as_tensor())?)),
        ),
        (
            "2 x residual add + layer_norm",
            Box::new(|| {
                let y = l
                    .attention
                    .output
                    .layer_norm
                    .forward(p, (xh.as_tensor(), xh.as_tensor()))?;
                Ok(l.output.layer_norm.forward(p, (&y, xh.as_tensor()))?)
            }),
        ),
    ];
    for (name, f) in &parts {
        let (fm, fmin) = time(a.reps, || f().map(|_| ()))?;
        let (am, amin) = time(a.reps, || {
            let y = f()?;
            backward_with(&y, &Tensor::ones_like(&y)?)?;
            Ok(())
        })?;
        rows.push((name.to_string(), fm, fmin, am, amin));
    }
    report(&a, &rows)
}

/// Prints the table and the JSON line.
fn report(a: &LayerArgs, rows: &[(String, f64, f64, f64, f64)]) -> Result<()> {
    println!(
        "one BERT layer, {}, batch {} seq {} hidden {} heads {} intermediate {}, {} thread(s)",
        a.dtype, a.batch, a.seq, a.hidden, a.heads, a.intermediate, a.threads
    );
    println!(
        "{:<38} {:>10} {:>10} {:>12} {:>12}",
        "part", "fwd_med", "fwd_min", "fwd+bwd_med", "fwd+bwd_min"
    );
    for (name, fm, fmin, am, amin) in rows {
        println!("{name:<38} {fm:>8.2}ms {fmin:>8.2}ms {am:>10.2}ms {amin:>10.2}ms");
    }
    let json = serde_json::json!({
        "benchmark": "layer",
        "shape": {"batch": a.batch, "seq": a.seq, "hidden": a.hidden, "heads": a.heads, "intermediate": a.intermediate},
        "dtype": a.dtype,
        "threads": a.threads,
        "reps": a.reps,
        "results": rows.iter().map(|(name, fm, fmin, am, amin)| serde_json::json!({
            "part": name, "forward_median_ms": fm, "forward_min_ms": fmin,
            "forward_backward_median_ms": am, "forward_backward_min_ms": amin,
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
