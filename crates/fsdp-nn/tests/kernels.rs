//! Every fused op against the same math composed from plain candle ops (values and
//! gradients, each element held to its own size: f64 tight, f32 within 1e-5) and against
//! central finite differences (f64).

use candle_core::{D, DType, Device, Result, Tensor, Var};
use fsdp_nn::ops::{self, CrossEntropy, GeluApprox, Reduction};

#[path = "support/numerics.rs"]
mod numerics;
/// Kernels write their results into reserved, uninitialised memory: allocations start as
/// garbage here, so an element a kernel never wrote cannot pass as a fresh page's zero.
#[path = "../../fsdp/tests/common/poisoned.rs"]
mod poisoned;
use numerics::{Fun, eval, max_rel_diff, per_element_error, rand, weighted};

/// The comparison holds each element to its own size: an error of half the tolerance times
/// the largest element, put on the smallest element, fails it (scaling every error by the
/// largest element, as this file once did, let it pass), while the same error on the
/// largest element passes.
#[test]
fn errors_are_measured_per_element() {
    // Many small elements and a few large ones, as a layer's outputs and gradients have.
    let b: Vec<f64> = (0..64)
        .map(|i| match i % 16 {
            0 => 4.0 - i as f64 / 16.0,
            _ => ((i * 37 % 64) as f64 - 31.5) / 400.0,
        })
        .collect();
    let max = b.iter().fold(0f64, |m, v| m.max(v.abs()));
    let tol = 1e-5;
    let smallest = (0..b.len())
        .min_by(|&i, &j| b[i].abs().total_cmp(&b[j].abs()))
        .unwrap();
    let largest = (0..b.len())
        .max_by(|&i, &j| b[i].abs().total_cmp(&b[j].abs()))
        .unwrap();
    let mut a = b.clone();
    a[smallest] += 0.5 * tol * max;
    let by_largest = a
        .iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs() / max));
    assert!(by_largest < tol, "the old measure let it pass");
    assert!(
        per_element_error(&a, &b) > tol,
        "a wrong small element passed"
    );
    let mut a = b.clone();
    a[largest] += 0.5 * tol * max;
    assert!(per_element_error(&a, &b) < tol);
}

/// Fused `fused` vs composed `reference`, values and gradients.
fn against_composed(name: &str, fused: &Fun<'_>, reference: &Fun<'_>, inputs: &[Tensor], tol: f64) {
    let (out_a, g_a) = eval(fused, inputs);
    let (out_b, g_b) = eval(reference, inputs);
    let d = max_rel_diff(&out_a, &out_b);
    assert!(d < tol, "{name}: value differs by {d:e} (tol {tol:e})");
    for (i, (a, b)) in g_a.iter().zip(&g_b).enumerate() {
        let d = max_rel_diff(a, b);
        assert!(
            d < tol,
            "{name}: gradient of input {i} differs by {d:e} (tol {tol:e})"
        );
    }
}

/// Analytic gradients vs central differences at a sample of positions (f64).
fn against_finite_differences(name: &str, f: &Fun<'_>, inputs: &[Tensor]) {
    let (_, grads) = eval(f, inputs);
    let h = 1e-6;
    for (i, input) in inputs.iter().enumerate() {
        let base: Vec<f64> = input.flatten_all().unwrap().to_vec1().unwrap();
        let analytic: Vec<f64> = grads[i].flatten_all().unwrap().to_vec1().unwrap();
        let step = (base.len() / 23).max(1);
        for k in (0..base.len()).step_by(step) {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[k] += delta;
                let mut ins = inputs.to_vec();
                ins[i] = Tensor::from_vec(v, input.dims(), &Device::Cpu).unwrap();
                weighted(f, &ins, 99).unwrap().to_scalar::<f64>().unwrap()
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            let err =
                (numeric - analytic[k]).abs() / numeric.abs().max(analytic[k].abs()).max(1e-3);
            assert!(
                err < 1e-6,
                "{name}: input {i} element {k}: analytic {} vs numeric {numeric} (rel {err:e})",
                analytic[k]
            );
        }
    }
}

fn composed_gelu_erf(x: &Tensor) -> Result<Tensor> {
    // x * Phi(x), with Phi from exp-based erf-free pieces: use candle's erf (differentiable).
    let phi = ((x / std::f64::consts::SQRT_2)?.erf()? + 1.0)? * 0.5;
    x * phi?
}

fn composed_gelu_tanh(x: &Tensor) -> Result<Tensor> {
    let inner = ((x + (x.powf(3.0)? * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?;
    (x * 0.5)? * (inner.tanh()? + 1.0)?
}

fn composed_softmax(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

fn composed_layer_norm(x: &Tensor, g: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(g)?
        .broadcast_add(b)
}

fn composed_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

fn composed_cross_entropy(logits: &Tensor, targets: &[i64], s: CrossEntropy) -> Result<Tensor> {
    let (_, c) = logits.dims2()?;
    let logp = logits.broadcast_sub(&composed_lse(logits)?)?;
    let mut terms = Vec::new();
    for (row, &t) in targets.iter().enumerate() {
        if t == s.ignore_index {
            continue;
        }
        let lp = logp.get(row)?;
        let nll = lp.get(t as usize)?.neg()?;
        let smooth = (lp.sum_all()? / c as f64)?.neg()?;
        terms.push(((nll * (1.0 - s.label_smoothing))? + (smooth * s.label_smoothing)?)?);
    }
    let total = Tensor::stack(&terms, 0)?.sum_all()?;
    match s.reduction {
        Reduction::Sum => Ok(total),
        Reduction::Mean => total / terms.len() as f64,
    }
}

fn composed_lse(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    x.broadcast_sub(&m)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        .broadcast_add(&m)
}

#[test]
fn gelu_both_forms() {
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let x = rand(&[6, 33], 1, 4.0, dtype);
        against_composed(
            "gelu erf",
            &|t| ops::gelu(&t[0], GeluApprox::Erf),
            &|t| composed_gelu_erf(&t[0]),
            std::slice::from_ref(&x),
            tol,
        );
        against_composed(
            "gelu tanh",
            &|t| ops::gelu(&t[0], GeluApprox::Tanh),
            &|t| composed_gelu_tanh(&t[0]),
            std::slice::from_ref(&x),
            tol,
        );
        let b = rand(&[33], 2, 1.0, dtype);
        against_composed(
            "bias gelu",
            &|t| ops::bias_gelu(&t[0], &t[1], GeluApprox::Erf),
            &|t| composed_gelu_erf(&t[0].broadcast_add(&t[1])?),
            &[x, b],
            tol,
        );
    }
    let x = rand(&[4, 9], 3, 4.0, DType::F64);
    against_finite_differences(
        "gelu erf",
        &|t| ops::gelu(&t[0], GeluApprox::Erf),
        std::slice::from_ref(&x),
    );
    against_finite_differences(
        "gelu tanh",
        &|t| ops::gelu(&t[0], GeluApprox::Tanh),
        std::slice::from_ref(&x),
    );
    let b = rand(&[9], 4, 1.0, DType::F64);
    against_finite_differences(
        "bias gelu",
        &|t| ops::bias_gelu(&t[0], &t[1], GeluApprox::Tanh),
        &[x, b],
    );
}

#[test]
fn softmax_last_dim() {
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let x = rand(&[2, 5, 17], 5, 6.0, dtype);
        against_composed(
            "softmax",
            &|t| ops::softmax_last_dim(&t[0]),
            &|t| composed_softmax(&t[0]),
            &[x],
            tol,
        );
    }
    against_finite_differences(
        "softmax",
        &|t| ops::softmax_last_dim(&t[0]),
        &[rand(&[3, 7], 6, 3.0, DType::F64)],
    );
}

#[test]
fn layer_norm_and_rms_norm() {
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let x = (rand(&[3, 4, 32], 7, 2.0, dtype) + 0.7).unwrap();
        let g = (rand(&[32], 8, 0.5, dtype) + 1.0).unwrap();
        let b = rand(&[32], 9, 0.5, dtype);
        against_composed(
            "layer_norm",
            &|t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-12),
            &|t| composed_layer_norm(&t[0], &t[1], &t[2], 1e-12),
            &[x.clone(), g.clone(), b],
            tol,
        );
        against_composed(
            "rms_norm",
            &|t| ops::rms_norm(&t[0], &t[1], 1e-6),
            &|t| composed_rms_norm(&t[0], &t[1], 1e-6),
            &[x, g],
            tol,
        );
    }
    let x = rand(&[3, 8], 10, 2.0, DType::F64);
    let g = (rand(&[8], 11, 0.5, DType::F64) + 1.0).unwrap();
    let b = rand(&[8], 12, 0.5, DType::F64);
    against_finite_differences(
        "layer_norm",
        &|t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        &[x.clone(), g.clone(), b],
    );
    against_finite_differences("rms_norm", &|t| ops::rms_norm(&t[0], &t[1], 1e-5), &[x, g]);
}

#[test]
fn add_layer_norm_fused() {
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-10 } else { 1e-5 };
        let x = rand(&[3, 4, 32], 50, 2.0, dtype);
        let r = (rand(&[3, 4, 32], 51, 1.0, dtype) + 0.3).unwrap();
        let g = (rand(&[32], 52, 0.5, dtype) + 1.0).unwrap();
        let b = rand(&[32], 53, 0.5, dtype);
        against_composed(
            "add_layer_norm",
            &|t| ops::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-12),
            &|t| composed_layer_norm(&(&t[0] + &t[1])?, &t[2], &t[3], 1e-12),
            &[x, r, g, b],
            tol,
        );
    }
    against_finite_differences(
        "add_layer_norm",
        &|t| ops::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-5),
        &[
            rand(&[3, 8], 54, 2.0, DType::F64),
            rand(&[3, 8], 55, 1.0, DType::F64),
            (rand(&[8], 56, 0.5, DType::F64) + 1.0).unwrap(),
            rand(&[8], 57, 0.5, DType::F64),
        ],
    );
}

#[test]
fn cross_entropy_variants() {
    let targets: Vec<i64> = vec![3, 0, -100, 6, 2, 2, -100, 1];
    let t = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let logits = rand(&[8, 7], 13, 5.0, dtype);
        for (reduction, smoothing) in [
            (Reduction::Mean, 0.0),
            (Reduction::Sum, 0.0),
            (Reduction::Mean, 0.1),
            (Reduction::Sum, 0.25),
        ] {
            let s = CrossEntropy {
                reduction,
                label_smoothing: smoothing,
                ..Default::default()
            };
            let t = t.clone();
            let targets = targets.clone();
            against_composed(
                &format!("cross_entropy {reduction:?} smoothing {smoothing}"),
                &move |x| ops::cross_entropy(&x[0], &t, s),
                &move |x| composed_cross_entropy(&x[0], &targets, s),
                std::slice::from_ref(&logits),
                tol,
            );
        }
    }
    let s = CrossEntropy {
        label_smoothing: 0.2,
        ..Default::default()
    };
    let logits = rand(&[8, 7], 14, 3.0, DType::F64);
    against_finite_differences(
        "cross_entropy",
        &move |x| ops::cross_entropy(&x[0], &t, s),
        &[logits],
    );
    // u32 targets work too; out-of-range targets are an error, not a panic.
    let logits = rand(&[2, 3], 15, 1.0, DType::F32);
    let ok = ops::cross_entropy(
        &logits,
        &Tensor::new(&[0u32, 2], &Device::Cpu).unwrap(),
        CrossEntropy::default(),
    );
    assert!(ok.is_ok());
    let bad = ops::cross_entropy(
        &logits,
        &Tensor::new(&[0u32, 3], &Device::Cpu).unwrap(),
        CrossEntropy::default(),
    );
    assert!(
        bad.unwrap_err()
            .to_string()
            .contains("target 3 is outside 0..3")
    );
}

#[test]
fn linear_cross_entropy_is_projection_then_cross_entropy() {
    // 4100 rows of a 4099-token vocabulary: three chunks of logits (2046, 2046, 8 rows).
    let (n, h, v) = (4100, 3, 4099);
    let targets: Vec<i64> = (0..n as i64)
        .map(|i| {
            if i % 7 == 3 {
                -100
            } else {
                (i * 31) % v as i64
            }
        })
        .collect();
    let t = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let inputs = [rand(&[n, h], 21, 2.0, dtype), rand(&[v, h], 22, 2.0, dtype)];
        for (reduction, smoothing) in [(Reduction::Mean, 0.0), (Reduction::Sum, 0.1)] {
            let s = CrossEntropy {
                reduction,
                label_smoothing: smoothing,
                ..Default::default()
            };
            let (t1, t2) = (t.clone(), t.clone());
            against_composed(
                &format!("linear_cross_entropy {dtype:?} {reduction:?} smoothing {smoothing}"),
                &move |x| ops::linear_cross_entropy(&x[0], &x[1], &t1, s),
                &move |x| ops::cross_entropy(&x[0].matmul(&x[1].t()?)?, &t2, s),
                &inputs,
                tol,
            );
        }
    }
    let small = Tensor::new(&[2i64, -100, 0, 4, 4, 1], &Device::Cpu).unwrap();
    let s = CrossEntropy {
        label_smoothing: 0.2,
        ..Default::default()
    };
    let t1 = small.clone();
    against_finite_differences(
        "linear_cross_entropy",
        &move |x| ops::linear_cross_entropy(&x[0], &x[1], &t1, s),
        &[
            rand(&[6, 4], 23, 1.5, DType::F64),
            rand(&[5, 4], 24, 1.5, DType::F64),
        ],
    );
    // Half precision is computed in f32 (the loss an f32 scalar, gradients in the inputs'
    // type); shapes that do not fit are errors naming the op.
    let t2 = small.clone();
    half_tracks_f32(
        "cross_entropy (linear)",
        DType::BF16,
        &move |x| ops::linear_cross_entropy(&x[0], &x[1], &t2, CrossEntropy::default()),
        &[
            rand(&[6, 4], 25, 1.0, DType::F32),
            rand(&[5, 4], 26, 1.0, DType::F32),
        ],
        2e-2,
    );
    let bad = ops::linear_cross_entropy(
        &rand(&[6, 4], 27, 1.0, DType::F32),
        &rand(&[5, 3], 28, 1.0, DType::F32),
        &small,
        CrossEntropy::default(),
    );
    assert!(
        bad.unwrap_err()
            .to_string()
            .contains("linear_cross_entropy"),
        "a [5, 3] weight for [6, 4] hidden states"
    );
    // A frozen head (a plain tensor outside the graph, LoRA's): the same loss and hidden
    // gradient, and no weight gradient formed.
    let (x, w) = (
        rand(&[6, 4], 29, 1.0, DType::F64),
        rand(&[5, 4], 30, 1.0, DType::F64),
    );
    let xv = Var::from_tensor(&x).unwrap();
    let frozen = ops::linear_cross_entropy(xv.as_tensor(), &w, &small, s).unwrap();
    let g_frozen = frozen.backward().unwrap();
    let wv = Var::from_tensor(&w).unwrap();
    let xv2 = Var::from_tensor(&x).unwrap();
    let both = ops::linear_cross_entropy(xv2.as_tensor(), wv.as_tensor(), &small, s).unwrap();
    let g_both = both.backward().unwrap();
    assert_eq!(
        frozen.to_scalar::<f64>().unwrap(),
        both.to_scalar::<f64>().unwrap()
    );
    let d = max_rel_diff(g_frozen.get(&xv).unwrap(), g_both.get(&xv2).unwrap());
    assert_eq!(d, 0.0, "hidden gradient with a frozen head");
    assert!(g_both.get(&wv).is_some());
}

#[test]
fn dropout_is_seeded_scaled_and_differentiable() {
    let x = (rand(&[64, 64], 16, 1.0, DType::F64).abs().unwrap() + 1.0).unwrap();
    let y = ops::dropout(&x, 0.25, 42).unwrap();
    let yv: Vec<f64> = y.flatten_all().unwrap().to_vec1().unwrap();
    let xv: Vec<f64> = x.flatten_all().unwrap().to_vec1().unwrap();
    let zeros = yv.iter().filter(|v| **v == 0.0).count() as f64 / yv.len() as f64;
    assert!((zeros - 0.25).abs() < 0.03, "dropped fraction {zeros}");
    for (a, b) in yv.iter().zip(&xv) {
        assert!(*a == 0.0 || (a - b / 0.75).abs() < 1e-12);
    }
    let again: Vec<f64> = ops::dropout(&x, 0.25, 42)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(yv, again, "same seed, same mask");
    let other: Vec<f64> = ops::dropout(&x, 0.25, 43)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_ne!(yv, other);
    against_finite_differences(
        "dropout",
        &|t| ops::dropout(&t[0], 0.3, 7),
        &[rand(&[5, 9], 17, 2.0, DType::F64)],
    );
    assert!(ops::dropout(&x, 1.0, 0).is_err());
}

/// candle's own lookup, with the padding rows' gradient cut by a detached copy.
fn composed_embedding(w: &Tensor, ids: &Tensor, pad: Option<u32>) -> Result<Tensor> {
    let mut dims = ids.dims().to_vec();
    dims.push(w.dim(1)?);
    let flat = ids.flatten_all()?;
    let looked = w.index_select(&flat, 0)?;
    let out = match pad {
        None => looked,
        Some(pad) => {
            let keep = flat
                .ne(pad)?
                .to_dtype(w.dtype())?
                .unsqueeze(1)?
                .broadcast_as(looked.shape())?;
            let frozen = w.detach().index_select(&flat, 0)?;
            ((&looked * &keep)? + (frozen * (keep.ones_like()? - &keep)?)?)?
        }
    };
    out.reshape(dims)
}

#[test]
fn embedding_with_and_without_padding_idx() {
    // Ids repeat (gradients add up per row) and include the padding row 2.
    let ids = Tensor::new(&[[1u32, 2, 3, 2], [0, 3, 3, 5]], &Device::Cpu).unwrap();
    for pad in [None, Some(2u32)] {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
            let w = rand(&[6, 5], 21, 1.0, dtype);
            against_composed(
                &format!("embedding {pad:?} {dtype:?}"),
                &|t| ops::embedding(&t[0], &ids, pad.map(|p| p as usize)),
                &|t| composed_embedding(&t[0], &ids, pad),
                &[w],
                tol,
            );
        }
    }
    // (The padding row's gradient is zero by definition, not by calculus: finite differences
    // check the lookup without one.)
    against_finite_differences(
        "embedding",
        &|t| ops::embedding(&t[0], &ids, None),
        &[rand(&[6, 5], 22, 1.0, DType::F64)],
    );
    // The padding row gets exactly no gradient; an id outside the table is an error.
    let w = candle_core::Var::from_tensor(&rand(&[6, 5], 23, 1.0, DType::F32)).unwrap();
    let y = ops::embedding(w.as_tensor(), &ids, Some(2)).unwrap();
    let g = y.sum_all().unwrap().backward().unwrap();
    let row: Vec<f32> = g.get(&w).unwrap().get(2).unwrap().to_vec1().unwrap();
    assert!(row.iter().all(|x| *x == 0.0), "{row:?}");
    let bad = Tensor::new(&[6u32], &Device::Cpu).unwrap();
    let e = ops::embedding(w.as_tensor(), &bad, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("id 6 is outside the table's 6 rows"), "{e}");
}

fn composed_linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (rows, d) = (x.elem_count() / x.dim(D::Minus1)?, x.dim(D::Minus1)?);
    let mut dims = x.dims().to_vec();
    *dims.last_mut().unwrap() = w.dim(0)?;
    x.reshape((rows, d))?
        .matmul(&w.t()?)?
        .broadcast_add(b)?
        .reshape(dims)
}

#[test]
fn linear_with_bias() {
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let x = rand(&[3, 5, 24], 20, 1.0, dtype);
        let w = rand(&[17, 24], 21, 0.5, dtype);
        let b = rand(&[17], 22, 0.5, dtype);
        against_composed(
            "linear",
            &|t| ops::linear(&t[0], &t[1], &t[2]),
            &|t| composed_linear(&t[0], &t[1], &t[2]),
            &[x, w, b],
            tol,
        );
    }
    let x = rand(&[4, 6], 23, 1.0, DType::F64);
    let w = rand(&[5, 6], 24, 0.5, DType::F64);
    let b = rand(&[5], 25, 0.5, DType::F64);
    against_finite_differences("linear", &|t| ops::linear(&t[0], &t[1], &t[2]), &[x, w, b]);
}

#[test]
fn linear_without_bias() {
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        let x = rand(&[3, 5, 24], 26, 1.0, dtype);
        let w = rand(&[17, 24], 27, 0.5, dtype);
        against_composed(
            "linear_no_bias",
            &|t| ops::linear_no_bias(&t[0], &t[1]),
            &|t| t[0].broadcast_matmul(&t[1].t()?),
            &[x, w],
            tol,
        );
    }
    let x = rand(&[4, 6], 28, 1.0, DType::F64);
    let w = rand(&[5, 6], 29, 0.5, DType::F64);
    against_finite_differences(
        "linear_no_bias",
        &|t| ops::linear_no_bias(&t[0], &t[1]),
        &[x, w],
    );
    // bf16 and f16 as the other kernels take them: within their rounding of f32's result.
    for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 2e-3)] {
        let (x, w) = (
            rand(&[8, 32], 30, 1.0, DType::F32),
            rand(&[16, 32], 31, 0.5, DType::F32),
        );
        let want = ops::linear_no_bias(&x, &w).unwrap();
        let got =
            ops::linear_no_bias(&x.to_dtype(dtype).unwrap(), &w.to_dtype(dtype).unwrap()).unwrap();
        assert!(max_rel_diff(&got, &want) < tol, "{dtype:?}");
    }
    let e = ops::linear_no_bias(
        &rand(&[2, 6], 1, 1.0, DType::F32),
        &rand(&[5, 7], 2, 1.0, DType::F32),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("do not fit"), "{e}");
}

#[test]
fn linear_gelu_fused() {
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for (approx, composed) in [
            (
                GeluApprox::Erf,
                composed_gelu_erf as fn(&Tensor) -> Result<Tensor>,
            ),
            (GeluApprox::Tanh, composed_gelu_tanh),
        ] {
            let x = rand(&[3, 5, 24], 40, 1.0, dtype);
            let w = rand(&[17, 24], 41, 0.5, dtype);
            let b = rand(&[17], 42, 0.5, dtype);
            against_composed(
                &format!("linear+gelu {approx:?} {dtype:?}"),
                &|t| ops::linear_gelu(&t[0], &t[1], &t[2], approx),
                &|t| composed(&composed_linear(&t[0], &t[1], &t[2])?),
                &[x, w, b],
                tol,
            );
        }
    }
    for approx in [GeluApprox::Erf, GeluApprox::Tanh] {
        let x = rand(&[4, 6], 43, 1.0, DType::F64);
        let w = rand(&[5, 6], 44, 0.5, DType::F64);
        let b = rand(&[5], 45, 0.5, DType::F64);
        against_finite_differences(
            "linear+gelu",
            &|t| ops::linear_gelu(&t[0], &t[1], &t[2], approx),
            &[x, w, b],
        );
    }
}

/// GPT-2's Conv1D (weight [in, out]), with and without the tanh GELU, against composed ops
/// (the same math as `linear` on the transposed weight).
#[test]
fn conv1d_weight_in_out() {
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for gelu in [None, Some(GeluApprox::Tanh)] {
            let x = rand(&[3, 5, 24], 50, 1.0, dtype);
            let w = rand(&[24, 17], 51, 0.5, dtype);
            let b = rand(&[17], 52, 0.5, dtype);
            against_composed(
                &format!("conv1d gelu {gelu:?} {dtype:?}"),
                &|t| ops::conv1d(&t[0], &t[1], &t[2], gelu),
                &|t| {
                    let y = composed_linear(&t[0], &t[1].t()?, &t[2])?;
                    if gelu.is_some() {
                        composed_gelu_tanh(&y)
                    } else {
                        Ok(y)
                    }
                },
                &[x, w, b],
                tol,
            );
        }
    }
    let x = rand(&[4, 6], 53, 1.0, DType::F64);
    let w = rand(&[6, 5], 54, 0.5, DType::F64);
    let b = rand(&[5], 55, 0.5, DType::F64);
    against_finite_differences(
        "conv1d",
        &|t| ops::conv1d(&t[0], &t[1], &t[2], Some(GeluApprox::Tanh)),
        &[x, w, b],
    );
}

/// Attention from plain candle ops (heads split by reshape + transpose).
fn composed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    let (b, s, w) = q.dims3()?;
    let d = w / heads;
    let split = |t: &Tensor| t.reshape((b, s, heads, d))?.transpose(1, 2)?.contiguous();
    let scores = (split(q)?.matmul(&split(k)?.t()?.contiguous()?)? / (d as f64).sqrt())?;
    let scores = match mask {
        Some(m) => scores.broadcast_add(&m.to_dtype(q.dtype())?)?,
        None => scores,
    };
    let probs = composed_softmax(&scores)?;
    let probs = match dropout {
        Some((p, seed)) => ops::dropout(&probs, p, seed)?,
        None => probs,
    };
    probs
        .matmul(&split(v)?)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((b, s, w))
}

#[test]
fn scaled_dot_product_attention() {
    let (b, s, heads, d) = (2, 5, 3, 4);
    let w = heads * d;
    // Padding mask [b, 1, 1, s] (last key of batch 1 masked) and causal [1, 1, s, s].
    let lowest = f32::MIN as f64;
    let pad: Vec<f64> = (0..b * s)
        .map(|i| if i == b * s - 1 { lowest } else { 0.0 })
        .collect();
    let pad = Tensor::from_vec(pad, (b, 1, 1, s), &Device::Cpu).unwrap();
    let causal: Vec<f64> = (0..s * s)
        .map(|i| if i % s > i / s { lowest } else { 0.0 })
        .collect();
    let causal = Tensor::from_vec(causal, (1, 1, s, s), &Device::Cpu).unwrap();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for (mask, dropout) in [
            (None, None),
            (Some(&pad), None),
            (Some(&causal), None),
            (Some(&pad), Some((0.3, 17u64))),
        ] {
            let inputs = [
                rand(&[b, s, w], 21, 2.0, dtype),
                rand(&[b, s, w], 22, 2.0, dtype),
                rand(&[b, s, w], 23, 2.0, dtype),
            ];
            against_composed(
                &format!(
                    "attention {dtype:?} mask {} dropout {dropout:?}",
                    mask.is_some()
                ),
                &|t| ops::scaled_dot_product_attention(&t[0], &t[1], &t[2], heads, mask, dropout),
                &|t| composed_attention(&t[0], &t[1], &t[2], heads, mask, dropout),
                &inputs,
                tol,
            );
        }
        // Strided rows: q, k, v as slices of one fused projection [b, s, 3w].
        let qkv = rand(&[b, s, 3 * w], 24, 2.0, dtype);
        let sliced = |t: &[Tensor], f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>| {
            let part = |i: usize| t[0].narrow(D::Minus1, i * w, w);
            f(&part(0)?, &part(1)?, &part(2)?)
        };
        against_composed(
            &format!("attention {dtype:?} on strided slices"),
            &|t| {
                sliced(t, &|q, k, v| {
                    ops::scaled_dot_product_attention(q, k, v, heads, Some(&causal), None)
                })
            },
            &|t| {
                sliced(t, &|q, k, v| {
                    composed_attention(q, k, v, heads, Some(&causal), None)
                })
            },
            std::slice::from_ref(&qkv),
            tol,
        );
        // The same projection through the packed op (one gradient for the whole projection).
        for (mask, dropout) in [(Some(&causal), None), (Some(&pad), Some((0.3, 17u64)))] {
            against_composed(
                &format!("packed attention {dtype:?} dropout {dropout:?}"),
                &|t| ops::packed_attention(&t[0], heads, false, mask, dropout),
                &|t| {
                    sliced(t, &|q, k, v| {
                        composed_attention(q, k, v, heads, mask, dropout)
                    })
                },
                std::slice::from_ref(&qkv),
                tol,
            );
        }
    }
    against_finite_differences(
        "packed attention",
        &|t| ops::packed_attention(&t[0], 2, false, Some(&pad), Some((0.2, 5))),
        &[rand(&[b, s, 12], 34, 1.0, DType::F64)],
    );
    against_finite_differences(
        "attention",
        &|t| ops::scaled_dot_product_attention(&t[0], &t[1], &t[2], 2, Some(&pad), Some((0.2, 5))),
        &[
            rand(&[b, s, 4], 31, 1.0, DType::F64),
            rand(&[b, s, 4], 32, 1.0, DType::F64),
            rand(&[b, s, 4], 33, 1.0, DType::F64),
        ],
    );
}

#[test]
fn swiglu() {
    // silu(g) * u from candle ops: g * sigmoid(g) * u, sigmoid as 1 / (1 + exp(-g)).
    let composed = |t: &[Tensor]| {
        let sigmoid = ((t[0].neg()?.exp()? + 1.0)?).recip()?;
        (&t[0] * sigmoid)? * &t[1]
    };
    // Wide enough to reach exp's clamped tails (|g| > 88).
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        let inputs = [
            rand(&[3, 7, 33], 71, 8.0, dtype),
            rand(&[3, 7, 33], 72, 2.0, dtype),
        ];
        against_composed(
            &format!("swiglu {dtype:?}"),
            &|t| ops::swiglu(&t[0], &t[1]),
            &composed,
            &inputs,
            tol,
        );
        let tails = [
            Tensor::new(
                &[-120.0, -90.0, -30.0, 0.0, 30.0, 90.0, 120.0],
                &Device::Cpu,
            )
            .unwrap()
            .to_dtype(dtype)
            .unwrap(),
            Tensor::new(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        ];
        let (out, grads) = eval(&|t| ops::swiglu(&t[0], &t[1]), &tails);
        for t in std::iter::once(&out).chain(&grads) {
            let v: Vec<f64> = t.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
            assert!(
                v.iter().all(|x| x.is_finite()),
                "swiglu {dtype:?} tails: {v:?}"
            );
        }
        let v: Vec<f64> = out.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
        assert!(v[0].abs() < 1e-30 && (v[6] - 840.0).abs() < 1e-3, "{v:?}");
    }
    against_finite_differences(
        "swiglu",
        &|t| ops::swiglu(&t[0], &t[1]),
        &[
            rand(&[4, 9], 73, 4.0, DType::F64),
            rand(&[4, 9], 74, 2.0, DType::F64),
        ],
    );
    // bf16 and f16 compute in f32 and round once: the f32 result rounded, gradients too.
    let inputs = [
        rand(&[5, 40], 75, 4.0, DType::F32),
        rand(&[5, 40], 76, 2.0, DType::F32),
    ];
    let (_, grads32) = eval(&|t| ops::swiglu(&t[0], &t[1]), &inputs);
    for half in [DType::BF16, DType::F16] {
        let narrow: Vec<Tensor> = inputs.iter().map(|t| t.to_dtype(half).unwrap()).collect();
        let wide: Vec<Tensor> = narrow
            .iter()
            .map(|t| t.to_dtype(DType::F32).unwrap())
            .collect();
        let (reference, _) = eval(&|t| ops::swiglu(&t[0], &t[1]), &wide);
        let (out, grads) = eval(&|t| ops::swiglu(&t[0], &t[1]), &narrow);
        let rounded = reference
            .to_dtype(half)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        assert_eq!(
            max_rel_diff(&out.to_dtype(DType::F32).unwrap(), &rounded),
            0.0,
            "{half:?}"
        );
        let eps = if half == DType::BF16 { 0.05 } else { 0.01 };
        for (g, g32) in grads.iter().zip(&grads32) {
            let d = max_rel_diff(&g.to_dtype(DType::F32).unwrap(), g32);
            assert!(d < eps, "{half:?} gradient differs by {d}");
        }
    }
    let err = ops::swiglu(&inputs[0], &inputs[1].narrow(1, 0, 39).unwrap()).unwrap_err();
    assert!(err.to_string().contains("differ in shape"), "{err}");
}

/// Grouped-query attention from plain candle ops: each K/V head repeated for its query group
/// (transformers' `repeat_kv`), then [`composed_attention`] under an additive causal mask.
fn composed_gqa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: ops::AttentionHeads,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    let (b, s, w) = q.dims3()?;
    let d = w / heads.heads;
    let group = heads.heads / heads.kv_heads;
    let repeat = |t: &Tensor| {
        t.reshape((b, s, heads.kv_heads, 1, d))?
            .broadcast_as((b, s, heads.kv_heads, group, d))?
            .contiguous()?
            .reshape((b, s, w))
    };
    let causal: Vec<f64> = (0..s * s)
        .map(|i| {
            if i % s > i / s {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let causal = Tensor::from_vec(causal, (1, 1, s, s), &Device::Cpu)?.to_dtype(q.dtype())?;
    let mask = match (mask, heads.causal) {
        (Some(m), true) => Some(m.to_dtype(q.dtype())?.broadcast_add(&causal)?),
        (Some(m), false) => Some(m.clone()),
        (None, true) => Some(causal),
        (None, false) => None,
    };
    composed_attention(
        q,
        &repeat(k)?,
        &repeat(v)?,
        heads.heads,
        mask.as_ref(),
        dropout,
    )
}

#[test]
fn grouped_query_and_causal_attention() {
    // 70 positions: causal blocks of 64 query rows, so a block boundary is crossed.
    let (b, s, d) = (2, 70, 4);
    let pad: Vec<f64> = (0..b * s)
        .map(|i| if i >= b * s - 3 { f32::MIN as f64 } else { 0.0 })
        .collect();
    let pad = Tensor::from_vec(pad, (b, 1, 1, s), &Device::Cpu).unwrap();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for (heads, kv_heads, causal) in [(4, 2, true), (4, 1, true), (4, 4, true), (6, 2, false)] {
            let h = ops::AttentionHeads {
                heads,
                kv_heads,
                causal,
            };
            for (mask, dropout) in [
                (None, None),
                (Some(&pad), None),
                (Some(&pad), Some((0.25, 3u64))),
            ] {
                let inputs = [
                    rand(&[b, s, heads * d], 51, 2.0, dtype),
                    rand(&[b, s, kv_heads * d], 52, 2.0, dtype),
                    rand(&[b, s, kv_heads * d], 53, 2.0, dtype),
                ];
                against_composed(
                    &format!(
                        "attention {dtype:?} {h:?} mask {} dropout {dropout:?}",
                        mask.is_some()
                    ),
                    &|t| ops::grouped_query_attention(&t[0], &t[1], &t[2], h, mask, dropout),
                    &|t| composed_gqa(&t[0], &t[1], &t[2], h, mask, dropout),
                    &inputs,
                    tol,
                );
            }
        }
        // Causal packed attention equals the packed op under a causal mask.
        let (heads, w) = (2, 8);
        let qkv = rand(&[b, s, 3 * w], 54, 2.0, dtype);
        let causal: Vec<f64> = (0..s * s)
            .map(|i| if i % s > i / s { f32::MIN as f64 } else { 0.0 })
            .collect();
        let causal = Tensor::from_vec(causal, (1, 1, s, s), &Device::Cpu).unwrap();
        against_composed(
            &format!("causal packed attention {dtype:?}"),
            &|t| ops::packed_attention(&t[0], heads, true, Some(&pad), Some((0.1, 9))),
            &|t| {
                let mask = pad.broadcast_add(&causal)?;
                ops::packed_attention(&t[0], heads, false, Some(&mask), Some((0.1, 9)))
            },
            std::slice::from_ref(&qkv),
            tol,
        );
    }
    let h = ops::AttentionHeads {
        heads: 4,
        kv_heads: 2,
        causal: true,
    };
    against_finite_differences(
        "grouped-query causal attention",
        &|t| ops::grouped_query_attention(&t[0], &t[1], &t[2], h, Some(&pad), Some((0.2, 5))),
        &[
            rand(&[b, s, 8], 55, 1.0, DType::F64),
            rand(&[b, s, 4], 56, 1.0, DType::F64),
            rand(&[b, s, 4], 57, 1.0, DType::F64),
        ],
    );
    // bf16 attends in f32 and rounds once: within bf16's rounding of the f32 result.
    let inputs: Vec<Tensor> = [(8, 61), (4, 62), (4, 63)]
        .iter()
        .map(|&(w, seed)| rand(&[b, s, w], seed, 2.0, DType::F32))
        .collect();
    let f32_out =
        ops::grouped_query_attention(&inputs[0], &inputs[1], &inputs[2], h, None, None).unwrap();
    let half: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::BF16).unwrap())
        .collect();
    let bf16_out =
        ops::grouped_query_attention(&half[0], &half[1], &half[2], h, None, None).unwrap();
    let diff = (bf16_out.to_dtype(DType::F32).unwrap() - f32_out)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    assert!(
        diff.to_scalar::<f32>().unwrap() < 0.05,
        "bf16 attention differs by {diff}"
    );
    // Head counts that do not fit are errors naming them.
    let bad = ops::AttentionHeads {
        heads: 4,
        kv_heads: 3,
        causal: true,
    };
    let err = ops::grouped_query_attention(&inputs[0], &inputs[1], &inputs[2], bad, None, None)
        .unwrap_err();
    assert!(err.to_string().contains("3 K/V heads"), "{err}");
    let err = ops::grouped_query_attention(&inputs[0], &inputs[0], &inputs[2], h, None, None)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("do not fit 4 query and 2 K/V heads"),
        "{err}"
    );
}

/// candle's backward (patched in vendor/candle-core to store a node's first gradient instead of
/// adding it to zeros) still sums every path: fan-in through add, mul and a fused op, a
/// variable used twice by one op, and a broadcast whose gradient arrives strided.
/// The real rows of a padded batch `t` `[batch, len, w]` (the inverse of
/// [`ops::PackedSequences::pad`]).
fn real_rows(t: &Tensor, seqs: &ops::PackedSequences) -> Result<Tensor> {
    let (b, s, w) = t.dims3()?;
    let rows = Tensor::from_vec(seqs.padded_rows().to_vec(), seqs.tokens(), t.device())?;
    t.reshape((b * s, w))?.index_select(&rows, 0)
}

/// Attention over packed sequences computes, on every real token, what attention over the
/// padded batch with a padding mask computes (values and gradients, with dropout drawing the
/// padded batch's masks, causal or not, grouped-query or not, a causal block boundary
/// crossed), against composed candle ops and finite differences; packed dropout keeps the
/// padded tensor's mask bit for bit.
#[test]
fn packed_sequences_attend_and_drop_out_as_their_padded_batch() {
    let lengths = [3, 70, 1, 66];
    let seqs = ops::PackedSequences::from_lengths(&lengths, 70).unwrap();
    let (b, s, d, t) = (lengths.len(), 70, 4, seqs.tokens());
    let pad: Vec<f64> = (0..b * s)
        .map(|i| {
            if i % s >= lengths[i / s] {
                f32::MIN as f64
            } else {
                0.0
            }
        })
        .collect();
    let pad = Tensor::from_vec(pad, (b, 1, 1, s), &Device::Cpu).unwrap();
    for dtype in [DType::F64, DType::F32] {
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        for (heads, kv_heads, causal) in [(4, 4, false), (4, 2, true), (4, 1, false)] {
            let h = ops::AttentionHeads {
                heads,
                kv_heads,
                causal,
            };
            for dropout in [None, Some((0.25, 3u64))] {
                let inputs = [
                    rand(&[t, heads * d], 61, 2.0, dtype),
                    rand(&[t, kv_heads * d], 62, 2.0, dtype),
                    rand(&[t, kv_heads * d], 63, 2.0, dtype),
                ];
                against_composed(
                    &format!("varlen attention {dtype:?} {h:?} dropout {dropout:?}"),
                    &|x| ops::varlen_attention(&x[0], &x[1], &x[2], h, &seqs, dropout),
                    &|x| {
                        let [q, k, v] = [0, 1, 2].map(|i| seqs.pad(&x[i]).unwrap());
                        real_rows(&composed_gqa(&q, &k, &v, h, Some(&pad), dropout)?, &seqs)
                    },
                    &inputs,
                    tol,
                );
            }
        }
        let x = rand(&[t, 24], 64, 1.0, dtype);
        let want = real_rows(
            &ops::dropout(&seqs.pad(&x).unwrap(), 0.3, 11).unwrap(),
            &seqs,
        )
        .unwrap();
        let got = ops::dropout_packed(&x, 0.3, 11, &seqs).unwrap();
        assert_eq!(max_rel_diff(&got, &want), 0.0, "packed dropout {dtype:?}");
        against_composed(
            &format!("packed dropout {dtype:?}"),
            &|x| ops::dropout_packed(&x[0], 0.3, 11, &seqs),
            &|x| real_rows(&ops::dropout(&seqs.pad(&x[0])?, 0.3, 11)?, &seqs),
            &[x],
            f64::MIN_POSITIVE, // exact: the same draws, the same products
        );
    }
    let h = ops::AttentionHeads {
        heads: 4,
        kv_heads: 2,
        causal: true,
    };
    let small = ops::PackedSequences::from_lengths(&[2, 5, 3], 6).unwrap();
    against_finite_differences(
        "varlen attention",
        &|x| ops::varlen_attention(&x[0], &x[1], &x[2], h, &small, Some((0.2, 5))),
        &[
            rand(&[10, 8], 65, 1.0, DType::F64),
            rand(&[10, 4], 66, 1.0, DType::F64),
            rand(&[10, 4], 67, 1.0, DType::F64),
        ],
    );
    // bf16 attends in f32 and rounds once: within bf16's rounding of the f32 result.
    half_tracks_f32(
        "varlen attention",
        DType::BF16,
        &|x| ops::varlen_attention(&x[0], &x[1], &x[2], h, &seqs, Some((0.1, 7))),
        &[
            rand(&[t, 16], 68, 1.0, DType::F32),
            rand(&[t, 8], 69, 1.0, DType::F32),
            rand(&[t, 8], 70, 1.0, DType::F32),
        ],
        3e-2,
    );
}

#[test]
fn backward_sums_gradients_over_every_path() {
    let x = Var::from_tensor(&rand(&[3, 4], 41, 1.0, DType::F64)).unwrap();
    let w = rand(&[3, 4], 42, 1.0, DType::F64);
    let b = Var::from_tensor(&rand(&[4], 43, 1.0, DType::F64)).unwrap();
    let xt = x.as_tensor();
    // f = sum(x * w) + sum(x + x) + sum(gelu(x) * w) + sum(x * x) + sum(x + broadcast(b))
    let f = ((xt * &w).unwrap().sum_all().unwrap()
        + (xt + xt).unwrap().sum_all().unwrap()
        + (ops::gelu(xt, GeluApprox::Erf).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap()
        + (xt * xt).unwrap().sum_all().unwrap()
        + xt.broadcast_add(b.as_tensor()).unwrap().sum_all().unwrap())
    .unwrap();
    let grads = f.backward().unwrap();
    let gx: Vec<Vec<f64>> = grads.get(&x).unwrap().to_vec2().unwrap();
    let gb: Vec<f64> = grads.get(&b).unwrap().to_vec1().unwrap();
    let xv: Vec<Vec<f64>> = xt.to_vec2().unwrap();
    let wv: Vec<Vec<f64>> = w.to_vec2().unwrap();
    let gelu_grad = |v: f64| {
        let cdf = 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
        cdf + v * (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt()
    };
    for i in 0..3 {
        for j in 0..4 {
            let (v, wij) = (xv[i][j], wv[i][j]);
            let want = wij + 2.0 + wij * gelu_grad(v) + 2.0 * v + 1.0;
            assert!(
                (gx[i][j] - want).abs() < 1e-12,
                "dx[{i}][{j}] {} vs {want}",
                gx[i][j]
            );
        }
    }
    assert!(gb.iter().all(|&g| (g - 3.0).abs() < 1e-12), "db {gb:?}");
}

/// `f` in half precision (`dtype`) against `f` in f32 on the same (representable) values:
/// outputs and gradients within `tol`, element by element ([`max_rel_diff`]). The bounds are
/// roundings: bf16 keeps 8 significant bits, one rounding is 2^-9 relative, fp16 11 bits,
/// 2^-12; `tol` is 8 of them (1.6e-2, 2e-3), f32 accumulation inside.
fn half_tracks_f32(name: &str, dtype: DType, f: &Fun<'_>, inputs: &[Tensor], tol: f64) {
    let half: Vec<Tensor> = inputs
        .iter()
        .map(|t| {
            if t.dtype().is_float() {
                t.to_dtype(dtype).unwrap()
            } else {
                t.clone()
            }
        })
        .collect();
    let wide: Vec<Tensor> = half
        .iter()
        .map(|t| {
            if t.dtype().is_float() {
                t.to_dtype(DType::F32).unwrap()
            } else {
                t.clone()
            }
        })
        .collect();
    let (out_h, g_h) = eval(f, &half);
    let (out_w, g_w) = eval(f, &wide);
    assert!(
        out_h.dtype() == dtype || name.starts_with("cross_entropy"),
        "{name}: computed in {:?}",
        out_h.dtype()
    );
    let d = max_rel_diff(&out_h, &out_w);
    assert!(
        d < tol,
        "{name} {dtype:?}: value differs by {d:e} (tol {tol:e})"
    );
    for (i, (a, b)) in g_h.iter().zip(&g_w).enumerate() {
        assert_eq!(a.dtype(), half[i].dtype(), "{name}: gradient {i} dtype");
        let d = max_rel_diff(a, b);
        assert!(
            d < tol,
            "{name} {dtype:?}: gradient of input {i} differs by {d:e} (tol {tol:e})"
        );
    }
}

#[test]
fn bf16_kernels_track_f32() {
    half_kernels_track_f32(DType::BF16, 1.6e-2);
}

#[test]
fn fp16_kernels_track_f32() {
    half_kernels_track_f32(DType::F16, 2e-3);
}

fn half_kernels_track_f32(half: DType, tol: f64) {
    let f = DType::F32;
    let bf16_tracks_f32 = |name: &str, fun: &Fun<'_>, inputs: &[Tensor], tol: f64| {
        half_tracks_f32(name, half, fun, inputs, tol)
    };
    let (m, k, n) = (6, 40, 24);
    let x = rand(&[m, k], 1, 1.0, f);
    let w = rand(&[n, k], 2, 0.3, f);
    let b = rand(&[n], 3, 0.3, f);
    bf16_tracks_f32(
        "linear",
        &|t| ops::linear(&t[0], &t[1], &t[2]),
        &[x.clone(), w.clone(), b.clone()],
        tol,
    );
    bf16_tracks_f32(
        "linear_gelu",
        &|t| ops::linear_gelu(&t[0], &t[1], &t[2], GeluApprox::Tanh),
        &[x.clone(), w.clone(), b.clone()],
        tol,
    );
    let w_in_out = rand(&[k, n], 4, 0.3, f);
    bf16_tracks_f32(
        "conv1d",
        &|t| ops::conv1d(&t[0], &t[1], &t[2], None),
        &[x.clone(), w_in_out, b.clone()],
        tol,
    );
    let g = rand(&[k], 5, 1.0, f);
    let beta = rand(&[k], 6, 0.5, f);
    bf16_tracks_f32(
        "layer_norm",
        &|t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-12),
        &[x.clone(), g.clone(), beta.clone()],
        tol,
    );
    bf16_tracks_f32(
        "add_layer_norm",
        &|t| ops::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-12),
        &[x.clone(), rand(&[m, k], 7, 1.0, f), g, beta],
        tol,
    );
    bf16_tracks_f32(
        "bias_gelu",
        &|t| ops::bias_gelu(&t[0], &t[1], GeluApprox::Erf),
        &[x.clone(), rand(&[k], 8, 0.5, f)],
        tol,
    );
    bf16_tracks_f32(
        "softmax",
        &|t| ops::softmax_last_dim(&t[0]),
        &[rand(&[m, k], 9, 3.0, f)],
        tol,
    );
    bf16_tracks_f32(
        "dropout",
        &|t| ops::dropout(&t[0], 0.3, 7),
        std::slice::from_ref(&x),
        tol,
    );
    let ids = Tensor::new(&[3u32, 0, 7, 3, 9], &Device::Cpu).unwrap();
    bf16_tracks_f32(
        "embedding",
        &|t| ops::embedding(&t[0], &ids, Some(0)),
        &[rand(&[10, k], 10, 1.0, f)],
        tol,
    );
    let targets = Tensor::new(&[1u32, 0, 5, 2, 2, 7], &Device::Cpu).unwrap();
    bf16_tracks_f32(
        "cross_entropy",
        &|t| ops::cross_entropy(&t[0], &targets, CrossEntropy::default()),
        &[rand(&[m, 8], 11, 2.0, f)],
        tol,
    );
    let (bsz, s, heads, d) = (2, 5, 3, 8);
    let causal: Vec<f32> = (0..s * s)
        .map(|i| if i % s > i / s { f32::MIN } else { 0.0 })
        .collect();
    let causal = Tensor::from_vec(causal, (1, 1, s, s), &Device::Cpu).unwrap();
    let mask = causal.to_dtype(half).unwrap();
    bf16_tracks_f32(
        "attention",
        &|t| {
            let mask = if t[0].dtype() == half { &mask } else { &causal };
            ops::scaled_dot_product_attention(
                &t[0],
                &t[1],
                &t[2],
                heads,
                Some(mask),
                Some((0.2, 5)),
            )
        },
        &[
            rand(&[bsz, s, heads * d], 12, 1.0, f),
            rand(&[bsz, s, heads * d], 13, 1.0, f),
            rand(&[bsz, s, heads * d], 14, 1.0, f),
        ],
        // dQ passes through the most roundings of any op here (probabilities, their
        // gradient, its row sum subtracted, then the product with K): 12 roundings, not 8.
        tol * 1.5,
    );
}

/// candle's vectorised bf16 element-wise kernels (patched in vendor/candle-core for AVX2) give
/// bit for bit what one rounding of the f32 result does: every bf16 bit pattern (subnormals,
/// infinities, NaNs) against pseudo-random partners, and ties that must round to even.
#[test]
fn bf16_add_and_mul_round_like_one_f32_rounding() {
    use half::bf16;
    // Every pattern, then 5 more so the scalar tail runs too.
    let n = (1 << 16) + 5;
    let mut s = fsdp_nn::rng::XorShift64::new(0x2545_f491_4f6c_dd1d);
    let mut next = || s.next_u64();
    let a: Vec<bf16> = (0..n).map(|i| bf16::from_bits(i as u16)).collect();
    let mut b: Vec<bf16> = (0..n).map(|_| bf16::from_bits(next() as u16)).collect();
    // 1 + 2^-8 lies halfway between two bf16 values (ties to 1), 1 + 3 * 2^-8 too (ties up).
    let one = bf16::from_bits(0x3f80);
    for (i, tie) in [(0x3f80usize, 2f32.powi(-8)), (0x3f81, 2f32.powi(-8))] {
        b[i] = bf16::from_f32(tie);
        assert_eq!(a[i].to_f32() - one.to_f32(), (i - 0x3f80) as f32 / 128.0);
    }
    let ta = Tensor::from_slice(&a, n, &Device::Cpu).unwrap();
    let tb = Tensor::from_slice(&b, n, &Device::Cpu).unwrap();
    type Case = (
        &'static str,
        fn(&Tensor, &Tensor) -> Result<Tensor>,
        fn(f32, f32) -> f32,
    );
    let cases: [Case; 2] = [
        ("add", |x, y| x + y, |x, y| x + y),
        ("mul", |x, y| x * y, |x, y| x * y),
    ];
    for (name, op, f) in cases {
        let got = op(&ta, &tb).unwrap().to_vec1::<bf16>().unwrap();
        for i in 0..n {
            let want = bf16::from_f32(f(a[i].to_f32(), b[i].to_f32()));
            let same = if want.is_nan() {
                got[i].is_nan()
            } else {
                got[i].to_bits() == want.to_bits()
            };
            assert!(
                same,
                "{name} {:#06x} {:#06x}: {:#06x}, want {:#06x}",
                a[i].to_bits(),
                b[i].to_bits(),
                got[i].to_bits(),
                want.to_bits()
            );
        }
    }
    // The ties: 1 + 2^-8 rounds to 1 (even), 1 + 2^-7 + 2^-8 to 1 + 2^-6.
    let sums = (&ta + &tb).unwrap().to_vec1::<bf16>().unwrap();
    assert_eq!(sums[0x3f80].to_bits(), 0x3f80);
    assert_eq!(sums[0x3f81].to_bits(), 0x3f82);
}

#[test]
fn lora_update_and_linear_no_bias_add_match_composed_ops_and_finite_differences() {
    let s = 1.75;
    let update = |t: &[Tensor]| ops::lora_update(&t[0], &t[1], &t[2], s);
    let update_ref = |t: &[Tensor]| {
        t[0].broadcast_matmul(&t[1].t()?)?
            .broadcast_matmul(&t[2].t()?)?
            * s
    };
    let add = |t: &[Tensor]| ops::linear_no_bias_add(&t[0], &t[1], &t[2]);
    let add_ref = |t: &[Tensor]| t[0].broadcast_matmul(&t[1].t()?)? + &t[2];
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        // x [2, 5, 12], A [3, 12], B [7, 3]; W [7, 12], u [2, 5, 7].
        let lora = [
            rand(&[2, 5, 12], 1, 1.0, dtype),
            rand(&[3, 12], 2, 0.5, dtype),
            rand(&[7, 3], 3, 0.5, dtype),
        ];
        against_composed("lora_update", &update, &update_ref, &lora, tol);
        let plus = [
            rand(&[2, 5, 12], 4, 1.0, dtype),
            rand(&[7, 12], 5, 0.5, dtype),
            rand(&[2, 5, 7], 6, 1.0, dtype),
        ];
        against_composed("linear_no_bias_add", &add, &add_ref, &plus, tol);
        if dtype == DType::F64 {
            against_finite_differences("lora_update", &update, &lora);
            against_finite_differences("linear_no_bias_add", &add, &plus);
        }
    }
}

#[test]
fn quantized_linear_is_the_dequantized_projection_with_no_weight_gradient() {
    use fsdp_nn::quant::{Packing, QuantFormat};
    // x [2, 3, 64], W [5, 64] kept quantized, u [2, 3, 5].
    let w = rand(&[5, 64], 7, 0.5, DType::F32);
    let x = rand(&[2, 3, 64], 8, 1.0, DType::F32);
    let u = rand(&[2, 3, 5], 9, 1.0, DType::F32);
    for format in [QuantFormat::Nf4, QuantFormat::parse("q4_0").unwrap()] {
        let packing = Packing::new("w", format, 64).unwrap();
        let values: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let words = Tensor::from_vec(
            packing.quantize(&values),
            (5, packing.row_words()),
            &Device::Cpu,
        )
        .unwrap();
        let deq = Tensor::from_vec(
            packing.dequantize(&packing.quantize(&values)).unwrap(),
            (5, 64),
            &Device::Cpu,
        )
        .unwrap();
        let plain = |t: &[Tensor]| ops::quantized_linear(&t[0], &words, packing, None);
        let plain_ref = |t: &[Tensor]| t[0].broadcast_matmul(&deq.t()?);
        against_composed(
            "quantized_linear",
            &plain,
            &plain_ref,
            std::slice::from_ref(&x),
            1e-5,
        );
        let add = |t: &[Tensor]| ops::quantized_linear(&t[0], &words, packing, Some(&t[1]));
        let add_ref = |t: &[Tensor]| t[0].broadcast_matmul(&deq.t()?)? + &t[1];
        against_composed(
            "quantized_linear + update",
            &add,
            &add_ref,
            &[x.clone(), u.clone()],
            1e-5,
        );
        // Central differences on x (the op is linear in x: a large step is exact up to f32
        // rounding).
        let (_, grads) = eval(&add, &[x.clone(), u.clone()]);
        let base: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let analytic: Vec<f32> = grads[0].flatten_all().unwrap().to_vec1().unwrap();
        for k in (0..base.len()).step_by(17) {
            let at = |delta: f32| {
                let mut v = base.clone();
                v[k] += delta;
                let xs = Tensor::from_vec(v, x.dims(), &Device::Cpu).unwrap();
                weighted(&add, &[xs, u.clone()], 99)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            };
            let numeric = (at(0.25) - at(-0.25)) / 0.5;
            let err = (numeric - analytic[k]).abs() / analytic[k].abs().max(1e-2);
            assert!(
                err < 1e-3,
                "{format}: element {k}: {} vs {numeric}",
                analytic[k]
            );
        }
        // The words are no variable: backward gives them nothing, and refuses nothing.
        let wv = Var::from_tensor(&words).unwrap();
        let xv = Var::from_tensor(&x).unwrap();
        let loss = ops::quantized_linear(xv.as_tensor(), wv.as_tensor(), packing, None)
            .unwrap()
            .sum_all()
            .unwrap();
        let g = loss.backward().unwrap();
        assert!(g.get(&wv).is_none() && g.get(&xv).is_some(), "{format}");
    }
    let packing = Packing::new("w", QuantFormat::Nf4, 64).unwrap();
    let words = Tensor::zeros((5, packing.row_words()), DType::F32, &Device::Cpu).unwrap();
    let e = ops::quantized_linear(&x.to_dtype(DType::BF16).unwrap(), &words, packing, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("f32"), "{e}");
    let e = ops::quantized_linear(&x, &words.narrow(1, 0, 4).unwrap(), packing, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("words"), "{e}");
}
