//! The bf16 GEMM for CPUs with AVX512_BF16, whose `vdpbf16ps` adds two bf16 products into
//! each f32 lane: the operands are packed as bf16 pairs, products are summed in f32 over
//! all of k in registers, and each result is scaled, added to the destination when
//! accumulating and rounded to bf16 once, as in the portable path. CPUs without the
//! instruction take `half_float`'s path (the f32 GEMM on widened operands).
//!
//! The rhs is packed once per product into column strips (in parallel), each thread packs
//! the lhs rows it computes, and a tile's sums go from registers to the destination with
//! vector instructions (the rounding is `simd::round_to_bf16`'s, bit for bit). Packing and
//! blocking are one code for every kernel: the tests run them on every CPU with a scalar
//! kernel of the instruction's arithmetic, and the instruction's kernel where the CPU has
//! it (`tools/avx512bf16_emulated.sh` runs them in an emulator of such a CPU).

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::ops::Range;

use half::bf16;

/// Rows of the product one tile computes: one broadcast per row and pair of k.
const MR: usize = 12;
/// Columns of the product one tile computes: `NV` vectors of 16 f32 lanes, so a tile keeps
/// `MR * NV` accumulators of the 32 vector registers in flight.
const NR: usize = 16 * NV;
/// Vectors of the rhs a tile multiplies per pair of k.
const NV: usize = 2;
/// Bytes of packed rhs strips one block holds (in L2) while every row strip passes over it.
const RHS_BLOCK_BYTES: usize = 512 * 1024;
/// Pairs of k a rhs strip is packed in at a time, column by column (8 KiB of output).
const PACK_PAIRS: usize = 64;
/// Rhs elements below which one thread packs the whole rhs (a parallel pass costs more).
const PARALLEL_PACK: usize = 1 << 16;

/// Whether this CPU has the instructions the kernel needs.
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where a product's results go, `dst_rs` elements between rows: bf16 (each rounded
/// once), or f32 (sums kept wide: attention's scores and the gradients it accumulates).
#[derive(Clone, Copy)]
pub(super) enum Dst {
    Bf16(*mut bf16),
    F32(*mut f32),
}

/// `dst[m×n] = (dst if accumulate) + scale · lhs[m×k] · rhs[k×n]` with the AVX512_BF16
/// kernel; operands as in `matmul::gemm_raw`, which has checked them.
///
/// # Safety
/// As `matmul::gemm_raw`; and the CPU has the instructions ([`available`]).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn gemm(
    mnk: (usize, usize, usize),
    dst: Dst,
    dst_rs: usize,
    accumulate: bool,
    lhs: (&[bf16], usize, usize),
    rhs: (&[bf16], usize, usize),
    scale: f64,
) {
    let threads = candle_core::utils::get_num_threads();
    // SAFETY: forwarded from the caller, who vouches for the CPU.
    unsafe {
        gemm_with(
            avx512::tiles,
            threads,
            mnk,
            dst,
            dst_rs,
            accumulate,
            lhs,
            rhs,
            scale,
        )
    }
}

/// The packed rhs and where the product goes, shared by the threads computing it.
struct Product<'a> {
    /// The rhs in strips of `NR` columns: per pair of k, each column's (k, k+1) elements as
    /// one u32 (k in the low half).
    rhs: &'a [u32],
    /// Pairs of k (k rounded up to even: a zero pads an odd k).
    kp: usize,
    m: usize,
    n: usize,
    dst: Dst,
    dst_rs: usize,
    accumulate: bool,
    scale: f32,
}

// SAFETY: the threads sharing a product write disjoint row strips of `dst` (the caller of
// `gemm_with` vouches for the memory) and only read the rest.
unsafe impl Sync for Product<'_> {}

/// Computes and writes the tiles of row strips `strips`, whose lhs is `lhs` (a kernel's
/// entry point, compiled with its instructions).
type Tiles = unsafe fn(&Product<'_>, &LhsStrips<'_>, Range<usize>);

/// An operand as `gemm` receives it: its elements and (row, column) strides.
type Operand<'a> = (&'a [bf16], usize, usize);

/// Packs the rhs, then on up to `threads` threads packs each range of row strips' lhs and
/// runs `tiles` over it.
///
/// # Safety
/// As [`gemm`], for the instructions `tiles` uses.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_with(
    tiles: Tiles,
    threads: usize,
    (m, n, k): (usize, usize, usize),
    dst: Dst,
    dst_rs: usize,
    accumulate: bool,
    lhs: Operand<'_>,
    rhs: Operand<'_>,
    scale: f64,
) {
    if m == 0 || n == 0 {
        return;
    }
    let strips = m.div_ceil(MR);
    let threads = threads.clamp(1, strips);
    let rhs = pack_rhs(rhs, k, n, if k * n >= PARALLEL_PACK { threads } else { 1 });
    let product = Product {
        rhs: &rhs,
        kp: k.div_ceil(2),
        m,
        n,
        dst,
        dst_rs,
        accumulate,
        scale: scale as f32,
    };
    let run = |range: Range<usize>| {
        let lhs = LhsStrips::new(lhs, m, k, range.clone());
        // SAFETY: forwarded from the caller; each range's rows are its own.
        unsafe { tiles(&product, &lhs, range) }
    };
    if threads == 1 {
        return run(0..strips);
    }
    let per_thread = strips.div_ceil(threads);
    rayon::scope(|scope| {
        for first in (0..strips).step_by(per_thread) {
            let run = &run;
            scope.spawn(move |_| run(first..(first + per_thread).min(strips)));
        }
    });
}

/// Pair `p` of k at `at` (the element of k = 0) with stride `step` along k, the odd half
/// zero past k.
///
/// # Safety
/// The elements `at + 2p * step` and, when `2p + 1 < k`, `at + (2p + 1) * step` are inside
/// the operand.
#[inline(always)]
unsafe fn pair(v: *const u16, at: usize, step: usize, p: usize, k: usize) -> u32 {
    // SAFETY: as the caller vouches.
    unsafe {
        let lo = u32::from(*v.add(at + 2 * p * step));
        let hi = if 2 * p + 1 < k {
            u32::from(*v.add(at + (2 * p + 1) * step))
        } else {
            0
        };
        lo | hi << 16
    }
}

/// Writes pairs `pairs` of k of the line at `at` (stride `step` along k) to `out` at every
/// `stride`-th element (pair `p` at `p * stride`): contiguous pairs are read as one u32,
/// the odd tail through [`pair`].
///
/// # Safety
/// The line's k elements are inside the operand; `out` is valid for the writes.
#[inline(always)]
unsafe fn pack_line(
    v: *const u16,
    (at, step, k): (usize, usize, usize),
    pairs: Range<usize>,
    out: *mut u32,
    stride: usize,
) {
    // SAFETY: as the caller vouches.
    unsafe {
        if step == 1 {
            let line = v.add(at).cast::<u32>();
            let whole = pairs.start..pairs.end.min(k / 2);
            for p in whole.clone() {
                *out.add(p * stride) = line.add(p).read_unaligned();
            }
            for p in whole.end.max(pairs.start)..pairs.end {
                *out.add(p * stride) = pair(v, at, step, p, k);
            }
        } else {
            for p in pairs {
                *out.add(p * stride) = pair(v, at, step, p, k);
            }
        }
    }
}

/// Pair `p` of k of `len` lines (the first at `at`, the next `line` elements on, stride
/// `step` along k) into `out[..len]`: where lines are contiguous (`line` 1) the two rows
/// of k are read as slices, which the compiler vectorises.
///
/// # Safety
/// The lines' elements of pair `p` are inside the operand; `out` is valid for `len` writes.
#[inline(always)]
unsafe fn interleave(
    v: *const u16,
    at: usize,
    line: usize,
    step: usize,
    (p, k): (usize, usize),
    len: usize,
    out: *mut u32,
) {
    // SAFETY: as the caller vouches.
    unsafe {
        if line == 1 && 2 * p + 1 < k {
            let lo = std::slice::from_raw_parts(v.add(at + 2 * p * step), len);
            let hi = std::slice::from_raw_parts(v.add(at + (2 * p + 1) * step), len);
            let out = std::slice::from_raw_parts_mut(out, len);
            for ((o, &lo), &hi) in out.iter_mut().zip(lo).zip(hi) {
                *o = u32::from(lo) | u32::from(hi) << 16;
            }
        } else {
            for c in 0..len {
                *out.add(c) = pair(v, at + c * line, step, p, k);
            }
        }
    }
}

/// Where a tile reads its lhs pairs: row `r`'s pair `q` is the u32 at byte
/// `r * row + q * pair` from `at` (unaligned).
#[derive(Clone, Copy)]
struct LhsStrip {
    at: *const u8,
    row: usize,
    pair: usize,
}

/// The lhs of one range of row strips as the tiles read it: a row-major operand of even k
/// is read in place (its rows' pairs are already u32), except a last strip short of `MR`
/// rows; everything else is packed ([`pack_lhs`]).
struct LhsStrips<'a> {
    /// The operand's first element and its row stride in bytes, when read in place.
    direct: Option<(*const u8, usize)>,
    /// Packed strips, the first of them `packed_first`.
    packed: Vec<u32>,
    packed_first: usize,
    kp: usize,
    _operand: std::marker::PhantomData<&'a [bf16]>,
}

impl<'a> LhsStrips<'a> {
    fn new(lhs: Operand<'a>, m: usize, k: usize, strips: Range<usize>) -> LhsStrips<'a> {
        let (v, rs, cs) = lhs;
        let kp = k.div_ceil(2);
        let full = m / MR;
        if cs == 1 && k.is_multiple_of(2) && k > 0 {
            // Strips from `full` on (at most one, short of `MR` rows) need zero rows.
            let tail = full.clamp(strips.start, strips.end)..strips.end;
            return LhsStrips {
                direct: Some((v.as_ptr().cast::<u8>(), rs * 2)),
                packed: pack_lhs(lhs, m, k, tail.clone()),
                packed_first: tail.start,
                kp,
                _operand: std::marker::PhantomData,
            };
        }
        LhsStrips {
            direct: None,
            packed: pack_lhs(lhs, m, k, strips.clone()),
            packed_first: strips.start,
            kp,
            _operand: std::marker::PhantomData,
        }
    }

    /// Row strip `s` (one of the range's).
    fn strip(&self, s: usize) -> LhsStrip {
        match self.direct {
            Some((at, row)) if s < self.packed_first => LhsStrip {
                // SAFETY: strip s's first row is inside the operand.
                at: unsafe { at.add(s * MR * row) },
                row,
                pair: 4,
            },
            _ => LhsStrip {
                at: self.packed[(s - self.packed_first) * self.kp * MR..]
                    .as_ptr()
                    .cast::<u8>(),
                row: 4,
                pair: 4 * MR,
            },
        }
    }
}

/// The lhs rows of row strips `strips` (the operand m×k, strides `rs`, `cs`), each strip
/// of `MR` rows laid out per pair of k, each row's (k, k+1) elements as one u32: what the
/// kernel broadcasts. Rows past m are zeros.
fn pack_lhs((v, rs, cs): Operand<'_>, m: usize, k: usize, strips: Range<usize>) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let len = strips.len() * kp * MR;
    let mut out: Vec<u32> = Vec::with_capacity(len);
    let (v, o) = (v.as_ptr().cast::<u16>(), out.as_mut_ptr());
    for (s_at, s) in strips.enumerate() {
        let strip = s_at * kp * MR;
        for r in 0..MR {
            let i = s * MR + r;
            // SAFETY: `out` has room for every strip; row i < m is inside the operand (the
            // caller checked its strides), and rows past m are zeros.
            unsafe {
                if i < m {
                    if cs == 1 || k < 2 {
                        pack_line(v, (i * rs, cs, k), 0..kp, o.add(strip + r), MR);
                    } else {
                        // Transposed: a strip's rows are contiguous for each k, so read them
                        // in that direction below.
                        continue;
                    }
                } else {
                    (0..kp).for_each(|p| *o.add(strip + p * MR + r) = 0);
                }
            }
        }
        if cs != 1 && k >= 2 {
            let rows = MR.min(m - s * MR);
            for p in 0..kp {
                // SAFETY: as above.
                unsafe {
                    interleave(
                        v,
                        (s * MR) * rs,
                        rs,
                        cs,
                        (p, k),
                        rows,
                        o.add(strip + p * MR),
                    )
                };
            }
        }
    }
    // SAFETY: every element was written above.
    unsafe { out.set_len(len) };
    out
}

/// The rhs (k×n, strides `rs`, `cs`) as strips of `NR` columns; in a strip, for each pair
/// of k, each column's (k, k+1) elements as one u32: the vectors the kernel multiplies.
/// Columns past n are zeros. Strips are packed on up to `threads` threads.
fn pack_rhs((v, rs, cs): Operand<'_>, k: usize, n: usize, threads: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let strip_len = kp * NR;
    let strips = n.div_ceil(NR);
    let mut out: Vec<u32> = Vec::with_capacity(strips * strip_len);
    let pack_strip = |t: usize, o: *mut u32| {
        let (v, j0) = (v.as_ptr().cast::<u16>(), t * NR);
        let cols = NR.min(n - j0);
        // SAFETY: `o` is strip t's `strip_len` elements; columns below n are inside the
        // operand (the caller checked its strides), and columns past n are zeros.
        unsafe {
            if rs == 1 || k < 2 {
                // Each column contiguous along k (a transposed weight): one line per column,
                // a block of pairs at a time so the block's output stays in L1.
                for first in (0..kp).step_by(PACK_PAIRS) {
                    let pairs = first..(first + PACK_PAIRS).min(kp);
                    for c in 0..cols {
                        pack_line(v, ((j0 + c) * cs, rs, k), pairs.clone(), o.add(c), NR);
                    }
                }
            } else {
                // Rows contiguous: two rows of k interleaved per pair.
                for p in 0..kp {
                    interleave(v, j0 * cs, cs, rs, (p, k), cols, o.add(p * NR));
                }
            }
            for p in 0..kp {
                (cols..NR).for_each(|c| *o.add(p * NR + c) = 0);
            }
        }
    };
    let base = SendPtr(out.as_mut_ptr());
    if threads <= 1 {
        (0..strips).for_each(|t| pack_strip(t, base.at(t * strip_len)));
    } else {
        let per_thread = strips.div_ceil(threads);
        rayon::scope(|scope| {
            for first in (0..strips).step_by(per_thread) {
                let (pack_strip, base) = (&pack_strip, &base);
                scope.spawn(move |_| {
                    (first..(first + per_thread).min(strips))
                        .for_each(|t| pack_strip(t, base.at(t * strip_len)))
                });
            }
        });
    }
    // SAFETY: every strip was written in full above.
    unsafe { out.set_len(strips * strip_len) };
    out
}

/// The packed rhs's buffer, shared by the threads that each write their own strips.
struct SendPtr(*mut u32);
// SAFETY: the threads write disjoint strips of the buffer, which outlives them.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn at(&self, offset: usize) -> *mut u32 {
        // SAFETY: offsets are strip starts inside the buffer's capacity.
        unsafe { self.0.add(offset) }
    }
}

/// Calls `tile(a, b, i0, j0)` for every tile of row strips `strips` (lhs `lhs`):
/// rhs strips in blocks of about `RHS_BLOCK_BYTES`, each block passed over by every row
/// strip in turn. Inlined into each kernel's entry point.
#[inline(always)]
fn for_each_tile(
    p: &Product<'_>,
    lhs: &LhsStrips<'_>,
    strips: Range<usize>,
    mut tile: impl FnMut(LhsStrip, &[u32], usize, usize),
) {
    let rhs_strip = p.kp * NR;
    let rhs_strips = p.n.div_ceil(NR);
    let block = (RHS_BLOCK_BYTES / (rhs_strip * 4).max(1)).max(1);
    for first in (0..rhs_strips).step_by(block) {
        for s in strips.clone() {
            let a = lhs.strip(s);
            for t in first..(first + block).min(rhs_strips) {
                tile(
                    a,
                    &p.rhs[t * rhs_strip..(t + 1) * rhs_strip],
                    s * MR,
                    t * NR,
                );
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
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

    /// One tile: per pair of k, each row's pair broadcast and `vdpbf16ps` against the
    /// strip's `NV` vectors, the sums kept in registers; then written as [`store`] says.
    ///
    /// # Safety
    /// As [`tiles`]; `a` reads `MR` rows and `b` holds `NR` u32 per pair.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    #[inline]
    unsafe fn tile(p: &Product<'_>, a: LhsStrip, b: &[u32], i0: usize, j0: usize) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let b = b.as_ptr();
        // Each row's first pair; a row advances by `a.pair` bytes a pair.
        let rows: [*const u8; MR] = std::array::from_fn(|r| a.at.wrapping_add(r * a.row));
        for q in 0..p.kp {
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
        let rows = MR.min(p.m - i0);
        let cols = NR.min(p.n - j0);
        let at = (i0 * p.dst_rs) + j0;
        for (r, acc) in acc.iter().enumerate() {
            if r < rows {
                // SAFETY: row i0 + r < m and columns j0 .. j0 + cols <= n are the caller's.
                unsafe {
                    match p.dst {
                        Dst::Bf16(d) => store(p, acc, d.add(at + r * p.dst_rs), cols),
                        Dst::F32(d) => store_f32(p, acc, d.add(at + r * p.dst_rs), cols),
                    }
                };
            }
        }
    }

    /// Writes one tile row's sums to f32 `out` (its first `cols` columns): scaled, added
    /// to the destination when accumulating.
    ///
    /// # Safety
    /// As [`tile`]; `out` is valid for `cols` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    #[inline]
    unsafe fn store_f32(p: &Product<'_>, acc: &[__m512; NV], out: *mut f32, cols: usize) {
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
                    x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, at));
                }
                _mm512_mask_storeu_ps(at, mask, x);
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

    /// Writes one tile row's sums to `out` (its first `cols` columns): scaled, added to the
    /// destination when accumulating (widened as `simd::bf16_as_f32`), rounded to bf16 as
    /// `simd::round_to_bf16` (to nearest, ties to even, NaNs quiet).
    ///
    /// # Safety
    /// As [`tile`]; `out` is valid for `cols` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    #[inline]
    unsafe fn store(p: &Product<'_>, acc: &[__m512; NV], out: *mut half::bf16, cols: usize) {
        let scale = _mm512_set1_ps(p.scale);
        for (v, &sum) in acc.iter().enumerate() {
            let first = 16 * v;
            if first >= cols {
                break;
            }
            let mask = column_mask(cols - first);
            // SAFETY: the mask covers only the columns below `cols`.
            unsafe {
                let at = out.add(first).cast::<i16>();
                let mut x = _mm512_mul_ps(sum, scale);
                if p.accumulate {
                    let old = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, at));
                    x = _mm512_add_ps(x, widen(old));
                }
                _mm256_mask_storeu_epi16(at, mask, round(x));
            }
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
}

#[cfg(test)]
mod tests;
