//! LoRA's update `scaling · (x Aᵀ) Bᵀ` as one op: the rank-r intermediate `x Aᵀ` is kept
//! inside the op for backward, and neither the unscaled product nor its scaled copy becomes
//! a graph node (with `linear_no_bias_add` adding it into the base projection, a projection
//! with an adapter keeps one activation-sized tensor more than one without, not three).
//! On a GPU the products are the backend's (cuBLAS), the scaling folded into the rank-r
//! intermediate, which backward reads: no activation-sized pass beyond the two products.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, gemm_new, tensor, with_slice};

struct LoraUpdate {
    scaling: f64,
    /// `x Aᵀ` [m, r], from a CPU forward.
    h: Mutex<Option<CpuStorage>>,
    /// `scaling · x Aᵀ` [m, r], from a GPU forward.
    #[cfg(feature = "cuda")]
    scaled_h: Mutex<Option<Tensor>>,
    /// Whether backward forms dx (an input outside the graph gets none).
    want_dx: bool,
}

/// `(m, k, r, n)` of an input `[m, k]`, `A` `[r, k]` and `B` `[n, r]`, or an error naming
/// the three shapes.
fn dims(x: &Layout, a: &Layout, b: &Layout) -> Result<(usize, usize, usize, usize)> {
    let (m, k) = x.shape().dims2()?;
    let (r, ka) = a.shape().dims2()?;
    let (n, rb) = b.shape().dims2()?;
    if ka != k || rb != r {
        candle_core::bail!(
            "lora update: input {:?}, A {:?} and B {:?} do not fit",
            x.shape().dims(),
            a.shape().dims(),
            b.shape().dims()
        );
    }
    Ok((m, k, r, n))
}

/// The update by a backend's own products: `(h Bᵀ, h)` with `h = scaling · x Aᵀ` (the
/// scaling on the rank-r side, where it costs m·r multiplies, not m·n).
#[cfg(any(test, feature = "cuda"))]
fn update_on<S: BackendStorage>(
    (x, xl): (&S, &Layout),
    (a, al): (&S, &Layout),
    (b, bl): (&S, &Layout),
    scaling: f64,
) -> Result<(S, S)> {
    let (m, k, r, n) = dims(xl, al, bl)?;
    let h_layout = Layout::contiguous((m, r));
    let xa = x.matmul(a, (1, m, r, k), xl, &al.transpose(0, 1)?)?;
    let h = xa.affine(&h_layout, scaling, 0.0)?;
    let u = h.matmul(b, (1, m, n, r), &h_layout, &bl.transpose(0, 1)?)?;
    Ok((u, h))
}

/// Backward of [`update_on`] by tensor products on any device: `(dx, dA, dB)` from the
/// output's gradient `g` [m, n] and the scaled intermediate `h` [m, r].
#[cfg(any(test, feature = "cuda"))]
fn backward_on(
    (x, a, b): (&Tensor, &Tensor, &Tensor),
    h: &Tensor,
    g: &Tensor,
    scaling: f64,
    want_dx: bool,
) -> Result<(Option<Tensor>, Tensor, Tensor)> {
    // No graph: these are gradients, and a node here would hold the inputs.
    let (x, a, b, h) = (x.detach(), a.detach(), b.detach(), h.detach());
    let g = g.detach().contiguous()?;
    // dB = gᵀ h; dh = scaling · g B; dA = dhᵀ x; dx = dh A.
    let db = g.t()?.matmul(&h)?;
    let dh = (g.matmul(&b)? * scaling)?;
    let da = dh.t()?.matmul(&x)?;
    let dx = want_dx.then(|| dh.matmul(&a)).transpose()?;
    Ok((dx, da, db))
}

impl CustomOp3 for LoraUpdate {
    fn name(&self) -> &'static str {
        "lora-update"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k, r, n) = dims(l1, l2, l3)?;
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let a = contiguous::<T>(s2, l2, self.name())?;
            let b = contiguous::<T>(s3, l3, self.name())?;
            // h[m×r] = x[m×k] · Aᵀ[k×r]; u[m×n] = scaling · h · Bᵀ[r×n]
            let h = gemm_new(m, r, k, x, k, 1, a, 1, k, 1.0);
            let u = gemm_new(m, n, r, &h, r, 1, b, 1, r, self.scaling);
            *self.h.lock().unwrap_or_else(|e| e.into_inner()) = Some(T::storage(h));
            Ok((T::storage(u), Shape::from((m, n))))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, _, r, n) = dims(l1, l2, l3)?;
        super::cuda_kernels::same_types(
            self.name(),
            &[("input", s1.dtype()), ("A", s2.dtype()), ("B", s3.dtype())],
        )?;
        let (u, h) = update_on((s1, l1), (s2, l2), (s3, l3), self.scaling)?;
        let h = super::cuda_kernels::gradient_tensor(h, &Shape::from((m, r)));
        *self.scaled_h.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        Ok((u, Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        a_t: &Tensor,
        b_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if !x_t.device().is_cpu() {
            let h = self
                .scaled_h
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .ok_or_else(|| {
                    candle_core::Error::Msg("lora update: backward without its forward".into())
                })?;
            let (dx, da, db) = backward_on((x_t, a_t, b_t), &h, grad, self.scaling, self.want_dx)?;
            return Ok((dx, Some(da), Some(db)));
        }
        let (m, k) = x_t.dims2()?;
        let (n, r) = b_t.dims2()?;
        let s = self.scaling;
        float_dispatch!(x_t.dtype(), self.name(), T => {
            let held = self.h.lock().unwrap_or_else(|e| e.into_inner());
            let h = held.as_ref().and_then(T::slice).ok_or_else(|| {
                candle_core::Error::Msg("lora update: backward without its forward".into())
            })?;
            with_slice::<T, _>(grad, self.name(), |g| {
                with_slice::<T, _>(x_t, self.name(), |x| {
                    with_slice::<T, _>(a_t, self.name(), |a| {
                        with_slice::<T, _>(b_t, self.name(), |b| {
                            // dh[m×r] = scaling · g[m×n] · B[n×r]
                            let dh = gemm_new(m, r, n, g, n, 1, b, r, 1, s);
                            // dB[n×r] = scaling · gᵀ[n×m] · h[m×r]
                            let db = gemm_new(n, r, m, g, 1, n, h, r, 1, s);
                            // dA[r×k] = dhᵀ[r×m] · x[m×k]
                            let da = gemm_new(r, k, m, &dh, 1, r, x, k, 1, 1.0);
                            // dx[m×k] = dh[m×r] · A[r×k]
                            let dx = self
                                .want_dx
                                .then(|| gemm_new(m, k, r, &dh, r, 1, a, k, 1, 1.0));
                            Ok((
                                dx.map(|dx| tensor(dx, x_t.shape(), x_t)).transpose()?,
                                Some(tensor(da, a_t.shape(), a_t)?),
                                Some(tensor(db, b_t.shape(), b_t)?),
                            ))
                        })
                    })
                })
            })
        })
    }
}

/// `scaling · (x Aᵀ) Bᵀ` over the last dimension of `x` (any leading shape), `A` `[r, in]`,
/// `B` `[out, r]`: LoRA's update, as one op.
pub fn lora_update(x: &Tensor, a: &Tensor, b: &Tensor, scaling: f64) -> Result<Tensor> {
    if !super::has_kernels(x) && !super::has_cuda_kernels(x) {
        return super::composed::lora_update(x, a, b, scaling);
    }
    let op = LoraUpdate {
        scaling,
        h: Mutex::new(None),
        #[cfg(feature = "cuda")]
        scaled_h: Mutex::new(None),
        want_dx: x.track_op(),
    };
    super::linear::on_rows(x, b.dim(0)?, |x2| {
        x2.apply_op3(&a.contiguous()?, &b.contiguous()?, op)
    })
}

#[cfg(test)]
mod tests {
    use candle_core::op::BackpropOp;
    use candle_core::{DType, Device, Storage, Var};

    use super::*;

    fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let z = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                ((z >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .unwrap()
    }

    /// Largest difference over the largest magnitude of `want`.
    fn rel(got: &Tensor, want: &Tensor) -> f32 {
        let (got, want) = (
            got.to_dtype(DType::F32).unwrap(),
            want.to_dtype(DType::F32).unwrap(),
        );
        let diff = (&got - &want).unwrap().abs().unwrap().max_all().unwrap();
        let scale = want.abs().unwrap().max_all().unwrap();
        diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap()
    }

    fn on_cpu(t: &Tensor) -> (CpuStorage, Layout) {
        let (storage, layout) = t.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => (s.clone(), layout.clone()),
            _ => panic!("a CPU tensor"),
        }
    }

    /// The GPU's path (the backend's products, the scaling folded into the rank-r
    /// intermediate, backward by tensor products) computed with the CPU backend: the values
    /// and all three gradients of the CPU's fused op, in f32 within 1e-5 and bf16 within 2e-2.
    #[test]
    fn the_gpu_path_on_cpu_storage_matches_the_fused_op() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let (m, k, r, n, scaling) = (7, 12, 3, 10, 2.5);
            let (x, a, b) = (
                rand(&[m, k], 1, dtype),
                rand(&[r, k], 2, dtype),
                rand(&[n, r], 3, dtype),
            );
            let g = rand(&[m, n], 4, dtype);
            let vars = [&x, &a, &b].map(|t| Var::from_tensor(t).unwrap());
            let u = lora_update(
                vars[0].as_tensor(),
                vars[1].as_tensor(),
                vars[2].as_tensor(),
                scaling,
            )
            .unwrap();
            let grads = (&u * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let want: Vec<Tensor> = vars
                .iter()
                .map(|v| grads.get(v.as_tensor()).unwrap().clone())
                .collect();

            let (xs, xl) = on_cpu(&x);
            let (as_, al) = on_cpu(&a);
            let (bs, bl) = on_cpu(&b);
            let (u2, h) = update_on((&xs, &xl), (&as_, &al), (&bs, &bl), scaling).unwrap();
            let tensor_of = |s: CpuStorage, shape: (usize, usize)| {
                Tensor::from_storage(Storage::Cpu(s), shape, BackpropOp::none(), false)
            };
            let (u2, h) = (tensor_of(u2, (m, n)), tensor_of(h, (m, r)));
            assert!(rel(&u2, &u) <= tol, "{dtype:?} output: {}", rel(&u2, &u));
            let (dx, da, db) = backward_on((&x, &a, &b), &h, &g, scaling, true).unwrap();
            for (name, got, want) in [
                ("dx", dx.unwrap(), &want[0]),
                ("dA", da, &want[1]),
                ("dB", db, &want[2]),
            ] {
                assert!(
                    rel(&got, want) <= tol,
                    "{dtype:?} {name}: {}",
                    rel(&got, want)
                );
            }
            let (dx, _, _) = backward_on((&x, &a, &b), &h, &g, scaling, false).unwrap();
            assert!(dx.is_none(), "no dx for an input outside the graph");
        }
    }
}
