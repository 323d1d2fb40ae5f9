//! BERT (`BertModel`, `BertForSequenceClassification`) with Hugging Face tensor names and
//! semantics: word + position + token-type embeddings, post-LayerNorm encoder layers, pooler
//! on the first token with tanh, classifier.

use std::path::Path;

use candle_core::{D, DType, Result, Tensor};
use serde::Deserialize;

use super::site_seed;
use crate::nn::layers::{
    add_layer_norm, embedding, embedding_info, layer_norm, layer_norm_info, linear, linear_gelu,
    linear_info,
};
use crate::nn::module::{ModuleInfo, Params};
use crate::nn::ops::{self, GeluApprox};

/// The fields of a Hugging Face BERT `config.json` this implementation uses.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Feed-forward inner size.
    pub intermediate_size: usize,
    /// Activation: `gelu` (erf form) or `gelu_new` / `gelu_pytorch_tanh` (tanh form).
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Position table size.
    pub max_position_embeddings: usize,
    /// Token-type table size.
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Standard deviation of the normal initialisation.
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
    /// Hidden dropout (training runs here support 0 only until dropout lands).
    #[serde(default)]
    pub hidden_dropout_prob: f64,
    /// Attention dropout (as above).
    #[serde(default)]
    pub attention_probs_dropout_prob: f64,
    /// Labels of the classification head.
    #[serde(default = "default_labels")]
    pub num_labels: usize,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_init_range() -> f64 {
    0.02
}
fn default_labels() -> usize {
    2
}

impl Default for BertConfig {
    /// The small BERT of the reference run: vocabulary 8192, hidden 256, 4 layers of 4 heads,
    /// feed-forward 1024, 128 positions, exact GELU, no dropout, 2 labels.
    fn default() -> Self {
        BertConfig {
            vocab_size: 8192,
            hidden_size: 256,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            intermediate_size: 1024,
            hidden_act: default_act(),
            max_position_embeddings: 128,
            type_vocab_size: default_type_vocab(),
            layer_norm_eps: default_eps(),
            initializer_range: default_init_range(),
            hidden_dropout_prob: 0.0,
            attention_probs_dropout_prob: 0.0,
            num_labels: default_labels(),
        }
    }
}

impl BertConfig {
    /// Parses `config.json` text.
    pub fn from_json(text: &str) -> Result<BertConfig> {
        serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("invalid BERT config: {e}")))
    }

    /// Reads a `config.json` file.
    pub fn from_file(path: &Path) -> Result<BertConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
        BertConfig::from_json(&text)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))
    }

    fn gelu(&self) -> Result<GeluApprox> {
        match self.hidden_act.as_str() {
            "gelu" => Ok(GeluApprox::Erf),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(GeluApprox::Tanh),
            other => Err(candle_core::Error::Msg(format!(
                "unsupported hidden_act {other:?}"
            ))),
        }
    }

    fn head_dim(&self) -> Result<usize> {
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err(candle_core::Error::Msg(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            )));
        }
        Ok(self.hidden_size / self.num_attention_heads)
    }
}

/// The encoder: embeddings, layers, pooler. `prefix` is `bert` inside task models, empty for
/// a bare `BertModel`.
#[derive(Debug, Clone)]
pub struct BertModel {
    /// Its configuration.
    pub config: BertConfig,
    prefix: String,
    /// Training mode: dropout is active, with masks drawn from this seed (set a new one each
    /// step, e.g. from the run seed, rank and step). `None` is evaluation mode.
    pub dropout_seed: Option<u64>,
}

fn join(prefix: &str, leaf: &str) -> String {
    if prefix.is_empty() {
        leaf.to_string()
    } else {
        format!("{prefix}.{leaf}")
    }
}

impl BertModel {
    /// A model whose parameter names start with `prefix`.
    pub fn new(config: BertConfig, prefix: &str) -> BertModel {
        BertModel {
            config,
            prefix: prefix.to_string(),
            dropout_seed: None,
        }
    }

    /// The module tree (types `BertEmbeddings`, `BertLayer`, `BertPooler`, ...).
    pub fn info(&self) -> ModuleInfo {
        let c = &self.config;
        let (h, std) = (c.hidden_size, c.initializer_range);
        let p = |leaf: &str| join(&self.prefix, leaf);
        let embeddings = ModuleInfo::new(p("embeddings"), "BertEmbeddings")
            .child(embedding_info(
                p("embeddings.word_embeddings"),
                c.vocab_size,
                h,
                std,
            ))
            .child(embedding_info(
                p("embeddings.position_embeddings"),
                c.max_position_embeddings,
                h,
                std,
            ))
            .child(embedding_info(
                p("embeddings.token_type_embeddings"),
                c.type_vocab_size,
                h,
                std,
            ))
            .child(layer_norm_info(p("embeddings.LayerNorm"), h));
        let mut encoder = ModuleInfo::new(p("encoder"), "BertEncoder");
        for i in 0..c.num_hidden_layers {
            let l = |leaf: &str| p(&format!("encoder.layer.{i}.{leaf}"));
            let layer = ModuleInfo::new(l("").trim_end_matches('.').to_string(), "BertLayer")
                .child(
                    ModuleInfo::new(l("attention"), "BertAttention")
                        .child(
                            ModuleInfo::new(l("attention.self"), "BertSelfAttention")
                                .child(linear_info(l("attention.self.query"), h, h, std))
                                .child(linear_info(l("attention.self.key"), h, h, std))
                                .child(linear_info(l("attention.self.value"), h, h, std)),
                        )
                        .child(
                            ModuleInfo::new(l("attention.output"), "BertSelfOutput")
                                .child(linear_info(l("attention.output.dense"), h, h, std))
                                .child(layer_norm_info(l("attention.output.LayerNorm"), h)),
                        ),
                )
                .child(
                    ModuleInfo::new(l("intermediate"), "BertIntermediate").child(linear_info(
                        l("intermediate.dense"),
                        h,
                        c.intermediate_size,
                        std,
                    )),
                )
                .child(
                    ModuleInfo::new(l("output"), "BertOutput")
                        .child(linear_info(l("output.dense"), c.intermediate_size, h, std))
                        .child(layer_norm_info(l("output.LayerNorm"), h)),
                );
            encoder = encoder.child(layer);
        }
        let pooler = ModuleInfo::new(p("pooler"), "BertPooler").child(linear_info(
            p("pooler.dense"),
            h,
            h,
            std,
        ));
        ModuleInfo::new(self.prefix.clone(), "BertModel")
            .child(embeddings)
            .child(encoder)
            .child(pooler)
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
        let c = &self.config;
        let pre = |leaf: &str| join(&self.prefix, leaf);
        let (batch, seq) = input_ids.dims2()?;
        if seq > c.max_position_embeddings {
            return Err(candle_core::Error::Msg(format!(
                "sequence length {seq} exceeds max_position_embeddings {}",
                c.max_position_embeddings
            )));
        }
        let device = input_ids.device();
        // Embeddings.
        let words = embedding(p, &pre("embeddings.word_embeddings"), input_ids)?;
        let positions = Tensor::arange(0u32, seq as u32, device)?;
        let pos = embedding(p, &pre("embeddings.position_embeddings"), &positions)?;
        let types = match token_type_ids {
            Some(t) => t.clone(),
            None => Tensor::zeros((batch, seq), DType::U32, device)?,
        };
        let typ = embedding(p, &pre("embeddings.token_type_embeddings"), &types)?;
        let emb = (words.broadcast_add(&pos)? + typ)?;
        let hidden = layer_norm(p, &pre("embeddings.LayerNorm"), &emb, c.layer_norm_eps)?;
        let mut hidden = self.dropout(&hidden, c.hidden_dropout_prob, &pre("embeddings"))?;
        hidden = p.module_output(&pre("embeddings"), hidden)?;
        // Additive mask: 0 where attended, the dtype's lowest value elsewhere (as transformers).
        let mask = match attention_mask {
            None => None,
            Some(m) => {
                let dtype = hidden.dtype();
                let lowest = if dtype == DType::F64 {
                    f64::MIN
                } else {
                    f32::MIN as f64
                };
                let m = m.to_dtype(dtype)?.reshape((batch, 1, 1, seq))?;
                Some(((m.ones_like()? - m)? * lowest)?)
            }
        };
        for i in 0..c.num_hidden_layers {
            hidden = self.layer(p, i, &hidden, mask.as_ref())?;
            hidden = p.module_output(&pre(&format!("encoder.layer.{i}")), hidden)?;
        }
        let hidden = p.module_output(&pre("encoder"), hidden)?;
        let first = hidden.narrow(1, 0, 1)?.squeeze(1)?;
        let pooled = linear(p, &pre("pooler.dense"), &first)?.tanh()?;
        let pooled = p.module_output(&pre("pooler"), pooled)?;
        // Both outputs of the model module are computed before either is hooked.
        let hidden = p.module_output(&self.prefix, hidden)?;
        let pooled = p.module_output(&self.prefix, pooled)?;
        Ok((hidden, pooled))
    }
}

impl BertModel {
    /// Encoder layer `i` on `hidden` [batch, seq, hidden] with an optional additive mask
    /// [batch, 1, 1, seq].
    pub fn layer(
        &self,
        p: &dyn Params,
        i: usize,
        hidden: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = &self.config;
        c.head_dim()?; // checks that the heads divide the hidden size
        let heads = c.num_attention_heads;
        let l = |leaf: &str| join(&self.prefix, &format!("encoder.layer.{i}.{leaf}"));
        // Three GEMMs, not one over stacked weights: a stacked copy of the weights would stay
        // alive in the graph until backward, outside what FSDP frees after the forward.
        let q = linear(p, &l("attention.self.query"), hidden)?;
        let k = linear(p, &l("attention.self.key"), hidden)?;
        let v = linear(p, &l("attention.self.value"), hidden)?;
        let probs_dropout = match self.dropout_seed {
            Some(seed) if c.attention_probs_dropout_prob > 0.0 => Some((
                c.attention_probs_dropout_prob,
                site_seed(seed, &l("attention.self")),
            )),
            _ => None,
        };
        let ctx = ops::scaled_dot_product_attention(&q, &k, &v, heads, mask, probs_dropout)?;
        let ctx = p.module_output(&l("attention.self"), ctx)?;
        let attn = linear(p, &l("attention.output.dense"), &ctx)?;
        let attn = self.dropout(&attn, c.hidden_dropout_prob, &l("attention.output"))?;
        let attn = add_layer_norm(
            p,
            &l("attention.output.LayerNorm"),
            &attn,
            hidden,
            c.layer_norm_eps,
        )?;
        let attn = p.module_output(&l("attention.output"), attn)?;
        let attn = p.module_output(&l("attention"), attn)?;
        let inter = linear_gelu(p, &l("intermediate.dense"), &attn, c.gelu()?)?;
        let inter = p.module_output(&l("intermediate"), inter)?;
        let out = linear(p, &l("output.dense"), &inter)?;
        let out = self.dropout(&out, c.hidden_dropout_prob, &l("output"))?;
        let out = add_layer_norm(p, &l("output.LayerNorm"), &out, &attn, c.layer_norm_eps)?;
        p.module_output(&l("output"), out)
    }

    /// Dropout at a call site in training mode; identity in evaluation mode.
    fn dropout(&self, x: &Tensor, prob: f64, site: &str) -> Result<Tensor> {
        match self.dropout_seed {
            Some(seed) if prob > 0.0 => ops::dropout(x, prob, site_seed(seed, site)),
            _ => Ok(x.clone()),
        }
    }
}

/// BERT with a classification head (`classifier` on the pooled output).
#[derive(Debug, Clone)]
pub struct BertForSequenceClassification {
    /// The encoder, named `bert.*`.
    pub bert: BertModel,
}

impl BertForSequenceClassification {
    /// A model for `config` (its `num_labels` outputs).
    pub fn new(config: BertConfig) -> Self {
        BertForSequenceClassification {
            bert: BertModel::new(config, "bert"),
        }
    }

    /// The module tree.
    pub fn info(&self) -> ModuleInfo {
        let c = &self.bert.config;
        ModuleInfo::new("", "BertForSequenceClassification")
            .child(self.bert.info())
            .child(linear_info(
                "classifier".into(),
                c.hidden_size,
                c.num_labels,
                c.initializer_range,
            ))
    }

    /// Logits [batch, num_labels].
    pub fn forward(
        &self,
        p: &dyn Params,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (_, pooled) = self
            .bert
            .forward(p, input_ids, attention_mask, token_type_ids)?;
        linear(p, "classifier", &pooled)
    }
}

/// Index of the largest logit per row (for accuracy).
pub fn argmax(logits: &Tensor) -> Result<Tensor> {
    logits.argmax(D::Minus1)
}
