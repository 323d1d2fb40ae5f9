//! The half-precision [`Float`] types (bf16 and f16, mixed precision's compute dtypes):
//! stored in half precision, computed in f32 through the f32 kernels, and bf16 GEMMs in
//! bf16 dot products with f32 sums where the CPU has them (`bf16_gemm`).

use std::borrow::Cow;

use candle_core::CpuStorage;

use super::bf16_gemm;
use super::dropout::scale_kept_bf16;
use super::matmul::native_gemm;
use super::{Float, GeluApprox, simd};

/// Conversions between a half-precision type and f32: exact widening, narrowing rounded to
/// nearest (ties to even). bf16 has its own vectorised kernels (`simd`); f16 has `half`'s,
/// which use F16C where the CPU has it.
trait F32Conversions: Sized + Copy + Default + Into<f32> {
    /// Appends `src`, widened, to `out` (no zero fill first).
    fn extend_f32(src: &[Self], out: &mut Vec<f32>);
    /// `src` rounded into `dst`, of the same length.
    fn narrow_into(src: &[f32], dst: &mut [Self]);
    /// `a + b`, each sum of the widened values rounded once.
    fn add(a: &[Self], b: &[Self]) -> Vec<Self>;
}

impl F32Conversions for half::bf16 {
    fn extend_f32(src: &[Self], out: &mut Vec<f32>) {
        simd::extend_bf16_as_f32(src, out)
    }
    fn narrow_into(src: &[f32], dst: &mut [Self]) {
        simd::f32_to_bf16(src, dst)
    }
    fn add(a: &[Self], b: &[Self]) -> Vec<Self> {
        let len = a.len().min(b.len());
        let mut out = Vec::new();
        // SAFETY: bf16_add writes every element of a destination as long as its operands.
        unsafe { simd::append_written(&mut out, len, |d| simd::bf16_add(&a[..len], &b[..len], d)) };
        out
    }
}

impl F32Conversions for half::f16 {
    fn extend_f32(src: &[Self], out: &mut Vec<f32>) {
        use half::slice::HalfFloatSliceExt;
        let start = out.len();
        out.resize(start + src.len(), 0.0);
        src.convert_to_f32_slice(&mut out[start..]);
    }
    fn narrow_into(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src)
    }
    fn add(a: &[Self], b: &[Self]) -> Vec<Self> {
        a.iter().zip(b).map(|(&x, &y)| x + y).collect()
    }
}

/// Runs `f` on an f32 copy of a half-precision slice and writes its f32 output back: the
/// half-precision kernels compute in f32 (the accumulation mixed precision asks for) with
/// the vectorised f32 code.
fn via_f32<H: F32Conversions>(out: &mut [H], f: impl FnOnce(&mut [f32])) {
    let mut wide = widen(out);
    f(&mut wide);
    H::narrow_into(&wide, out);
}

/// Runs `f` on a zeroed f32 buffer and writes what it produced into `out` (an output the
/// kernel only writes: nothing is converted in first).
fn write_via_f32<H: F32Conversions>(out: &mut [H], f: impl FnOnce(&mut [f32])) {
    let mut wide = vec![0f32; out.len()];
    f(&mut wide);
    H::narrow_into(&wide, out);
}

/// Elements of each operand the chunked kernels convert at a time (whole rows, at least one).
const CHUNK_ELEMS: usize = 8192;

/// Runs `f` over `out` in chunks of whole rows of `row` elements: each chunk's `inputs`
/// widened into f32 buffers reused from chunk to chunk, `f` given the chunk's range and
/// writing every element of its f32 output, which is rounded into `out`. The copies stay
/// in cache and nothing activation-sized is allocated; a row kernel computes each row as on
/// whole f32 copies, so results are the same bit for bit.
fn chunked<H: F32Conversions, const N: usize>(
    inputs: [&[H]; N],
    out: &mut [H],
    row: usize,
    mut f: impl FnMut(std::ops::Range<usize>, [&[f32]; N], &mut [f32]),
) {
    let row = row.max(1);
    let step = (CHUNK_ELEMS / row).max(1) * row;
    let mut wide: [Vec<f32>; N] = std::array::from_fn(|_| Vec::with_capacity(step));
    let mut wide_out: Vec<f32> = Vec::with_capacity(step);
    for start in (0..out.len()).step_by(step) {
        let end = (start + step).min(out.len());
        for (w, x) in wide.iter_mut().zip(&inputs) {
            w.clear();
            H::extend_f32(&x[start..end], w);
        }
        wide_out.resize(end - start, 0.0);
        f(
            start..end,
            std::array::from_fn(|i| wide[i].as_slice()),
            &mut wide_out,
        );
        H::narrow_into(&wide_out, &mut out[start..end]);
    }
}

fn widen<H: F32Conversions>(v: &[H]) -> Vec<f32> {
    let mut wide = Vec::with_capacity(v.len());
    H::extend_f32(v, &mut wide);
    wide
}

fn narrow<H: F32Conversions>(v: &[f32]) -> Vec<H> {
    let mut out = vec![H::default(); v.len()];
    H::narrow_into(v, &mut out);
    out
}

/// An f32 copy of the `rows` x `cols` operand at `v` with (row, column) strides `(rs, cs)`,
/// and its strides: rows (or, for a transposed view, columns) that are contiguous are
/// converted a slice at a time, keeping the operand's orientation for the GEMM.
fn widen_operand<H: F32Conversions>(
    v: &[H],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
) -> (Vec<f32>, usize, usize) {
    let mut out = Vec::with_capacity(rows * cols);
    if rows == 0 || cols == 0 {
        return (out, cols, 1);
    }
    if cs == 1 {
        for i in 0..rows {
            H::extend_f32(&v[i * rs..i * rs + cols], &mut out);
        }
        (out, cols, 1)
    } else if rs == 1 {
        for j in 0..cols {
            H::extend_f32(&v[j * cs..j * cs + rows], &mut out);
        }
        (out, 1, rows)
    } else {
        // Neither direction contiguous: one element at a time.
        for i in 0..rows {
            out.extend((0..cols).map(|j| v[i * rs + j * cs].into()));
        }
        (out, cols, 1)
    }
}

/// The f32 GEMM on f32 copies of exactly the elements the product reads (in their layout),
/// into the f32 `dst`: half-precision products where the CPU has no dot products of the
/// type.
///
/// # Safety
/// As `matmul::gemm_raw`, `dst` of f32.
unsafe fn widened_gemm<H: F32Conversions>(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[H], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[H], usize, usize),
    scale: f64,
) {
    let (a, a_rs, a_cs) = widen_operand(lhs, m, k, lhs_rs, lhs_cs);
    let (b, b_rs, b_cs) = widen_operand(rhs, k, n, rhs_rs, rhs_cs);
    // SAFETY: forwarded from the caller; `a` and `b` are of these strides.
    unsafe {
        native_gemm(
            (m, n, k),
            dst,
            dst_rs,
            accumulate,
            (&a, a_rs, a_cs),
            (&b, b_rs, b_cs),
            scale,
        )
    }
}

/// A half-precision type (mixed precision's compute dtypes): stored in half precision,
/// computed in f32 — elementwise and row kernels through the f32 SIMD code, GEMMs on f32
/// copies of the operands with f32 accumulation, rounded once at the end.
/// `dot`, where given, is a module with a GEMM in this type's own dot-product instructions
/// (`gemm(...)`), taken where [`super::bf16_choice`] says (the CPU has them, and its cores do
/// not retire f32 multiply-adds clearly faster).
macro_rules! half_float {
    ($t:ty, $variant:ident $(, dot = $dot:ident)? $(, scale_kept = $scale_kept:ident)?) => {
        impl Float for $t {
            $(
                fn scale_kept(x: &[Self], keep: &[bool], scale: f64, out: &mut Vec<Self>) {
                    $scale_kept(x, keep, scale, out)
                }
            )?
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
            fn add(a: &[Self], b: &[Self]) -> Vec<Self> {
                <Self as F32Conversions>::add(a, b)
            }
            fn softmax_rows_in_place(s: &mut [Self], lse: &mut [f64], d: usize) {
                via_f32(s, |w| simd::softmax_rows_in_place(w, lse, d))
            }
            fn exp_rows_minus(s: &mut [Self], lse: &[f64], d: usize) {
                via_f32(s, |w| simd::exp_rows_minus(w, lse, d))
            }
            fn softmax_rows_backward(y: &[Self], g: &[Self], dx: &mut [Self], d: usize) {
                let (y, g) = (widen(y), widen(g));
                write_via_f32(dx, |w| simd::softmax_rows_backward(&y, &g, w, d))
            }
            fn gelu_forward(x: &[Self], bias: &[Self], out: &mut [Self], approx: GeluApprox) {
                let (bias, tanh) = (widen(bias), approx == GeluApprox::Tanh);
                // Rows of the bias's width (element-wise without one).
                let row = bias.len().max(1);
                chunked([x], out, row, |_, [x], w| simd::gelu_forward(x, &bias, w, tanh))
            }
            fn gelu_backward(
                x: &[Self],
                bias: &[Self],
                g: &[Self],
                dx: &mut [Self],
                dbias: &mut [f64],
                approx: GeluApprox,
            ) {
                let (bias, tanh) = (widen(bias), approx == GeluApprox::Tanh);
                let row = bias.len().max(1);
                chunked([x, g], dx, row, |_, [x, g], w| {
                    simd::gelu_backward(x, &bias, g, w, dbias, tanh)
                })
            }
            fn swiglu_forward(gate: &[Self], up: &[Self], out: &mut [Self]) {
                chunked([gate, up], out, 1, |_, [gate, up], w| simd::swiglu_forward(gate, up, w))
            }
            fn swiglu_backward(
                gate: &[Self],
                up: &[Self],
                dy: &[Self],
                dgate: &mut [Self],
                dup: &mut [Self],
            ) {
                let mut wide_up = Vec::new();
                chunked([gate, up, dy], dgate, 1, |range, [gate, up, dy], w| {
                    wide_up.resize(range.len(), 0.0);
                    simd::swiglu_backward(gate, up, dy, w, &mut wide_up);
                    <Self as F32Conversions>::narrow_into(&wide_up, &mut dup[range]);
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
                let (gamma, beta) = (widen(gamma), beta.map(widen).unwrap_or_default());
                let mut y = vec![Self::default(); x.len()];
                chunked([x], &mut y, d, |_, [x], w| {
                    simd::norm_rows(x, &gamma, &beta, w, d, eps as f32, center)
                });
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
                let gamma = widen(gamma);
                let mut dx = vec![Self::default(); x.len()];
                let (mut dgamma, mut dbeta) = (vec![0f64; d], vec![0f64; d]);
                chunked([x, g], &mut dx, d, |_, [x, g], w| {
                    simd::norm_rows_backward(
                        x, &gamma, g, w, &mut dgamma, &mut dbeta, d, eps as f32, center,
                    )
                });
                // Through f32, as f32's own backward rounds them.
                let narrow = |v: Vec<f64>| narrow(&v.into_iter().map(|x| x as f32).collect::<Vec<_>>());
                (dx, narrow(dgamma), narrow(dbeta))
            }
            unsafe fn gemm(
                mnk: (usize, usize, usize),
                dst: *mut Self,
                dst_rs: usize,
                accumulate: bool,
                lhs: (&[Self], usize, usize),
                rhs: (&[Self], usize, usize),
                scale: f64,
            ) {
                $(
                    #[cfg(target_arch = "x86_64")]
                    if super::bf16_choice::choice().dot_products() {
                        let dst = $dot::Dst::Bf16(dst);
                        // SAFETY: forwarded from the caller; the CPU has the instructions.
                        return unsafe { $dot::gemm(mnk, dst, dst_rs, accumulate, lhs, rhs, scale) };
                    }
                )?
                let (m, n, _) = mnk;
                let mut c = Vec::with_capacity(m * n);
                if accumulate {
                    for i in 0..m {
                        // SAFETY: the caller vouches for reads (when accumulating) and writes
                        // of `dst` at row i, columns 0..n.
                        let row = unsafe { std::slice::from_raw_parts(dst.add(i * dst_rs), n) };
                        Self::extend_f32(row, &mut c);
                    }
                } else {
                    c.resize(m * n, 0.0);
                }
                // SAFETY: `c` holds the m x n product; the operands are the caller's.
                unsafe { widened_gemm(mnk, c.as_mut_ptr(), n, accumulate, lhs, rhs, scale) };
                for i in 0..m {
                    // SAFETY: as above.
                    let row = unsafe { std::slice::from_raw_parts_mut(dst.add(i * dst_rs), n) };
                    Self::narrow_into(&c[i * n..(i + 1) * n], row);
                }
            }
            type Acc = f32;
            fn from_acc(v: &[f32]) -> Cow<'_, [Self]> {
                Cow::Owned(narrow(v))
            }
            fn from_acc_vec(v: Vec<f32>) -> Vec<Self> {
                narrow(&v)
            }
            fn to_acc(v: &[Self]) -> Cow<'_, [f32]> {
                Cow::Owned(widen(v))
            }
            unsafe fn gemm_acc(
                mnk: (usize, usize, usize),
                dst: *mut f32,
                dst_rs: usize,
                accumulate: bool,
                lhs: (&[Self], usize, usize),
                rhs: (&[Self], usize, usize),
                scale: f64,
            ) {
                $(
                    #[cfg(target_arch = "x86_64")]
                    if super::bf16_choice::choice().dot_products() {
                        let dst = $dot::Dst::F32(dst);
                        // SAFETY: forwarded from the caller; the CPU has the instructions.
                        return unsafe { $dot::gemm(mnk, dst, dst_rs, accumulate, lhs, rhs, scale) };
                    }
                )?
                // SAFETY: forwarded from the caller.
                unsafe { widened_gemm(mnk, dst, dst_rs, accumulate, lhs, rhs, scale) }
            }
        }
    };
}

half_float!(
    half::bf16,
    BF16,
    dot = bf16_gemm,
    scale_kept = scale_kept_bf16
);
half_float!(half::f16, F16);
