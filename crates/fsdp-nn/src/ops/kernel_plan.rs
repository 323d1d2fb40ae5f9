//! Launch plans for fsdp-nn's own CUDA kernels (`crates/fsdp-nn/kernels/*.cu`): which kernels
//! an op runs, on what grid, with which buffers and scalars. A plan is plain data, so one plan
//! runs on a GPU (`cuda_kernels.rs`, feature `cuda`) and on the CPU emulator that tests the
//! kernels' logic where there is no GPU (`kernels/emulator`, `tests.rs`).

use candle_core::{DType, Result};

/// One argument of a kernel launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum KernelArg {
    /// A pointer to the plan's buffer of this index.
    Buffer(usize),
    /// A null pointer (an optional input left out).
    Null,
    /// A 32-bit integer.
    Int(i32),
    /// A 32-bit float.
    Float(f32),
}

/// One kernel launch.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Launch {
    /// The kernel's name, its element type's suffix included.
    pub kernel: String,
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// The kernel's parameters in order.
    pub args: Vec<KernelArg>,
}

/// The kernels' name suffix for tensors of `dtype`; `None` where they have no kernel for it.
pub(crate) fn suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

/// The buffers of a norm's forward plan, by index.
pub(crate) mod forward {
    /// The input, `[rows, d]`.
    pub const X: usize = 0;
    /// The residual added to the input first (`add_layer_norm`), `[rows, d]`.
    pub const RESIDUAL: usize = 1;
    /// The scale, `[d]`.
    pub const GAMMA: usize = 2;
    /// The shift (LayerNorm), `[d]`.
    pub const BETA: usize = 3;
    /// The output, `[rows, d]`.
    pub const Y: usize = 4;
}

/// The buffers of a norm's backward plan, by index.
pub(crate) mod backward {
    /// The input, `[rows, d]`.
    pub const X: usize = 0;
    /// The residual added to the input first, `[rows, d]`.
    pub const RESIDUAL: usize = 1;
    /// The scale, `[d]`.
    pub const GAMMA: usize = 2;
    /// The output's gradient, `[rows, d]`.
    pub const GRAD: usize = 3;
    /// The input's gradient (also the residual's), `[rows, d]`.
    pub const DX: usize = 4;
    /// f32 scratch: each row's mean and 1/std, `[rows, 2]`.
    pub const ROW_STATS: usize = 5;
    /// f32 scratch: the parameter gradients' partial sums, `[chunks, 2, d]`.
    pub const PARTIALS: usize = 6;
    /// The scale's gradient, `[d]`.
    pub const DGAMMA: usize = 7;
    /// The shift's gradient (LayerNorm), `[d]`.
    pub const DBETA: usize = 8;
}

/// Rows summed by one thread of the parameter gradients' first pass.
const ROWS_PER_CHUNK: usize = 64;

/// A LayerNorm or RMSNorm over the last dimension of `[rows, d]` in `dtype`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NormShape {
    pub rows: usize,
    pub d: usize,
    pub dtype: DType,
    /// LayerNorm (subtract the mean) rather than RMSNorm.
    pub center: bool,
    /// A residual is added to the input first.
    pub residual: bool,
    /// A shift is added after the scale (LayerNorm's beta).
    pub beta: bool,
    pub eps: f64,
}

impl NormShape {
    fn kernel(&self, name: &str) -> Result<String> {
        let suffix = suffix(self.dtype).ok_or_else(|| {
            candle_core::Error::Msg(format!("{name}: no CUDA kernel for {:?}", self.dtype))
        })?;
        if i32::try_from(self.rows).is_err() || i32::try_from(self.d).is_err() {
            candle_core::bail!(
                "{name}: {} rows of {} elements exceed the kernels' 32-bit counts",
                self.rows,
                self.d
            );
        }
        Ok(format!("fsdp_norm_{name}_{suffix}"))
    }

    /// Threads of a row's block: enough 32-thread warps to cover `d` once, at most 256.
    fn row_threads(&self) -> u32 {
        self.d.div_ceil(32).clamp(1, 8) as u32 * 32
    }

    /// Threads of a column pass's block and the blocks to cover `d`.
    fn column_blocks(&self) -> (u32, u32) {
        let threads = self.row_threads();
        (threads, self.d.div_ceil(threads as usize) as u32)
    }

    /// Chunks of rows the parameter gradients sum separately, then add in order.
    pub fn chunks(&self) -> usize {
        self.rows.div_ceil(ROWS_PER_CHUNK)
    }

    fn optional(&self, present: bool, index: usize) -> KernelArg {
        if present {
            KernelArg::Buffer(index)
        } else {
            KernelArg::Null
        }
    }

    /// The forward's launches (buffers in [`forward`]); none for an empty tensor.
    pub fn forward(&self) -> Result<Vec<Launch>> {
        use forward::*;
        let kernel = self.kernel("forward")?;
        if self.rows == 0 || self.d == 0 {
            return Ok(Vec::new());
        }
        Ok(vec![Launch {
            kernel,
            grid: [self.rows as u32, 1, 1],
            block: [self.row_threads(), 1, 1],
            args: vec![
                KernelArg::Buffer(X),
                self.optional(self.residual, RESIDUAL),
                KernelArg::Buffer(GAMMA),
                self.optional(self.beta, BETA),
                KernelArg::Buffer(Y),
                KernelArg::Int(self.d as i32),
                KernelArg::Float(self.eps as f32),
                KernelArg::Int(i32::from(self.center)),
            ],
        }])
    }

    /// The backward's launches (buffers in [`backward`]: `ROW_STATS` holds `2 * rows` f32,
    /// `PARTIALS` `2 * chunks() * d`); none for an empty tensor.
    pub fn backward(&self) -> Result<Vec<Launch>> {
        use backward::*;
        let names = [
            self.kernel("backward_rows")?,
            self.kernel("param_partials")?,
            self.kernel("param_totals")?,
        ];
        if self.rows == 0 || self.d == 0 {
            return Ok(Vec::new());
        }
        let [rows_kernel, partials_kernel, totals_kernel] = names;
        let (threads, column_blocks) = self.column_blocks();
        let d = KernelArg::Int(self.d as i32);
        Ok(vec![
            Launch {
                kernel: rows_kernel,
                grid: [self.rows as u32, 1, 1],
                block: [self.row_threads(), 1, 1],
                args: vec![
                    KernelArg::Buffer(X),
                    self.optional(self.residual, RESIDUAL),
                    KernelArg::Buffer(GAMMA),
                    KernelArg::Buffer(GRAD),
                    KernelArg::Buffer(DX),
                    KernelArg::Buffer(ROW_STATS),
                    d,
                    KernelArg::Float(self.eps as f32),
                    KernelArg::Int(i32::from(self.center)),
                ],
            },
            Launch {
                kernel: partials_kernel,
                grid: [column_blocks, self.chunks() as u32, 1],
                block: [threads, 1, 1],
                args: vec![
                    KernelArg::Buffer(X),
                    self.optional(self.residual, RESIDUAL),
                    KernelArg::Buffer(GRAD),
                    KernelArg::Buffer(ROW_STATS),
                    KernelArg::Buffer(PARTIALS),
                    KernelArg::Int(self.rows as i32),
                    d,
                    KernelArg::Int(ROWS_PER_CHUNK as i32),
                ],
            },
            Launch {
                kernel: totals_kernel,
                grid: [column_blocks, 1, 1],
                block: [threads, 1, 1],
                args: vec![
                    KernelArg::Buffer(PARTIALS),
                    KernelArg::Buffer(DGAMMA),
                    self.optional(self.beta, DBETA),
                    KernelArg::Int(self.chunks() as i32),
                    d,
                ],
            },
        ])
    }
}

#[cfg(test)]
mod tests;
