//! The bf16 GEMM's tests: packing, blocking and write-back with a scalar kernel of the
//! instruction's arithmetic on every CPU, the AMX kernel on emulated tiles on every CPU,
//! and the AVX512_BF16 and AMX kernels where the CPU has them.

use super::super::simd::{bf16_as_f32, round_to_bf16};
use super::tile_emulator::EmulatedTiles;
use super::*;

/// The instruction's arithmetic per Intel's definition of `vdpbf16ps`: per lane, the
/// odd pair's product and then the even pair's added to the f32 sum (bf16 products are
/// exact in f32); each tile written through the scalar rounding the portable path uses.
unsafe fn tiles_scalar(p: &Product<'_>, lhs: &LhsStrips<'_>, strips: Range<usize>) {
    let f = |bits: u32| f32::from_bits(bits << 16);
    for_each_tile(p, lhs, strips, |a, b, i0, j0| {
        let mut tile = vec![0f32; p.rows * NR];
        for (q, pb) in b.chunks_exact(NR).enumerate() {
            // SAFETY: the strip holds `strip_pairs` pairs of `p.rows` rows.
            let pa: Vec<u32> = (0..p.rows)
                .map(|r| unsafe { a.at.add(a.offset(r, q)).cast::<u32>().read_unaligned() })
                .collect();
            for (r, &x) in pa.iter().enumerate() {
                for (c, &y) in pb.iter().enumerate() {
                    let t = &mut tile[r * NR + c];
                    *t += f(x >> 16) * f(y >> 16);
                    *t += f(x & 0xffff) * f(y & 0xffff);
                }
            }
        }
        // SAFETY: the tile is inside the product.
        unsafe { write_scalar(p, &tile, i0, j0) }
    });
}

/// A tile's sums (row-major, `NR` a row) to the destination through the scalar conversions
/// the portable path uses.
///
/// # Safety
/// Rows `i0..` and columns `j0..` are a tile of the product.
unsafe fn write_scalar(p: &Product<'_>, tile: &[f32], i0: usize, j0: usize) {
    for r in 0..(tile.len() / NR).min(p.m - i0) {
        for c in 0..NR.min(p.n - j0) {
            let at = (i0 + r) * p.dst_rs + j0 + c;
            let v = tile[r * NR + c] * p.scale;
            // SAFETY: the tile's rows and columns are inside the product.
            unsafe {
                match p.dst {
                    Dst::Bf16(d) => {
                        let old = if p.accumulate {
                            bf16_as_f32(d.add(at).read())
                        } else {
                            0.0
                        };
                        d.add(at).write(round_to_bf16(v + old));
                    }
                    Dst::F32(d) => {
                        let old = if p.accumulate { d.add(at).read() } else { 0.0 };
                        d.add(at).write(v + old);
                    }
                }
            }
        }
    }
}

/// The AMX kernel on emulated tiles, written back by `write`: every configuration it
/// loads is released, a product with any k and any tile runs `tdpbf16ps`, and each
/// `tdpbf16ps` has one tile load and 16 rows (the 2×2 blocking: one load per product where
/// 1×2 blocks of 12 rows took 1.5 for three quarters of the rows).
///
/// # Safety
/// As `gemm_with`; `write` can run on this CPU.
unsafe fn tiles_emulated(
    write: amx::WriteBack,
    p: &Product<'_>,
    lhs: &LhsStrips<'_>,
    strips: Range<usize>,
) {
    let mut unit = EmulatedTiles::new();
    let any = p.strip_pairs > 0 && p.n > 0 && !strips.is_empty();
    // SAFETY: forwarded; the emulation runs anywhere.
    unsafe { amx::tiles_on(&mut unit, write, p, lhs, strips) };
    assert_eq!(
        (unit.configured, unit.released),
        (1, 1),
        "tiles configured and released once"
    );
    assert_eq!(unit.dots > 0, any, "tdpbf16ps ran {} times", unit.dots);
    assert_eq!(unit.loads, unit.dots, "tile loads per tdpbf16ps");
    assert_eq!(amx::kernel_config().shape(0).0, 16, "rows a tdpbf16ps sums");
}

unsafe fn tiles_emulated_scalar(p: &Product<'_>, lhs: &LhsStrips<'_>, strips: Range<usize>) {
    // SAFETY: forwarded; the scalar write-back runs anywhere.
    unsafe { tiles_emulated(write_scalar, p, lhs, strips) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn tiles_emulated_avx512(p: &Product<'_>, lhs: &LhsStrips<'_>, strips: Range<usize>) {
    // SAFETY: forwarded; the callers check the CPU has AVX512_BF16.
    unsafe { tiles_emulated(avx512::write_tile, p, lhs, strips) }
}

/// The scalar kernel reading the lhs as the vector kernel does.
const SCALAR: Kernel = Kernel::broadcast(tiles_scalar);

/// Deterministic values in [-1, 1) as bf16 (no denormals, which the instruction
/// flushes).
fn values(len: usize, seed: u64) -> Vec<bf16> {
    let mut rng = crate::rng::XorShift64::seeded(seed);
    (0..len)
        .map(|_| {
            let s = rng.next_u64();
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

/// The packings this CPU runs: the scalar ones, and the AVX-512 ones where it has them.
fn movers() -> Vec<Mover> {
    let mut movers = vec![Mover::Scalar];
    if Mover::detect() != Mover::Scalar {
        movers.push(Mover::detect());
    }
    movers
}

/// Runs `tiles` on one case, packed by every mover this CPU runs, and checks every element
/// against the f64 product of the same bf16 inputs: within the f32 sums' rounding plus one
/// bf16 rounding.
fn check(kernel: Kernel, (m, n, k): (usize, usize, usize), t_lhs: bool, t_rhs: bool) {
    for mover in movers() {
        for threads in [1, 3] {
            check_on(kernel, mover, threads, (m, n, k), t_lhs, t_rhs);
        }
    }
}

fn check_on(
    kernel: Kernel,
    mover: Mover,
    threads: usize,
    (m, n, k): (usize, usize, usize),
    t_lhs: bool,
    t_rhs: bool,
) {
    let (a_rs, a_cs, a_len) = layout(m, k, t_lhs);
    let (b_rs, b_cs, b_len) = layout(k, n, t_rhs);
    let a = values(a_len, 1 + (m * 31 + k) as u64);
    let b = values(b_len, 2 + (n * 17 + k) as u64);
    let dst_rs = n + 3;
    let before = values(m * dst_rs, 3);
    let before_f32: Vec<f32> = before.iter().map(|v| v.to_f32()).collect();
    for wide in [false, true] {
        for (accumulate, scale) in [(false, 1.0), (true, 0.5)] {
            let (mut dst, mut dst_f32) = (before.clone(), before_f32.clone());
            let target = if wide {
                Dst::F32(dst_f32.as_mut_ptr())
            } else {
                Dst::Bf16(dst.as_mut_ptr())
            };
            // SAFETY: `dst` has m rows of `dst_rs`; the operands are as laid out above.
            unsafe {
                gemm_with(
                    kernel,
                    mover,
                    threads,
                    (m, n, k),
                    target,
                    dst_rs,
                    accumulate,
                    (&a, a_rs, a_cs),
                    (&b, b_rs, b_cs),
                    scale,
                )
            };
            let got = |at: usize| {
                if wide {
                    f64::from(dst_f32[at])
                } else {
                    dst[at].to_f64()
                }
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
                    let got = got(i * dst_rs + j);
                    // An f32 destination is not rounded to bf16 at the end.
                    let rounding = if wide { 0.0 } else { exact.abs() / 256.0 };
                    let bound = rounding + magnitude * (k as f64 + 2.0) * 6e-8;
                    assert!(
                        (got - exact).abs() <= bound,
                        "({m}, {n}, {k}) t_lhs {t_lhs} t_rhs {t_rhs} accumulate {accumulate} \
                         f32 {wide}: [{i}, {j}] = {got}, exact {exact}, bound {bound}"
                    );
                }
                for j in n..dst_rs {
                    let (got, was) = (got(i * dst_rs + j), before[i * dst_rs + j].to_f64());
                    assert_eq!(
                        got.to_bits(),
                        was.to_bits(),
                        "({m}, {n}, {k}): [{i}, {j}] is outside the product but was written"
                    );
                }
            }
        }
    }
}

/// Shapes at and around the tile and block edges, odd and even k, both layouts.
fn cases(kernel: Kernel) {
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
            check(kernel, (m, n, k), t_lhs, t_rhs);
        }
    }
}

#[test]
fn packing_blocking_and_write_back_are_exact_with_the_instructions_arithmetic() {
    cases(SCALAR);
}

#[test]
fn the_tiles_layout_packs_every_lhs_shape() {
    cases(Kernel::tiled(tiles_scalar));
}

#[test]
fn the_amx_kernel_computes_the_product_on_emulated_tiles() {
    let kernel = Kernel::tiled(tiles_emulated_scalar);
    cases(kernel);
    // k past several 16-pair blocks with a tail (the lhs packed with zeros) and a whole
    // number of blocks, rows past one block and short of the next.
    for k in [67, 96] {
        for t_lhs in [false, true] {
            check(kernel, (45, 40, k), t_lhs, true);
        }
    }
    // A row-major lhs the kernel reads packed rather than in place (`tiles_read_in_place`),
    // and a k long enough that each rhs strip is a block of its own (three blocks).
    check(kernel, (45, 1040, 544), false, true);
    check(kernel, (45, 70, 4100), false, true);
}

#[test]
fn the_amx_kernel_writes_back_with_the_vector_code() {
    if !available() {
        skipped_optional!("this CPU has no AVX512_BF16 for the write-back");
        return;
    }
    #[cfg(target_arch = "x86_64")]
    cases(Kernel::tiled(tiles_emulated_avx512));
}

#[test]
fn the_amx_kernel_computes_the_product_on_this_cpus_tiles() {
    if !amx::ready() {
        skipped_optional!("no AMX here ({:?})", amx::support());
        return;
    }
    cases(Kernel::tiled(amx::tiles));
    check(Kernel::tiled(amx::tiles), (70, 100, 96), false, true);
    check(Kernel::tiled(amx::tiles), (45, 1040, 544), false, true);
    check(Kernel::tiled(amx::tiles), (45, 70, 4100), false, true);
    check(Kernel::tiled(amx::tiles), (100, 300, 2048), true, false);
}

#[test]
fn the_tile_configuration_is_what_ldtilecfg_reads() {
    // Palette 1; tile t's bytes per row at 16 + 2t (little-endian u16), its rows at 48 + t.
    let cfg = amx::kernel_config();
    assert_eq!(cfg.0[0], 1);
    for t in 0..8 {
        assert_eq!(cfg.shape(t), (16, 64), "tmm{t}");
    }
    assert_eq!((cfg.0[16], cfg.0[17], cfg.0[48]), (64, 0, 16));
    assert!(cfg.0[32..48].iter().chain(&cfg.0[56..]).all(|&b| b == 0));
}

#[test]
fn the_avx512_bf16_kernel_computes_the_product() {
    if !available() {
        skipped_optional!("this CPU has no AVX512_BF16");
        return;
    }
    #[cfg(target_arch = "x86_64")]
    cases(Kernel::broadcast(avx512::tiles));
}

#[test]
fn the_vector_write_back_rounds_and_widens_as_the_scalar_conversions() {
    if !available() {
        skipped_optional!("this CPU has no AVX512_BF16");
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // Ties both ways, carries into the exponent, infinities, signalling and quiet
        // NaNs of both signs, denormals, then a sweep of bit patterns.
        let mut bits: Vec<u32> = vec![
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_7fff,
            0x3f80_8001,
            0x7f7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7f80_0001,
            0xff80_0001,
            0x7fc0_0000,
            0x7fbf_ffff,
            0x0000_8000,
            0x0001_8000,
            0x8000_0001,
            0x0000_0000,
            0x8000_0000,
        ];
        let mut x = 0x1234_5678u32;
        bits.extend((0..16 * 4096).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        }));
        for chunk in bits.chunks_exact(16) {
            let mut got = [0u16; 16];
            let mut wide = [0f32; 16];
            // SAFETY: the CPU has the features; the arrays hold 16 elements.
            unsafe {
                let v = _mm512_loadu_si512(chunk.as_ptr().cast());
                let r = avx512::round(_mm512_castsi512_ps(v));
                _mm256_storeu_si256(got.as_mut_ptr().cast(), r);
                let low = _mm512_and_si512(v, _mm512_set1_epi32(0xffff));
                _mm512_storeu_ps(wide.as_mut_ptr(), avx512::widen(low));
            }
            for (i, &b) in chunk.iter().enumerate() {
                let want = round_to_bf16(f32::from_bits(b)).to_bits();
                assert_eq!(got[i], want, "round {b:#010x}");
                let half = half::bf16::from_bits(b as u16);
                assert_eq!(
                    wide[i].to_bits(),
                    bf16_as_f32(half).to_bits(),
                    "widen {b:#06x}"
                );
            }
        }
    }
}

#[test]
fn the_blocked_path_spans_several_rhs_blocks() {
    // k = 4100 makes a 32-column strip 262 KB, so a block holds one strip and the
    // 70 columns take three blocks.
    check(SCALAR, (13, 70, 4100), false, true);
}

/// Operand shapes around the 16×16 transposes' and the strips' edges: k odd and even, below,
/// at and past 16 and 64 pairs; columns short of, at and past 16 and `NR`.
#[test]
fn the_vector_packings_equal_the_scalar_ones_element_for_element() {
    let movers = movers();
    if movers.len() == 1 {
        skipped_optional!("this CPU has no AVX-512 packing to compare");
        return;
    }
    for k in [1, 2, 31, 32, 33, 64, 130, 259] {
        for cols in [1, 5, 16, 17, 32, 48, 70] {
            for transposed in [false, true] {
                // The rhs k×cols and the lhs cols×k, in each layout.
                let (rs, cs, len) = layout(k, cols, transposed);
                let b = values(len, (k * 131 + cols) as u64);
                let (a_rs, a_cs, a_len) = layout(cols, k, transposed);
                let a = values(a_len, (k * 7 + cols) as u64);
                for kernel in [Kernel::broadcast(tiles_scalar), Kernel::tiled(tiles_scalar)] {
                    let strip_pairs = kernel.strip_pairs(k);
                    let packed: Vec<_> = movers
                        .iter()
                        .map(|&m| pack_rhs(m, (&b, rs, cs), (k, cols), strip_pairs, 1))
                        .collect();
                    assert_eq!(
                        packed[0], packed[1],
                        "rhs {k}x{cols} transposed {transposed} pairs {strip_pairs}"
                    );
                    let strips = 0..cols.div_ceil(kernel.rows);
                    let packed: Vec<_> = movers
                        .iter()
                        .map(|&m| pack_lhs(m, kernel, (&a, a_rs, a_cs), (cols, k), strips.clone()))
                        .collect();
                    assert_eq!(
                        packed[0], packed[1],
                        "lhs {cols}x{k} transposed {transposed} {:?}",
                        kernel.lhs
                    );
                }
            }
        }
    }
}

/// Does nothing: a kernel that leaves the product unwritten.
unsafe fn tiles_idle(_: &Product<'_>, _: &LhsStrips<'_>, _: Range<usize>) {}

/// The AMX kernel's first-use check passes a kernel that computes the products (the tile
/// emulation, against the scalar and, where the CPU has it, the AVX512_BF16 kernel) and
/// refuses one that does not, naming an element.
#[test]
fn the_first_use_check_takes_a_kernel_only_if_it_computes_the_products() {
    // SAFETY: the scalar and emulated kernels run on any CPU.
    unsafe {
        assert_eq!(agrees(Kernel::tiled(tiles_emulated_scalar), SCALAR), Ok(()));
        let refused = agrees(Kernel::tiled(tiles_idle), SCALAR).unwrap_err();
        assert!(refused.contains("element [0, 0] was 0 where"), "{refused}");
        assert!(agrees(SCALAR, Kernel::tiled(tiles_idle)).is_err());
    }
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has AVX512_BF16.
        let emulated = unsafe {
            agrees(
                Kernel::tiled(tiles_emulated_avx512),
                Kernel::broadcast(avx512::tiles),
            )
        };
        assert_eq!(emulated, Ok(()));
    }
}
