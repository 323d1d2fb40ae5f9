//! BERT's embeddings and encoder layer as modules: `BertEmbeddings`, and `BertLayer` made of
//! `BertAttention` (`BertSelfAttention` + `BertSelfOutput`), `BertIntermediate` and
//! `BertOutput`.

use candle_core::{DType, Result, Tensor};

use super::config::BertConfig;
use crate::nn::composite_module;
use crate::nn::layers::{Dropout, Embedding, LayerNorm, Linear};
use crate::nn::module::{Forward, Module, ModuleInfo, Params, join};
use crate::nn::ops;
use crate::nn::ops::PackedSequences;

/// How a batch's tokens lie in the hidden states the layers pass on.
#[derive(Debug, Clone)]
pub enum TokenLayout {
    /// `[batch, seq, hidden]`, with an optional additive mask `[batch, 1, 1, seq]` (0 where
    /// attended, the dtype's lowest value on padding).
    Padded(Option<Tensor>),
    /// `[tokens, hidden]`: the real tokens of a right-padded batch end to end, each
    /// sequence attending within itself; dropout draws the padded batch's masks.
    Packed(PackedSequences),
}

impl TokenLayout {
    /// `x` through `dropout` (`None`: evaluation mode) as this layout's padded batch would be.
    fn dropout(&self, dropout: &Dropout, x: &Tensor, seed: Option<u64>) -> Result<Tensor> {
        match self {
            TokenLayout::Padded(_) => dropout.apply(x, seed),
            TokenLayout::Packed(seqs) => dropout.apply_packed(x, seed, seqs),
        }
    }
}

/// The input of a BERT encoder layer (and of the modules inside it): hidden states laid out
/// as the [`TokenLayout`] says, and the step's dropout seed (`None` in evaluation mode).
pub type LayerInput<'a> = (&'a Tensor, &'a TokenLayout, Option<u64>);

/// Word + position + token-type embeddings, LayerNorm, dropout (`BertEmbeddings`).
#[derive(Debug, Clone)]
pub struct BertEmbeddings {
    path: String,
    max_positions: usize,
    /// Token table (its `pad_token_id` row gets no gradient).
    pub word_embeddings: Embedding,
    /// Position table.
    pub position_embeddings: Embedding,
    /// Segment table.
    pub token_type_embeddings: Embedding,
    /// The normalisation of the sum.
    pub layer_norm: LayerNorm,
    dropout: Dropout,
}

impl BertEmbeddings {
    /// Embeddings at `path` for `c`.
    pub fn new(path: String, c: &BertConfig) -> BertEmbeddings {
        let (h, std) = (c.hidden_size, c.initializer_range);
        let p = |leaf: &str| join(&path, leaf);
        BertEmbeddings {
            max_positions: c.max_position_embeddings,
            word_embeddings: Embedding::new(p("word_embeddings"), c.vocab_size, h, std)
                .with_padding_idx(c.pad_token_id),
            position_embeddings: Embedding::new(
                p("position_embeddings"),
                c.max_position_embeddings,
                h,
                std,
            ),
            token_type_embeddings: Embedding::new(
                p("token_type_embeddings"),
                c.type_vocab_size,
                h,
                std,
            ),
            layer_norm: LayerNorm::new(p("LayerNorm"), h, c.layer_norm_eps),
            dropout: Dropout::new(path.clone(), c.hidden_dropout_prob),
            path,
        }
    }
}

composite_module!(
    BertEmbeddings,
    "BertEmbeddings",
    [
        word_embeddings,
        position_embeddings,
        token_type_embeddings,
        layer_norm
    ]
);

/// What the embeddings read: token ids `[batch, seq]`, optional token types, the packing of
/// the batch's real tokens (`None`: every position embedded, `[batch, seq, hidden]` out), and
/// the dropout seed.
pub type EmbeddingsInput<'a> = (
    &'a Tensor,
    Option<&'a Tensor>,
    Option<&'a PackedSequences>,
    Option<u64>,
);

impl<'a> Forward<EmbeddingsInput<'a>> for BertEmbeddings {
    type Output = Tensor;

    fn forward(
        &self,
        p: &dyn Params,
        (ids, types, packed, seed): EmbeddingsInput<'a>,
    ) -> Result<Tensor> {
        let (batch, seq) = ids.dims2()?;
        if seq > self.max_positions {
            return Err(candle_core::Error::Msg(format!(
                "sequence length {seq} exceeds max_position_embeddings {}",
                self.max_positions
            )));
        }
        let device = ids.device();
        // What is looked up: every position of the batch, or (packed) each real token's id,
        // position and type picked out of it.
        let (ids, positions, types) = match packed {
            None => (
                ids.clone(),
                Tensor::arange(0u32, seq as u32, device)?,
                match types {
                    Some(t) => t.clone(),
                    None => Tensor::zeros((batch, seq), DType::U32, device)?,
                },
            ),
            Some(seqs) => {
                let rows = Tensor::from_slice(seqs.padded_rows(), seqs.tokens(), device)?;
                let real = |t: &Tensor| t.flatten_all()?.index_select(&rows, 0);
                (
                    real(ids)?,
                    Tensor::from_vec(seqs.positions(), seqs.tokens(), device)?,
                    match types {
                        Some(t) => real(t)?,
                        None => Tensor::zeros(seqs.tokens(), DType::U32, device)?,
                    },
                )
            }
        };
        let words = self.word_embeddings.call(p, &ids)?;
        let pos = self.position_embeddings.call(p, &positions)?;
        let typ = self.token_type_embeddings.call(p, &types)?;
        let emb = (words.broadcast_add(&pos)? + typ)?;
        let hidden = self.layer_norm.call(p, &emb)?;
        match packed {
            None => self.dropout.apply(&hidden, seed),
            Some(seqs) => self.dropout.apply_packed(&hidden, seed, seqs),
        }
    }
}

/// Query, key and value projections and scaled dot-product attention (`BertSelfAttention`).
#[derive(Debug, Clone)]
pub struct BertSelfAttention {
    path: String,
    heads: usize,
    /// Query projection.
    pub query: Linear,
    /// Key projection.
    pub key: Linear,
    /// Value projection.
    pub value: Linear,
    dropout: Dropout,
}

composite_module!(BertSelfAttention, "BertSelfAttention", [query, key, value]);

impl<'a> Forward<LayerInput<'a>> for BertSelfAttention {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, (hidden, layout, seed): LayerInput<'a>) -> Result<Tensor> {
        // Three GEMMs, not one over stacked weights: a stacked copy of the weights would stay
        // alive in the graph until backward, outside what FSDP frees after the forward.
        let q = self.query.call(p, hidden)?;
        let k = self.key.call(p, hidden)?;
        let v = self.value.call(p, hidden)?;
        let dropout = self.dropout.seed(seed);
        match layout {
            TokenLayout::Padded(mask) => {
                ops::scaled_dot_product_attention(&q, &k, &v, self.heads, mask.as_ref(), dropout)
            }
            TokenLayout::Packed(seqs) => {
                let heads = ops::AttentionHeads::full(self.heads);
                ops::varlen_attention(&q, &k, &v, heads, seqs, dropout)
            }
        }
    }
}

/// A sub-layer's output: dense projection, dropout, residual add and LayerNorm
/// (`BertSelfOutput` after attention, `BertOutput` after the feed-forward block).
#[derive(Debug, Clone)]
pub struct BertResidualOutput {
    path: String,
    type_name: &'static str,
    /// The projection.
    pub dense: Linear,
    /// The normalisation of the residual sum.
    pub layer_norm: LayerNorm,
    dropout: Dropout,
}

impl BertResidualOutput {
    fn new(
        path: String,
        type_name: &'static str,
        d_in: usize,
        c: &BertConfig,
    ) -> BertResidualOutput {
        BertResidualOutput {
            dense: Linear::new(
                join(&path, "dense"),
                d_in,
                c.hidden_size,
                c.initializer_range,
            ),
            layer_norm: LayerNorm::new(join(&path, "LayerNorm"), c.hidden_size, c.layer_norm_eps),
            dropout: Dropout::new(path.clone(), c.hidden_dropout_prob),
            type_name,
            path,
        }
    }
}

impl Module for BertResidualOutput {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new(self.path.clone(), self.type_name)
            .child(self.dense.info())
            .child(self.layer_norm.info())
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        vec![&mut self.dense, &mut self.layer_norm]
    }
}

/// A residual sub-layer's input: its input, the residual, their layout and the dropout seed.
pub type ResidualInput<'a> = (&'a Tensor, &'a Tensor, &'a TokenLayout, Option<u64>);

impl<'a> Forward<ResidualInput<'a>> for BertResidualOutput {
    type Output = Tensor;

    fn forward(
        &self,
        p: &dyn Params,
        (x, residual, layout, seed): ResidualInput<'a>,
    ) -> Result<Tensor> {
        let y = self.dense.call(p, x)?;
        let y = layout.dropout(&self.dropout, &y, seed)?;
        self.layer_norm.call(p, (&y, residual))
    }
}

/// Self-attention and its output sub-layer (`BertAttention`).
#[derive(Debug, Clone)]
pub struct BertAttention {
    path: String,
    /// The attention.
    pub self_attention: BertSelfAttention,
    /// Projection, dropout, residual and LayerNorm.
    pub output: BertResidualOutput,
}

composite_module!(BertAttention, "BertAttention", [self_attention, output]);

impl<'a> Forward<LayerInput<'a>> for BertAttention {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, input: LayerInput<'a>) -> Result<Tensor> {
        let ctx = self.self_attention.call(p, input)?;
        self.output.call(p, (&ctx, input.0, input.1, input.2))
    }
}

/// The feed-forward expansion with GELU fused in (`BertIntermediate`).
#[derive(Debug, Clone)]
pub struct BertIntermediate {
    path: String,
    /// Linear + GELU.
    pub dense: Linear,
}

composite_module!(BertIntermediate, "BertIntermediate", [dense]);

impl Forward<&Tensor> for BertIntermediate {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, x: &Tensor) -> Result<Tensor> {
        self.dense.call(p, x)
    }
}

/// One encoder layer (`BertLayer`): attention, then the feed-forward block.
#[derive(Debug, Clone)]
pub struct BertLayer {
    path: String,
    /// Attention with its output sub-layer.
    pub attention: BertAttention,
    /// Feed-forward expansion.
    pub intermediate: BertIntermediate,
    /// Feed-forward output sub-layer.
    pub output: BertResidualOutput,
}

impl BertLayer {
    /// Layer module at `path` for `c`.
    pub fn new(path: String, c: &BertConfig) -> Result<BertLayer> {
        c.head_dim()?;
        let (h, std) = (c.hidden_size, c.initializer_range);
        let p = |leaf: &str| join(&path, leaf);
        let s = |leaf: &str| p(&format!("attention.self.{leaf}"));
        Ok(BertLayer {
            attention: BertAttention {
                self_attention: BertSelfAttention {
                    heads: c.num_attention_heads,
                    query: Linear::new(s("query"), h, h, std),
                    key: Linear::new(s("key"), h, h, std),
                    value: Linear::new(s("value"), h, h, std),
                    dropout: Dropout::new(p("attention.self"), c.attention_probs_dropout_prob),
                    path: p("attention.self"),
                },
                output: BertResidualOutput::new(p("attention.output"), "BertSelfOutput", h, c),
                path: p("attention"),
            },
            intermediate: BertIntermediate {
                dense: Linear::new(p("intermediate.dense"), h, c.intermediate_size, std)
                    .with_gelu(c.gelu()?),
                path: p("intermediate"),
            },
            output: BertResidualOutput::new(p("output"), "BertOutput", c.intermediate_size, c),
            path,
        })
    }
}

composite_module!(BertLayer, "BertLayer", [attention, intermediate, output]);

impl<'a> Forward<LayerInput<'a>> for BertLayer {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, input: LayerInput<'a>) -> Result<Tensor> {
        let attn = self.attention.call(p, input)?;
        let inter = self.intermediate.call(p, &attn)?;
        self.output.call(p, (&inter, &attn, input.1, input.2))
    }
}
