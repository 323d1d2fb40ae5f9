//! LayerNorm and RMSNorm kernels on the emulator, and their plans.

use super::*;

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
