//! Softmax over the last dimension.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::{Float, composed, contiguous, float_dispatch, has_kernels, rows, tensor, with_slice};

struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "fused-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s.dtype(), self.name(), T => {
            let (n, d) = rows(l.shape());
            let mut y = contiguous::<T>(s, l, self.name())?.to_vec();
            T::softmax_rows_in_place(&mut y, &mut vec![0.0; n], d);
            Ok((T::storage(y), l.shape().clone()))
        })
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        float_dispatch!(res.dtype(), self.name(), T => {
            with_slice::<T, _>(res, self.name(), |y| {
                with_slice::<T, _>(grad, self.name(), |g| {
                    let mut dx = vec![T::of(0.0); y.len()];
                    T::softmax_rows_backward(y, g, &mut dx, rows(res.shape()).1);
                    tensor(dx, res.shape(), res).map(Some)
                })
            })
        })
    }
}

/// Softmax over the last dimension with a hand-written backward (`dx = y (dy - sum(dy y))`).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if !has_kernels(x) {
        return composed::softmax_last_dim(x);
    }
    x.contiguous()?.apply_op1(Softmax)
}
