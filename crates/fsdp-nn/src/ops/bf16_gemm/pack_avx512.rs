//! The packings' AVX-512 forms: a transposed operand's pairs turned into strips by 16×16
//! transposes of u32 in registers, and two rows of k interleaved into pairs 16 columns at
//! a time. The scalar forms in `mod.rs` pack everything these leave (edges, odd k, strided
//! operands) and are what the tests compare these with, element for element.

use std::arch::x86_64::*;

/// Pairs `0..pairs` of `len` contiguous columns whose rows of k start at `first`, `step`
/// elements apart: pair `p` is `out[p * stride + c] = row(2p)[c] | row(2p + 1)[c] << 16`.
///
/// # Safety
/// The CPU has AVX512F, AVX512BW and AVX512VL; rows `0..2 * pairs` are valid for `len`
/// reads, `out` for `len` writes at each pair's offset.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn interleave(
    first: *const u16,
    step: usize,
    pairs: usize,
    len: usize,
    (out, stride): (*mut u32, usize),
) {
    for c in (0..len).step_by(16) {
        let left = len - c;
        let mask: __mmask16 = if left >= 16 { 0xffff } else { (1 << left) - 1 };
        for p in 0..pairs {
            // SAFETY: the mask covers only columns below `len` of rows below `2 * pairs`.
            unsafe {
                let lo = first.add(2 * p * step + c);
                let l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo.cast()));
                let hi = lo.add(step).cast();
                let h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, hi));
                let pair = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
                _mm512_mask_storeu_epi32(out.add(p * stride + c).cast(), mask, pair);
            }
        }
    }
}

/// Column `c`'s 16 pairs from `first`: `first[c]` points at them (16 contiguous u32); they
/// become row `q` of `out` (`out_stride` u32 apart), column `c`, for `c`, `q` below 16.
///
/// # Safety
/// The CPU has AVX512F; each `first[c]` is valid for 16 u32 reads (unaligned), `out` for
/// 16 rows of 16 u32 writes `out_stride` apart.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose16(first: &[*const u32; 16], out: *mut u32, out_stride: usize) {
    // SAFETY: as the caller vouches.
    let r: [__m512i; 16] = std::array::from_fn(|c| unsafe { _mm512_loadu_si512(first[c].cast()) });
    // Within each 128-bit lane l (pairs 4l..4l+4): t[2i] holds columns 2i, 2i+1 of pairs
    // 4l, 4l+1, t[2i+1] of pairs 4l+2, 4l+3.
    let t: [__m512i; 16] = std::array::from_fn(|x| {
        let (a, b) = (r[x & !1], r[x | 1]);
        if x % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // u[4g + e], lane l: columns 4g..4g+4 of pair 4l + e.
    let u: [__m512i; 16] = std::array::from_fn(|x| {
        let (g, e) = (x / 4, x % 4);
        let (a, b) = (t[4 * g + e / 2], t[4 * g + 2 + e / 2]);
        if e % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    for e in 0..4 {
        let (a, b, c, d) = (u[e], u[4 + e], u[8 + e], u[12 + e]);
        // Lanes (a0, a1, b0, b1), (a2, a3, b2, b3) and the same of c, d.
        let ab01 = _mm512_shuffle_i32x4::<0b01_00_01_00>(a, b);
        let ab23 = _mm512_shuffle_i32x4::<0b11_10_11_10>(a, b);
        let cd01 = _mm512_shuffle_i32x4::<0b01_00_01_00>(c, d);
        let cd23 = _mm512_shuffle_i32x4::<0b11_10_11_10>(c, d);
        // Pair 4l + e is lane l of a, b, c, d side by side.
        let rows = [
            _mm512_shuffle_i32x4::<0b10_00_10_00>(ab01, cd01),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(ab01, cd01),
            _mm512_shuffle_i32x4::<0b10_00_10_00>(ab23, cd23),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(ab23, cd23),
        ];
        for (l, row) in rows.into_iter().enumerate() {
            // SAFETY: row 4l + e < 16 of `out`, as the caller vouches.
            unsafe { _mm512_storeu_si512(out.add((4 * l + e) * out_stride).cast(), row) };
        }
    }
}
