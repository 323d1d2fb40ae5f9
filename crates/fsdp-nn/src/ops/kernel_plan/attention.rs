//! Attention's plans (`kernels/attention.cu`), dropout on the probabilities included.

use candle_core::{DType, Result};

use super::{KernelArg, Launch, Module, checked_name, optional};
use crate::rng::dropout_threshold;

/// The buffers of attention's plans, by index.
pub(crate) mod buffers {
    /// Queries, `[batch, seq, heads * head_dim]` at [`super::AttentionShape::q`]'s strides.
    pub const Q: usize = 0;
    /// Keys, `[batch, seq, kv_heads * head_dim]` at `k`'s strides.
    pub const K: usize = 1;
    /// Values, as keys at `v`'s strides.
    pub const V: usize = 2;
    /// The additive f32 mask, contiguous over its `[batch|1, heads|1, seq|1, seq|1]` dims.
    pub const MASK: usize = 3;
    /// The output, contiguous `[batch, seq, heads * head_dim]`.
    pub const OUT: usize = 4;
    /// f32: each score row's log-sum-exp, `[batch, heads, seq]` (forward writes it).
    pub const LSE: usize = 5;
    /// The output's gradient, contiguous as `OUT`.
    pub const DOUT: usize = 6;
    /// f32 scratch: each row's `dO . O`, `[batch, heads, seq]`.
    pub const DELTA: usize = 7;
    /// The queries' gradient, at the strides `backward` is given.
    pub const DQ: usize = 8;
    /// The keys' gradient, at the strides `backward` is given for K/V.
    pub const DK: usize = 9;
    /// The values' gradient, as `DK`.
    pub const DV: usize = 10;
    /// u32: packed sequences' first rows, then the number of rows (`batch + 1` entries).
    pub const STARTS: usize = 11;
}

/// Warps (query or key rows) per block of the row kernels.
const WARPS: u32 = 4;
/// Rows per block of the tiled kernels (heads of 64): forward and the query pass; the key
/// pass's blocks are half as many rows.
const TILE_ROWS: u32 = 64;
/// Head dimensions one lane holds at most (`MAX_PER_LANE` in the kernel).
const MAX_HEAD_DIM: usize = 256;

/// An operand's element strides: of a batch, and of a row (`[batch, seq, width]`, rows
/// contiguous).
pub(crate) type Strides = (usize, usize);

/// One attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DType,
    pub causal: bool,
    pub scale: f64,
    pub q: Strides,
    pub k: Strides,
    pub v: Strides,
    /// The mask's dims broadcast to `[batch, heads, seq, seq]` (each 1 or full), if any.
    pub mask: Option<[usize; 4]>,
    /// Dropout on the probabilities, `(probability, seed)`, if any.
    pub dropout: Option<(f64, u64)>,
    /// The tiled kernels (heads of 64: a thread per row, tiles in shared memory) rather than
    /// the row kernels (a warp per row, any head size up to 256).
    pub tiled: bool,
    /// Packed sequences (`varlen_attention`): `batch` sequences laid end to end, whose rows
    /// `STARTS` gives, each attending within itself; `seq` is the padded length the saved
    /// log-sum-exps and the dropout draws follow, and the operands' batch strides are 0.
    pub packed: bool,
}

impl AttentionShape {
    /// Whether the kernels take heads of `head_dim` elements.
    pub fn fits(head_dim: usize) -> bool {
        (1..=MAX_HEAD_DIM).contains(&head_dim)
    }

    /// Whether heads of `head_dim` run on the tiled kernels: heads of 64 do, unless
    /// `FSDP_CUDA_ATTENTION=rows` asks for the row kernels (to time one against the other).
    pub fn tiles(head_dim: usize) -> bool {
        head_dim == 64 && std::env::var("FSDP_CUDA_ATTENTION").as_deref() != Ok("rows")
    }

    fn kernel(&self, name: &str) -> Result<String> {
        if self.tiled && self.head_dim != 64 {
            candle_core::bail!(
                "attention_{name}: the tiled kernels take heads of 64, not {}",
                self.head_dim
            );
        }
        if !Self::fits(self.head_dim) {
            candle_core::bail!(
                "attention_{name}: head_dim {} is not in 1..={MAX_HEAD_DIM}",
                self.head_dim
            );
        }
        if self.packed && [self.q.0, self.k.0, self.v.0] != [0; 3] {
            candle_core::bail!(
                "attention_{name}: packed sequences' operands have no batch stride (got {:?})",
                [self.q.0, self.k.0, self.v.0]
            );
        }
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            candle_core::bail!(
                "attention_{name}: {} query heads do not share {} K/V heads evenly",
                self.heads,
                self.kv_heads
            );
        }
        let out = self.batch * self.seq * self.heads * self.head_dim;
        let grid = [self.batch, self.heads, self.seq.div_ceil(WARPS as usize)];
        if grid[0] > 65535 || grid[1] > 65535 {
            candle_core::bail!(
                "attention_{name}: {} sequences of {} heads exceed the kernels' grid",
                self.batch,
                self.heads
            );
        }
        let variant = if self.tiled { "64" } else { "" };
        checked_name(
            &format!("attention_{name}{variant}"),
            self.dtype,
            &[out, grid[2]],
        )
    }

    /// The mask's element strides per (batch, head, query, key), 0 where it broadcasts.
    fn mask_strides(&self) -> [i64; 4] {
        let Some(dims) = self.mask else {
            return [0; 4];
        };
        let mut strides = [0i64; 4];
        let mut next = 1i64;
        for axis in (0..4).rev() {
            if dims[axis] != 1 {
                strides[axis] = next;
                next *= dims[axis] as i64;
            }
        }
        strides
    }

    /// A launch over the rows of `rows_of` heads; `key_pass` is backward's pass over keys.
    fn launch(
        &self,
        kernel: String,
        rows_of: usize,
        key_pass: bool,
        args: Vec<KernelArg>,
    ) -> Launch {
        let rows_per_block = match (self.tiled, key_pass) {
            (false, _) => WARPS,
            (true, false) => TILE_ROWS,
            (true, true) => TILE_ROWS / 2,
        };
        let threads = if self.tiled {
            rows_per_block
        } else {
            WARPS * 32
        };
        let blocks = self.seq.div_ceil(rows_per_block as usize) as u32;
        Launch {
            module: Module::Attention,
            kernel,
            grid: [blocks, rows_of as u32, self.batch as u32],
            block: [threads, 1, 1],
            args,
        }
    }

    /// The arguments every kernel ends with: sizes, causality, scale and strides.
    fn tail(&self) -> Vec<KernelArg> {
        let int = |v: usize| KernelArg::Int(v as i32);
        let long = |v: usize| KernelArg::Long(v as i64);
        let mut args = vec![
            int(self.seq),
            int(self.heads),
            int(self.kv_heads),
            int(self.head_dim),
            KernelArg::Int(i32::from(self.causal)),
            KernelArg::Float(self.scale as f32),
        ];
        for (batch, row) in [self.q, self.k, self.v] {
            args.extend([long(batch), long(row)]);
        }
        args.extend(self.mask_strides().map(KernelArg::Long));
        let (seed, threshold, scale) = match self.dropout {
            Some((p, seed)) if p > 0.0 => (seed, dropout_threshold(p), 1.0 / (1.0 - p)),
            _ => (0, 0, 1.0),
        };
        args.extend([
            KernelArg::U64(seed),
            KernelArg::U64(threshold),
            KernelArg::Float(scale as f32),
            optional(self.packed, buffers::STARTS),
        ]);
        args
    }

    fn inputs(&self) -> Vec<KernelArg> {
        use buffers::*;
        vec![
            KernelArg::Buffer(Q),
            KernelArg::Buffer(K),
            KernelArg::Buffer(V),
            optional(self.mask.is_some(), MASK),
        ]
    }

    /// Forward: `OUT` and `LSE` (`batch * heads * seq` f32); none for an empty call.
    pub fn forward(&self) -> Result<Vec<Launch>> {
        use buffers::*;
        let kernel = self.kernel("forward")?;
        if self.batch * self.seq == 0 {
            return Ok(Vec::new());
        }
        let mut args = self.inputs();
        args.extend([KernelArg::Buffer(OUT), KernelArg::Buffer(LSE)]);
        args.extend(self.tail());
        Ok(vec![self.launch(kernel, self.heads, false, args)])
    }

    /// Backward from `OUT`, `DOUT` and forward's `LSE`: `DQ` at strides `dq`, `DK` and `DV` at
    /// `dkv` (`DELTA` holds `batch * heads * seq` f32); none for an empty call.
    pub fn backward(&self, dq: Strides, dkv: Strides) -> Result<Vec<Launch>> {
        use buffers::*;
        let names = [
            self.kernel("backward_queries")?,
            self.kernel("backward_keys")?,
        ];
        if self.packed && (dq.0, dkv.0) != (0, 0) {
            candle_core::bail!(
                "attention_backward: packed sequences' gradients have no batch stride (got {} and {})",
                dq.0,
                dkv.0
            );
        }
        if self.batch * self.seq == 0 {
            return Ok(Vec::new());
        }
        let [queries, keys] = names;
        let long = |v: usize| KernelArg::Long(v as i64);
        let mut first = self.inputs();
        first.extend([OUT, DOUT, LSE, DELTA, DQ].map(KernelArg::Buffer));
        first.extend([long(dq.0), long(dq.1)]);
        first.extend(self.tail());
        let mut second = self.inputs();
        second.extend([DOUT, LSE, DELTA, DK, DV].map(KernelArg::Buffer));
        second.extend([long(dkv.0), long(dkv.1)]);
        second.extend(self.tail());
        Ok(vec![
            self.launch(queries, self.heads, false, first),
            self.launch(keys, self.kv_heads, true, second),
        ])
    }
}
