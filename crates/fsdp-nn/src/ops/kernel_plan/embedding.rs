//! The embedding backward's plan (`kernels/embedding.cu`).

use candle_core::{DType, Result};

use super::{KernelArg, Launch, Module, checked_name, column_blocks};

/// The buffers of the embedding backward, by index.
pub(crate) mod buffers {
    /// The output's gradient, `[positions, d]`.
    pub const GRAD: usize = 0;
    /// Where each table row's positions start in `POSITIONS`, `[rows + 1]` (i32).
    pub const STARTS: usize = 1;
    /// The positions that looked up each row, grouped by row, in order (i32).
    pub const POSITIONS: usize = 2;
    /// The table's gradient, `[rows, d]`.
    pub const DW: usize = 3;
}

/// Most blocks along the rows (CUDA's limit for y is 65535).
const MAX_ROW_BLOCKS: usize = 65535;

/// A table of `rows` rows of `d` elements, of `dtype`, looked up at `positions` positions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EmbeddingShape {
    pub rows: usize,
    pub d: usize,
    pub positions: usize,
    pub dtype: DType,
}

impl EmbeddingShape {
    /// The table's gradient into `DW` (every row written); none for an empty table.
    pub fn backward(&self) -> Result<Vec<Launch>> {
        let kernel = checked_name(
            "embedding_backward",
            self.dtype,
            &[self.rows * self.d, self.positions * self.d, self.rows + 1],
        )?;
        if self.rows == 0 || self.d == 0 {
            return Ok(Vec::new());
        }
        let (threads, column_blocks) = column_blocks(self.d);
        let row_blocks = self.rows.min(MAX_ROW_BLOCKS) as u32;
        let int = |v: usize| KernelArg::Int(v as i32);
        Ok(vec![Launch {
            module: Module::Embedding,
            kernel,
            grid: [column_blocks, row_blocks, 1],
            block: [threads, 1, 1],
            args: vec![
                KernelArg::Buffer(buffers::GRAD),
                KernelArg::Buffer(buffers::STARTS),
                KernelArg::Buffer(buffers::POSITIONS),
                KernelArg::Buffer(buffers::DW),
                int(self.rows),
                int(self.d),
            ],
        }])
    }
}

/// The positions of `ids` grouped by the row they look up, as the kernel reads them:
/// `(starts, positions)`, `starts` of `rows + 1` offsets into `positions`; the positions of
/// `padding_idx` left out (its row gets no gradient).
pub(crate) fn positions_by_row(
    ids: &[usize],
    rows: usize,
    padding_idx: Option<usize>,
) -> (Vec<u32>, Vec<u32>) {
    let mut starts = vec![0u32; rows + 1];
    for &id in ids.iter().filter(|&&id| Some(id) != padding_idx) {
        starts[id + 1] += 1;
    }
    for r in 0..rows {
        starts[r + 1] += starts[r];
    }
    let mut next = starts.clone();
    let mut positions = vec![0u32; starts[rows] as usize];
    for (pos, &id) in ids.iter().enumerate() {
        if Some(id) != padding_idx {
            positions[next[id] as usize] = pos as u32;
            next[id] += 1;
        }
    }
    (starts, positions)
}
