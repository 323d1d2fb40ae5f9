//! The cross-entropy kernels on the emulator.

use super::*;

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
