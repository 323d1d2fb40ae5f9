//! The Llama family as causal language models with transformers' tensor names
//! (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`): token embedding, decoder
//! layers of RMSNorm → grouped-query causal attention with rotary positions → residual,
//! RMSNorm → SwiGLU MLP → residual, a final RMSNorm and an `lm_head` that may be tied to the
//! embedding. Built from a transformers `config.json` ([`LlamaConfig`]).

mod config;
mod gguf;
mod gguf_tokenizer;
mod kv_cache;
mod transformers_files;

pub use config::{LlamaConfig, LlamaFamily};
pub use gguf::{GgufFile, GgufWeights, gguf_config};
pub use gguf_tokenizer::gguf_tokenizer;
pub use kv_cache::KvCache;
pub use transformers_files::{
    TokenizerExtras, config_token_id, generation_config, portable_config, tokenizer_files,
    write_tokenizer_and_generation_files,
};

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use crate::nn::composite_module;
use crate::nn::layers::{Dropout, Embedding, Linear, RmsNorm, TiedLmHead};
use crate::nn::module::{
    Forward, Model, Module, ModuleInfo, Params, Recompute, call_checkpointable, join,
};
use crate::nn::ops::{
    self, AttentionHeads, RopeAngles, RopeLayout, RopeTable, grouped_query_attention, rope_with,
};

impl LlamaFamily {
    /// transformers' class name of `part` (`DecoderLayer`, `Attention`, ...) in this family.
    fn class(self, part: Part) -> &'static str {
        use LlamaFamily::*;
        use Part::*;
        match (self, part) {
            (Llama, CausalLm) => "LlamaForCausalLM",
            (Llama, Base) => "LlamaModel",
            (Llama, Layer) => "LlamaDecoderLayer",
            (Llama, Attention) => "LlamaAttention",
            (Llama, Mlp) => "LlamaMLP",
            (Mistral, CausalLm) => "MistralForCausalLM",
            (Mistral, Base) => "MistralModel",
            (Mistral, Layer) => "MistralDecoderLayer",
            (Mistral, Attention) => "MistralAttention",
            (Mistral, Mlp) => "MistralMLP",
            (Qwen2, CausalLm) => "Qwen2ForCausalLM",
            (Qwen2, Base) => "Qwen2Model",
            (Qwen2, Layer) => "Qwen2DecoderLayer",
            (Qwen2, Attention) => "Qwen2Attention",
            (Qwen2, Mlp) => "Qwen2MLP",
        }
    }

    /// The decoder layer class as the one wrap class (`_no_split_modules`).
    fn no_split_modules(self) -> &'static [&'static str] {
        match self {
            LlamaFamily::Llama => &["LlamaDecoderLayer"],
            LlamaFamily::Mistral => &["MistralDecoderLayer"],
            LlamaFamily::Qwen2 => &["Qwen2DecoderLayer"],
        }
    }
}

/// The parts of a model that have a class name of their own.
#[derive(Clone, Copy)]
enum Part {
    CausalLm,
    Base,
    Layer,
    Attention,
    Mlp,
}

/// What every layer of one forward shares: the rotary angles of its positions, the padding
/// mask and the dropout seed.
#[derive(Clone)]
struct LayerInput {
    angles: RopeAngles,
    /// Additive `[batch, 1, 1, seq]` mask of padded keys (`None`: no padding).
    mask: Option<Tensor>,
    seed: Option<u64>,
    /// Generation: the keys and values of the positions before these ones.
    cache: Option<Arc<KvCache>>,
}

/// Grouped-query self-attention with rotary positions (`LlamaAttention`).
#[derive(Debug, Clone)]
pub struct LlamaAttention {
    path: String,
    family: LlamaFamily,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Query projection [heads * head_dim, hidden].
    pub q_proj: Linear,
    /// Key projection [kv_heads * head_dim, hidden].
    pub k_proj: Linear,
    /// Value projection [kv_heads * head_dim, hidden].
    pub v_proj: Linear,
    /// Output projection [hidden, heads * head_dim].
    pub o_proj: Linear,
    dropout: Dropout,
}

impl LlamaAttention {
    fn type_name(&self) -> &'static str {
        self.family.class(Part::Attention)
    }

    /// `x` `[batch, seq, n * head_dim]` rotated by the positions' angles.
    fn rotate(&self, x: &Tensor, n: usize, angles: &RopeAngles) -> Result<Tensor> {
        let (b, s, w) = x.dims3()?;
        let rotated = rope_with(
            &x.reshape((b, s, n, self.head_dim))?,
            angles,
            RopeLayout::SeqFirst,
        )?;
        rotated.reshape((b, s, w))
    }
}

composite_module!(LlamaAttention, fn type_name, [q_proj, k_proj, v_proj, o_proj]);

impl Forward<(&Tensor, &LayerInput)> for LlamaAttention {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, (x, input): (&Tensor, &LayerInput)) -> Result<Tensor> {
        let q = self.rotate(&self.q_proj.call(p, x)?, self.heads, &input.angles)?;
        let k = self.rotate(&self.k_proj.call(p, x)?, self.kv_heads, &input.angles)?;
        let v = self.v_proj.call(p, x)?;
        // With a cache, the new positions attend to every earlier one and themselves: one
        // new position needs no mask; a prompt (nothing cached yet) is causal.
        let (k, v, prompt) = match &input.cache {
            Some(cache) => cache.extend(&self.path, k, v)?,
            None => (k, v, true),
        };
        if !prompt {
            let ctx = kv_cache::attend_cached(&q, &k, &v, self.heads, self.kv_heads)?;
            return self.o_proj.call(p, &ctx);
        }
        let heads = AttentionHeads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            causal: true,
        };
        let dropout = self.dropout.seed(input.seed);
        let ctx = grouped_query_attention(&q, &k, &v, heads, input.mask.as_ref(), dropout)?;
        self.o_proj.call(p, &ctx)
    }
}

/// The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))` (`LlamaMLP`).
#[derive(Debug, Clone)]
pub struct LlamaMlp {
    path: String,
    family: LlamaFamily,
    /// Gate projection [intermediate, hidden].
    pub gate_proj: Linear,
    /// Up projection [intermediate, hidden].
    pub up_proj: Linear,
    /// Down projection [hidden, intermediate].
    pub down_proj: Linear,
}

impl LlamaMlp {
    fn type_name(&self) -> &'static str {
        self.family.class(Part::Mlp)
    }
}

composite_module!(LlamaMlp, fn type_name, [gate_proj, up_proj, down_proj]);

impl Forward<&Tensor> for LlamaMlp {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, x: &Tensor) -> Result<Tensor> {
        let gated = ops::swiglu(&self.gate_proj.call(p, x)?, &self.up_proj.call(p, x)?)?;
        self.down_proj.call(p, &gated)
    }
}

/// A pre-norm decoder layer (`LlamaDecoderLayer`): the FSDP unit of these models.
#[derive(Debug, Clone)]
pub struct LlamaDecoderLayer {
    path: String,
    family: LlamaFamily,
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Attention.
    pub self_attn: LlamaAttention,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// Feed-forward.
    pub mlp: LlamaMlp,
}

impl LlamaDecoderLayer {
    fn new(path: String, c: &LlamaConfig) -> LlamaDecoderLayer {
        let (h, std) = (c.hidden_size, c.initializer_range);
        let (q, kv) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let at = |leaf: &str| join(&path, leaf);
        let linear = |leaf: &str, d_in: usize, d_out: usize, bias: bool| {
            let l = Linear::new(at(leaf), d_in, d_out, std);
            if bias { l } else { l.without_bias() }
        };
        LlamaDecoderLayer {
            family: c.family,
            input_layernorm: RmsNorm::new(at("input_layernorm"), h, c.rms_norm_eps),
            self_attn: LlamaAttention {
                family: c.family,
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                q_proj: linear("self_attn.q_proj", h, q, c.qkv_bias),
                k_proj: linear("self_attn.k_proj", h, kv, c.qkv_bias),
                v_proj: linear("self_attn.v_proj", h, kv, c.qkv_bias),
                o_proj: linear("self_attn.o_proj", q, h, c.o_bias),
                dropout: Dropout::new(at("self_attn.attention_dropout"), c.attention_dropout),
                path: at("self_attn"),
            },
            post_attention_layernorm: RmsNorm::new(
                at("post_attention_layernorm"),
                h,
                c.rms_norm_eps,
            ),
            mlp: LlamaMlp {
                family: c.family,
                gate_proj: linear("mlp.gate_proj", h, c.intermediate_size, c.mlp_bias),
                up_proj: linear("mlp.up_proj", h, c.intermediate_size, c.mlp_bias),
                down_proj: linear("mlp.down_proj", c.intermediate_size, h, c.mlp_bias),
                path: at("mlp"),
            },
            path,
        }
    }

    fn type_name(&self) -> &'static str {
        self.family.class(Part::Layer)
    }
}

composite_module!(
    LlamaDecoderLayer,
    fn type_name,
    [input_layernorm, self_attn, post_attention_layernorm, mlp]
);

impl Forward<(&Tensor, &LayerInput)> for LlamaDecoderLayer {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, (x, input): (&Tensor, &LayerInput)) -> Result<Tensor> {
        let a = self.input_layernorm.call(p, x)?;
        let x = (x + self.self_attn.call(p, (&a, input))?)?;
        let m = self.post_attention_layernorm.call(p, &x)?;
        x + self.mlp.call(p, &m)?
    }
}

/// Embedding, decoder layers and final norm (`LlamaModel`).
#[derive(Debug, Clone)]
pub struct LlamaModel {
    path: String,
    family: LlamaFamily,
    rope: RopeTable,
    sliding_window: Option<usize>,
    /// Token table.
    pub embed_tokens: Embedding,
    /// Decoder layers.
    pub layers: Vec<LlamaDecoderLayer>,
    /// Final norm.
    pub norm: RmsNorm,
}

impl LlamaModel {
    fn type_name(&self) -> &'static str {
        self.family.class(Part::Base)
    }
}

composite_module!(LlamaModel, fn type_name, [embed_tokens, layers, norm]);

/// The additive key mask of an `attention_mask` `[batch, seq]` (1 real, 0 padding), or `None`
/// when nothing is padded.
fn padding_mask(attention_mask: &Tensor, dtype: DType) -> Result<Option<Tensor>> {
    let (b, s) = attention_mask.dims2()?;
    let keep: Vec<f64> = attention_mask
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1()?;
    if keep.iter().all(|&k| k != 0.0) {
        return Ok(None);
    }
    let lowest = super::mask_lowest(dtype);
    let additive: Vec<f64> = keep
        .iter()
        .map(|&k| if k != 0.0 { 0.0 } else { lowest })
        .collect();
    Tensor::from_vec(additive, (b, 1, 1, s), attention_mask.device())?
        .to_dtype(dtype)
        .map(Some)
}

impl Forward<(&Tensor, Option<&Tensor>, Option<u64>)> for LlamaModel {
    type Output = Tensor;

    /// Final hidden states [batch, seq, hidden] for `ids` [batch, seq], an optional
    /// `attention_mask` [batch, seq] and a dropout seed.
    fn forward(
        &self,
        p: &dyn Params,
        (ids, attention_mask, seed): (&Tensor, Option<&Tensor>, Option<u64>),
    ) -> Result<Tensor> {
        self.run(p, ids, attention_mask, seed, None)
    }
}

impl LlamaModel {
    /// [`Forward::forward`], continuing the positions `cache` holds when given (and adding
    /// these positions' keys and values to it).
    fn run(
        &self,
        p: &dyn Params,
        ids: &Tensor,
        attention_mask: Option<&Tensor>,
        seed: Option<u64>,
        cache: Option<Arc<KvCache>>,
    ) -> Result<Tensor> {
        let seq = ids.dim(1)?;
        let past = cache.as_ref().map_or(0, |c| c.len());
        if cache.is_some() && attention_mask.is_some() {
            candle_core::bail!("generation with a key/value cache takes prompts without padding");
        }
        if let Some(window) = self.sliding_window
            && seq > window
        {
            return Err(candle_core::Error::Msg(format!(
                "sequence length {seq} exceeds the config's `sliding_window` {window}: sliding-window attention is not implemented"
            )));
        }
        let mut x = self.embed_tokens.call(p, ids)?;
        let positions: Vec<u32> = (past as u32..(past + seq) as u32).collect();
        let input = LayerInput {
            angles: self.rope.angles_at(&positions),
            mask: attention_mask
                .map(|m| padding_mask(m, x.dtype()))
                .transpose()?
                .flatten(),
            seed,
            cache: cache.clone(),
        };
        for layer in &self.layers {
            let recompute = || -> Recompute {
                let (layer, input) = (layer.clone(), input.clone());
                Arc::new(move |p: &dyn Params, x: &Tensor| layer.forward(p, (x, &input)))
            };
            let plain = || layer.call(p, (&x, &input));
            x = call_checkpointable(p, layer.path(), &x, recompute, plain)?;
        }
        if let Some(cache) = &cache {
            cache.advance(seq);
        }
        self.norm.call(p, &x)
    }
}

/// The output projection: its own weight, or the token embedding's.
#[derive(Debug, Clone)]
pub enum LmHead {
    /// `lm_head.weight` [vocab, hidden].
    Own(Linear),
    /// `tie_word_embeddings`: `model.embed_tokens.weight`.
    Tied(TiedLmHead),
}

impl Module for LmHead {
    fn path(&self) -> &str {
        match self {
            LmHead::Own(l) => l.path(),
            LmHead::Tied(t) => t.path(),
        }
    }

    fn info(&self) -> ModuleInfo {
        match self {
            LmHead::Own(l) => l.info(),
            LmHead::Tied(t) => t.info(),
        }
    }

    fn as_layer_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        match self {
            LmHead::Own(l) => Some(l),
            LmHead::Tied(_) => None,
        }
    }
}

impl LmHead {
    /// The weight's name when the head is `x · weightᵀ` alone, as Llama's always is.
    pub fn plain_weight(&self) -> Option<&str> {
        match self {
            LmHead::Own(l) => l.plain_weight(),
            LmHead::Tied(t) => Some(t.weight_name()),
        }
    }
}

impl Forward<&Tensor> for LmHead {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, x: &Tensor) -> Result<Tensor> {
        match self {
            LmHead::Own(l) => l.forward(p, x),
            LmHead::Tied(t) => t.forward(p, x),
        }
    }
}

/// `LlamaForCausalLM` (and Mistral's, Qwen2's).
#[derive(Debug, Clone)]
pub struct LlamaForCausalLM {
    /// Its configuration.
    pub config: LlamaConfig,
    /// Training mode: attention dropout is active, with masks drawn from this seed. `None`
    /// is evaluation mode.
    pub dropout_seed: Option<u64>,
    /// The decoder.
    pub model: LlamaModel,
    /// The output projection.
    pub lm_head: LmHead,
}

impl LlamaForCausalLM {
    /// A model for `config`.
    pub fn new(config: LlamaConfig) -> Result<LlamaForCausalLM> {
        config.validate()?;
        let (h, std) = (config.hidden_size, config.initializer_range);
        let embed_tokens = Embedding::new("model.embed_tokens".into(), config.vocab_size, h, std)
            .with_padding_idx(config.pad_token_id);
        let lm_head = if config.tie_word_embeddings {
            LmHead::Tied(TiedLmHead::new(
                "lm_head".into(),
                embed_tokens.weight_name().to_string(),
            ))
        } else {
            LmHead::Own(Linear::new("lm_head".into(), h, config.vocab_size, std).without_bias())
        };
        let model = LlamaModel {
            path: "model".into(),
            family: config.family,
            rope: RopeTable::new(config.head_dim, config.rope_theta, config.rope_scaling)?,
            sliding_window: config.sliding_window,
            embed_tokens,
            layers: (0..config.num_hidden_layers)
                .map(|i| LlamaDecoderLayer::new(format!("model.layers.{i}"), &config))
                .collect(),
            norm: RmsNorm::new("model.norm".into(), h, config.rms_norm_eps),
        };
        Ok(LlamaForCausalLM {
            config,
            dropout_seed: None,
            model,
            lm_head,
        })
    }

    /// Logits [batch, seq, vocab] for `input_ids` [batch, seq] and an optional
    /// `attention_mask` [batch, seq] (1 real, 0 padding).
    pub fn forward(
        &self,
        p: &dyn Params,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.call(p, (input_ids, attention_mask))
    }

    /// transformers' causal-LM loss: position t predicts token t+1, labels equal to -100
    /// ignored, the mean over the rest.
    pub fn loss(&self, logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
        super::causal_lm_loss(logits, labels, ops::Reduction::Mean)
    }

    /// [`LlamaForCausalLM::loss`] of the model's logits for `input_ids`, with the output
    /// projection fused into the loss ([`crate::nn::ops::linear_cross_entropy`]): the
    /// [batch, seq, vocab] logits and their gradient are never held, a few rows of them made
    /// at a time. The same loss and gradients up to the order of float sums.
    pub fn forward_loss(
        &self,
        p: &dyn Params,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Tensor> {
        self.forward_loss_reduced(p, input_ids, attention_mask, labels, ops::Reduction::Mean)
    }

    /// [`LlamaForCausalLM::forward_loss`] summed over the label tokens instead of averaged:
    /// what transformers divides by `num_items_in_batch`, the label tokens of a whole step
    /// (every micro-batch, every rank). Give it to
    /// [`crate::accelerator::Accelerator::backward_sum`] with that count, so padding that
    /// differs between ranks and micro-batches weighs every token alike.
    pub fn forward_loss_sum(
        &self,
        p: &dyn Params,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Tensor> {
        self.forward_loss_reduced(p, input_ids, attention_mask, labels, ops::Reduction::Sum)
    }

    /// The next-token logits `[batch, vocab]` after `ids` `[batch, seq]`, which continue the
    /// positions `cache` holds (and are added to it): generation's step, the prompt first
    /// and then one token at a time, each attending to the cached keys and values instead of
    /// running the sequence again. The head runs on the last position only.
    pub fn next_token_logits(
        &self,
        p: &dyn Params,
        ids: &Tensor,
        cache: &Arc<KvCache>,
    ) -> Result<Tensor> {
        let x = self.model.run(p, ids, None, None, Some(cache.clone()))?;
        let last = x.narrow(1, x.dim(1)? - 1, 1)?;
        self.lm_head.call(p, &last)?.squeeze(1)
    }

    fn forward_loss_reduced(
        &self,
        p: &dyn Params,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
        reduction: ops::Reduction,
    ) -> Result<Tensor> {
        let x = self
            .model
            .call(p, (input_ids, attention_mask, self.dropout_seed))?;
        let Some(weight) = self.lm_head.plain_weight() else {
            return super::causal_lm_loss(&self.lm_head.call(p, &x)?, labels, reduction);
        };
        let head = self.lm_head.path();
        super::fused_causal_lm_loss(p, &x, &p.get(weight)?, labels, head, reduction)
    }
}

impl Module for LlamaForCausalLM {
    fn path(&self) -> &str {
        ""
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new("", self.config.family.class(Part::CausalLm))
            .child(self.model.info())
            .child(self.lm_head.info())
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        vec![&mut self.model, &mut self.lm_head]
    }
}

impl Model for LlamaForCausalLM {
    fn no_split_modules(&self) -> &'static [&'static str] {
        self.config.family.no_split_modules()
    }
}

impl<'a> Forward<(&'a Tensor, Option<&'a Tensor>)> for LlamaForCausalLM {
    type Output = Tensor;

    fn forward(
        &self,
        p: &dyn Params,
        (input_ids, attention_mask): (&Tensor, Option<&Tensor>),
    ) -> Result<Tensor> {
        input_ids.dims2()?;
        let x = self
            .model
            .call(p, (input_ids, attention_mask, self.dropout_seed))?;
        self.lm_head.call(p, &x)
    }
}

impl Forward<&Tensor> for LlamaForCausalLM {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, input_ids: &Tensor) -> Result<Tensor> {
        self.call(p, (input_ids, None))
    }
}
