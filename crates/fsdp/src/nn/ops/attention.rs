//! Scaled dot-product attention as one op: scores, additive mask, softmax, dropout and the
//! weighted sum per (batch, head), with memory for one head's scores at a time. Forward keeps
//! only each row's log-sum-exp; backward recomputes that head's probabilities (one extra
//! scores GEMM) instead of storing every head's, and regenerates the seeded dropout mask.
//!
//! Inputs and output are `[batch, seq, heads * head_dim]` (the projections' own layout, rows
//! may be strided such as a slice of a fused QKV projection), so no head transposes are
//! materialised.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::dropout::keep;
use super::{Float, float_dispatch, gemm_into, tensor, with_slice};

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

/// Attention on three operands q, k, v.
impl CustomOp3 for Sdpa {
    fn name(&self) -> &'static str {
        "fused-sdpa"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = dims3(l1)?;
        if dims3(l2)? != shape || dims3(l3)? != shape {
            return Err(candle_core::Error::Msg(format!(
                "sdpa: q {:?}, k {:?} and v {:?} differ",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )));
        }
        float_dispatch!(s1.dtype(), self.name(), T => {
            let out = self.forward::<T>(
                &view(s1, l1, 0, self.name())?,
                &view(s2, l2, 0, self.name())?,
                &view(s3, l3, 0, self.name())?,
                shape,
            )?;
            Ok((T::storage(out), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        q_t: &Tensor,
        k_t: &Tensor,
        v_t: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let shape = q_t.dims3()?;
        let (b, s, w) = shape;
        float_dispatch!(q_t.dtype(), self.name(), T => {
            let n = b * s * w;
            let (mut dq, mut dk, mut dv) =
                (vec![T::of(0.0); n], vec![T::of(0.0); n], vec![T::of(0.0); n]);
            with_slice::<T, _>(q_t, self.name(), |q| {
                with_slice::<T, _>(k_t, self.name(), |k| {
                    with_slice::<T, _>(v_t, self.name(), |v| {
                        self.with_output_grad::<T, _>(res, grad, |o, g| {
                            self.backward::<T>(
                                &View::dense(q, s, w, 0),
                                &View::dense(k, s, w, 0),
                                &View::dense(v, s, w, 0),
                                o,
                                g,
                                shape,
                                &mut GradOut::Separate([&mut dq, &mut dk, &mut dv]),
                            )
                        })
                    })
                })
            })?;
            Ok((
                Some(tensor(dq, q_t.shape(), q_t)?),
                Some(tensor(dk, k_t.shape(), k_t)?),
                Some(tensor(dv, v_t.shape(), v_t)?),
            ))
        })
    }
}

/// Attention on one packed `[batch, seq, 3 * width]` projection (q, k, v side by side): its
/// gradient is one tensor written in place, where slicing the projection would cost candle a
/// zero-padded copy per slice in backward.
struct PackedSdpa(Sdpa);

impl PackedSdpa {
    /// (batch, seq, width of one projection) of a packed `[batch, seq, 3 * width]` layout.
    fn width(l: &Layout) -> Result<(usize, usize, usize)> {
        let (b, s, w3) = dims3(l)?;
        if w3 % 3 != 0 {
            return Err(candle_core::Error::Msg(format!(
                "sdpa: packed qkv {:?} is not three projections wide",
                l.dims()
            )));
        }
        Ok((b, s, w3 / 3))
    }
}

impl CustomOp1 for PackedSdpa {
    fn name(&self) -> &'static str {
        "fused-sdpa-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = Self::width(l)?;
        let w = shape.2;
        float_dispatch!(s.dtype(), self.name(), T => {
            let part = |i| view::<T>(s, l, i * w, self.name());
            let out = self.0.forward::<T>(&part(0)?, &part(1)?, &part(2)?, shape)?;
            Ok((T::storage(out), Shape::from(shape)))
        })
    }

    fn bwd(&self, qkv_t: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let shape = Self::width(qkv_t.layout())?;
        let (b, s, w) = shape;
        float_dispatch!(qkv_t.dtype(), self.name(), T => {
            let dqkv = with_slice::<T, _>(qkv_t, self.name(), |qkv| {
                self.0.with_output_grad::<T, _>(res, grad, |o, g| {
                    let part = |i: usize| View::dense(qkv, s, 3 * w, i * w);
                    let mut dqkv = vec![T::of(0.0); 3 * b * s * w];
                    let mut out = GradOut::Packed(&mut dqkv);
                    self.0.backward::<T>(&part(0), &part(1), &part(2), o, g, shape, &mut out)?;
                    Ok(dqkv)
                })
            })?;
            Ok(Some(tensor(dqkv, qkv_t.shape(), qkv_t)?))
        })
    }
}

/// Checks the attention settings and builds the op (mask broadcast to
/// `[batch, heads, seq, seq]`).
fn sdpa_op(
    (batch, seq, width): (usize, usize, usize),
    dtype: candle_core::DType,
    heads: usize,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Sdpa> {
    if heads == 0 || width % heads != 0 {
        return Err(candle_core::Error::Msg(format!(
            "sdpa: width {width} is not a multiple of {heads} heads"
        )));
    }
    if let Some((p, _)) = dropout {
        if !(0.0..1.0).contains(&p) {
            return Err(candle_core::Error::Msg(format!(
                "attention dropout probability {p} is not in [0, 1)"
            )));
        }
    }
    let mask = match mask {
        None => None,
        Some(m) => {
            let md = m.dims();
            if md.len() > 4 {
                return Err(candle_core::Error::Msg(format!(
                    "sdpa: mask has {} dims (at most 4)",
                    md.len()
                )));
            }
            let mut dims = [1usize; 4];
            dims[4 - md.len()..].copy_from_slice(md);
            let full = [batch, heads, seq, seq];
            if dims.iter().zip(full).any(|(&d, f)| d != 1 && d != f) {
                return Err(candle_core::Error::Msg(format!(
                    "sdpa: mask {md:?} does not broadcast to {full:?}"
                )));
            }
            Some(Mask {
                values: m.detach().to_dtype(dtype)?.contiguous()?,
                dims,
            })
        }
    };
    Ok(Sdpa {
        heads,
        scale: 1.0 / ((width / heads) as f64).sqrt(),
        mask,
        dropout: dropout.filter(|(p, _)| *p > 0.0),
        lse: Mutex::new(Vec::new()),
    })
}

/// `softmax(Q K^T / sqrt(head_dim) + mask) V` per head, with optional dropout
/// `(probability, seed)` on the probabilities. `q`, `k`, `v`: `[batch, seq, heads * head_dim]`
/// (rows may be strided); `mask`: additive, broadcastable to `[batch, heads, seq, seq]`
/// (e.g. `[batch, 1, 1, seq]` padding or `[1, 1, seq, seq]` causal). Returns
/// `[batch, seq, heads * head_dim]`.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    if matches!(q.dtype(), DType::BF16 | DType::F16) {
        // Probabilities kept in half precision lose too much in softmax's backward (a
        // difference of nearly equal products): half-precision inputs are attended in f32, as
        // PyTorch's kernels accumulate and keep them, and the output is cast back.
        let wide = |t: &Tensor| t.to_dtype(DType::F32);
        let mask = mask.map(wide).transpose()?;
        let out = scaled_dot_product_attention(
            &wide(q)?,
            &wide(k)?,
            &wide(v)?,
            heads,
            mask.as_ref(),
            dropout,
        )?;
        return out.to_dtype(q.dtype());
    }
    let op = sdpa_op(q.dims3()?, q.dtype(), heads, mask, dropout)?;
    q.apply_op3(k, v, op)
}

/// [`scaled_dot_product_attention`] on a fused projection `qkv` `[batch, seq, 3 * width]`
/// holding q, k and v side by side (BERT's query/key/value or GPT-2's `c_attn` computed by
/// one GEMM). Returns `[batch, seq, width]`.
pub fn packed_attention(
    qkv: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    if matches!(qkv.dtype(), DType::BF16 | DType::F16) {
        // In f32, as in [`scaled_dot_product_attention`].
        let mask = mask.map(|m| m.to_dtype(DType::F32)).transpose()?;
        let out = packed_attention(&qkv.to_dtype(DType::F32)?, heads, mask.as_ref(), dropout)?;
        return out.to_dtype(qkv.dtype());
    }
    let shape = PackedSdpa::width(qkv.layout())?;
    let op = sdpa_op(shape, qkv.dtype(), heads, mask, dropout)?;
    qkv.apply_op1(PackedSdpa(op))
}
