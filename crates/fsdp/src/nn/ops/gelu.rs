//! GELU in the exact erf form (BERT's `gelu`) and the tanh form (GPT-2's `gelu_new`), alone
//! and fused with the preceding bias add.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, rows, simd, tensor, with_slice};

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

/// gelu(x) alone.
#[inline]
fn gelu_value<T: Float>(x: T, approx: GeluApprox) -> T {
    gelu_and_grad(x, approx).0
}

struct Gelu(GeluApprox);

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        if let CpuStorage::F32(_) = s {
            let x = contiguous::<f32>(s, l, self.name())?;
            let mut y = vec![0f32; x.len()];
            simd::gelu_forward(x, &[], &mut y, self.0 == GeluApprox::Tanh);
            return Ok((CpuStorage::F32(y), l.shape().clone()));
        }
        float_dispatch!(s.dtype(), self.name(), T => {
            let x = contiguous::<T>(s, l, self.name())?;
            let y: Vec<T> = x.iter().map(|&v| gelu_value(v, self.0)).collect();
            Ok((T::storage(y), l.shape().clone()))
        })
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if arg.dtype() == candle_core::DType::F32 {
            return with_slice::<f32, _>(arg, self.name(), |x| {
                with_slice::<f32, _>(grad, self.name(), |g| {
                    let mut dx = vec![0f32; x.len()];
                    simd::gelu_backward(x, &[], g, &mut dx, &mut [], self.0 == GeluApprox::Tanh);
                    tensor(dx, arg.shape(), arg).map(Some)
                })
            });
        }
        float_dispatch!(arg.dtype(), self.name(), T => {
            with_slice::<T, _>(arg, self.name(), |x| {
                with_slice::<T, _>(grad, self.name(), |g| {
                    let dx: Vec<T> = x.iter().zip(g).map(|(&v, &gv)| T::of(gelu_and_grad(v, self.0).1.f() * gv.f())).collect();
                    tensor(dx, arg.shape(), arg).map(Some)
                })
            })
        })
    }
}

/// GELU with a hand-written backward.
pub fn gelu(x: &Tensor, approx: GeluApprox) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu(approx))
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
        let (_, d) = rows(l1.shape());
        if l2.shape().elem_count() != d {
            return Err(candle_core::Error::Msg(format!(
                "{}: bias has {} elements, last dimension is {d}",
                self.name(),
                l2.shape().elem_count()
            )));
        }
        if let CpuStorage::F32(_) = s1 {
            let x = contiguous::<f32>(s1, l1, self.name())?;
            let b = contiguous::<f32>(s2, l2, self.name())?;
            let mut y = vec![0f32; x.len()];
            simd::gelu_forward(x, b, &mut y, self.0 == GeluApprox::Tanh);
            return Ok((CpuStorage::F32(y), l1.shape().clone()));
        }
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let b = contiguous::<T>(s2, l2, self.name())?;
            let mut y = Vec::with_capacity(x.len());
            for row in x.chunks(d.max(1)) {
                y.extend(row.iter().zip(b).map(|(&v, &bj)| gelu_value(T::of(v.f() + bj.f()), self.0)));
            }
            Ok((T::storage(y), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        b_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if x_t.dtype() == candle_core::DType::F32 {
            return with_slice::<f32, _>(x_t, self.name(), |x| {
                with_slice::<f32, _>(b_t, self.name(), |b| {
                    with_slice::<f32, _>(grad, self.name(), |g| {
                        let mut dx = vec![0f32; x.len()];
                        let mut db = vec![0f64; b.len()];
                        simd::gelu_backward(x, b, g, &mut dx, &mut db, self.0 == GeluApprox::Tanh);
                        let db: Vec<f32> = db.into_iter().map(|v| v as f32).collect();
                        Ok((
                            Some(tensor(dx, x_t.shape(), x_t)?),
                            Some(tensor(db, b_t.shape(), b_t)?),
                        ))
                    })
                })
            });
        }
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(x_t, self.name(), |x| {
                with_slice::<T, _>(b_t, self.name(), |b| {
                    with_slice::<T, _>(grad, self.name(), |g| {
                        let d = b.len().max(1);
                        let mut db = vec![0f64; b.len()];
                        let mut dx = Vec::with_capacity(x.len());
                        for (row, grow) in x.chunks(d).zip(g.chunks(d)) {
                            for (j, (&v, &gv)) in row.iter().zip(grow).enumerate() {
                                let dv = T::of(gelu_and_grad(T::of(v.f() + b[j].f()), self.0).1.f() * gv.f());
                                db[j] += dv.f();
                                dx.push(dv);
                            }
                        }
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
    x.contiguous()?
        .apply_op2(&bias.contiguous()?, BiasGelu(approx))
}
