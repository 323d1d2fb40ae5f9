//! Which GEMM bf16 products run in on this CPU: the dot-product kernel (AMX tiles, or
//! AVX512_BF16's `vdpbf16ps`) where the CPU has one, unless this core retires the f32
//! multiply-add clearly faster than the bf16 dot product — some Intel cores run `vdpbf16ps` at
//! half the f32 multiply-adds' FLOPs, and there the f32 GEMM on widened operands is 1.6-1.9x
//! the dot-product kernel. Decided once per process from the two instructions' own rates
//! (registers only, so the choice holds under other work on the machine); `FSDP_BF16_GEMM`
//! (`auto`, `dot`, `f32`) pins it. Both sum in f32 and round once; the order of the sums differs.

use std::sync::OnceLock;
use std::time::Instant;

use super::bf16_gemm;

/// Environment variable pinning the bf16 GEMM: `auto` (the default), `dot` or `f32`.
pub const BF16_GEMM_ENV: &str = "FSDP_BF16_GEMM";

/// The widened f32 GEMM is taken only when the multiply-add retires at least this many times
/// the dot product's FLOPs (widening the operands costs some; a stable choice where close).
const CLEARLY_FASTER: f64 = 1.3;

/// The bf16 GEMM this process runs, and why.
#[derive(Debug, Clone, PartialEq)]
pub enum Bf16Gemm {
    /// The dot-product kernel (the CPU has AVX512_BF16 or AMX).
    DotProducts {
        /// One core's GFLOP/s in (`vdpbf16ps`, the f32 multiply-add), when they were compared.
        measured: Option<(f64, f64)>,
    },
    /// The f32 GEMM on widened operands.
    Widened {
        /// One core's GFLOP/s in (`vdpbf16ps`, the f32 multiply-add), when they were compared.
        measured: Option<(f64, f64)>,
    },
}

impl Bf16Gemm {
    /// Whether products run in the dot-product kernel.
    pub fn dot_products(&self) -> bool {
        matches!(self, Bf16Gemm::DotProducts { .. })
    }

    /// One core's GFLOP/s in (`vdpbf16ps`, the f32 multiply-add), when they were compared.
    pub fn measured(&self) -> Option<(f64, f64)> {
        match self {
            Bf16Gemm::DotProducts { measured } | Bf16Gemm::Widened { measured } => *measured,
        }
    }
}

/// This process's bf16 GEMM, decided on first use.
pub(super) fn choice() -> &'static Bf16Gemm {
    static CHOICE: OnceLock<Bf16Gemm> = OnceLock::new();
    CHOICE.get_or_init(|| {
        let pinned = std::env::var(BF16_GEMM_ENV).unwrap_or_default();
        decide(
            pinned.trim(),
            bf16_gemm::available(),
            bf16_gemm::amx::ready(),
            measure,
        )
    })
}

/// The choice for `pinned` (the variable's value), whether the CPU has dot products and AMX
/// tiles ready, with `measure` timing both kernels when it comes to that.
fn decide(
    pinned: &str,
    available: bool,
    amx: bool,
    measure: impl FnOnce() -> (f64, f64),
) -> Bf16Gemm {
    match (pinned, available) {
        (_, false) | ("f32", _) => Bf16Gemm::Widened { measured: None },
        ("dot", true) => Bf16Gemm::DotProducts { measured: None },
        // AMX tiles compute many times the vector units' FLOPs.
        (_, true) if amx => Bf16Gemm::DotProducts { measured: None },
        (_, true) => {
            let (dot, widened) = measure();
            let measured = Some((dot, widened));
            if widened >= CLEARLY_FASTER * dot {
                Bf16Gemm::Widened { measured }
            } else {
                Bf16Gemm::DotProducts { measured }
            }
        }
    }
}

/// One core's GFLOP/s in `vdpbf16ps` and in the f32 multiply-add (`vfmadd231ps` on zmm),
/// each the best of five runs of 4 M instructions, the two alternating.
fn measure() -> (f64, f64) {
    const TRIPS: usize = 1 << 18;
    let time = |run: &dyn Fn()| {
        let t = Instant::now();
        run();
        t.elapsed().as_secs_f64().max(1e-9)
    };
    let (mut dot, mut fma) = (f64::MAX, f64::MAX);
    #[cfg(target_arch = "x86_64")]
    for _ in 0..5 {
        // SAFETY: only measured where the CPU has AVX512F and AVX512_BF16 (`available`).
        dot = dot.min(time(&|| unsafe {
            super::instruction_loops::dpbf16_zmm(TRIPS);
        }));
        // SAFETY: as above.
        fma = fma.min(time(&|| unsafe {
            super::instruction_loops::fma_zmm(TRIPS);
        }));
    }
    // 16 instructions a trip: 64 FLOP each for the dot product, 32 for the multiply-add.
    let rate = |secs: f64, flops: f64| 16.0 * TRIPS as f64 * flops / secs / 1e9;
    (rate(dot, 64.0), rate(fma, 32.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dot_products_run_unless_pinned_or_measured_clearly_slower() {
        let never = || -> (f64, f64) { panic!("measured when nothing is to decide") };
        let widened = |measured| Bf16Gemm::Widened { measured };
        let dot = |measured| Bf16Gemm::DotProducts { measured };
        // No dot products on the CPU: widened, whatever is asked.
        assert_eq!(decide("dot", false, false, never), widened(None));
        // Pinned, or AMX tiles ready: no measurement.
        assert_eq!(decide("f32", true, false, never), widened(None));
        assert_eq!(decide("dot", true, false, never), dot(None));
        assert_eq!(decide("", true, true, never), dot(None));
        // Measured: widened only when the multiply-add is 1.3x as fast (a core retiring
        // `vdpbf16ps` at half rate), the dot products when close or faster.
        assert_eq!(
            decide("auto", true, false, || (90.0, 150.0)),
            widened(Some((90.0, 150.0)))
        );
        assert_eq!(
            decide("", true, false, || (100.0, 120.0)),
            dot(Some((100.0, 120.0)))
        );
        assert_eq!(
            decide("", true, false, || (180.0, 150.0)),
            dot(Some((180.0, 150.0)))
        );
    }

    #[test]
    fn the_measurement_times_both_instructions_where_the_cpu_has_dot_products() {
        if !bf16_gemm::available() {
            skipped_optional!("this CPU has no AVX512_BF16 to compare");
            return;
        }
        let (dot, widened) = measure();
        assert!(dot > 0.1 && widened > 0.1, "{dot} {widened}");
    }
}
