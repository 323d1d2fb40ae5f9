//! Between tensors and communication buffers: a parameter's gradient read in a buffer's
//! element type and packed into the ranks' blocks (the CPU data plane's and the row-sparse
//! reduction's), a collective's result read back as f32.

use candle_core::{CpuStorage, Storage, Tensor};
use fsdp_comm::{Buffer, BufferElement, DType};

use super::cpu_floats::float_pair;
use super::error::EngineError;
use super::plan::ShardLayout;
use crate::nn::ops::{bf16_to_f32_into, f32_to_bf16_into};

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
    let grad = on_host(grad)?.to_dtype(candle_dtype(buffer.dtype()))?;
    with_elements(name, &grad, |cpu, range, unsupported| {
        float_pair!(
            cpu,
            buffer,
            |g, b| {
                visitor.visit(&g[range], b);
                Ok(())
            },
            Err(unsupported())
        )
    })
}

/// The gradient in host memory (a gradient on a GPU is read through it: the host-staged
/// plane's reduction), contiguous.
fn on_host(grad: &Tensor) -> Result<Tensor, EngineError> {
    Ok(grad.to_device(&candle_core::Device::Cpu)?.contiguous()?)
}

/// Runs `read` on the storage of `grad`, a contiguous tensor in host memory, and the range
/// of its elements there, with the error to return for a gradient the reduction cannot
/// take.
fn with_elements<R>(
    name: &str,
    grad: &Tensor,
    read: impl FnOnce(
        &CpuStorage,
        std::ops::Range<usize>,
        &dyn Fn() -> EngineError,
    ) -> Result<R, EngineError>,
) -> Result<R, EngineError> {
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
    read(cpu, first..last, &unsupported)
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
    let host = on_host(grad)?;
    // A gradient in another dtype than the reduction's (bf16 compute reduced in f32, or the
    // reverse) is converted as it is packed, by the vector kernels: no converted copy of it.
    let converted = with_elements(&layout.name, &host, |cpu, range, _| {
        Ok(match (cpu, &mut *packed) {
            (CpuStorage::BF16(g), Buffer::F32(p)) => {
                layout.pack_converted(&g[range], block, ranks, p, bf16_to_f32_into);
                true
            }
            (CpuStorage::F32(g), Buffer::BF16(p)) => {
                layout.pack_converted(&g[range], block, ranks, p, f32_to_bf16_into);
                true
            }
            _ => false,
        })
    })?;
    if converted {
        return Ok(());
    }
    let pack = Pack {
        layout,
        block,
        ranks,
    };
    visit_gradient(&layout.name, &host, packed, pack)
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

#[cfg(test)]
mod tests {
    use candle_core::{DType as TensorDType, Device};

    use super::*;

    /// Each element's bits, whatever the buffer's float type (padding and all).
    fn bits(b: &Buffer) -> Vec<u64> {
        match b {
            Buffer::F32(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
            Buffer::BF16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
            Buffer::F16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
            other => panic!("not a float buffer: {:?}", other.dtype()),
        }
    }

    #[test]
    fn a_gradient_packs_as_its_copy_converted_to_the_reductions_dtype() {
        // 5 rows of 3 over 2 ranks: 3 rows each, rank 1's last one padding, the parameter
        // 2 elements into each rank's block of 12.
        let layout = ShardLayout {
            name: "w".into(),
            shape: vec![5, 3],
            requires_grad: true,
            sparse_grad: false,
            rows_per_rank: 3,
            row_elems: 3,
            offset: 2,
            packing: None,
        };
        let (block, ranks) = (12, 2);
        // Values bf16 rounds (ties, halfway and far from it, a NaN, an infinity, a tiny one).
        let mut values: Vec<f32> = (0..15).map(|i| i as f32 * 0.3791 - 2.17).collect();
        values[3] = f32::from_bits(0x3f80_8000); // a tie, to even (down)
        values[4] = f32::from_bits(0x3f81_8000); // a tie, to even (up)
        values[7] = f32::NAN;
        values[8] = f32::NEG_INFINITY;
        values[11] = 1e-41;
        let cpu = Device::Cpu;
        let transposed = Tensor::from_vec(values.clone(), (3, 5), &cpu)
            .unwrap()
            .t()
            .unwrap();
        let cases = [
            (TensorDType::BF16, DType::F32),
            (TensorDType::F32, DType::BF16),
            (TensorDType::F16, DType::F32),
            (TensorDType::F32, DType::F32),
        ];
        for (grad_dtype, reduce) in cases {
            for contiguous in [true, false] {
                let grad = if contiguous {
                    Tensor::from_vec(values.clone(), (5, 3), &cpu).unwrap()
                } else {
                    transposed.clone()
                };
                let grad = grad.to_dtype(grad_dtype).unwrap();
                // What the pack must hold: the gradient converted by candle, then packed,
                // over a buffer of NaNs (the padding and the other rows must keep them).
                let nan = Buffer::from_f32(&vec![f32::NAN; block * ranks], reduce).unwrap();
                let converted = grad.to_dtype(candle_dtype(reduce)).unwrap();
                let converted = converted.flatten_all().unwrap();
                let mut want = nan.clone();
                match (&mut want, converted.dtype()) {
                    (Buffer::F32(w), TensorDType::F32) => {
                        layout.pack(&converted.to_vec1::<f32>().unwrap(), block, ranks, w)
                    }
                    (Buffer::BF16(w), TensorDType::BF16) => {
                        let v = converted.to_vec1::<half::bf16>().unwrap();
                        layout.pack(&v, block, ranks, w)
                    }
                    _ => unreachable!(),
                }
                let mut got = nan.clone();
                pack_gradient(&layout, &grad, &mut got, block, ranks).unwrap();
                let case = format!("{grad_dtype:?} into {reduce:?}, contiguous {contiguous}");
                assert_eq!(bits(&got), bits(&want), "{case}");
                assert_ne!(bits(&got), bits(&nan), "{case}: nothing packed");
            }
        }
    }
}
