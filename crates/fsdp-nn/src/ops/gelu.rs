//! GELU in the exact erf form (BERT's `gelu`) and the tanh form (GPT-2's `gelu_new`), alone
//! and fused with the preceding bias add.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::{
    Float, composed, contiguous, float_dispatch, has_cuda_kernels, has_kernels, rows, tensor,
    with_slice,
};
#[cfg(feature = "cuda")]
use super::{
    cuda_kernels::{self, Output, device_operand, take_storage, take_tensor},
    kernel_plan::{ElementShape, gelu as plan},
};

/// `gelu(x (+ bias))` on their GPU.
#[cfg(feature = "cuda")]
fn gpu_forward(
    approx: GeluApprox,
    (x, xl): (&candle_core::CudaStorage, &Layout),
    bias: Option<(&candle_core::CudaStorage, &Layout)>,
) -> Result<(candle_core::CudaStorage, Shape)> {
    let mut types = vec![("input", x.dtype())];
    types.extend(bias.map(|(b, _)| ("bias", b.dtype())));
    cuda_kernels::same_types("gelu", &types)?;
    let shape = ElementShape::over(xl.shape(), x.dtype());
    let mut inputs = vec![(plan::X, device_operand(x, xl, "gelu input")?)];
    if let Some((b, bl)) = bias {
        inputs.push((plan::BIAS, device_operand(b, bl, "gelu bias")?));
    }
    let launches = shape.gelu_forward(bias.is_some(), approx == GeluApprox::Tanh)?;
    let y = Output::tensor(plan::Y, xl.shape().elem_count());
    let mut out = cuda_kernels::execute(shape.dtype, &launches, &inputs, &[y])?;
    Ok((take_storage(&mut out, plan::Y)?, xl.shape().clone()))
}

/// The gradients of `gelu(x (+ bias))` on their GPU: the input's, and the bias's where given.
#[cfg(feature = "cuda")]
fn gpu_backward(
    approx: GeluApprox,
    x: &Tensor,
    bias: Option<&Tensor>,
    grad: &Tensor,
) -> Result<(Tensor, Option<Tensor>)> {
    let shape = ElementShape::over(x.shape(), x.dtype());
    let mut inputs = vec![
        (plan::X, x, "gelu input"),
        (plan::Y, grad, "gelu output gradient"),
    ];
    inputs.extend(bias.map(|b| (plan::BIAS, b, "gelu bias")));
    let mut outputs = vec![Output::tensor(plan::DX, x.elem_count())];
    if bias.is_some() {
        outputs.push(Output::scratch(plan::PARTIALS, shape.chunks() * shape.d));
        outputs.push(Output::tensor(plan::DBIAS, shape.d));
    }
    let launches = shape.gelu_backward(bias.is_some(), approx == GeluApprox::Tanh)?;
    let mut out = cuda_kernels::execute_on_tensors(&launches, &inputs, &outputs)?;
    let dx = take_tensor(&mut out, plan::DX, x.shape())?;
    let dbias = bias
        .map(|b| take_tensor(&mut out, plan::DBIAS, b.shape()))
        .transpose()?;
    Ok((dx, dbias))
}

/// Which GELU formula.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluApprox {
    /// `0.5 x (1 + erf(x / sqrt 2))`.
    Erf,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Tanh,
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const INV_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7; // 1 / sqrt(2 pi)

/// (gelu(x), gelu'(x)) for one element in f64 (f32 tensors take the vectorised kernels in
/// `simd`).
#[inline]
fn gelu_and_grad<T: Float>(x: T, approx: GeluApprox) -> (T, T) {
    let xf = x.f();
    match approx {
        GeluApprox::Erf => {
            let cdf = 0.5 * (1.0 + libm::erf(xf * INV_SQRT_2));
            let pdf = INV_SQRT_2PI * (-0.5 * xf * xf).exp();
            (T::of(xf * cdf), T::of(cdf + xf * pdf))
        }
        GeluApprox::Tanh => {
            let inner = SQRT_2_OVER_PI * (xf + 0.044715 * xf * xf * xf);
            let t = inner.tanh();
            let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * xf * xf);
            (
                T::of(0.5 * xf * (1.0 + t)),
                T::of(0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * dinner),
            )
        }
    }
}

/// `out = gelu(x + bias)` in f64 arithmetic (bias broadcast over rows; empty: none). The f32
/// path is the vectorised `simd::gelu_forward`.
pub(super) fn forward_scalar<T: Float>(x: &[T], bias: &[T], out: &mut [T], approx: GeluApprox) {
    let d = if bias.is_empty() {
        x.len().max(1)
    } else {
        bias.len()
    };
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        for (j, (&v, o)) in xr.iter().zip(or.iter_mut()).enumerate() {
            let b = bias.get(j).map_or(0.0, |b| b.f());
            *o = gelu_and_grad(T::of(v.f() + b), approx).0;
        }
    }
}

/// `dx = g * gelu'(x + bias)` and, with a bias, its column sums added to `dbias`.
pub(super) fn backward_scalar<T: Float>(
    x: &[T],
    bias: &[T],
    g: &[T],
    dx: &mut [T],
    dbias: &mut [f64],
    approx: GeluApprox,
) {
    let d = if bias.is_empty() {
        x.len().max(1)
    } else {
        bias.len()
    };
    for ((xr, gr), dr) in x.chunks(d).zip(g.chunks(d)).zip(dx.chunks_mut(d)) {
        for (j, ((&v, &gv), o)) in xr.iter().zip(gr).zip(dr.iter_mut()).enumerate() {
            let b = bias.get(j).map_or(0.0, |b| b.f());
            *o = T::of(gelu_and_grad(T::of(v.f() + b), approx).1.f() * gv.f());
            if let Some(acc) = dbias.get_mut(j) {
                *acc += o.f();
            }
        }
    }
}

struct Gelu(GeluApprox);

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s.dtype(), self.name(), T => {
            let x = contiguous::<T>(s, l, self.name())?;
            let mut y = vec![T::of(0.0); x.len()];
            T::gelu_forward(x, &[], &mut y, self.0);
            Ok((T::storage(y), l.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        gpu_forward(self.0, (s, l), None)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if arg.device().is_cuda() {
            return Ok(Some(gpu_backward(self.0, arg, None, grad)?.0));
        }
        float_dispatch!(arg.dtype(), self.name(), T => {
            with_slice::<T, _>(arg, self.name(), |x| {
                with_slice::<T, _>(grad, self.name(), |g| {
                    let mut dx = vec![T::of(0.0); x.len()];
                    T::gelu_backward(x, &[], g, &mut dx, &mut [], self.0);
                    tensor(dx, arg.shape(), arg).map(Some)
                })
            })
        })
    }
}

/// GELU with a hand-written backward.
pub fn gelu(x: &Tensor, approx: GeluApprox) -> Result<Tensor> {
    if !has_kernels(x) && !has_cuda_kernels(x) {
        return composed::gelu(x, approx == GeluApprox::Tanh);
    }
    x.contiguous()?.apply_op1(Gelu(approx))
}

/// An error unless the bias (`l2`) has one element per column of the input (`l1`).
fn check_bias(op: &str, l1: &Layout, l2: &Layout) -> Result<()> {
    let (_, d) = rows(l1.shape());
    if l2.shape().elem_count() != d {
        candle_core::bail!(
            "{op}: bias has {} elements, last dimension is {d}",
            l2.shape().elem_count()
        );
    }
    Ok(())
}

struct BiasGelu(GeluApprox);

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "fused-bias-gelu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        check_bias(self.name(), l1, l2)?;
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let b = contiguous::<T>(s2, l2, self.name())?;
            let mut y = vec![T::of(0.0); x.len()];
            T::gelu_forward(x, b, &mut y, self.0);
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
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        check_bias(self.name(), l1, l2)?;
        gpu_forward(self.0, (s1, l1), Some((s2, l2)))
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        b_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x_t.device().is_cuda() {
            let (dx, db) = gpu_backward(self.0, x_t, Some(b_t), grad)?;
            return Ok((Some(dx), db));
        }
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(x_t, self.name(), |x| {
                with_slice::<T, _>(b_t, self.name(), |b| {
                    with_slice::<T, _>(grad, self.name(), |g| {
                        let mut dx = vec![T::of(0.0); x.len()];
                        let mut db = vec![0f64; b.len()];
                        T::gelu_backward(x, b, g, &mut dx, &mut db, self.0);
                        let db: Vec<T> = db.into_iter().map(T::of).collect();
                        Ok((Some(tensor(dx, x_t.shape(), x_t)?), Some(tensor(db, b_t.shape(), b_t)?)))
                    })
                })
            })
        })
    }
}

/// `gelu(x + bias)` with the bias broadcast over the last dimension, in one pass.
pub fn bias_gelu(x: &Tensor, bias: &Tensor, approx: GeluApprox) -> Result<Tensor> {
    if !has_kernels(x) && !has_cuda_kernels(x) {
        return composed::bias_gelu(x, bias, approx == GeluApprox::Tanh);
    }
    x.contiguous()?
        .apply_op2(&bias.contiguous()?, BiasGelu(approx))
}
