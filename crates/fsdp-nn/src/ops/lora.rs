//! LoRA's update `scaling · (x Aᵀ) Bᵀ` as one op: the rank-r intermediate `x Aᵀ` is kept
//! inside the op for backward, and neither the unscaled product nor its scaled copy becomes
//! a graph node (with `linear_no_bias_add` adding it into the base projection, a projection
//! with an adapter keeps one activation-sized tensor more than one without, not three).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, gemm_new, tensor, with_slice};

struct LoraUpdate {
    scaling: f64,
    /// `x Aᵀ` [m, r], from forward.
    h: Mutex<Option<CpuStorage>>,
    /// Whether backward forms dx (an input outside the graph gets none).
    want_dx: bool,
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
        let (m, k) = l1.shape().dims2()?;
        let (r, ka) = l2.shape().dims2()?;
        let (n, rb) = l3.shape().dims2()?;
        if ka != k || rb != r {
            candle_core::bail!(
                "lora update: input {:?}, A {:?} and B {:?} do not fit",
                l1.shape().dims(),
                l2.shape().dims(),
                l3.shape().dims()
            );
        }
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

    fn bwd(
        &self,
        x_t: &Tensor,
        a_t: &Tensor,
        b_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
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
    if !super::has_kernels(x) {
        return super::composed::lora_update(x, a, b, scaling);
    }
    let op = LoraUpdate {
        scaling,
        h: Mutex::new(None),
        want_dx: x.track_op(),
    };
    super::linear::on_rows(x, b.dim(0)?, |x2| {
        x2.apply_op3(&a.contiguous()?, &b.contiguous()?, op)
    })
}
