//! LayerNorm and RMSNorm over the last dimension, with affine parameters.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::cuda_kernels::{self, Output, device_operand, take_storage, take_tensor};
#[cfg(feature = "cuda")]
use super::kernel_plan::{NormShape, backward, forward};
use super::{
    Float, composed, contiguous, float_dispatch, has_cuda_kernels, has_kernels, rows, tensor,
    with_slice,
};

/// Per-row mean and 1/std (mean 0 for RMSNorm).
fn row_stats<T: Float>(row: &[T], eps: f64, center: bool) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = if center {
        row.iter().map(|v| v.f()).sum::<f64>() / n
    } else {
        0.0
    };
    let var = row
        .iter()
        .map(|v| (v.f() - mean) * (v.f() - mean))
        .sum::<f64>()
        / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// An error unless the residual (`l2`) has the input's (`l1`) shape.
fn check_residual(op: &str, l1: &Layout, l2: &Layout) -> Result<()> {
    if l1.shape() != l2.shape() {
        candle_core::bail!(
            "{op}: input {:?} and residual {:?} differ",
            l1.dims(),
            l2.dims()
        );
    }
    Ok(())
}

fn check_param(op: &str, len: usize, d: usize) -> Result<()> {
    if len != d {
        return Err(candle_core::Error::Msg(format!(
            "{op}: parameter has {len} elements, last dimension is {d}"
        )));
    }
    Ok(())
}

/// Forward for both norms: `y = (x - mean) * rstd * gamma (+ beta)`, in f64 arithmetic (f32
/// takes the vectorised `simd::norm_rows`).
pub(super) fn norm_fwd<T: Float>(
    x: &[T],
    gamma: &[T],
    beta: Option<&[T]>,
    d: usize,
    eps: f64,
    center: bool,
) -> Vec<T> {
    let mut y = vec![T::of(0.0); x.len()];
    for (xr, yr) in x.chunks(d.max(1)).zip(y.chunks_mut(d.max(1))) {
        let (mean, rstd) = row_stats(xr, eps, center);
        for j in 0..xr.len() {
            let b = beta.map_or(0.0, |b| b[j].f());
            yr[j] = T::of((xr[j].f() - mean) * rstd * gamma[j].f() + b);
        }
    }
    y
}

/// Backward for both norms: (dx, dgamma, dbeta), in f64 arithmetic.
pub(super) fn norm_bwd<T: Float>(
    x: &[T],
    gamma: &[T],
    g: &[T],
    d: usize,
    eps: f64,
    center: bool,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let mut dx = vec![T::of(0.0); x.len()];
    let mut dgamma = vec![0f64; d];
    let mut dbeta = vec![0f64; d];
    let n = d as f64;
    let mut xhat = vec![0f64; d];
    let mut dxhat = vec![0f64; d];
    for ((xr, gr), dr) in x
        .chunks(d.max(1))
        .zip(g.chunks(d.max(1)))
        .zip(dx.chunks_mut(d.max(1)))
    {
        let (mean, rstd) = row_stats(xr, eps, center);
        let (mut sum_dxhat, mut sum_dxhat_xhat) = (0.0, 0.0);
        for j in 0..d {
            xhat[j] = (xr[j].f() - mean) * rstd;
            dxhat[j] = gr[j].f() * gamma[j].f();
            sum_dxhat += dxhat[j];
            sum_dxhat_xhat += dxhat[j] * xhat[j];
            dgamma[j] += gr[j].f() * xhat[j];
            dbeta[j] += gr[j].f();
        }
        let mean_dxhat = if center { sum_dxhat / n } else { 0.0 };
        for j in 0..d {
            dr[j] = T::of(rstd * (dxhat[j] - mean_dxhat - xhat[j] * sum_dxhat_xhat / n));
        }
    }
    (
        dx,
        dgamma.into_iter().map(T::of).collect(),
        dbeta.into_iter().map(T::of).collect(),
    )
}

/// The kernels' description of a norm over the last dimension of `shape`.
#[cfg(feature = "cuda")]
fn gpu_norm(
    shape: &Shape,
    dtype: candle_core::DType,
    eps: f64,
    layer: bool,
    residual: bool,
) -> NormShape {
    let (rows, d) = rows(shape);
    NormShape {
        rows,
        d,
        dtype,
        center: layer,
        residual,
        beta: layer,
        eps,
    }
}

/// The norm `shape` of `x` (plus `residual`), scaled by `gamma` and shifted by `beta`, on
/// their GPU.
#[cfg(feature = "cuda")]
fn gpu_norm_forward(
    shape: NormShape,
    x: cuda_kernels::Operand<'_>,
    residual: Option<cuda_kernels::Operand<'_>>,
    gamma: cuda_kernels::Operand<'_>,
    beta: Option<cuda_kernels::Operand<'_>>,
) -> Result<candle_core::CudaStorage> {
    let mut types = vec![("input", x.0.dtype()), ("scale", gamma.0.dtype())];
    types.extend(residual.map(|r| ("residual", r.0.dtype())));
    types.extend(beta.map(|b| ("shift", b.0.dtype())));
    cuda_kernels::same_types("fused norm", &types)?;
    let mut inputs = vec![(forward::X, x), (forward::GAMMA, gamma)];
    inputs.extend(residual.map(|r| (forward::RESIDUAL, r)));
    inputs.extend(beta.map(|b| (forward::BETA, b)));
    let y = Output::tensor(forward::Y, shape.rows * shape.d);
    let mut out = cuda_kernels::execute(shape.dtype, &shape.forward()?, &inputs, &[y])?;
    take_storage(&mut out, forward::Y)
}

/// The gradients of a norm on the GPU: the input's (also the residual's), the scale's, and
/// the shift's where `shape.beta`. `gamma` is the scale's `[d]` elements (a view is fine).
#[cfg(feature = "cuda")]
fn gpu_norm_backward(
    shape: NormShape,
    x: &Tensor,
    residual: Option<&Tensor>,
    gamma: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    use backward as b;
    let mut types = vec![
        ("input", x.dtype()),
        ("scale", gamma.dtype()),
        ("gradient", grad.dtype()),
    ];
    types.extend(residual.map(|r| ("residual", r.dtype())));
    cuda_kernels::same_types("fused norm backward", &types)?;
    let mut inputs = vec![
        (b::X, x, "norm input"),
        (b::GAMMA, gamma, "norm scale"),
        (b::GRAD, grad, "norm output gradient"),
    ];
    inputs.extend(residual.map(|r| (b::RESIDUAL, r, "norm residual")));
    let (rows, d) = (shape.rows, shape.d);
    let mut outputs = vec![
        Output::tensor(b::DX, rows * d),
        Output::scratch(b::ROW_STATS, 2 * rows),
        Output::scratch(b::PARTIALS, 2 * shape.chunks() * d),
        Output::tensor(b::DGAMMA, d),
    ];
    if shape.beta {
        outputs.push(Output::tensor(b::DBETA, d));
    }
    let mut out = cuda_kernels::execute_on_tensors(&shape.backward()?, &inputs, &outputs)?;
    let dx = take_tensor(&mut out, b::DX, x.shape())?;
    let dgamma = take_tensor(&mut out, b::DGAMMA, gamma.shape())?;
    let dbeta = match shape.beta {
        true => Some(take_tensor(&mut out, b::DBETA, gamma.shape())?),
        false => None,
    };
    Ok((dx, dgamma, dbeta))
}

struct LayerNorm {
    eps: f64,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
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
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let gamma = contiguous::<T>(s2, l2, self.name())?;
            let beta = contiguous::<T>(s3, l3, self.name())?;
            let (_, d) = rows(l1.shape());
            check_param(self.name(), gamma.len(), d)?;
            check_param(self.name(), beta.len(), d)?;
            Ok((T::storage(T::norm_forward(x, gamma, Some(beta), d, self.eps, true)), l1.shape().clone()))
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
        let shape = gpu_norm(l1.shape(), s1.dtype(), self.eps, true, false);
        check_param(self.name(), l2.shape().elem_count(), shape.d)?;
        check_param(self.name(), l3.shape().elem_count(), shape.d)?;
        let y = gpu_norm_forward(
            shape,
            device_operand(s1, l1, self.name())?,
            None,
            device_operand(s2, l2, self.name())?,
            Some(device_operand(s3, l3, self.name())?),
        )?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        g_t: &Tensor,
        b_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x_t.device().is_cuda() {
            let shape = gpu_norm(x_t.shape(), x_t.dtype(), self.eps, true, false);
            let (dx, dgamma, dbeta) = gpu_norm_backward(shape, x_t, None, g_t, grad)?;
            return Ok((
                Some(dx),
                Some(dgamma),
                dbeta.map(|b| b.reshape(b_t.shape())).transpose()?,
            ));
        }
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(x_t, self.name(), |x| {
                with_slice::<T, _>(g_t, self.name(), |gamma| {
                    with_slice::<T, _>(grad, self.name(), |g| {
                        let (dx, dgamma, dbeta) = T::norm_backward(x, gamma, g, gamma.len(), self.eps, true);
                        Ok((Some(tensor(dx, x_t.shape(), x_t)?), Some(tensor(dgamma, g_t.shape(), g_t)?), Some(tensor(dbeta, b_t.shape(), b_t)?)))
                    })
                })
            })
        })
    }
}

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * gamma + beta`
/// (biased variance, as PyTorch), with a hand-written backward for all three inputs.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
    if !has_kernels(x) && !has_cuda_kernels(x) {
        return composed::layer_norm(x, gamma, beta, eps);
    }
    x.contiguous()?
        .apply_op3(&gamma.contiguous()?, &beta.contiguous()?, LayerNorm { eps })
}

/// `LayerNorm(x + residual)` with gamma and beta as one `[2, d]` tensor (candle ops take at
/// most three inputs). The sum is recomputed in backward rather than kept.
struct AddLayerNorm {
    eps: f64,
}

impl CustomOp3 for AddLayerNorm {
    fn name(&self) -> &'static str {
        "fused-add-layer-norm"
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
        check_residual(self.name(), l1, l2)?;
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let r = contiguous::<T>(s2, l2, self.name())?;
            let gb = contiguous::<T>(s3, l3, self.name())?;
            let (_, d) = rows(l1.shape());
            check_param(self.name(), gb.len(), 2 * d)?;
            let sum = T::add(x, r);
            let y = T::norm_forward(&sum, &gb[..d], Some(&gb[d..]), d, self.eps, true);
            Ok((T::storage(y), l1.shape().clone()))
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
        check_residual(self.name(), l1, l2)?;
        let shape = gpu_norm(l1.shape(), s1.dtype(), self.eps, true, true);
        check_param(self.name(), l3.shape().elem_count(), 2 * shape.d)?;
        let (gb, start) = device_operand(s3, l3, self.name())?;
        let y = gpu_norm_forward(
            shape,
            device_operand(s1, l1, self.name())?,
            Some(device_operand(s2, l2, self.name())?),
            (gb, start),
            Some((gb, start + shape.d)),
        )?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        r_t: &Tensor,
        gb_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x_t.device().is_cuda() {
            let shape = gpu_norm(x_t.shape(), x_t.dtype(), self.eps, true, true);
            let gamma = gb_t.get(0)?;
            let (ds, dgamma, dbeta) = gpu_norm_backward(shape, x_t, Some(r_t), &gamma, grad)?;
            let dbeta = dbeta.ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: no shift gradient", self.name()))
            })?;
            let dgb = Tensor::stack(&[dgamma, dbeta], 0)?.reshape(gb_t.shape())?;
            return Ok((Some(ds.clone()), Some(ds), Some(dgb)));
        }
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(x_t, self.name(), |x| {
                with_slice::<T, _>(r_t, self.name(), |r| {
                    with_slice::<T, _>(gb_t, self.name(), |gb| {
                        with_slice::<T, _>(grad, self.name(), |g| {
                            let d = gb.len() / 2;
                            // Recomputed, not kept from forward: its inputs are alive in the
                            // graph anyway, and a saved sum would be one more activation.
                            let sum = T::add(x, r);
                            let (ds, dgamma, dbeta) = T::norm_backward(&sum, &gb[..d], g, d, self.eps, true);
                            let mut dgb = dgamma;
                            dgb.extend(dbeta);
                            let ds = tensor(ds, x_t.shape(), x_t)?;
                            Ok((Some(ds.clone()), Some(ds), Some(tensor(dgb, gb_t.shape(), gb_t)?)))
                        })
                    })
                })
            })
        })
    }
}

/// `LayerNorm(x + residual)` (BERT's post-norm residual) as one op: no separate sum node, and
/// one gradient for both inputs.
pub fn add_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    if !has_kernels(x) && !has_cuda_kernels(x) {
        return composed::add_layer_norm(x, residual, gamma, beta, eps);
    }
    let d = gamma.elem_count();
    let gb = Tensor::cat(&[gamma.flatten_all()?, beta.flatten_all()?], 0)?.reshape((2, d))?;
    x.contiguous()?
        .apply_op3(&residual.contiguous()?, &gb, AddLayerNorm { eps })
}

struct RmsNorm {
    eps: f64,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let w = contiguous::<T>(s2, l2, self.name())?;
            let (_, d) = rows(l1.shape());
            check_param(self.name(), w.len(), d)?;
            Ok((T::storage(T::norm_forward(x, w, None, d, self.eps, false)), l1.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = gpu_norm(l1.shape(), s1.dtype(), self.eps, false, false);
        check_param(self.name(), l2.shape().elem_count(), shape.d)?;
        let y = gpu_norm_forward(
            shape,
            device_operand(s1, l1, self.name())?,
            None,
            device_operand(s2, l2, self.name())?,
            None,
        )?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x_t.device().is_cuda() {
            let shape = gpu_norm(x_t.shape(), x_t.dtype(), self.eps, false, false);
            let (dx, dw, _) = gpu_norm_backward(shape, x_t, None, w_t, grad)?;
            return Ok((Some(dx), Some(dw)));
        }
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(x_t, self.name(), |x| {
                with_slice::<T, _>(w_t, self.name(), |w| {
                    with_slice::<T, _>(grad, self.name(), |g| {
                        let (dx, dw, _) = T::norm_backward(x, w, g, w.len(), self.eps, false);
                        Ok((Some(tensor(dx, x_t.shape(), x_t)?), Some(tensor(dw, w_t.shape(), w_t)?)))
                    })
                })
            })
        })
    }
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if !has_kernels(x) && !has_cuda_kernels(x) {
        return composed::rms_norm(x, weight, eps);
    }
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps })
}
