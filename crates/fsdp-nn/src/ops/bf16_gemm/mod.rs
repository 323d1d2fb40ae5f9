//! The bf16 GEMM for CPUs with bf16 dot products: AMX tiles (`tdpbf16ps`, a 16×16 block
//! of f32 sums per instruction over 32 of k, in 2×2 blocks of tiles) where the CPU has them and Linux grants their
//! state, AVX512_BF16 (`vdpbf16ps`, two bf16 products into each f32 lane) next. The operands
//! are packed as bf16 pairs, products are summed in f32 over all of k, and each result is
//! scaled, added to the destination when accumulating and rounded to bf16 once, as in the
//! portable path. CPUs without either take `half_float`'s path (the f32 GEMM on widened
//! operands).
//!
//! The rhs is packed once per product into column strips (in parallel; with AVX-512
//! transposes and interleaves, `pack_avx512.rs`), each thread packs the lhs rows it computes, and a tile's sums go to the destination with vector
//! instructions (the rounding is `simd::round_to_bf16`'s, bit for bit). Packing and
//! blocking are one code for every kernel: the tests run them on every CPU with a scalar
//! kernel of the instruction's arithmetic, the AMX kernel on an emulation of the tile
//! registers, and each instruction's kernel where the CPU has it
//! (`tools/avx512bf16_emulated.sh` runs the AVX512_BF16 one in an emulator of such a CPU).

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::ops::Range;

use half::bf16;

/// Rows of the product one tile of the vector kernel computes: one broadcast per row and
/// pair of k (the AMX kernel's tiles have [`amx::ROWS`]).
const MR: usize = 12;
/// Columns of the product one tile computes: `NV` vectors of 16 f32 lanes, so a tile keeps
/// `MR * NV` accumulators of the 32 vector registers in flight.
const NR: usize = 16 * NV;
/// Vectors of the rhs a tile multiplies per pair of k.
const NV: usize = 2;
/// Bytes of packed rhs strips one block holds (in L2) while every row strip passes over it.
const RHS_BLOCK_BYTES: usize = 512 * 1024;
/// Rhs elements below which one thread packs the whole rhs (a parallel pass costs more).
const PARALLEL_PACK: usize = 1 << 16;

/// Whether this CPU has the instructions the AVX512_BF16 kernel needs (and the AMX kernel's
/// write-back).
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

/// `dst[m×n] = (dst if accumulate) + scale · lhs[m×k] · rhs[k×n]` with the AMX kernel when
/// the tiles are ready ([`amx::support`]), the AVX512_BF16 kernel otherwise; operands as in
/// `matmul::gemm_raw`, which has checked them.
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
    let kernel = if amx::ready() {
        Kernel::tiled(amx::tiles)
    } else {
        Kernel::broadcast(avx512::tiles)
    };
    // SAFETY: forwarded from the caller, who vouches for the CPU (and `amx::ready` for the
    // tiles).
    unsafe {
        gemm_with(
            kernel,
            Mover::detect(),
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
    /// Pairs of k in a packed strip or row ([`Kernel::strip_pairs`]): k rounded up to even
    /// (a zero pads an odd k), then to the kernel's block of pairs, zeros past k.
    strip_pairs: usize,
    /// Rows of the product one tile computes ([`Kernel::rows`]).
    rows: usize,
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

/// How a kernel reads a strip's lhs pairs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum LhsLayout {
    /// Per pair of k, the strip's `MR` rows side by side (the vector kernel broadcasts one
    /// row's pair at a time).
    Broadcast,
    /// Per block of 16 pairs, the strip's rows one after another, 16 pairs each (a tile
    /// load reads 16 rows of 64 contiguous bytes).
    Tiles,
}

/// A tile kernel and how it reads its operands.
#[derive(Clone, Copy)]
struct Kernel {
    tiles: Tiles,
    lhs: LhsLayout,
    /// Rows of the product one tile computes.
    rows: usize,
    /// The packed operands' pairs of k are a multiple of this (zeros past k): a tile
    /// instruction takes a fixed number of pairs.
    pairs: usize,
}

impl Kernel {
    /// A vector kernel: tiles of `MR` rows broadcast from the `Broadcast` layout, any k.
    const fn broadcast(tiles: Tiles) -> Kernel {
        Kernel {
            tiles,
            lhs: LhsLayout::Broadcast,
            rows: MR,
            pairs: 1,
        }
    }

    /// Pairs of k its packed operands hold for a product with `k`: k's pairs (a zero pads
    /// an odd k) rounded up to [`Kernel::pairs`].
    fn strip_pairs(&self, k: usize) -> usize {
        k.div_ceil(2).next_multiple_of(self.pairs)
    }

    /// The AMX kernel's operands: tiles of [`amx::ROWS`] rows loaded from the `Tiles`
    /// layout, k in blocks of [`amx::TILE_PAIRS`] pairs.
    const fn tiled(tiles: Tiles) -> Kernel {
        Kernel {
            tiles,
            lhs: LhsLayout::Tiles,
            rows: amx::ROWS,
            pairs: amx::TILE_PAIRS,
        }
    }
}

/// An operand as `gemm` receives it: its elements and (row, column) strides.
type Operand<'a> = (&'a [bf16], usize, usize);

/// Packs the rhs, then on up to `threads` threads packs each range of row strips' lhs and
/// runs `tiles` over it; `mover` packs.
///
/// # Safety
/// As [`gemm`], for the instructions `tiles` uses.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_with(
    kernel: Kernel,
    mover: Mover,
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
    let strips = m.div_ceil(kernel.rows);
    let threads = threads.clamp(1, strips);
    let pack_threads = if k * n >= PARALLEL_PACK { threads } else { 1 };
    let rhs = pack_rhs(mover, rhs, (k, n), kernel.strip_pairs(k), pack_threads);
    let product = Product {
        rhs: &rhs,
        strip_pairs: kernel.strip_pairs(k),
        rows: kernel.rows,
        m,
        n,
        dst,
        dst_rs,
        accumulate,
        scale: scale as f32,
    };
    let run = |range: Range<usize>| {
        let lhs = LhsStrips::new(mover, kernel, lhs, (m, n, k), range.clone());
        // SAFETY: forwarded from the caller; each range's rows are its own.
        unsafe { (kernel.tiles)(&product, &lhs, range) }
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

/// The products a kernel computes on first use, beside the AVX512_BF16 kernel, before the
/// GEMM takes it: shapes across the tile and block edges, odd k, both transposes of each
/// operand. (m, n, k, lhs transposed, rhs transposed.)
const FIRST_USE_PRODUCTS: [(usize, usize, usize, bool, bool); 4] = [
    (70, 100, 96, false, true),
    (33, 47, 129, false, false),
    (45, 40, 33, true, false),
    (17, 80, 200, true, true),
];

/// Whether the AMX kernel computes [`FIRST_USE_PRODUCTS`] as the AVX512_BF16 kernel does:
/// [`amx::support`] asks before the tiles are used, so a kernel that misbehaves on a CPU
/// it was not tested on (it has run on one AMX model only) is never used.
///
/// # Safety
/// The CPU has both kernels' instructions and the tile state is granted.
#[cfg(target_arch = "x86_64")]
unsafe fn amx_agrees() -> Result<(), String> {
    // SAFETY: forwarded from the caller.
    unsafe { agrees(Kernel::tiled(amx::tiles), Kernel::broadcast(avx512::tiles)) }
}

/// Whether `kernel` computes [`FIRST_USE_PRODUCTS`] as `reference` does: f32 sums of the
/// same exact products, which may differ only in their order of summation; otherwise the
/// first element that differs.
///
/// # Safety
/// The CPU has the instructions both kernels use.
unsafe fn agrees(kernel: Kernel, reference: Kernel) -> Result<(), String> {
    let operand = |rows: usize, cols: usize, transposed: bool, seed: u64| {
        let mut rng = crate::rng::XorShift64::seeded(seed);
        let v: Vec<bf16> = (0..rows * cols)
            .map(|_| bf16::from_f32((rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0))
            .collect();
        let (rs, cs) = if transposed { (1, rows) } else { (cols, 1) };
        (v, rs, cs)
    };
    for (m, n, k, t_lhs, t_rhs) in FIRST_USE_PRODUCTS {
        let (a, a_rs, a_cs) = operand(m, k, t_lhs, 1);
        let (b, b_rs, b_cs) = operand(k, n, t_rhs, 2);
        let product = |kernel: Kernel| {
            let mut out = vec![0f32; m * n];
            // SAFETY: `out` holds m rows of n; the operands are laid out as their strides
            // say; the caller vouches for the instructions.
            unsafe {
                gemm_with(
                    kernel,
                    Mover::detect(),
                    1,
                    (m, n, k),
                    Dst::F32(out.as_mut_ptr()),
                    n,
                    false,
                    (&a, a_rs, a_cs),
                    (&b, b_rs, b_cs),
                    1.0,
                )
            };
            out
        };
        let (got, want) = (product(kernel), product(reference));
        // Values in [-1, 1): sums of at most 200 products, whose f32 summation orders differ
        // by far less than this; a wrong element is off by about its own size.
        // A NaN differs too.
        let differs = |i: usize| {
            let bound = 1e-3 + 1e-4 * want[i].abs();
            (got[i] - want[i]).abs() > bound || got[i].is_nan() != want[i].is_nan()
        };
        if let Some(i) = (0..m * n).find(|&i| differs(i)) {
            return Err(format!(
                "the {m}x{k} by {k}x{n} product's element [{}, {}] was {} where {} was expected",
                i / n,
                i % n,
                got[i],
                want[i]
            ));
        }
    }
    Ok(())
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
    let rhs_strip = p.strip_pairs * NR;
    let rhs_strips = p.n.div_ceil(NR);
    let block = (RHS_BLOCK_BYTES / (rhs_strip * 4).max(1)).max(1);
    for first in (0..rhs_strips).step_by(block) {
        for s in strips.clone() {
            let a = lhs.strip(s);
            for t in first..(first + block).min(rhs_strips) {
                tile(
                    a,
                    &p.rhs[t * rhs_strip..(t + 1) * rhs_strip],
                    s * p.rows,
                    t * NR,
                );
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;
mod pack;
#[cfg(target_arch = "x86_64")]
mod pack_avx512;

#[cfg(test)]
use pack::pack_lhs;
use pack::{LhsStrip, LhsStrips, Mover, pack_rhs};

pub(super) mod amx;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tile_emulator;
