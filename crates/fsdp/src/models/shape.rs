//! A transformer's size as its training FLOPs see it, counted as PaLM's appendix B counts
//! them: a step is forward plus backward, three times the forward's matrix products; the
//! forward of one sequence of `L` tokens is `layers * (2 L P + 4 L^2 A) + 2 L h V`, with `P`
//! the weights of one layer's projections (`4 h^2 + 2 h I` for BERT and GPT-2: four attention
//! projections, two feed-forward ones; Llama's are its q/k/v/o and three SwiGLU
//! projections), `A` the attention width (heads times head size, `h` for BERT) for the scores
//! and their weighted sum over all `L^2` pairs (causal attention included, as PaLM counts),
//! and an output head of `V` outputs per token, 0 when the head reads one token. Embedding
//! lookups, norms, activations and softmax are not counted. Padded FLOPs count every position
//! of the padded batch; real ones only the tokens of each sequence (its length `L`), which is
//! the work the model needed. `Accelerator::mfu_line` divides them by the measured peak.

use candle_core::{DType, Tensor};

/// The sizes of a transformer that its FLOPs depend on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransformerShape {
    /// Layers (blocks).
    pub layers: usize,
    /// Weights of one layer's projections `P` (every matrix a token is multiplied by).
    pub layer_matmul_params: usize,
    /// Attention width `A`: heads times head size.
    pub attention_width: usize,
    /// Hidden size `h` (what the output head reads).
    pub hidden: usize,
    /// Outputs of a head applied to every token (`V`: a language model's vocabulary); 0 for a
    /// head that reads one token per sequence (classification).
    pub head_per_token: usize,
}

impl TransformerShape {
    /// BERT's and GPT-2's shape: four `h x h` attention projections and a feed-forward block
    /// of `intermediate` (`P = 4 h^2 + 2 h I`, `A = h`).
    pub fn dense(
        layers: usize,
        hidden: usize,
        intermediate: usize,
        head_per_token: usize,
    ) -> TransformerShape {
        TransformerShape {
            layers,
            layer_matmul_params: 4 * hidden * hidden + 2 * hidden * intermediate,
            attention_width: hidden,
            hidden,
            head_per_token,
        }
    }

    /// Training FLOPs (forward and backward) of sequences of these lengths (see the module
    /// docs for the formula).
    pub fn training_flops(&self, lengths: impl IntoIterator<Item = usize>) -> f64 {
        let (p, a, h, v) = (
            self.layer_matmul_params as f64,
            self.attention_width as f64,
            self.hidden as f64,
            self.head_per_token as f64,
        );
        let forward: f64 = lengths
            .into_iter()
            .map(|l| {
                let l = l as f64;
                self.layers as f64 * (2.0 * l * p + 4.0 * l * l * a) + 2.0 * l * h * v
            })
            .sum();
        3.0 * forward
    }
}

/// Per sequence of a padded batch: its real length (the attention mask's ones) and the padded
/// length, for [`TransformerShape::training_flops`].
pub fn sequence_lengths(attention_mask: &Tensor) -> candle_core::Result<(Vec<usize>, Vec<usize>)> {
    let (n, padded) = attention_mask.dims2()?;
    let real: Vec<f32> = attention_mask.to_dtype(DType::F32)?.sum(1)?.to_vec1()?;
    Ok((real.iter().map(|&l| l as usize).collect(), vec![padded; n]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn training_flops_follow_the_formula() {
        // BERT-base: 12 layers, 768, 3072; one sequence of 128 tokens. Forward:
        // 12 * (2 * 128 * (4 * 768^2 + 2 * 768 * 3072) + 4 * 128^2 * 768) = 21.9 GFLOP.
        let bert = TransformerShape::dense(12, 768, 3072, 0);
        let f = bert.training_flops([128]);
        let forward = 12.0
            * (2.0 * 128.0 * (4.0 * 768.0 * 768.0 + 2.0 * 768.0 * 3072.0)
                + 4.0 * 128.0 * 128.0 * 768.0);
        assert_eq!(f, 3.0 * forward);
        // The 6N rule: without attention and head, 6 FLOPs per parameter of the layers per token.
        let params = 12.0 * (4.0 * 768.0 * 768.0 + 2.0 * 768.0 * 3072.0);
        assert!((f - 6.0 * params * 128.0) / f < 0.03);
        // Lengths add; a per-token head adds 6 h V per token.
        assert_eq!(
            bert.training_flops([100, 28]),
            bert.training_flops([100]) + bert.training_flops([28])
        );
        let lm = TransformerShape {
            head_per_token: 256,
            ..bert
        };
        assert_eq!(
            lm.training_flops([10]) - bert.training_flops([10]),
            6.0 * 10.0 * 768.0 * 256.0
        );
        let mask = Tensor::new(&[[1u32, 1, 1, 0], [1, 1, 0, 0]], &Device::Cpu).unwrap();
        assert_eq!(sequence_lengths(&mask).unwrap(), (vec![3, 2], vec![4, 4]));
    }
}
