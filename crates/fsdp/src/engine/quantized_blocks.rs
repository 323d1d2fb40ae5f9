//! Symmetric integer blocks, ZeRO++'s quantization for the wire: a rank's packed block of
//! f32 values becomes one f32 scale per block of a [`Codec`]'s size (the block's largest
//! magnitude over the largest level) and one integer per value — int8: a quarter of f32's
//! bytes (plus 1/32 for the scales), half of bf16's; a value comes back within half a step
//! (`scale / 2`). Blocks never straddle two parameters: each parameter's run of the packed
//! block (`runs`, their lengths in order) is quantized apart, so a bias whose values or
//! gradients are a thousand times smaller than a neighbouring weight's keeps its own scale
//! instead of rounding to zero.
//!
//! * Weights (`fsdp_all_gather_dtype: int8`, qwZ): each rank encodes its packed shard, the
//!   ranks all-gather the bytes, and each dequantizes every rank's part into the compute
//!   dtype before unpacking. Master weights and optimizer state are untouched.
//! * Gradients (`fsdp_reduce_dtype: int8`, or `int4`: 4-bit values, two to a byte, in blocks
//!   of 128; qgZ): each rank encodes its gradient in one part per destination rank, the ranks exchange the parts all-to-all, and each dequantizes the
//!   parts it received and sums them in f32 ([`Codec::mean_of_parts`]), so the sum is never
//!   formed in low precision; only each rank's contribution is rounded.

use std::ops::Range;

use fsdp_comm::{Buffer, DType};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::config::ReduceDtype;

/// The largest block a codec uses.
const MAX_BLOCK: usize = 128;

/// Values dequantized at a time before they are stored (whole blocks of them).
const DECODE_CHUNK: usize = 16 * MAX_BLOCK;

/// How values cross the wire: symmetric integers of one width, one f32 scale per `block`
/// values of one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Codec {
    /// Bits per value: 8 (one byte each) or 4 (two to a byte, the first in the low nibble).
    bits: u8,
    /// Values per scale (ZeRO++ quantizes in groups): 128 keeps a block's scale local to a
    /// part of a row, so one large weight rounds fewer of its neighbours coarsely, for scales
    /// of 3% of int8's bytes (SmolLM2's perplexity with int8 gathers and int4 gradients was
    /// 1.2% over f32's with blocks of 512, 0.8% with 128: docs/BENCHMARKS.md).
    block: usize,
}

impl Codec {
    /// int8: levels -127..=127, blocks of 128 (an f32 scale per 128 bytes: 8.25 bits a
    /// value).
    pub(crate) const INT8: Codec = Codec {
        bits: 8,
        block: 128,
    };

    /// int4: levels -7..=7, blocks of 128 (an f32 scale per 64 bytes: 4.25 bits a value).
    pub(crate) const INT4: Codec = Codec {
        bits: 4,
        block: 128,
    };

    /// The codec gradients travel in under `dtype`, if it quantizes.
    pub(crate) fn for_reduce(dtype: ReduceDtype) -> Option<Codec> {
        match dtype {
            ReduceDtype::Int8 => Some(Codec::INT8),
            ReduceDtype::Int4 => Some(Codec::INT4),
            ReduceDtype::Fp32 | ReduceDtype::Bf16 | ReduceDtype::Fp16 => None,
        }
    }

    /// The largest level: a block's largest magnitude maps to it.
    fn levels(self) -> f32 {
        match self.bits {
            8 => 127.0,
            _ => 7.0,
        }
    }

    /// Bytes `n` values take (without their scales).
    fn payload(self, n: usize) -> usize {
        (n * usize::from(self.bits)).div_ceil(8)
    }

    /// Bytes one run of `n` values takes: its block scales (f32, little-endian) then its
    /// values' bytes.
    fn run_len(self, n: usize) -> usize {
        n.div_ceil(self.block) * 4 + self.payload(n)
    }

    /// Bytes a rank sends for a block of `runs` (each run encoded after the one before).
    pub(crate) fn encoded_len(self, runs: &[usize]) -> usize {
        runs.iter().map(|&n| self.run_len(n)).sum()
    }

    /// Each run's values and bytes in a block of `runs` and in its encoding.
    fn spans(self, runs: &[usize]) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
        let (mut at, mut byte) = (0, 0);
        runs.iter().map(move |&n| {
            let span = (at..at + n, byte..byte + self.run_len(n));
            (at, byte) = (span.0.end, span.1.end);
            span
        })
    }

    /// `values` (a block of `runs`) as integer blocks with their scales. A block holding a
    /// NaN or an infinity gets that as its scale, so it dequantizes to NaN: a non-finite
    /// value stays visible.
    pub(crate) fn encode(self, values: &[f32], runs: &[usize]) -> Vec<u8> {
        let mut out = vec![0u8; self.encoded_len(runs)];
        self.encode_into(values, runs, &mut out);
        out
    }

    /// [`Codec::encode`] into `out`, zeroed, of [`Codec::encoded_len`] bytes.
    fn encode_into(self, values: &[f32], runs: &[usize], out: &mut [u8]) {
        for (v, b) in self.spans(runs) {
            encode_run(self, &values[v], &mut out[b]);
        }
    }

    /// `values` (`parts` blocks of `runs` one after the other) encoded part by part, so
    /// part p is bytes `p * encoded_len(runs)..` — what an all-to-all sends rank p.
    pub(crate) fn encode_parts(self, values: &[f32], runs: &[usize], parts: usize) -> Vec<u8> {
        let (k, part) = (runs.iter().sum::<usize>(), self.encoded_len(runs));
        let mut out = vec![0u8; part * parts];
        if k > 0 && part > 0 {
            for (values, out) in values.chunks_exact(k).zip(out.chunks_exact_mut(part)) {
                self.encode_into(values, runs, out);
            }
        }
        out
    }

    /// The means of `members` senders' encoded blocks of `runs`, `blocks` blocks from each
    /// (in `bytes`, sender after sender, each sender's blocks in order): block b of the
    /// result is the mean of every sender's block b, dequantized and summed in f32 in sender
    /// order, so every rank that sums the same bytes gets the same values. The error says
    /// what arrived instead (the caller names the op).
    pub(crate) fn mean_of_parts(
        self,
        bytes: &[u8],
        runs: &[usize],
        members: usize,
        blocks: usize,
    ) -> Result<Vec<f32>, String> {
        let (k, part) = (runs.iter().sum::<usize>(), self.encoded_len(runs));
        let parts = members * blocks;
        if bytes.len() != part * parts {
            return Err(format!(
                "{} bytes arrived for {parts} parts of {k} values ({part} bytes each)",
                bytes.len()
            ));
        }
        let mut sum = vec![0f32; k * blocks];
        for (i, encoded) in bytes.chunks_exact(part.max(1)).enumerate() {
            let b = i % blocks.max(1);
            self.decode_into(encoded, runs, &mut sum[b * k..(b + 1) * k], |v, out| {
                for (o, v) in out.iter_mut().zip(v) {
                    *o += v;
                }
            });
        }
        let n = members.max(1) as f32;
        sum.iter_mut().for_each(|v| *v /= n);
        Ok(sum)
    }

    /// Dequantizes one rank's `encoded` block of `runs` into `out`, [`DECODE_CHUNK`] values
    /// at a time through `store` (which writes f32 values in `out`'s type).
    fn decode_into<T>(
        self,
        encoded: &[u8],
        runs: &[usize],
        out: &mut [T],
        store: impl Fn(&[f32], &mut [T]),
    ) {
        let mut values = [0f32; DECODE_CHUNK];
        for (v, b) in self.spans(runs) {
            let (encoded, out) = (&encoded[b], &mut out[v.clone()]);
            let (scales, quantized) = encoded.split_at(v.len().div_ceil(self.block) * 4);
            // Whole blocks a chunk.
            let blocks = DECODE_CHUNK / self.block;
            let chunk = blocks * self.block;
            for ((scales, q), out) in scales
                .chunks(4 * blocks)
                .zip(quantized.chunks(self.payload(chunk)))
                .zip(out.chunks_mut(chunk))
            {
                let values = &mut values[..out.len()];
                decode_blocks(self, scales, q, values);
                store(values, out);
            }
        }
    }

    /// The gathered bytes of `ranks` ranks, each a block of `runs`, dequantized into `dtype`
    /// in rank order: what an all-gather in `dtype` would have delivered, rounded. The error
    /// says what arrived instead (the caller names the unit).
    pub(crate) fn decode_gathered(
        self,
        gathered: &Buffer,
        runs: &[usize],
        ranks: usize,
        dtype: DType,
    ) -> Result<Buffer, String> {
        let (block, part) = (runs.iter().sum::<usize>(), self.encoded_len(runs));
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
                    self.decode_into(p, runs, o, |v, o| o.copy_from_slice(v));
                }
                Buffer::F32(out)
            }
            DType::BF16 => {
                let mut out = vec![bf16::ZERO; block * ranks];
                for (p, o) in parts.zip(out.chunks_mut(block.max(1))) {
                    self.decode_into(p, runs, o, |v, o| o.convert_from_f32_slice(v));
                }
                Buffer::BF16(out)
            }
            DType::F16 => {
                let mut out = vec![f16::ZERO; block * ranks];
                for (p, o) in parts.zip(out.chunks_mut(block.max(1))) {
                    self.decode_into(p, runs, o, |v, o| o.convert_from_f32_slice(v));
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
}

fsdp_nn::multiversion! {
    /// One run's blocks into `out` (zeroed, of [`Codec::run_len`] bytes): for each block of
    /// `values`, its scale (the largest magnitude over the largest level, NaN where a value is
    /// not finite) and its values' levels, rounded half away from zero. One pass finds the
    /// largest magnitude and whether every value is finite (for finite values the order of
    /// their magnitudes' bits is the order of the magnitudes), one rounds: both vectorise.
    fn encode_run(codec: Codec, values: &[f32], out: &mut [u8]) {
        let blocks = values.len().div_ceil(codec.block);
        let (scales, quantized) = out.split_at_mut(blocks * 4);
        for ((block, scale), q) in values
            .chunks(codec.block)
            .zip(scales.chunks_exact_mut(4))
            .zip(quantized.chunks_mut(codec.payload(codec.block)))
        {
            let top = block.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
            let step = if top < f32::INFINITY.to_bits() {
                f32::from_bits(top) / codec.levels()
            } else {
                f32::NAN
            };
            scale.copy_from_slice(&step.to_le_bytes());
            if step > 0.0 {
                let inv = 1.0 / step;
                let round = |v: f32| {
                    let r = v * inv;
                    r + 0.5f32.copysign(r)
                };
                if inv.is_finite() {
                    // Every value is finite and |v * inv| <= the largest level (under 127.5
                    // after rounding), so the rounded level converts to an i32 as a saturating
                    // cast would, and its low byte is the level's i8: a plain conversion,
                    // which vectorises where the saturating one does not.
                    // SAFETY: finite and within ±128, as above.
                    let level = |v: f32| unsafe { round(v).to_int_unchecked::<i32>() as u8 };
                    quantize_block(codec.bits, block, q, level);
                } else {
                    // A block of subnormals, whose step's inverse overflows: divided instead.
                    let level = |v: f32| {
                        let r = v / step;
                        (r + 0.5f32.copysign(r)) as i8 as u8
                    };
                    quantize_block(codec.bits, block, q, level);
                }
            }
        }
    }
}

/// `block`'s levels (each value through `level`, its i8's byte) into `q`: one a byte for 8
/// bits, two a byte (the first in the low nibble) for 4.
#[inline(always)]
fn quantize_block(bits: u8, block: &[f32], q: &mut [u8], level: impl Fn(f32) -> u8) {
    if bits == 8 {
        for (q, v) in q.iter_mut().zip(block) {
            *q = level(*v);
        }
        return;
    }
    let mut levels = [0u8; MAX_BLOCK];
    for (l, v) in levels.iter_mut().zip(block) {
        *l = level(*v);
    }
    let levels = &levels[..block.len()];
    let pairs = levels.chunks_exact(2);
    if let [last] = pairs.remainder() {
        q[block.len() / 2] = last & 0x0f;
    }
    for (q, pair) in q.iter_mut().zip(pairs) {
        *q = (pair[0] & 0x0f) | (pair[1] << 4);
    }
}

fsdp_nn::multiversion! {
    /// Dequantizes consecutive blocks of one run into `values` (as many as it holds): each
    /// level times its block's scale in `scales` (f32, little-endian), the levels in `q`.
    fn decode_blocks(codec: Codec, scales: &[u8], q: &[u8], values: &mut [f32]) {
        for ((scale, q), values) in scales
            .chunks_exact(4)
            .zip(q.chunks(codec.payload(codec.block)))
            .zip(values.chunks_mut(codec.block))
        {
            let step = f32::from_le_bytes([scale[0], scale[1], scale[2], scale[3]]);
            if codec.bits == 8 {
                for (v, &q) in values.iter_mut().zip(q) {
                    *v = f32::from(q as i8) * step;
                }
            } else {
                // Each nibble sign-extended: shifted to the byte's top, then back.
                let mut levels = [0i8; MAX_BLOCK];
                for (pair, &q) in levels.chunks_exact_mut(2).zip(q) {
                    pair[0] = ((q << 4) as i8) >> 4;
                    pair[1] = (q as i8) >> 4;
                }
                for (v, &l) in values.iter_mut().zip(&levels) {
                    *v = f32::from(l) * step;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
