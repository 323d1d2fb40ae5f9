//! Dropout whose mask is a pure function of (seed, element index): the backward pass
//! regenerates it instead of storing it, and a run is reproducible per rank and step.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use std::sync::Arc;

use super::packed::PackedSequences;
use super::{Float, contiguous, float_dispatch, tensor, with_slice};

use crate::rng::{dropout_keep_into, dropout_threshold};

#[cfg(feature = "cuda")]
use super::{
    cuda_kernels::{self, Operand, Output, device_operand, take_storage},
    kernel_plan::{ElementShape, dropout as plan},
};

struct Dropout {
    p: f64,
    seed: u64,
    /// For packed rows of `width` elements: each row's row in the padded layout whose
    /// element numbers the draws follow (`None`: the tensor's own numbering).
    padded_rows: Option<(Arc<[u32]>, usize)>,
}

/// Elements whose draws are made at a time (a stack buffer of flags).
const DRAWS: usize = 512;

impl Dropout {
    fn apply<T: Float>(&self, x: &[T]) -> Vec<T> {
        let scale = 1.0 / (1.0 - self.p);
        let threshold = dropout_threshold(self.p);
        let mut keep = [false; DRAWS];
        let mut out = Vec::with_capacity(x.len());
        let mut draw = |first: u64, chunk: &[T], out: &mut Vec<T>| {
            let keep = &mut keep[..chunk.len()];
            dropout_keep_into(self.seed, first, threshold, keep);
            T::scale_kept(chunk, keep, scale, out);
        };
        match &self.padded_rows {
            None => {
                for (c, chunk) in x.chunks(DRAWS).enumerate() {
                    draw((c * DRAWS) as u64, chunk, &mut out);
                }
            }
            Some((rows, width)) => {
                for (row, &padded) in x.chunks(*width).zip(rows.iter()) {
                    let first = padded as u64 * *width as u64;
                    for (c, chunk) in row.chunks(DRAWS).enumerate() {
                        draw(first + (c * DRAWS) as u64, chunk, &mut out);
                    }
                }
            }
        }
        out
    }
}

/// [`Float::scale_kept`] element by element.
pub(super) fn scale_kept_portable<T: Float>(x: &[T], keep: &[bool], scale: f64, out: &mut Vec<T>) {
    out.extend(x.iter().zip(keep).map(|(&v, &kept)| {
        if kept {
            T::of(v.f() * scale)
        } else {
            T::of(0.0)
        }
    }));
}

/// bf16's [`Float::scale_kept`]: with AVX-512 eight lanes at a time ([`bf16_vector`]), the
/// same bits as element by element.
pub(super) fn scale_kept_bf16(
    x: &[half::bf16],
    keep: &[bool],
    scale: f64,
    out: &mut Vec<half::bf16>,
) {
    #[cfg(target_arch = "x86_64")]
    if bf16_vector::available() {
        // SAFETY: bf16 is a u16; the kernel writes all x.len() elements of the destination
        // it is given; the CPU has the features.
        unsafe {
            let bits = std::slice::from_raw_parts(x.as_ptr().cast::<u16>(), x.len());
            super::simd::append_written(out, x.len(), |d| {
                bf16_vector::scale_kept(bits, keep, scale, d.as_mut_ptr().cast::<u16>())
            });
        }
        return;
    }
    scale_kept_portable(x, keep, scale, out)
}

/// bf16 dropout scaling eight lanes at a time: each kept value widened to f64, multiplied,
/// and rounded back as `half::bf16::from_f64` rounds a normal result (from the f64's top
/// 32 bits: round up when the first dropped bit is set and any other dropped bit or the
/// last kept one is); eight lanes with a zero, subnormal, infinite or NaN result go
/// through `from_f64` itself.
#[cfg(target_arch = "x86_64")]
mod bf16_vector {
    use std::arch::x86_64::*;

    use half::bf16;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    }

    /// One lane as the portable path computes it.
    fn scalar(bits: u16, kept: bool, scale: f64) -> u16 {
        if kept {
            bf16::from_f64(bf16::from_bits(bits).to_f64() * scale).to_bits()
        } else {
            0
        }
    }

    /// `out[i]` = `x[i]` scaled where `keep[i]`, else 0.
    ///
    /// # Safety
    /// The CPU has AVX512F, BW and VL; `keep` is as long as `x`; `out` is valid for
    /// `x.len()` writes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn scale_kept(x: &[u16], keep: &[bool], scale: f64, out: *mut u16) {
        debug_assert_eq!(x.len(), keep.len());
        let s = _mm512_set1_pd(scale);
        let lanes = x.len() / 8 * 8;
        for i in (0..lanes).step_by(8) {
            // SAFETY: lanes i..i + 8 are inside `x`, `keep` and `out`.
            unsafe {
                let b = _mm_loadu_si128(x.as_ptr().add(i).cast());
                let f = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(b)));
                let product = _mm512_mul_pd(_mm512_cvtps_pd(f), s);
                let flags = _mm_loadl_epi64(keep.as_ptr().add(i).cast());
                let kept = _mm_cmpneq_epi8_mask(flags, _mm_setzero_si128()) as __mmask8;
                // Per lane the f64's top 32 bits: sign, exponent (11), mantissa (20).
                let top = _mm512_srli_epi64::<32>(_mm512_castpd_si512(product));
                let exp = _mm512_and_si512(_mm512_srli_epi64::<20>(top), _mm512_set1_epi64(0x7ff));
                // bf16's exponent exp - 896 in 1..=254: a normal bf16.
                let normal = _mm512_cmpge_epu64_mask(exp, _mm512_set1_epi64(897))
                    & _mm512_cmple_epu64_mask(exp, _mm512_set1_epi64(1150));
                if kept & !normal != 0 {
                    for j in i..i + 8 {
                        *out.add(j) = scalar(x[j], keep[j], scale);
                    }
                    continue;
                }
                let man = _mm512_and_si512(top, _mm512_set1_epi64(0xf_ffff));
                let sign =
                    _mm512_and_si512(_mm512_srli_epi64::<16>(top), _mm512_set1_epi64(0x8000));
                let biased = _mm512_slli_epi64::<7>(_mm512_sub_epi64(exp, _mm512_set1_epi64(896)));
                let r =
                    _mm512_or_si512(_mm512_or_si512(sign, biased), _mm512_srli_epi64::<13>(man));
                let up = _mm512_test_epi64_mask(man, _mm512_set1_epi64(0x1000))
                    & _mm512_test_epi64_mask(man, _mm512_set1_epi64(0x2fff));
                let r = _mm512_mask_add_epi64(r, up, r, _mm512_set1_epi64(1));
                let r = _mm512_maskz_mov_epi64(kept, r);
                _mm_storeu_si128(out.add(i).cast(), _mm512_cvtepi64_epi16(r));
            }
        }
        for j in lanes..x.len() {
            // SAFETY: j is inside `out`.
            unsafe { *out.add(j) = scalar(x[j], keep[j], scale) };
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Every bf16 value (zeros, subnormals, infinities, NaNs included), kept and
        /// dropped, at dropout's scales and at 1.25 and 1.5, whose products of odd
        /// significands fall exactly halfway (ties to even): the same bits as `from_f64`
        /// of the f64 product.
        #[test]
        fn the_vector_scaling_rounds_every_bf16_as_from_f64() {
            if !available() {
                skipped_optional!("this CPU has no AVX-512");
                return;
            }
            let x: Vec<u16> = (0..=u16::MAX).collect();
            let dropout = |p: f64| 1.0 / (1.0 - p);
            for (scale, pattern) in [
                (dropout(0.1), 7),
                (dropout(0.37), 5),
                (dropout(1e-7), 1),
                (1.25, 3),
                (1.5, 1),
                (2.0, 4),
            ] {
                let p = 1.0 - 1.0 / scale;
                let keep: Vec<bool> = (0..x.len()).map(|i| i % pattern != 1).collect();
                let mut out = vec![0u16; x.len()];
                // SAFETY: checked above; `out` is as long as `x`.
                unsafe { scale_kept(&x, &keep, scale, out.as_mut_ptr()) };
                for (i, (&got, (&b, &k))) in out.iter().zip(x.iter().zip(&keep)).enumerate() {
                    assert_eq!(
                        got,
                        scalar(b, k, scale),
                        "bf16 {b:#06x} (element {i}) at p {p}"
                    );
                }
            }
        }
    }
}

#[cfg(feature = "cuda")]
impl Dropout {
    /// The mask applied to `x` of `shape` on its GPU (forward, or backward on the output's
    /// gradient): the CPU's draws, so both drop the same elements.
    fn on_gpu(
        &self,
        x: Operand<'_>,
        shape: &Shape,
        dtype: candle_core::DType,
    ) -> Result<candle_core::CudaStorage> {
        use candle_core::backend::BackendDevice;
        let element = ElementShape::over(shape, dtype);
        let padded_rows = match &self.padded_rows {
            Some((rows, width)) if (rows.len(), *width) == (element.rows, element.d) => {
                Some(x.0.device().storage_from_slice(rows)?)
            }
            Some((rows, width)) => candle_core::bail!(
                "dropout_packed: {} rows of {} elements for {} packed rows of {width}",
                element.rows,
                element.d,
                rows.len()
            ),
            None => None,
        };
        let plan = element.dropout(self.p, self.seed, padded_rows.is_some())?;
        let y = Output::tensor(plan::Y, shape.elem_count());
        let mut inputs = vec![(plan::X, x)];
        if let Some(rows) = &padded_rows {
            inputs.push((plan::PADDED_ROWS, (rows, 0)));
        }
        let mut out = cuda_kernels::execute(dtype, &plan, &inputs, &[y])?;
        take_storage(&mut out, plan::Y)
    }
}

impl CustomOp1 for Dropout {
    fn name(&self) -> &'static str {
        "seeded-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s.dtype(), self.name(), T => {
            let x = contiguous::<T>(s, l, self.name())?;
            Ok((T::storage(self.apply(x)), l.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = self.on_gpu(device_operand(s, l, self.name())?, l.shape(), s.dtype())?;
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if grad.device().is_cuda() {
            let dx =
                cuda_kernels::gradient_by(grad, "dropout output gradient", arg.shape(), |g| {
                    self.on_gpu(g, arg.shape(), grad.dtype())
                })?;
            return Ok(Some(dx));
        }
        float_dispatch!(grad.dtype(), self.name(), T => {
            with_slice::<T, _>(grad, self.name(), |g| tensor(self.apply(g), arg.shape(), arg).map(Some))
        })
    }
}

/// Zeroes each element with probability `p` and scales the rest by `1/(1-p)`; the mask is
/// determined by `seed` (derive it from the run seed, rank, step and call site).
pub fn dropout(x: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        return Err(candle_core::Error::Msg(format!(
            "dropout probability {p} is not in [0, 1)"
        )));
    }
    if p == 0.0 {
        return Ok(x.clone());
    }
    if !super::has_kernels(x) && !super::has_cuda_kernels(x) {
        return super::composed::dropout(x, p, seed);
    }
    x.contiguous()?.apply_op1(Dropout {
        p,
        seed,
        padded_rows: None,
    })
}

/// [`dropout`] of packed rows `x` `[tokens, width]` that keeps the padded batch's mask: the
/// element of row `t` at column `j` is dropped as element `(padded_rows[t], j)` of the
/// padded `[batch * padded_len, width]` tensor would be.
pub fn dropout_packed(x: &Tensor, p: f64, seed: u64, seqs: &PackedSequences) -> Result<Tensor> {
    let (tokens, width) = x.dims2()?;
    if tokens != seqs.tokens() {
        candle_core::bail!(
            "dropout_packed: {tokens} rows for {} packed tokens",
            seqs.tokens()
        );
    }
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!("dropout probability {p} is not in [0, 1)");
    }
    if p == 0.0 {
        return Ok(x.clone());
    }
    if !super::has_kernels(x) && !super::has_cuda_kernels(x) {
        return super::composed::dropout_packed(x, p, seed, seqs);
    }
    x.contiguous()?.apply_op1(Dropout {
        p,
        seed,
        padded_rows: Some((seqs.shared_padded_rows(), width)),
    })
}

#[cfg(test)]
mod f32_tests {
    use super::super::Float;
    use super::scale_kept_portable;

    /// f32's vectorised [`Float::scale_kept`] gives the bits of the element-by-element one:
    /// values across every exponent (subnormals, zeros of both signs, infinities, NaNs),
    /// kept and dropped, at dropout's scales, appended after what `out` held.
    #[test]
    fn f32_scaling_in_vectors_is_the_element_by_element_one_bit_for_bit() {
        let x: Vec<f32> = (0..1u32 << 16)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9) ^ (i << 16)))
            .chain([
                0.0,
                -0.0,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                f32::MIN_POSITIVE / 3.0,
            ])
            .collect();
        for (p, pattern) in [(0.1, 7), (0.37, 5), (1e-7, 3)] {
            let scale = 1.0 / (1.0 - p);
            let keep: Vec<bool> = (0..x.len()).map(|i| i % pattern != 1).collect();
            let (mut got, mut want) = (vec![1.5f32; 3], vec![1.5f32; 3]);
            f32::scale_kept(&x, &keep, scale, &mut got);
            scale_kept_portable(&x, &keep, scale, &mut want);
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "element {i} at p {p}");
            }
        }
    }
}
