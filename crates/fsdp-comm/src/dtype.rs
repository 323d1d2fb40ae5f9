//! Element types that collectives move and reduce.

use std::mem::MaybeUninit;

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
    fn each<T: Element>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = f(*d, *s));
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each(dst, src, T::add),
        ReduceOp::Max => each(dst, src, max_of),
        ReduceOp::Min => each(dst, src, min_of),
    }
}

/// [`reduce_into`] and then [`finish_avg`] over `ranks`, in one pass: bit for bit the two.
pub(crate) fn reduce_into_finished<T: Element>(
    dst: &mut [T],
    src: &[T],
    op: ReduceOp,
    ranks: usize,
) {
    if op == ReduceOp::Avg {
        let average = |(d, s): (&mut T, &T)| *d = T::div(T::add(*d, *s), ranks);
        dst.iter_mut().zip(src).for_each(average);
    } else {
        reduce_into(dst, src, op);
    }
}

/// Writes `a` combined with `b` element-wise into `dst`, finished: [`reduce_into`] of `b`
/// into a copy of `a` and then [`finish_avg`] over `ranks`, bit for bit, without the copy or
/// a second pass (an average is divided as it is written). `dst` need not be initialised:
/// every element of it is written.
pub fn reduce_pair_into<T: Element>(
    dst: &mut [MaybeUninit<T>],
    a: &[T],
    b: &[T],
    op: ReduceOp,
    ranks: usize,
) {
    fn each<T: Element>(dst: &mut [MaybeUninit<T>], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
        dst.iter_mut().zip(a.iter().zip(b)).for_each(|(d, (x, y))| {
            d.write(f(*x, *y));
        });
    }
    match op {
        ReduceOp::Sum => each(dst, a, b, T::add),
        ReduceOp::Avg => each(dst, a, b, |x, y| T::div(T::add(x, y), ranks)),
        ReduceOp::Max => each(dst, a, b, max_of),
        ReduceOp::Min => each(dst, a, b, min_of),
    }
}

/// [`reduce_pair_into`] with stores that bypass the cache where the CPU has them (f32 sums
/// and averages on x86_64; the rest as [`reduce_pair_into`]): its result, every number bit
/// for bit (of two NaNs added, which one's payload passes on is the compiler's choice in
/// either).
pub(crate) fn reduce_pair_streaming<T: Element>(
    dst: &mut [MaybeUninit<T>],
    a: &[T],
    b: &[T],
    op: ReduceOp,
    ranks: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == DType::F32 && matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        use std::arch::x86_64::{
            _mm_add_ps, _mm_div_ps, _mm_loadu_ps, _mm_set1_ps, _mm_sfence, _mm_stream_ps,
        };
        let n = dst.len().min(a.len()).min(b.len());
        // SAFETY: `T` is f32 (its wire tag says so: only f32 carries it).
        let (dst, a, b) = unsafe {
            (
                std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<MaybeUninit<f32>>(), n),
                std::slice::from_raw_parts(a.as_ptr().cast::<f32>(), n),
                std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), n),
            )
        };
        let (head, body) = vector_split(dst.as_ptr(), n, 4);
        reduce_pair_into(&mut dst[..head], &a[..head], &b[..head], op, ranks);
        // SAFETY: SSE is part of x86_64; `dst[head..]` is 16-byte aligned and all three hold
        // `head + body` elements; unaligned loads.
        unsafe {
            let (d, x, y) = (
                dst.as_mut_ptr().add(head).cast::<f32>(),
                a.as_ptr().add(head),
                b.as_ptr().add(head),
            );
            // Divided as `finish_avg` divides an f32: by the group size as an f32.
            let divisor = _mm_set1_ps(ranks as f32);
            let average = op == ReduceOp::Avg;
            for i in (0..body).step_by(4) {
                let sum = _mm_add_ps(_mm_loadu_ps(x.add(i)), _mm_loadu_ps(y.add(i)));
                _mm_stream_ps(
                    d.add(i),
                    if average {
                        _mm_div_ps(sum, divisor)
                    } else {
                        sum
                    },
                );
            }
            _mm_sfence();
        }
        let rest = head + body;
        reduce_pair_into(&mut dst[rest..n], &a[rest..n], &b[rest..n], op, ranks);
        return;
    }
    reduce_pair_into(dst, a, b, op, ranks)
}

/// `s` where it is greater than `d`, else `d` (so a NaN `s` keeps `d`).
#[inline]
fn max_of<T: Element>(d: T, s: T) -> T {
    if s > d { s } else { d }
}

/// `s` where it is less than `d`, else `d`.
#[inline]
fn min_of<T: Element>(d: T, s: T) -> T {
    if s < d { s } else { d }
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

/// Writes `src` into `dst` (the same length), which need not be initialised:
/// `<[MaybeUninit<T>]>::write_copy_of_slice`, stable only after this crate's minimum Rust.
pub(crate) fn write_copy<T: Copy>(dst: &mut [MaybeUninit<T>], src: &[T]) {
    debug_assert_eq!(dst.len(), src.len());
    let n = dst.len().min(src.len());
    // SAFETY: both are valid for `n` elements, and they cannot overlap: `dst` is borrowed
    // mutably.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<T>(), n) }
}

/// How `n` elements from `dst` split for 16-byte vector stores of `lanes` elements: the
/// elements before its first 16-byte boundary (all `n` where there is none), then the most
/// whole vectors that follow; the rest is the tail.
#[cfg(target_arch = "x86_64")]
fn vector_split<T>(dst: *const T, n: usize, lanes: usize) -> (usize, usize) {
    let head = dst.align_offset(16).min(n);
    (head, (n - head) / lanes * lanes)
}

/// Collectives that write at least this many bytes into their destination write them past
/// the cache ([`stream_copy`], [`reduce_pair_streaming`]): a destination this large mostly
/// leaves the cache before anyone reads it, and a cached store first reads each line it is
/// about to overwrite.
pub(crate) const STREAM_BYTES: usize = 4 << 20;

/// Copies `src` into `dst` (the same length) with stores that bypass the cache where the
/// CPU has them: for destinations much larger than the cache, which the copy would only
/// fill with lines evicted unread (and read each line first to write it).
pub(crate) fn stream_copy(dst: &mut [MaybeUninit<u8>], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let n = dst.len().min(src.len());
        let (head, body) = vector_split(dst.as_ptr(), n, 16);
        write_copy(&mut dst[..head], &src[..head]);
        // SAFETY: SSE2 is part of x86_64; `dst[head..]` is 16-byte aligned and both slices
        // hold `head + body` bytes; unaligned loads from `src`.
        unsafe {
            let (d, s) = (
                dst.as_mut_ptr().add(head).cast::<__m128i>(),
                src.as_ptr().add(head).cast::<__m128i>(),
            );
            for i in 0..body / 16 {
                _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i)));
            }
            _mm_sfence();
        }
        write_copy(&mut dst[head + body..n], &src[head + body..n]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    write_copy(dst, src);
}

/// `buf` as elements to be written, for code that also writes into uninitialised memory.
///
/// # Safety
/// Only initialised values are written through the result.
pub(crate) unsafe fn as_uninit_mut<T>(buf: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: `MaybeUninit<T>` has `T`'s layout; the caller writes only initialised values.
    unsafe { &mut *(buf as *mut [T] as *mut [MaybeUninit<T>]) }
}

/// The bytes of a buffer of possibly uninitialised elements, to be written.
pub(crate) fn uninit_bytes_mut<T: Element>(buf: &mut [MaybeUninit<T>]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: `Element` types have no padding, so the bytes are exactly the elements'; any
    // bytes written make valid elements.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast(), std::mem::size_of_val(buf)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Awkward values: rounding-sensitive sums, signed zeros, infinities and NaNs.
    fn awkward(seed: u32, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                match i % 11 {
                    0 => f32::NAN,
                    1 => -0.0,
                    2 => f32::INFINITY,
                    _ => f32::from_bits(x) % 1e6,
                }
            })
            .collect()
    }

    #[test]
    fn reducing_a_pair_into_a_third_buffer_is_reducing_into_a_copy_bit_for_bit() {
        let (a, b) = (awkward(1, 1000), awkward(2, 1000));
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut want = a.clone();
            reduce_into(&mut want, &b, op);
            finish_avg(&mut want, op, 3);
            let mut got = vec![MaybeUninit::new(7.0); a.len()];
            reduce_pair_into(&mut got, &a, &b, op, 3);
            // SAFETY: every element was initialised (7.0) before the reduction wrote it.
            let got: Vec<f32> = got.iter().map(|v| unsafe { v.assume_init() }).collect();
            // Every number bit for bit, a NaN as a NaN (its payload is the compiler's choice
            // of operand order).
            let bits = |v: &[f32]| {
                let number = |x: &f32| Some(x.to_bits()).filter(|_| !x.is_nan());
                v.iter().map(number).collect::<Vec<_>>()
            };
            assert_eq!(bits(&got), bits(&want), "{op:?}");
            let mut in_place = a.clone();
            reduce_into_finished(&mut in_place, &b, op, 3);
            assert_eq!(bits(&in_place), bits(&want), "{op:?} in place");
        }
        let (x, y) = (vec![bf16::from_f32(1.0); 4], vec![bf16::from_f32(1e-3); 4]);
        let mut want = x.clone();
        reduce_into(&mut want, &y, ReduceOp::Sum);
        let mut got = Vec::with_capacity(4);
        reduce_pair_into(&mut got.spare_capacity_mut()[..4], &x, &y, ReduceOp::Sum, 2);
        // SAFETY: the reduction wrote all four.
        unsafe { got.set_len(4) };
        assert_eq!(got, want);
    }

    /// What the streaming writes leave is what the cached ones do, every number bit for bit,
    /// at every misalignment of the destination (its 16-byte-aligned middle streamed, the
    /// edges not) and lengths on either side of a vector's width.
    #[test]
    fn streaming_writes_are_the_cached_writes_bit_for_bit() {
        // Every number bit for bit; a NaN only as a NaN (which operand's payload an add
        // passes on depends on the order the compiler gives the operands).
        let bits = |v: &[MaybeUninit<f32>]| {
            // SAFETY: every element was initialised before the writes under test.
            let value = |x: &MaybeUninit<f32>| unsafe { x.assume_init() };
            v.iter()
                .map(|x| Some(value(x).to_bits()).filter(|_| !value(x).is_nan()))
                .collect::<Vec<_>>()
        };
        let lengths = [0, 1, 3, 4, 5, 15, 16, 17, 63, 64, 65, 1000, 4099];
        for skip in 0..4 {
            for &len in &lengths {
                let (a, b) = (awkward(3, len + skip), awkward(4, len));
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    let mut want = vec![MaybeUninit::new(7.0f32); len + skip];
                    reduce_pair_into(&mut want[skip..], &a[skip..], &b, op, 3);
                    let mut got = vec![MaybeUninit::new(7.0f32); len + skip];
                    reduce_pair_streaming(&mut got[skip..], &a[skip..], &b, op, 3);
                    assert_eq!(bits(&got), bits(&want), "{op:?}, length {len}, skip {skip}");
                }
            }
        }
        // Other element types take the cached path: the same result.
        let (x, y) = ([1.5f64, -2.0, 3.25], [0.5f64, 2.0, f64::NAN]);
        let mut got = [MaybeUninit::new(0.0f64); 3];
        reduce_pair_streaming(&mut got, &x, &y, ReduceOp::Sum, 2);
        // SAFETY: initialised above.
        let got = got.map(|v| unsafe { v.assume_init() });
        assert_eq!((got[0], got[1]), (2.0, 0.0));
        assert!(got[2].is_nan());

        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        for skip in 0..17 {
            for &len in lengths.iter().chain(&[4096 - skip, 5000 - skip]) {
                let mut dst = vec![MaybeUninit::new(0xAAu8); len + skip + 3];
                stream_copy(&mut dst[skip..skip + len], &src[..len]);
                // SAFETY: initialised above.
                let dst: Vec<u8> = dst.iter().map(|v| unsafe { v.assume_init() }).collect();
                assert!(
                    dst[..skip].iter().all(|&v| v == 0xAA),
                    "before, skip {skip}"
                );
                assert_eq!(
                    &dst[skip..skip + len],
                    &src[..len],
                    "length {len}, skip {skip}"
                );
                assert!(
                    dst[skip + len..].iter().all(|&v| v == 0xAA),
                    "after, skip {skip}"
                );
            }
        }
    }
}
