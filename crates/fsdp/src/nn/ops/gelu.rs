//! GELU in the exact erf form (BERT's `gelu`) and the tanh form (GPT-2's `gelu_new`), alone
//! and fused with the preceding bias add.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, rows, tensor, with_slice};

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

/// (gelu(x), gelu'(x)) for one element, computed in the element's precision class.
#[inline]
fn gelu_and_grad<T: Float>(x: T, approx: GeluApprox) -> (T, T) {
    let xf = x.f();
    match approx {
        GeluApprox::Erf => {
            let cdf = if std::mem::size_of::<T>() == 4 {
                0.5 * (1.0 + libm::erff((xf * INV_SQRT_2) as f32) as f64)
            } else {
                0.5 * (1.0 + libm::erf(xf * INV_SQRT_2))
            };
            let pdf = INV_SQRT_2PI * (-0.5 * xf * xf).exp();
            (T::of(xf * cdf), T::of(cdf + xf * pdf))
        }
        GeluApprox::Tanh => {
            let inner = SQRT_2_OVER_PI * (xf + 0.044715 * xf * xf * xf);
            let t = inner.tanh();
            let y = 0.5 * xf * (1.0 + t);
            let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * xf * xf);
            let dy = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * dinner;
            (T::of(y), T::of(dy))
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
            let y: Vec<T> = x.iter().map(|&v| gelu_and_grad(v, self.0).0).collect();
            Ok((T::storage(y), l.shape().clone()))
        })
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
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
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let b = contiguous::<T>(s2, l2, self.name())?;
            let (_, d) = rows(l1.shape());
            if b.len() != d {
                return Err(candle_core::Error::Msg(format!("{}: bias has {} elements, last dimension is {d}", self.name(), b.len())));
            }
            let y: Vec<T> = x.iter().enumerate().map(|(i, &v)| gelu_and_grad(T::of(v.f() + b[i % d].f()), self.0).0).collect();
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
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(x_t, self.name(), |x| {
                with_slice::<T, _>(b_t, self.name(), |b| {
                    with_slice::<T, _>(grad, self.name(), |g| {
                        let d = b.len();
                        let mut db = vec![0f64; d];
                        let dx: Vec<T> = x.iter().zip(g).enumerate().map(|(i, (&v, &gv))| {
                            let pre = T::of(v.f() + b[i % d].f());
                            let dv = gelu_and_grad(pre, self.0).1.f() * gv.f();
                            db[i % d] += dv;
                            T::of(dv)
                        }).collect();
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
