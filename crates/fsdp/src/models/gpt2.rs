//! A GPT-2 style causal language model with `GPT2LMHeadModel` tensor names: pre-LayerNorm
//! blocks, `Conv1D` projections (weights stored [in, out]), learned positions, tanh GELU, and
//! an output projection tied to the token embedding.

use std::sync::Arc;

use candle_core::{Result, Tensor};
use serde::Deserialize;

use crate::nn::composite_module;
use crate::nn::layers::{Dropout, Embedding, LayerNorm, Linear, TiedLmHead};
use crate::nn::module::{
    Forward, Model, Module, ModuleInfo, Params, Recompute, call_checkpointable, join,
};
use crate::nn::ops::{self, GeluApprox};

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
    /// The sizes its training FLOPs depend on: dense blocks, and the tied head over the
    /// vocabulary at every token.
    pub fn transformer_shape(&self) -> crate::models::TransformerShape {
        let inner = self.n_inner.unwrap_or(4 * self.n_embd);
        crate::models::TransformerShape::dense(self.n_layer, self.n_embd, inner, self.vocab_size)
    }

    /// Parses `config.json` text.
    pub fn from_json(text: &str) -> Result<Gpt2Config> {
        serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("invalid GPT-2 config: {e}")))
    }

    /// Checks the sizes against bounds and the memory present, and the epsilon (see
    /// `models::bounds`): a crafted size is an error naming its key, not an abort.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size, None),
            ("n_positions", self.n_positions, None),
            ("n_embd", self.n_embd, None),
            ("n_layer", self.n_layer, Some(super::bounds::MAX_LAYERS)),
            ("n_head", self.n_head, None),
            ("n_inner", self.n_inner.unwrap_or(0), None),
        ];
        let params = || {
            let w = |x: usize| x as u128;
            let h = w(self.n_embd);
            let i = self.n_inner.map_or(4 * h, w);
            let layer = 4 * h * h + 2 * h * i + 9 * h + i;
            (w(self.vocab_size) + w(self.n_positions)) * h + w(self.n_layer) * layer + 2 * h
        };
        super::bounds::check(
            "GPT-2",
            &sizes,
            params,
            ("layer_norm_epsilon", self.layer_norm_epsilon),
        )
    }

    fn inner(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }
}

/// Causal self-attention with GPT-2's fused query/key/value projection (`GPT2Attention`).
#[derive(Debug, Clone)]
pub struct Gpt2Attention {
    path: String,
    heads: usize,
    /// Query, key and value in one `Conv1D` [hidden, 3 hidden].
    pub c_attn: Linear,
    /// Output projection.
    pub c_proj: Linear,
    attn_dropout: Dropout,
    resid_dropout: Dropout,
}

composite_module!(Gpt2Attention, "GPT2Attention", [c_attn, c_proj]);

impl<'a> Forward<(&'a Tensor, &'a Tensor, Option<u64>)> for Gpt2Attention {
    type Output = Tensor;

    /// `(x, causal mask, seed)`.
    fn forward(
        &self,
        p: &dyn Params,
        (x, mask, seed): (&Tensor, &Tensor, Option<u64>),
    ) -> Result<Tensor> {
        let qkv = self.c_attn.call(p, x)?;
        let ctx = ops::packed_attention(
            &qkv,
            self.heads,
            false,
            Some(mask),
            self.attn_dropout.seed(seed),
        )?;
        let out = self.c_proj.call(p, &ctx)?;
        self.resid_dropout.apply(&out, seed)
    }
}

/// The feed-forward block with tanh GELU fused into `c_fc` (`GPT2MLP`).
#[derive(Debug, Clone)]
pub struct Gpt2Mlp {
    path: String,
    /// Expansion + GELU.
    pub c_fc: Linear,
    /// Projection back.
    pub c_proj: Linear,
    dropout: Dropout,
}

composite_module!(Gpt2Mlp, "GPT2MLP", [c_fc, c_proj]);

impl Forward<(&Tensor, Option<u64>)> for Gpt2Mlp {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, (x, seed): (&Tensor, Option<u64>)) -> Result<Tensor> {
        let inner = self.c_fc.call(p, x)?;
        let out = self.c_proj.call(p, &inner)?;
        self.dropout.apply(&out, seed)
    }
}

/// A pre-LayerNorm block (`GPT2Block`).
#[derive(Debug, Clone)]
pub struct Gpt2Block {
    path: String,
    /// Norm before attention.
    pub ln_1: LayerNorm,
    /// Attention.
    pub attn: Gpt2Attention,
    /// Norm before the MLP.
    pub ln_2: LayerNorm,
    /// Feed-forward.
    pub mlp: Gpt2Mlp,
}

impl Gpt2Block {
    fn new(path: String, c: &Gpt2Config) -> Gpt2Block {
        let (h, std) = (c.n_embd, c.initializer_range);
        // GPT-2 scales the residual projections' initialisation by 1/sqrt(2 n_layer).
        let proj_std = std / (2.0 * c.n_layer as f64).sqrt();
        let b = |leaf: &str| join(&path, leaf);
        Gpt2Block {
            ln_1: LayerNorm::new(b("ln_1"), h, c.layer_norm_epsilon),
            attn: Gpt2Attention {
                heads: c.n_head,
                c_attn: Linear::conv1d(b("attn.c_attn"), h, 3 * h, std),
                c_proj: Linear::conv1d(b("attn.c_proj"), h, h, proj_std),
                attn_dropout: Dropout::new(b("attn.attn_dropout"), c.attn_pdrop),
                resid_dropout: Dropout::new(b("attn.resid_dropout"), c.resid_pdrop),
                path: b("attn"),
            },
            ln_2: LayerNorm::new(b("ln_2"), h, c.layer_norm_epsilon),
            mlp: Gpt2Mlp {
                c_fc: Linear::conv1d(b("mlp.c_fc"), h, c.inner(), std).with_gelu(GeluApprox::Tanh),
                c_proj: Linear::conv1d(b("mlp.c_proj"), c.inner(), h, proj_std),
                dropout: Dropout::new(b("mlp.dropout"), c.resid_pdrop),
                path: b("mlp"),
            },
            path,
        }
    }
}

composite_module!(Gpt2Block, "GPT2Block", [ln_1, attn, ln_2, mlp]);

impl<'a> Forward<(&'a Tensor, &'a Tensor, Option<u64>)> for Gpt2Block {
    type Output = Tensor;

    /// `(x, causal mask, seed)`.
    fn forward(
        &self,
        p: &dyn Params,
        (x, mask, seed): (&Tensor, &Tensor, Option<u64>),
    ) -> Result<Tensor> {
        let a = self.ln_1.call(p, x)?;
        let x = (x + self.attn.call(p, (&a, mask, seed))?)?;
        let m = self.ln_2.call(p, &x)?;
        x + self.mlp.call(p, (&m, seed))?
    }
}

/// Token and position embeddings, blocks, final norm (`GPT2Model`).
#[derive(Debug, Clone)]
pub struct Gpt2Model {
    path: String,
    n_positions: usize,
    /// Token table (also the output projection).
    pub wte: Embedding,
    /// Position table.
    pub wpe: Embedding,
    /// Blocks.
    pub h: Vec<Gpt2Block>,
    /// Final norm.
    pub ln_f: LayerNorm,
    drop: Dropout,
}

impl Module for Gpt2Model {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        let m = ModuleInfo::new(self.path.clone(), "GPT2Model")
            .child(self.wte.info())
            .child(self.wpe.info());
        self.h
            .iter()
            .fold(m, |m, b| m.child(b.info()))
            .child(self.ln_f.info())
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        let mut out: Vec<&mut dyn Module> = vec![&mut self.wte, &mut self.wpe];
        out.extend(self.h.iter_mut().map(|b| b as &mut dyn Module));
        out.push(&mut self.ln_f);
        out
    }
}

impl Forward<(&Tensor, Option<u64>)> for Gpt2Model {
    type Output = Tensor;

    /// Final hidden states [batch, seq, hidden] for `ids` [batch, seq] under a causal mask.
    fn forward(&self, p: &dyn Params, (ids, seed): (&Tensor, Option<u64>)) -> Result<Tensor> {
        let seq = ids.dim(1)?;
        if seq > self.n_positions {
            return Err(candle_core::Error::Msg(format!(
                "sequence length {seq} exceeds n_positions {}",
                self.n_positions
            )));
        }
        let device = ids.device();
        let tok = self.wte.call(p, ids)?;
        let pos = self
            .wpe
            .call(p, &Tensor::arange(0u32, seq as u32, device)?)?;
        let mut x = self.drop.apply(&tok.broadcast_add(&pos)?, seed)?;
        let dtype = x.dtype();
        let lowest = super::mask_lowest(dtype);
        let causal: Vec<f64> = (0..seq * seq)
            .map(|i| if i % seq > i / seq { lowest } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(causal, (1, 1, seq, seq), device)?.to_dtype(dtype)?;
        for block in &self.h {
            let recompute = || -> Recompute {
                let (block, mask) = (block.clone(), mask.clone());
                Arc::new(move |p: &dyn Params, x: &Tensor| block.forward(p, (x, &mask, seed)))
            };
            let plain = || block.call(p, (&x, &mask, seed));
            x = call_checkpointable(p, block.path(), &x, recompute, plain)?;
        }
        self.ln_f.call(p, &x)
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
    /// The transformer.
    pub transformer: Gpt2Model,
    /// The tied output projection.
    pub lm_head: TiedLmHead,
}

impl Gpt2LmHeadModel {
    /// A model for `config`; an error when the heads do not divide the hidden size.
    pub fn new(config: Gpt2Config) -> Result<Self> {
        config.validate()?;
        if config.n_head == 0 || !config.n_embd.is_multiple_of(config.n_head) {
            return Err(candle_core::Error::Msg(format!(
                "n_embd {} is not a multiple of n_head {}",
                config.n_embd, config.n_head
            )));
        }
        let (h, std) = (config.n_embd, config.initializer_range);
        let wte = Embedding::new("transformer.wte".into(), config.vocab_size, h, std);
        let lm_head = TiedLmHead::new("lm_head".into(), wte.weight_name().to_string());
        let transformer = Gpt2Model {
            path: "transformer".into(),
            n_positions: config.n_positions,
            wpe: Embedding::new("transformer.wpe".into(), config.n_positions, h, std),
            wte,
            h: (0..config.n_layer)
                .map(|i| Gpt2Block::new(format!("transformer.h.{i}"), &config))
                .collect(),
            ln_f: LayerNorm::new("transformer.ln_f".into(), h, config.layer_norm_epsilon),
            drop: Dropout::new("transformer.drop".into(), config.embd_pdrop),
        };
        Ok(Gpt2LmHeadModel {
            config,
            dropout_seed: None,
            transformer,
            lm_head,
        })
    }

    /// The module types that make good FSDP units.
    pub fn no_split_modules() -> &'static [&'static str] {
        &["GPT2Block"]
    }

    /// Logits [batch, seq, vocab] for `input_ids` [batch, seq] under a causal mask.
    pub fn forward(&self, p: &dyn Params, input_ids: &Tensor) -> Result<Tensor> {
        self.call(p, input_ids)
    }

    /// Next-token cross-entropy: position t predicts token t+1; targets equal to -100 are
    /// ignored (as `GPT2LMHeadModel` with `labels`).
    pub fn loss(&self, logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
        super::causal_lm_loss(logits, labels, crate::nn::ops::Reduction::Mean)
    }

    /// [`Gpt2LmHeadModel::loss`] of the model's logits for `input_ids`, with the tied head
    /// fused into the loss ([`crate::nn::ops::linear_cross_entropy`]): the [batch, seq,
    /// vocab] logits are never held. The same loss and gradients up to the order of float
    /// sums.
    pub fn forward_loss(
        &self,
        p: &dyn Params,
        input_ids: &Tensor,
        labels: &Tensor,
    ) -> Result<Tensor> {
        input_ids.dims2()?;
        let x = self.transformer.call(p, (input_ids, self.dropout_seed))?;
        let weight = p.get(self.lm_head.weight_name())?;
        super::fused_causal_lm_loss(
            p,
            &x,
            &weight,
            labels,
            self.lm_head.path(),
            crate::nn::ops::Reduction::Mean,
        )
    }
}

impl Module for Gpt2LmHeadModel {
    fn path(&self) -> &str {
        ""
    }

    /// The module tree (blocks are `GPT2Block`); `lm_head` uses `transformer.wte.weight`.
    fn info(&self) -> ModuleInfo {
        ModuleInfo::new("", "GPT2LMHeadModel")
            .child(self.transformer.info())
            .child(self.lm_head.info())
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        vec![&mut self.transformer, &mut self.lm_head]
    }
}

impl Model for Gpt2LmHeadModel {
    fn no_split_modules(&self) -> &'static [&'static str] {
        Gpt2LmHeadModel::no_split_modules()
    }
}

impl Forward<&Tensor> for Gpt2LmHeadModel {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, input_ids: &Tensor) -> Result<Tensor> {
        input_ids.dims2()?;
        let x = self.transformer.call(p, (input_ids, self.dropout_seed))?;
        self.lm_head.call(p, &x)
    }
}
