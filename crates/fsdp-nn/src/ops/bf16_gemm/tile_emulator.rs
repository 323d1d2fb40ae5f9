//! The AMX tile registers emulated per Intel's definitions of `ldtilecfg`, `tilezero`,
//! `tileloadd`, `tdpbf16ps`, `tilestored` and `tilerelease`, refusing (with a panic naming
//! the rule) every operand the CPU would fault on: the tests run the AMX kernel's
//! configuration, blocking, loads and write-back through it on CPUs without tiles.

use super::amx::{TileConfig, TileUnit};

/// Bytes of one tile register (16 rows of 64 bytes).
const TILE_BYTES: usize = 1024;

/// Eight tile registers and the configuration they were given.
pub(super) struct EmulatedTiles {
    config: Option<TileConfig>,
    registers: [[u8; TILE_BYTES]; 8],
    /// `tdpbf16ps` instructions run, for the tests to see the tiles were used.
    pub(super) dots: usize,
    /// `tileloadd`s run.
    pub(super) loads: usize,
    /// Configurations loaded and released, which a kernel must pair.
    pub(super) configured: usize,
    pub(super) released: usize,
}

impl EmulatedTiles {
    pub(super) fn new() -> EmulatedTiles {
        EmulatedTiles {
            config: None,
            registers: [[0; TILE_BYTES]; 8],
            dots: 0,
            loads: 0,
            configured: 0,
            released: 0,
        }
    }

    /// Tile `t`'s rows and bytes per row, refusing an unconfigured tile (#UD).
    fn shape(&self, op: &str, t: u8) -> (usize, usize) {
        let config = self
            .config
            .unwrap_or_else(|| panic!("{op} tmm{t} before ldtilecfg (#UD)"));
        let (rows, bytes) = config.shape(t);
        assert!(
            rows > 0 && bytes > 0,
            "{op} tmm{t}: the tile is not configured (#UD)"
        );
        (rows, bytes)
    }

    /// Row `r`'s f32 element `c` of tile `t`.
    fn f32_at(&self, t: u8, r: usize, c: usize) -> f32 {
        let at = r * 64 + 4 * c;
        f32::from_le_bytes(
            self.registers[usize::from(t)][at..at + 4]
                .try_into()
                .unwrap(),
        )
    }

    /// Row `r`'s bf16 element `e` of tile `t`, as `make_fp32` reads it: denormals as zero.
    fn bf16_at(&self, t: u8, r: usize, e: usize) -> f32 {
        let at = r * 64 + 2 * e;
        let bits = u16::from_le_bytes(
            self.registers[usize::from(t)][at..at + 2]
                .try_into()
                .unwrap(),
        );
        let x = f32::from_bits(u32::from(bits) << 16);
        if x.is_subnormal() {
            0.0f32.copysign(x)
        } else {
            x
        }
    }
}

impl TileUnit for EmulatedTiles {
    unsafe fn configure(&mut self, cfg: &TileConfig) {
        let bytes = &cfg.0;
        assert_eq!(
            bytes[0], 1,
            "ldtilecfg: palette {} (#GP: only palette 1)",
            bytes[0]
        );
        assert_eq!(bytes[1], 0, "ldtilecfg: start_row must be 0 (#GP)");
        assert!(
            bytes[2..16].iter().all(|&b| b == 0),
            "ldtilecfg: reserved bytes set (#GP)"
        );
        assert!(
            bytes[32..48].iter().all(|&b| b == 0),
            "ldtilecfg: colsb of tiles 8-15 (#GP)"
        );
        assert!(
            bytes[56..].iter().all(|&b| b == 0),
            "ldtilecfg: rows of tiles 8-15 (#GP)"
        );
        for t in 0..8 {
            let (rows, colsb) = cfg.shape(t);
            assert!(
                rows <= 16 && colsb <= 64,
                "ldtilecfg: tmm{t} {rows}x{colsb} (#GP)"
            );
            assert_eq!(
                rows == 0,
                colsb == 0,
                "ldtilecfg: tmm{t} half configured (#GP)"
            );
        }
        self.config = Some(*cfg);
        self.registers = [[0; TILE_BYTES]; 8];
        self.configured += 1;
    }

    unsafe fn zero<const T: u8>(&mut self) {
        self.shape("tilezero", T);
        self.registers[usize::from(T)] = [0; TILE_BYTES];
    }

    unsafe fn load<const T: u8>(&mut self, at: *const u8, stride: usize) {
        let (rows, bytes) = self.shape("tileloadd", T);
        self.loads += 1;
        let tile = &mut self.registers[usize::from(T)];
        *tile = [0; TILE_BYTES];
        for r in 0..rows {
            // SAFETY: the trait's contract: the rows are valid memory.
            let row = unsafe { std::slice::from_raw_parts(at.add(r * stride), bytes) };
            tile[r * 64..r * 64 + bytes].copy_from_slice(row);
        }
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        assert!(
            C != A && C != B && A != B,
            "tdpbf16ps tmm{C}, tmm{A}, tmm{B}: same tile twice (#UD)"
        );
        let (c_rows, c_bytes) = self.shape("tdpbf16ps", C);
        let (a_rows, a_bytes) = self.shape("tdpbf16ps", A);
        let (b_rows, b_bytes) = self.shape("tdpbf16ps", B);
        assert_eq!(
            c_rows, a_rows,
            "tdpbf16ps: tmm{C} and tmm{A} rows differ (#UD)"
        );
        assert_eq!(
            a_bytes,
            4 * b_rows,
            "tdpbf16ps: tmm{A} bytes are not 4 x tmm{B} rows (#UD)"
        );
        assert_eq!(
            c_bytes, b_bytes,
            "tdpbf16ps: tmm{C} and tmm{B} bytes differ (#UD)"
        );
        assert_eq!(c_bytes % 4, 0, "tdpbf16ps: tmm{C} holds no whole f32 (#UD)");
        let mut out = self.registers[usize::from(C)];
        for m in 0..c_rows {
            for n in 0..c_bytes / 4 {
                let mut sum = self.f32_at(C, m, n);
                for k in 0..a_bytes / 4 {
                    sum += self.bf16_at(A, m, 2 * k) * self.bf16_at(B, k, 2 * n);
                    sum += self.bf16_at(A, m, 2 * k + 1) * self.bf16_at(B, k, 2 * n + 1);
                }
                // Results are flushed to zero, as the instruction does.
                let sum = if sum.is_subnormal() {
                    0.0f32.copysign(sum)
                } else {
                    sum
                };
                out[m * 64 + 4 * n..m * 64 + 4 * n + 4].copy_from_slice(&sum.to_le_bytes());
            }
        }
        self.registers[usize::from(C)] = out;
        self.dots += 1;
    }

    unsafe fn store<const T: u8>(&self, at: *mut u8, stride: usize) {
        let (rows, bytes) = self.shape("tilestored", T);
        let tile = &self.registers[usize::from(T)];
        for r in 0..rows {
            // SAFETY: the trait's contract: the rows are valid memory.
            let row = unsafe { std::slice::from_raw_parts_mut(at.add(r * stride), bytes) };
            row.copy_from_slice(&tile[r * 64..r * 64 + bytes]);
        }
    }

    unsafe fn release(&mut self) {
        self.config = None;
        self.registers = [[0; TILE_BYTES]; 8];
        self.released += 1;
    }
}
