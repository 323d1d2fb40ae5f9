//! Dropout whose mask is a pure function of (seed, element index): the backward pass
//! regenerates it instead of storing it, and a run is reproducible per rank and step.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, tensor, with_slice};

use crate::rng::{dropout_keep_into, dropout_threshold};

struct Dropout {
    p: f64,
    seed: u64,
}

/// Elements whose draws are made at a time (a stack buffer of flags).
const DRAWS: usize = 512;

impl Dropout {
    fn apply<T: Float>(&self, x: &[T]) -> Vec<T> {
        let scale = 1.0 / (1.0 - self.p);
        let threshold = dropout_threshold(self.p);
        let mut keep = [false; DRAWS];
        let mut out = Vec::with_capacity(x.len());
        for (c, chunk) in x.chunks(DRAWS).enumerate() {
            let keep = &mut keep[..chunk.len()];
            dropout_keep_into(self.seed, (c * DRAWS) as u64, threshold, keep);
            out.extend(chunk.iter().zip(keep.iter()).map(|(&v, &kept)| {
                if kept {
                    T::of(v.f() * scale)
                } else {
                    T::of(0.0)
                }
            }));
        }
        out
    }
}

impl CustomOp1 for Dropout {
    fn name(&self) -> &'static str {
        "seeded-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s.dtype(), self.name(), T => {
            let x = contiguous::<T>(s, l, self.name())?;
            Ok((T::storage(self.apply(x)), l.shape().clone()))
        })
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        float_dispatch!(grad.dtype(), self.name(), T => {
            with_slice::<T, _>(grad, self.name(), |g| tensor(self.apply(g), arg.shape(), arg).map(Some))
        })
    }
}

/// Zeroes each element with probability `p` and scales the rest by `1/(1-p)`; the mask is
/// determined by `seed` (derive it from the run seed, rank, step and call site).
pub fn dropout(x: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        return Err(candle_core::Error::Msg(format!(
            "dropout probability {p} is not in [0, 1)"
        )));
    }
    if p == 0.0 {
        return Ok(x.clone());
    }
    if !super::has_kernels(x) {
        return super::composed::dropout(x, p, seed);
    }
    x.contiguous()?.apply_op1(Dropout { p, seed })
}
