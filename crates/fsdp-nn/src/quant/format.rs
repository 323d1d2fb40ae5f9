//! The quantized formats and their layout: [`QuantFormat`], [`Packing`] (a weight's rows as
//! 32-bit words of blocks), quantizing and dequantizing rows, and [`QuantError`].

use std::fmt;

use candle_core::quantized::GgmlDType;
use candle_core::quantized::k_quants::{self, GgmlType};

/// Runs `$body` with `$B` the block type of GGML type `$t` (a weight format).
macro_rules! ggml_dispatch {
    ($t:expr, $B:ident => $body:expr) => {
        match $t {
            GgmlDType::Q4_0 => {
                type $B = k_quants::BlockQ4_0;
                $body
            }
            GgmlDType::Q4_1 => {
                type $B = k_quants::BlockQ4_1;
                $body
            }
            GgmlDType::Q5_0 => {
                type $B = k_quants::BlockQ5_0;
                $body
            }
            GgmlDType::Q5_1 => {
                type $B = k_quants::BlockQ5_1;
                $body
            }
            GgmlDType::Q8_0 => {
                type $B = k_quants::BlockQ8_0;
                $body
            }
            GgmlDType::Q2K => {
                type $B = k_quants::BlockQ2K;
                $body
            }
            GgmlDType::Q3K => {
                type $B = k_quants::BlockQ3K;
                $body
            }
            GgmlDType::Q4K => {
                type $B = k_quants::BlockQ4K;
                $body
            }
            GgmlDType::Q5K => {
                type $B = k_quants::BlockQ5K;
                $body
            }
            GgmlDType::Q6K => {
                type $B = k_quants::BlockQ6K;
                $body
            }
            // `Packing::new` refuses every other type, so none reaches here.
            _ => {}
        }
    };
}

/// A block-quantized format a frozen weight can be kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// One of llama.cpp's block types (what a GGUF file's tensors are stored as).
    Ggml(GgmlDType),
    /// 4-bit NormalFloat (QLoRA's, bitsandbytes' `nf4`): blocks of 64, each a f32 absmax and
    /// 32 bytes of 4-bit indices into the 16 NF4 levels (no double quantization).
    Nf4,
}

/// The 16 NF4 levels (Dettmers et al. 2023, as bitsandbytes defines them).
const NF4_LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// The midpoints between consecutive NF4 levels, where rounding to the nearest changes.
const NF4_MIDPOINTS: [f32; 15] = {
    let mut m = [0f32; 15];
    let mut i = 0;
    while i < 15 {
        m[i] = (NF4_LEVELS[i] + NF4_LEVELS[i + 1]) / 2.0;
        i += 1;
    }
    m
};

/// NF4's elements per block.
const NF4_BLOCK: usize = 64;
/// NF4's bytes per block: the absmax (f32) and two indices per byte.
const NF4_BLOCK_BYTES: usize = 4 + NF4_BLOCK / 2;

/// Why a weight cannot be kept in a format.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    /// A format name this library does not know.
    #[error(
        "unknown quantized format `{0}` (known: nf4, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k)"
    )]
    UnknownFormat(String),
    /// A GGML type that is not a weight format (f32, f16, bf16, or a dot-product type).
    #[error("GGML type {0:?} is not a block format weights are kept in")]
    NotWeightFormat(GgmlDType),
    /// The rows are not whole blocks.
    #[error(
        "`{name}`: rows of {cols} elements are not whole {format} blocks of {block} (quantize only layers whose input size is a multiple of {block})"
    )]
    PartialBlock {
        /// The parameter.
        name: String,
        /// Elements per row.
        cols: usize,
        /// The format.
        format: QuantFormat,
        /// Its block size.
        block: usize,
    },
    /// A layer whose weight cannot be kept quantized.
    #[error("`{path}`: only an nn.Linear weight ([out, in]) can be kept quantized, not a Conv1D's")]
    Layout {
        /// The layer.
        path: String,
    },
    /// A linear layer the model's tree lists but [`crate::Module::children_mut`] does
    /// not reach.
    #[error(
        "`{path}`: cannot reach the layer to quantize it (a module above it does not implement Module::children_mut)"
    )]
    Unreachable {
        /// The layer.
        path: String,
    },
    /// A model without a linear layer to quantize.
    #[error("the model has no linear layer to quantize (lm_head is kept in f32)")]
    NoLinear,
    /// Packed data of the wrong length.
    #[error("quantized rows: {got} words given for {rows} rows of {words} words")]
    Length {
        /// Words given.
        got: usize,
        /// Rows expected.
        rows: usize,
        /// Words per row.
        words: usize,
    },
}

impl QuantFormat {
    /// Every format weights may be kept in.
    pub const ALL: [QuantFormat; 11] = [
        QuantFormat::Nf4,
        QuantFormat::Ggml(GgmlDType::Q4_0),
        QuantFormat::Ggml(GgmlDType::Q4_1),
        QuantFormat::Ggml(GgmlDType::Q5_0),
        QuantFormat::Ggml(GgmlDType::Q5_1),
        QuantFormat::Ggml(GgmlDType::Q8_0),
        QuantFormat::Ggml(GgmlDType::Q2K),
        QuantFormat::Ggml(GgmlDType::Q3K),
        QuantFormat::Ggml(GgmlDType::Q4K),
        QuantFormat::Ggml(GgmlDType::Q5K),
        QuantFormat::Ggml(GgmlDType::Q6K),
    ];

    /// The format a GGML type names, if weights may be kept in it.
    pub fn from_ggml(dtype: GgmlDType) -> Result<QuantFormat, QuantError> {
        let f = QuantFormat::Ggml(dtype);
        if QuantFormat::ALL.contains(&f) {
            Ok(f)
        } else {
            Err(QuantError::NotWeightFormat(dtype))
        }
    }

    /// The format named `name` (`nf4`, `q4_0`, `Q4_K`, ...: llama.cpp's spelling, any case).
    pub fn parse(name: &str) -> Result<QuantFormat, QuantError> {
        QuantFormat::ALL
            .into_iter()
            .find(|f| f.to_string().eq_ignore_ascii_case(name))
            .ok_or_else(|| QuantError::UnknownFormat(name.to_string()))
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            QuantFormat::Ggml(t) => t.block_size(),
            QuantFormat::Nf4 => NF4_BLOCK,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Ggml(t) => t.type_size(),
            QuantFormat::Nf4 => NF4_BLOCK_BYTES,
        }
    }
}

impl fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            QuantFormat::Nf4 => "NF4",
            QuantFormat::Ggml(t) => match t {
                GgmlDType::Q4_0 => "Q4_0",
                GgmlDType::Q4_1 => "Q4_1",
                GgmlDType::Q5_0 => "Q5_0",
                GgmlDType::Q5_1 => "Q5_1",
                GgmlDType::Q8_0 => "Q8_0",
                GgmlDType::Q8_1 => "Q8_1",
                GgmlDType::Q2K => "Q2_K",
                GgmlDType::Q3K => "Q3_K",
                GgmlDType::Q4K => "Q4_K",
                GgmlDType::Q5K => "Q5_K",
                GgmlDType::Q6K => "Q6_K",
                GgmlDType::Q8K => "Q8_K",
                GgmlDType::F32 => "F32",
                GgmlDType::F16 => "F16",
                GgmlDType::BF16 => "BF16",
            },
        };
        f.write_str(name)
    }
}

/// How a quantized parameter's words stand for a `[rows, cols]` weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Packing {
    /// The format of every row's blocks.
    pub format: QuantFormat,
    /// Elements per row of the weight it stands for (a multiple of the block size).
    pub cols: usize,
}

impl Packing {
    /// `cols`-element rows in `format`; an error naming `name` unless they are whole blocks.
    /// An error too for a GGML type that is not a weight format (`F16`, `Q8_K`, ...).
    pub fn new(name: &str, format: QuantFormat, cols: usize) -> Result<Packing, QuantError> {
        if let QuantFormat::Ggml(t) = format {
            QuantFormat::from_ggml(t)?;
        }
        let block = format.block_size();
        if cols == 0 || !cols.is_multiple_of(block) {
            return Err(QuantError::PartialBlock {
                name: name.to_string(),
                cols,
                format,
                block,
            });
        }
        Ok(Packing { format, cols })
    }

    /// Bytes of one row's blocks.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.format.block_size() * self.format.block_bytes()
    }

    /// 32-bit words one row is held in (its bytes, padded).
    pub fn row_words(&self) -> usize {
        self.row_bytes().div_ceil(4)
    }

    /// Quantizes whole rows of `values` (`cols` each) into their words.
    pub fn quantize(&self, values: &[f32]) -> Vec<f32> {
        let rows = values.len() / self.cols;
        let mut words = vec![0f32; rows * self.row_words()];
        for (row, out) in values
            .chunks_exact(self.cols)
            .zip(words.chunks_exact_mut(self.row_words()))
        {
            let bytes = &mut as_bytes_mut(out)[..self.row_bytes()];
            match self.format {
                QuantFormat::Nf4 => nf4_quantize(row, bytes),
                QuantFormat::Ggml(t) => ggml_dispatch!(t, B => ggml_quantize::<B>(row, bytes)),
            }
        }
        words
    }

    /// Dequantizes whole rows of `words` (`row_words` each) into `out` (`cols` per row).
    pub fn dequantize_into(&self, words: &[f32], out: &mut [f32]) -> Result<(), QuantError> {
        let rows = out.len() / self.cols;
        if words.len() != rows * self.row_words() {
            return Err(QuantError::Length {
                got: words.len(),
                rows,
                words: self.row_words(),
            });
        }
        for (row, dst) in words
            .chunks_exact(self.row_words())
            .zip(out.chunks_exact_mut(self.cols))
        {
            let bytes = &as_bytes(row)[..self.row_bytes()];
            match self.format {
                QuantFormat::Nf4 => nf4_dequantize(bytes, dst),
                QuantFormat::Ggml(t) => ggml_dispatch!(t, B => ggml_dequantize::<B>(bytes, dst)),
            }
        }
        Ok(())
    }

    /// [`Packing::dequantize_into`] a new vector.
    pub fn dequantize(&self, words: &[f32]) -> Result<Vec<f32>, QuantError> {
        let rows = words.len() / self.row_words().max(1);
        let mut out = vec![0f32; rows * self.cols];
        self.dequantize_into(words, &mut out)?;
        Ok(out)
    }

    /// The words of rows whose block bytes are given back to back (a GGUF tensor's data,
    /// `row_bytes` per row), each row padded to whole words.
    pub fn words_from_row_bytes(&self, bytes: &[u8]) -> Result<Vec<f32>, QuantError> {
        let rb = self.row_bytes();
        let rows = bytes.len() / rb.max(1);
        if bytes.len() != rows * rb {
            return Err(QuantError::Length {
                got: bytes.len().div_ceil(4),
                rows,
                words: self.row_words(),
            });
        }
        let mut words = vec![0f32; rows * self.row_words()];
        for (src, out) in bytes
            .chunks_exact(rb)
            .zip(words.chunks_exact_mut(self.row_words()))
        {
            as_bytes_mut(out)[..rb].copy_from_slice(src);
        }
        Ok(words)
    }
}

fn as_bytes(words: &[f32]) -> &[u8] {
    // SAFETY: any f32 is 4 initialised bytes; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), std::mem::size_of_val(words)) }
}

fn as_bytes_mut(words: &mut [f32]) -> &mut [u8] {
    // SAFETY: as `as_bytes`; every byte pattern is a valid f32 once written back.
    unsafe {
        std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), std::mem::size_of_val(words))
    }
}

/// The blocks of type `B` in `bytes` (a row: starts on a word, whole blocks).
fn blocks<B: GgmlType>(bytes: &[u8]) -> &[B] {
    let n = bytes.len() / std::mem::size_of::<B>();
    assert!(
        bytes.as_ptr().align_offset(std::mem::align_of::<B>()) == 0
            && n * std::mem::size_of::<B>() == bytes.len(),
        "quantized row: misaligned or partial blocks"
    );
    // SAFETY: aligned (checked) and exactly `n` blocks long; GGML's blocks are plain
    // `repr(C)` structs of integers and halves, valid for any bytes.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), n) }
}

fn ggml_dequantize<B: GgmlType>(bytes: &[u8], out: &mut [f32]) {
    B::to_float(blocks::<B>(bytes), out);
}

fn ggml_quantize<B: GgmlType>(row: &[f32], bytes: &mut [u8]) {
    let mut out = vec![B::zeros(); row.len() / B::BLCK_SIZE];
    B::from_float(row, &mut out);
    // SAFETY: the blocks are plain `repr(C)` data; read as their bytes.
    let src = unsafe {
        std::slice::from_raw_parts(out.as_ptr().cast::<u8>(), std::mem::size_of_val(&*out))
    };
    bytes.copy_from_slice(src);
}

fn nf4_quantize(row: &[f32], bytes: &mut [u8]) {
    for (block, out) in row
        .chunks_exact(NF4_BLOCK)
        .zip(bytes.chunks_exact_mut(NF4_BLOCK_BYTES))
    {
        let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        out[..4].copy_from_slice(&absmax.to_le_bytes());
        let scale = if absmax > 0.0 { 1.0 / absmax } else { 0.0 };
        // The nearest level: how many midpoints between levels lie below (a tie goes to the
        // lower level).
        let nearest = |v: f32| NF4_MIDPOINTS.partition_point(|&m| m < v * scale) as u8;
        for (pair, byte) in block.chunks_exact(2).zip(&mut out[4..]) {
            // bitsandbytes' order: the first element in the high half.
            *byte = (nearest(pair[0]) << 4) | nearest(pair[1]);
        }
    }
}

fn nf4_dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, dst) in bytes
        .chunks_exact(NF4_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(NF4_BLOCK))
    {
        let absmax = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
        for (byte, pair) in block[4..].iter().zip(dst.chunks_exact_mut(2)) {
            pair[0] = NF4_LEVELS[usize::from(byte >> 4)] * absmax;
            pair[1] = NF4_LEVELS[usize::from(byte & 15)] * absmax;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn values(n: usize) -> Vec<f32> {
        let mut rng = crate::NormalRng::new(5);
        (0..n).map(|_| (rng.normal() * 0.02) as f32).collect()
    }

    #[test]
    fn every_format_round_trips_within_its_precision_and_matches_candle() {
        let (rows, cols) = (3, 512);
        let v = values(rows * cols);
        for f in QuantFormat::ALL {
            let p = Packing::new("w", f, cols).unwrap();
            let words = p.quantize(&v);
            assert_eq!(words.len(), rows * p.row_words());
            let back = p.dequantize(&words).unwrap();
            let rms = |x: &[f32]| (x.iter().map(|a| a * a).sum::<f32>() / x.len() as f32).sqrt();
            let err: Vec<f32> = v.iter().zip(&back).map(|(a, b)| a - b).collect();
            let rel = rms(&err) / rms(&v);
            let bound = match f.block_bytes() * 8 / f.block_size() {
                b if b >= 8 => 0.01,
                4 | 5 => 0.12,
                _ => 0.6,
            };
            assert!(rel < bound, "{f}: rms error {rel} of the rms");
            if let QuantFormat::Ggml(t) = f {
                // The same bytes as candle's own quantizer, dequantized as candle does.
                let t_in = Tensor::from_vec(v.clone(), (rows, cols), &Device::Cpu).unwrap();
                let q = candle_core::quantized::QTensor::quantize(&t_in, t).unwrap();
                let ours = p
                    .words_from_row_bytes(&q.data().unwrap())
                    .expect("whole rows");
                assert_eq!(p.dequantize(&ours).unwrap(), back, "{f}");
                let theirs = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
                assert_eq!(theirs.to_vec1::<f32>().unwrap(), back, "{f}");
            }
        }
    }

    #[test]
    fn nf4_keeps_each_blocks_extreme_and_its_levels() {
        let mut v = vec![0.0f32; 64];
        v[3] = -0.5;
        v[10] = 0.25;
        v[63] = 0.5 * 0.722_956_84;
        let p = Packing::new("w", QuantFormat::Nf4, 64).unwrap();
        let back = p.dequantize(&p.quantize(&v)).unwrap();
        assert_eq!(back[3], -0.5, "the absmax is exact");
        assert_eq!(back[0], 0.0, "zero is a level");
        assert_eq!(back[63], 0.5 * 0.722_956_84);
        assert_eq!(
            back[10],
            0.5 * 0.440_709_83,
            "0.5 of absmax rounds to the nearest level"
        );
        assert_eq!(p.row_bytes(), 36);
        assert_eq!(p.row_words(), 9);
    }

    #[test]
    fn nf4_rounds_to_the_nearest_level() {
        let p = Packing::new("w", QuantFormat::Nf4, 64).unwrap();
        let mut v = values(64 * 50);
        for (i, x) in v.iter_mut().enumerate().step_by(64) {
            *x = if i % 128 == 0 { 0.1 } else { -0.1 };
        }
        let back = p.dequantize(&p.quantize(&v)).unwrap();
        for (block, got) in v.chunks(64).zip(back.chunks(64)) {
            let absmax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (x, y) in block.iter().zip(got) {
                let best = NF4_LEVELS
                    .iter()
                    .map(|l| l * absmax)
                    .min_by(|a, b| (a - x).abs().total_cmp(&(b - x).abs()))
                    .unwrap();
                assert!(
                    (y - x).abs() <= (best - x).abs() + 1e-9,
                    "{x}: {y} vs {best}"
                );
            }
        }
    }

    #[test]
    fn names_and_refusals() {
        assert_eq!(QuantFormat::parse("nf4").unwrap(), QuantFormat::Nf4);
        assert_eq!(
            QuantFormat::parse("q4_k").unwrap(),
            QuantFormat::Ggml(GgmlDType::Q4K)
        );
        assert!(matches!(
            QuantFormat::parse("int3"),
            Err(QuantError::UnknownFormat(_))
        ));
        assert!(QuantFormat::from_ggml(GgmlDType::F16).is_err());
        assert_eq!(
            Packing::new("w", QuantFormat::Ggml(GgmlDType::Q8K), 256),
            Err(QuantError::NotWeightFormat(GgmlDType::Q8K))
        );
        let e = Packing::new("model.layers.0.mlp.up_proj.weight", QuantFormat::Nf4, 96)
            .unwrap_err()
            .to_string();
        assert!(e.contains("up_proj") && e.contains("64"), "{e}");
        // Q4_0 rows of 32 are 18 bytes: padded to 5 words.
        let p = Packing::new("w", QuantFormat::Ggml(GgmlDType::Q4_0), 32).unwrap();
        assert_eq!((p.row_bytes(), p.row_words()), (18, 5));
        let v = values(64);
        assert_eq!(p.quantize(&v).len(), 10);
        assert!(p.dequantize_into(&[0.0; 9], &mut [0.0; 64]).is_err());
    }
}
