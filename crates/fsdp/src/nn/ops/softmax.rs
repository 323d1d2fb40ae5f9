//! Softmax over the last dimension.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, rows, simd, tensor, with_slice};

struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "fused-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        if let CpuStorage::F32(_) = s {
            let x = contiguous::<f32>(s, l, self.name())?;
            let mut y = vec![0f32; x.len()];
            simd::softmax_rows(x, &mut y, rows(l.shape()).1);
            return Ok((CpuStorage::F32(y), l.shape().clone()));
        }
        float_dispatch!(s.dtype(), self.name(), T => {
            let x = contiguous::<T>(s, l, self.name())?;
            let (_, d) = rows(l.shape());
            let mut y = vec![T::of(0.0); x.len()];
            for (xr, yr) in x.chunks(d.max(1)).zip(y.chunks_mut(d.max(1))) {
                let max = xr.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.f()));
                let mut sum = 0.0;
                for (o, v) in yr.iter_mut().zip(xr) {
                    let e = (v.f() - max).exp();
                    sum += e;
                    *o = T::of(e);
                }
                let inv = 1.0 / sum;
                yr.iter_mut().for_each(|o| *o = T::of(o.f() * inv));
            }
            Ok((T::storage(y), l.shape().clone()))
        })
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if res.dtype() == candle_core::DType::F32 {
            return with_slice::<f32, _>(res, self.name(), |y| {
                with_slice::<f32, _>(grad, self.name(), |g| {
                    let mut dx = vec![0f32; y.len()];
                    simd::softmax_rows_backward(y, g, &mut dx, rows(res.shape()).1);
                    tensor(dx, res.shape(), res).map(Some)
                })
            });
        }
        float_dispatch!(res.dtype(), self.name(), T => {
            with_slice::<T, _>(res, self.name(), |y| {
                with_slice::<T, _>(grad, self.name(), |g| {
                    let (_, d) = rows(res.shape());
                    let mut dx = vec![T::of(0.0); y.len()];
                    for ((yr, gr), dr) in y.chunks(d.max(1)).zip(g.chunks(d.max(1))).zip(dx.chunks_mut(d.max(1))) {
                        let dot: f64 = yr.iter().zip(gr).map(|(a, b)| a.f() * b.f()).sum();
                        for ((o, a), b) in dr.iter_mut().zip(yr).zip(gr) {
                            *o = T::of(a.f() * (b.f() - dot));
                        }
                    }
                    tensor(dx, res.shape(), res).map(Some)
                })
            })
        })
    }
}

/// Softmax over the last dimension with a hand-written backward (`dx = y (dy - sum(dy y))`).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Softmax)
}
