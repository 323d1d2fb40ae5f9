//! The AMX tile kernel: per block of [`ROWS`] rows and `NR` columns, four accumulator tiles
//! of 16×16 f32 (2×2: two lhs tiles of 16 rows, two rhs tiles of 16 columns) summed by
//! `tdpbf16ps` over 16 pairs of k at a time, stored to the stack and written back by the
//! AVX512_BF16 kernel's vector code. Four loads feed four products, and four independent
//! accumulators keep the tile unit busy while each product's sums are still being
//! written, the blocking Intel's optimization manual gives for AMX GEMMs. The packings pad
//! k with zeros to whole blocks of 16 pairs (a row-major lhs whose k is a multiple of 32 is
//! loaded in place), so one tile configuration serves every product.
//!
//! AMX needs the CPU's AMX-TILE and AMX-BF16 (cpuid leaf 7), and Linux's permission for
//! the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`), asked once per
//! process, and a first-use check: four products computed on the tiles equal the
//! AVX512_BF16 kernel's. Where any is missing the GEMM keeps the AVX512_BF16 kernel and
//! `fsdp env` says why. The kernel is generic over [`TileUnit`]: the hardware's instructions (stable
//! Rust has no AMX intrinsics: six `asm!` instructions), or in the tests an emulation of
//! the tile registers per Intel's definition, which runs the blocking, the tile
//! configuration and the write-back on any CPU.

use std::ops::Range;
use std::sync::OnceLock;

use super::{LhsStrip, LhsStrips, NR, Product};

/// Pairs of k one tile product takes (64 bytes of a row of bf16 pairs).
pub(super) const TILE_PAIRS: usize = 16;
/// Rows of a tile register.
const TILE_ROWS: usize = 16;
/// Rows of the product one block of the kernel computes: two lhs tiles.
pub(super) const ROWS: usize = 2 * TILE_ROWS;
/// The accumulators (rows 0..16 or 16..32, columns 0..16 or 16..32 of a block), the two
/// lhs tiles (rows) and the two rhs tiles (columns): all eight tile registers.
const C00: u8 = 0;
const C01: u8 = 1;
const C10: u8 = 2;
const C11: u8 = 3;
const A0: u8 = 4;
const A1: u8 = 5;
const B0: u8 = 6;
const B1: u8 = 7;

/// Whether this process can run the AMX kernel, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AmxSupport {
    /// The tiles are usable.
    Ready,
    /// The CPU has no AMX-BF16 tiles.
    NoTiles,
    /// The CPU has tiles but not the AVX512_BF16 vector instructions the kernel's
    /// write-back uses.
    NoVectorWriteBack,
    /// The operating system did not grant the tile state (the reason).
    Refused(String),
    /// The tiles computed a first-use product unlike the AVX512_BF16 kernel (the
    /// difference); the GEMM keeps that kernel.
    Disagreed(String),
}

impl std::fmt::Display for AmxSupport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AmxSupport::Ready => write!(f, "AMX-BF16 tiles in use"),
            AmxSupport::NoTiles => write!(f, "this CPU has no AMX-BF16 tiles"),
            AmxSupport::NoVectorWriteBack => write!(
                f,
                "this CPU has AMX tiles but not the AVX512_BF16 the kernel writes back with"
            ),
            AmxSupport::Refused(why) => write!(f, "AMX tiles refused by the kernel: {why}"),
            AmxSupport::Disagreed(why) => write!(
                f,
                "AMX tiles not used: on first use {why} (the AVX512_BF16 kernel's); please \
                 report this CPU"
            ),
        }
    }
}

/// This process's AMX support, found (and the tile state asked for) on first use.
pub fn support() -> &'static AmxSupport {
    static SUPPORT: OnceLock<AmxSupport> = OnceLock::new();
    SUPPORT.get_or_init(|| {
        if !cpu_has_tiles() {
            AmxSupport::NoTiles
        } else if !super::available() {
            AmxSupport::NoVectorWriteBack
        } else {
            match request_tile_state() {
                // SAFETY: the CPU has the tiles and AVX512_BF16 (checked above) and the tile
                // state was granted.
                Ok(()) => match unsafe { first_use_check() } {
                    Ok(()) => AmxSupport::Ready,
                    Err(difference) => AmxSupport::Disagreed(difference),
                },
                Err(reason) => AmxSupport::Refused(reason),
            }
        }
    })
}

/// The AMX kernel's products against the AVX512_BF16 kernel's ([`super::amx_agrees`]).
///
/// # Safety
/// As `amx_agrees`.
unsafe fn first_use_check() -> Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: forwarded from the caller.
        unsafe { super::amx_agrees() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Ok(())
    }
}

/// Whether the GEMM runs on tiles.
pub(crate) fn ready() -> bool {
    *support() == AmxSupport::Ready
}

/// Whether cpuid reports AMX-TILE and AMX-BF16 (leaf 7, subleaf 0, EDX bits 24 and 22).
pub fn cpu_has_tiles() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        if __cpuid(0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        edx & (1 << 24) != 0 && edx & (1 << 22) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Asks Linux for this process's permission to use the tile data state (every thread's,
/// from now on), then reads the permission back; the error says what the kernel answered.
pub fn request_tile_state() -> Result<(), String> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these codes reads its integer argument only.
        let asked = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        if asked != 0 {
            return Err(format!(
                "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut granted: u64 = 0;
        // SAFETY: ARCH_GET_XCOMP_PERM writes one u64 to the pointer, which is valid.
        let read = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_GET_XCOMP_PERM,
                &mut granted as *mut u64,
            )
        };
        if read != 0 || granted & (1 << XFEATURE_XTILEDATA) == 0 {
            return Err(format!(
                "the kernel accepted the tile state request but does not report it granted \
                 (ARCH_GET_XCOMP_PERM: {granted:#x})"
            ));
        }
        Ok(())
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        Err("AMX tiles are used only on x86-64 Linux (its permission request)".into())
    }
}

/// The 64-byte tile configuration `ldtilecfg` reads: palette 1, per tile its bytes per row
/// and its rows (a tile left at zero is unconfigured).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct TileConfig(pub [u8; 64]);

impl TileConfig {
    /// Palette 1, no tile configured.
    pub fn new() -> TileConfig {
        let mut bytes = [0u8; 64];
        bytes[0] = 1;
        TileConfig(bytes)
    }

    /// Tile `t` as `rows` rows of `bytes` bytes.
    pub fn with(mut self, t: u8, rows: usize, bytes: usize) -> TileConfig {
        let t = usize::from(t);
        debug_assert!(t < 8 && rows <= 16 && bytes <= 64);
        self.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&(bytes as u16).to_le_bytes());
        self.0[48 + t] = rows as u8;
        self
    }

    /// Tile `t`'s rows and bytes per row.
    #[cfg(test)]
    pub fn shape(&self, t: u8) -> (usize, usize) {
        let t = usize::from(t);
        let bytes = u16::from_le_bytes([self.0[16 + 2 * t], self.0[17 + 2 * t]]);
        (usize::from(self.0[48 + t]), usize::from(bytes))
    }
}

impl Default for TileConfig {
    fn default() -> TileConfig {
        TileConfig::new()
    }
}

/// The kernel's tiles: all eight registers as 16 rows of 64 bytes (f32 sums, 16 pairs of
/// bf16, or 16 columns of pairs).
pub(super) fn kernel_config() -> TileConfig {
    (0..8).fold(TileConfig::new(), |cfg, t| cfg.with(t, TILE_ROWS, 64))
}

/// The tile instructions the kernel uses, on tile registers named by constants.
///
/// # Safety
/// Every method: the unit is configured (after [`TileUnit::configure`], before
/// [`TileUnit::release`]) with the tiles it names, and the memory a load or store covers
/// (the tile's rows, `stride` bytes apart, of its bytes per row) is valid.
pub(super) trait TileUnit {
    /// `ldtilecfg`: sets the tiles' shapes (and zeroes them).
    unsafe fn configure(&mut self, cfg: &TileConfig);
    /// `tilezero`.
    unsafe fn zero<const T: u8>(&mut self);
    /// `tileloadd`: the tile's rows from `at`, `stride` bytes apart.
    unsafe fn load<const T: u8>(&mut self, at: *const u8, stride: usize);
    /// `tdpbf16ps`: `C += A · B` on bf16 pairs, f32 sums.
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `tilestored`: the tile's rows to `at`, `stride` bytes apart.
    unsafe fn store<const T: u8>(&self, at: *mut u8, stride: usize);
    /// `tilerelease`: back to the unconfigured state.
    unsafe fn release(&mut self);
}

/// The CPU's tiles.
#[cfg(target_arch = "x86_64")]
pub(super) struct Hardware;

#[cfg(target_arch = "x86_64")]
impl TileUnit for Hardware {
    #[inline(always)]
    unsafe fn configure(&mut self, cfg: &TileConfig) {
        // SAFETY: as the trait's contract; the configuration is 64 valid bytes.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly))
        }
    }
    #[inline(always)]
    unsafe fn zero<const T: u8>(&mut self) {
        // SAFETY: as the trait's contract.
        unsafe { std::arch::asm!("tilezero tmm{t}", t = const T, options(nomem, nostack)) }
    }
    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, at: *const u8, stride: usize) {
        // SAFETY: as the trait's contract.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm{t}, [{at} + {stride} * 1]",
                t = const T,
                at = in(reg) at,
                stride = in(reg) stride,
                options(nostack, readonly),
            )
        }
    }
    #[inline(always)]
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: as the trait's contract.
        unsafe {
            std::arch::asm!(
                "tdpbf16ps tmm{c}, tmm{a}, tmm{b}",
                c = const C,
                a = const A,
                b = const B,
                options(nomem, nostack),
            )
        }
    }
    #[inline(always)]
    unsafe fn store<const T: u8>(&self, at: *mut u8, stride: usize) {
        // SAFETY: as the trait's contract.
        unsafe {
            std::arch::asm!(
                "tilestored [{at} + {stride} * 1], tmm{t}",
                t = const T,
                at = in(reg) at,
                stride = in(reg) stride,
                options(nostack),
            )
        }
    }
    #[inline(always)]
    unsafe fn release(&mut self) {
        // SAFETY: tilerelease is valid in any state once the permission is granted.
        unsafe { std::arch::asm!("tilerelease", options(nomem, nostack)) }
    }
}

/// Writes a block's sums (row-major, `NR` a row) to rows `i0..` and columns `j0..` of the
/// product's destination.
pub(super) type WriteBack = unsafe fn(&Product<'_>, &[f32], usize, usize);

/// The tiles of row strips `strips` on the CPU's tiles.
///
/// # Safety
/// As `gemm_with`; [`ready`] is true.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn tiles(p: &Product<'_>, lhs: &LhsStrips<'_>, strips: Range<usize>) {
    // SAFETY: forwarded; `ready` implies AVX512_BF16 for the write-back.
    unsafe { tiles_on(&mut Hardware, super::avx512::write_tile, p, lhs, strips) }
}

/// Without x86-64 there are no tiles ([`ready`] is false).
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn tiles(_: &Product<'_>, _: &LhsStrips<'_>, _: Range<usize>) {
    unreachable!("AMX tiles exist only on x86-64")
}

/// The tiles of row strips `strips` on `unit`, each tile's sums written by `write`: the
/// unit configured for the product's k, every tile computed, the unit released.
///
/// # Safety
/// As `gemm_with`; the lhs is in the `Tiles` layout; `unit` can run the instructions and
/// `write` can run on this CPU.
pub(super) unsafe fn tiles_on<U: TileUnit>(
    unit: &mut U,
    write: WriteBack,
    p: &Product<'_>,
    lhs: &LhsStrips<'_>,
    strips: Range<usize>,
) {
    debug_assert!(p.rows == ROWS && p.strip_pairs.is_multiple_of(TILE_PAIRS));
    let cfg = kernel_config();
    // SAFETY: as the caller vouches; the tiles named are the configuration's.
    unsafe {
        unit.configure(&cfg);
        super::for_each_tile(p, lhs, strips, |a, b, i0, j0| {
            let sums = block(unit, p.strip_pairs, a, b);
            write(p, &sums, i0, j0);
        });
        unit.release();
    }
}

/// One block's sums: the four accumulators over k, 16 pairs at a time.
///
/// # Safety
/// As [`tiles_on`]; `a` holds `pairs` pairs of [`ROWS`] rows, each block of 16 pairs of a
/// row contiguous (`a.pair` is 4), `b` holds `pairs` pairs of `NR` u32, and `pairs` is a
/// multiple of [`TILE_PAIRS`].
#[inline(always)]
unsafe fn block<U: TileUnit>(
    unit: &mut U,
    pairs: usize,
    a: LhsStrip,
    b: &[u32],
) -> [f32; ROWS * NR] {
    debug_assert_eq!(a.pair, 4, "tile loads read a row's pairs contiguously");
    let b = b.as_ptr().cast::<u8>();
    // A pair of k of the rhs strip is `NR` u32; its second 16 columns start 64 bytes in.
    let b_row = NR * 4;
    // SAFETY: the loads stay inside the strips: `q + 16 <= pairs` for every block of k.
    unsafe {
        let a1 = a.at.add(TILE_ROWS * a.row);
        unit.zero::<C00>();
        unit.zero::<C01>();
        unit.zero::<C10>();
        unit.zero::<C11>();
        for q in (0..pairs).step_by(TILE_PAIRS) {
            let a_block = q / TILE_PAIRS * a.block;
            unit.load::<A0>(a.at.add(a_block), a.row);
            unit.load::<B0>(b.add(q * b_row), b_row);
            unit.dot::<C00, A0, B0>();
            unit.load::<B1>(b.add(q * b_row + 64), b_row);
            unit.dot::<C01, A0, B1>();
            unit.load::<A1>(a1.add(a_block), a.row);
            unit.dot::<C10, A1, B0>();
            unit.dot::<C11, A1, B1>();
        }
        let mut sums = [0f32; ROWS * NR];
        let out = sums.as_mut_ptr().cast::<u8>();
        let lower = out.add(TILE_ROWS * NR * 4);
        unit.store::<C00>(out, NR * 4);
        unit.store::<C01>(out.add(64), NR * 4);
        unit.store::<C10>(lower, NR * 4);
        unit.store::<C11>(lower.add(64), NR * 4);
        sums
    }
}

/// One core's AMX limit: `trips` trips of 16 `tdpbf16ps` on full 16×16×32 tiles into four
/// independent accumulators (16,384 FLOP each), nothing loaded.
///
/// # Safety
/// [`ready`] is true.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn peak_loop(trips: usize) {
    let mut cfg = TileConfig::new();
    for t in 0..8 {
        cfg = cfg.with(t, 16, 64);
    }
    let unit = &mut Hardware;
    // SAFETY: the caller vouches for the tiles; every tile named is configured.
    unsafe {
        unit.configure(&cfg);
        for _ in 0..trips {
            for _ in 0..4 {
                unit.dot::<0, 4, 6>();
                unit.dot::<1, 4, 7>();
                unit.dot::<2, 5, 6>();
                unit.dot::<3, 5, 7>();
            }
        }
        unit.release();
    }
}
