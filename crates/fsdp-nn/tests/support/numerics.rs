//! Numerical test helpers shared by fsdp-nn's kernel tests (`tests/kernels.rs`) and its
//! unit tests of the ops' compositions (`src/ops/composed/tests.rs`, by `#[path]`): seeded
//! inputs, values and gradients of a weighted sum, and the per-element error measure.

#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};

/// A deterministic pseudo-random tensor (xorshift), values in [-scale, scale).
pub fn rand(shape: &[usize], seed: u64, scale: f64, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut rng = fsdp_nn::rng::XorShift64::seeded(seed);
    let v: Vec<f64> = (0..n)
        .map(|_| (rng.next_unit() * 2.0 - 1.0) * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

pub type Fun<'a> = dyn Fn(&[Tensor]) -> Result<Tensor> + 'a;

/// `sum(f(inputs) * w)` for a fixed random `w`, so every output element gets its own weight.
pub fn weighted(f: &Fun<'_>, inputs: &[Tensor], seed: u64) -> Result<Tensor> {
    let out = f(inputs)?;
    let w = rand(out.dims(), seed, 1.0, out.dtype()).to_device(out.device())?;
    (out * w)?.sum_all()
}

/// Values and gradients of `f` at `inputs` (each input a fresh variable).
pub fn eval(f: &Fun<'_>, inputs: &[Tensor]) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts).unwrap();
    let loss = weighted(f, &ts, 99).unwrap();
    let grads = loss.backward().unwrap();
    let g = vars
        .iter()
        .map(|v| grads.get(v).expect("no gradient").clone())
        .collect();
    (out, g)
}

/// The largest error of `a` against reference `b`, element by element: `|a - b|` over
/// `|b| + rms(b)`. Each element is held to its own size, so a small element cannot hide
/// behind a large one; the root mean square of the reference floors the denominator where
/// an element is near zero by cancellation (a sum of terms of the tensor's typical size).
pub fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (f64_values(a), f64_values(b));
    assert_eq!(a.len(), b.len());
    per_element_error(&a, &b)
}

/// Every element of `t`, in order, as f64.
pub fn f64_values(t: &Tensor) -> Vec<f64> {
    let t = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    t.to_vec1().unwrap()
}

/// [`max_rel_diff`] on plain values.
pub fn per_element_error(a: &[f64], b: &[f64]) -> f64 {
    let rms = (b.iter().map(|v| v * v).sum::<f64>() / b.len().max(1) as f64).sqrt();
    let floor = rms.max(1e-12);
    a.iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs() / (y.abs() + floor)))
}
