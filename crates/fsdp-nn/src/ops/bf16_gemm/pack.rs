//! The bf16 GEMM's packings: the rhs into strips of `NR` columns of bf16 pairs, the lhs
//! read in place or packed in the layout its kernel reads (`LhsStrips`), each with scalar
//! code and, where the CPU has AVX-512, the vector forms of `pack_avx512.rs`.

use std::ops::Range;

use half::bf16;

#[cfg(target_arch = "x86_64")]
use super::pack_avx512;
use super::{Kernel, LhsLayout, MR, NR, Operand};

/// Pairs of k a rhs strip is packed in at a time, column by column (8 KiB of output).
const PACK_PAIRS: usize = 64;

/// How the packings move elements: AVX-512 shuffles where the CPU has them (every CPU
/// the bf16 kernels run on has), scalar code otherwise. The tests run both.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Mover {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Mover {
    /// The fastest this CPU runs.
    pub(super) fn detect() -> Mover {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            return Mover::Avx512;
        }
        Mover::Scalar
    }
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

/// Every pair of k of `len` lines (the first at `at`, the next `line` elements on, stride
/// `step` along k), pair `p` into `out[p * stride..][..len]`: where lines are contiguous
/// (`line` 1) two rows of k are read as slices, with AVX-512 where `mover` says.
///
/// # Safety
/// The lines' k elements are inside the operand; `out` is valid for `len` writes at each
/// of the `k.div_ceil(2)` pairs' offsets; the CPU runs `mover`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn interleave(
    mover: Mover,
    v: *const u16,
    at: usize,
    line: usize,
    step: usize,
    k: usize,
    len: usize,
    (out, stride): (*mut u32, usize),
) {
    // Pairs below `whole` have both rows of k.
    let whole = if line == 1 { k / 2 } else { 0 };
    // SAFETY: as the caller vouches.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if mover == Mover::Avx512 && whole > 0 {
            pack_avx512::interleave(v.add(at), step, whole, len, (out, stride));
        }
        if mover == Mover::Scalar {
            for p in 0..whole {
                let lo = std::slice::from_raw_parts(v.add(at + 2 * p * step), len);
                let hi = std::slice::from_raw_parts(v.add(at + (2 * p + 1) * step), len);
                let out = std::slice::from_raw_parts_mut(out.add(p * stride), len);
                for ((o, &lo), &hi) in out.iter_mut().zip(lo).zip(hi) {
                    *o = u32::from(lo) | u32::from(hi) << 16;
                }
            }
        }
        for p in whole..k.div_ceil(2) {
            for c in 0..len {
                *out.add(p * stride + c) = pair(v, at + c * line, step, p, k);
            }
        }
    }
}

/// Where a tile reads its lhs pairs: row `r`'s pair `q` is the u32 at byte
/// `r * row + (q / 16) * block + (q % 16) * pair` from `at` (unaligned).
#[derive(Clone, Copy)]
pub(super) struct LhsStrip {
    pub(super) at: *const u8,
    pub(super) row: usize,
    pub(super) pair: usize,
    /// Bytes from one block of 16 pairs to the next (`16 * pair` where pairs run on).
    pub(super) block: usize,
}

impl LhsStrip {
    /// Byte offset of row `r`'s pair `q` from `at`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) fn offset(&self, r: usize, q: usize) -> usize {
        r * self.row + (q / 16) * self.block + (q % 16) * self.pair
    }
}

/// The lhs of one range of row strips as the tiles read it: a row-major operand whose
/// rows' pairs fill the kernel's blocks of k is read in place (its rows' pairs are already
/// u32, contiguous), except a last strip short of the kernel's rows, and except where the
/// AMX kernel reads a packed one faster ([`tiles_read_in_place`]); everything else is
/// packed in the kernel's layout ([`pack_lhs`]).
pub(super) struct LhsStrips<'a> {
    /// The operand's first element and its row stride in bytes, when read in place.
    direct: Option<(*const u8, usize)>,
    /// Packed strips, the first of them `packed_first`.
    packed: Vec<u32>,
    packed_first: usize,
    /// Pairs of k per packed row.
    strip_pairs: usize,
    kernel: Kernel,
    _operand: std::marker::PhantomData<&'a [bf16]>,
}

impl<'a> LhsStrips<'a> {
    pub(super) fn new(
        mover: Mover,
        kernel: Kernel,
        lhs: Operand<'a>,
        (m, n, k): (usize, usize, usize),
        strips: Range<usize>,
    ) -> LhsStrips<'a> {
        let (v, rs, cs) = lhs;
        let strip_pairs = kernel.strip_pairs(k);
        let in_place = cs == 1
            && k > 0
            && k == 2 * strip_pairs
            && (kernel.lhs == LhsLayout::Broadcast || tiles_read_in_place(n, k));
        let (direct, packed) = if in_place {
            // Strips from `full` on (at most one, short of the kernel's rows) need
            // zero rows.
            let full = m / kernel.rows;
            let direct = (v.as_ptr().cast::<u8>(), rs * 2);
            (
                Some(direct),
                full.clamp(strips.start, strips.end)..strips.end,
            )
        } else {
            (None, strips)
        };
        LhsStrips {
            direct,
            packed: pack_lhs(mover, kernel, lhs, (m, k), packed.clone()),
            packed_first: packed.start,
            strip_pairs,
            kernel,
            _operand: std::marker::PhantomData,
        }
    }

    /// Row strip `s` (one of the range's).
    pub(super) fn strip(&self, s: usize) -> LhsStrip {
        let rows = self.kernel.rows;
        match self.direct {
            Some((at, row)) if s < self.packed_first => LhsStrip {
                // SAFETY: strip s's first row is inside the operand.
                at: unsafe { at.add(s * rows * row) },
                row,
                pair: 4,
                block: 64,
            },
            _ => {
                let at = self.packed[(s - self.packed_first) * self.strip_pairs * rows..]
                    .as_ptr()
                    .cast::<u8>();
                match self.kernel.lhs {
                    LhsLayout::Broadcast => LhsStrip {
                        at,
                        row: 4,
                        pair: 4 * rows,
                        block: 64 * rows,
                    },
                    LhsLayout::Tiles => LhsStrip {
                        at,
                        row: 64,
                        pair: 4,
                        block: 64 * rows,
                    },
                }
            }
        }
    }
}

/// Whether the AMX kernel reads a row-major lhs in place for a product of `n` columns over
/// `k`. In place a tile's 16 rows are a row stride apart, and past k of 512 a strip's 32
/// rows no longer stay in L1 beside the rhs while the rhs strips pass (at k of 1024 they
/// also fall in two of its 64 sets): the tiles then load faster from a packed copy, whose
/// 16 rows of a tile are 1 KiB in a row, but copying costs as much as the reads save
/// unless there are many rhs strips to read it for (the thresholds are where the
/// measurements in docs/BENCHMARKS.md, "bf16 on a Xeon with AMX", changed sides).
fn tiles_read_in_place(n: usize, k: usize) -> bool {
    /// k (elements) whose strip of 32 rows, 64·k bytes, still leaves L1 room for the rhs.
    const STRIP_IN_L1: usize = 512;
    /// Columns from which a packed copy pays for itself.
    const PACK_PAYS: usize = 1024;
    k <= STRIP_IN_L1 || n < PACK_PAYS
}

/// The lhs rows of row strips `strips` (the operand m×k, strides `rs`, `cs`) in the
/// kernel's layout, each row's (k, k+1) elements as one u32; for `Broadcast` each strip of
/// `MR` rows laid out per pair of k (what the vector kernel broadcasts). Rows past m are
/// zeros.
pub(super) fn pack_lhs(
    mover: Mover,
    kernel: Kernel,
    lhs: Operand<'_>,
    (m, k): (usize, usize),
    strips: Range<usize>,
) -> Vec<u32> {
    if kernel.lhs == LhsLayout::Tiles {
        return pack_lhs_tiles(mover, kernel, lhs, (m, k), strips);
    }
    debug_assert!(kernel.rows == MR && kernel.pairs == 1);
    let (v, rs, cs) = lhs;
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
            // SAFETY: as above.
            unsafe {
                let out = (o.add(strip), MR);
                interleave(mover, v, (s * MR) * rs, rs, cs, k, rows, out)
            };
        }
    }
    // SAFETY: every element was written above.
    unsafe { out.set_len(len) };
    out
}

/// [`pack_lhs`] in the `Tiles` layout: per block of 16 pairs of k, the strip's rows one
/// after another, 16 pairs (64 bytes) each; zeros past k (the odd tail's high half, and up
/// to the kernel's block of pairs) and past m. A transposed lhs (its rows contiguous for
/// each k: the gradient's product `dYᵀ x`) takes AVX-512 where `mover` says for its whole
/// blocks of 16 pairs.
fn pack_lhs_tiles(
    mover: Mover,
    kernel: Kernel,
    (v, rs, cs): Operand<'_>,
    (m, k): (usize, usize),
    strips: Range<usize>,
) -> Vec<u32> {
    let (rows, kp, strip_pairs) = (kernel.rows, k.div_ceil(2), kernel.strip_pairs(k));
    debug_assert_eq!(kernel.pairs, 16);
    let len = strips.len() * rows * strip_pairs;
    // Written once: the padding zeroed, then the operand's pairs (not zero-filled first).
    let mut out: Vec<u32> = Vec::with_capacity(len);
    let v = v.as_ptr().cast::<u16>();
    // Pairs with both elements inside k.
    let whole = k / 2;
    for (s_at, s) in strips.enumerate() {
        let valid = rows.min(m.saturating_sub(s * rows));
        // SAFETY: strip `s_at` lies inside the `len` reserved elements.
        let strip = unsafe { out.as_mut_ptr().add(s_at * rows * strip_pairs) };
        // SAFETY: the strip holds `strip_pairs` pairs (a multiple of 16) of `rows` rows.
        unsafe { zero_tiles_padding(strip, (valid, rows), (kp, strip_pairs)) };
        // SAFETY: rows below m are inside the operand (the caller checked its strides);
        // the strip holds `strip_pairs` pairs for each of its `rows` rows; the CPU runs
        // `mover`.
        let vector_pairs =
            unsafe { transpose_lhs_strip(mover, v, (s * rows, rs, cs, k), (valid, rows), strip) };
        for r in 0..valid {
            let at = (s * rows + r) * rs;
            for q0 in (vector_pairs..kp).step_by(16) {
                let pairs = q0..(q0 + 16).min(kp);
                // SAFETY: as above; pair q of row r is at `(q / 16) * rows * 16 + r * 16 +
                // q % 16` of the strip, below its end.
                unsafe {
                    let out = strip.add(q0 * rows + r * 16);
                    let contiguous = if cs == 1 { pairs.end.min(whole) } else { q0 };
                    // Bytes: the operand's pairs need not be u32-aligned.
                    let line = v.add(at + 2 * q0).cast::<u8>();
                    if contiguous == q0 + 16 {
                        let whole = line.cast::<[u8; 64]>().read_unaligned();
                        out.cast::<[u8; 64]>().write_unaligned(whole);
                    } else if contiguous > q0 {
                        std::ptr::copy_nonoverlapping(line, out.cast(), 4 * (contiguous - q0));
                    }
                    for q in contiguous.max(q0)..pairs.end {
                        *out.add(q - q0) = pair(v, at, cs, q, k);
                    }
                }
            }
        }
    }
    // SAFETY: every element is written: the padding above, the rows below m's pairs below
    // k by the transposes (whole blocks of 16 pairs) and the loop (the rest).
    unsafe { out.set_len(len) };
    out
}

/// Zeros what packing a `Tiles` strip leaves unwritten: in every block of 16 pairs the rows
/// from `valid` (past m) to `rows`, and in the last block the pairs from `kp` (past k) of
/// the rows below `valid`.
///
/// # Safety
/// `strip` is valid for `rows * strip_pairs` elements; `strip_pairs` is `kp` rounded up to
/// a multiple of 16.
unsafe fn zero_tiles_padding(
    strip: *mut u32,
    (valid, rows): (usize, usize),
    (kp, strip_pairs): (usize, usize),
) {
    for q0 in (0..strip_pairs).step_by(16) {
        // SAFETY: block q0 holds `rows` rows of 16 pairs inside the strip.
        unsafe {
            strip
                .add(q0 * rows + valid * 16)
                .write_bytes(0, (rows - valid) * 16)
        };
    }
    if kp < strip_pairs {
        let (q0, from) = (strip_pairs - 16, kp % 16);
        for r in 0..valid {
            // SAFETY: pairs `from..16` of row r in the last block, inside the strip.
            unsafe {
                strip
                    .add(q0 * rows + r * 16 + from)
                    .write_bytes(0, 16 - from)
            };
        }
    }
}

/// Packs what it can of a `Tiles` strip of a transposed lhs (row `i`'s pair `p` at
/// `i * rs + 2p * cs` with `rs` 1) by AVX-512 when `mover` says: per block of 16 pairs,
/// the strip's `valid` rows (of its `rows`) interleaved into pairs, then turned row-major
/// by 16×16 transposes. Returns the pairs packed (a multiple of 16; 0 when none).
///
/// # Safety
/// As [`pack_lhs_tiles`]'s strip: rows `first..first + valid` are inside the operand,
/// `strip` holds the strip's `rows` rows of its pairs in the `Tiles` layout; the CPU runs
/// `mover`.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn transpose_lhs_strip(
    mover: Mover,
    v: *const u16,
    (first, rs, cs, k): (usize, usize, usize, usize),
    (valid, rows): (usize, usize),
    strip: *mut u32,
) -> usize {
    // The transposes write whole groups of 16 rows, which the strip's rows must be.
    #[cfg(target_arch = "x86_64")]
    if mover == Mover::Avx512 && rs == 1 && cs != 1 && rows <= 32 && rows % 16 == 0 {
        let whole = k / 2 / 16 * 16;
        // Per pair of the block, the strip's rows' pairs side by side (rows past `valid`
        // stay zero, as the strip's rows past m must).
        let mut block = [0u32; 16 * 32];
        for p0 in (0..whole).step_by(16) {
            // SAFETY: pairs p0..p0 + 16 lie below k / 2, rows below `valid` inside the
            // operand; `block` holds 16 pairs of 32 rows; the strip's block of pairs p0..
            // holds `rows` rows of 16.
            unsafe {
                let at = v.add(first + 2 * p0 * cs);
                pack_avx512::interleave(at, cs, 16, valid, (block.as_mut_ptr(), 32));
                for r0 in (0..valid).step_by(16) {
                    let pairs = std::array::from_fn(|p| block[p * 32 + r0..].as_ptr());
                    let out = strip.add(p0 * rows + r0 * 16);
                    pack_avx512::transpose16(&pairs, out, 16);
                }
            }
        }
        return whole;
    }
    0
}

/// The rhs (k×n, strides `rs`, `cs`) as strips of `NR` columns; in a strip, for each pair
/// of k, each column's (k, k+1) elements as one u32: the vectors the kernel multiplies.
/// Columns past n and pairs from k to `strip_pairs` are zeros. Strips are packed on up to
/// `threads` threads, by `mover`.
pub(super) fn pack_rhs(
    mover: Mover,
    (v, rs, cs): Operand<'_>,
    (k, n): (usize, usize),
    strip_pairs: usize,
    threads: usize,
) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let strip_len = strip_pairs * NR;
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
                    let (vector_cols, vector_end) =
                        transpose_block(mover, v, (j0 * cs, cs, k), pairs.clone(), cols, o);
                    for c in 0..cols {
                        let rest = if c < vector_cols {
                            vector_end..pairs.end
                        } else {
                            pairs.clone()
                        };
                        pack_line(v, ((j0 + c) * cs, rs, k), rest, o.add(c), NR);
                    }
                }
            } else {
                // Rows contiguous: two rows of k interleaved per pair.
                interleave(mover, v, j0 * cs, cs, rs, k, cols, (o, NR));
            }
            if cols < NR {
                for p in 0..kp {
                    (cols..NR).for_each(|c| *o.add(p * NR + c) = 0);
                }
            }
            std::ptr::write_bytes(o.add(kp * NR), 0, (strip_pairs - kp) * NR);
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

/// Packs what it can of pairs `pairs` of the first `cols` columns of a transposed rhs strip
/// (column `c` at `at + c * cs`, its k elements contiguous) into `out` (`NR` u32 a pair) by
/// 16×16 transposes when `mover` is AVX-512: returns the columns and the end of the pairs
/// it packed (from `pairs.start`), both multiples of 16 there, `(0, pairs.start)` if none.
///
/// # Safety
/// As `pack_rhs`'s strip: the columns' k elements are inside the operand, `out` holds the
/// strip; the CPU runs `mover`.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn transpose_block(
    mover: Mover,
    v: *const u16,
    (at, cs, k): (usize, usize, usize),
    pairs: Range<usize>,
    cols: usize,
    out: *mut u32,
) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if mover == Mover::Avx512 {
        let whole = (pairs.end.min(k / 2)).saturating_sub(pairs.start) / 16 * 16;
        let (cols, end) = (cols / 16 * 16, pairs.start + whole);
        for c0 in (0..cols).step_by(16) {
            for p0 in (pairs.start..end).step_by(16) {
                // SAFETY: pairs p0..p0 + 16 lie below k / 2 in each column; `out` holds
                // rows p0.. of `NR` u32.
                unsafe {
                    let first =
                        std::array::from_fn(|c| v.add(at + (c0 + c) * cs + 2 * p0).cast::<u32>());
                    pack_avx512::transpose16(&first, out.add(p0 * NR + c0), NR);
                }
            }
        }
        return if whole == 0 {
            (0, pairs.start)
        } else {
            (cols, end)
        };
    }
    (0, pairs.start)
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
