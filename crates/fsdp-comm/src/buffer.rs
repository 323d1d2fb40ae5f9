//! [`Buffer`]: a typed buffer that a [`crate::Communicator`] moves, whatever the backend: host
//! vectors of each element type, and CUDA memory with the `nccl` feature. Carrying the dtype
//! in the value keeps the communicator trait object-safe, so the engine can hold any backend.

use half::{bf16, f16};

use crate::dtype::{DType, Element};

/// A buffer of one element type, in host memory or (feature `nccl`) on a CUDA device.
#[derive(Debug, Clone)]
pub enum Buffer {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// 64-bit floats.
    F64(Vec<f64>),
    /// IEEE halves.
    F16(Vec<f16>),
    /// bfloat16s.
    BF16(Vec<bf16>),
    /// 32-bit integers.
    I32(Vec<i32>),
    /// 64-bit integers.
    I64(Vec<i64>),
    /// Bytes.
    U8(Vec<u8>),
    /// Device memory (NCCL groups).
    #[cfg(feature = "nccl")]
    Cuda(crate::cuda_buffer::CudaBuffer),
}

/// Runs `$body` with `$v` bound to the host vector inside `$buf` (any element type);
/// `$cuda` is the value for a device buffer. Defined once per build of this crate (with and
/// without its `nccl` feature), so the match fits the enum whichever crate expands it.
#[cfg(feature = "nccl")]
#[macro_export]
#[doc(hidden)]
macro_rules! with_host_vec {
    ($buf:expr, $v:ident => $body:expr, cuda => $cuda:expr) => {
        match $buf {
            $crate::Buffer::F32($v) => $body,
            $crate::Buffer::F64($v) => $body,
            $crate::Buffer::F16($v) => $body,
            $crate::Buffer::BF16($v) => $body,
            $crate::Buffer::I32($v) => $body,
            $crate::Buffer::I64($v) => $body,
            $crate::Buffer::U8($v) => $body,
            $crate::Buffer::Cuda(_) => $cuda,
        }
    };
}

/// Runs `$body` with `$v` bound to the host vector inside `$buf` (any element type);
/// `$cuda` is the value for a device buffer (which this build has not).
#[cfg(not(feature = "nccl"))]
#[macro_export]
#[doc(hidden)]
macro_rules! with_host_vec {
    ($buf:expr, $v:ident => $body:expr, cuda => $cuda:expr) => {
        match $buf {
            $crate::Buffer::F32($v) => $body,
            $crate::Buffer::F64($v) => $body,
            $crate::Buffer::F16($v) => $body,
            $crate::Buffer::BF16($v) => $body,
            $crate::Buffer::I32($v) => $body,
            $crate::Buffer::I64($v) => $body,
            $crate::Buffer::U8($v) => $body,
        }
    };
}

impl Buffer {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F64(_) => DType::F64,
            Buffer::F16(_) => DType::F16,
            Buffer::BF16(_) => DType::BF16,
            Buffer::I32(_) => DType::I32,
            Buffer::I64(_) => DType::I64,
            Buffer::U8(_) => DType::U8,
            #[cfg(feature = "nccl")]
            Buffer::Cuda(b) => b.dtype(),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            #[cfg(feature = "nccl")]
            Buffer::Cuda(b) => b.len(),
            host => with_host_vec!(host, v => v.len(), cuda => 0),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the buffer lives in host memory.
    pub fn is_host(&self) -> bool {
        with_host_vec!(self, _v => true, cuda => false)
    }

    /// An empty host buffer of `dtype`.
    pub fn empty(dtype: DType) -> Buffer {
        Buffer::zeros(dtype, 0)
    }

    /// `len` zeros of `dtype` in host memory.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        match dtype {
            DType::F32 => Buffer::F32(vec![0.0; len]),
            DType::F64 => Buffer::F64(vec![0.0; len]),
            DType::F16 => Buffer::F16(vec![f16::ZERO; len]),
            DType::BF16 => Buffer::BF16(vec![bf16::ZERO; len]),
            DType::I32 => Buffer::I32(vec![0; len]),
            DType::I64 => Buffer::I64(vec![0; len]),
            DType::U8 => Buffer::U8(vec![0; len]),
        }
    }

    /// Room for an in-place all-gather's output ([`crate::Communicator::all_gather_in_place`]):
    /// `size` blocks of `k` elements of which `write` writes block `rank` (< `size`; given as
    /// uninitialised memory), the others left for the gather to write, so a rank's own block
    /// is produced where the gathered buffer holds it instead of being copied there.
    ///
    /// # Safety
    /// `write` must write every element of the slice it is given, and the buffer must go to
    /// an in-place all-gather before anything reads it (its other blocks are uninitialised
    /// until then; dropping it unread is fine).
    pub unsafe fn for_gather_in_place<T: BufferElement>(
        size: usize,
        rank: usize,
        k: usize,
        write: impl FnOnce(&mut [std::mem::MaybeUninit<T>]),
    ) -> Buffer {
        let total = size * k;
        let mut v: Vec<T> = Vec::with_capacity(total);
        write(&mut v.spare_capacity_mut()[rank * k..(rank + 1) * k]);
        // SAFETY: the capacity is `total`; block `rank` is written (the caller's promise), and
        // the caller lets only the gather, which writes every other block, read the rest.
        unsafe { v.set_len(total) };
        T::into_buffer(v)
    }

    /// The host vector of element type `T`, or the buffer back when it holds another type.
    pub fn into_vec<T: BufferElement>(self) -> Result<Vec<T>, Buffer> {
        T::from_buffer(self)
    }

    /// The host elements as `T`, if the buffer holds that type.
    pub fn as_slice<T: BufferElement>(&self) -> Option<&[T]> {
        T::slice_of(self)
    }

    /// A copy of the host elements in `range` (out-of-range ends clamped), `None` for a
    /// device buffer.
    pub fn copy_range(&self, range: std::ops::Range<usize>) -> Option<Buffer> {
        with_host_vec!(self, v => {
            let end = range.end.min(v.len());
            Some(Buffer::from(v[range.start.min(end)..end].to_vec()))
        }, cuda => None)
    }

    /// The host elements of `ranges`, one after another, in a new buffer of the same type;
    /// `None` for a device buffer or a range past the end.
    pub fn copy_ranges(
        &self,
        ranges: impl IntoIterator<Item = std::ops::Range<usize>>,
    ) -> Option<Buffer> {
        with_host_vec!(self, v => {
            let mut out = Vec::new();
            for r in ranges {
                out.extend_from_slice(v.get(r)?);
            }
            Some(Buffer::from(out))
        }, cuda => None)
    }

    /// The host elements seen as `rows` × `cols` equal blocks, row after row, copied column
    /// after column (block (r, c) moves to (c, r)); `None` for a device buffer or a length
    /// that `rows * cols` does not divide.
    pub fn transpose_blocks(&self, rows: usize, cols: usize) -> Option<Buffer> {
        with_host_vec!(self, v => {
            let n = rows * cols;
            if n == 0 || !v.len().is_multiple_of(n) {
                return None;
            }
            let k = v.len() / n;
            let mut out = Vec::with_capacity(v.len());
            for c in 0..cols {
                for r in 0..rows {
                    out.extend_from_slice(&v[(r * cols + c) * k..][..k]);
                }
            }
            Some(Buffer::from(out))
        }, cuda => None)
    }

    /// The host elements as `T`, writable, if the buffer holds that type.
    pub fn as_mut_slice<T: BufferElement>(&mut self) -> Option<&mut [T]> {
        T::slice_of_mut(self)
    }

    /// `values` converted to `dtype` (a float type), in host memory: the cast mixed precision
    /// applies before sending (f32 master shards gathered in bf16, say).
    pub fn from_f32(values: &[f32], dtype: DType) -> Option<Buffer> {
        use half::slice::HalfFloatSliceExt;
        Some(match dtype {
            DType::F32 => Buffer::F32(values.to_vec()),
            DType::F64 => Buffer::F64(values.iter().map(|&x| x as f64).collect()),
            DType::F16 => {
                let mut out = vec![f16::ZERO; values.len()];
                out.convert_from_f32_slice(values);
                Buffer::F16(out)
            }
            DType::BF16 => {
                let mut out = vec![bf16::ZERO; values.len()];
                out.convert_from_f32_slice(values);
                Buffer::BF16(out)
            }
            _ => return None,
        })
    }

    /// Adds `other` element-wise (host buffers of the same type and length: gradients
    /// accumulated before one reduction); false, leaving `self` as it was, otherwise.
    pub fn add_assign(&mut self, other: &Buffer) -> bool {
        fn add<T: Element>(a: &mut [T], b: &[T]) -> bool {
            if a.len() != b.len() {
                return false;
            }
            crate::dtype::reduce_into(a, b, crate::ReduceOp::Sum);
            true
        }
        match (self, other) {
            (Buffer::F32(a), Buffer::F32(b)) => add(a, b),
            (Buffer::F64(a), Buffer::F64(b)) => add(a, b),
            (Buffer::F16(a), Buffer::F16(b)) => add(a, b),
            (Buffer::BF16(a), Buffer::BF16(b)) => add(a, b),
            (Buffer::I32(a), Buffer::I32(b)) => add(a, b),
            (Buffer::I64(a), Buffer::I64(b)) => add(a, b),
            (Buffer::U8(a), Buffer::U8(b)) => add(a, b),
            _ => false,
        }
    }

    /// Writes the elements of a host float buffer, converted to f32, into `out` (same length);
    /// false for integer or device buffers and length mismatches.
    pub fn to_f32_into(&self, out: &mut [f32]) -> bool {
        use half::slice::HalfFloatSliceExt;
        if out.len() != self.len() {
            return false;
        }
        match self {
            Buffer::F32(v) => out.copy_from_slice(v),
            Buffer::F64(v) => out.iter_mut().zip(v).for_each(|(o, x)| *o = *x as f32),
            Buffer::F16(v) => v.convert_to_f32_slice(out),
            Buffer::BF16(v) => v.convert_to_f32_slice(out),
            _ => return false,
        }
        true
    }
}

/// An element type with its own [`Buffer`] variant: converts typed vectors to and from
/// buffers.
pub trait BufferElement: Element {
    /// `v` as a buffer.
    fn into_buffer(v: Vec<Self>) -> Buffer;
    /// The vector inside `b`, or `b` back when it holds another type.
    fn from_buffer(b: Buffer) -> Result<Vec<Self>, Buffer>;
    /// The elements of `b`, if it holds this type in host memory.
    fn slice_of(b: &Buffer) -> Option<&[Self]>;
    /// The elements of `b`, writable, if it holds this type in host memory.
    fn slice_of_mut(b: &mut Buffer) -> Option<&mut [Self]>;
}

macro_rules! buffer_element {
    ($t:ty, $variant:ident) => {
        impl From<Vec<$t>> for Buffer {
            fn from(v: Vec<$t>) -> Buffer {
                Buffer::$variant(v)
            }
        }

        impl BufferElement for $t {
            fn into_buffer(v: Vec<Self>) -> Buffer {
                Buffer::$variant(v)
            }

            fn from_buffer(b: Buffer) -> Result<Vec<Self>, Buffer> {
                match b {
                    Buffer::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }

            fn slice_of(b: &Buffer) -> Option<&[Self]> {
                match b {
                    Buffer::$variant(v) => Some(v),
                    _ => None,
                }
            }

            fn slice_of_mut(b: &mut Buffer) -> Option<&mut [Self]> {
                match b {
                    Buffer::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

buffer_element!(f32, F32);
buffer_element!(f64, F64);
buffer_element!(f16, F16);
buffer_element!(bf16, BF16);
buffer_element!(i32, I32);
buffer_element!(i64, I64);
buffer_element!(u8, U8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn casts_round_trip_through_half_precision() {
        let values = [1.0f32, -2.5, 0.333_333_34, 1e-3];
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let b = Buffer::from_f32(&values, dtype).unwrap();
            assert_eq!(b.dtype(), dtype);
            let mut back = [0f32; 4];
            assert!(b.to_f32_into(&mut back));
            let tol = match dtype {
                DType::BF16 => 4e-3,
                DType::F16 => 1e-3,
                _ => 1e-7,
            };
            for (a, b) in values.iter().zip(back) {
                assert!((a - b).abs() <= tol * a.abs(), "{dtype:?}: {a} vs {b}");
            }
        }
        assert!(Buffer::from_f32(&values, DType::I32).is_none());
        assert!(!Buffer::I32(vec![1; 4]).to_f32_into(&mut [0.0; 4]));
    }

    #[test]
    fn typed_access() {
        let b = Buffer::from(vec![1u8, 2, 3]);
        assert_eq!(b.as_slice::<u8>(), Some(&[1u8, 2, 3][..]));
        assert!(b.as_slice::<f32>().is_none());
        let b = b.into_vec::<f32>().unwrap_err();
        assert_eq!(b.into_vec::<u8>().unwrap(), vec![1, 2, 3]);
        assert_eq!(Buffer::zeros(DType::BF16, 3).len(), 3);
    }

    #[test]
    fn add_assign_sums_matching_buffers_only() {
        let mut a = Buffer::F32(vec![1.0, 2.0]);
        assert!(a.add_assign(&Buffer::F32(vec![0.5, -4.0])));
        assert_eq!(a.as_slice::<f32>(), Some(&[1.5f32, -2.0][..]));
        assert!(!a.add_assign(&Buffer::F32(vec![1.0])));
        assert!(!a.add_assign(&Buffer::from_f32(&[1.0, 1.0], DType::BF16).unwrap()));
        assert_eq!(a.as_slice::<f32>(), Some(&[1.5f32, -2.0][..]));
    }
}
