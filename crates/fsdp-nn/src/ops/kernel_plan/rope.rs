//! Rotary position embedding's plan (`kernels/rope.cu`).

use candle_core::{DType, Result};

use super::{KernelArg, Launch, Module, checked_name};

/// The buffers of rope's plan, by index.
pub(crate) mod buffers {
    /// The input (forward) or the output's gradient (backward).
    pub const X: usize = 0;
    /// f32 cos of each (position, frequency), `[positions, head_dim / 2]`.
    pub const COS: usize = 1;
    /// f32 sin, as `COS`.
    pub const SIN: usize = 2;
    /// The output (forward) or the input's gradient (backward).
    pub const Y: usize = 3;
}

/// Threads per block.
const THREADS: u32 = 256;
/// At most this many blocks: each thread then takes pairs a grid apart.
const MAX_BLOCKS: usize = 4096;

/// Rope over `batch` sequences of `seq` positions, `heads` heads of `head_dim`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RopeShape {
    pub batch: usize,
    pub heads: usize,
    pub seq: usize,
    pub head_dim: usize,
    pub dtype: DType,
    /// The tables hold `batch * seq` positions (each sequence its own), not `seq`.
    pub per_batch: bool,
    /// `[batch, seq, heads, head_dim]` rather than `[batch, heads, seq, head_dim]`.
    pub seq_first: bool,
}

impl RopeShape {
    /// The rotation (`backward` false) or its transpose, the gradient's (`backward` true);
    /// none for an empty tensor.
    pub fn plan(&self, backward: bool) -> Result<Vec<Launch>> {
        let n = self.batch * self.heads * self.seq * self.head_dim;
        let kernel = checked_name("rope", self.dtype, &[n])?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let pairs = n / 2;
        let blocks = pairs.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
        let int = |v: usize| KernelArg::Int(v as i32);
        Ok(vec![Launch {
            module: Module::Rope,
            kernel,
            grid: [blocks, 1, 1],
            block: [THREADS, 1, 1],
            args: vec![
                KernelArg::Buffer(buffers::X),
                KernelArg::Buffer(buffers::COS),
                KernelArg::Buffer(buffers::SIN),
                KernelArg::Buffer(buffers::Y),
                int(self.batch),
                int(self.heads),
                int(self.seq),
                int(self.head_dim),
                KernelArg::Int(i32::from(self.per_batch)),
                KernelArg::Int(i32::from(self.seq_first)),
                KernelArg::Float(if backward { -1.0 } else { 1.0 }),
            ],
        }])
    }
}
