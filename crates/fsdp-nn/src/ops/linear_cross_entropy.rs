//! A language model's output projection and its cross-entropy as one op: the logits
//! (`hidden · weightᵀ`, tokens × vocabulary — the largest activation of a small LM) are made a
//! few rows at a time and never kept. Forward computes each chunk's loss and, while the
//! chunk is at hand, its gradient, folding it into the gradients of the hidden states and of
//! the weight; backward only scales those by the upstream gradient. The arithmetic per row is
//! [`super::cross_entropy`]'s, so the loss is the unfused one's.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::cross_entropy::{CrossEntropy, Reduction};
use super::{Float, contiguous, float_dispatch, gemm_acc_into};

/// Logit elements made at once (rows of the vocabulary's width): 32 MiB of f32.
const CHUNK_ELEMS: usize = 8 << 20;

/// The op: the settings, the targets, and the gradients forward leaves for backward (at an
/// upstream gradient of one).
struct LinearCrossEntropyOp {
    settings: CrossEntropy,
    targets: Vec<i64>,
    /// Which gradients forward forms: (hidden states, weight). A frozen head (LoRA's) or an
    /// evaluation forms neither the [V, H] weight gradient nor its product.
    wanted: (bool, bool),
    grads: Mutex<Option<(Option<Tensor>, Option<Tensor>)>>,
}

/// The loss of `x` [n, h] projected by `w` [v, h] against `t`, and its gradients with
/// respect to `x` and `w` at an upstream gradient of one (each only if `wanted`; empty
/// otherwise). Logits, their gradient and the
/// gradients' sums are kept in `T::Acc` (f32 for half precision, whose operands the
/// products read in their own type), the gradients rounded to `T` once at the end.
fn loss_and_grads<T: Float>(
    settings: &CrossEntropy,
    x: &[T],
    w: &[T],
    t: &[i64],
    (n, h, v): (usize, usize, usize),
    (want_x, want_w): (bool, bool),
) -> Result<(f64, Vec<T>, Vec<T>)> {
    let count = t.iter().filter(|&&t| t != settings.ignore_index).count();
    // Chunks are summed, then scaled as the reduction asks: the per-row terms are the
    // unfused op's.
    let summed = CrossEntropy {
        reduction: Reduction::Sum,
        ..*settings
    };
    let scale = match settings.reduction {
        Reduction::Sum => 1.0,
        Reduction::Mean => 1.0 / count as f64,
    };
    let rows = (CHUNK_ELEMS / v.max(1)).clamp(1, n.max(1));
    let zero = T::Acc::of(0.0);
    let mut gx = vec![zero; if want_x { n * h } else { 0 }];
    let mut gw = vec![zero; if want_w { v * h } else { 0 }];
    let mut logits = Vec::new();
    let mut total = 0.0;
    for r0 in (0..n).step_by(rows) {
        let m = rows.min(n - r0);
        let xc = &x[r0 * h..(r0 + m) * h];
        let tc = &t[r0..r0 + m];
        logits.resize(m * v, zero);
        gemm_acc_into((m, v, h), &mut logits, v, false, (xc, h, 1), (w, 1, h), 1.0);
        let (part, lses) = summed.forward(&logits, tc, v)?;
        total += part;
        if !(want_x || want_w) {
            continue;
        }
        let dz = summed.backward(&logits, tc, v, scale, &lses);
        // The logits' gradient as the products' operand type (rounded once for half
        // precision; borrowed otherwise).
        let dz = T::from_acc(&dz);
        if want_x {
            let gx = &mut gx[r0 * h..];
            gemm_acc_into((m, h, v), gx, h, false, (&dz, v, 1), (w, h, 1), 1.0);
        }
        if want_w {
            gemm_acc_into((v, h, m), &mut gw, h, r0 > 0, (&dz, 1, v), (xc, h, 1), 1.0);
        }
    }
    let loss = match settings.reduction {
        Reduction::Sum => total,
        // PyTorch returns NaN for a mean over zero targets.
        Reduction::Mean => total / count as f64,
    };
    Ok((loss, T::from_acc_vec(gx), T::from_acc_vec(gw)))
}

impl CustomOp2 for LinearCrossEntropyOp {
    fn name(&self) -> &'static str {
        "fused-linear-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (xd, wd) = (l1.shape().dims(), l2.shape().dims());
        let ([n, h], [v, h2]) = (xd, wd) else {
            return Err(candle_core::Error::Msg(format!(
                "linear_cross_entropy: hidden states must be [N, H] and the weight [V, H]; got {xd:?} and {wd:?}"
            )));
        };
        if h != h2 || self.targets.len() != *n || s1.dtype() != s2.dtype() {
            return Err(candle_core::Error::Msg(format!(
                "linear_cross_entropy: hidden states {xd:?} ({:?}), weight {wd:?} ({:?}) and {} targets do not fit",
                s1.dtype(),
                s2.dtype(),
                self.targets.len()
            )));
        }
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let w = contiguous::<T>(s2, l2, self.name())?;
            let dims = (*n, *h, *v);
            let (loss, gx, gw) =
                loss_and_grads(&self.settings, x, w, &self.targets, dims, self.wanted)?;
            let device = candle_core::Device::Cpu;
            let (want_x, want_w) = self.wanted;
            let grads = (
                want_x.then(|| Tensor::from_vec(gx, (*n, *h), &device)).transpose()?,
                want_w.then(|| Tensor::from_vec(gw, (*v, *h), &device)).transpose()?,
            );
            *self.grads.lock().unwrap_or_else(|e| e.into_inner()) = Some(grads);
            // The loss in `T::Acc`: f32 for half-precision inputs.
            let loss = <T as Float>::Acc::of(loss);
            Ok((<<T as Float>::Acc as Float>::storage(vec![loss]), Shape::from(())))
        })
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let (gx, gw) = self
            .grads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(
                    "linear_cross_entropy: backward without a matching forward".into(),
                )
            })?;
        if g == 1.0 {
            return Ok((gx, gw));
        }
        let scaled = |t: Option<Tensor>| t.map(|t| t.affine(g, 0.0)).transpose();
        Ok((scaled(gx)?, scaled(gw)?))
    }
}

/// Cross-entropy of the logits `hidden · weightᵀ` (`hidden` [N, H], `weight` [V, H]) against
/// integer `targets` `[N]`, as a scalar, without keeping the `[N, V]` logits or their gradient:
/// what `cross_entropy(&hidden.matmul(&weight.t()?)?, targets, settings)` gives, with memory
/// for a few rows of logits at a time. Gradients flow to both `hidden` and `weight`;
/// half-precision inputs are multiplied in their own type with f32 logits, and the loss is
/// an f32 scalar.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    settings: CrossEntropy,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::has_cuda_kernels(hidden) {
        return super::gpu_losses::linear_cross_entropy(hidden, weight, targets, settings);
    }
    if !super::has_kernels(hidden) {
        let logits = super::composed::project(hidden, weight, true, None, None)?;
        return super::composed::cross_entropy(
            &logits,
            targets,
            settings.ignore_index,
            settings.label_smoothing,
            settings.reduction == super::Reduction::Mean,
        );
    }
    let targets: Vec<i64> = targets.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?;
    let op = LinearCrossEntropyOp {
        settings,
        targets,
        wanted: (hidden.track_op(), weight.track_op()),
        grads: Mutex::new(None),
    };
    hidden.contiguous()?.apply_op2(&weight.contiguous()?, op)
}
