//! Parameters all-gathered as int8 blocks (`fsdp_all_gather_dtype: int8`, ZeRO++'s quantized
//! weights): each rank quantizes its packed shard block by block — symmetric int8, one f32
//! scale per [`BLOCK`] elements, the scale its largest magnitude over 127 — the ranks gather
//! the bytes, and each dequantizes every rank's part into the compute dtype before unpacking.
//! A quarter of f32's bytes on the wire (plus 1/128 for the scales), half of bf16's. Master
//! weights, gradients and optimizer state are untouched: only what forward and backward
//! compute with is rounded, by at most half a step (`scale / 2`) per element.

use fsdp_comm::{Buffer, DType};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements per quantization block (ZeRO++ quantizes in groups; 512 keeps a block's scale
/// local to a few rows of a typical weight while the scales cost under 1% of the bytes).
pub(crate) const BLOCK: usize = 512;

/// Bytes a rank sends for `n` values: the block scales (f32, little-endian) then one byte
/// per value.
pub(crate) fn encoded_len(n: usize) -> usize {
    n.div_ceil(BLOCK) * 4 + n
}

/// `values` as int8 blocks with their scales (see [`encoded_len`] for the layout). A block
/// holding a NaN or an infinity gets that as its scale, so it dequantizes to NaN: a
/// non-finite weight stays visible.
pub(crate) fn encode(values: &[f32]) -> Vec<u8> {
    let blocks = values.len().div_ceil(BLOCK);
    let mut out = vec![0u8; encoded_len(values.len())];
    let (scales, quantized) = out.split_at_mut(blocks * 4);
    for ((block, scale), q) in values
        .chunks(BLOCK)
        .zip(scales.chunks_exact_mut(4))
        .zip(quantized.chunks_mut(BLOCK))
    {
        // Two plain passes the compiler vectorises: the largest magnitude, and whether every
        // value is finite (a NaN or an infinity makes the scale NaN).
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let finite = block.iter().all(|v| v.is_finite());
        let step = if finite { amax / 127.0 } else { f32::NAN };
        scale.copy_from_slice(&step.to_le_bytes());
        if step > 0.0 {
            let inv = 1.0 / step;
            for (q, v) in q.iter_mut().zip(block) {
                // |v * inv| <= 127: rounded half away from zero by adding half a step with
                // the value's sign and truncating (`as` saturates, so nothing wraps).
                let r = v * inv;
                *q = (r + 0.5f32.copysign(r)) as i8 as u8;
            }
        }
    }
    out
}

/// Dequantizes one rank's `encoded` part of `n` values into `out`, a block at a time through
/// `store` (which writes a block's f32 values in `out`'s type).
fn decode_into<T>(encoded: &[u8], n: usize, out: &mut [T], store: impl Fn(&[f32], &mut [T])) {
    let blocks = n.div_ceil(BLOCK);
    let (scales, quantized) = encoded.split_at(blocks * 4);
    let mut values = [0f32; BLOCK];
    for ((scale, q), out) in scales
        .chunks_exact(4)
        .zip(quantized.chunks(BLOCK))
        .zip(out.chunks_mut(BLOCK))
    {
        let step = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
        let values = &mut values[..q.len()];
        for (v, &q) in values.iter_mut().zip(q) {
            *v = f32::from(q as i8) * step;
        }
        store(values, out);
    }
}

/// The gathered bytes of `ranks` ranks, `block` values each, dequantized into `dtype` in
/// rank order: what an all-gather in `dtype` would have delivered, rounded. The error says
/// what arrived instead (the caller names the unit).
pub(crate) fn decode_gathered(
    gathered: &Buffer,
    block: usize,
    ranks: usize,
    dtype: DType,
) -> Result<Buffer, String> {
    let part = encoded_len(block);
    let bytes = match gathered {
        Buffer::U8(b) if b.len() == part * ranks => b,
        other => {
            return Err(format!(
                "{} {:?} elements arrived for {ranks} ranks of {part} bytes",
                other.len(),
                other.dtype()
            ));
        }
    };
    let parts = bytes.chunks_exact(part.max(1));
    Ok(match dtype {
        DType::F32 => {
            let mut out = vec![0f32; block * ranks];
            for (p, o) in parts.zip(out.chunks_mut(block.max(1))) {
                decode_into(p, block, o, |v, o| o.copy_from_slice(v));
            }
            Buffer::F32(out)
        }
        DType::BF16 => {
            let mut out = vec![bf16::ZERO; block * ranks];
            for (p, o) in parts.zip(out.chunks_mut(block.max(1))) {
                decode_into(p, block, o, |v, o| o.convert_from_f32_slice(v));
            }
            Buffer::BF16(out)
        }
        DType::F16 => {
            let mut out = vec![f16::ZERO; block * ranks];
            for (p, o) in parts.zip(out.chunks_mut(block.max(1))) {
                decode_into(p, block, o, |v, o| o.convert_from_f32_slice(v));
            }
            Buffer::F16(out)
        }
        other => {
            return Err(format!(
                "parameters compute in f32, bf16 or f16, not {other:?}"
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn as_f32(b: Buffer) -> Vec<f32> {
        let mut out = vec![0f32; b.len()];
        assert!(b.to_f32_into(&mut out));
        out
    }

    /// Values of every magnitude, a block of zeros, and a tail shorter than a block.
    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match (i / BLOCK) % 3 {
                0 => ((i * 37 % 101) as f32 - 50.0) / 7.0,
                1 => 0.0,
                _ => ((i * 13 % 29) as f32 - 14.0) * 1e-3,
            })
            .collect()
    }

    #[test]
    fn every_value_comes_back_within_half_a_step_of_its_block() {
        let (block, ranks) = (3 * BLOCK + 77, 3);
        let mine: Vec<Vec<f32>> = (0..ranks)
            .map(|r| values(block).iter().map(|v| v * (r + 1) as f32).collect())
            .collect();
        let wire: Vec<u8> = mine.iter().flat_map(|m| encode(m)).collect();
        assert_eq!(wire.len(), ranks * encoded_len(block));
        assert!(
            encoded_len(block) < block + block / 100 + 8,
            "scales under 1%"
        );
        for dtype in [DType::F32, DType::BF16] {
            let got = decode_gathered(&Buffer::U8(wire.clone()), block, ranks, dtype).unwrap();
            let got = as_f32(got);
            for (r, m) in mine.iter().enumerate() {
                for (b, chunk) in m.chunks(BLOCK).enumerate() {
                    let step = chunk.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                    // bf16's own rounding on top of the int8 step.
                    let slack = if dtype == DType::BF16 {
                        1.0 / 128.0
                    } else {
                        1e-6
                    };
                    for (i, v) in chunk.iter().enumerate() {
                        let g = got[r * block + b * BLOCK + i];
                        let bound = step / 2.0 * (1.0 + 1e-5) + v.abs() * slack;
                        assert!((g - v).abs() <= bound, "rank {r} block {b}: {g} for {v}");
                    }
                }
            }
        }
        // A block of zeros comes back as zeros.
        let zeros = decode_gathered(&Buffer::U8(encode(&[0.0; 700])), 700, 1, DType::F32);
        assert!(as_f32(zeros.unwrap()).iter().all(|v| *v == 0.0));
    }

    #[test]
    fn a_non_finite_weight_dequantizes_to_nan_in_its_block_only() {
        let mut v = values(2 * BLOCK);
        v[3] = f32::INFINITY;
        let got = decode_gathered(&Buffer::U8(encode(&v)), v.len(), 1, DType::F32).unwrap();
        let got = as_f32(got);
        assert!(got[..BLOCK].iter().all(|x| x.is_nan()));
        assert!(got[BLOCK..].iter().all(|x| x.is_finite()));
    }

    #[test]
    fn bytes_of_the_wrong_length_or_type_are_refused() {
        let e = decode_gathered(&Buffer::U8(vec![0; 10]), 600, 2, DType::F32).unwrap_err();
        assert!(e.contains("for 2 ranks of"), "{e}");
        let e = decode_gathered(&Buffer::F32(vec![0.0; 10]), 8, 1, DType::F32).unwrap_err();
        assert!(e.contains("F32"), "{e}");
    }
}
