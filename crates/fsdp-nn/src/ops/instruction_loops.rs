//! One core's widest multiply-add instructions, back to back into independent registers
//! (`CHAINS` = 16 per loop trip, nothing loaded): what the hardware retires at best, timed by
//! `fsdp`'s instruction peak and by the choice of the bf16 GEMM ([`super::bf16_gemm_choice`]).
//! x86-64 only; each function needs the CPU features it is compiled with.

/// 16 independent multiply-adds into zmm0-15 per trip, `trips` trips (at least one): the
/// loop is written out so no register spills or moves stand between the instructions.
macro_rules! chains {
    ($name:ident, $features:literal, $insn:literal) => {
        chains!(
            @registers $name, $features, $insn,
            "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7",
            "zmm8", "zmm9", "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "zmm15"
        );
    };
    (@registers $name:ident, $features:literal, $insn:literal, $($reg:literal),*) => {
        /// # Safety
        /// The CPU has the features this function is compiled with.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(trips: usize) -> f32 {
            let (one, trips) = (std::hint::black_box(0x3f80_3f80u32), trips.max(1));
            // SAFETY: only registers are touched, all declared clobbered.
            unsafe {
                std::arch::asm!(
                    "vmovd xmm16, {one:e}",
                    "vpbroadcastd zmm16, xmm16",
                    $(concat!("vpxord ", $reg, ", ", $reg, ", ", $reg),)*
                    "2:",
                    $(concat!($insn, " ", $reg, ", zmm16, zmm16"),)*
                    "dec {n}",
                    "jnz 2b",
                    one = in(reg) one,
                    n = inout(reg) trips => _,
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

chains!(fma_zmm, "avx512f", "vfmadd231ps");
chains!(dpbf16_zmm, "avx512f,avx512bf16", "vdpbf16ps");

/// 16 multiply-adds into 12 ymm registers per trip (AVX2 has 16 registers), `trips` trips
/// (at least one).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn fma_ymm(trips: usize) -> f32 {
    let (one, trips) = (std::hint::black_box(0x3f80_0000u32), trips.max(1));
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
            n = inout(reg) trips => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm15") _,
            options(nostack, nomem),
        );
    }
    0.0
}
