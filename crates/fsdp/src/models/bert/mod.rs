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
    BertSelfAttention, LayerInput,
};

use crate::nn::composite_module;
use crate::nn::layers::Linear;
use crate::nn::module::{
    Forward, Model, Module, ModuleInfo, Params, Recompute, call_checkpointable, join,
};

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

    fn forward(&self, p: &dyn Params, (hidden, mask, seed): LayerInput<'a>) -> Result<Tensor> {
        let mut hidden = hidden.clone();
        for layer in &self.layer {
            let recompute = || -> Recompute {
                let (layer, mask) = (layer.clone(), mask.cloned());
                Arc::new(move |p: &dyn Params, x: &Tensor| {
                    layer.forward(p, (x, mask.as_ref(), seed))
                })
            };
            let plain = || layer.call(p, (&hidden, mask, seed));
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

impl Forward<&Tensor> for BertPooler {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, hidden: &Tensor) -> Result<Tensor> {
        let first = hidden.narrow(1, 0, 1)?.squeeze(1)?;
        self.dense.call(p, &first)?.tanh()
    }
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

impl<'a> Forward<BertInput<'a>> for BertModel {
    type Output = (Tensor, Tensor);

    fn forward(&self, p: &dyn Params, input: BertInput<'a>) -> Result<(Tensor, Tensor)> {
        let seed = self.dropout_seed;
        let hidden = self
            .embeddings
            .call(p, (input.input_ids, input.token_type_ids, seed))?;
        let (batch, seq) = input.input_ids.dims2()?;
        // Additive mask: 0 where attended, the dtype's lowest value elsewhere (as transformers).
        let mask = match input.attention_mask {
            None => None,
            Some(m) => {
                let dtype = hidden.dtype();
                let lowest = crate::models::mask_lowest(dtype);
                let m = m.to_dtype(dtype)?.reshape((batch, 1, 1, seq))?;
                Some(((m.ones_like()? - m)? * lowest)?)
            }
        };
        let hidden = self.encoder.call(p, (&hidden, mask.as_ref(), seed))?;
        let pooled = self.pooler.call(p, &hidden)?;
        Ok((hidden, pooled))
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
        let (_, pooled) = self.bert.call(p, input)?;
        self.classifier.call(p, &pooled)
    }
}

/// Index of the largest logit per row (for accuracy).
pub fn argmax(logits: &Tensor) -> Result<Tensor> {
    logits.argmax(D::Minus1)
}
