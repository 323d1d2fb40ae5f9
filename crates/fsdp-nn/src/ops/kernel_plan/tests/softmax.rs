//! Softmax on the emulator.

use super::*;
use crate::ops::kernel_plan::{SoftmaxShape, softmax_buffers};

/// Softmax forward and backward on the emulator against the CPU op, rows narrower than a
/// warp and wider than a block's threads, large logits included (the row's maximum is
/// subtracted first).
#[test]
fn softmax_kernels_on_the_emulator_match_the_cpu_op() {
    let Some(emulator) = emulator() else {
        return;
    };
    for (rows, d) in [(6, 17), (3, 300)] {
        for dtype in [DType::F32, DType::BF16] {
            let case = format!("softmax, {rows} x {d}, {dtype:?}");
            let x = rand(&[rows, d], 1, 30.0, dtype);
            let grad = rand(&[rows, d], 2, 1.0, dtype);
            let (y, grads) = on_the_cpu(|t| ops::softmax_last_dim(&t[0]), &[&x], &grad);
            let shape = SoftmaxShape { rows, d, dtype };
            let buffers = Buffers::default().input(softmax_buffers::X, &x).output(
                softmax_buffers::Y,
                rows * d,
                dtype,
            );
            let out = emulator.run(&shape.forward().unwrap(), &buffers.0);
            assert_close(&case, "output", &out[&softmax_buffers::Y], dtype, &y);
            // Backward reads the output as the op keeps it: in the tensor's type.
            let y_kept = y.to_dtype(dtype).unwrap();
            let buffers = Buffers::default()
                .input(softmax_buffers::Y, &y_kept)
                .input(softmax_buffers::GRAD, &grad)
                .output(softmax_buffers::DX, rows * d, dtype);
            let out = emulator.run(&shape.backward().unwrap(), &buffers.0);
            assert_close(
                &case,
                "input gradient",
                &out[&softmax_buffers::DX],
                dtype,
                &grads[0],
            );
        }
    }
}
