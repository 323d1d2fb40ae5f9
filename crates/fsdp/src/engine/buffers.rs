//! Between tensors and communication buffers: a parameter's gradient read in a buffer's
//! element type and packed into the ranks' blocks (the CPU data plane's and the row-sparse
//! reduction's: [`GradPack`], written once, converted as it is written), a collective's
//! result read back as f32.

use std::mem::MaybeUninit;
use std::ops::Range;

use candle_core::{CpuStorage, Storage, Tensor};
use fsdp_comm::{Buffer, BufferElement, DType, with_host_vec};

use super::cpu_floats::float_pair;
use super::error::{EngineError, unit_name};
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
    read: impl FnOnce(&CpuStorage, Range<usize>, &dyn Fn() -> EngineError) -> Result<R, EngineError>,
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

/// A unit's gradients packed as its reduction takes them (`ranks` blocks of `block`
/// elements in the reduction's dtype) while backward delivers them: each parameter's rows
/// are written once into reserved memory that is never zero-filled first, and what no
/// gradient wrote (the shards' padding rows, parameters without a gradient) is zeroed when
/// the pack is finished.
pub(crate) struct GradPack {
    /// The elements: reserved and written in place while empty; once every element is
    /// written (the gaps zeroed), `ranks * block` long.
    buffer: Buffer,
    block: usize,
    ranks: usize,
    /// The runs written so far, while the buffer is empty.
    written: Vec<Range<usize>>,
}

impl GradPack {
    /// An empty pack of `ranks` blocks of `block` elements of `dtype`.
    pub fn new(dtype: DType, block: usize, ranks: usize) -> GradPack {
        let mut buffer = Buffer::empty(dtype);
        with_host_vec!(&mut buffer, v => v.reserve_exact(block * ranks), cuda => ());
        GradPack {
            buffer,
            block,
            ranks,
            written: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.block * self.ranks
    }

    /// Writes a parameter's full gradient into its rows of every rank's block.
    pub fn add(&mut self, layout: &ShardLayout, grad: &Tensor) -> Result<(), EngineError> {
        if layout.offset + layout.shard_numel() > self.block {
            return Err(EngineError::UnsupportedTensor {
                op: "gradient packing",
                what: format!("the gradient of `{}`", layout.name),
                found: format!(
                    "rows at {}..{} of a rank's block",
                    layout.offset,
                    layout.offset + layout.shard_numel()
                ),
                expected: "rows inside the unit's gradient block",
            });
        }
        let host = on_host(grad)?;
        let mut runs = Runs {
            layout,
            block: self.block,
            ranks: self.ranks,
            written: &mut self.written,
        };
        // A gradient in another dtype than the reduction's (bf16 compute reduced in f32, or
        // the reverse) is converted as it is packed, by the vector kernels: no converted copy
        // of it.
        let buffer = &mut self.buffer;
        let converted = with_elements(&layout.name, &host, |cpu, range, _| {
            Ok(match (cpu, &mut *buffer) {
                (CpuStorage::BF16(g), Buffer::F32(p)) => {
                    runs.fill(&g[range], p, bf16_to_f32_into);
                    true
                }
                (CpuStorage::F32(g), Buffer::BF16(p)) => {
                    runs.fill(&g[range], p, f32_to_bf16_into);
                    true
                }
                _ => false,
            })
        })?;
        if converted {
            return Ok(());
        }
        visit_gradient(&layout.name, &host, buffer, runs)
    }

    /// Zeroes what no gradient wrote: from now on every element is initialised.
    fn make_whole(&mut self) {
        if self.buffer.len() == self.len() {
            return;
        }
        self.written.sort_by_key(|r| r.start);
        let mut gaps = Vec::new();
        let mut at = 0;
        for run in &self.written {
            if run.start > at {
                gaps.push(at..run.start);
            }
            at = at.max(run.end);
        }
        let len = self.len();
        if at < len {
            gaps.push(at..len);
        }
        with_host_vec!(&mut self.buffer, v => zero_gaps(v, len, &gaps), cuda => ());
        self.written = Vec::new();
    }

    /// `self += part` (a parameter's gradients read in several places, or carried from
    /// backwards without sync), an error naming `op` and the unit at `unit_path` when their
    /// dtypes or sizes differ.
    pub fn add_assign(
        &mut self,
        part: &Buffer,
        op: &'static str,
        unit_path: &str,
    ) -> Result<(), EngineError> {
        self.make_whole();
        if self.buffer.add_assign(part) {
            return Ok(());
        }
        Err(EngineError::UnsupportedTensor {
            op,
            what: format!("the gradients of {}", unit_name(unit_path)),
            found: format!("{:?} x {}", part.dtype(), part.len()),
            expected: "the unit's gradient pack's dtype and size",
        })
    }

    /// The pack, every element written: what no gradient wrote is zero.
    pub fn finish(mut self) -> Buffer {
        self.make_whole();
        self.buffer
    }
}

/// A pack's `len` elements to be written: the reserved capacity of an empty vector, or the
/// elements of a whole one (then only initialised values are written through them).
fn slots<T>(v: &mut Vec<T>, len: usize) -> &mut [MaybeUninit<T>] {
    if v.len() == len {
        let v = &mut v[..len];
        // SAFETY: `MaybeUninit<T>` has `T`'s layout, and the pack writes only `T` values
        // through the view, so the vector stays initialised.
        unsafe { &mut *(v as *mut [T] as *mut [MaybeUninit<T>]) }
    } else {
        &mut v.spare_capacity_mut()[..len]
    }
}

/// Where one parameter's gradient goes in a pack being filled (`ranks` blocks of `block`),
/// and the record of the runs written.
struct Runs<'a> {
    layout: &'a ShardLayout,
    block: usize,
    ranks: usize,
    written: &'a mut Vec<Range<usize>>,
}

impl Runs<'_> {
    /// Writes the gradient's `values` into its runs of `packed` with `write`, recording each.
    fn fill<S, T>(
        &mut self,
        values: &[S],
        packed: &mut Vec<T>,
        write: impl Fn(&[S], &mut [MaybeUninit<T>]),
    ) {
        let pack = slots(packed, self.block * self.ranks);
        let written = &mut *self.written;
        (self.layout).pack_runs(0, values.len(), self.block, self.ranks, |from, to| {
            write(&values[from], &mut pack[to.clone()]);
            written.push(to);
        });
    }
}

impl GradientVisitor for Runs<'_> {
    fn visit<T: BufferElement>(mut self, grad: &[T], packed: &mut Vec<T>) {
        self.fill(grad, packed, write_copy);
    }
}

/// `dst = src` (of one length) into memory that may be uninitialised.
pub(crate) fn write_copy<T: Copy>(src: &[T], dst: &mut [MaybeUninit<T>]) {
    let n = dst.len().min(src.len());
    // SAFETY: both are valid for `n` elements and cannot overlap (`dst` is borrowed
    // mutably); `MaybeUninit<T>` has `T`'s layout.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<T>(), n) }
}

/// Zeroes the `gaps` of an empty vector's first `len` reserved elements, the rest having
/// been written, and sets its length to `len`.
fn zero_gaps<T: Copy + Default>(v: &mut Vec<T>, len: usize, gaps: &[Range<usize>]) {
    let slots = &mut v.spare_capacity_mut()[..len];
    for gap in gaps {
        slots[gap.clone()].fill(MaybeUninit::new(T::default()));
    }
    // SAFETY: every element below `len` is written: by a run of the pack or as a gap.
    unsafe { v.set_len(len) };
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

    /// 5 rows of 3 over 2 ranks: 3 rows each, rank 1's last one padding, the parameter
    /// 2 elements into each rank's block of 12 (the first 2 and last 1 written by no one).
    fn layout(name: &str, offset: usize) -> ShardLayout {
        ShardLayout {
            name: name.into(),
            shape: vec![5, 3],
            requires_grad: true,
            sparse_grad: false,
            rows_per_rank: 3,
            row_elems: 3,
            offset,
            packing: None,
        }
    }

    /// Values bf16 rounds (ties, halfway and far from it, a NaN, an infinity, a tiny one).
    fn values() -> Vec<f32> {
        let mut values: Vec<f32> = (0..15).map(|i| i as f32 * 0.3791 - 2.17).collect();
        values[3] = f32::from_bits(0x3f80_8000); // a tie, to even (down)
        values[4] = f32::from_bits(0x3f81_8000); // a tie, to even (up)
        values[7] = f32::NAN;
        values[8] = f32::NEG_INFINITY;
        values[11] = 1e-41;
        values
    }

    /// What a pack of `grad` laid out as `layout` must hold: candle's conversion of it to
    /// `reduce`, packed over zeros.
    fn packed_by_candle(layout: &ShardLayout, grad: &Tensor, reduce: DType) -> Buffer {
        let (block, ranks) = (12, 2);
        let mut want = Buffer::zeros(reduce, block * ranks);
        let converted = grad.to_dtype(candle_dtype(reduce)).unwrap();
        let converted = converted.flatten_all().unwrap();
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
        want
    }

    #[test]
    fn a_gradient_packs_as_its_copy_converted_to_the_reductions_dtype() {
        let layout = layout("w", 2);
        let cpu = Device::Cpu;
        let transposed = Tensor::from_vec(values(), (3, 5), &cpu)
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
                    Tensor::from_vec(values(), (5, 3), &cpu).unwrap()
                } else {
                    transposed.clone()
                };
                let grad = grad.to_dtype(grad_dtype).unwrap();
                let want = packed_by_candle(&layout, &grad, reduce);
                let mut pack = GradPack::new(reduce, 12, 2);
                pack.add(&layout, &grad).unwrap();
                let got = pack.finish();
                let case = format!("{grad_dtype:?} into {reduce:?}, contiguous {contiguous}");
                assert_eq!(got.len(), 24, "{case}");
                assert_eq!(bits(&got), bits(&want), "{case}");
            }
        }
    }

    #[test]
    fn what_no_gradient_wrote_is_zero_and_parts_add_to_a_partial_pack() {
        // Two parameters' places in blocks of 21: `a` at 2, `b` at 11, a gap between them
        // and after; only `a` receives a gradient before the pack is summed with a part,
        // then `b` receives one.
        let (a, b) = (layout("a", 2), layout("b", 11));
        let grad = Tensor::from_vec(values(), (5, 3), &Device::Cpu).unwrap();
        let mut pack = GradPack::new(DType::F32, 21, 2);
        pack.add(&a, &grad).unwrap();
        let part = Buffer::F32((0..42).map(|i| i as f32).collect());
        pack.add_assign(&part, "test", "u").unwrap();
        pack.add(&b, &grad).unwrap();
        let got = pack.finish().into_vec::<f32>().unwrap();
        let mut want = vec![0f32; 42];
        let v = values();
        a.pack(&v, 21, 2, &mut want);
        want.iter_mut().zip(0..).for_each(|(w, i)| *w += i as f32);
        b.pack(&v, 21, 2, &mut want);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
        // A pack nothing was written into is all zeros.
        let empty = GradPack::new(DType::BF16, 7, 3).finish();
        let empty = empty.into_vec::<half::bf16>().unwrap();
        assert!(empty.len() == 21 && empty.iter().all(|x| x.to_bits() == 0));
        // A part of another size is an error naming the op and the unit.
        let mut pack = GradPack::new(DType::F32, 4, 1);
        let e = pack.add_assign(&part, "summing", "layers.0").unwrap_err();
        assert!(
            e.to_string().contains("summing") && e.to_string().contains("layers.0"),
            "{e}"
        );
    }

    #[test]
    fn a_parameter_outside_the_block_is_an_error_naming_it() {
        let grad = Tensor::from_vec(values(), (5, 3), &Device::Cpu).unwrap();
        let mut pack = GradPack::new(DType::F32, 12, 2);
        let e = pack.add(&layout("big", 4), &grad).unwrap_err().to_string();
        assert!(e.contains("`big`") && e.contains("4..13"), "{e}");
    }
}
