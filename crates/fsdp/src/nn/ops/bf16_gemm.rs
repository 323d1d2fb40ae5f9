//! The bf16 GEMM for CPUs with AVX512_BF16, whose `vdpbf16ps` adds two bf16 products into
//! each f32 lane: the operands are packed as bf16 pairs (half the bytes of the f32 copies
//! the portable path makes), products are summed in f32 over all of k, and each result is
//! rounded to bf16 once, as in the portable path. CPUs without the instruction take
//! `half_float`'s path (the f32 GEMM on widened operands).
//!
//! Packing, blocking and the write-back are one code for every kernel. The tests run them
//! on every CPU with a scalar kernel of the instruction's arithmetic, and the instruction's
//! kernel where the CPU has it (`tools/avx512bf16_emulated.sh` runs them in an emulator of
//! such a CPU).

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::ops::Range;

use half::bf16;

use super::simd::{bf16_as_f32, round_to_bf16};

/// Rows of the product one tile computes: one broadcast per row and pair of k.
const MR: usize = 12;
/// Columns of the product one tile computes: two vectors of 16 f32 lanes, so a tile keeps
/// 24 accumulators of the 32 vector registers in flight.
const NR: usize = 32;
/// Bytes of packed rhs strips one block holds (in L2) while every row strip passes over it.
const RHS_BLOCK_BYTES: usize = 512 * 1024;

/// One tile's f32 sums, row-major, `NR` per row.
type Tile = [f32; MR * NR];

/// A tile kernel: the sums of one packed lhs strip times one packed rhs strip.
type Dot = unsafe fn(&[u32], &[u16], &mut Tile);

/// Whether this CPU has the instruction the kernel needs.
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst[m×n] = (dst if accumulate) + scale · lhs[m×k] · rhs[k×n]` with the AVX512_BF16
/// kernel; operands as in `matmul::gemm_raw`, which has checked them.
///
/// # Safety
/// As `matmul::gemm_raw`; and the CPU has the instruction ([`available`]).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn gemm(
    mnk: (usize, usize, usize),
    dst: *mut bf16,
    dst_rs: usize,
    accumulate: bool,
    lhs: (&[bf16], usize, usize),
    rhs: (&[bf16], usize, usize),
    scale: f64,
) {
    // SAFETY: forwarded from the caller, who vouches for the CPU.
    unsafe { gemm_with(avx512::tiles, mnk, dst, dst_rs, accumulate, lhs, rhs, scale) }
}

/// The packed operands and where their product goes, shared by the threads computing it.
struct Product<'a> {
    lhs: &'a [u32],
    rhs: &'a [u16],
    /// Pairs of k (k rounded up to even: a zero pads an odd k).
    kp: usize,
    m: usize,
    n: usize,
    dst: *mut bf16,
    dst_rs: usize,
    accumulate: bool,
    scale: f32,
}

// SAFETY: the threads sharing a product write disjoint row strips of `dst` (the caller of
// `gemm_with` vouches for the memory) and only read the rest.
unsafe impl Sync for Product<'_> {}

/// Computes and writes the tiles of row strips `strips` (a kernel's entry point, compiled
/// with its instructions).
type Tiles = unsafe fn(&Product<'_>, Range<usize>);

/// Packs the operands and runs `tiles` over the row strips, split across the compute
/// threads.
///
/// # Safety
/// As [`gemm`], for the instructions `tiles` uses.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_with(
    tiles: Tiles,
    (m, n, k): (usize, usize, usize),
    dst: *mut bf16,
    dst_rs: usize,
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[bf16], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[bf16], usize, usize),
    scale: f64,
) {
    if m == 0 || n == 0 {
        return;
    }
    let lhs = pack_lhs(lhs, m, k, lhs_rs, lhs_cs);
    let rhs = pack_rhs(rhs, k, n, rhs_rs, rhs_cs);
    let product = Product {
        lhs: &lhs,
        rhs: &rhs,
        kp: k.div_ceil(2),
        m,
        n,
        dst,
        dst_rs,
        accumulate,
        scale: scale as f32,
    };
    let strips = m.div_ceil(MR);
    let threads = candle_core::utils::get_num_threads().clamp(1, strips);
    if threads == 1 {
        // SAFETY: forwarded from the caller.
        return unsafe { tiles(&product, 0..strips) };
    }
    let per_thread = strips.div_ceil(threads);
    rayon::scope(|scope| {
        for first in (0..strips).step_by(per_thread) {
            let product = &product;
            // SAFETY: forwarded from the caller; each range's rows are its own.
            scope
                .spawn(move |_| unsafe { tiles(product, first..(first + per_thread).min(strips)) });
        }
    });
}

/// The lhs (m×k, strides `rs`, `cs`) as strips of `MR` rows; in a strip, for each pair of
/// k, each row's (k, k+1) elements as one u32 (k in the low half): what the kernel
/// broadcasts. Rows past m and an odd k's last pair are padded with zeros.
fn pack_lhs(v: &[bf16], m: usize, k: usize, rs: usize, cs: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let mut out = vec![0u32; m.div_ceil(MR) * kp * MR];
    let mut put = |i: usize, kk: usize| {
        let at = (i / MR) * kp * MR + (kk / 2) * MR + i % MR;
        out[at] |= u32::from(v[i * rs + kk * cs].to_bits()) << (16 * (kk % 2));
    };
    // Read the operand in its contiguous direction.
    if cs == 1 {
        (0..m).for_each(|i| (0..k).for_each(|kk| put(i, kk)));
    } else {
        (0..k).for_each(|kk| (0..m).for_each(|i| put(i, kk)));
    }
    out
}

/// The rhs (k×n, strides `rs`, `cs`) as strips of `NR` columns; in a strip, for each pair
/// of k, the columns' (k, k+1) elements interleaved: the two vectors the kernel multiplies.
/// Columns past n and an odd k's last row are padded with zeros.
fn pack_rhs(v: &[bf16], k: usize, n: usize, rs: usize, cs: usize) -> Vec<u16> {
    let kp = k.div_ceil(2);
    let mut out = vec![0u16; n.div_ceil(NR) * kp * NR * 2];
    let mut put = |kk: usize, j: usize| {
        let at = ((j / NR) * kp + kk / 2) * NR * 2 + 2 * (j % NR) + kk % 2;
        out[at] = v[kk * rs + j * cs].to_bits();
    };
    if cs == 1 {
        (0..k).for_each(|kk| (0..n).for_each(|j| put(kk, j)));
    } else {
        (0..n).for_each(|j| (0..k).for_each(|kk| put(kk, j)));
    }
    out
}

/// Computes the tiles of row strips `strips` with `dot` and writes them: rhs strips in
/// blocks of about `RHS_BLOCK_BYTES`, each block passed over by every row strip in turn.
/// Inlined into each kernel's entry point, so the write-back is compiled with its
/// instructions too.
///
/// # Safety
/// As [`gemm_with`], for the instructions `dot` uses.
#[inline(always)]
unsafe fn tiles_with(dot: Dot, p: &Product<'_>, strips: Range<usize>) {
    let lhs_strip = p.kp * MR;
    let rhs_strip = p.kp * NR * 2;
    let rhs_strips = p.n.div_ceil(NR);
    let block = (RHS_BLOCK_BYTES / (rhs_strip * 2).max(1)).max(1);
    let mut tile = [0f32; MR * NR];
    for first in (0..rhs_strips).step_by(block) {
        for s in strips.clone() {
            let a = &p.lhs[s * lhs_strip..(s + 1) * lhs_strip];
            for t in first..(first + block).min(rhs_strips) {
                let b = &p.rhs[t * rhs_strip..(t + 1) * rhs_strip];
                // SAFETY: forwarded from the caller.
                unsafe { dot(a, b, &mut tile) };
                // SAFETY: the tile's rows and columns are inside the product.
                unsafe { store_tile(p, &tile, s * MR, t * NR) };
            }
        }
    }
}

/// Writes the part of `tile` inside the product at row `i0`, column `j0`: scaled, added to
/// the destination when accumulating, rounded to bf16 by the rule every bf16 conversion
/// here shares (`simd::round_to_bf16`).
///
/// # Safety
/// `dst` is valid as [`gemm`] says.
#[inline(always)]
unsafe fn store_tile(p: &Product<'_>, tile: &Tile, i0: usize, j0: usize) {
    let cols = NR.min(p.n - j0);
    for r in 0..MR.min(p.m - i0) {
        let sums = &tile[r * NR..r * NR + cols];
        // SAFETY: row i0 + r < m, columns j0 .. j0 + cols <= n.
        let out = unsafe { p.dst.add((i0 + r) * p.dst_rs + j0) };
        for (j, &sum) in sums.iter().enumerate() {
            let mut v = sum * p.scale;
            // SAFETY: as above; read only when accumulating, when the caller vouches for it.
            unsafe {
                if p.accumulate {
                    v += bf16_as_f32(out.add(j).read());
                }
                out.add(j).write(round_to_bf16(v));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_loadu_si512, _mm512_set1_epi32,
        _mm512_setzero_ps, _mm512_storeu_ps,
    };
    use std::ops::Range;

    use super::{MR, NR, Product, Tile};

    /// The packing-shared tile loop compiled for AVX512_BF16.
    ///
    /// # Safety
    /// As `tiles_with`; the CPU has AVX512F, AVX512BW and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn tiles(p: &Product<'_>, strips: Range<usize>) {
        // SAFETY: forwarded; `dot` needs the features this function is compiled with.
        unsafe { super::tiles_with(dot, p, strips) }
    }

    /// Sums of an `MR`-row lhs strip times an `NR`-column rhs strip: per pair of k, each
    /// row's pair broadcast and `vdpbf16ps` against the strip's two vectors.
    ///
    /// # Safety
    /// The CPU has AVX512F, AVX512BW and AVX512_BF16; `a` holds `MR` u32 and `b` `2 NR` u16 per pair.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn dot(a: &[u32], b: &[u16], tile: &mut Tile) {
        let pairs = a.len() / MR;
        debug_assert_eq!(b.len(), pairs * NR * 2);
        let mut acc = [_mm512_setzero_ps(); 2 * MR];
        for p in 0..pairs {
            // SAFETY: the strips hold `pairs` pairs; each vector is 32 u16 of `b`.
            let (b0, b1) = unsafe {
                let at = b.as_ptr().add(p * NR * 2);
                (
                    bh(_mm512_loadu_si512(at.cast())),
                    bh(_mm512_loadu_si512(at.add(NR).cast())),
                )
            };
            for r in 0..MR {
                // SAFETY: p * MR + r < a.len().
                let pair = unsafe { *a.get_unchecked(p * MR + r) };
                let a = bh(_mm512_set1_epi32(pair as i32));
                acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], a, b0);
                acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], a, b1);
            }
        }
        for (r, row) in tile.chunks_exact_mut(NR).enumerate() {
            // SAFETY: a row of the tile is two vectors of 16 f32.
            unsafe {
                _mm512_storeu_ps(row.as_mut_ptr(), acc[2 * r]);
                _mm512_storeu_ps(row.as_mut_ptr().add(16), acc[2 * r + 1]);
            }
        }
    }

    /// 32 packed bf16 as the instruction's operand type (the same 512 bits).
    #[inline(always)]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: both are plain 512-bit vectors.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The instruction's arithmetic per Intel's definition of `vdpbf16ps`: per lane, the
    /// odd pair's product and then the even pair's added to the f32 sum (bf16 products are
    /// exact in f32).
    unsafe fn dot_scalar(a: &[u32], b: &[u16], tile: &mut Tile) {
        tile.fill(0.0);
        let f = |bits: u32| f32::from_bits(bits << 16);
        for (pa, pb) in a.chunks_exact(MR).zip(b.chunks_exact(2 * NR)) {
            for (r, &pair) in pa.iter().enumerate() {
                for c in 0..NR {
                    let t = &mut tile[r * NR + c];
                    *t += f(pair >> 16) * f(u32::from(pb[2 * c + 1]));
                    *t += f(pair & 0xffff) * f(u32::from(pb[2 * c]));
                }
            }
        }
    }

    unsafe fn tiles_scalar(p: &Product<'_>, strips: Range<usize>) {
        // SAFETY: the scalar kernel needs no instructions.
        unsafe { tiles_with(dot_scalar, p, strips) }
    }

    /// Deterministic values in [-1, 1) as bf16 (no denormals, which the instruction
    /// flushes).
    fn values(len: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                bf16::from_f32((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            })
            .collect()
    }

    /// (rows, cols, row stride, col stride, length) of a row-major or transposed operand.
    fn layout(rows: usize, cols: usize, transposed: bool) -> (usize, usize, usize) {
        if transposed {
            (1, rows, rows * cols)
        } else {
            (cols, 1, rows * cols)
        }
    }

    /// Runs `tiles` on one case and checks every element against the f64 product of the
    /// same bf16 inputs: within the f32 sums' rounding plus one bf16 rounding.
    fn check(tiles: Tiles, (m, n, k): (usize, usize, usize), t_lhs: bool, t_rhs: bool) {
        let (a_rs, a_cs, a_len) = layout(m, k, t_lhs);
        let (b_rs, b_cs, b_len) = layout(k, n, t_rhs);
        let a = values(a_len, 1 + (m * 31 + k) as u64);
        let b = values(b_len, 2 + (n * 17 + k) as u64);
        let dst_rs = n + 3;
        let before = values(m * dst_rs, 3);
        for (accumulate, scale) in [(false, 1.0), (true, 0.5)] {
            let mut dst = before.clone();
            // SAFETY: `dst` has m rows of `dst_rs`; the operands are as laid out above.
            unsafe {
                gemm_with(
                    tiles,
                    (m, n, k),
                    dst.as_mut_ptr(),
                    dst_rs,
                    accumulate,
                    (&a, a_rs, a_cs),
                    (&b, b_rs, b_cs),
                    scale,
                )
            };
            for i in 0..m {
                for j in 0..n {
                    let (mut exact, mut magnitude) = (0f64, 0f64);
                    for kk in 0..k {
                        let x = a[i * a_rs + kk * a_cs].to_f64() * b[kk * b_rs + j * b_cs].to_f64();
                        exact += x;
                        magnitude += x.abs();
                    }
                    exact *= scale;
                    magnitude *= scale;
                    let old = before[i * dst_rs + j].to_f64();
                    if accumulate {
                        exact += old;
                        magnitude += old.abs();
                    }
                    let got = dst[i * dst_rs + j].to_f64();
                    let bound = exact.abs() / 256.0 + magnitude * (k as f64 + 2.0) * 6e-8;
                    assert!(
                        (got - exact).abs() <= bound,
                        "({m}, {n}, {k}) t_lhs {t_lhs} t_rhs {t_rhs} accumulate {accumulate}: \
                         [{i}, {j}] = {got}, exact {exact}, bound {bound}"
                    );
                }
                for j in n..dst_rs {
                    assert_eq!(
                        dst[i * dst_rs + j].to_bits(),
                        before[i * dst_rs + j].to_bits(),
                        "({m}, {n}, {k}): [{i}, {j}] is outside the product but was written"
                    );
                }
            }
        }
    }

    /// Shapes at and around the tile and block edges, odd and even k, both layouts.
    fn cases(tiles: Tiles) {
        for (m, n, k) in [
            (1, 1, 1),
            (12, 32, 2),
            (13, 33, 3),
            (11, 31, 64),
            (25, 70, 129),
            (40, 100, 300),
            (3, 5, 0),
        ] {
            for (t_lhs, t_rhs) in [(false, false), (false, true), (true, false), (true, true)] {
                check(tiles, (m, n, k), t_lhs, t_rhs);
            }
        }
    }

    #[test]
    fn packing_blocking_and_write_back_are_exact_with_the_instructions_arithmetic() {
        cases(tiles_scalar);
    }

    #[test]
    fn the_avx512_bf16_kernel_computes_the_product() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        #[cfg(target_arch = "x86_64")]
        cases(avx512::tiles);
    }

    #[test]
    fn the_blocked_path_spans_several_rhs_blocks() {
        // k = 4100 makes a 32-column strip 262 KB, so a block holds one strip and the
        // 70 columns take three blocks.
        check(tiles_scalar, (13, 70, 4100), false, true);
    }
}
