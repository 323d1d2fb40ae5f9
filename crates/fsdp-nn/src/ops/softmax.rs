//! Softmax over the last dimension (on a GPU, `kernels/softmax.cu`: a block per row).

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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda_kernels::{self, Output, device_operand, take_storage};
        use super::kernel_plan::softmax_buffers as plan;
        let shape = softmax_shape(l.shape(), s.dtype());
        let inputs = [(plan::X, device_operand(s, l, self.name())?)];
        let y = Output::tensor(plan::Y, l.shape().elem_count());
        let mut out = cuda_kernels::execute(shape.dtype, &shape.forward()?, &inputs, &[y])?;
        Ok((take_storage(&mut out, plan::Y)?, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if res.device().is_cuda() {
            use super::cuda_kernels::{self, Output, take_tensor};
            use super::kernel_plan::softmax_buffers as plan;
            let types = [("output", res.dtype()), ("gradient", grad.dtype())];
            cuda_kernels::same_types(self.name(), &types)?;
            let shape = softmax_shape(res.shape(), res.dtype());
            let inputs = [
                (plan::Y, res, "softmax output"),
                (plan::GRAD, grad, "softmax output gradient"),
            ];
            let dx = Output::tensor(plan::DX, res.elem_count());
            let mut out = cuda_kernels::execute_on_tensors(&shape.backward()?, &inputs, &[dx])?;
            return take_tensor(&mut out, plan::DX, res.shape()).map(Some);
        }
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

/// The kernels' view of a softmax over the last dimension of `shape`.
#[cfg(feature = "cuda")]
fn softmax_shape(shape: &Shape, dtype: candle_core::DType) -> super::kernel_plan::SoftmaxShape {
    let (rows, d) = rows(shape);
    super::kernel_plan::SoftmaxShape { rows, d, dtype }
}

/// Softmax over the last dimension with a hand-written backward (`dx = y (dy - sum(dy y))`).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if !has_kernels(x) && !super::has_cuda_kernels(x) {
        return composed::softmax_last_dim(x);
    }
    x.contiguous()?.apply_op1(Softmax)
}
