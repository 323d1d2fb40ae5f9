//! The CUDA kernels' plans run on the CPU emulator (`kernels/emulator`: each GPU thread an OS
//! thread, barriers and warp shuffles emulated) against the fused ops on the CPU: values and
//! every gradient, f32 within 1e-5 of each element's size and bf16 within 2e-2 (one rounding
//! of f32 arithmetic against one of f64). This checks the kernels' logic and the plans that
//! launch them; only a GPU shows that they run there (`every_op_on_a_gpu_matches_the_cpu`).
//! This file is the harness; each kernel family's tests are in a file of its own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Tensor, Var};

use crate::ops::{
    AttentionHeads, CrossEntropy, GeluApprox, Reduction, RopeLayout, RopeScaling, RopeTable,
};

use super::{
    AttentionShape, CrossEntropyShape, ElementShape, KernelArg, Launch, Nf4Shape, NormShape,
    RopeShape, attention_buffers, backward, cross_entropy_buffers, dropout, forward, gelu,
    quant_buffers, rope_buffers, swiglu,
};
use crate::ops;

use crate::numerics::{f64_values, per_element_error, rand};

/// The emulator's driver, built once for this test binary.
struct Emulator {
    dir: tempfile::TempDir,
    driver: PathBuf,
    runs: AtomicUsize,
}

/// The emulator, or `None` where no C++ compiler is installed (the calling test's skip
/// recorded).
fn emulator() -> Option<&'static Emulator> {
    static BUILT: OnceLock<Option<Emulator>> = OnceLock::new();
    let built = BUILT
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("a temporary folder");
            let driver = dir.path().join("driver");
            let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emulator/driver.cpp");
            let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
            let built = Command::new(&compiler)
                .args(["-std=c++20", "-O1", "-pthread", "-Wall", "-Werror"])
                .arg("-Wno-unknown-pragmas")
                .arg("-DFSDP_CUDA_EMULATOR")
                .arg(&source)
                .arg("-o")
                .arg(&driver)
                .output();
            match built {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => panic!("running {compiler}: {e}"),
                Ok(out) => {
                    assert!(
                        out.status.success(),
                        "building the kernel emulator failed:\n{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    Some(Emulator {
                        dir,
                        driver,
                        runs: AtomicUsize::new(0),
                    })
                }
            }
        })
        .as_ref();
    if built.is_none() {
        skipped!("no C++ compiler (c++, or $CXX) to build the CUDA kernel emulator");
    }
    built
}

impl Emulator {
    /// Runs `plan` over `buffers` (bytes by index; scratch buffers given as zeros) and
    /// returns them as the kernels left them.
    fn run(&self, plan: &[Launch], buffers: &BTreeMap<usize, Vec<u8>>) -> BTreeMap<usize, Vec<u8>> {
        let run = self.runs.fetch_add(1, Ordering::Relaxed);
        let dir = self.dir.path().join(format!("run{run}"));
        std::fs::create_dir(&dir).unwrap();
        let mut text = String::new();
        for (i, bytes) in buffers {
            std::fs::write(dir.join(format!("buf{i}.bin")), bytes).unwrap();
            text += &format!("buffer {i} {}\n", bytes.len());
        }
        for l in plan {
            let [gx, gy, gz] = l.grid;
            let [bx, by, bz] = l.block;
            text += &format!("launch {} {gx} {gy} {gz} {bx} {by} {bz}", l.kernel);
            for a in &l.args {
                text += &match a {
                    KernelArg::Buffer(i) => format!(" b{i}"),
                    KernelArg::Null => " null".to_string(),
                    KernelArg::Int(v) => format!(" i{v}"),
                    KernelArg::Long(v) => format!(" l{v}"),
                    KernelArg::U64(v) => format!(" u{v}"),
                    KernelArg::Float(v) => format!(" f{:08x}", v.to_bits()),
                };
            }
            text += "\n";
        }
        let plan_file = dir.join("plan");
        std::fs::write(&plan_file, text).unwrap();
        let out = Command::new(&self.driver)
            .arg(&plan_file)
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the emulated kernels failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        buffers
            .keys()
            .map(|i| (*i, std::fs::read(dir.join(format!("buf{i}.out"))).unwrap()))
            .collect()
    }
}

/// A tensor's elements as the bytes a kernel reads (f32 or bf16, little-endian).
fn bytes(t: &Tensor) -> Vec<u8> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        other => panic!("no kernel buffers of {other:?}"),
    }
}

/// A kernel's output bytes as f64 values.
fn values(bytes: &[u8], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64())
            .collect(),
        other => panic!("no kernel buffers of {other:?}"),
    }
}

/// The CPU op `f` at `inputs`: its output and each input's gradient for the upstream
/// gradient `grad` (zeros for an input `f` does not use). bf16 inputs are computed in f32
/// (exactly their values): a bf16 kernel is held to the result its inputs have, not to the
/// CPU's own bf16 roundings, which differ from a GPU's in where they round.
fn on_the_cpu(
    f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[&Tensor],
    grad: &Tensor,
) -> (Tensor, Vec<Tensor>) {
    let widened = |t: &Tensor| match t.dtype() {
        DType::BF16 => t.to_dtype(DType::F32).unwrap(),
        _ => t.clone(),
    };
    let grad = &widened(grad);
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&widened(t)).unwrap())
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&tensors).unwrap();
    let grads = (&y * grad).unwrap().sum_all().unwrap().backward().unwrap();
    let of = |v: &Var| match grads.get(v.as_tensor()) {
        Some(g) => g.clone(),
        None => v.as_tensor().zeros_like().unwrap(),
    };
    (y, vars.iter().map(of).collect())
}

/// The buffers of one plan: inputs from tensors, outputs and scratch filled with `0x7f` bytes
/// (an element a kernel never writes, or reads before writing, shows as garbage).
#[derive(Default)]
struct Buffers(BTreeMap<usize, Vec<u8>>);

impl Buffers {
    fn input(mut self, index: usize, t: &Tensor) -> Self {
        self.0.insert(index, bytes(t));
        self
    }

    fn output(mut self, index: usize, elements: usize, dtype: DType) -> Self {
        self.0
            .insert(index, vec![0x7f; elements * dtype.size_in_bytes()]);
        self
    }

    /// u32 values (little-endian), as index buffers are read.
    fn u32s(mut self, index: usize, values: &[u32]) -> Self {
        self.0
            .insert(index, values.iter().flat_map(|v| v.to_le_bytes()).collect());
        self
    }

    /// f32 scratch the plan writes before it reads it, garbage too.
    fn scratch(mut self, index: usize, f32s: usize) -> Self {
        self.0.insert(index, vec![0x7f; f32s * 4]);
        self
    }
}

/// Holds a kernel's output bytes of `dtype` to the CPU op's tensor: f32 within 1e-5 of each
/// element's size, bf16 within 2e-2.
fn assert_close(case: &str, what: &str, got: &[u8], dtype: DType, want: &Tensor) {
    let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
    let err = per_element_error(&values(got, dtype), &f64_values(want));
    assert!(err < tol, "{case}: {what} off by {err:e} (tol {tol:e})");
}

mod attention;
mod cross_entropy;
mod elementwise;
mod embedding;
mod norm;
mod quant;
mod softmax;
