//! [`LlamaConfig`]: a transformers `config.json` of the Llama family (`llama`, `mistral`,
//! `qwen2`; SmolLM2 is `llama`), read strictly: a field that changes the model and that this
//! implementation does not compute (a `rope_scaling` type, sliding-window layers, experts,
//! quantization, another activation) is an error naming the field, never a silent difference.

use std::path::Path;

use candle_core::Result;
use serde_json::Value;

use crate::nn::ops::RopeScaling;

/// Which architecture of the family: module type names and where the biases are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaFamily {
    /// `model_type: llama` (Llama 2/3, SmolLM2, TinyLlama, ...).
    Llama,
    /// `model_type: mistral`.
    Mistral,
    /// `model_type: qwen2`: biases on the q, k and v projections.
    Qwen2,
}

impl LlamaFamily {
    /// transformers' class-name prefix (`LlamaDecoderLayer`, `Qwen2DecoderLayer`, ...).
    pub fn prefix(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "Llama",
            LlamaFamily::Mistral => "Mistral",
            LlamaFamily::Qwen2 => "Qwen2",
        }
    }
}

/// The fields of a Llama-family `config.json` this implementation computes.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// The architecture (`model_type`).
    pub family: LlamaFamily,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// K/V heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Head size (`head_dim`, default `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Position limit.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (`rope_theta`, or `rope_parameters.rope_theta`).
    pub rope_theta: f64,
    /// RoPE scaling (`rope_scaling`, or the type in `rope_parameters`).
    pub rope_scaling: Option<RopeScaling>,
    /// `lm_head` is the token embedding.
    pub tie_word_embeddings: bool,
    /// Biases on q, k, v (Llama's `attention_bias`, always for Qwen2).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`; never for Qwen2).
    pub o_bias: bool,
    /// Biases on the MLP's projections (`mlp_bias`).
    pub mlp_bias: bool,
    /// Dropout on the attention probabilities, in training mode.
    pub attention_dropout: f64,
    /// Standard deviation of the normal initialisation.
    pub initializer_range: f64,
    /// Mistral's `sliding_window`: sequences longer than it are refused (the window is not
    /// computed).
    pub sliding_window: Option<usize>,
    /// `pad_token_id`: the token embedding's `padding_idx` (its row gets no gradient, as
    /// transformers builds the embedding).
    pub pad_token_id: Option<usize>,
}

/// A field's value, or its default when absent or null.
fn opt<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("Llama config: {msg}"))
}

fn count(v: &Value, key: &str, default: Option<usize>) -> Result<usize> {
    match opt(v, key) {
        Some(x) => x
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| err(format!("`{key}` is {x}, not a non-negative integer"))),
        None => default.ok_or_else(|| err(format!("`{key}` is missing"))),
    }
}

fn number(v: &Value, key: &str, default: f64) -> Result<f64> {
    match opt(v, key) {
        Some(x) => x
            .as_f64()
            .ok_or_else(|| err(format!("`{key}` is {x}, not a number"))),
        None => Ok(default),
    }
}

fn flag(v: &Value, key: &str, default: bool) -> Result<bool> {
    match opt(v, key) {
        Some(x) => x
            .as_bool()
            .ok_or_else(|| err(format!("`{key}` is {x}, not true or false"))),
        None => Ok(default),
    }
}

impl LlamaConfig {
    /// Parses `config.json` text.
    pub fn from_json(text: &str) -> Result<LlamaConfig> {
        let v: Value = serde_json::from_str(text).map_err(|e| err(format!("not JSON: {e}")))?;
        LlamaConfig::from_value(&v)
    }

    /// Reads `config.json` at `path` (errors name the file).
    pub fn from_file(path: &Path) -> Result<LlamaConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| candle_core::Error::Msg(format!("reading {}: {e}", path.display())))?;
        LlamaConfig::from_json(&text)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))
    }

    /// From a parsed `config.json`.
    pub fn from_value(v: &Value) -> Result<LlamaConfig> {
        let family = match opt(v, "model_type")
            .and_then(Value::as_str)
            .unwrap_or("llama")
        {
            "llama" => LlamaFamily::Llama,
            "mistral" => LlamaFamily::Mistral,
            "qwen2" => LlamaFamily::Qwen2,
            other => {
                return Err(err(format!(
                    "`model_type` {other:?} is not one this implementation computes (llama, mistral, qwen2)"
                )));
            }
        };
        for key in [
            "num_experts",
            "num_local_experts",
            "n_routed_experts",
            "quantization_config",
        ] {
            if opt(v, key).is_some() {
                return Err(err(format!(
                    "`{key}` is set: mixture-of-experts and quantized models are not implemented"
                )));
            }
        }
        let act = opt(v, "hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(err(format!(
                "`hidden_act` {act:?} is not implemented (the MLP is SwiGLU: silu)"
            )));
        }
        if flag(v, "use_sliding_window", false)? {
            return Err(err(
                "`use_sliding_window` is true: sliding-window attention is not implemented".into(),
            ));
        }
        if let Some(types) = opt(v, "layer_types").and_then(Value::as_array)
            && let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention"))
        {
            return Err(err(format!(
                "`layer_types` has {t}: only full_attention layers are implemented"
            )));
        }
        let heads = count(v, "num_attention_heads", None)?;
        let hidden = count(v, "hidden_size", None)?;
        let kv_heads = count(v, "num_key_value_heads", Some(heads))?;
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(err(format!(
                "`num_attention_heads` {heads} is not a positive multiple of `num_key_value_heads` {kv_heads}"
            )));
        }
        let head_dim = count(v, "head_dim", Some(hidden / heads))?;
        // transformers 5 writes `rope_parameters`; earlier versions `rope_theta` and
        // `rope_scaling`.
        let (rope_theta, rope_scaling) = match opt(v, "rope_parameters") {
            Some(p) => (
                number(p, "rope_theta", 10000.0)?,
                RopeScaling::from_config(p).map_err(|e| err(format!("`rope_parameters`: {e}")))?,
            ),
            None => (
                number(v, "rope_theta", 10000.0)?,
                match opt(v, "rope_scaling") {
                    Some(s) => RopeScaling::from_config(s)
                        .map_err(|e| err(format!("`rope_scaling`: {e}")))?,
                    None => None,
                },
            ),
        };
        let attention_bias = flag(v, "attention_bias", false)?;
        let (qkv_bias, o_bias) = match family {
            LlamaFamily::Qwen2 => (true, false),
            _ => (attention_bias, attention_bias),
        };
        let sliding_window = match family {
            LlamaFamily::Mistral => opt(v, "sliding_window")
                .map(|_| count(v, "sliding_window", None))
                .transpose()?,
            _ => None,
        };
        let config = LlamaConfig {
            family,
            vocab_size: count(v, "vocab_size", None)?,
            hidden_size: hidden,
            intermediate_size: count(v, "intermediate_size", None)?,
            num_hidden_layers: count(v, "num_hidden_layers", None)?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: count(v, "max_position_embeddings", Some(2048))?,
            rms_norm_eps: number(v, "rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: flag(v, "tie_word_embeddings", false)?,
            qkv_bias,
            o_bias,
            mlp_bias: flag(v, "mlp_bias", false)?,
            attention_dropout: number(v, "attention_dropout", 0.0)?,
            initializer_range: number(v, "initializer_range", 0.02)?,
            sliding_window,
            pad_token_id: opt(v, "pad_token_id")
                .map(|_| count(v, "pad_token_id", None))
                .transpose()?,
        };
        if config.head_dim == 0 || !config.head_dim.is_multiple_of(2) {
            return Err(err(format!(
                "`head_dim` {} must be even and positive (rotary embedding)",
                config.head_dim
            )));
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks the sizes against bounds and the memory present, and the epsilon (see
    /// `models::bounds`): a crafted size is an error naming its key, not an abort.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size, None),
            ("hidden_size", self.hidden_size, None),
            ("intermediate_size", self.intermediate_size, None),
            (
                "num_hidden_layers",
                self.num_hidden_layers,
                Some(super::super::bounds::MAX_LAYERS),
            ),
            ("num_attention_heads", self.num_attention_heads, None),
            ("num_key_value_heads", self.num_key_value_heads, None),
            ("head_dim", self.head_dim, None),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                None,
            ),
        ];
        let params = || {
            let w = |x: usize| x as u128;
            let (h, i) = (w(self.hidden_size), w(self.intermediate_size));
            let q = w(self.num_attention_heads) * w(self.head_dim);
            let kv = w(self.num_key_value_heads) * w(self.head_dim);
            let layer = 2 * h * q + 2 * h * kv + q + 2 * kv + 3 * h * i + 2 * i + 3 * h;
            // The rotary tables: cos and sin of every position.
            let rope = w(self.max_position_embeddings) * w(self.head_dim);
            2 * w(self.vocab_size) * h + w(self.num_hidden_layers) * layer + h + rope
        };
        super::super::bounds::check("Llama", &sizes, params, ("rms_norm_eps", self.rms_norm_eps))
    }

    /// The sizes its training FLOPs depend on: q/k/v/o and the three SwiGLU
    /// projections per layer, attention `heads * head_dim` wide, the vocabulary as the head.
    pub fn transformer_shape(&self) -> crate::models::TransformerShape {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        crate::models::TransformerShape {
            layers: self.num_hidden_layers,
            layer_matmul_params: 2 * h * q + 2 * h * kv + 3 * h * i,
            attention_width: q,
            hidden: h,
            head_per_token: self.vocab_size,
        }
    }

    /// Parameters of the model this config describes (a tied `lm_head` counted once).
    pub fn num_parameters(&self) -> usize {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let attn = h * q
            + 2 * h * kv
            + q * h
            + if self.qkv_bias { q + 2 * kv } else { 0 }
            + if self.o_bias { h } else { 0 };
        let mlp = 3 * h * i + if self.mlp_bias { 2 * i + h } else { 0 };
        let layer = attn + mlp + 2 * h;
        let embed = self.vocab_size * h;
        embed
            + self.num_hidden_layers * layer
            + h
            + if self.tie_word_embeddings { 0 } else { embed }
    }
}
