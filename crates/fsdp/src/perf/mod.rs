//! Model FLOPs utilisation (MFU): how much of the CPU's arithmetic a training run uses. The
//! peak is measured, not taken from a data sheet: the best rate of the engine's own GEMM
//! (`ops::linear`, which every projection runs) on one thread, in f32 and in bf16, over a few
//! square sizes. It is measured once per CPU and kept in `fsdp_home()/core_peak.json`.
//!
//! The FLOPs a run did are counted by the model's shape ([`crate::models::TransformerShape`]).

mod instructions;

#[doc(hidden)] // `fsdp env` and `fsdp bench gemm`
pub use instructions::{InstructionPeak, instruction_peak};

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

/// The measured peak of one core.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CorePeak {
    /// The CPU it was measured on (`model name` and the SIMD features that decide the
    /// kernels), so a cache from another machine is not used.
    pub cpu: String,
    /// f32 FLOP/s of one thread.
    pub f32: f64,
    /// bf16 FLOP/s of one thread (bf16 inputs, f32 sums).
    pub bf16: f64,
    /// The f32 multiply-add limit of the core ([`instruction_peak`]): what the silicon
    /// allows, which `f32` reaches a share of.
    pub f32_instruction: f64,
    /// The bf16 dot-product limit of the core ([`instruction_peak`]; f32's where bf16
    /// computes through f32).
    pub bf16_instruction: f64,
    /// The share of the machine's CPU time other work took while this was measured (0: an
    /// idle machine). A peak measured under load reads low and overstates MFU: it is used
    /// for the run that measured it but not cached.
    #[serde(default)]
    pub others_busy: f64,
}

/// Above this share of the machine busy with other work, a measured peak is not cached.
pub(crate) const BUSY_LIMIT: f64 = 0.25;

/// The machine's CPU time so far from `/proc/stat`: (busy, total) in clock ticks.
fn cpu_times() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().take(8).sum();
    // idle and iowait.
    let idle = fields.get(3)? + fields.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// The share of `cpus` CPUs' time between two [`cpu_times`] samples that was busy beyond
/// one thread of ours.
fn others_busy(before: (u64, u64), after: (u64, u64), cpus: usize) -> f64 {
    let total = after.1.saturating_sub(before.1);
    if total == 0 {
        return 0.0;
    }
    let busy = after.0.saturating_sub(before.0) as f64 / total as f64;
    (busy - 1.0 / cpus.max(1) as f64).max(0.0)
}

impl CorePeak {
    /// Whether other work took more than a quarter of the machine while this was
    /// measured: such a peak reads low, is not cached, and is labelled wherever it is shown.
    pub fn measured_under_load(&self) -> bool {
        self.others_busy > BUSY_LIMIT
    }

    /// The peak of `dtype`'s GEMM (bf16 for bf16 and f16 compute, f32 otherwise).
    pub fn for_dtype(&self, dtype: DType) -> f64 {
        match dtype {
            DType::BF16 | DType::F16 => self.bf16,
            _ => self.f32,
        }
    }

    /// The instruction limit for `dtype` (as [`CorePeak::for_dtype`]).
    pub fn instruction_for_dtype(&self, dtype: DType) -> f64 {
        match dtype {
            DType::BF16 | DType::F16 => self.bf16_instruction,
            _ => self.f32_instruction,
        }
    }
}

/// The GEMM kernels' revision in the cache's key: bumped when a kernel changes, so a peak
/// measured with an older, slower kernel on the same CPU is measured again.
const KERNELS_REVISION: u32 = 2;

/// This CPU (and the kernels' revision) as the cache keys it.
fn this_cpu() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("model name")?
                    .split_once(':')
                    .map(|(_, m)| m.trim().to_string())
            })
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!(
        "{model}; f32: {}; bf16: {}; kernels revision {KERNELS_REVISION}",
        crate::nn::ops::f32_matmul_kernel(),
        crate::nn::ops::bf16_matmul_kernel()
    )
}

/// The peak of one core: from the cache when it was measured on this CPU, else measured now
/// (a few seconds) and cached if the machine was idle enough (other work under a quarter of it; a cache that
/// cannot be written is only a lost shortcut).
pub fn core_peak() -> CorePeak {
    // Once per process: a peak measured under load (not cached) is not measured again.
    static PEAK: std::sync::OnceLock<CorePeak> = std::sync::OnceLock::new();
    PEAK.get_or_init(|| core_peak_cached_in(&crate::config::fsdp_home()))
        .clone()
}

/// Measures the peak again, whatever is cached (`fsdp env --remeasure_peak`), and caches it
/// when the machine was idle enough; returns it.
#[doc(hidden)] // `fsdp env --remeasure_peak`
pub fn remeasure_core_peak() -> CorePeak {
    let peak = measure_core_peak();
    cache_if_idle(&crate::config::fsdp_home(), &peak);
    peak
}

/// Writes `peak` to `dir`'s cache unless other work took more than [`BUSY_LIMIT`] of the
/// machine while it was measured. Whether it was cached.
fn cache_if_idle(dir: &std::path::Path, peak: &CorePeak) -> bool {
    if peak.measured_under_load() {
        // Every MFU line and `fsdp env` say so; this is for a caller that prints neither.
        tracing::debug!(
            "the core peak was measured while other work took {:.0}% of the machine: used for this run, not cached (`fsdp env --remeasure_peak` on an idle machine caches one)",
            100.0 * peak.others_busy
        );
        return false;
    }
    let file = dir.join("core_peak.json");
    if std::fs::create_dir_all(dir).is_ok()
        && let Ok(bytes) = serde_json::to_vec_pretty(peak)
    {
        let partial = file.with_extension("json.partial");
        if std::fs::write(&partial, bytes).is_ok() {
            return std::fs::rename(&partial, &file).is_ok();
        }
    }
    false
}

/// [`core_peak`] with its cache in `dir`.
fn core_peak_cached_in(dir: &std::path::Path) -> CorePeak {
    let file = dir.join("core_peak.json");
    let cpu = this_cpu();
    let cached = std::fs::read(&file)
        .ok()
        .and_then(|b| serde_json::from_slice::<CorePeak>(&b).ok())
        .filter(|p| {
            p.cpu == cpu
                && [p.f32, p.bf16, p.f32_instruction, p.bf16_instruction]
                    .iter()
                    .all(|&v| v > 0.0)
        });
    if let Some(peak) = cached {
        return peak;
    }
    let peak = measure_core_peak();
    cache_if_idle(dir, &peak);
    peak
}

/// Measures the peak now, on one thread: the best of several runs of `ops::linear` on square
/// matrices of 256, 512 and 1024, and the instructions' limit.
pub(crate) fn measure_core_peak() -> CorePeak {
    let before = cpu_times();
    let rate = |dtype: DType| -> f64 {
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build();
        let run = || {
            let mut best = 0f64;
            for n in [256usize, 512, 1024] {
                let make = |seed: f64| {
                    Tensor::arange(0u32, (n * n) as u32, &Device::Cpu)
                        .and_then(|t| t.to_dtype(DType::F32))
                        .and_then(|t| ((t * (1e-6 * seed))?.sin()?).reshape((n, n)))
                        .and_then(|t| t.to_dtype(dtype))
                };
                let (Ok(x), Ok(w), Ok(b)) =
                    (make(1.0), make(2.0), Tensor::zeros(n, dtype, &Device::Cpu))
                else {
                    continue;
                };
                let reps = if n >= 1024 { 3 } else { 6 };
                for _ in 0..reps + 1 {
                    let t = Instant::now();
                    if crate::nn::ops::linear(&x, &w, &b).is_err() {
                        break;
                    }
                    let secs = t.elapsed().as_secs_f64();
                    best = best.max(2.0 * (n * n * n) as f64 / secs.max(1e-9));
                }
            }
            // Whole FLOP/s: the cache's JSON holds them exactly.
            best.round()
        };
        match one {
            Ok(pool) => pool.install(run),
            Err(_) => run(),
        }
    };
    let limit = instruction_peak();
    let (f32, bf16) = (rate(DType::F32), rate(DType::BF16));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let others_busy = match (before, cpu_times()) {
        (Some(b), Some(a)) => others_busy(b, a, cpus),
        _ => 0.0,
    };
    peak_of(this_cpu(), (f32, bf16), &limit, others_busy)
}

/// The peak from the GEMMs' rates `(f32, bf16)` and the instructions' `limit`. The
/// hardware's limit is never below a rate a GEMM reached (a lower reading means the
/// instruction loop was measured while other work had the core), and bf16's never below
/// f32's (bf16 can compute through f32).
fn peak_of(cpu: String, (f32, bf16): (f64, f64), limit: &InstructionPeak, busy: f64) -> CorePeak {
    let f32_instruction = limit.f32.max(f32);
    CorePeak {
        cpu,
        f32,
        bf16,
        f32_instruction,
        bf16_instruction: limit.bf16.max(bf16).max(f32_instruction),
        others_busy: busy,
    }
}

/// What a run reports: FLOP/s over the cores it ran on, and MFU against their peak.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Utilisation {
    /// Model FLOPs per second (all processes).
    pub flops_per_second: f64,
    /// Those FLOPs as a share of the cores' peak (0..1).
    pub mfu: f64,
}

/// `flops` done in `seconds` on `cores` cores of peak `per_core` FLOP/s each.
pub fn utilisation(flops: f64, seconds: f64, cores: usize, per_core: f64) -> Utilisation {
    let flops_per_second = flops / seconds.max(1e-9);
    Utilisation {
        flops_per_second,
        mfu: flops_per_second / (cores.max(1) as f64 * per_core.max(1e-9)),
    }
}

/// The dtype a run's matrix products compute in under `mixed_precision`.
pub fn compute_dtype(mixed_precision: crate::config::MixedPrecision) -> DType {
    match mixed_precision {
        crate::config::MixedPrecision::Bf16 => DType::BF16,
        crate::config::MixedPrecision::Fp16 => DType::F16,
        crate::config::MixedPrecision::No => DType::F32,
    }
}

/// The cores this job computes on: its processes times each one's compute threads.
pub fn job_cores(processes: usize) -> usize {
    processes * candle_core::utils::get_num_threads()
}

/// One line for a run's log: model FLOP/s and MFU of `real` FLOPs (and of `padded` ones,
/// when the batches were padded) done in `seconds` on `cores` cores computing in `dtype`,
/// against this CPU's measured [`core_peak`]. The peak is looked up (measured, the first
/// time on a CPU) only when the line is displayed, so ranks that do not print it
/// (`Accelerator::print`) measure nothing and compete with nobody.
pub fn mfu_line(
    real: f64,
    padded: Option<f64>,
    seconds: f64,
    cores: usize,
    dtype: DType,
) -> MfuLine {
    MfuLine {
        real,
        padded,
        seconds,
        cores,
        dtype,
    }
}

/// A run's MFU line ([`mfu_line`]), formatted when displayed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MfuLine {
    real: f64,
    padded: Option<f64>,
    seconds: f64,
    cores: usize,
    dtype: DType,
}

impl MfuLine {
    /// Whether a training step was timed: a run that trained none (resumed at its end,
    /// `--max_train_steps 0`) has no rate, and no peak is looked up for it.
    fn timed(&self) -> bool {
        self.real > 0.0 && self.seconds > 0.0
    }

    /// The line against `peak` (what `Display` writes against [`core_peak`]).
    fn against(&self, peak: &CorePeak) -> String {
        let Self {
            real,
            padded,
            seconds,
            cores,
            dtype,
        } = *self;
        let per_core = peak.for_dtype(dtype);
        let real = utilisation(real, seconds, cores, per_core);
        let padded = padded
            .map(|p| {
                let p = utilisation(p, seconds, cores, per_core);
                format!(
                    "; padded: {:.1} GFLOP/s, MFU {:.1}%",
                    p.flops_per_second / 1e9,
                    100.0 * p.mfu
                )
            })
            .unwrap_or_default();
        // A peak measured under load reads low: say so instead of setting it beside the
        // instructions' limit, which was measured under the same load.
        let source = if peak.measured_under_load() {
            format!(
                "measured while other work took {:.0}% of the machine, so it reads low and the MFU high; `fsdp env --remeasure_peak` on an idle machine",
                100.0 * peak.others_busy
            )
        } else {
            let limit = peak.instruction_for_dtype(dtype);
            format!(
                "measured; {:.1}% of the instructions' {:.1}",
                100.0 * utilisation(self.real, seconds, cores, limit).mfu,
                limit / 1e9
            )
        };
        format!(
            "model FLOPs {:.1} GFLOP/s, MFU {:.1}% of {cores} core(s) at {:.1} GFLOP/s ({dtype:?} peak {source}){padded}",
            real.flops_per_second / 1e9,
            100.0 * real.mfu,
            per_core / 1e9,
        )
    }
}

impl std::fmt::Display for MfuLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A run without a timed step printed `model FLOPs -0.0 GFLOP/s, MFU -0.0%`.
        if !self.timed() {
            return f.write_str("model FLOPs: none (no training step was timed)");
        }
        f.write_str(&self.against(&core_peak()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_without_a_timed_step_has_no_rate() {
        for (flops, secs) in [(0.0, 0.0), (0.0, 1.5), (-0.0, 2.0), (1e9, 0.0)] {
            let line = mfu_line(flops, None, secs, 2, DType::F32).to_string();
            assert_eq!(line, "model FLOPs: none (no training step was timed)");
        }
    }

    #[test]
    fn an_mfu_line_says_when_its_peak_was_measured_under_load() {
        let limit = InstructionPeak {
            f32: 200e9,
            f32_instruction: "vfmadd",
            bf16: 400e9,
            bf16_instruction: "vdpbf16ps",
        };
        let line = mfu_line(100e9, Some(200e9), 1.0, 2, DType::F32);
        let quiet = line.against(&peak_of("cpu".into(), (100e9, 150e9), &limit, 0.1));
        assert_eq!(
            quiet,
            "model FLOPs 100.0 GFLOP/s, MFU 50.0% of 2 core(s) at 100.0 GFLOP/s (F32 peak measured; 25.0% of the instructions' 200.0); padded: 200.0 GFLOP/s, MFU 100.0%"
        );
        let busy = line.against(&peak_of("cpu".into(), (50e9, 75e9), &limit, 0.49));
        assert_eq!(
            busy,
            "model FLOPs 100.0 GFLOP/s, MFU 100.0% of 2 core(s) at 50.0 GFLOP/s (F32 peak measured while other work took 49% of the machine, so it reads low and the MFU high; `fsdp env --remeasure_peak` on an idle machine); padded: 200.0 GFLOP/s, MFU 200.0%"
        );
    }

    #[test]
    fn the_hardware_limit_is_never_below_a_measured_gemm_rate() {
        let limit = InstructionPeak {
            f32: 62.1e9,
            f32_instruction: "vfmadd",
            bf16: 50e9,
            bf16_instruction: "vdpbf16ps",
        };
        // A busy machine: the instruction loop read below the GEMM (issue 52: 62.1 under an
        // 88.1 GFLOP/s GEMM) and bf16's below f32's.
        let p = peak_of("cpu".into(), (88.1e9, 70e9), &limit, 0.6);
        assert_eq!((p.f32_instruction, p.bf16_instruction), (88.1e9, 88.1e9));
        let quiet = peak_of("cpu".into(), (88.1e9, 150e9), &limit, 0.0);
        assert_eq!(
            (quiet.f32_instruction, quiet.bf16_instruction),
            (88.1e9, 150e9)
        );
    }

    #[test]
    fn utilisation_is_flops_per_second_over_the_cores_peak() {
        let u = utilisation(4e9, 2.0, 2, 1e9);
        assert_eq!((u.flops_per_second, u.mfu), (2e9, 1.0));
    }

    #[test]
    fn the_peak_is_measured_once_per_cpu_and_cached_when_idle() {
        let home = tempfile::tempdir().unwrap();
        let file = home.path().join("core_peak.json");
        let peak = |cpu: &str, others_busy: f64| CorePeak {
            cpu: cpu.into(),
            f32: 1.5e9,
            bf16: 3e9,
            f32_instruction: 2e9,
            bf16_instruction: 4e9,
            others_busy,
        };
        // Measured under load: not cached; idle: cached, and read back instead of measured.
        assert!(!cache_if_idle(home.path(), &peak(&this_cpu(), 0.6)));
        assert!(!file.exists());
        assert!(cache_if_idle(home.path(), &peak(&this_cpu(), 0.1)));
        assert_eq!(core_peak_cached_in(home.path()), peak(&this_cpu(), 0.1));
        // Another CPU's cache (or one without the instruction peaks) is measured over.
        for stale in [
            peak("another CPU", 0.0),
            CorePeak {
                f32_instruction: 0.0,
                ..peak(&this_cpu(), 0.0)
            },
        ] {
            std::fs::write(&file, serde_json::to_vec(&stale).unwrap()).unwrap();
            let measured = core_peak_cached_in(home.path());
            assert_eq!(measured.cpu, this_cpu());
            assert!(measured.f32 > 1e8 && measured.bf16 > 1e8, "{measured:?}");
            assert!(measured.f32_instruction > 1e8 && measured.bf16_instruction > 1e8);
            assert!((0.0..=1.0).contains(&measured.others_busy), "{measured:?}");
        }
    }

    #[test]
    fn other_work_is_the_busy_share_beyond_one_thread() {
        // 4 CPUs, 100 ticks: 25 busy is our one thread alone; 75 busy is half the machine
        // taken by others.
        assert_eq!(others_busy((0, 0), (25, 100), 4), 0.0);
        assert_eq!(others_busy((10, 100), (85, 200), 4), 0.5);
        assert_eq!(others_busy((0, 0), (0, 0), 4), 0.0);
        let (busy, total) = cpu_times().expect("/proc/stat");
        assert!(busy <= total && total > 0);
    }
}
