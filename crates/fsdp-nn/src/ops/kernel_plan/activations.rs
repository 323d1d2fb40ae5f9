//! The element-wise ops' plans: SwiGLU, GELU and dropout (`kernels/activations.cu`).

use candle_core::{DType, Result, Shape};

use super::{
    KernelArg, Launch, Module, ROWS_PER_CHUNK, checked_name, chunks, column_blocks, optional,
};
use crate::rng::dropout_threshold;

/// The buffers of SwiGLU's plans, by index.
pub(crate) mod swiglu {
    /// `gate`, `[n]`.
    pub const GATE: usize = 0;
    /// `up`, `[n]`.
    pub const UP: usize = 1;
    /// The output (forward) or its gradient (backward), `[n]`.
    pub const Y: usize = 2;
    /// `gate`'s gradient, `[n]`.
    pub const DGATE: usize = 3;
    /// `up`'s gradient, `[n]`.
    pub const DUP: usize = 4;
}

/// The buffers of GELU's plans, by index.
pub(crate) mod gelu {
    /// The input, `[rows, d]`.
    pub const X: usize = 0;
    /// The bias added to each row first (`bias_gelu`), `[d]`.
    pub const BIAS: usize = 1;
    /// The output (forward) or its gradient (backward), `[rows, d]`.
    pub const Y: usize = 2;
    /// The input's gradient, `[rows, d]`.
    pub const DX: usize = 3;
    /// f32 scratch: the bias gradient's partial sums, `[chunks, d]`.
    pub const PARTIALS: usize = 4;
    /// The bias's gradient, `[d]`.
    pub const DBIAS: usize = 5;
}

/// The buffers of dropout's plan, by index.
pub(crate) mod dropout {
    /// The input (forward) or the output's gradient (backward), `[n]`.
    pub const X: usize = 0;
    /// The output (forward) or the input's gradient (backward), `[n]`.
    pub const Y: usize = 1;
    /// u32: for packed rows, each row's row in the padded batch, `[rows]`.
    pub const PADDED_ROWS: usize = 2;
}

/// Threads per block of the element kernels.
const ELEMENT_THREADS: u32 = 256;
/// At most this many blocks: each thread then takes elements a grid apart.
const MAX_ELEMENT_BLOCKS: usize = 4096;

/// An element-wise op over `rows` rows of `d` elements in `dtype`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ElementShape {
    pub rows: usize,
    pub d: usize,
    pub dtype: DType,
}

impl ElementShape {
    /// An op over a tensor of `shape` (rows of its last dimension) in `dtype`.
    pub fn over(shape: &Shape, dtype: DType) -> ElementShape {
        let (rows, d) = super::super::rows(shape);
        ElementShape { rows, d, dtype }
    }

    fn n(&self) -> usize {
        self.rows * self.d
    }

    fn kernel(&self, name: &str) -> Result<String> {
        checked_name(name, self.dtype, &[self.rows, self.d, self.n()])
    }

    /// Chunks of rows the bias gradient sums separately, then adds in order.
    pub fn chunks(&self) -> usize {
        chunks(self.rows)
    }

    /// A launch of an element kernel over all `n` elements.
    fn elements(&self, kernel: String, args: Vec<KernelArg>) -> Launch {
        let blocks = self
            .n()
            .div_ceil(ELEMENT_THREADS as usize)
            .clamp(1, MAX_ELEMENT_BLOCKS);
        Launch {
            module: Module::Activations,
            kernel,
            grid: [blocks as u32, 1, 1],
            block: [ELEMENT_THREADS, 1, 1],
            args,
        }
    }

    /// SwiGLU forward (buffers in [`swiglu`]); none for an empty tensor.
    pub fn swiglu_forward(&self) -> Result<Vec<Launch>> {
        use swiglu::*;
        let kernel = self.kernel("swiglu_forward")?;
        let args = [GATE, UP, Y].map(KernelArg::Buffer).to_vec();
        Ok(self.unless_empty(|| vec![self.elements(kernel, self.with_n(args))]))
    }

    /// SwiGLU backward: `Y` holds the output's gradient.
    pub fn swiglu_backward(&self) -> Result<Vec<Launch>> {
        use swiglu::*;
        let kernel = self.kernel("swiglu_backward")?;
        let args = [GATE, UP, Y, DGATE, DUP].map(KernelArg::Buffer).to_vec();
        Ok(self.unless_empty(|| vec![self.elements(kernel, self.with_n(args))]))
    }

    /// GELU forward (buffers in [`gelu`]), of `x + bias` where `bias`, the tanh form where
    /// `tanh`.
    pub fn gelu_forward(&self, bias: bool, tanh: bool) -> Result<Vec<Launch>> {
        use gelu::*;
        let kernel = self.kernel("gelu_forward")?;
        let args = vec![
            KernelArg::Buffer(X),
            optional(bias, BIAS),
            KernelArg::Buffer(Y),
        ];
        Ok(self.unless_empty(|| vec![self.elements(kernel, self.gelu_args(args, tanh))]))
    }

    /// GELU backward: `Y` holds the output's gradient; with `bias`, the bias's gradient is the
    /// input's summed over rows (`PARTIALS` holds `chunks() * d` f32).
    pub fn gelu_backward(&self, bias: bool, tanh: bool) -> Result<Vec<Launch>> {
        use gelu::*;
        let names = [
            self.kernel("gelu_backward")?,
            self.kernel("column_partials")?,
            self.kernel("column_totals")?,
        ];
        let [gelu_kernel, partials_kernel, totals_kernel] = names;
        let args = vec![
            KernelArg::Buffer(X),
            optional(bias, BIAS),
            KernelArg::Buffer(Y),
            KernelArg::Buffer(DX),
        ];
        Ok(self.unless_empty(|| {
            let mut plan = vec![self.elements(gelu_kernel, self.gelu_args(args, tanh))];
            if bias {
                let (threads, blocks) = column_blocks(self.d);
                let d = KernelArg::Int(self.d as i32);
                let column = |kernel, grid, args| Launch {
                    module: Module::Activations,
                    kernel,
                    grid,
                    block: [threads, 1, 1],
                    args,
                };
                plan.push(column(
                    partials_kernel,
                    [blocks, self.chunks() as u32, 1],
                    vec![
                        KernelArg::Buffer(DX),
                        KernelArg::Buffer(PARTIALS),
                        KernelArg::Int(self.rows as i32),
                        d,
                        KernelArg::Int(ROWS_PER_CHUNK as i32),
                    ],
                ));
                plan.push(column(
                    totals_kernel,
                    [blocks, 1, 1],
                    vec![
                        KernelArg::Buffer(PARTIALS),
                        KernelArg::Buffer(DBIAS),
                        KernelArg::Int(self.chunks() as i32),
                        d,
                    ],
                ));
            }
            plan
        }))
    }

    /// Dropout with probability `p` (in (0, 1)) under `seed`: forward, and backward on the
    /// output's gradient (the same mask and scale). With `packed`, the rows are packed
    /// sequences' and draw the padded batch's mask (`PADDED_ROWS` says where each lay).
    pub fn dropout(&self, p: f64, seed: u64, packed: bool) -> Result<Vec<Launch>> {
        let kernel = self.kernel("dropout")?;
        let args = vec![
            KernelArg::Buffer(dropout::X),
            KernelArg::Buffer(dropout::Y),
            optional(packed, dropout::PADDED_ROWS),
            KernelArg::Int(self.n() as i32),
            KernelArg::Int(self.d as i32),
            KernelArg::U64(seed),
            KernelArg::U64(dropout_threshold(p)),
            KernelArg::Float((1.0 / (1.0 - p)) as f32),
        ];
        Ok(self.unless_empty(|| vec![self.elements(kernel, args)]))
    }

    fn with_n(&self, mut args: Vec<KernelArg>) -> Vec<KernelArg> {
        args.push(KernelArg::Int(self.n() as i32));
        args
    }

    fn gelu_args(&self, mut args: Vec<KernelArg>, tanh: bool) -> Vec<KernelArg> {
        args.extend([
            KernelArg::Int(self.n() as i32),
            KernelArg::Int(self.d as i32),
            KernelArg::Int(i32::from(tanh)),
        ]);
        args
    }

    fn unless_empty(&self, plan: impl FnOnce() -> Vec<Launch>) -> Vec<Launch> {
        if self.n() == 0 { Vec::new() } else { plan() }
    }
}
