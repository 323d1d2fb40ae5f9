//! The AVX512_BF16 tile kernel: `vdpbf16ps` on broadcast lhs pairs and rhs strips, sums
//! in registers, and the vector write-back to bf16 or f32.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Dst, LhsStrip, LhsStrips, MR, NR, NV, Product};

/// The tiles of row strips `strips`, compiled for AVX512_BF16.
///
/// # Safety
/// As `gemm_with`; the CPU has AVX512F, AVX512BW, AVX512VL and AVX512_BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn tiles(p: &Product<'_>, lhs: &LhsStrips<'_>, strips: Range<usize>) {
    super::for_each_tile(p, lhs, strips, |a, b, i0, j0| {
        // SAFETY: the CPU has the features; the strips hold `kp` pairs; the tile is
        // inside the product.
        unsafe { tile(p, a, b, i0, j0) }
    });
}

/// One tile: its sums ([`sums`]) written as [`store`] says.
///
/// # Safety
/// As [`tiles`]; `a` reads `MR` rows and `b` holds `NR` u32 per pair.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn tile(p: &Product<'_>, a: LhsStrip, b: &[u32], i0: usize, j0: usize) {
    // SAFETY: forwarded; the tile's rows and columns are the caller's.
    unsafe {
        let acc = sums(p.strip_pairs, a, b);
        write_rows(p, &acc, i0, j0)
    }
}

/// A tile's sums: per pair of k, each row's pair broadcast and `vdpbf16ps` against the
/// strip's `NV` vectors. Its own function, returning the sums, so they stay in registers
/// from the first pair to the last (indexed by a run-time row count in the write-back,
/// they would be a stack array zeroed per tile by a call to memset).
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn sums(kp: usize, a: LhsStrip, b: &[u32]) -> [[__m512; NV]; MR] {
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    let b = b.as_ptr();
    debug_assert_eq!(a.block, 16 * a.pair, "a row's pairs run on across blocks");
    // Each row's first pair; a row advances by `a.pair` bytes a pair.
    let rows: [*const u8; MR] = std::array::from_fn(|r| a.at.wrapping_add(r * a.row));
    for q in 0..kp {
        // SAFETY: the strips hold `kp` pairs of `MR` and `NR` u32.
        unsafe {
            let mut bv = [_mm512_setzero_si512(); NV];
            for (v, bv) in bv.iter_mut().enumerate() {
                *bv = _mm512_loadu_si512(b.add(q * NR + 16 * v).cast());
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = rows[r].add(q * a.pair).cast::<i32>().read_unaligned();
                let x = bh(_mm512_set1_epi32(pair));
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_dpbf16_ps(*acc, x, bh(bv));
                }
            }
        }
    }
    acc
}

/// Writes a tile's sums, kept in memory by the AMX kernel (row-major, `NR` a row, as many
/// rows as the tile has), as [`tile`] writes its registers.
///
/// # Safety
/// As [`tiles`]; rows `i0..` and columns `j0..` are a tile of the product.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn write_tile(p: &Product<'_>, sums: &[f32], i0: usize, j0: usize) {
    for (r, row) in sums.chunks_exact(NR).take(p.m - i0).enumerate() {
        let acc: [__m512; NV] =
            // SAFETY: the row's `NR` = 16 `NV` sums are inside the slice.
            std::array::from_fn(|v| unsafe { _mm512_loadu_ps(row.as_ptr().add(16 * v)) });
        // SAFETY: forwarded; row i0 + r is below m.
        unsafe { write_rows(p, &[acc], i0 + r, j0) }
    }
}

/// The rows of sums `acc` (from row `i0`) inside the product to the destination, as
/// [`store`] says.
///
/// # Safety
/// As [`write_tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn write_rows(p: &Product<'_>, acc: &[[__m512; NV]], i0: usize, j0: usize) {
    let rows = acc.len().min(p.m - i0);
    let cols = NR.min(p.n - j0);
    let at = (i0 * p.dst_rs) + j0;
    for (r, acc) in acc.iter().enumerate().take(rows) {
        // SAFETY: row i0 + r < m and columns j0 .. j0 + cols <= n are the caller's.
        unsafe {
            match p.dst {
                Dst::Bf16(d) => store(p, acc, d.add(at + r * p.dst_rs), cols),
                Dst::F32(d) => store(p, acc, d.add(at + r * p.dst_rs), cols),
            }
        };
    }
}

/// A destination element type the write-back reads and writes 16 lanes of.
trait Lanes: Sized {
    /// The lanes of `at` under `mask`, as f32.
    ///
    /// # Safety
    /// The CPU has the kernel's features; `at` is valid for the masked lanes.
    unsafe fn load(at: *mut Self, mask: __mmask16) -> __m512;
    /// `x` into the lanes of `at` under `mask`.
    ///
    /// # Safety
    /// As [`Lanes::load`].
    unsafe fn store(at: *mut Self, mask: __mmask16, x: __m512);
}

impl Lanes for f32 {
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load(at: *mut f32, mask: __mmask16) -> __m512 {
        // SAFETY: as the caller vouches.
        unsafe { _mm512_maskz_loadu_ps(mask, at) }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store(at: *mut f32, mask: __mmask16, x: __m512) {
        // SAFETY: as the caller vouches.
        unsafe { _mm512_mask_storeu_ps(at, mask, x) }
    }
}

/// bf16 lanes widened as `simd::bf16_as_f32` and rounded as `simd::round_to_bf16` (to
/// nearest, ties to even, NaNs quiet).
impl Lanes for half::bf16 {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn load(at: *mut half::bf16, mask: __mmask16) -> __m512 {
        // SAFETY: as the caller vouches.
        widen(_mm512_cvtepu16_epi32(unsafe {
            _mm256_maskz_loadu_epi16(mask, at.cast::<i16>())
        }))
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn store(at: *mut half::bf16, mask: __mmask16, x: __m512) {
        // SAFETY: as the caller vouches.
        unsafe { _mm256_mask_storeu_epi16(at.cast::<i16>(), mask, round(x)) }
    }
}

/// Writes one tile row's sums to `out` (its first `cols` columns): scaled, added to the
/// destination when accumulating, in the destination's type.
///
/// # Safety
/// As [`tile`]; `out` is valid for `cols` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn store<D: Lanes>(p: &Product<'_>, acc: &[__m512; NV], out: *mut D, cols: usize) {
    let scale = _mm512_set1_ps(p.scale);
    for (v, &sum) in acc.iter().enumerate() {
        let first = 16 * v;
        if first >= cols {
            break;
        }
        let mask = column_mask(cols - first);
        // SAFETY: the mask covers only the columns below `cols`.
        unsafe {
            let at = out.add(first);
            let mut x = _mm512_mul_ps(sum, scale);
            if p.accumulate {
                x = _mm512_add_ps(x, D::load(at, mask));
            }
            D::store(at, mask, x);
        }
    }
}

/// The lanes of a 16-column vector below `left` columns.
#[inline(always)]
fn column_mask(left: usize) -> __mmask16 {
    if left >= 16 {
        0xffff
    } else {
        (1u16 << left) - 1
    }
}

/// bf16 bits (in the low half of each lane) as f32, a signalling NaN made quiet.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn widen(b: __m512i) -> __m512 {
    let nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(b, _mm512_set1_epi32(0x7fff)),
        _mm512_set1_epi32(0x7f80),
    );
    let b = _mm512_mask_or_epi32(b, nan, b, _mm512_set1_epi32(0x40));
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b))
}

/// f32 to bf16 bits: to nearest, ties to even; a NaN's top half made quiet.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn round(x: __m512) -> __m256i {
    let x = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
        x,
        _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)),
    ));
    let nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff)),
        _mm512_set1_epi32(0x7f80_0000),
    );
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
    _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
}

/// 32 packed bf16 as the instruction's operand type (the same 512 bits).
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are plain 512-bit vectors.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}
