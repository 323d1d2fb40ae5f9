//! BERT (`BertModel`, `BertForSequenceClassification`) with Hugging Face tensor names and
//! semantics: word + position + token-type embeddings, post-LayerNorm encoder layers, pooler
//! on the first token with tanh, classifier.

mod config;
mod layer;

use std::sync::Arc;

use candle_core::{D, Result, Tensor};

pub use config::BertConfig;
pub use layer::{
    BertAttention, BertEmbeddings, BertIntermediate, BertLayer, BertResidualOutput,
    BertSelfAttention, EmbeddingsInput, LayerInput, ResidualInput, TokenLayout,
};

use crate::nn::composite_module;
use crate::nn::layers::Linear;
use crate::nn::module::{
    Forward, Model, Module, ModuleInfo, Params, Recompute, call_checkpointable, join,
};
use crate::nn::ops::PackedSequences;

/// What BERT reads: token ids [batch, seq], an optional attention mask (1 = attend) and
/// optional token types (default all zeros).
#[derive(Debug, Clone, Copy)]
pub struct BertInput<'a> {
    /// Token ids.
    pub input_ids: &'a Tensor,
    /// 1 where a token is attended, 0 for padding.
    pub attention_mask: Option<&'a Tensor>,
    /// Segment ids.
    pub token_type_ids: Option<&'a Tensor>,
}

/// The stack of layers (`BertEncoder`).
#[derive(Debug, Clone)]
pub struct BertEncoder {
    path: String,
    /// The layers, `layer.0` first.
    pub layer: Vec<BertLayer>,
}

impl Module for BertEncoder {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        self.layer
            .iter()
            .fold(ModuleInfo::new(self.path.clone(), "BertEncoder"), |m, l| {
                m.child(l.info())
            })
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        self.layer
            .iter_mut()
            .map(|l| l as &mut dyn Module)
            .collect()
    }
}

impl<'a> Forward<LayerInput<'a>> for BertEncoder {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, (hidden, layout, seed): LayerInput<'a>) -> Result<Tensor> {
        let mut hidden = hidden.clone();
        for layer in &self.layer {
            let recompute = || -> Recompute {
                let (layer, layout) = (layer.clone(), layout.clone());
                Arc::new(move |p: &dyn Params, x: &Tensor| layer.forward(p, (x, &layout, seed)))
            };
            let plain = || layer.call(p, (&hidden, layout, seed));
            hidden = call_checkpointable(p, layer.path(), &hidden, recompute, plain)?;
        }
        Ok(hidden)
    }
}

/// Dense + tanh on the first token (`BertPooler`).
#[derive(Debug, Clone)]
pub struct BertPooler {
    path: String,
    /// The projection.
    pub dense: Linear,
}

composite_module!(BertPooler, "BertPooler", [dense]);

impl Forward<(&Tensor, &TokenLayout)> for BertPooler {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, (hidden, layout): (&Tensor, &TokenLayout)) -> Result<Tensor> {
        let first = match layout {
            TokenLayout::Padded(_) => hidden.narrow(1, 0, 1)?.squeeze(1)?,
            TokenLayout::Packed(seqs) => {
                let rows = Tensor::from_vec(seqs.first_rows(), seqs.sequences(), hidden.device())?;
                hidden.index_select(&rows, 0)?
            }
        };
        self.dense.call(p, &first)?.tanh()
    }
}

/// The real-token lengths of a right-padded `attention_mask` `[batch, seq]` (each row ones,
/// then zeros, at least one one), or `None` for any other mask.
fn right_padded_lengths(mask: &Tensor) -> Result<Option<Vec<usize>>> {
    let rows: Vec<Vec<f32>> = mask.to_dtype(candle_core::DType::F32)?.to_vec2()?;
    Ok(rows
        .iter()
        .map(|row| {
            let n = row.iter().take_while(|&&m| m == 1.0).count();
            (n > 0 && row[n..].iter().all(|&m| m == 0.0)).then_some(n)
        })
        .collect())
}

/// The encoder: embeddings, layers, pooler. Its path is `bert` inside task models, empty for
/// a bare `BertModel`.
#[derive(Debug, Clone)]
pub struct BertModel {
    /// Its configuration.
    pub config: BertConfig,
    path: String,
    /// Training mode: dropout is active, with masks drawn from this seed (set a new one each
    /// step, e.g. from the run seed, rank and step). `None` is evaluation mode.
    pub dropout_seed: Option<u64>,
    /// Whether a right-padded batch (an `attention_mask` of ones, then zeros, per row) is
    /// computed on its real tokens only, end to end, instead of padded and masked: the same
    /// values (dropout draws the padded batch's masks) up to the order of sums over tokens,
    /// without the padding's work. On by default, on every device (on a GPU, attention over
    /// packed sequences runs on fsdp-nn's kernels in f32 and bf16).
    pub pack_sequences: bool,
    /// Embeddings.
    pub embeddings: BertEmbeddings,
    /// Layers.
    pub encoder: BertEncoder,
    /// Pooler.
    pub pooler: BertPooler,
}

impl BertModel {
    /// A model whose parameter names start with `prefix`; an error for a configuration that
    /// cannot work (heads not dividing the hidden size, an unknown activation).
    pub fn new(config: BertConfig, prefix: &str) -> Result<BertModel> {
        config.validate()?;
        let p = |leaf: &str| join(prefix, leaf);
        let layer = (0..config.num_hidden_layers)
            .map(|i| BertLayer::new(p(&format!("encoder.layer.{i}")), &config))
            .collect::<Result<Vec<_>>>()?;
        Ok(BertModel {
            embeddings: BertEmbeddings::new(p("embeddings"), &config),
            encoder: BertEncoder {
                path: p("encoder"),
                layer,
            },
            pooler: BertPooler {
                dense: Linear::new(
                    p("pooler.dense"),
                    config.hidden_size,
                    config.hidden_size,
                    config.initializer_range,
                ),
                path: p("pooler"),
            },
            path: prefix.to_string(),
            dropout_seed: None,
            pack_sequences: true,
            config,
        })
    }

    /// The module types that make good FSDP units (transformers' `_no_split_modules`).
    pub fn no_split_modules() -> &'static [&'static str] {
        &["BertEmbeddings", "BertLayer"]
    }

    /// Sequence output [batch, seq, hidden] and pooled output [batch, hidden].
    /// `attention_mask` (1 = attend) and `token_type_ids` default to all ones and all zeros.
    pub fn forward(
        &self,
        p: &dyn Params,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        self.call(
            p,
            BertInput {
                input_ids,
                attention_mask,
                token_type_ids,
            },
        )
    }
}

composite_module!(BertModel, "BertModel", [embeddings, encoder, pooler]);

impl Model for BertModel {
    fn no_split_modules(&self) -> &'static [&'static str] {
        BertModel::no_split_modules()
    }
}

impl BertModel {
    /// The packing of `input`'s real tokens, when it is computed packed.
    fn packing(&self, input: &BertInput<'_>) -> Result<Option<PackedSequences>> {
        let Some(mask) = input.attention_mask else {
            return Ok(None);
        };
        if !self.pack_sequences {
            return Ok(None);
        }
        let seq = input.input_ids.dim(1)?;
        match right_padded_lengths(mask)? {
            Some(lengths) if lengths.iter().any(|&n| n < seq) => {
                Ok(Some(PackedSequences::from_lengths(&lengths, seq)?))
            }
            _ => Ok(None),
        }
    }

    /// The last layer's hidden states, their layout and the pooled output.
    fn encode(
        &self,
        p: &dyn Params,
        input: BertInput<'_>,
    ) -> Result<(Tensor, TokenLayout, Tensor)> {
        let seed = self.dropout_seed;
        let packed = self.packing(&input)?;
        let hidden = self.embeddings.call(
            p,
            (input.input_ids, input.token_type_ids, packed.as_ref(), seed),
        )?;
        let layout = match packed {
            Some(seqs) => TokenLayout::Packed(seqs),
            // Additive mask: 0 where attended, the dtype's lowest value elsewhere (as
            // transformers).
            None => TokenLayout::Padded(match input.attention_mask {
                None => None,
                Some(m) => {
                    let (batch, seq) = input.input_ids.dims2()?;
                    let dtype = hidden.dtype();
                    let lowest = crate::models::mask_lowest(dtype);
                    let m = m.to_dtype(dtype)?.reshape((batch, 1, 1, seq))?;
                    Some(((m.ones_like()? - m)? * lowest)?)
                }
            }),
        };
        let hidden = self.encoder.call(p, (&hidden, &layout, seed))?;
        let pooled = self.pooler.call(p, (&hidden, &layout))?;
        Ok((hidden, layout, pooled))
    }
}

impl<'a> Forward<BertInput<'a>> for BertModel {
    type Output = (Tensor, Tensor);

    /// Sequence output `[batch, seq, hidden]` (zeros past each sequence's end when computed
    /// packed) and pooled output `[batch, hidden]`.
    fn forward(&self, p: &dyn Params, input: BertInput<'a>) -> Result<(Tensor, Tensor)> {
        let (hidden, layout, pooled) = self.encode(p, input)?;
        let hidden = match &layout {
            TokenLayout::Padded(_) => hidden,
            TokenLayout::Packed(seqs) => seqs.pad(&hidden)?,
        };
        Ok((hidden, pooled))
    }
}

/// A [`BertInput`] for which only the pooled output is wanted (a sequence classifier's):
/// packed hidden states are not laid back into the padded batch.
#[derive(Debug, Clone, Copy)]
pub struct PooledOnly<'a>(pub BertInput<'a>);

impl<'a> Forward<PooledOnly<'a>> for BertModel {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, input: PooledOnly<'a>) -> Result<Tensor> {
        Ok(self.encode(p, input.0)?.2)
    }
}

/// BERT with a classification head (`classifier` on the pooled output).
#[derive(Debug, Clone)]
pub struct BertForSequenceClassification {
    /// The encoder, named `bert.*`.
    pub bert: BertModel,
    /// The head.
    pub classifier: Linear,
}

impl BertForSequenceClassification {
    /// A model for `config` (its `num_labels` outputs).
    pub fn new(config: BertConfig) -> Result<Self> {
        let classifier = Linear::new(
            "classifier".into(),
            config.hidden_size,
            config.num_labels,
            config.initializer_range,
        );
        Ok(BertForSequenceClassification {
            bert: BertModel::new(config, "bert")?,
            classifier,
        })
    }

    /// Logits [batch, num_labels].
    pub fn forward(
        &self,
        p: &dyn Params,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.call(
            p,
            BertInput {
                input_ids,
                attention_mask,
                token_type_ids,
            },
        )
    }
}

impl Module for BertForSequenceClassification {
    fn path(&self) -> &str {
        ""
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new("", "BertForSequenceClassification")
            .child(self.bert.info())
            .child(self.classifier.info())
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        vec![&mut self.bert, &mut self.classifier]
    }
}

impl Model for BertForSequenceClassification {
    fn no_split_modules(&self) -> &'static [&'static str] {
        BertModel::no_split_modules()
    }
}

impl<'a> Forward<BertInput<'a>> for BertForSequenceClassification {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, input: BertInput<'a>) -> Result<Tensor> {
        let pooled = self.bert.call(p, PooledOnly(input))?;
        self.classifier.call(p, &pooled)
    }
}

/// Index of the largest logit per row (for accuracy).
pub fn argmax(logits: &Tensor) -> Result<Tensor> {
    logits.argmax(D::Minus1)
}
