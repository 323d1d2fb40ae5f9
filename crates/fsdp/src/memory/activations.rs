//! An estimate of the activation memory a transformer's training step keeps for backward,
//! counted as Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
//! Transformer Models", section 4.1) count it for one layer: the values attention keeps
//! (its input, Q, K, V, the softmax output and its dropped-out copy, the output projection's
//! input), the MLP's input and its intermediate-width tensors, the two norms' inputs, and
//! one byte per element of each dropout mask — `34 s b h + 5 a s² b` bytes at 2 bytes a
//! value with a GELU MLP of width `4h`. fsdp-rs's fused attention and LM head keep less than
//! this count (no `s²` probabilities kept between forward and backward, no logits), so it is
//! an upper estimate of the layers' share; embeddings, the head and allocator slack are not
//! in it.

/// What a step's activations depend on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationShape {
    /// Transformer layers.
    pub layers: usize,
    /// Hidden size `h`.
    pub hidden: usize,
    /// Attention heads `a`.
    pub heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// A gated MLP (SwiGLU: gate, up and their product kept) rather than GELU's two.
    pub gated_mlp: bool,
    /// Dropout is on (its masks are kept).
    pub dropout: bool,
    /// Sequences per rank per micro-batch `b`.
    pub batch: usize,
    /// Tokens per sequence `s`.
    pub seq: usize,
    /// Bytes of one activation value (4 in f32, 2 in bf16/fp16).
    pub value_bytes: usize,
}

impl ActivationShape {
    /// One layer's kept activations, in bytes.
    pub fn layer_bytes(&self) -> u64 {
        let (s, b, h, a) = (
            self.seq as u64,
            self.batch as u64,
            self.hidden as u64,
            self.heads as u64,
        );
        let v = self.value_bytes as u64;
        let kept_wide = if self.gated_mlp { 3 } else { 2 };
        let values =
            8 * s * b * h + kept_wide * s * b * self.intermediate as u64 + 2 * a * s * s * b;
        let masks = if self.dropout {
            2 * s * b * h + a * s * s * b
        } else {
            0
        };
        v * values + masks
    }

    /// Every layer's kept activations, in bytes; with activation checkpointing each layer
    /// keeps only its input, plus one layer's whole set while it is recomputed.
    pub fn total_bytes(&self, checkpointing: bool) -> u64 {
        let layers = self.layers as u64;
        if checkpointing {
            let input = (self.seq * self.batch * self.hidden * self.value_bytes) as u64;
            layers * input + self.layer_bytes()
        } else {
            layers * self.layer_bytes()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_is_korthikantis_for_a_gelu_layer_at_two_bytes() {
        let shape = ActivationShape {
            layers: 24,
            hidden: 1024,
            heads: 16,
            intermediate: 4096,
            gated_mlp: false,
            dropout: true,
            batch: 4,
            seq: 512,
            value_bytes: 2,
        };
        let (s, b, h, a) = (512u64, 4u64, 1024u64, 16u64);
        assert_eq!(shape.layer_bytes(), 34 * s * b * h + 5 * a * s * s * b);
        assert_eq!(shape.total_bytes(false), 24 * shape.layer_bytes());
        assert_eq!(
            shape.total_bytes(true),
            24 * 2 * s * b * h + shape.layer_bytes()
        );
        // SwiGLU keeps a third intermediate-width tensor; no dropout, no masks.
        let llama = ActivationShape {
            gated_mlp: true,
            dropout: false,
            ..shape
        };
        assert_eq!(
            llama.layer_bytes(),
            2 * (8 * s * b * h + 3 * s * b * 4096 + 2 * a * s * s * b)
        );
    }
}
