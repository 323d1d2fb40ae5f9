//! Scaled dot-product attention as one op: scores, additive mask, causal limit, softmax,
//! dropout and the weighted sum per (batch, head), with memory for one head's scores at a time.
//! Forward keeps only each row's log-sum-exp; backward recomputes that head's probabilities
//! (one extra scores GEMM) instead of storing every head's, and regenerates the seeded dropout
//! mask.
//!
//! Inputs and output are `[batch, seq, heads * head_dim]` (the projections' own layout, rows
//! may be strided such as a slice of a fused QKV projection), so no head transposes are
//! materialised. Grouped-query attention reads each K/V head for its group of query heads in
//! place (never repeated in memory); causal attention works in blocks of query rows that
//! compute only the keys up to their last row, skipping the masked half of the work.
//!
//! This module is the computation; `op.rs` makes it candle ops and the public functions.

#[cfg(feature = "cuda")]
mod gpu;
mod op;

pub use op::{
    AttentionHeads, grouped_query_attention, packed_attention, scaled_dot_product_attention,
    varlen_attention,
};

use std::sync::Mutex;

use candle_core::{CpuStorage, Layout, Result, Tensor};

use super::packed::PackedSequences;
use super::{Float, gemm_acc_into, gemm_into, with_slice};
use crate::rng::{dropout_keep_into, dropout_threshold};

/// Query rows per block of causal attention: each block computes keys up to its last row, so
/// the work is about `seq² / 2 + seq · CAUSAL_BLOCK / 2` scores instead of `seq²`.
const CAUSAL_BLOCK: usize = 64;

/// An additive mask broadcast to [batch, heads, query, key].
struct Mask {
    values: Tensor,
    /// Extents of the mask's four dims (each 1 or the full size).
    dims: [usize; 4],
}

struct Sdpa {
    heads: usize,
    /// K/V heads; each serves `heads / kv_heads` consecutive query heads.
    kv_heads: usize,
    /// Whether query row `i` sees keys `0..=i` only.
    causal: bool,
    scale: f64,
    mask: Option<Mask>,
    dropout: Option<(f64, u64)>,
    /// Sequences laid end to end (`[1, tokens, width]` operands): each attends within
    /// itself; `Dims::seq` is then the padded length the dropout draws and saved rows follow.
    packed: Option<PackedSequences>,
    /// Log-sum-exp of every score row, saved by forward for backward.
    lse: Mutex<Vec<f64>>,
    /// The same on a GPU: `[batch, heads, seq]` f32 on the device (`gpu.rs`).
    #[cfg(feature = "cuda")]
    gpu_lse: Mutex<Option<Tensor>>,
}

/// The extents of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dims {
    batch: usize,
    seq: usize,
    head_dim: usize,
}

/// Query rows `r0..r1` attending to keys `0..keys`.
#[derive(Clone, Copy)]
struct Block {
    r0: usize,
    r1: usize,
    keys: usize,
}

/// The dropout of one head's probabilities: element (i, j) of its `seq`×`seq` matrix is
/// draw `first + i·seq + j`, as the dropout op numbers a tensor's elements.
struct DropoutRows {
    seed: u64,
    threshold: u64,
    first: u64,
    seq: usize,
    /// The survivors' scale, 1/(1-p).
    scale: f64,
}

impl DropoutRows {
    /// Whether probabilities (i, 0..kept.len()) survive.
    fn row(&self, i: usize, kept: &mut [bool]) {
        let first = self.first + (i * self.seq) as u64;
        dropout_keep_into(self.seed, first, self.threshold, kept);
    }
}

impl Block {
    fn rows(&self) -> usize {
        self.r1 - self.r0
    }
}

/// Where backward writes dQ, dK and dV.
enum GradOut<'a, T> {
    /// One `[batch, seq, 3 * width]` buffer, q, k, v side by side in each row (the layout
    /// of a fused projection; equal head counts only).
    Packed(&'a mut [T]),
    /// Three contiguous buffers, `[batch, seq, heads * head_dim]` for dQ and
    /// `[batch, seq, kv_heads * head_dim]` for dK and dV.
    Separate([&'a mut [T]; 3]),
}

impl<T> GradOut<'_, T> {
    /// From row `r` (of all the operand's rows) of head `h` (a K/V head for `which` 1 and
    /// 2) in the gradient of operand `which` (0 q, 1 k, 2 v), and the elements between its
    /// rows.
    fn at(&mut self, which: usize, r: usize, h: usize, op: &Sdpa, dims: Dims) -> (&mut [T], usize) {
        let d = dims.head_dim;
        match self {
            GradOut::Packed(buf) => {
                let width = op.heads * d;
                let row = 3 * width;
                (&mut buf[r * row + which * width + h * d..], row)
            }
            GradOut::Separate(bufs) => {
                let row = if which == 0 { op.heads } else { op.kv_heads } * d;
                (&mut bufs[which][r * row + h * d..], row)
            }
        }
    }
}

/// A `[batch, seq, width]` operand: data from its start and its batch and row strides.
struct View<'a, T> {
    data: &'a [T],
    batch: usize,
    row: usize,
}

impl<'a, T> View<'a, T> {
    /// An operand in contiguous `[batch, seq, row]` data, `offset` elements into each row.
    fn dense(data: &'a [T], seq: usize, row: usize, offset: usize) -> Self {
        View {
            data: &data[offset..],
            batch: seq * row,
            row,
        }
    }

    /// Elements from row `r` of `b`'s head `h` (head width `d`).
    fn head(&self, b: usize, h: usize, r: usize, d: usize) -> &[T] {
        &self.data[b * self.batch + r * self.row + h * d..]
    }
}

/// The operand of `l` in `s`, starting `offset` elements into each row.
fn view<'a, T: Float>(
    s: &'a CpuStorage,
    l: &Layout,
    offset: usize,
    name: &str,
) -> Result<View<'a, T>> {
    let stride = l.stride();
    if l.dims().len() != 3 || stride[2] != 1 {
        return Err(candle_core::Error::Msg(format!(
            "{name}: inputs must be [batch, seq, heads*head_dim] with contiguous rows (got shape {:?}, strides {stride:?})",
            l.dims()
        )));
    }
    let all =
        T::slice(s).ok_or_else(|| candle_core::Error::Msg(format!("{name}: unexpected dtype")))?;
    Ok(View {
        data: &all[l.start_offset() + offset..],
        batch: stride[0],
        row: stride[1],
    })
}

/// Where sequence `b` of an attention call lies.
#[derive(Clone, Copy)]
struct Extent {
    /// Its tokens.
    len: usize,
    /// Added to its row numbers when reading an operand's view (whose batch stride places a
    /// padded batch's sequences; packed ones have none).
    view_row: usize,
    /// Its first row among the output's rows.
    out_row: usize,
}

impl Sdpa {
    /// Where sequence `b` of a call whose (padded) length is `seq` lies.
    fn extent(&self, b: usize, seq: usize) -> Extent {
        match &self.packed {
            None => Extent {
                len: seq,
                view_row: 0,
                out_row: b * seq,
            },
            Some(p) => Extent {
                len: p.len(b),
                view_row: p.start(b),
                out_row: p.start(b),
            },
        }
    }

    /// Rows of every operand and of the output.
    fn rows(&self, dims: Dims) -> usize {
        match &self.packed {
            None => dims.batch * dims.seq,
            Some(p) => p.tokens(),
        }
    }

    /// A view's stride between sequences: none for packed operands, whose sequences are
    /// placed by their rows.
    fn batch_stride(&self, stride: usize) -> usize {
        if self.packed.is_some() { 0 } else { stride }
    }

    /// The K/V head that query head `h` reads.
    fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }

    /// The blocks of query rows one (batch, head) is computed in.
    fn blocks(&self, seq: usize) -> impl Iterator<Item = Block> + use<> {
        let (causal, step) = if self.causal {
            (true, CAUSAL_BLOCK)
        } else {
            (false, seq.max(1))
        };
        (0..seq).step_by(step).map(move |r0| {
            let r1 = (r0 + step).min(seq);
            Block {
                r0,
                r1,
                keys: if causal { r1 } else { seq },
            }
        })
    }

    /// Keys query row `i` sees among a block's.
    fn visible(&self, i: usize, block: Block) -> usize {
        if self.causal { i + 1 } else { block.keys }
    }

    /// Scores of (b, h) for `block` into `s` [rows × keys], in `T::Acc`:
    /// `scale · Q K^T + mask`.
    #[allow(clippy::too_many_arguments)]
    fn scores<T: Float>(
        &self,
        q: &View<T>,
        k: &View<T>,
        mask: Option<&[T::Acc]>,
        (b, h, at): (usize, usize, Extent),
        dims: Dims,
        block: Block,
        s: &mut [T::Acc],
    ) {
        let (d, r) = (dims.head_dim, at.view_row);
        gemm_acc_into(
            (block.rows(), block.keys, d),
            s,
            block.keys,
            false,
            (q.head(b, h, r + block.r0, d), q.row, 1),
            (k.head(b, self.kv_head(h), r, d), 1, k.row),
            self.scale,
        );
        if let (Some(m), Some(spec)) = (mask, &self.mask) {
            let [mb, mh, mq, mk] = spec.dims;
            let base = ((if mb == 1 { 0 } else { b }) * mh + if mh == 1 { 0 } else { h }) * mq;
            for (ri, row) in s.chunks_mut(block.keys).enumerate() {
                let i = block.r0 + ri;
                let mrow = &m[(base + if mq == 1 { 0 } else { i }) * mk..][..mk];
                if mk == 1 {
                    row.iter_mut().for_each(|v| *v += mrow[0]);
                } else {
                    row.iter_mut().zip(mrow).for_each(|(v, &a)| *v += a);
                }
            }
        }
    }

    /// Runs `f` with the mask's values (if any) as a slice of `T`.
    fn with_mask<T: Float>(&self, mut f: impl FnMut(Option<&[T]>)) -> Result<()> {
        match &self.mask {
            Some(m) => with_slice::<T, _>(&m.values, "sdpa mask", |mv| {
                f(Some(mv));
                Ok(())
            }),
            None => {
                f(None);
                Ok(())
            }
        }
    }

    /// Runs `f` on the contiguous output and output gradient.
    fn with_output_grad<T: Float, R>(
        &self,
        res: &Tensor,
        grad: &Tensor,
        f: impl FnOnce(&[T], &[T]) -> Result<R>,
    ) -> Result<R> {
        with_slice::<T, _>(res, "sdpa output", |o| {
            with_slice::<T, _>(grad, "sdpa output gradient", |g| f(o, g))
        })
    }

    /// The dropout of head (b, h)'s probabilities, if any.
    fn dropout_rows(&self, b: usize, h: usize, seq: usize) -> Option<DropoutRows> {
        self.dropout.map(|(prob, seed)| DropoutRows {
            seed,
            threshold: dropout_threshold(prob),
            first: ((b * self.heads + h) * seq * seq) as u64,
            seq,
            scale: 1.0 / (1.0 - prob),
        })
    }

    /// Applies the dropout mask of (b, h) to a block's probabilities `p` (scaled by 1/(1-p)).
    fn drop<T: Float>(&self, b: usize, h: usize, seq: usize, block: Block, p: &mut [T]) {
        if let Some(rows) = self.dropout_rows(b, h, seq) {
            let mut kept = vec![false; block.keys];
            for (ri, row) in p.chunks_mut(block.keys).enumerate() {
                rows.row(block.r0 + ri, &mut kept);
                for (v, &kept) in row.iter_mut().zip(&kept) {
                    *v = if kept {
                        T::of(v.f() * rows.scale)
                    } else {
                        T::of(0.0)
                    };
                }
            }
        }
    }

    /// Turns a block's scores into probabilities: softmax over each row's visible keys
    /// (saving its log-sum-exp, forward) or `exp(s - lse)` with the saved one (backward);
    /// keys a row does not see become 0.
    fn probabilities<T: Float>(&self, s: &mut [T], lse: &mut [f64], block: Block, forward: bool) {
        for (ri, (row, l)) in s.chunks_mut(block.keys).zip(lse.iter_mut()).enumerate() {
            let n = self.visible(block.r0 + ri, block);
            let (seen, unseen) = row.split_at_mut(n);
            if forward {
                T::softmax_rows_in_place(seen, std::slice::from_mut(l), n);
            } else {
                T::exp_rows_minus(seen, std::slice::from_ref(l), n);
            }
            unseen.fill(T::of(0.0));
        }
    }

    fn forward<T: Float>(
        &self,
        q: &View<T>,
        k: &View<T>,
        v: &View<T>,
        dims: Dims,
    ) -> Result<Vec<T>> {
        let Dims {
            batch,
            seq,
            head_dim: d,
        } = dims;
        let width = self.heads * d;
        let mut out = vec![T::of(0.0); self.rows(dims) * width];
        let mut lse = vec![0f64; batch * self.heads * seq];
        let mut s = vec![T::Acc::of(0.0); seq * seq];
        let run = |mask: Option<&[T::Acc]>| {
            for b in 0..batch {
                let ext = self.extent(b, seq);
                for h in 0..self.heads {
                    for block in self.blocks(ext.len) {
                        let s = &mut s[..block.rows() * block.keys];
                        self.scores(q, k, mask, (b, h, ext), dims, block, s);
                        let at = (b * self.heads + h) * seq;
                        self.probabilities(s, &mut lse[at + block.r0..at + block.r1], block, true);
                        self.drop(b, h, seq, block, s);
                        // The probabilities as the product's operand type (rounded once for
                        // half precision; borrowed otherwise).
                        let p = T::from_acc(s);
                        gemm_into(
                            block.rows(),
                            d,
                            block.keys,
                            &mut out[(ext.out_row + block.r0) * width + h * d..],
                            width,
                            false,
                            &p,
                            block.keys,
                            1,
                            v.head(b, self.kv_head(h), ext.view_row, d),
                            v.row,
                            1,
                            1.0,
                        );
                    }
                }
            }
        };
        self.with_mask::<T::Acc>(run)?;
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lse;
        Ok(out)
    }

    /// Writes dQ, dK and dV into `out` (which starts zeroed: dK and dV accumulate over the
    /// query heads of a group and the blocks of a head), in `T::Acc`.
    #[allow(clippy::too_many_arguments)]
    fn backward<T: Float>(
        &self,
        q: &View<T>,
        k: &View<T>,
        v: &View<T>,
        o: &[T],
        g: &[T],
        dims: Dims,
        out: &mut GradOut<'_, T::Acc>,
    ) -> Result<()> {
        let Dims {
            batch,
            seq,
            head_dim: d,
        } = dims;
        let width = self.heads * d;
        let mut lse = self.lse.lock().unwrap_or_else(|e| e.into_inner());
        if lse.len() != batch * self.heads * seq {
            return Err(candle_core::Error::Msg(
                "sdpa: backward without a matching forward".into(),
            ));
        }
        let mut p = vec![T::Acc::of(0.0); seq * seq];
        let mut dp = vec![T::Acc::of(0.0); seq * seq];
        let mut rowdot = vec![T::Acc::of(0.0); seq];
        // The output and its gradient for the row dots, in `T::Acc` (borrowed for f32, f64).
        let (o_acc, g_acc) = (T::to_acc(o), T::to_acc(g));
        let run = |mask: Option<&[T::Acc]>| {
            for b in 0..batch {
                let ext = self.extent(b, seq);
                let r = ext.view_row;
                for h in 0..self.heads {
                    let kvh = self.kv_head(h);
                    for block in self.blocks(ext.len) {
                        let n = block.keys;
                        let (p, dp) = (&mut p[..block.rows() * n], &mut dp[..block.rows() * n]);
                        let at = (ext.out_row + block.r0) * width + h * d;
                        self.scores(q, k, mask, (b, h, ext), dims, block, p);
                        let l = (b * self.heads + h) * seq;
                        self.probabilities(p, &mut lse[l + block.r0..l + block.r1], block, false);
                        // dV += P'^T dO, with P' the dropped-out probabilities.
                        let dropped = if self.dropout.is_some() {
                            dp.copy_from_slice(p);
                            self.drop(b, h, seq, block, dp);
                            T::from_acc(dp)
                        } else {
                            T::from_acc(p)
                        };
                        let (dv, dv_row) = out.at(2, ext.out_row, kvh, self, dims);
                        gemm_acc_into(
                            (n, d, block.rows()),
                            dv,
                            dv_row,
                            true,
                            (&dropped, 1, n),
                            (&g[at..], width, 1),
                            1.0,
                        );
                        drop(dropped);
                        // dP' = dO V^T
                        gemm_acc_into(
                            (block.rows(), n, d),
                            dp,
                            n,
                            false,
                            (&g[at..], width, 1),
                            (v.head(b, kvh, r, d), 1, v.row),
                            1.0,
                        );
                        // D_i = sum_j P'_ij dP'_ij = dO_i . O_i
                        for (ri, r) in rowdot[..block.rows()].iter_mut().enumerate() {
                            let row = at + ri * width;
                            *r = dot(&g_acc[row..row + d], &o_acc[row..row + d]);
                        }
                        // dS = P (dP - D), dP = dP' * dropout mask / (1-p)
                        let mask = self.dropout_rows(b, h, seq);
                        let mut kept = vec![false; if mask.is_some() { n } else { 0 }];
                        for (ri, (prow, dprow)) in p.chunks(n).zip(dp.chunks_mut(n)).enumerate() {
                            let (i, r) = (block.r0 + ri, rowdot[ri]);
                            let seen = self.visible(i, block);
                            if let Some(rows) = &mask {
                                let s = T::Acc::of(rows.scale);
                                rows.row(i, &mut kept[..seen]);
                                for ((&pv, dv), &kept) in
                                    prow[..seen].iter().zip(dprow.iter_mut()).zip(&kept)
                                {
                                    let dpv = if kept { *dv * s } else { T::Acc::of(0.0) };
                                    *dv = pv * (dpv - r);
                                }
                            } else {
                                prow[..seen]
                                    .iter()
                                    .zip(dprow.iter_mut())
                                    .for_each(|(&pv, dv)| *dv = pv * (*dv - r));
                            }
                            dprow[seen..].fill(T::Acc::of(0.0));
                        }
                        // dQ = scale dS K; dK += scale dS^T Q
                        let ds = T::from_acc(dp);
                        let (dq, dq_row) = out.at(0, ext.out_row + block.r0, h, self, dims);
                        gemm_acc_into(
                            (block.rows(), d, n),
                            dq,
                            dq_row,
                            false,
                            (&ds, n, 1),
                            (k.head(b, kvh, r, d), k.row, 1),
                            self.scale,
                        );
                        let (dk, dk_row) = out.at(1, ext.out_row, kvh, self, dims);
                        gemm_acc_into(
                            (n, d, block.rows()),
                            dk,
                            dk_row,
                            true,
                            (&ds, 1, n),
                            (q.head(b, h, r + block.r0, d), q.row, 1),
                            self.scale,
                        );
                    }
                }
            }
        };
        self.with_mask::<T::Acc>(run)?;
        Ok(())
    }
}

/// `a · b` with independent partial sums (vectorisable).
fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    const LANES: usize = 8;
    let mut acc = [T::of(0.0); LANES];
    for (ac, bc) in a.chunks(LANES).zip(b.chunks(LANES)) {
        for ((s, &x), &y) in acc.iter_mut().zip(ac).zip(bc) {
            *s += x * y;
        }
    }
    acc.iter().fold(T::of(0.0), |s, &x| s + x)
}

fn dims3(l: &Layout) -> Result<(usize, usize, usize)> {
    l.shape().dims3()
}
