//! Scaled dot-product attention as one op: scores, additive mask, softmax, dropout and the
//! weighted sum per (batch, head), with memory for one head's scores at a time. Forward keeps
//! only each row's log-sum-exp; backward recomputes that head's probabilities (one extra
//! scores GEMM) instead of storing every head's, and regenerates the seeded dropout mask.
//!
//! Inputs and output are `[batch, seq, heads * head_dim]` (the projections' own layout, rows
//! may be strided such as a slice of a fused QKV projection), so no head transposes are
//! materialised.
//!
//! This module is the computation; `op.rs` makes it candle ops and the public functions.

mod op;

pub use op::{packed_attention, scaled_dot_product_attention};

use std::sync::Mutex;

use candle_core::{CpuStorage, Layout, Result, Tensor};

use super::dropout::keep;
use super::{Float, gemm_into, with_slice};

/// An additive mask broadcast to [batch, heads, query, key].
struct Mask {
    values: Tensor,
    /// Extents of the mask's four dims (each 1 or the full size).
    dims: [usize; 4],
}

struct Sdpa {
    heads: usize,
    scale: f64,
    mask: Option<Mask>,
    dropout: Option<(f64, u64)>,
    /// Log-sum-exp of every score row, saved by forward for backward.
    lse: Mutex<Vec<f64>>,
}

/// Where backward writes dQ, dK and dV (`[batch, seq, width]` each).
enum GradOut<'a, T> {
    /// One `[batch, seq, 3 * width]` buffer, q, k, v side by side in each row (the layout
    /// of a fused projection).
    Packed(&'a mut [T]),
    /// Three contiguous buffers.
    Separate([&'a mut [T]; 3]),
}

impl<T> GradOut<'_, T> {
    /// From row 0 of `b`'s head `h` in the gradient of operand `which` (0 q, 1 k, 2 v).
    fn head(
        &mut self,
        which: usize,
        b: usize,
        h: usize,
        (seq, width, d): (usize, usize, usize),
    ) -> &mut [T] {
        match self {
            GradOut::Packed(buf) => &mut buf[b * seq * 3 * width + which * width + h * d..],
            GradOut::Separate(bufs) => &mut bufs[which][b * seq * width + h * d..],
        }
    }

    /// Elements between consecutive rows.
    fn row_stride(&self, width: usize) -> usize {
        match self {
            GradOut::Packed(_) => 3 * width,
            GradOut::Separate(_) => width,
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

    /// Elements from row 0 of `b`'s head `h` (head width `d`).
    fn head(&self, b: usize, h: usize, d: usize) -> &[T] {
        &self.data[b * self.batch + h * d..]
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

impl Sdpa {
    /// Scores of (b, h) into `s` [seq × seq]: `scale · Q K^T + mask`.
    #[allow(clippy::too_many_arguments)]
    fn scores<T: Float>(
        &self,
        q: &View<T>,
        k: &View<T>,
        mask: Option<&[T]>,
        b: usize,
        h: usize,
        (seq, d): (usize, usize),
        s: &mut [T],
    ) {
        gemm_into(
            seq,
            seq,
            d,
            s,
            seq,
            false,
            q.head(b, h, d),
            q.row,
            1,
            k.head(b, h, d),
            1,
            k.row,
            self.scale,
        );
        if let (Some(m), Some(spec)) = (mask, &self.mask) {
            let [mb, mh, mq, mk] = spec.dims;
            let base = ((if mb == 1 { 0 } else { b }) * mh + if mh == 1 { 0 } else { h }) * mq;
            for (i, row) in s.chunks_mut(seq).enumerate() {
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

    /// Applies the dropout mask of (b, h) to probabilities `p` (scaled by 1/(1-p)).
    fn drop<T: Float>(&self, b: usize, h: usize, seq: usize, p: &mut [T]) {
        if let Some((prob, seed)) = self.dropout {
            let scale = 1.0 / (1.0 - prob);
            let base = ((b * self.heads + h) * seq * seq) as u64;
            for (i, v) in p.iter_mut().enumerate() {
                *v = if keep(seed, base + i as u64, prob) {
                    T::of(v.f() * scale)
                } else {
                    T::of(0.0)
                };
            }
        }
    }

    fn forward<T: Float>(
        &self,
        q: &View<T>,
        k: &View<T>,
        v: &View<T>,
        (batch, seq, width): (usize, usize, usize),
    ) -> Result<Vec<T>> {
        let d = width / self.heads;
        let mut out = vec![T::of(0.0); batch * seq * width];
        let mut lse = vec![0f64; batch * self.heads * seq];
        let mut s = vec![T::of(0.0); seq * seq];
        let run = |mask: Option<&[T]>| {
            for b in 0..batch {
                for h in 0..self.heads {
                    self.scores(q, k, mask, b, h, (seq, d), &mut s);
                    let at = (b * self.heads + h) * seq;
                    T::softmax_rows_in_place(&mut s, &mut lse[at..at + seq], seq);
                    self.drop(b, h, seq, &mut s);
                    gemm_into(
                        seq,
                        d,
                        seq,
                        &mut out[b * seq * width + h * d..],
                        width,
                        false,
                        &s,
                        seq,
                        1,
                        v.head(b, h, d),
                        v.row,
                        1,
                        1.0,
                    );
                }
            }
        };
        self.with_mask(run)?;
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lse;
        Ok(out)
    }

    /// Writes dQ, dK and dV into `out`.
    #[allow(clippy::too_many_arguments)]
    fn backward<T: Float>(
        &self,
        q: &View<T>,
        k: &View<T>,
        v: &View<T>,
        o: &[T],
        g: &[T],
        (batch, seq, width): (usize, usize, usize),
        out: &mut GradOut<'_, T>,
    ) -> Result<()> {
        let d = width / self.heads;
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner());
        if lse.len() != batch * self.heads * seq {
            return Err(candle_core::Error::Msg(
                "sdpa: backward without a matching forward".into(),
            ));
        }
        let out_row = out.row_stride(width);
        let mut p = vec![T::of(0.0); seq * seq];
        let mut dp = vec![T::of(0.0); seq * seq];
        let mut rowdot = vec![T::of(0.0); seq];
        let run = |mask: Option<&[T]>| {
            for b in 0..batch {
                for h in 0..self.heads {
                    let at = b * seq * width + h * d;
                    self.scores(q, k, mask, b, h, (seq, d), &mut p);
                    let l = (b * self.heads + h) * seq;
                    T::exp_rows_minus(&mut p, &lse[l..l + seq], seq);
                    // dV = P'^T dO, with P' the dropped-out probabilities.
                    let dropped: &[T] = if self.dropout.is_some() {
                        dp.copy_from_slice(&p);
                        self.drop(b, h, seq, &mut dp);
                        &dp
                    } else {
                        &p
                    };
                    gemm_into(
                        seq,
                        d,
                        seq,
                        out.head(2, b, h, (seq, width, d)),
                        out_row,
                        false,
                        dropped,
                        1,
                        seq,
                        &g[at..],
                        width,
                        1,
                        1.0,
                    );
                    // dP' = dO V^T
                    gemm_into(
                        seq,
                        seq,
                        d,
                        &mut dp,
                        seq,
                        false,
                        &g[at..],
                        width,
                        1,
                        v.head(b, h, d),
                        1,
                        v.row,
                        1.0,
                    );
                    // D_i = sum_j P'_ij dP'_ij = dO_i . O_i
                    for (i, r) in rowdot.iter_mut().enumerate() {
                        let row = at + i * width;
                        *r = dot(&g[row..row + d], &o[row..row + d]);
                    }
                    // dS = P (dP - D), dP = dP' * dropout mask / (1-p)
                    let base = ((b * self.heads + h) * seq * seq) as u64;
                    for (i, (prow, dprow)) in p.chunks(seq).zip(dp.chunks_mut(seq)).enumerate() {
                        let r = rowdot[i];
                        if let Some((prob, seed)) = self.dropout {
                            let s = T::of(1.0 / (1.0 - prob));
                            for (j, (&pv, dv)) in prow.iter().zip(dprow.iter_mut()).enumerate() {
                                let kept = keep(seed, base + (i * seq + j) as u64, prob);
                                let dpv = if kept { *dv * s } else { T::of(0.0) };
                                *dv = pv * (dpv - r);
                            }
                        } else {
                            prow.iter()
                                .zip(dprow.iter_mut())
                                .for_each(|(&pv, dv)| *dv = pv * (*dv - r));
                        }
                    }
                    // dQ = scale dS K; dK = scale dS^T Q
                    gemm_into(
                        seq,
                        d,
                        seq,
                        out.head(0, b, h, (seq, width, d)),
                        out_row,
                        false,
                        &dp,
                        seq,
                        1,
                        k.head(b, h, d),
                        k.row,
                        1,
                        self.scale,
                    );
                    gemm_into(
                        seq,
                        d,
                        seq,
                        out.head(1, b, h, (seq, width, d)),
                        out_row,
                        false,
                        &dp,
                        1,
                        seq,
                        q.head(b, h, d),
                        q.row,
                        1,
                        self.scale,
                    );
                }
            }
        };
        self.with_mask(run)?;
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
