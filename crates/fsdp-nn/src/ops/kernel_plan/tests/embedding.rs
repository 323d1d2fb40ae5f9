//! The embedding table's gradient on the emulator.

use super::*;
use crate::ops::kernel_plan::{EmbeddingShape, embedding_buffers, positions_by_row};

/// The table's gradient on the emulator is the CPU backward's, bit for bit, in f32 and bf16
/// (the same additions in the same order, rounded as the CPU rounds them): rows looked up
/// many times, once, never (zero), and the padding row (zero, though looked up), with rows
/// wider than a block's threads.
#[test]
fn embedding_backward_on_the_emulator_gives_the_cpus_bits() {
    let Some(emulator) = emulator() else {
        return;
    };
    let (rows, d, pad) = (37, 300, 5);
    let ids: Vec<u32> = (0..45u32)
        .map(|i| ([3, 5, 3, 36, 0, 3][i as usize % 6] + i / 9) % rows as u32)
        .collect();
    for dtype in [DType::F32, DType::BF16] {
        let weight = rand(&[rows, d], 1, 1.0, dtype);
        let grad = rand(&[3, 15, d], 2, 1.0, dtype);
        let ids_t = Tensor::from_vec(ids.clone(), (3, 15), weight.device()).unwrap();
        let w = Var::from_tensor(&weight).unwrap();
        let y = ops::embedding(w.as_tensor(), &ids_t, Some(pad)).unwrap();
        let grads = (&y * &grad).unwrap().sum_all().unwrap().backward().unwrap();
        let want = grads.get(w.as_tensor()).unwrap();

        let as_usize: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
        let (starts, positions) = positions_by_row(&as_usize, rows, Some(pad));
        let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut buffers = Buffers::default()
            .input(embedding_buffers::GRAD, &grad)
            .output(embedding_buffers::DW, rows * d, dtype);
        buffers.0.insert(embedding_buffers::STARTS, le(&starts));
        buffers
            .0
            .insert(embedding_buffers::POSITIONS, le(&positions));
        let shape = EmbeddingShape {
            rows,
            d,
            positions: ids.len(),
            dtype,
        };
        let out = emulator.run(&shape.backward().unwrap(), &buffers.0);
        assert!(
            out[&embedding_buffers::DW] == bytes(want),
            "{dtype:?}: the emulator's table gradient differs from the CPU's"
        );
        let zero_row = |r: usize| {
            want.get(r)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                == 0.0
        };
        // The padding row and a row never looked up get nothing; the others something.
        assert!(zero_row(pad) && zero_row(30) && !zero_row(3) && !zero_row(36));
    }
}

/// Positions grouped by row keep each row's positions in order and leave the padding row's
/// out.
#[test]
fn positions_are_grouped_by_row_in_order_without_the_padding_row() {
    let (starts, positions) = positions_by_row(&[2, 0, 2, 1, 2, 0], 4, Some(1));
    assert_eq!(starts, [0, 2, 2, 5, 5]);
    assert_eq!(positions, [1, 5, 0, 2, 4]);
}
