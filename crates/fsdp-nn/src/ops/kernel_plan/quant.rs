//! Dequantizing NF4 weights' plan (`kernels/quant.cu`).

use candle_core::{DType, Result};

use super::{KernelArg, Launch, Module, checked_name};

/// The buffers of the dequantize plan, by index.
pub(crate) mod buffers {
    /// The weight's words, `[rows, row_words]` (bytes read as the blocks they hold).
    pub const WORDS: usize = 0;
    /// The f32 weight, `[rows, cols]`.
    pub const OUT: usize = 1;
}

/// Threads per block and most blocks of the element loop.
const THREADS: u32 = 256;
const MAX_BLOCKS: usize = 4096;

/// An NF4 weight of `rows` rows of `cols` elements (whole blocks of 64), each held in
/// `row_words` words.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Nf4Shape {
    pub rows: usize,
    pub cols: usize,
    pub row_words: usize,
}

impl Nf4Shape {
    /// The weight dequantized into `OUT`; none for an empty weight.
    pub fn dequantize(&self) -> Result<Vec<Launch>> {
        let kernel = checked_name("nf4_dequantize", DType::F32, &[self.rows * self.cols])?;
        if !self.cols.is_multiple_of(64) || self.row_words * 4 < self.cols / 64 * 36 {
            candle_core::bail!(
                "nf4_dequantize: rows of {} elements in {} words are not whole NF4 blocks",
                self.cols,
                self.row_words
            );
        }
        let pairs = self.rows * self.cols / 2;
        if pairs == 0 {
            return Ok(Vec::new());
        }
        let blocks = pairs.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
        let int = |v: usize| KernelArg::Int(v as i32);
        Ok(vec![Launch {
            module: Module::Quant,
            kernel,
            grid: [blocks, 1, 1],
            block: [THREADS, 1, 1],
            args: vec![
                KernelArg::Buffer(buffers::WORDS),
                KernelArg::Buffer(buffers::OUT),
                int(self.rows),
                int(self.cols),
                int(self.row_words),
            ],
        }])
    }
}
