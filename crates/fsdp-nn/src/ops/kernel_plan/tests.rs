//! The CUDA kernels' plans run on the CPU emulator (`kernels/emulator`: each GPU thread an OS
//! thread, barriers and warp shuffles emulated) against the fused ops on the CPU: values and
//! every gradient, f32 within 1e-5 of each element's size and bf16 within 2e-2 (one rounding
//! of f32 arithmetic against one of f64). This checks the kernels' logic and the plans that
//! launch them; only a GPU shows that they run there (`every_op_on_a_gpu_matches_the_cpu`).

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

/// Which norm a case runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Norm {
    Layer,
    AddLayer,
    Rms,
}

/// One norm on `[rows, d]` in `dtype`: the emulated kernels' output and gradients against
/// the CPU op's.
fn check_norm(emulator: &Emulator, norm: Norm, rows: usize, d: usize, dtype: DType) {
    let case = format!("{norm:?} norm, {rows} x {d}, {dtype:?}");
    let seed = (rows * 1000 + d) as u64;
    let t = |shape: &[usize], s: u64, scale: f64| rand(shape, seed + s, scale, dtype);
    // An offset mean, as activations have, so the variance is not a sum of squares alone.
    let x = (t(&[rows, d], 1, 2.0) + 0.75).unwrap();
    let residual = t(&[rows, d], 2, 1.0);
    let gamma = (t(&[d], 3, 0.5) + 1.0).unwrap();
    let beta = t(&[d], 4, 0.5);
    let grad = t(&[rows, d], 5, 1.0);
    let eps = if norm == Norm::Rms { 1e-6 } else { 1e-5 };
    let (y, grads) = on_the_cpu(
        |t| match norm {
            Norm::Layer => ops::layer_norm(&t[0], &t[2], &t[3], eps),
            Norm::AddLayer => ops::add_layer_norm(&t[0], &t[1], &t[2], &t[3], eps),
            Norm::Rms => ops::rms_norm(&t[0], &t[2], eps),
        },
        &[&x, &residual, &gamma, &beta],
        &grad,
    );

    let shape = NormShape {
        rows,
        d,
        dtype,
        center: norm != Norm::Rms,
        residual: norm == Norm::AddLayer,
        beta: norm != Norm::Rms,
        eps,
    };
    let with_inputs = |b: Buffers, (x_at, residual_at, gamma_at): (usize, usize, usize)| {
        let b = b.input(x_at, &x).input(gamma_at, &gamma);
        if shape.residual {
            b.input(residual_at, &residual)
        } else {
            b
        }
    };

    use forward as f;
    let mut buffers = with_inputs(Buffers::default(), (f::X, f::RESIDUAL, f::GAMMA)).output(
        f::Y,
        rows * d,
        dtype,
    );
    if shape.beta {
        buffers = buffers.input(f::BETA, &beta);
    }
    let out = emulator.run(&shape.forward().unwrap(), &buffers.0);
    assert_close(&case, "output", &out[&f::Y], dtype, &y);

    use backward as b;
    let mut buffers = with_inputs(Buffers::default(), (b::X, b::RESIDUAL, b::GAMMA))
        .input(b::GRAD, &grad)
        .output(b::DX, rows * d, dtype)
        .scratch(b::ROW_STATS, 2 * rows)
        .scratch(b::PARTIALS, 2 * shape.chunks() * d)
        .output(b::DGAMMA, d, dtype);
    if shape.beta {
        buffers = buffers.output(b::DBETA, d, dtype);
    }
    let out = emulator.run(&shape.backward().unwrap(), &buffers.0);
    assert_close(&case, "input gradient", &out[&b::DX], dtype, &grads[0]);
    if shape.residual {
        assert_close(&case, "residual gradient", &out[&b::DX], dtype, &grads[1]);
    }
    assert_close(&case, "scale gradient", &out[&b::DGAMMA], dtype, &grads[2]);
    if shape.beta {
        assert_close(&case, "shift gradient", &out[&b::DBETA], dtype, &grads[3]);
    }
}

/// Every norm kernel on shapes that cover one warp with idle lanes (d 16), several warps
/// (40, 300: each thread two elements, the last warp partly idle), many chunks of rows for
/// the parameter gradients (130 rows), in f32 and bf16.
#[test]
fn norm_kernels_on_the_emulator_match_the_cpu_ops() {
    let Some(emulator) = emulator() else {
        return;
    };
    for dtype in [DType::F32, DType::BF16] {
        for norm in [Norm::Layer, Norm::AddLayer, Norm::Rms] {
            for (rows, d) in [(3, 16), (5, 40), (4, 300), (130, 24)] {
                check_norm(emulator, norm, rows, d, dtype);
            }
        }
    }
}

/// SwiGLU, GELU and `bias_gelu` (both forms) on `[rows, d]` in `dtype`: the emulated
/// kernels against the CPU ops, values and every gradient.
fn check_activations(emulator: &Emulator, rows: usize, d: usize, dtype: DType) {
    let seed = (rows * 1000 + d) as u64;
    let t = |shape: &[usize], s: u64, scale: f64| rand(shape, seed + s, scale, dtype);
    let (a, b, bias, grad) = (
        t(&[rows, d], 1, 4.0),
        t(&[rows, d], 2, 2.0),
        t(&[d], 3, 1.0),
        t(&[rows, d], 4, 1.0),
    );
    let shape = ElementShape::over(a.shape(), dtype);
    assert_eq!((shape.rows, shape.d), (rows, d));
    let n = rows * d;

    let case = format!("swiglu, {rows} x {d}, {dtype:?}");
    let (y, grads) = on_the_cpu(|t| ops::swiglu(&t[0], &t[1]), &[&a, &b], &grad);
    let inputs = Buffers::default()
        .input(swiglu::GATE, &a)
        .input(swiglu::UP, &b);
    let out = emulator.run(
        &shape.swiglu_forward().unwrap(),
        &inputs.output(swiglu::Y, n, dtype).0,
    );
    assert_close(&case, "output", &out[&swiglu::Y], dtype, &y);
    let inputs = Buffers::default()
        .input(swiglu::GATE, &a)
        .input(swiglu::UP, &b);
    let buffers = inputs
        .input(swiglu::Y, &grad)
        .output(swiglu::DGATE, n, dtype)
        .output(swiglu::DUP, n, dtype);
    let out = emulator.run(&shape.swiglu_backward().unwrap(), &buffers.0);
    assert_close(
        &case,
        "gate gradient",
        &out[&swiglu::DGATE],
        dtype,
        &grads[0],
    );
    assert_close(&case, "up gradient", &out[&swiglu::DUP], dtype, &grads[1]);

    for approx in [GeluApprox::Erf, GeluApprox::Tanh] {
        let tanh = approx == GeluApprox::Tanh;
        for with_bias in [false, true] {
            let case = format!("gelu {approx:?}, bias {with_bias}, {rows} x {d}, {dtype:?}");
            let (y, grads) = on_the_cpu(
                |t| {
                    if with_bias {
                        ops::bias_gelu(&t[0], &t[1], approx)
                    } else {
                        ops::gelu(&t[0], approx)
                    }
                },
                &[&a, &bias],
                &grad,
            );
            let inputs = || {
                let b = Buffers::default().input(gelu::X, &a);
                if with_bias {
                    b.input(gelu::BIAS, &bias)
                } else {
                    b
                }
            };
            let plan = shape.gelu_forward(with_bias, tanh).unwrap();
            let out = emulator.run(&plan, &inputs().output(gelu::Y, n, dtype).0);
            assert_close(&case, "output", &out[&gelu::Y], dtype, &y);
            let buffers = inputs()
                .input(gelu::Y, &grad)
                .output(gelu::DX, n, dtype)
                .scratch(gelu::PARTIALS, shape.chunks() * d)
                .output(gelu::DBIAS, d, dtype);
            let out = emulator.run(&shape.gelu_backward(with_bias, tanh).unwrap(), &buffers.0);
            assert_close(&case, "input gradient", &out[&gelu::DX], dtype, &grads[0]);
            if with_bias {
                assert_close(&case, "bias gradient", &out[&gelu::DBIAS], dtype, &grads[1]);
            }
        }
    }
}

/// Dropout on the emulator drops exactly the elements the CPU op drops (its draws), and
/// scales the rest as it does; backward applies the same mask to the gradient.
#[test]
fn dropout_kernel_on_the_emulator_drops_what_the_cpu_op_drops() {
    let Some(emulator) = emulator() else {
        return;
    };
    for dtype in [DType::F32, DType::BF16] {
        for (p, seed) in [(0.1, 7), (0.5, 12345)] {
            let case = format!("dropout {p}, seed {seed}, {dtype:?}");
            let x = rand(&[37, 29], seed, 2.0, dtype);
            let grad = rand(&[37, 29], seed + 1, 1.0, dtype);
            let (y, grads) = on_the_cpu(|t| ops::dropout(&t[0], p, seed), &[&x], &grad);
            let shape = ElementShape::over(x.shape(), dtype);
            let plan = shape.dropout(p, seed).unwrap();
            let run = |input: &Tensor| {
                let buffers = Buffers::default().input(dropout::X, input).output(
                    dropout::Y,
                    x.elem_count(),
                    dtype,
                );
                emulator.run(&plan, &buffers.0)[&dropout::Y].clone()
            };
            let out = run(&x);
            assert_close(&case, "output", &out, dtype, &y);
            let zeros = |v: &[f64]| v.iter().map(|e| *e == 0.0).collect::<Vec<_>>();
            assert_eq!(
                zeros(&values(&out, dtype)),
                zeros(&f64_values(&y)),
                "{case}: masks differ"
            );
            assert_close(&case, "gradient", &run(&grad), dtype, &grads[0]);
        }
    }
}

/// The activation kernels on one row of a few elements (a grid with idle threads), and on
/// more rows than one chunk of the bias gradient's sums, in f32 and bf16.
#[test]
fn activation_kernels_on_the_emulator_match_the_cpu_ops() {
    let Some(emulator) = emulator() else {
        return;
    };
    for dtype in [DType::F32, DType::BF16] {
        for (rows, d) in [(1, 7), (130, 24)] {
            check_activations(emulator, rows, d, dtype);
        }
    }
}

/// Rope in both layouts, with positions shared by the batch and per sequence (Llama 3.1's
/// scaled frequencies), in f32 and bf16: the emulated kernel against the CPU op, values and
/// gradient.
#[test]
fn rope_kernel_on_the_emulator_matches_the_cpu_op() {
    let Some(emulator) = emulator() else {
        return;
    };
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 32.0,
    };
    let table = RopeTable::new(16, 500000.0, Some(scaling)).unwrap();
    let (batch, heads, seq, head_dim) = (2, 3, 5, 16);
    let shared: Vec<u32> = (0..5).collect();
    let per_sequence: Vec<u32> = (0..5).chain(40..45).collect();
    let f32_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    for dtype in [DType::F32, DType::BF16] {
        for layout in [RopeLayout::HeadsFirst, RopeLayout::SeqFirst] {
            for positions in [&shared, &per_sequence] {
                let case = format!("rope {layout:?}, {} positions, {dtype:?}", positions.len());
                let angles = table.angles_at(positions);
                let dims = match layout {
                    RopeLayout::HeadsFirst => [batch, heads, seq, head_dim],
                    RopeLayout::SeqFirst => [batch, seq, heads, head_dim],
                };
                let x = rand(&dims, 1, 2.0, dtype);
                let grad = rand(&dims, 2, 1.0, dtype);
                let (y, grads) =
                    on_the_cpu(|t| ops::rope_with(&t[0], &angles, layout), &[&x], &grad);
                let shape = RopeShape {
                    batch,
                    heads,
                    seq,
                    head_dim,
                    dtype,
                    per_batch: positions.len() != seq,
                    seq_first: layout == RopeLayout::SeqFirst,
                };
                let (cos, sin, _) = angles.parts();
                let run = |input: &Tensor, backward: bool| {
                    let mut buffers = Buffers::default().input(rope_buffers::X, input).output(
                        rope_buffers::Y,
                        x.elem_count(),
                        dtype,
                    );
                    buffers.0.insert(rope_buffers::COS, f32_bytes(cos));
                    buffers.0.insert(rope_buffers::SIN, f32_bytes(sin));
                    let out = emulator.run(&shape.plan(backward).unwrap(), &buffers.0);
                    out[&rope_buffers::Y].clone()
                };
                assert_close(&case, "output", &run(&x, false), dtype, &y);
                assert_close(&case, "gradient", &run(&grad, true), dtype, &grads[0]);
            }
        }
    }
}

/// One attention case: `heads` over `[batch, seq]`, optionally causal, with a padding mask
/// hiding the last `masked` keys of the second sequence, q, k, v read in place from one fused
/// `[batch, seq, 3 * width]` projection (`fused`, equal head counts) or given apart, and
/// optionally dropout.
struct AttentionCase {
    batch: usize,
    seq: usize,
    heads: AttentionHeads,
    head_dim: usize,
    masked: usize,
    fused: bool,
    /// Dropout on the probabilities, `(probability, seed)`.
    dropout: Option<(f64, u64)>,
}

fn check_attention(emulator: &Emulator, c: &AttentionCase, dtype: DType) {
    use attention_buffers as ab;
    let AttentionCase {
        batch,
        seq,
        heads,
        head_dim,
        masked,
        fused,
        dropout,
    } = *c;
    let case = format!(
        "attention {heads:?}, {batch} x {seq}, head_dim {head_dim}, {masked} masked, fused {fused}, dropout {dropout:?}, {dtype:?}"
    );
    let (qw, kw) = (heads.heads * head_dim, heads.kv_heads * head_dim);
    let seed = (seq * 100 + head_dim) as u64;
    let t = |shape: &[usize], s: u64| rand(shape, seed + s, 1.5, dtype);
    let mask = (masked > 0).then(|| {
        let mut m = vec![0f32; batch * seq];
        for key in seq - masked..seq {
            m[seq + key] = -1e4;
        }
        Tensor::from_vec(m, (batch, 1, 1, seq), &candle_core::Device::Cpu).unwrap()
    });
    let grad = t(&[batch, seq, qw], 9);
    // The CPU op and its gradients: of q, k and v, or of the fused projection.
    let (inputs, (y, grads)) = if fused {
        let qkv = t(&[batch, seq, 3 * qw], 1);
        let cpu = on_the_cpu(
            |t| ops::packed_attention(&t[0], heads.heads, heads.causal, mask.as_ref(), dropout),
            &[&qkv],
            &grad,
        );
        (vec![qkv], cpu)
    } else {
        let (q, k, v) = (
            t(&[batch, seq, qw], 1),
            t(&[batch, seq, kw], 2),
            t(&[batch, seq, kw], 3),
        );
        let cpu = on_the_cpu(
            |t| ops::grouped_query_attention(&t[0], &t[1], &t[2], heads, mask.as_ref(), dropout),
            &[&q, &k, &v],
            &grad,
        );
        (vec![q, k, v], cpu)
    };
    // Operand bytes and strides: the fused projection's rows hold q, k, v side by side, each
    // bound at its own offset (as a GPU pointer into a view would be).
    let size = dtype.size_in_bytes();
    let (operands, strides): (Vec<Vec<u8>>, Vec<(usize, usize)>) = if fused {
        let all = bytes(&inputs[0]);
        let at = |part: usize| all[part * qw * size..].to_vec();
        (vec![at(0), at(1), at(2)], vec![(seq * 3 * qw, 3 * qw); 3])
    } else {
        (
            inputs.iter().map(bytes).collect(),
            vec![(seq * qw, qw), (seq * kw, kw), (seq * kw, kw)],
        )
    };
    let shape = AttentionShape {
        batch,
        seq,
        heads: heads.heads,
        kv_heads: heads.kv_heads,
        head_dim,
        dtype,
        causal: heads.causal,
        scale: 1.0 / (head_dim as f64).sqrt(),
        q: strides[0],
        k: strides[1],
        v: strides[2],
        mask: mask.as_ref().map(|_| [batch, 1, 1, seq]),
        dropout,
        tiled: false,
    };
    let mut buffers = Buffers::default();
    for (index, data) in [ab::Q, ab::K, ab::V].into_iter().zip(operands) {
        buffers.0.insert(index, data);
    }
    if let Some(m) = &mask {
        buffers = buffers.input(ab::MASK, m);
    }
    // Heads of 64 take the tiled kernels (as on a GPU); the others the row kernels.
    let shape = AttentionShape {
        tiled: head_dim == 64,
        ..shape
    };
    let case = format!("{case}, tiled {}", shape.tiled);
    run_attention(emulator, &case, &shape, buffers, (&y, &grads, &grad), fused);
}

/// One attention plan on the emulator against the CPU op's output and gradients.
fn run_attention(
    emulator: &Emulator,
    case: &str,
    shape: &AttentionShape,
    buffers: Buffers,
    (y, grads, grad): (&Tensor, &[Tensor], &Tensor),
    fused: bool,
) {
    use attention_buffers as ab;
    let AttentionShape {
        batch,
        seq,
        dtype,
        head_dim,
        ..
    } = *shape;
    let (qw, kw) = (shape.heads * head_dim, shape.kv_heads * head_dim);
    let rows = batch * shape.heads * seq;
    let forward_buffers = Buffers(buffers.0.clone())
        .output(ab::OUT, batch * seq * qw, dtype)
        .scratch(ab::LSE, rows);
    let out = emulator.run(&shape.forward().unwrap(), &forward_buffers.0);
    assert_close(case, "output", &out[&ab::OUT], dtype, y);

    let mut backward_buffers = buffers
        .input(ab::DOUT, grad)
        .scratch(ab::DELTA, rows)
        .output(ab::DQ, batch * seq * qw, dtype)
        .output(ab::DK, batch * seq * kw, dtype)
        .output(ab::DV, batch * seq * kw, dtype);
    backward_buffers.0.insert(ab::OUT, out[&ab::OUT].clone());
    backward_buffers.0.insert(ab::LSE, out[&ab::LSE].clone());
    let plan = shape.backward((seq * qw, qw), (seq * kw, kw)).unwrap();
    let out = emulator.run(&plan, &backward_buffers.0);
    let want: Vec<Tensor> = if fused {
        (0..3)
            .map(|i| grads[0].narrow(2, i * qw, qw).unwrap())
            .collect()
    } else {
        grads.to_vec()
    };
    for (i, (index, name)) in [(ab::DQ, "q"), (ab::DK, "k"), (ab::DV, "v")]
        .into_iter()
        .enumerate()
    {
        assert_close(
            case,
            &format!("{name} gradient"),
            &out[&index],
            dtype,
            &want[i],
        );
    }
}

/// Attention on the emulator against the CPU op, values and the three gradients, in f32 and
/// bf16: multi-head, grouped-query 4:2 causal with heads wider than a warp (40: two elements
/// a lane, some lanes idle) and a last block of rows half full, multi-query with a padding
/// mask, q, k, v read in place from a fused projection, causal and masked, and dropout; heads
/// of 64 on the tiled kernels too.
#[test]
fn attention_kernels_on_the_emulator_match_the_cpu_op() {
    let Some(emulator) = emulator() else {
        return;
    };
    let gqa = |heads, kv_heads, causal| AttentionHeads {
        heads,
        kv_heads,
        causal,
    };
    let case = |batch, seq, heads, head_dim, masked, fused, dropout| AttentionCase {
        batch,
        seq,
        heads,
        head_dim,
        masked,
        fused,
        dropout,
    };
    let cases = [
        case(2, 6, gqa(2, 2, false), 8, 0, false, None),
        case(1, 9, gqa(4, 2, true), 40, 0, false, None),
        case(2, 5, gqa(4, 1, false), 16, 2, false, None),
        case(2, 7, gqa(2, 2, true), 12, 3, true, None),
        // Dropout draws the CPU's masks: grouped-query causal, and fused with a mask.
        case(2, 9, gqa(4, 2, true), 40, 0, false, Some((0.25, 17))),
        case(2, 7, gqa(2, 2, false), 12, 3, true, Some((0.5, 3))),
        // Heads of 64 run the tiled kernels: several tiles of rows and keys, the last ones
        // partial, causal grouped-query, fused with a mask and dropout.
        case(1, 70, gqa(2, 1, true), 64, 0, false, None),
        case(2, 37, gqa(1, 1, true), 64, 4, true, Some((0.2, 9))),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for c in &cases {
            check_attention(emulator, c, dtype);
        }
    }
}

/// Cross-entropy on the emulator against the CPU op: the loss and the logits' gradient, with
/// ignored targets, label smoothing, mean and sum, rows narrower and wider than a block's
/// threads, in f32 and bf16 logits.
#[test]
fn cross_entropy_kernels_on_the_emulator_match_the_cpu_op() {
    use cross_entropy_buffers as cb;
    let Some(emulator) = emulator() else {
        return;
    };
    for dtype in [DType::F32, DType::BF16] {
        for (rows, classes) in [(6, 40), (5, 300)] {
            for (label_smoothing, reduction) in [(0.0, Reduction::Mean), (0.1, Reduction::Sum)] {
                let case = format!(
                    "cross_entropy {rows} x {classes}, smoothing {label_smoothing}, {reduction:?}, {dtype:?}"
                );
                let logits = rand(&[rows, classes], (rows * classes) as u64, 4.0, dtype);
                // Every third row ignored.
                let targets: Vec<i64> = (0..rows)
                    .map(|r| {
                        if r % 3 == 1 {
                            -100
                        } else {
                            ((r * 37) % classes) as i64
                        }
                    })
                    .collect();
                let t = Tensor::new(targets.as_slice(), &candle_core::Device::Cpu).unwrap();
                let settings = CrossEntropy {
                    ignore_index: -100,
                    label_smoothing,
                    reduction,
                };
                let one = Tensor::new(1f32, &candle_core::Device::Cpu).unwrap();
                let (loss, grads) = on_the_cpu(
                    |x| ops::cross_entropy(&x[0], &t, settings),
                    &[&logits],
                    &one,
                );
                let counted = targets.iter().filter(|&&v| v != -100).count() as f64;
                let scale = match reduction {
                    Reduction::Mean => 1.0 / counted,
                    Reduction::Sum => 1.0,
                };
                let shape = CrossEntropyShape {
                    rows,
                    classes,
                    dtype,
                    ignore_index: -100,
                    label_smoothing,
                };
                let inputs = || {
                    let mut b = Buffers::default().input(cb::LOGITS, &logits);
                    b.0.insert(
                        cb::TARGETS,
                        targets.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    );
                    b
                };
                let forward_buffers = inputs()
                    .scratch(cb::LOSS_ROWS, rows)
                    .scratch(cb::LSE, rows)
                    .scratch(cb::LOSS, 1);
                let out = emulator.run(&shape.forward(scale).unwrap(), &forward_buffers.0);
                assert_close(
                    &case,
                    "loss",
                    &out[&cb::LOSS],
                    DType::F32,
                    &loss.reshape(1).unwrap(),
                );
                let mut backward_buffers = inputs().output(cb::DLOGITS, rows * classes, dtype);
                backward_buffers.0.insert(cb::LSE, out[&cb::LSE].clone());
                let out = emulator.run(&shape.backward(scale).unwrap(), &backward_buffers.0);
                assert_close(
                    &case,
                    "logits gradient",
                    &out[&cb::DLOGITS],
                    dtype,
                    &grads[0],
                );
            }
        }
    }
}

/// NF4 dequantization on the emulator gives the CPU's weight bit for bit (each element one
/// f32 product of a level and its block's absmax), over rows of several blocks.
#[test]
fn nf4_dequantize_kernel_on_the_emulator_gives_the_cpus_weight() {
    use crate::quant::{Packing, QuantFormat};
    let Some(emulator) = emulator() else {
        return;
    };
    let (rows, cols) = (7, 192);
    let packing = Packing::new("w", QuantFormat::Nf4, cols).unwrap();
    let weight: Vec<f32> = f64_values(&rand(&[rows, cols], 3, 2.0, DType::F32))
        .into_iter()
        .map(|v| v as f32)
        .collect();
    let words = packing.quantize(&weight);
    let want = packing.dequantize(&words).unwrap();
    let shape = Nf4Shape {
        rows,
        cols,
        row_words: packing.row_words(),
    };
    let mut buffers = Buffers::default().output(quant_buffers::OUT, rows * cols, DType::F32);
    let word_bytes = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    buffers.0.insert(quant_buffers::WORDS, word_bytes);
    let out = emulator.run(&shape.dequantize().unwrap(), &buffers.0);
    let got: Vec<f32> = values(&out[&quant_buffers::OUT], DType::F32)
        .into_iter()
        .map(|v| v as f32)
        .collect();
    assert_eq!(got, want);
    let ragged = Nf4Shape { cols: 100, ..shape };
    assert!(
        ragged
            .dequantize()
            .unwrap_err()
            .to_string()
            .contains("whole NF4 blocks")
    );
}

/// Attention's plans: heads of 64 on the tiled kernels (64 rows a block, the key pass 32) unless
/// `FSDP_CUDA_ATTENTION=rows`, other heads on the row kernels (4 warps a block); heads past
/// 256, uneven groups and tiled kernels for other head sizes refused by name.
#[test]
fn attention_plans_pick_the_kernels_their_heads_fit() {
    let rows_asked = std::env::var("FSDP_CUDA_ATTENTION").as_deref() == Ok("rows");
    assert_eq!(AttentionShape::tiles(64), !rows_asked);
    assert!(!AttentionShape::tiles(40) && !AttentionShape::tiles(128));
    let shape = AttentionShape {
        batch: 2,
        seq: 100,
        heads: 6,
        kv_heads: 2,
        head_dim: 64,
        dtype: DType::BF16,
        causal: true,
        scale: 0.125,
        q: (100 * 384, 384),
        k: (100 * 128, 128),
        v: (100 * 128, 128),
        mask: None,
        dropout: None,
        tiled: true,
    };
    let plan = shape.backward((100 * 384, 384), (100 * 128, 128)).unwrap();
    let geometry: Vec<(&str, [u32; 3], [u32; 3])> = plan
        .iter()
        .map(|l| (l.kernel.as_str(), l.grid, l.block))
        .collect();
    assert_eq!(
        geometry,
        [
            (
                "fsdp_attention_backward_queries64_bf16",
                [2, 6, 2],
                [64, 1, 1]
            ),
            ("fsdp_attention_backward_keys64_bf16", [4, 2, 2], [32, 1, 1]),
        ]
    );
    let rows = AttentionShape {
        tiled: false,
        ..shape
    };
    let forward = rows.forward().unwrap();
    assert_eq!(forward[0].kernel, "fsdp_attention_forward_bf16");
    assert_eq!(
        (forward[0].grid, forward[0].block),
        ([25, 6, 2], [128, 1, 1])
    );
    let e = AttentionShape {
        head_dim: 40,
        ..shape
    }
    .forward()
    .unwrap_err()
    .to_string();
    assert!(e.contains("tiled kernels take heads of 64"), "{e}");
    let wide = AttentionShape {
        head_dim: 300,
        tiled: false,
        ..shape
    };
    assert!(wide.forward().unwrap_err().to_string().contains("1..=256"));
    let uneven = AttentionShape {
        kv_heads: 4,
        ..shape
    };
    assert!(uneven.forward().unwrap_err().to_string().contains("evenly"));
}

/// The plans: one block per row with whole warps covering the row once (at most 256
/// threads); the parameter gradients' two passes over the columns; optional inputs null;
/// nothing launched for an empty tensor; types without kernels and counts past 32 bits
/// refused by name.
#[test]
fn norm_plans_launch_what_the_kernels_expect() {
    let shape = NormShape {
        rows: 200,
        d: 600,
        dtype: DType::BF16,
        center: false,
        residual: false,
        beta: false,
        eps: 1e-6,
    };
    let fwd = shape.forward().unwrap();
    assert_eq!(fwd.len(), 1);
    assert_eq!(fwd[0].kernel, "fsdp_norm_forward_bf16");
    assert_eq!((fwd[0].grid, fwd[0].block), ([200, 1, 1], [256, 1, 1]));
    assert_eq!(fwd[0].args[1], KernelArg::Null);
    assert_eq!(fwd[0].args[3], KernelArg::Null);
    assert_eq!(fwd[0].args[7], KernelArg::Int(0));
    let bwd = shape.backward().unwrap();
    let names: Vec<&str> = bwd.iter().map(|l| l.kernel.as_str()).collect();
    assert_eq!(
        names,
        [
            "fsdp_norm_backward_rows_bf16",
            "fsdp_norm_param_partials_bf16",
            "fsdp_norm_param_totals_bf16"
        ]
    );
    assert_eq!(shape.chunks(), 4);
    assert_eq!(bwd[1].grid, [3, 4, 1]);
    assert_eq!(bwd[2].grid, [3, 1, 1]);
    assert_eq!(bwd[2].args[2], KernelArg::Null);
    let small = NormShape { d: 20, ..shape };
    assert_eq!(small.forward().unwrap()[0].block, [32, 1, 1]);

    let empty = NormShape { rows: 0, ..shape };
    assert!(empty.forward().unwrap().is_empty() && empty.backward().unwrap().is_empty());
    let f16 = NormShape {
        dtype: DType::F16,
        ..shape
    };
    let e = f16.forward().unwrap_err().to_string();
    assert!(e.contains("forward") && e.contains("F16"), "{e}");
    let huge = NormShape {
        rows: 1 << 31,
        ..shape
    };
    let e = huge.backward().unwrap_err().to_string();
    assert!(e.contains("32-bit"), "{e}");
}
