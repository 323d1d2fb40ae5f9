//! Between tensors and communication buffers: a parameter's gradient read in a buffer's
//! element type and packed into the ranks' blocks (the CPU data plane's and the row-sparse
//! reduction's), a collective's result read back as f32.

use candle_core::{CpuStorage, Storage, Tensor};
use fsdp_comm::{Buffer, BufferElement, DType};

use super::cpu_floats::float_pair;
use super::error::EngineError;
use super::plan::ShardLayout;

/// What is done with a parameter's full gradient once it is read as the elements of a
/// buffer's type (see [`visit_gradient`]).
pub(crate) trait GradientVisitor {
    /// Handles the gradient's elements `grad`, in `buffer`'s element type.
    fn visit<T: BufferElement>(self, grad: &[T], buffer: &mut Vec<T>);
}

/// Reads the full gradient of parameter `name` in `buffer`'s element type (cast if needed,
/// in place when it already is) and hands it to `visitor` with the buffer.
pub(crate) fn visit_gradient(
    name: &str,
    grad: &Tensor,
    buffer: &mut Buffer,
    visitor: impl GradientVisitor,
) -> Result<(), EngineError> {
    // A gradient on a GPU is read through host memory (the host-staged plane's reduction).
    let grad = grad
        .to_device(&candle_core::Device::Cpu)?
        .to_dtype(candle_dtype(buffer.dtype()))?
        .contiguous()?;
    let (storage, l) = grad.storage_and_layout();
    let unsupported = || EngineError::UnsupportedTensor {
        op: "gradient reduction",
        what: format!("the gradient of `{name}`"),
        found: format!("{:?} on {:?}", grad.dtype(), grad.device()),
        expected: "float gradients on the CPU",
    };
    let Storage::Cpu(cpu) = &*storage else {
        return Err(unsupported());
    };
    let (first, last) = l.contiguous_offsets().ok_or_else(unsupported)?;
    float_pair!(
        cpu,
        buffer,
        |g, b| {
            visitor.visit(&g[first..last], b);
            Ok(())
        },
        Err(unsupported())
    )
}

/// Writes a parameter's full gradient into its rows of every rank's block of `packed`.
pub(crate) fn pack_gradient(
    layout: &ShardLayout,
    grad: &Tensor,
    packed: &mut Buffer,
    block: usize,
    ranks: usize,
) -> Result<(), EngineError> {
    struct Pack<'a> {
        layout: &'a ShardLayout,
        block: usize,
        ranks: usize,
    }
    impl GradientVisitor for Pack<'_> {
        fn visit<T: BufferElement>(self, grad: &[T], packed: &mut Vec<T>) {
            self.layout.pack(grad, self.block, self.ranks, packed);
        }
    }
    let pack = Pack {
        layout,
        block,
        ranks,
    };
    visit_gradient(&layout.name, grad, packed, pack)
}

/// candle's dtype for a communication dtype (f32 for non-float ones).
pub(crate) fn candle_dtype(d: DType) -> candle_core::DType {
    match d {
        DType::F64 => candle_core::DType::F64,
        DType::F16 => candle_core::DType::F16,
        DType::BF16 => candle_core::DType::BF16,
        _ => candle_core::DType::F32,
    }
}

/// A collective's result as f32 values; another element type (a peer that sent another
/// dtype) is an error naming the op, never an empty vector.
pub(crate) fn f32_values(buffer: Buffer, op: &'static str) -> Result<Vec<f32>, EngineError> {
    buffer
        .into_vec::<f32>()
        .map_err(|b| EngineError::UnsupportedTensor {
            op,
            what: "the collective's result".into(),
            found: format!("{:?}", b.dtype()),
            expected: "f32 values",
        })
}
