//! The hardware's own limit for the arithmetic the GEMMs use: how many FLOP/s one core's
//! widest multiply-add instruction retires when nothing else stands in its way (independent
//! accumulators in registers, no memory traffic). A GEMM's rate over this is the share of the
//! silicon it uses; the engine-GEMM peak ([`super::CorePeak`]) says instead what the engine
//! reaches at best.

use std::time::Instant;

use candle_core::DType;

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
                best(&|| unsafe { x86::fma_zmm() }, 32.0),
                "vfmadd (AVX-512, 16 f32 lanes)",
            );
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA.
            return (
                best(&|| unsafe { x86::fma_ymm() }, 16.0),
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
                best(&|| unsafe { x86::dpbf16_zmm() }, 64.0),
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::TRIPS;

    /// `CHAINS` (16) independent multiply-adds into zmm0-15 per trip, `TRIPS` trips: the
    /// loop is written out so no register spills or moves stand between the instructions.
    macro_rules! chains {
        ($name:ident, $features:literal, $insn:literal, $zero:literal, $($reg:literal),*) => {
            /// # Safety
            /// The CPU has the features this function is compiled with.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name() -> f32 {
                let one = std::hint::black_box(0x3f80_3f80u32);
                // SAFETY: only registers are touched, all declared clobbered.
                unsafe {
                    std::arch::asm!(
                        "vmovd xmm16, {one:e}",
                        "vpbroadcastd zmm16, xmm16",
                        $(concat!($zero, " ", $reg, ", ", $reg, ", ", $reg),)*
                        "2:",
                        $(concat!($insn, " ", $reg, ", zmm16, zmm16"),)*
                        "dec {n}",
                        "jnz 2b",
                        one = in(reg) one,
                        n = inout(reg) TRIPS => _,
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                        out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                        out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                        out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                        out("zmm16") _,
                        options(nostack, nomem),
                    );
                }
                0.0
            }
        };
    }

    chains!(
        fma_zmm,
        "avx512f",
        "vfmadd231ps",
        "vpxord",
        "zmm0",
        "zmm1",
        "zmm2",
        "zmm3",
        "zmm4",
        "zmm5",
        "zmm6",
        "zmm7",
        "zmm8",
        "zmm9",
        "zmm10",
        "zmm11",
        "zmm12",
        "zmm13",
        "zmm14",
        "zmm15"
    );
    chains!(
        dpbf16_zmm,
        "avx512f,avx512bf16",
        "vdpbf16ps",
        "vpxord",
        "zmm0",
        "zmm1",
        "zmm2",
        "zmm3",
        "zmm4",
        "zmm5",
        "zmm6",
        "zmm7",
        "zmm8",
        "zmm9",
        "zmm10",
        "zmm11",
        "zmm12",
        "zmm13",
        "zmm14",
        "zmm15"
    );

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma_ymm() -> f32 {
        let one = std::hint::black_box(0x3f80_0000u32);
        // SAFETY: only registers are touched, all declared clobbered.
        unsafe {
            std::arch::asm!(
                "vmovd xmm15, {one:e}",
                "vbroadcastss ymm15, xmm15",
                "vxorps ymm0, ymm0, ymm0", "vxorps ymm1, ymm1, ymm1", "vxorps ymm2, ymm2, ymm2",
                "vxorps ymm3, ymm3, ymm3", "vxorps ymm4, ymm4, ymm4", "vxorps ymm5, ymm5, ymm5",
                "vxorps ymm6, ymm6, ymm6", "vxorps ymm7, ymm7, ymm7", "vxorps ymm8, ymm8, ymm8",
                "vxorps ymm9, ymm9, ymm9", "vxorps ymm10, ymm10, ymm10", "vxorps ymm11, ymm11, ymm11",
                "2:",
                "vfmadd231ps ymm0, ymm15, ymm15", "vfmadd231ps ymm1, ymm15, ymm15",
                "vfmadd231ps ymm2, ymm15, ymm15", "vfmadd231ps ymm3, ymm15, ymm15",
                "vfmadd231ps ymm4, ymm15, ymm15", "vfmadd231ps ymm5, ymm15, ymm15",
                "vfmadd231ps ymm6, ymm15, ymm15", "vfmadd231ps ymm7, ymm15, ymm15",
                "vfmadd231ps ymm8, ymm15, ymm15", "vfmadd231ps ymm9, ymm15, ymm15",
                "vfmadd231ps ymm10, ymm15, ymm15", "vfmadd231ps ymm11, ymm15, ymm15",
                "vfmadd231ps ymm0, ymm15, ymm15", "vfmadd231ps ymm1, ymm15, ymm15",
                "vfmadd231ps ymm2, ymm15, ymm15", "vfmadd231ps ymm3, ymm15, ymm15",
                "dec {n}",
                "jnz 2b",
                one = in(reg) one,
                n = inout(reg) TRIPS => _,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm15") _,
                options(nostack, nomem),
            );
        }
        0.0
    }
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
