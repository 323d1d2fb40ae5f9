//! Fused training kernels as candle custom ops, each with a hand-written, slice-based
//! backward that records no graph (candle-nn's fast layer_norm and softmax have no backward
//! at all, and candle's composed backward formulas are slow and memory-hungry).

mod attention;
mod bf16_choice;
mod bf16_gemm;
mod composed;
mod cross_entropy;
#[cfg(feature = "cuda")]
mod cuda_kernels;
mod dropout;
mod embedding;
mod gelu;
#[cfg(feature = "cuda")]
mod gpu_losses;
mod half_float;
#[cfg(target_arch = "x86_64")]
pub mod instruction_loops;
/// Plans of the CUDA kernels, run on a GPU and (in tests) on the CPU emulator.
#[cfg(any(test, feature = "cuda"))]
mod kernel_plan;
mod linear;
mod linear_cross_entropy;
mod lora;
mod matmul;
mod norm;
mod packed;
mod quantized_linear;
mod rope;
mod simd;
mod softmax;
mod swiglu;

pub use attention::{
    AttentionHeads, grouped_query_attention, packed_attention, scaled_dot_product_attention,
    varlen_attention,
};
pub use cross_entropy::{CrossEntropy, Reduction, cross_entropy};
pub use dropout::{dropout, dropout_packed};
pub use embedding::embedding;
pub use gelu::{GeluApprox, bias_gelu, gelu};
pub use linear::{conv1d, linear, linear_gelu, linear_no_bias, linear_no_bias_add};
pub use linear_cross_entropy::linear_cross_entropy;
pub use lora::lora_update;
pub use norm::{add_layer_norm, layer_norm, rms_norm};
pub use packed::PackedSequences;
pub use quantized_linear::quantized_linear;
pub use rope::{RopeAngles, RopeLayout, RopeScaling, RopeTable, rope, rope_with};
pub use softmax::softmax_last_dim;
pub use swiglu::swiglu;

/// Whether the fused ops have kernels for `x`'s device (the CPU's); elsewhere they compute
/// as compositions of candle's ops (`composed.rs`).
fn has_kernels(x: &Tensor) -> bool {
    x.device().is_cpu()
}

/// Whether fsdp-nn's own CUDA paths (`kernels/*.cu`, and LoRA's update on cuBLAS) serve
/// `x`: a CUDA tensor of a type they are built for (f32, bf16); other types compose
/// candle's ops.
fn has_cuda_kernels(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        x.device().is_cuda() && kernel_plan::suffix(x.dtype()).is_some()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = x;
        false
    }
}

/// Which kernels run f32 and f64 matrix products on this CPU (the `gemm` crate's, chosen at
/// run time; built with its AVX-512 ones): what the f32 peak and every projection depend on.
pub fn f32_matmul_kernel() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        let has = |f: &str| match f {
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            "avx512bw" => std::arch::is_x86_feature_detected!("avx512bw"),
            "avx512cd" => std::arch::is_x86_feature_detected!("avx512cd"),
            "avx512dq" => std::arch::is_x86_feature_detected!("avx512dq"),
            "avx512vl" => std::arch::is_x86_feature_detected!("avx512vl"),
            "avx2" => std::arch::is_x86_feature_detected!("avx2"),
            "fma" => std::arch::is_x86_feature_detected!("fma"),
            _ => false,
        };
        if ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]
            .iter()
            .all(|f| has(f))
        {
            return "AVX-512 (x86-64-v4)";
        }
        if has("avx2") && has("fma") {
            return "AVX2+FMA (x86-64-v3)";
        }
    }
    "baseline SIMD"
}

/// Whether this CPU has bf16 dot-product instructions (AVX512_BF16) that bf16 products run
/// in; without them bf16 computes through f32.
pub fn bf16_dot_products_available() -> bool {
    bf16_gemm::available()
}

pub use bf16_gemm::amx::AmxSupport;

/// `values` rounded to bf16 (to nearest, ties to even, as `half::bf16::from_f32`) with the
/// vector instructions this CPU has: f32 parameters made bf16 for a mixed-precision
/// all-gather or computation.
pub fn bf16_from_f32(values: &[f32]) -> Vec<half::bf16> {
    simd::bf16_vec_from_f32(values)
}

/// [`bf16_from_f32`] of `parts` one after another in one vector: a send block rounded
/// straight from several parameters' f32 shards, with no f32 copy of them first.
pub fn bf16_from_f32_parts(parts: &[&[f32]]) -> Vec<half::bf16> {
    simd::bf16_vec_from_parts(parts)
}

/// `src` rounded to bf16 into `dst` (of the same length, written only), with the vector
/// instructions this CPU has, bit for bit `half::bf16::from_f32`: a gradient packed for a
/// reduction in another dtype without an intermediate tensor.
pub fn f32_to_bf16_into(src: &[f32], dst: &mut [std::mem::MaybeUninit<half::bf16>]) {
    simd::f32_to_bf16_uninit(src, dst)
}

/// `src` widened to f32 into `dst` (of the same length, written only), with the vector
/// instructions this CPU has, bit for bit `half::bf16::to_f32`: a bf16 gradient packed for
/// an f32 reduction without an intermediate tensor.
pub fn bf16_to_f32_into(src: &[half::bf16], dst: &mut [std::mem::MaybeUninit<f32>]) {
    simd::bf16_to_f32(src, dst)
}

/// Whether bf16 products run on AMX tiles in this process, and if not, why (the CPU has
/// none, or Linux refused their state): asked of the operating system on first use.
pub fn amx_support() -> &'static AmxSupport {
    bf16_gemm::amx::support()
}

/// Runs `trips` trips of 16 independent `tdpbf16ps` on full tiles (16,384 FLOP each),
/// nothing loaded: the AMX limit `perf` measures. `None` where the tiles are not ready.
pub fn amx_peak_loop(trips: usize) -> Option<()> {
    #[cfg(target_arch = "x86_64")]
    if bf16_gemm::amx::ready() {
        // SAFETY: the tiles are ready.
        unsafe { bf16_gemm::amx::peak_loop(trips) };
        return Some(());
    }
    let _ = trips;
    None
}

pub use bf16_choice::{BF16_GEMM_ENV, Bf16Gemm};

/// Which GEMM bf16 products run in this process, and what decided it (first use decides).
pub fn bf16_gemm_choice() -> &'static Bf16Gemm {
    bf16_choice::choice()
}

/// Which kernel runs bf16 matrix products in this process (what `fsdp env` reports, with the
/// figures [`bf16_gemm_choice`] measured): mixed precision's speed depends on it.
pub fn bf16_matmul_kernel() -> &'static str {
    match bf16_gemm_choice() {
        Bf16Gemm::DotProducts { .. } if bf16_gemm::amx::ready() => {
            "AMX tiles (tdpbf16ps), f32 sums"
        }
        Bf16Gemm::DotProducts { .. } => "AVX512_BF16 dot products, f32 sums",
        Bf16Gemm::Widened { measured: Some(_) } => {
            "f32 GEMM on widened operands (AVX512_BF16 dot products measured slower on this core)"
        }
        Bf16Gemm::Widened { .. } if bf16_gemm::available() => {
            "f32 GEMM on widened operands (FSDP_BF16_GEMM=f32)"
        }
        Bf16Gemm::Widened { .. } => "f32 GEMM on widened operands (this CPU has no AVX512_BF16)",
    }
}

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};

use matmul::{gemm_acc_into, gemm_into, gemm_new, native_gemm};

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
    /// Appends `x` scaled by `scale` where `keep` says and zero elsewhere (dropout's
    /// survivors), each value rounded as `Self::of(v.f() * scale)`.
    fn scale_kept(x: &[Self], keep: &[bool], scale: f64, out: &mut Vec<Self>) {
        dropout::scale_kept_portable(x, keep, scale, out)
    }
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
    /// `out = silu(gate) * up`.
    fn swiglu_forward(gate: &[Self], up: &[Self], out: &mut [Self]);
    /// `dgate = dy * up * silu'(gate)`, `dup = dy * silu(gate)`.
    fn swiglu_backward(
        gate: &[Self],
        up: &[Self],
        dy: &[Self],
        dgate: &mut [Self],
        dup: &mut [Self],
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

    /// The GEMM behind `gemm_into` and `gemm_new` (in `matmul`); types the `gemm`
    /// crate lacks override it.
    ///
    /// # Safety
    /// As `matmul::gemm_raw`.
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

    /// `a + b` element-wise, each sum rounded once to this type.
    fn add(a: &[Self], b: &[Self]) -> Vec<Self> {
        a.iter().zip(b).map(|(&x, &y)| x + y).collect()
    }

    /// The type this one's sums are kept in where a kernel keeps them (attention's scores,
    /// probabilities and gradients): itself for f32 and f64, f32 for the half-precision
    /// types, as mixed precision accumulates.
    type Acc: Float;
    /// `v` as this type: borrowed where `Acc` is this type, else rounded into a new vector.
    fn from_acc(v: &[Self::Acc]) -> Cow<'_, [Self]>;
    /// An `Acc` vector as this type: moved where they are one type, else rounded.
    fn from_acc_vec(v: Vec<Self::Acc>) -> Vec<Self>;
    /// `v` widened to `Acc` (borrowed where they are one type).
    fn to_acc(v: &[Self]) -> Cow<'_, [Self::Acc]>;
    /// [`Float::gemm`] with its results written (or added) in `Acc`: half-precision
    /// operands, f32 sums.
    ///
    /// # Safety
    /// As `matmul::gemm_raw`, `dst` of `Acc`.
    unsafe fn gemm_acc(
        mnk: (usize, usize, usize),
        dst: *mut Self::Acc,
        dst_rs: usize,
        accumulate: bool,
        lhs: (&[Self], usize, usize),
        rhs: (&[Self], usize, usize),
        scale: f64,
    );
}

/// [`Float`]'s accumulation items for a type that is its own `Acc` (f32, f64).
macro_rules! own_accumulator {
    () => {
        type Acc = Self;
        fn from_acc(v: &[Self]) -> Cow<'_, [Self]> {
            Cow::Borrowed(v)
        }
        fn from_acc_vec(v: Vec<Self>) -> Vec<Self> {
            v
        }
        fn to_acc(v: &[Self]) -> Cow<'_, [Self]> {
            Cow::Borrowed(v)
        }
        unsafe fn gemm_acc(
            mnk: (usize, usize, usize),
            dst: *mut Self,
            dst_rs: usize,
            accumulate: bool,
            lhs: (&[Self], usize, usize),
            rhs: (&[Self], usize, usize),
            scale: f64,
        ) {
            // SAFETY: forwarded from the caller.
            unsafe { Self::gemm(mnk, dst, dst_rs, accumulate, lhs, rhs, scale) }
        }
    };
}

impl Float for f32 {
    own_accumulator!();

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
    fn scale_kept(x: &[Self], keep: &[bool], scale: f64, out: &mut Vec<Self>) {
        let n = x.len().min(keep.len());
        // SAFETY: the kernel writes every element of a destination no longer than `x` and
        // `keep`.
        unsafe { simd::append_written(out, n, |d| simd::scale_kept_f32(x, keep, scale, d)) }
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
    fn swiglu_forward(gate: &[Self], up: &[Self], out: &mut [Self]) {
        simd::swiglu_forward(gate, up, out)
    }
    fn swiglu_backward(
        gate: &[Self],
        up: &[Self],
        dy: &[Self],
        dgate: &mut [Self],
        dup: &mut [Self],
    ) {
        simd::swiglu_backward(gate, up, dy, dgate, dup)
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
    own_accumulator!();
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
    fn swiglu_forward(gate: &[Self], up: &[Self], out: &mut [Self]) {
        swiglu::forward_scalar(gate, up, out)
    }
    fn swiglu_backward(
        gate: &[Self],
        up: &[Self],
        dy: &[Self],
        dgate: &mut [Self],
        dup: &mut [Self],
    ) {
        swiglu::backward_scalar(gate, up, dy, dgate, dup)
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
