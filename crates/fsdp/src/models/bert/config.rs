//! [`BertConfig`]: the fields of a Hugging Face BERT `config.json` this implementation uses.

use std::path::Path;

use candle_core::Result;
use serde::{Deserialize, Serialize};

use crate::nn::ops::GeluApprox;

/// The fields of a Hugging Face BERT `config.json` this implementation uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Dropout on the embeddings and on each sub-layer's output, in training mode.
    #[serde(default)]
    pub hidden_dropout_prob: f64,
    /// Dropout on the attention probabilities, in training mode.
    #[serde(default)]
    pub attention_probs_dropout_prob: f64,
    /// Labels of the classification head.
    #[serde(default = "default_labels")]
    pub num_labels: usize,
    /// The padding token: its word-embedding row gets no gradient (`nn.Embedding`'s
    /// `padding_idx`, as transformers builds BERT).
    #[serde(default = "default_pad")]
    pub pad_token_id: Option<usize>,
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
fn default_pad() -> Option<usize> {
    Some(0)
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
            pad_token_id: default_pad(),
        }
    }
}

impl BertConfig {
    /// The sizes its training FLOPs depend on: dense layers, and a classification head that
    /// reads one token per sequence.
    pub fn transformer_shape(&self) -> crate::models::TransformerShape {
        let (layers, h, i) = (
            self.num_hidden_layers,
            self.hidden_size,
            self.intermediate_size,
        );
        crate::models::TransformerShape::dense(layers, h, i, 0)
    }

    /// Parses `config.json` text.
    pub fn from_json(text: &str) -> Result<BertConfig> {
        serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("invalid BERT config: {e}")))
    }

    /// Checks the sizes against bounds and the memory present, and the epsilon (see
    /// `models::bounds`): a crafted size is an error naming its key, not an abort.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size, None),
            ("hidden_size", self.hidden_size, None),
            (
                "num_hidden_layers",
                self.num_hidden_layers,
                Some(super::super::bounds::MAX_LAYERS),
            ),
            ("num_attention_heads", self.num_attention_heads, None),
            ("intermediate_size", self.intermediate_size, None),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                None,
            ),
            ("type_vocab_size", self.type_vocab_size, None),
            ("num_labels", self.num_labels, None),
        ];
        let params = || {
            let w = |x: usize| x as u128;
            let (h, i) = (w(self.hidden_size), w(self.intermediate_size));
            let tables =
                w(self.vocab_size) + w(self.max_position_embeddings) + w(self.type_vocab_size);
            let layer = 4 * h * h + 2 * h * i + 9 * h + i;
            tables * h + w(self.num_hidden_layers) * layer + h * h + (h + 1) * w(self.num_labels)
        };
        super::super::bounds::check(
            "BERT",
            &sizes,
            params,
            ("layer_norm_eps", self.layer_norm_eps),
        )
    }

    /// `config.json` as transformers writes it for `architecture` (such as
    /// `BertForSequenceClassification`), for `save_pretrained`.
    pub fn to_hf_json(&self, architecture: &str) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let Some(map) = v.as_object_mut() {
            map.insert("model_type".into(), "bert".into());
            map.insert("architectures".into(), serde_json::json!([architecture]));
        }
        v
    }

    /// Reads a `config.json` file.
    pub fn from_file(path: &Path) -> Result<BertConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
        BertConfig::from_json(&text)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))
    }

    pub(super) fn gelu(&self) -> Result<GeluApprox> {
        match self.hidden_act.as_str() {
            "gelu" => Ok(GeluApprox::Erf),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(GeluApprox::Tanh),
            other => Err(candle_core::Error::Msg(format!(
                "unsupported hidden_act {other:?}"
            ))),
        }
    }

    pub(super) fn head_dim(&self) -> Result<usize> {
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(candle_core::Error::Msg(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            )));
        }
        Ok(self.hidden_size / self.num_attention_heads)
    }
}
