//! Cross-entropy's plans (`kernels/cross_entropy.cu`).

use candle_core::{DType, Result};

use super::{KernelArg, Launch, Module, checked_name, row_threads};

/// The buffers of cross-entropy's plans, by index.
pub(crate) mod buffers {
    /// The logits, `[rows, classes]`.
    pub const LOGITS: usize = 0;
    /// The targets, i64 `[rows]`.
    pub const TARGETS: usize = 1;
    /// f32: each row's loss (0 where ignored), `[rows]`.
    pub const LOSS_ROWS: usize = 2;
    /// f32: each row's log-sum-exp, `[rows]`.
    pub const LSE: usize = 3;
    /// The logits' gradient, `[rows, classes]`.
    pub const DLOGITS: usize = 4;
    /// f32: the scaled sum of the rows' losses, `[1]`.
    pub const LOSS: usize = 5;
}

/// Threads of the single block that sums the rows' losses.
const SUM_THREADS: u32 = 256;
/// Threads per block and most blocks of the gradient's element loop.
const ELEMENT_THREADS: u32 = 256;
const MAX_ELEMENT_BLOCKS: usize = 4096;

/// Cross-entropy of `rows` rows of `classes` logits in `dtype`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CrossEntropyShape {
    pub rows: usize,
    pub classes: usize,
    pub dtype: DType,
    pub ignore_index: i64,
    pub label_smoothing: f64,
}

impl CrossEntropyShape {
    fn common(&self) -> [KernelArg; 3] {
        [
            KernelArg::Int(self.classes as i32),
            KernelArg::Long(self.ignore_index),
            KernelArg::Float(self.label_smoothing as f32),
        ]
    }

    /// Forward: `LOSS_ROWS`, `LSE`, and `LOSS` = `loss_scale` times their sum (1 / the
    /// counted targets for a mean, 1 for a sum); none for no rows.
    pub fn forward(&self, loss_scale: f64) -> Result<Vec<Launch>> {
        use buffers::*;
        let kernel = checked_name(
            "cross_entropy_forward",
            self.dtype,
            &[self.rows, self.classes],
        )?;
        let sum = checked_name("sum_rows", DType::F32, &[self.rows])?;
        if self.rows == 0 || self.classes == 0 {
            return Ok(Vec::new());
        }
        let mut args = [LOGITS, TARGETS, LOSS_ROWS, LSE]
            .map(KernelArg::Buffer)
            .to_vec();
        args.extend(self.common());
        Ok(vec![
            Launch {
                module: Module::CrossEntropy,
                kernel,
                grid: [self.rows as u32, 1, 1],
                block: [row_threads(self.classes), 1, 1],
                args,
            },
            Launch {
                module: Module::CrossEntropy,
                kernel: sum,
                grid: [1, 1, 1],
                block: [SUM_THREADS, 1, 1],
                args: vec![
                    KernelArg::Buffer(LOSS_ROWS),
                    KernelArg::Buffer(LOSS),
                    KernelArg::Int(self.rows as i32),
                    KernelArg::Float(loss_scale as f32),
                ],
            },
        ])
    }

    /// Backward from forward's `LSE`: `DLOGITS` = `(softmax - q) * grad_scale`; none for no
    /// rows.
    pub fn backward(&self, grad_scale: f64) -> Result<Vec<Launch>> {
        use buffers::*;
        let n = self.rows * self.classes;
        let kernel = checked_name(
            "cross_entropy_backward",
            self.dtype,
            &[self.rows, self.classes],
        )?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let [classes, ignore, eps] = self.common();
        let blocks = n
            .div_ceil(ELEMENT_THREADS as usize)
            .clamp(1, MAX_ELEMENT_BLOCKS);
        Ok(vec![Launch {
            module: Module::CrossEntropy,
            kernel,
            grid: [blocks as u32, 1, 1],
            block: [ELEMENT_THREADS, 1, 1],
            args: vec![
                KernelArg::Buffer(LOGITS),
                KernelArg::Buffer(TARGETS),
                KernelArg::Buffer(LSE),
                KernelArg::Buffer(DLOGITS),
                KernelArg::Long(n as i64),
                classes,
                ignore,
                eps,
                KernelArg::Float(grad_scale as f32),
            ],
        }])
    }
}
