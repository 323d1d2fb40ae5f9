//! Softmax's plans (`kernels/softmax.cu`).

use candle_core::{DType, Result};

use super::{KernelArg, Launch, Module, checked_name, row_threads};

/// The buffers of softmax's plans, by index.
pub(crate) mod buffers {
    /// The input, `[rows, d]`.
    pub const X: usize = 0;
    /// The output, `[rows, d]` (backward reads it).
    pub const Y: usize = 1;
    /// The output's gradient, `[rows, d]`.
    pub const GRAD: usize = 2;
    /// The input's gradient, `[rows, d]`.
    pub const DX: usize = 3;
}

/// Softmax over the last dimension of `[rows, d]` in `dtype`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SoftmaxShape {
    pub rows: usize,
    pub d: usize,
    pub dtype: DType,
}

impl SoftmaxShape {
    /// One block per row running `name` on `buffers`, then the row length.
    fn launch(&self, name: &str, buffers: &[usize]) -> Result<Vec<Launch>> {
        let kernel = checked_name(name, self.dtype, &[self.rows, self.d, self.rows * self.d])?;
        if self.rows == 0 || self.d == 0 {
            return Ok(Vec::new());
        }
        let mut args: Vec<KernelArg> = buffers.iter().map(|&b| KernelArg::Buffer(b)).collect();
        args.push(KernelArg::Int(self.d as i32));
        Ok(vec![Launch {
            module: Module::Softmax,
            kernel,
            grid: [self.rows as u32, 1, 1],
            block: [row_threads(self.d), 1, 1],
            args,
        }])
    }

    /// `Y` from `X`.
    pub fn forward(&self) -> Result<Vec<Launch>> {
        self.launch("softmax_forward", &[buffers::X, buffers::Y])
    }

    /// `DX` from `Y` and `GRAD`.
    pub fn backward(&self) -> Result<Vec<Launch>> {
        self.launch(
            "softmax_backward",
            &[buffers::Y, buffers::GRAD, buffers::DX],
        )
    }
}
