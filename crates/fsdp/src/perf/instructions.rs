//! The hardware's own limit for the arithmetic the GEMMs use: how many FLOP/s one core's
//! widest multiply-add instruction retires when nothing else stands in its way (independent
//! accumulators in registers, no memory traffic). A GEMM's rate over this is the share of the
//! silicon it uses; the engine-GEMM peak ([`super::CorePeak`]) says instead what the engine
//! reaches at best.

use std::time::Instant;

use candle_core::DType;

#[cfg(target_arch = "x86_64")]
use crate::nn::ops::instruction_loops as loops;

/// One core's measured multiply-add limit, per compute dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct InstructionPeak {
    /// f32 FLOP/s of the widest fused multiply-add.
    pub f32: f64,
    /// The instruction measured for f32.
    pub f32_instruction: &'static str,
    /// bf16 FLOP/s (bf16 inputs, f32 sums): the bf16 dot product where the CPU has one that
    /// outruns the f32 multiply-add, the f32 multiply-add otherwise (bf16 then computes
    /// through f32 at best).
    pub bf16: f64,
    /// The instruction measured for bf16.
    pub bf16_instruction: &'static str,
}

impl InstructionPeak {
    /// The limit for `dtype`'s GEMM (bf16 for bf16 and f16 compute, f32 otherwise).
    pub fn for_dtype(&self, dtype: DType) -> f64 {
        match dtype {
            DType::BF16 | DType::F16 => self.bf16,
            _ => self.f32,
        }
    }
}

/// Instructions per loop trip, into independent accumulators (the AVX2 loop reuses four of
/// its twelve): more chains than any core's latency times its throughput.
const CHAINS: usize = 16;
/// Loop trips per timed run (16 M instructions: a few milliseconds).
const TRIPS: usize = 1 << 20;

/// Measures this core's limit now, on the calling thread (best of a few runs).
pub fn instruction_peak() -> InstructionPeak {
    let best = |run: &dyn Fn() -> f32, flops_per_instruction: f64| {
        let mut best = 0f64;
        for _ in 0..6 {
            let t = Instant::now();
            std::hint::black_box(run());
            let secs = t.elapsed().as_secs_f64().max(1e-9);
            best = best.max((CHAINS * TRIPS) as f64 * flops_per_instruction / secs);
        }
        best.round()
    };
    let (f32_rate, f32_instruction) = f32_peak(&best);
    // A bf16 GEMM may compute through either instruction: its limit is the faster one (on
    // some Intel cores the bf16 dot product retires fewer FLOPs than the f32 multiply-add).
    let (bf16, bf16_instruction) = bf16_peak(&best)
        .filter(|(rate, _)| *rate >= f32_rate)
        .unwrap_or((f32_rate, f32_instruction));
    InstructionPeak {
        f32: f32_rate,
        f32_instruction,
        bf16,
        bf16_instruction,
    }
}

type Timer<'a> = dyn Fn(&dyn Fn() -> f32, f64) -> f64 + 'a;

fn f32_peak(best: &Timer) -> (f64, &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX512F.
            return (
                best(&|| unsafe { loops::fma_zmm(TRIPS) }, 32.0),
                "vfmadd (AVX-512, 16 f32 lanes)",
            );
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA.
            return (
                best(&|| unsafe { loops::fma_ymm(TRIPS) }, 16.0),
                "vfmadd (AVX2, 8 f32 lanes)",
            );
        }
    }
    (best(&scalar_fma, 2.0), "scalar f32 multiply-add")
}

fn bf16_peak(best: &Timer) -> Option<(f64, &'static str)> {
    // 16 tdpbf16ps of 16,384 FLOP each per trip: TRIPS / 16 trips is TRIPS instructions.
    if *crate::nn::ops::amx_support() == crate::nn::ops::AmxSupport::Ready {
        return Some((
            best(
                &|| {
                    crate::nn::ops::amx_peak_loop(TRIPS / 16);
                    0.0
                },
                16_384.0 / CHAINS as f64,
            ),
            "tdpbf16ps (AMX-BF16, 16x16x32 tiles)",
        ));
    }
    #[cfg(target_arch = "x86_64")]
    {
        if crate::nn::ops::bf16_dot_products_available() {
            // SAFETY: the CPU has AVX512F and AVX512_BF16.
            return Some((
                best(&|| unsafe { loops::dpbf16_zmm(TRIPS) }, 64.0),
                "vdpbf16ps (AVX512_BF16, 32 bf16 pairs)",
            ));
        }
    }
    let _ = best;
    None
}

fn scalar_fma() -> f32 {
    let (a, b) = (
        std::hint::black_box(1.000_000_1f32),
        std::hint::black_box(0.999_999f32),
    );
    let mut acc = [0f32; CHAINS];
    for _ in 0..TRIPS {
        for x in &mut acc {
            *x = x.mul_add(a, b);
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_instruction_peak_is_positive_and_bf16_is_at_least_f32() {
        let p = instruction_peak();
        assert!(p.f32 > 1e9, "{p:?}");
        // bf16 computes through the faster of the bf16 dot product and the f32 multiply-add
        // (AMD's Zen 4/5 retire vdpbf16ps at 1-2x the multiply-adds' FLOPs, a 2-core Intel
        // Xeon of family 6, model 207 at 0.5x): never below f32's limit.
        assert!(p.bf16 >= p.f32, "{p:?}");
        if p.bf16_instruction == p.f32_instruction {
            assert_eq!(p.bf16, p.f32, "{p:?}");
        }
    }
}
