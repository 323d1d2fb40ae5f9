//! Cross-entropy from logits with integer targets, `ignore_index`, label smoothing, and mean
//! or sum reduction (PyTorch's `F.cross_entropy` semantics). Forward keeps each row's
//! log-sum-exp, so backward takes one exponential per logit (`exp(x - lse)`); f32 logits go
//! through the vectorised exp of `simd`, sums in f64.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, rows, tensor, with_slice};

/// How per-sample losses are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Mean over the targets that are not ignored.
    Mean,
    /// Sum over the targets that are not ignored.
    Sum,
}

/// The loss settings.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropy {
    /// Targets equal to this contribute nothing (PyTorch's default is -100).
    pub ignore_index: i64,
    /// Weight moved from the target class to the uniform distribution.
    pub label_smoothing: f64,
    /// How losses are combined.
    pub reduction: Reduction,
}

impl Default for CrossEntropy {
    fn default() -> Self {
        CrossEntropy {
            ignore_index: -100,
            label_smoothing: 0.0,
            reduction: Reduction::Mean,
        }
    }
}

fn targets(s: &CpuStorage, l: &Layout) -> Result<Vec<i64>> {
    let (start, end) = l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("cross_entropy: targets must be contiguous".into())
    })?;
    Ok(match s {
        CpuStorage::I64(v) => v[start..end].to_vec(),
        CpuStorage::U32(v) => v[start..end].iter().map(|&t| t as i64).collect(),
        CpuStorage::U8(v) => v[start..end].iter().map(|&t| t as i64).collect(),
        other => {
            return Err(candle_core::Error::Msg(format!(
                "cross_entropy: targets must be integers, got {:?}",
                other.dtype()
            )));
        }
    })
}

impl CrossEntropy {
    pub(super) fn check(&self, t: i64, c: usize) -> Result<()> {
        if t != self.ignore_index && (t < 0 || t as usize >= c) {
            return Err(candle_core::Error::Msg(format!(
                "cross_entropy: target {t} is outside 0..{c}"
            )));
        }
        Ok(())
    }

    /// The reduced loss, and each row's log-sum-exp (NaN for ignored rows).
    pub(super) fn forward<T: Float>(
        &self,
        x: &[T],
        t: &[i64],
        c: usize,
    ) -> Result<(f64, Vec<f64>)> {
        let eps = self.label_smoothing;
        let mut total = 0.0;
        let mut count = 0usize;
        let mut lses = vec![f64::NAN; t.len()];
        let mut scratch = vec![T::of(0.0); c];
        for ((row, &target), lse_out) in x.chunks(c.max(1)).zip(t).zip(lses.iter_mut()) {
            self.check(target, c)?;
            if target == self.ignore_index {
                continue;
            }
            let max = row.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.f()));
            scratch.copy_from_slice(row);
            T::exp_rows_minus(&mut scratch, &[max], c);
            let lse = max + scratch.iter().map(|v| v.f()).sum::<f64>().ln();
            *lse_out = lse;
            let nll = lse - row[target as usize].f();
            let smooth = if eps > 0.0 {
                lse - row.iter().map(|v| v.f()).sum::<f64>() / c as f64
            } else {
                0.0
            };
            total += (1.0 - eps) * nll + eps * smooth;
            count += 1;
        }
        let loss = match self.reduction {
            Reduction::Sum => total,
            // PyTorch returns NaN for a mean over zero targets.
            Reduction::Mean => total / count as f64,
        };
        Ok((loss, lses))
    }

    /// The logits' gradient from the rows' saved log-sum-exps: `(softmax - q) * scale`.
    pub(super) fn backward<T: Float>(
        &self,
        x: &[T],
        t: &[i64],
        c: usize,
        g: f64,
        lses: &[f64],
    ) -> Vec<T> {
        let eps = self.label_smoothing;
        let count = t.iter().filter(|&&v| v != self.ignore_index).count();
        let scale = match self.reduction {
            Reduction::Sum => g,
            Reduction::Mean => g / count as f64,
        };
        let mut dx = vec![T::of(0.0); x.len()];
        let rows = x
            .chunks(c.max(1))
            .zip(t)
            .zip(dx.chunks_mut(c.max(1)))
            .zip(lses);
        for (((row, &target), dr), &lse) in rows {
            if target == self.ignore_index {
                continue;
            }
            dr.copy_from_slice(row);
            T::exp_rows_minus(dr, &[lse], c);
            for (j, o) in dr.iter_mut().enumerate() {
                let q = (1.0 - eps) * f64::from(u8::from(j == target as usize)) + eps / c as f64;
                *o = T::of((o.f() - q) * scale);
            }
        }
        dx
    }
}

/// The op: the settings and the rows' log-sum-exps forward saves for backward.
struct CrossEntropyOp {
    settings: CrossEntropy,
    lses: Mutex<Vec<f64>>,
}

impl CustomOp2 for CrossEntropyOp {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let t = targets(s2, l2)?;
        let (n, c) = rows(l1.shape());
        if l1.shape().rank() != 2 || t.len() != n {
            return Err(candle_core::Error::Msg(format!(
                "cross_entropy: logits must be [N, C] and targets [N]; got {:?} and {} targets",
                l1.shape().dims(),
                t.len()
            )));
        }
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let (loss, lses) = self.settings.forward(x, &t, c)?;
            *self.lses.lock().unwrap_or_else(|e| e.into_inner()) = lses;
            Ok((T::storage(vec![T::of(loss)]), Shape::from(())))
        })
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        t_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let t: Vec<i64> = t_t.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?;
        let (_, c) = rows(x_t.shape());
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let lses = self.lses.lock().unwrap_or_else(|e| e.into_inner());
        if lses.len() != t.len() {
            return Err(candle_core::Error::Msg(
                "cross_entropy: backward without a matching forward".into(),
            ));
        }
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(x_t, self.name(), |x| {
                let dx = self.settings.backward(x, &t, c, g, &lses);
                Ok((Some(tensor(dx, x_t.shape(), x_t)?), None))
            })
        })
    }
}

/// Cross-entropy of `logits` `[N, C]` against integer `targets` `[N]` (u8, u32 or i64), as a
/// scalar, with a hand-written backward for the logits. Half-precision logits are taken in
/// f32 (as autocast does): the loss is an f32 scalar and its gradient flows back in the
/// logits' dtype.
///
/// ```
/// use fsdp_nn::candle::{Device, Tensor};
/// use fsdp_nn::ops::{CrossEntropy, cross_entropy};
///
/// let logits = Tensor::new(&[[2.0f32, 0.0], [0.0, 2.0]], &Device::Cpu)?;
/// let targets = Tensor::new(&[0u32, 1], &Device::Cpu)?;
/// // PyTorch's F.cross_entropy(logits, targets): mean over the rows.
/// let loss = cross_entropy(&logits, &targets, CrossEntropy::default())?.to_scalar::<f32>()?;
/// assert!((loss - (1.0 + (-2.0f32).exp()).ln()).abs() < 1e-6);
/// # Ok::<(), fsdp_nn::candle::Error>(())
/// ```
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, settings: CrossEntropy) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::has_cuda_kernels(logits) {
        return super::gpu_losses::cross_entropy(logits, targets, settings);
    }
    if !super::has_kernels(logits) {
        return super::composed::cross_entropy(
            logits,
            targets,
            settings.ignore_index,
            settings.label_smoothing,
            settings.reduction == Reduction::Mean,
        );
    }
    let logits = match logits.dtype() {
        DType::BF16 | DType::F16 => logits.to_dtype(DType::F32)?,
        _ => logits.contiguous()?,
    };
    let op = CrossEntropyOp {
        settings,
        lses: Mutex::new(Vec::new()),
    };
    logits.apply_op2(&targets.contiguous()?, op)
}
