//! The norms' plans: LayerNorm and RMSNorm (`kernels/norm.cu`).

use candle_core::{DType, Result};

use super::{
    KernelArg, Launch, Module, ROWS_PER_CHUNK, checked_name, chunks, column_blocks, optional,
    row_threads,
};

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
        checked_name(&format!("norm_{name}"), self.dtype, &[self.rows, self.d])
    }

    /// Chunks of rows the parameter gradients sum separately, then add in order.
    pub fn chunks(&self) -> usize {
        chunks(self.rows)
    }

    fn launch(&self, kernel: String, grid: [u32; 3], block: u32, args: Vec<KernelArg>) -> Launch {
        Launch {
            module: Module::Norm,
            kernel,
            grid,
            block: [block, 1, 1],
            args,
        }
    }

    /// The forward's launches (buffers in [`forward`]); none for an empty tensor.
    pub fn forward(&self) -> Result<Vec<Launch>> {
        use forward::*;
        let kernel = self.kernel("forward")?;
        if self.rows == 0 || self.d == 0 {
            return Ok(Vec::new());
        }
        let args = vec![
            KernelArg::Buffer(X),
            optional(self.residual, RESIDUAL),
            KernelArg::Buffer(GAMMA),
            optional(self.beta, BETA),
            KernelArg::Buffer(Y),
            KernelArg::Int(self.d as i32),
            KernelArg::Float(self.eps as f32),
            KernelArg::Int(i32::from(self.center)),
        ];
        let rows = [self.rows as u32, 1, 1];
        Ok(vec![self.launch(kernel, rows, row_threads(self.d), args)])
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
        let (threads, column_blocks) = column_blocks(self.d);
        let d = KernelArg::Int(self.d as i32);
        let rows_args = vec![
            KernelArg::Buffer(X),
            optional(self.residual, RESIDUAL),
            KernelArg::Buffer(GAMMA),
            KernelArg::Buffer(GRAD),
            KernelArg::Buffer(DX),
            KernelArg::Buffer(ROW_STATS),
            d,
            KernelArg::Float(self.eps as f32),
            KernelArg::Int(i32::from(self.center)),
        ];
        let partials_args = vec![
            KernelArg::Buffer(X),
            optional(self.residual, RESIDUAL),
            KernelArg::Buffer(GRAD),
            KernelArg::Buffer(ROW_STATS),
            KernelArg::Buffer(PARTIALS),
            KernelArg::Int(self.rows as i32),
            d,
            KernelArg::Int(ROWS_PER_CHUNK as i32),
        ];
        let totals_args = vec![
            KernelArg::Buffer(PARTIALS),
            KernelArg::Buffer(DGAMMA),
            optional(self.beta, DBETA),
            KernelArg::Int(self.chunks() as i32),
            d,
        ];
        let chunk_grid = [column_blocks, self.chunks() as u32, 1];
        Ok(vec![
            self.launch(
                rows_kernel,
                [self.rows as u32, 1, 1],
                row_threads(self.d),
                rows_args,
            ),
            self.launch(partials_kernel, chunk_grid, threads, partials_args),
            self.launch(totals_kernel, [column_blocks, 1, 1], threads, totals_args),
        ])
    }
}
