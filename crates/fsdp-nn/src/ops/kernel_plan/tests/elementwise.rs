//! The element-wise kernels on the emulator: SwiGLU, GELU, dropout, rope.

use super::*;

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
/// scales the rest as it does; backward applies the same mask to the gradient. Packed rows
/// (`dropout_packed`: sequences of 3, 5 and 1 tokens out of a padded batch of 6) draw the
/// padded batch's mask, as on the CPU.
#[test]
fn dropout_kernel_on_the_emulator_drops_what_the_cpu_op_drops() {
    let Some(emulator) = emulator() else {
        return;
    };
    let seqs = ops::PackedSequences::from_lengths(&[3, 5, 1], 6).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        for (p, seed, packed) in [(0.1, 7, false), (0.5, 12345, false), (0.3, 99, true)] {
            let case = format!("dropout {p}, seed {seed}, packed {packed}, {dtype:?}");
            let rows = if packed { seqs.tokens() } else { 37 };
            let x = rand(&[rows, 29], seed, 2.0, dtype);
            let grad = rand(&[rows, 29], seed + 1, 1.0, dtype);
            let (y, grads) = on_the_cpu(
                |t| match packed {
                    true => ops::dropout_packed(&t[0], p, seed, &seqs),
                    false => ops::dropout(&t[0], p, seed),
                },
                &[&x],
                &grad,
            );
            let shape = ElementShape::over(x.shape(), dtype);
            let plan = shape.dropout(p, seed, packed).unwrap();
            let run = |input: &Tensor| {
                let mut buffers = Buffers::default().input(dropout::X, input).output(
                    dropout::Y,
                    x.elem_count(),
                    dtype,
                );
                if packed {
                    buffers = buffers.u32s(dropout::PADDED_ROWS, seqs.padded_rows());
                }
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
