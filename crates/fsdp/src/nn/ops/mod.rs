//! Fused training kernels as candle custom ops, each with a hand-written, slice-based
//! backward that records no graph (candle-nn's fast layer_norm and softmax have no backward
//! at all, and candle's composed backward formulas are slow and memory-hungry).

mod cross_entropy;
mod dropout;
mod gelu;
mod linear;
mod norm;
mod simd;
mod softmax;

pub use cross_entropy::{CrossEntropy, Reduction, cross_entropy};
pub use dropout::dropout;
pub use gelu::{GeluApprox, bias_gelu, gelu};
pub use linear::linear;
pub use norm::{layer_norm, rms_norm};
pub use softmax::softmax_last_dim;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};

/// The float types the kernels run in.
pub trait Float: candle_core::WithDType + Copy + Send + Sync + 'static {
    /// Borrows the contiguous elements of a storage of this type.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    /// Wraps a vector as a storage.
    fn storage(v: Vec<Self>) -> CpuStorage;
    /// To f64 for accumulation.
    fn f(self) -> f64;
    /// From f64.
    fn of(v: f64) -> Self;
}

impl Float for f32 {
    fn slice(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
    fn storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F32(v)
    }
    #[inline]
    fn f(self) -> f64 {
        self as f64
    }
    #[inline]
    fn of(v: f64) -> Self {
        v as f32
    }
}

impl Float for f64 {
    fn slice(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::F64(v) => Some(v),
            _ => None,
        }
    }
    fn storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F64(v)
    }
    #[inline]
    fn f(self) -> f64 {
        self
    }
    #[inline]
    fn of(v: f64) -> Self {
        v
    }
}

/// The contiguous elements of a CPU storage under `layout`.
fn contiguous<'a, T: Float>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [T]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: input must be contiguous")))?;
    let all = T::slice(s).ok_or_else(|| {
        candle_core::Error::Msg(format!("{op}: unexpected dtype {:?}", s.dtype()))
    })?;
    Ok(&all[start..end])
}

/// Runs `f` on the contiguous CPU elements of `t`.
fn with_slice<T: Float, R>(t: &Tensor, op: &str, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(contiguous::<T>(s, layout, op)?),
        _ => Err(candle_core::Error::Msg(format!(
            "{op}: only CPU tensors are supported"
        ))),
    }
}

/// A new, untracked tensor (gradients built this way record no graph).
fn tensor<T: Float>(v: Vec<T>, shape: &Shape, like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(v, shape, like.device())
}

/// Dispatches on the float dtype of a tensor.
macro_rules! float_dispatch {
    ($dtype:expr, $op:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $T = f64;
                $body
            }
            other => Err(candle_core::Error::Msg(format!(
                "{}: unsupported dtype {other:?} (f32 or f64)",
                $op
            ))),
        }
    };
}
use float_dispatch;

/// Rows of the last dimension: (number of rows, row length).
fn rows(shape: &Shape) -> (usize, usize) {
    let dims = shape.dims();
    let d = dims.last().copied().unwrap_or(1);
    (shape.elem_count() / d.max(1), d)
}
