//! Linear (`x W^T + b`, or `x W + b` for GPT-2's Conv1D weights) as one op: the bias is folded
//! into the GEMM's output, and the backward computes dx and dW with two direct GEMM calls
//! and db as column sums, instead of candle's transposes, broadcasts and zero-initialised
//! accumulations.

use candle_core::backend::BackendStorage;
use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::GeluApprox;

use super::{
    Float, composed, contiguous, float_dispatch, gemm_into, gemm_new, has_cuda_kernels,
    has_kernels, tensor, with_slice,
};

/// How a weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WeightLayout {
    /// `[out, in]` (`nn.Linear`): the op computes `x W^T`.
    OutIn,
    /// `[in, out]` (GPT-2's `Conv1D`): the op computes `x W`.
    InOut,
}

/// `x W^T + b` (or `x W + b`), optionally followed by GELU in the same op: then the
/// pre-activation is kept inside the op for backward instead of being a graph node of its own
/// (one fewer activation-sized gradient to accumulate).
struct Linear {
    layout: WeightLayout,
    gelu: Option<GeluApprox>,
    pre: Mutex<Option<CpuStorage>>,
    /// Which gradients backward forms: (input, weight). A frozen weight (LoRA's base, a
    /// plain tensor outside the graph) gets none, which saves backward's dW product; an
    /// input outside the graph none either.
    wanted: (bool, bool),
}

impl Linear {
    /// (rows, cols) of the weight for `k` inputs and `n` outputs.
    fn weight_dims(&self, k: usize, n: usize) -> (usize, usize) {
        match self.layout {
            WeightLayout::OutIn => (n, k),
            WeightLayout::InOut => (k, n),
        }
    }

    /// (row, column) strides of the weight seen as the `[k, n]` right operand of `x · M`.
    fn operand_strides(&self, k: usize, n: usize) -> (usize, usize) {
        match self.layout {
            WeightLayout::OutIn => (1, k),
            WeightLayout::InOut => (n, 1),
        }
    }

    /// Checks the operands; returns (m, k, n).
    fn dims(&self, l1: &Layout, l2: &Layout, l3: &Layout) -> Result<(usize, usize, usize)> {
        let (m, k) = l1.shape().dims2()?;
        let (r, c) = l2.shape().dims2()?;
        let n = if self.layout == WeightLayout::OutIn {
            r
        } else {
            c
        };
        if self.weight_dims(k, n) != (r, c) || l3.shape().elem_count() != n {
            return Err(candle_core::Error::Msg(format!(
                "linear: input {:?}, weight {:?} ({:?}) and bias {:?} do not fit",
                l1.shape().dims(),
                l2.shape().dims(),
                self.layout,
                l3.shape().dims()
            )));
        }
        Ok((m, k, n))
    }

    /// `x · M` for contiguous `x` [m, k] and the weight `w` as `M` [k, n].
    fn product<T: Float>(&self, x: &[T], w: &[T], (m, k, n): (usize, usize, usize)) -> Vec<T> {
        let (rs, cs) = self.operand_strides(k, n);
        gemm_new(m, n, k, x, k, 1, w, rs, cs, 1.0)
    }

    /// Gradients for output gradient `g` [m, n] and bias gradient `db`: dx = g M^T and the
    /// weight's gradient in its own layout, with two direct GEMMs.
    fn grads<T: Float>(
        &self,
        (x_t, w_t, b_t): (&Tensor, &Tensor, &Tensor),
        g: &[T],
        db: Vec<f64>,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = self.input_and_weight_grads((x_t, w_t), b_t.elem_count(), g)?;
        let db: Vec<T> = db.into_iter().map(T::of).collect();
        Ok((dx, dw, Some(tensor(db, b_t.shape(), b_t)?)))
    }

    /// dx = g M^T and the weight's gradient in its own layout (`n` outputs), with two direct
    /// GEMMs, each only when [`Linear::wanted`].
    fn input_and_weight_grads<T: Float>(
        &self,
        (x_t, w_t): (&Tensor, &Tensor),
        n: usize,
        g: &[T],
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (m, k) = x_t.dims2()?;
        let (rs, cs) = self.operand_strides(k, n);
        let name = self.name();
        let (want_dx, want_dw) = self.wanted;
        with_slice::<T, _>(x_t, name, |x| {
            with_slice::<T, _>(w_t, name, |w| {
                // dx[m×k] = g[m×n] · M^T[n×k]
                let dx = want_dx.then(|| gemm_new(m, k, n, g, n, 1, w, cs, rs, 1.0));
                let dw = want_dw.then(|| match self.layout {
                    // dW[n×k] = g^T[n×m] · x[m×k]
                    WeightLayout::OutIn => gemm_new(n, k, m, g, 1, n, x, k, 1, 1.0),
                    // dW[k×n] = x^T[k×m] · g[m×n]
                    WeightLayout::InOut => gemm_new(k, n, m, x, 1, k, g, n, 1, 1.0),
                });
                Ok((
                    dx.map(|dx| tensor(dx, x_t.shape(), x_t)).transpose()?,
                    dw.map(|dw| tensor(dw, w_t.shape(), w_t)).transpose()?,
                ))
            })
        })
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "fused-linear"
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
        let (m, k, n) = self.dims(l1, l2, l3)?;
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let w = contiguous::<T>(s2, l2, self.name())?;
            let b = contiguous::<T>(s3, l3, self.name())?;
            let out = match self.gelu {
                None => {
                    // y = b (each row) + x · M
                    let mut y = Vec::with_capacity(m * n);
                    for _ in 0..m {
                        y.extend_from_slice(b);
                    }
                    let (rs, cs) = self.operand_strides(k, n);
                    gemm_into(m, n, k, &mut y, n, true, x, k, 1, w, rs, cs, 1.0);
                    y
                }
                Some(approx) => {
                    // x · M without the bias: GELU adds it on the fly (and its backward
                    // yields the bias gradient), so the pre-activation is written once.
                    let xw = self.product(x, w, (m, k, n));
                    let mut a = vec![T::of(0.0); xw.len()];
                    T::gelu_forward(&xw, b, &mut a, approx);
                    *self.pre.lock().unwrap_or_else(|e| e.into_inner()) = Some(T::storage(xw));
                    a
                }
            };
            Ok((T::storage(out), Shape::from((m, n))))
        })
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        b_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(grad, self.name(), |g| {
                let Some(approx) = self.gelu else {
                    let db = column_sums(g, b_t.elem_count());
                    return self.grads::<T>((x_t, w_t, b_t), g, db);
                };
                let pre = self.pre.lock().unwrap_or_else(|e| e.into_inner());
                let xw = pre.as_ref().and_then(T::slice).ok_or_else(|| {
                    candle_core::Error::Msg("linear-gelu: backward without its forward".into())
                })?;
                with_slice::<T, _>(b_t, self.name(), |b| {
                    let mut gy = vec![T::of(0.0); xw.len()];
                    let mut db = vec![0f64; b.len()];
                    T::gelu_backward(xw, b, g, &mut gy, &mut db, approx);
                    self.grads::<T>((x_t, w_t, b_t), &gy, db)
                })
            })
        })
    }
}

/// `x W^T` without a bias (Llama's projections): the same GEMMs as [`Linear`], without the
/// bias add and its gradient.
struct LinearNoBias(Linear);

impl CustomOp2 for LinearNoBias {
    fn name(&self) -> &'static str {
        "fused-linear-no-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k) = l1.shape().dims2()?;
        let (n, c) = l2.shape().dims2()?;
        if c != k {
            return Err(candle_core::Error::Msg(format!(
                "linear (no bias): input {:?} and weight {:?} do not fit",
                l1.shape().dims(),
                l2.shape().dims()
            )));
        }
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let w = contiguous::<T>(s2, l2, self.name())?;
            Ok((T::storage(self.0.product(x, w, (m, k, n))), Shape::from((m, n))))
        })
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = w_t.dim(0)?;
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(grad, self.name(), |g| {
                self.0.input_and_weight_grads::<T>((x_t, w_t), n, g)
            })
        })
    }
}

/// Column sums of `g` (rows of length `n`): blocks of rows summed in `T::Acc` (vectorised;
/// f32 for half precision), the blocks accumulated in f64.
fn column_sums<T: Float>(g: &[T], n: usize) -> Vec<f64> {
    const BLOCK_ROWS: usize = 32;
    let n = n.max(1);
    let mut db = vec![0f64; n];
    let mut block = vec![T::Acc::of(0.0); n];
    for rows in g.chunks(n * BLOCK_ROWS) {
        let rows = T::to_acc(rows);
        block.iter_mut().for_each(|b| *b = T::Acc::of(0.0));
        for row in rows.chunks(n) {
            block.iter_mut().zip(row).for_each(|(b, &v)| *b += v);
        }
        db.iter_mut().zip(&block).for_each(|(d, b)| *d += b.f());
    }
    db
}

/// Applies the linear op (with optional GELU) over the last dimension of `x` (any leading
/// shape).
fn over_last_dim(
    x: &Tensor,
    (w, b): (&Tensor, &Tensor),
    layout: WeightLayout,
    gelu: Option<GeluApprox>,
) -> Result<Tensor> {
    let op = Linear {
        layout,
        gelu,
        pre: Mutex::new(None),
        wanted: (x.track_op(), w.track_op()),
    };
    on_rows(x, b.elem_count(), |x2| {
        x2.apply_op3(&w.contiguous()?, &b.contiguous()?, op)
    })
}

/// `op` on `x` seen as the rows `[elements / d_in, d_in]` of its last dimension, its
/// `[rows, d_out]` result given `x`'s leading shape back.
pub(super) fn on_rows(
    x: &Tensor,
    d_out: usize,
    op: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let d_in = *dims.last().unwrap_or(&1);
    let x2 = x
        .reshape((x.elem_count() / d_in.max(1), d_in))?
        .contiguous()?;
    let y = op(&x2)?;
    if let Some(last) = dims.last_mut() {
        *last = d_out;
    }
    y.reshape(dims)
}

/// `x W^T + b` over the last dimension of `x` (any leading shape), `W` `[out, in]`, `b` `[out]`.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !has_kernels(x) {
        return project_elsewhere(x, w, true, b, None);
    }
    over_last_dim(x, (w, b), WeightLayout::OutIn, None)
}

/// `x W^T` over the last dimension of `x` (any leading shape), `W` `[out, in]`, no bias
/// (Llama's, Mistral's and Qwen2's output projections), as one op.
pub fn linear_no_bias(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !has_kernels(x) {
        return composed::project(x, w, true, None, None);
    }
    let op = LinearNoBias(Linear {
        layout: WeightLayout::OutIn,
        gelu: None,
        pre: Mutex::new(None),
        wanted: (x.track_op(), w.track_op()),
    });
    on_rows(x, w.dim(0)?, |x2| x2.apply_op2(&w.contiguous()?, op))
}

/// `x W^T + u` over the last dimension of `x` (any leading shape), `W` `[out, in]`, `u` of
/// the output's shape: a projection without bias plus an update made beside it (LoRA's), as
/// one op, so the projection's own output is no graph node kept to backward.
pub fn linear_no_bias_add(x: &Tensor, w: &Tensor, u: &Tensor) -> Result<Tensor> {
    if !has_kernels(x) {
        return composed::project(x, w, true, None, None)? + u;
    }
    let op = LinearNoBiasAdd(Linear {
        layout: WeightLayout::OutIn,
        gelu: None,
        pre: Mutex::new(None),
        wanted: (x.track_op(), w.track_op()),
    });
    let n = w.dim(0)?;
    let u2 = u.reshape((u.elem_count() / n.max(1), n))?.contiguous()?;
    on_rows(x, n, |x2| x2.apply_op3(&w.contiguous()?, &u2, op))
}

/// [`linear_no_bias_add`]'s op: [`LinearNoBias`]'s GEMMs, the product accumulated onto `u`.
struct LinearNoBiasAdd(Linear);

impl CustomOp3 for LinearNoBiasAdd {
    fn name(&self) -> &'static str {
        "fused-linear-no-bias-add"
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
        let (m, k) = l1.shape().dims2()?;
        let (n, c) = l2.shape().dims2()?;
        if c != k || l3.shape().dims() != [m, n] {
            candle_core::bail!(
                "linear (no bias) + update: input {:?}, weight {:?} and update {:?} do not fit",
                l1.shape().dims(),
                l2.shape().dims(),
                l3.shape().dims()
            );
        }
        float_dispatch!(s1.dtype(), self.name(), T => {
            let x = contiguous::<T>(s1, l1, self.name())?;
            let w = contiguous::<T>(s2, l2, self.name())?;
            let mut y = contiguous::<T>(s3, l3, self.name())?.to_vec();
            let (rs, cs) = self.0.operand_strides(k, n);
            gemm_into(m, n, k, &mut y, n, true, x, k, 1, w, rs, cs, 1.0);
            Ok((T::storage(y), Shape::from((m, n))))
        })
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        _u_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = w_t.dim(0)?;
        float_dispatch!(x_t.dtype(), self.name(), T => {
            with_slice::<T, _>(grad, self.name(), |g| {
                let (dx, dw) = self.0.input_and_weight_grads::<T>((x_t, w_t), n, g)?;
                Ok((dx, dw, Some(grad.clone())))
            })
        })
    }
}

/// `gelu(x W^T + b)` over the last dimension of `x`, as one op.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor, approx: GeluApprox) -> Result<Tensor> {
    if !has_kernels(x) {
        return project_elsewhere(x, w, true, b, Some(approx));
    }
    over_last_dim(x, (w, b), WeightLayout::OutIn, Some(approx))
}

/// GPT-2's `Conv1D`: `x W + b` over the last dimension of `x`, `W` `[in, out]`, `b` `[out]`,
/// optionally followed by GELU, as one op.
pub fn conv1d(x: &Tensor, w: &Tensor, b: &Tensor, gelu: Option<GeluApprox>) -> Result<Tensor> {
    if !has_kernels(x) {
        return project_elsewhere(x, w, false, b, gelu);
    }
    over_last_dim(x, (w, b), WeightLayout::InOut, gelu)
}

/// A projection with a bias where the CPU's fused op does not serve `x`: on a GPU in f32 or
/// bf16 with GELU, [`product_then_bias_gelu`]; otherwise candle's ops (the bias alone is one
/// broadcast add, which keeps nothing for backward).
fn project_elsewhere(
    x: &Tensor,
    w: &Tensor,
    w_out_in: bool,
    b: &Tensor,
    gelu: Option<GeluApprox>,
) -> Result<Tensor> {
    match gelu {
        Some(approx) if has_cuda_kernels(x) => product_then_bias_gelu(x, w, w_out_in, b, approx),
        _ => composed::project(x, w, w_out_in, Some(b), gelu.map(|a| a == GeluApprox::Tanh)),
    }
}

/// `gelu(x W^T + b)` (or `x W + b`) as the device's product (cuBLAS on a GPU) followed by
/// the fused bias-and-GELU op, one kernel that keeps only the product for its backward;
/// candle's composition keeps the biased sum (in f32) and runs the add and GELU as passes of
/// their own. Computes on any device (tested on the CPU against the fused projection).
pub(super) fn product_then_bias_gelu(
    x: &Tensor,
    w: &Tensor,
    w_out_in: bool,
    b: &Tensor,
    approx: GeluApprox,
) -> Result<Tensor> {
    let product = composed::project(x, w, w_out_in, None, None)?;
    super::gelu::bias_gelu(&product, b, approx)
}
