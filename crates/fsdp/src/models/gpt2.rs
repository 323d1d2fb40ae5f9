//! A GPT-2 style causal language model with `GPT2LMHeadModel` tensor names: pre-LayerNorm
//! blocks, `Conv1D` projections (weights stored [in, out]), learned positions, tanh GELU, and
//! an output projection tied to the token embedding.

use candle_core::{DType, Result, Tensor};
use serde::Deserialize;

use super::site_seed;
use crate::nn::layers::{embedding, embedding_info, layer_norm, layer_norm_info};
use crate::nn::module::{Init, ModuleInfo, Params};
use crate::nn::ops::{self, CrossEntropy, GeluApprox};

/// The fields of a GPT-2 `config.json` this implementation uses.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Gpt2Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context length (position table size).
    pub n_positions: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Feed-forward size (default 4 × n_embd).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// Standard deviation of the normal initialisation.
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    /// Dropout on the embeddings' sum (`transformer.drop`).
    #[serde(default = "default_dropout")]
    pub embd_pdrop: f64,
    /// Dropout on the attention probabilities.
    #[serde(default = "default_dropout")]
    pub attn_pdrop: f64,
    /// Dropout on the attention and MLP outputs before each residual add.
    #[serde(default = "default_dropout")]
    pub resid_pdrop: f64,
}

fn default_dropout() -> f64 {
    0.1
}

fn default_eps() -> f64 {
    1e-5
}
fn default_init() -> f64 {
    0.02
}

impl Gpt2Config {
    /// Parses `config.json` text.
    pub fn from_json(text: &str) -> Result<Gpt2Config> {
        serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("invalid GPT-2 config: {e}")))
    }

    fn inner(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }
}

/// `GPT2LMHeadModel`.
#[derive(Debug, Clone)]
pub struct Gpt2LmHeadModel {
    /// Its configuration.
    pub config: Gpt2Config,
    /// Training mode: dropout is active, with masks drawn from this seed (set a new one each
    /// step, e.g. from the run seed, rank and step). `None` is evaluation mode.
    pub dropout_seed: Option<u64>,
}

/// A `Conv1D` module: `weight` [in, out], `bias` [out].
fn conv1d_info(path: String, d_in: usize, d_out: usize, std: f64) -> ModuleInfo {
    ModuleInfo::new(path, "Conv1D")
        .param("weight", &[d_in, d_out], Init::Normal { std })
        .param("bias", &[d_out], Init::Zeros)
}

/// A `Conv1D` module's `x W + b` (W [in, out]), optionally with GPT-2's tanh GELU fused.
fn conv1d(p: &dyn Params, path: &str, x: &Tensor, gelu: bool) -> Result<Tensor> {
    let w = p.get(&format!("{path}.weight"))?;
    let b = p.get(&format!("{path}.bias"))?;
    let y = ops::conv1d(x, &w, &b, gelu.then_some(GeluApprox::Tanh))?;
    p.module_output(path, y)
}

impl Gpt2LmHeadModel {
    /// A model for `config`.
    pub fn new(config: Gpt2Config) -> Self {
        Gpt2LmHeadModel {
            config,
            dropout_seed: None,
        }
    }

    /// Dropout at a call site in training mode; identity in evaluation mode.
    fn dropout(&self, x: &Tensor, prob: f64, site: &str) -> Result<Tensor> {
        match self.dropout_seed {
            Some(seed) if prob > 0.0 => ops::dropout(x, prob, site_seed(seed, site)),
            _ => Ok(x.clone()),
        }
    }

    /// The module tree (blocks are `GPT2Block`); `lm_head` uses `transformer.wte.weight`.
    pub fn info(&self) -> ModuleInfo {
        let c = &self.config;
        let (h, std) = (c.n_embd, c.initializer_range);
        // GPT-2 scales the residual projections' initialisation by 1/sqrt(2 n_layer).
        let proj_std = std / (2.0 * c.n_layer as f64).sqrt();
        let mut transformer = ModuleInfo::new("transformer", "GPT2Model")
            .child(embedding_info(
                "transformer.wte".into(),
                c.vocab_size,
                h,
                std,
            ))
            .child(embedding_info(
                "transformer.wpe".into(),
                c.n_positions,
                h,
                std,
            ));
        for i in 0..c.n_layer {
            let b = |leaf: &str| format!("transformer.h.{i}.{leaf}");
            transformer = transformer.child(
                ModuleInfo::new(format!("transformer.h.{i}"), "GPT2Block")
                    .child(layer_norm_info(b("ln_1"), h))
                    .child(
                        ModuleInfo::new(b("attn"), "GPT2Attention")
                            .child(conv1d_info(b("attn.c_attn"), h, 3 * h, std))
                            .child(conv1d_info(b("attn.c_proj"), h, h, proj_std)),
                    )
                    .child(layer_norm_info(b("ln_2"), h))
                    .child(
                        ModuleInfo::new(b("mlp"), "GPT2MLP")
                            .child(conv1d_info(b("mlp.c_fc"), h, c.inner(), std))
                            .child(conv1d_info(b("mlp.c_proj"), c.inner(), h, proj_std)),
                    ),
            );
        }
        transformer = transformer.child(layer_norm_info("transformer.ln_f".into(), h));
        ModuleInfo::new("", "GPT2LMHeadModel")
            .child(transformer)
            .child(ModuleInfo::new("lm_head", "Linear").uses("transformer.wte.weight"))
    }

    /// The module types that make good FSDP units.
    pub fn no_split_modules() -> &'static [&'static str] {
        &["GPT2Block"]
    }

    /// Logits [batch, seq, vocab] for `input_ids` [batch, seq] under a causal mask.
    pub fn forward(&self, p: &dyn Params, input_ids: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let (batch, seq) = input_ids.dims2()?;
        if seq > c.n_positions {
            return Err(candle_core::Error::Msg(format!(
                "sequence length {seq} exceeds n_positions {}",
                c.n_positions
            )));
        }
        if c.n_embd % c.n_head != 0 {
            return Err(candle_core::Error::Msg(format!(
                "n_embd {} is not a multiple of n_head {}",
                c.n_embd, c.n_head
            )));
        }
        let device = input_ids.device();
        let tok = embedding(p, "transformer.wte", input_ids)?;
        let pos = embedding(
            p,
            "transformer.wpe",
            &Tensor::arange(0u32, seq as u32, device)?,
        )?;
        let mut x = self.dropout(&tok.broadcast_add(&pos)?, c.embd_pdrop, "transformer.drop")?;
        let dtype = x.dtype();
        let lowest = if dtype == DType::F64 {
            f64::MIN
        } else {
            f32::MIN as f64
        };
        let causal: Vec<f64> = (0..seq * seq)
            .map(|i| if i % seq > i / seq { lowest } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(causal, (1, 1, seq, seq), device)?.to_dtype(dtype)?;
        let heads = c.n_head;
        for i in 0..c.n_layer {
            let b = |leaf: &str| format!("transformer.h.{i}.{leaf}");
            let a = layer_norm(p, &b("ln_1"), &x, c.layer_norm_epsilon)?;
            let qkv = conv1d(p, &b("attn.c_attn"), &a, false)?;
            let probs_dropout = match self.dropout_seed {
                Some(seed) if c.attn_pdrop > 0.0 => {
                    Some((c.attn_pdrop, site_seed(seed, &b("attn.attn_dropout"))))
                }
                _ => None,
            };
            let ctx = ops::packed_attention(&qkv, heads, Some(&mask), probs_dropout)?;
            let attn = conv1d(p, &b("attn.c_proj"), &ctx, false)?;
            let attn = self.dropout(&attn, c.resid_pdrop, &b("attn.resid_dropout"))?;
            x = (x + p.module_output(&b("attn"), attn)?)?;
            let m = layer_norm(p, &b("ln_2"), &x, c.layer_norm_epsilon)?;
            let inner = conv1d(p, &b("mlp.c_fc"), &m, true)?;
            let mlp = conv1d(p, &b("mlp.c_proj"), &inner, false)?;
            let mlp = self.dropout(&mlp, c.resid_pdrop, &b("mlp.dropout"))?;
            x = (x + p.module_output(&b("mlp"), mlp)?)?;
            x = p.module_output(&format!("transformer.h.{i}"), x)?;
        }
        let x = layer_norm(p, "transformer.ln_f", &x, c.layer_norm_epsilon)?;
        let x = p.module_output("transformer", x)?;
        let wte = p.get("transformer.wte.weight")?;
        let logits = x
            .reshape((batch * seq, c.n_embd))?
            .matmul(&wte.t()?)?
            .reshape((batch, seq, c.vocab_size))?;
        p.module_output("lm_head", logits)
    }

    /// Next-token cross-entropy: position t predicts token t+1; targets equal to -100 are
    /// ignored (as `GPT2LMHeadModel` with `labels`).
    pub fn loss(&self, logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let (batch, seq, vocab) = logits.dims3()?;
        let shifted = logits
            .narrow(1, 0, seq - 1)?
            .reshape((batch * (seq - 1), vocab))?;
        let targets = labels
            .to_dtype(DType::I64)?
            .narrow(1, 1, seq - 1)?
            .flatten_all()?;
        ops::cross_entropy(&shifted, &targets, CrossEntropy::default())
    }
}
