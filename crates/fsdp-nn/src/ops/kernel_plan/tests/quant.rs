//! NF4 dequantization on the emulator.

use super::*;

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
