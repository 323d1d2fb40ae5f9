//! Launch plans for fsdp-nn's own CUDA kernels (`crates/fsdp-nn/kernels/*.cu`): which kernels
//! an op runs, on what grid, with which buffers and scalars. A plan is plain data, so one plan
//! runs on a GPU (`cuda_kernels.rs`, feature `cuda`) and on the CPU emulator that tests the
//! kernels' logic where there is no GPU (`kernels/emulator`, `tests.rs`).

use candle_core::{DType, Result};

mod activations;
mod attention;
mod cross_entropy;
mod embedding;
mod norm;
mod quant;
mod rope;
mod softmax;

pub(crate) use activations::{ElementShape, dropout, gelu, swiglu};
pub(crate) use attention::{AttentionShape, buffers as attention_buffers};
pub(crate) use cross_entropy::{CrossEntropyShape, buffers as cross_entropy_buffers};
pub(crate) use embedding::{EmbeddingShape, buffers as embedding_buffers, positions_by_row};
pub(crate) use norm::{NormShape, backward, forward};
pub(crate) use quant::{Nf4Shape, buffers as quant_buffers};
pub(crate) use rope::{RopeShape, buffers as rope_buffers};
pub(crate) use softmax::{SoftmaxShape, buffers as softmax_buffers};

/// One argument of a kernel launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum KernelArg {
    /// A pointer to the plan's buffer of this index.
    Buffer(usize),
    /// A null pointer (an optional input left out).
    Null,
    /// A 32-bit integer.
    Int(i32),
    /// A 64-bit integer (`long` in the kernels: strides).
    Long(i64),
    /// An unsigned 64-bit integer (`unsigned long long`: seeds and draw thresholds).
    U64(u64),
    /// A 32-bit float.
    Float(f32),
}

/// A file of kernels (`kernels/<name>.cu`), loaded as one PTX module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Module {
    /// `norm.cu`: LayerNorm and RMSNorm.
    Norm,
    /// `activations.cu`: SwiGLU, GELU, column sums.
    Activations,
    /// `rope.cu`: rotary position embedding.
    Rope,
    /// `attention.cu`: scaled dot-product attention.
    Attention,
    /// `cross_entropy.cu`: cross-entropy of logit rows.
    CrossEntropy,
    /// `quant.cu`: dequantizing NF4 weights.
    Quant,
    /// `embedding.cu`: the embedding table's gradient.
    Embedding,
    /// `softmax.cu`: softmax over rows.
    Softmax,
}

/// One kernel launch.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Launch {
    /// The file the kernel is in.
    pub module: Module,
    /// The kernel's name, its element type's suffix included.
    pub kernel: String,
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// The kernel's parameters in order.
    pub args: Vec<KernelArg>,
}

/// Rows one thread sums in the first pass of a column sum (parameter and bias gradients).
const ROWS_PER_CHUNK: usize = 64;

/// Chunks of `rows` a column sum adds separately, then in order.
fn chunks(rows: usize) -> usize {
    rows.div_ceil(ROWS_PER_CHUNK)
}

/// The kernel `fsdp_<name>_<suffix>` for `dtype`; an error naming it where there is no kernel
/// for the type or one of `counts` exceeds the kernels' 32-bit counts.
fn checked_name(name: &str, dtype: DType, counts: &[usize]) -> Result<String> {
    let suffix = suffix(dtype)
        .ok_or_else(|| candle_core::Error::Msg(format!("{name}: no CUDA kernel for {dtype:?}")))?;
    if counts.iter().any(|c| i32::try_from(*c).is_err()) {
        candle_core::bail!("{name}: sizes {counts:?} exceed the kernels' 32-bit counts");
    }
    Ok(format!("fsdp_{name}_{suffix}"))
}

/// Threads of a block over a row of `d` elements: whole 32-thread warps covering the row
/// once, at most 256.
fn row_threads(d: usize) -> u32 {
    d.div_ceil(32).clamp(1, 8) as u32 * 32
}

/// Threads per block and blocks covering `d` columns, one thread a column.
fn column_blocks(d: usize) -> (u32, u32) {
    let threads = row_threads(d);
    (threads, d.div_ceil(threads as usize) as u32)
}

/// Buffer `index`, or a null pointer where the optional input is absent.
fn optional(present: bool, index: usize) -> KernelArg {
    if present {
        KernelArg::Buffer(index)
    } else {
        KernelArg::Null
    }
}

/// The kernels' name suffix for tensors of `dtype`; `None` where they have no kernel for it.
pub(crate) fn suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
