//! Fused training kernels as candle custom ops, each with a hand-written, slice-based
//! backward that records no graph (candle-nn's fast layer_norm and softmax have no backward
//! at all, and candle's composed backward formulas are slow and memory-hungry).

mod attention;
mod cross_entropy;
mod dropout;
mod embedding;
mod gelu;
mod linear;
mod norm;
mod simd;
mod softmax;

pub use attention::{packed_attention, scaled_dot_product_attention};
pub use cross_entropy::{CrossEntropy, Reduction, cross_entropy};
pub use dropout::dropout;
pub use embedding::embedding;
pub use gelu::{GeluApprox, bias_gelu, gelu};
pub use linear::{conv1d, linear, linear_gelu};
pub use norm::{add_layer_norm, layer_norm, rms_norm};
pub use softmax::softmax_last_dim;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};

/// The float types the kernels run in.
pub trait Float: candle_core::WithDType + Copy + Send + Sync + 'static {
    /// Borrows the contiguous elements of a storage of this type.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    /// Wraps a vector as a storage.
    fn storage(v: Vec<Self>) -> CpuStorage;
    /// To f64 for accumulation.
    fn f(self) -> f64;
    /// From f64.
    fn of(v: f64) -> Self;
    /// Softmax of each row of `s` (length `d`) in place, writing each row's log-sum-exp.
    fn softmax_rows_in_place(s: &mut [Self], lse: &mut [f64], d: usize);
    /// `s = exp(s - lse)` per row of length `d`.
    fn exp_rows_minus(s: &mut [Self], lse: &[f64], d: usize);
    /// Softmax backward per row of length `d`: `dx = y * (g - sum(g * y))`.
    fn softmax_rows_backward(y: &[Self], g: &[Self], dx: &mut [Self], d: usize);
    /// `out = gelu(x + bias)`, bias broadcast over rows (empty: no bias).
    fn gelu_forward(x: &[Self], bias: &[Self], out: &mut [Self], approx: GeluApprox);
    /// `dx = g * gelu'(x + bias)`; with a bias, its column sums are added to `dbias`.
    fn gelu_backward(
        x: &[Self],
        bias: &[Self],
        g: &[Self],
        dx: &mut [Self],
        dbias: &mut [f64],
        approx: GeluApprox,
    );
    /// LayerNorm (`center`) or RMSNorm rows of length `d`, affine.
    fn norm_forward(
        x: &[Self],
        gamma: &[Self],
        beta: Option<&[Self]>,
        d: usize,
        eps: f64,
        center: bool,
    ) -> Vec<Self>;
    /// Their backward: (dx, dgamma, dbeta).
    #[allow(clippy::type_complexity)]
    fn norm_backward(
        x: &[Self],
        gamma: &[Self],
        g: &[Self],
        d: usize,
        eps: f64,
        center: bool,
    ) -> (Vec<Self>, Vec<Self>, Vec<Self>);

    /// The GEMM behind [`gemm_into`] and [`gemm_new`] (see [`gemm_raw`]); types the `gemm`
    /// crate lacks override it.
    ///
    /// # Safety
    /// As [`gemm_raw`].
    unsafe fn gemm(
        mnk: (usize, usize, usize),
        dst: *mut Self,
        dst_rs: usize,
        accumulate: bool,
        lhs: (&[Self], usize, usize),
        rhs: (&[Self], usize, usize),
        scale: f64,
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { native_gemm(mnk, dst, dst_rs, accumulate, lhs, rhs, scale) }
    }
}

/// Runs `f` on an f32 copy of a half-precision slice and writes its f32 output back: the
/// half-precision kernels compute in f32 (the accumulation mixed precision asks for) with
/// the vectorised f32 code.
fn via_f32<H>(out: &mut [H], f: impl FnOnce(&mut [f32]))
where
    [H]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    let mut wide = vec![0f32; out.len()];
    out.convert_to_f32_slice(&mut wide);
    f(&mut wide);
    out.convert_from_f32_slice(&wide);
}

fn widen<H>(v: &[H]) -> Vec<f32>
where
    [H]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    let mut wide = vec![0f32; v.len()];
    v.convert_to_f32_slice(&mut wide);
    wide
}

fn narrow<H: Default + Clone>(v: &[f32]) -> Vec<H>
where
    [H]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    let mut out = vec![H::default(); v.len()];
    out.convert_from_f32_slice(v);
    out
}

/// An f32 copy of the `rows` x `cols` operand at `v` with (row, column) strides `(rs, cs)`,
/// and its strides: rows (or, for a transposed view, columns) that are contiguous are
/// converted a slice at a time, keeping the operand's orientation for the GEMM.
fn widen_operand<H: Copy + Default>(
    v: &[H],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
) -> (Vec<f32>, usize, usize)
where
    [H]: half::slice::HalfFloatSliceExt,
{
    use half::slice::HalfFloatSliceExt;
    let mut out = vec![0f32; rows * cols];
    if rows == 0 || cols == 0 {
        return (out, cols, 1);
    }
    if cs == 1 {
        for i in 0..rows {
            v[i * rs..i * rs + cols].convert_to_f32_slice(&mut out[i * cols..(i + 1) * cols]);
        }
        (out, cols, 1)
    } else if rs == 1 {
        for j in 0..cols {
            v[j * cs..j * cs + rows].convert_to_f32_slice(&mut out[j * rows..(j + 1) * rows]);
        }
        (out, 1, rows)
    } else {
        let mut one = [0f32];
        for i in 0..rows {
            for j in 0..cols {
                [v[i * rs + j * cs]].convert_to_f32_slice(&mut one);
                out[i * cols + j] = one[0];
            }
        }
        (out, cols, 1)
    }
}

/// A half-precision type (mixed precision's compute dtypes): stored in half precision,
/// computed in f32 — elementwise and row kernels through the f32 SIMD code, GEMMs on f32
/// copies of the operands with f32 accumulation, rounded once at the end.
macro_rules! half_float {
    ($t:ty, $variant:ident) => {
        impl Float for $t {
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
            #[inline]
            fn f(self) -> f64 {
                self.to_f64()
            }
            #[inline]
            fn of(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            fn softmax_rows_in_place(s: &mut [Self], lse: &mut [f64], d: usize) {
                via_f32(s, |w| simd::softmax_rows_in_place(w, lse, d))
            }
            fn exp_rows_minus(s: &mut [Self], lse: &[f64], d: usize) {
                via_f32(s, |w| simd::exp_rows_minus(w, lse, d))
            }
            fn softmax_rows_backward(y: &[Self], g: &[Self], dx: &mut [Self], d: usize) {
                let (y, g) = (widen(y), widen(g));
                via_f32(dx, |w| simd::softmax_rows_backward(&y, &g, w, d))
            }
            fn gelu_forward(x: &[Self], bias: &[Self], out: &mut [Self], approx: GeluApprox) {
                let (x, bias) = (widen(x), widen(bias));
                via_f32(out, |w| {
                    simd::gelu_forward(&x, &bias, w, approx == GeluApprox::Tanh)
                })
            }
            fn gelu_backward(
                x: &[Self],
                bias: &[Self],
                g: &[Self],
                dx: &mut [Self],
                dbias: &mut [f64],
                approx: GeluApprox,
            ) {
                let (x, bias, g) = (widen(x), widen(bias), widen(g));
                via_f32(dx, |w| {
                    simd::gelu_backward(&x, &bias, &g, w, dbias, approx == GeluApprox::Tanh)
                })
            }
            fn norm_forward(
                x: &[Self],
                gamma: &[Self],
                beta: Option<&[Self]>,
                d: usize,
                eps: f64,
                center: bool,
            ) -> Vec<Self> {
                let beta = beta.map(widen);
                narrow(&f32::norm_forward(
                    &widen(x),
                    &widen(gamma),
                    beta.as_deref(),
                    d,
                    eps,
                    center,
                ))
            }
            fn norm_backward(
                x: &[Self],
                gamma: &[Self],
                g: &[Self],
                d: usize,
                eps: f64,
                center: bool,
            ) -> (Vec<Self>, Vec<Self>, Vec<Self>) {
                let (dx, dgamma, dbeta) =
                    f32::norm_backward(&widen(x), &widen(gamma), &widen(g), d, eps, center);
                (narrow(&dx), narrow(&dgamma), narrow(&dbeta))
            }
            unsafe fn gemm(
                (m, n, k): (usize, usize, usize),
                dst: *mut Self,
                dst_rs: usize,
                accumulate: bool,
                (lhs, lhs_rs, lhs_cs): (&[Self], usize, usize),
                (rhs, rhs_rs, rhs_cs): (&[Self], usize, usize),
                scale: f64,
            ) {
                use half::slice::HalfFloatSliceExt;
                // f32 copies of exactly the elements the product reads, in their layout.
                let (a, a_rs, a_cs) = widen_operand(lhs, m, k, lhs_rs, lhs_cs);
                let (b, b_rs, b_cs) = widen_operand(rhs, k, n, rhs_rs, rhs_cs);
                let mut c = vec![0f32; m * n];
                for i in 0..m {
                    // SAFETY: the caller vouches for reads (when accumulating) and writes of
                    // `dst` at row i, columns 0..n.
                    let row = unsafe { std::slice::from_raw_parts_mut(dst.add(i * dst_rs), n) };
                    if accumulate {
                        row.convert_to_f32_slice(&mut c[i * n..(i + 1) * n]);
                    }
                }
                // SAFETY: `c`, `a` and `b` are buffers of exactly these shapes and strides.
                unsafe {
                    native_gemm(
                        (m, n, k),
                        c.as_mut_ptr(),
                        n,
                        accumulate,
                        (&a, a_rs, a_cs),
                        (&b, b_rs, b_cs),
                        scale,
                    )
                };
                for i in 0..m {
                    // SAFETY: as above.
                    let row = unsafe { std::slice::from_raw_parts_mut(dst.add(i * dst_rs), n) };
                    row.convert_from_f32_slice(&c[i * n..(i + 1) * n]);
                }
            }
        }
    };
}

half_float!(half::bf16, BF16);
half_float!(half::f16, F16);

impl Float for f32 {
    fn slice(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
    fn storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F32(v)
    }
    #[inline]
    fn f(self) -> f64 {
        self as f64
    }
    #[inline]
    fn of(v: f64) -> Self {
        v as f32
    }
    fn softmax_rows_in_place(s: &mut [Self], lse: &mut [f64], d: usize) {
        simd::softmax_rows_in_place(s, lse, d)
    }
    fn exp_rows_minus(s: &mut [Self], lse: &[f64], d: usize) {
        simd::exp_rows_minus(s, lse, d)
    }
    fn softmax_rows_backward(y: &[Self], g: &[Self], dx: &mut [Self], d: usize) {
        simd::softmax_rows_backward(y, g, dx, d)
    }
    fn gelu_forward(x: &[Self], bias: &[Self], out: &mut [Self], approx: GeluApprox) {
        simd::gelu_forward(x, bias, out, approx == GeluApprox::Tanh)
    }
    fn gelu_backward(
        x: &[Self],
        bias: &[Self],
        g: &[Self],
        dx: &mut [Self],
        dbias: &mut [f64],
        approx: GeluApprox,
    ) {
        simd::gelu_backward(x, bias, g, dx, dbias, approx == GeluApprox::Tanh)
    }
    fn norm_forward(
        x: &[Self],
        gamma: &[Self],
        beta: Option<&[Self]>,
        d: usize,
        eps: f64,
        center: bool,
    ) -> Vec<Self> {
        let mut y = vec![0f32; x.len()];
        simd::norm_rows(x, gamma, beta.unwrap_or(&[]), &mut y, d, eps as f32, center);
        y
    }
    fn norm_backward(
        x: &[Self],
        gamma: &[Self],
        g: &[Self],
        d: usize,
        eps: f64,
        center: bool,
    ) -> (Vec<Self>, Vec<Self>, Vec<Self>) {
        let mut dx = vec![0f32; x.len()];
        let (mut dgamma, mut dbeta) = (vec![0f64; d], vec![0f64; d]);
        simd::norm_rows_backward(
            x,
            gamma,
            g,
            &mut dx,
            &mut dgamma,
            &mut dbeta,
            d,
            eps as f32,
            center,
        );
        let narrow = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect();
        (dx, narrow(dgamma), narrow(dbeta))
    }
}

impl Float for f64 {
    fn slice(s: &CpuStorage) -> Option<&[Self]> {
        match s {
            CpuStorage::F64(v) => Some(v),
            _ => None,
        }
    }
    fn storage(v: Vec<Self>) -> CpuStorage {
        CpuStorage::F64(v)
    }
    #[inline]
    fn f(self) -> f64 {
        self
    }
    #[inline]
    fn of(v: f64) -> Self {
        v
    }
    fn softmax_rows_in_place(s: &mut [Self], lse: &mut [f64], d: usize) {
        for (row, l) in s.chunks_mut(d.max(1)).zip(lse.iter_mut()) {
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
            row.iter_mut().for_each(|v| *v = (*v - max).exp());
            let sum: f64 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= sum);
            *l = max + sum.ln();
        }
    }
    fn exp_rows_minus(s: &mut [Self], lse: &[f64], d: usize) {
        for (row, &l) in s.chunks_mut(d.max(1)).zip(lse) {
            row.iter_mut().for_each(|v| *v = (*v - l).exp());
        }
    }
    fn softmax_rows_backward(y: &[Self], g: &[Self], dx: &mut [Self], d: usize) {
        let d = d.max(1);
        for ((yr, gr), dr) in y.chunks(d).zip(g.chunks(d)).zip(dx.chunks_mut(d)) {
            let dot: f64 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((o, a), b) in dr.iter_mut().zip(yr).zip(gr) {
                *o = a * (b - dot);
            }
        }
    }
    fn gelu_forward(x: &[Self], bias: &[Self], out: &mut [Self], approx: GeluApprox) {
        gelu::forward_scalar(x, bias, out, approx)
    }
    fn gelu_backward(
        x: &[Self],
        bias: &[Self],
        g: &[Self],
        dx: &mut [Self],
        dbias: &mut [f64],
        approx: GeluApprox,
    ) {
        gelu::backward_scalar(x, bias, g, dx, dbias, approx)
    }
    fn norm_forward(
        x: &[Self],
        gamma: &[Self],
        beta: Option<&[Self]>,
        d: usize,
        eps: f64,
        center: bool,
    ) -> Vec<Self> {
        norm::norm_fwd(x, gamma, beta, d, eps, center)
    }
    fn norm_backward(
        x: &[Self],
        gamma: &[Self],
        g: &[Self],
        d: usize,
        eps: f64,
        center: bool,
    ) -> (Vec<Self>, Vec<Self>, Vec<Self>) {
        norm::norm_bwd(x, gamma, g, d, eps, center)
    }
}

/// The contiguous elements of a CPU storage under `layout`.
fn contiguous<'a, T: Float>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [T]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: input must be contiguous")))?;
    let all = T::slice(s).ok_or_else(|| {
        candle_core::Error::Msg(format!("{op}: unexpected dtype {:?}", s.dtype()))
    })?;
    Ok(&all[start..end])
}

/// Runs `f` on the contiguous CPU elements of `t`.
fn with_slice<T: Float, R>(t: &Tensor, op: &str, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(contiguous::<T>(s, layout, op)?),
        _ => Err(candle_core::Error::Msg(format!(
            "{op}: only CPU tensors are supported"
        ))),
    }
}

/// A new, untracked tensor (gradients built this way record no graph).
fn tensor<T: Float>(v: Vec<T>, shape: &Shape, like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(v, shape, like.device())
}

/// Dispatches on the float dtype of a tensor.
macro_rules! float_dispatch {
    ($dtype:expr, $op:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $T = f64;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => Err(candle_core::Error::Msg(format!(
                "{}: unsupported dtype {other:?} (f32, f64, bf16 or f16)",
                $op
            ))),
        }
    };
}
use float_dispatch;

/// Rows of the last dimension: (number of rows, row length).
fn rows(shape: &Shape) -> (usize, usize) {
    let dims = shape.dims();
    let d = dims.last().copied().unwrap_or(1);
    (shape.elem_count() / d.max(1), d)
}

fn parallelism() -> gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// `dst[m×n] = (dst if accumulate) + scale · lhs[m×k] · rhs[k×n]`, every operand given by
/// (row, column) strides (`dst` by its row stride, columns contiguous).
#[allow(clippy::too_many_arguments)]
fn gemm_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[T],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[T],
    rhs_rs: usize,
    rhs_cs: usize,
    scale: f64,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        dst.len() >= (m - 1) * dst_rs + n,
        "gemm: destination too short"
    );
    // SAFETY: the assertion above keeps every destination index inside `dst`.
    unsafe {
        gemm_raw(
            (m, n, k),
            dst.as_mut_ptr(),
            dst_rs,
            accumulate,
            (lhs, lhs_rs, lhs_cs),
            (rhs, rhs_rs, rhs_cs),
            scale,
        )
    }
}

/// `scale · lhs[m×k] · rhs[k×n]` into a new row-major vector, written by the GEMM directly
/// (no zero-fill first: outputs here are activation- and weight-sized).
#[allow(clippy::too_many_arguments)]
fn gemm_new<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    lhs: &[T],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[T],
    rhs_rs: usize,
    rhs_cs: usize,
    scale: f64,
) -> Vec<T> {
    if m == 0 || n == 0 || k == 0 {
        return vec![T::of(0.0); m * n];
    }
    let mut dst: Vec<T> = Vec::with_capacity(m * n);
    // SAFETY: the destination is the vector's m·n reserved elements, which a GEMM that does
    // not read its destination (`accumulate` false) writes in full before the length is set.
    unsafe {
        gemm_raw(
            (m, n, k),
            dst.as_mut_ptr(),
            n,
            false,
            (lhs, lhs_rs, lhs_cs),
            (rhs, rhs_rs, rhs_cs),
            scale,
        );
        dst.set_len(m * n);
    }
    dst
}

/// The one call into `gemm`; checks that the operands' strides stay inside their slices.
///
/// # Safety
/// `dst` must be valid for writes (and for reads when `accumulate`) at every
/// `i * dst_rs + j`, `i < m`, `j < n`.
unsafe fn gemm_raw<T: Float>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[T], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[T], usize, usize),
    scale: f64,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k > 0 {
        assert!(
            lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs,
            "gemm: lhs too short"
        );
        assert!(
            rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs,
            "gemm: rhs too short"
        );
    }
    // SAFETY: the caller vouches for `dst`; the assertions above for the operands.
    unsafe {
        T::gemm(
            (m, n, k),
            dst,
            dst_rs,
            accumulate,
            (lhs, lhs_rs, lhs_cs),
            (rhs, rhs_rs, rhs_cs),
            scale,
        )
    }
}

/// The `gemm` crate's GEMM for the types it has (f32, f64).
///
/// # Safety
/// As [`gemm_raw`], whose checks have been made.
unsafe fn native_gemm<T: 'static + Copy + Float>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[T], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[T], usize, usize),
    scale: f64,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            T::of(1.0),
            T::of(scale),
            false,
            false,
            false,
            parallelism(),
        )
    }
}
