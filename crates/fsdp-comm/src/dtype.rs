//! Element types that collectives move and reduce.

use half::{bf16, f16};

/// The element types collectives accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// 32-bit float.
    F32 = 1,
    /// 64-bit float.
    F64 = 2,
    /// IEEE half.
    F16 = 3,
    /// bfloat16.
    BF16 = 4,
    /// 32-bit signed integer.
    I32 = 5,
    /// 64-bit signed integer.
    I64 = 6,
    /// Byte.
    U8 = 7,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Decodes the wire tag.
    pub fn from_u8(v: u8) -> Option<DType> {
        [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I32,
            DType::I64,
            DType::U8,
        ]
        .into_iter()
        .find(|d| *d as u8 == v)
    }
}

/// How values from all ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum.
    Sum = 1,
    /// Mean over ranks (sum, then divide by the group size; integer types truncate).
    Avg = 2,
    /// Maximum.
    Max = 3,
    /// Minimum.
    Min = 4,
}

/// An element type: plain old data with the arithmetic reductions need.
///
/// # Safety
/// Implementors must be plain old data: any bit pattern of `size_of::<Self>()` bytes is a
/// valid value, with no padding, so buffers can be sent as bytes.
pub unsafe trait Element: Copy + Send + Sync + Default + PartialOrd + 'static {
    /// The wire tag.
    const DTYPE: DType;
    /// `a + b`.
    fn add(a: Self, b: Self) -> Self;
    /// `a / n` for averaging.
    fn div(a: Self, n: usize) -> Self;
}

macro_rules! element {
    ($t:ty, $d:ident, $add:expr, $div:expr) => {
        unsafe impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline]
            fn add(a: Self, b: Self) -> Self {
                #[allow(clippy::redundant_closure_call)]
                ($add)(a, b)
            }
            #[inline]
            fn div(a: Self, n: usize) -> Self {
                #[allow(clippy::redundant_closure_call)]
                ($div)(a, n)
            }
        }
    };
}

element!(f32, F32, |a: f32, b: f32| a + b, |a: f32, n: usize| a / n
    as f32);
element!(f64, F64, |a: f64, b: f64| a + b, |a: f64, n: usize| a / n
    as f64);
element!(
    f16,
    F16,
    |a: f16, b: f16| f16::from_f32(a.to_f32() + b.to_f32()),
    |a: f16, n: usize| f16::from_f32(a.to_f32() / n as f32)
);
element!(
    bf16,
    BF16,
    |a: bf16, b: bf16| bf16::from_f32(a.to_f32() + b.to_f32()),
    |a: bf16, n: usize| bf16::from_f32(a.to_f32() / n as f32)
);
element!(
    i32,
    I32,
    |a: i32, b: i32| a.wrapping_add(b),
    |a: i32, n: usize| a / n as i32
);
element!(
    i64,
    I64,
    |a: i64, b: i64| a.wrapping_add(b),
    |a: i64, n: usize| a / n as i64
);
element!(
    u8,
    U8,
    |a: u8, b: u8| a.wrapping_add(b),
    |a: u8, n: usize| a / n as u8
);

/// Combines `src` into `dst` element-wise (`Avg` accumulates as `Sum`; divide at the end).
pub fn reduce_into<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => dst
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = T::add(*d, *s)),
        ReduceOp::Max => dst.iter_mut().zip(src).for_each(|(d, s)| {
            if *s > *d {
                *d = *s
            }
        }),
        ReduceOp::Min => dst.iter_mut().zip(src).for_each(|(d, s)| {
            if *s < *d {
                *d = *s
            }
        }),
    }
}

/// Finishes an average by dividing by the group size.
pub fn finish_avg<T: Element>(buf: &mut [T], op: ReduceOp, n: usize) {
    if op == ReduceOp::Avg {
        buf.iter_mut().for_each(|v| *v = T::div(*v, n));
    }
}

/// The bytes of a buffer of elements.
pub fn as_bytes<T: Element>(buf: &[T]) -> &[u8] {
    // SAFETY: `Element` types are plain old data without padding.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast(), std::mem::size_of_val(buf)) }
}

/// The bytes of a buffer of elements, writable.
pub fn as_bytes_mut<T: Element>(buf: &mut [T]) -> &mut [u8] {
    // SAFETY: `Element` types are plain old data; every byte pattern is a valid value.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast(), std::mem::size_of_val(buf)) }
}
