//! Layers as modules: structs built once with their path and parameter names, whose forward
//! runs one fused op on parameters read through [`Params`] (plain in one process, gathered
//! shards under FSDP).

use candle_core::{Result, Tensor};

use super::lora::LoraAdapter;
use super::module::{Forward, Init, Module, ModuleInfo, Params, join};
use super::ops::{self, GeluApprox};
use super::quant::format::{Packing, QuantError, QuantFormat};
use crate::rng::site_seed;

mod walk;

pub use walk::{quantize_linears, visit_linears};

/// How a linear layer stores its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `nn.Linear`: `weight` [out, in].
    OutIn,
    /// GPT-2's `Conv1D`: `weight` [in, out].
    InOut,
}

/// `x W^T + b` (`nn.Linear`) or `x W + b` (GPT-2's `Conv1D`) over the last dimension, as one
/// fused op, optionally followed by GELU inside the same op.
#[derive(Debug, Clone)]
pub struct Linear {
    path: String,
    weight: String,
    /// `None` for a projection without bias (Llama's).
    bias: Option<String>,
    d_in: usize,
    d_out: usize,
    std: f64,
    layout: WeightLayout,
    gelu: Option<GeluApprox>,
    /// A LoRA adapter beside the weight ([`Linear::set_lora`]).
    lora: Option<LoraAdapter>,
    /// The weight kept quantized ([`Linear::set_quantized`]).
    quantized: Option<Packing>,
}

impl Linear {
    /// An `nn.Linear` at `path` (`weight` normal with `std`, `bias` zeros): PyTorch's
    /// `nn.Linear(d_in, d_out)` named `path` in its model, its parameters `path.weight`
    /// `[d_out, d_in]` and `path.bias` `[d_out]`.
    ///
    /// ```
    /// use fsdp_nn::candle::{DType, Device, Tensor};
    /// use fsdp_nn::layers::Linear;
    /// use fsdp_nn::{Forward, LocalParams, Module};
    ///
    /// let fc = Linear::new("encoder.fc".into(), 4, 3, 0.02);
    /// let names: Vec<String> = fc.info().all_params().iter().map(|p| p.name.clone()).collect();
    /// assert_eq!(names, ["encoder.fc.weight", "encoder.fc.bias"]);
    /// // Outside FSDP, parameters can live in plain tensors (under it, the engine's `p`).
    /// let params = LocalParams::init(&fc.info(), 42, DType::F32, &Device::Cpu)?;
    /// let y = fc.forward(&params, &Tensor::ones((2, 4), DType::F32, &Device::Cpu)?)?;
    /// assert_eq!(y.dims(), [2, 3]);
    /// # Ok::<(), fsdp_nn::candle::Error>(())
    /// ```
    pub fn new(path: String, d_in: usize, d_out: usize, std: f64) -> Linear {
        Linear {
            weight: join(&path, "weight"),
            bias: Some(join(&path, "bias")),
            path,
            d_in,
            d_out,
            std,
            layout: WeightLayout::OutIn,
            gelu: None,
            lora: None,
            quantized: None,
        }
    }

    /// A GPT-2 `Conv1D` at `path` (weight stored [in, out]).
    pub fn conv1d(path: String, d_in: usize, d_out: usize, std: f64) -> Linear {
        Linear {
            layout: WeightLayout::InOut,
            ..Linear::new(path, d_in, d_out, std)
        }
    }

    /// The weight's name when this projection is `x · weightᵀ` alone (`nn.Linear`'s layout,
    /// no bias, no activation): what an op fusing the projection with what follows takes.
    pub fn plain_weight(&self) -> Option<&str> {
        (self.bias.is_none()
            && self.gelu.is_none()
            && self.layout == WeightLayout::OutIn
            && self.lora.is_none()
            && self.quantized.is_none())
        .then_some(self.weight.as_str())
    }

    /// The same `nn.Linear` without its bias (`bias=False`: Llama's, Mistral's projections);
    /// the module then has the parameter `weight` only.
    pub fn without_bias(self) -> Linear {
        Linear { bias: None, ..self }
    }

    /// Adds `adapter` beside the weight: forward adds its low-rank update (before a fused
    /// GELU), and the module gains `lora_A.weight` [r, in] and `lora_B.weight` [out, r].
    pub fn set_lora(&mut self, adapter: LoraAdapter) {
        self.lora = Some(adapter);
    }

    /// Keeps the weight frozen and quantized in `format` (QLoRA's base layer): the module's
    /// `weight` becomes the blocks' words ([`crate::quant`]), dequantized per product. An
    /// error for GPT-2's Conv1D layout or an input size that is not whole blocks.
    pub fn set_quantized(&mut self, format: QuantFormat) -> std::result::Result<(), QuantError> {
        if self.layout != WeightLayout::OutIn {
            return Err(QuantError::Layout {
                path: self.path.clone(),
            });
        }
        self.quantized = Some(Packing::new(&self.weight, format, self.d_in)?);
        Ok(())
    }

    /// How the weight is kept quantized, if it is.
    pub fn quantized(&self) -> Option<Packing> {
        self.quantized
    }

    /// The adapter [`Linear::set_lora`] added.
    pub fn lora(&self) -> Option<&LoraAdapter> {
        self.lora.as_ref()
    }

    /// (in, out) features.
    pub fn features(&self) -> (usize, usize) {
        (self.d_in, self.d_out)
    }

    /// How the weight is stored.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// The weight's name.
    pub fn weight_name(&self) -> &str {
        &self.weight
    }

    /// The same layer with GELU fused after it.
    pub fn with_gelu(self, approx: GeluApprox) -> Linear {
        Linear {
            gelu: Some(approx),
            ..self
        }
    }
}

impl Module for Linear {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        let (name, shape) = match self.layout {
            WeightLayout::OutIn => ("Linear", [self.d_out, self.d_in]),
            WeightLayout::InOut => ("Conv1D", [self.d_in, self.d_out]),
        };
        let init = Init::Normal { std: self.std };
        let info = ModuleInfo::new(self.path.clone(), name);
        let info = match self.quantized {
            Some(packing) => info.packed_param("weight", self.d_out, packing, init),
            None => info.param("weight", &shape, init),
        };
        let info = match self.bias {
            Some(_) => info.param("bias", &[self.d_out], Init::Zeros),
            None => info,
        };
        match &self.lora {
            Some(lora) => lora.add_params(info, self.d_in, self.d_out),
            None => info,
        }
    }

    fn as_layer_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

impl Forward<&Tensor> for Linear {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, x: &Tensor) -> Result<Tensor> {
        if let Some(packing) = self.quantized {
            return self.quantized_forward(p, x, packing);
        }
        let Some(lora) = &self.lora else {
            return self.base_forward(p, x, self.gelu);
        };
        let update = lora.update(p, &self.path, x)?;
        if self.bias.is_none() && self.gelu.is_none() && self.layout == WeightLayout::OutIn {
            // Llama's projections: the update added inside the base op.
            return ops::linear_no_bias_add(x, &p.get(&self.weight)?, &update);
        }
        let y = (self.base_forward(p, x, None)? + update)?;
        match self.gelu {
            Some(approx) => ops::gelu(&y, approx),
            None => Ok(y),
        }
    }
}

impl Linear {
    /// The layer on its quantized weight: the adapter's update added inside the op.
    fn quantized_forward(&self, p: &dyn Params, x: &Tensor, packing: Packing) -> Result<Tensor> {
        let update = match &self.lora {
            Some(lora) => Some(lora.update(p, &self.path, x)?),
            None => None,
        };
        let words = p.get(&self.weight)?;
        let y = ops::quantized_linear(x, &words, packing, update.as_ref())?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(&p.get(b)?)?,
            None => y,
        };
        match self.gelu {
            Some(approx) => ops::gelu(&y, approx),
            None => Ok(y),
        }
    }

    /// The layer without its adapter, followed by `gelu`.
    fn base_forward(&self, p: &dyn Params, x: &Tensor, gelu: Option<GeluApprox>) -> Result<Tensor> {
        let w = p.get(&self.weight)?;
        let Some(bias) = &self.bias else {
            let y = match self.layout {
                WeightLayout::OutIn => ops::linear_no_bias(x, &w)?,
                WeightLayout::InOut => x.broadcast_matmul(&w)?,
            };
            return match gelu {
                Some(approx) => ops::gelu(&y, approx),
                None => Ok(y),
            };
        };
        let b = p.get(bias)?;
        match (self.layout, gelu) {
            (WeightLayout::OutIn, None) => ops::linear(x, &w, &b),
            (WeightLayout::OutIn, Some(approx)) => ops::linear_gelu(x, &w, &b, approx),
            (WeightLayout::InOut, gelu) => ops::conv1d(x, &w, &b, gelu),
        }
    }
}

/// An `nn.Embedding` (`weight` [count, dim]); the `padding_idx` row gets no gradient.
#[derive(Debug, Clone)]
pub struct Embedding {
    path: String,
    weight: String,
    count: usize,
    dim: usize,
    std: f64,
    padding_idx: Option<usize>,
    sparse: bool,
}

impl Embedding {
    /// A table of `count` rows of `dim` at `path`.
    pub fn new(path: String, count: usize, dim: usize, std: f64) -> Embedding {
        Embedding {
            weight: join(&path, "weight"),
            path,
            count,
            dim,
            std,
            padding_idx: None,
            sparse: false,
        }
    }

    /// The same table with a row-sparse gradient (`nn.Embedding(sparse=True)`): under FSDP
    /// only the rows some rank's batch looks up are gathered in forward and sent when
    /// gradients are reduced, not the whole table. The reduced gradient, and so training, is exactly the dense one
    /// (rows nobody looked up are zero): optimizers update as with a dense gradient —
    /// PyTorch's `AdamW` on the densified gradient, not `SparseAdam`'s lazy update.
    pub fn sparse(self, on: bool) -> Embedding {
        Embedding { sparse: on, ..self }
    }

    /// The same table whose row `idx` gets no gradient (`nn.Embedding(padding_idx=idx)`).
    pub fn with_padding_idx(self, idx: Option<usize>) -> Embedding {
        Embedding {
            padding_idx: idx,
            ..self
        }
    }

    /// The weight's full name (for tying another module to it).
    pub fn weight_name(&self) -> &str {
        &self.weight
    }
}

impl Module for Embedding {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        let mut info = ModuleInfo::new(self.path.clone(), "Embedding").param(
            "weight",
            &[self.count, self.dim],
            Init::Normal { std: self.std },
        );
        for p in &mut info.params {
            p.sparse_grad = self.sparse;
        }
        info
    }
}

impl Forward<&Tensor> for Embedding {
    type Output = Tensor;

    /// Rows for integer `ids` of any shape; output shape `ids.shape + [dim]`.
    fn forward(&self, p: &dyn Params, ids: &Tensor) -> Result<Tensor> {
        p.lookup(&self.weight, ids, self.padding_idx)
    }
}

/// A `LayerNorm` module (`weight` ones, `bias` zeros) with the fused kernel; on a pair
/// `(x, residual)` it normalises `x + residual` in one op (post-norm residual blocks).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    path: String,
    weight: String,
    bias: String,
    dim: usize,
    eps: f64,
}

impl LayerNorm {
    /// A LayerNorm over the last dimension `dim` at `path`.
    pub fn new(path: String, dim: usize, eps: f64) -> LayerNorm {
        LayerNorm {
            weight: join(&path, "weight"),
            bias: join(&path, "bias"),
            path,
            dim,
            eps,
        }
    }
}

impl Module for LayerNorm {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new(self.path.clone(), "LayerNorm")
            .param("weight", &[self.dim], Init::Ones)
            .param("bias", &[self.dim], Init::Zeros)
    }
}

impl Forward<&Tensor> for LayerNorm {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, x: &Tensor) -> Result<Tensor> {
        ops::layer_norm(x, &p.get(&self.weight)?, &p.get(&self.bias)?, self.eps)
    }
}

impl Forward<(&Tensor, &Tensor)> for LayerNorm {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, (x, residual): (&Tensor, &Tensor)) -> Result<Tensor> {
        let (w, b) = (p.get(&self.weight)?, p.get(&self.bias)?);
        ops::add_layer_norm(x, residual, &w, &b, self.eps)
    }
}

/// An `RMSNorm` module (`weight` ones, no bias; Llama's `LlamaRMSNorm`) over the last
/// dimension, with the fused kernel.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    path: String,
    weight: String,
    dim: usize,
    eps: f64,
}

impl RmsNorm {
    /// An RMSNorm over the last dimension `dim` at `path`.
    pub fn new(path: String, dim: usize, eps: f64) -> RmsNorm {
        RmsNorm {
            weight: join(&path, "weight"),
            path,
            dim,
            eps,
        }
    }
}

impl Module for RmsNorm {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new(self.path.clone(), "RmsNorm").param("weight", &[self.dim], Init::Ones)
    }
}

impl Forward<&Tensor> for RmsNorm {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, x: &Tensor) -> Result<Tensor> {
        ops::rms_norm(x, &p.get(&self.weight)?, self.eps)
    }
}

/// An output projection whose weight is another module's (`lm_head` tied to the token
/// embedding, `tie_word_embeddings`): `x W^T`, `W` read by name. The module tree records the
/// use, so the plan keeps it in the embedding's unit.
#[derive(Debug, Clone)]
pub struct TiedLmHead {
    path: String,
    weight: String,
}

impl TiedLmHead {
    /// The projection at `path` using the parameter named `weight` ([vocab, hidden]).
    pub fn new(path: String, weight: String) -> TiedLmHead {
        TiedLmHead { path, weight }
    }
}

impl TiedLmHead {
    /// The name of the weight it projects with (the embedding's).
    pub fn weight_name(&self) -> &str {
        &self.weight
    }
}

impl Module for TiedLmHead {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new(self.path.clone(), "Linear").uses(&self.weight)
    }
}

impl Forward<&Tensor> for TiedLmHead {
    type Output = Tensor;

    /// Logits [batch, seq, vocab] for hidden states [batch, seq, hidden].
    fn forward(&self, p: &dyn Params, x: &Tensor) -> Result<Tensor> {
        let (batch, seq, hidden) = x.dims3()?;
        let w = p.get(&self.weight)?;
        let vocab = w.dim(0)?;
        x.reshape((batch * seq, hidden))?
            .matmul(&w.t()?)?
            .reshape((batch, seq, vocab))
    }
}

/// Seeded dropout at one call site: active when a step seed is given (training), identity
/// otherwise. Each site draws its own mask from (step seed, site name).
#[derive(Debug, Clone)]
pub struct Dropout {
    site: String,
    p: f64,
}

impl Dropout {
    /// Dropout with probability `p` at call site `site` (its module path).
    pub fn new(site: String, p: f64) -> Dropout {
        Dropout { site, p }
    }

    /// `x` with dropout when `seed` is set.
    pub fn apply(&self, x: &Tensor, seed: Option<u64>) -> Result<Tensor> {
        match seed {
            Some(seed) if self.p > 0.0 => ops::dropout(x, self.p, site_seed(seed, &self.site)),
            _ => Ok(x.clone()),
        }
    }

    /// Packed rows `x` `[tokens, width]` with the dropout their padded batch would get
    /// ([`ops::dropout_packed`]) when `seed` is set.
    pub fn apply_packed(
        &self,
        x: &Tensor,
        seed: Option<u64>,
        seqs: &ops::PackedSequences,
    ) -> Result<Tensor> {
        match self.seed(seed) {
            Some((p, site)) => ops::dropout_packed(x, p, site, seqs),
            None => Ok(x.clone()),
        }
    }

    /// The seed of this site's mask for step seed `seed`.
    pub fn seed(&self, seed: Option<u64>) -> Option<(f64, u64)> {
        match seed {
            Some(seed) if self.p > 0.0 => Some((self.p, site_seed(seed, &self.site))),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::LocalParams;

    #[test]
    fn a_linear_without_bias_has_a_weight_only_and_computes_x_w_t() {
        let lin = Linear::new("q_proj".into(), 3, 2, 0.02).without_bias();
        let info = lin.info();
        let names: Vec<&str> = info.params.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["q_proj.weight"]);
        let w = Tensor::new(&[[1.0f32, 0.0, 2.0], [0.5, -1.0, 0.0]], &Device::Cpu).unwrap();
        let params =
            LocalParams::from_tensors(&info, [("q_proj.weight".to_string(), w)].into()).unwrap();
        let x = Tensor::new(&[[[1.0f32, 2.0, 3.0]]], &Device::Cpu).unwrap();
        let y: Vec<f32> = lin
            .call(&params, &x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(y, [7.0, -1.5]);
    }

    #[test]
    fn rms_norm_module_normalises_by_the_root_mean_square_and_scales() {
        let norm = RmsNorm::new("model.norm".into(), 3, 1e-6);
        let info = norm.info();
        assert_eq!(info.type_name, "RmsNorm");
        assert_eq!(info.all_params()[0].name, "model.norm.weight");
        let weight = Tensor::new(&[1.0f32, 2.0, 0.5], &Device::Cpu).unwrap();
        let params =
            LocalParams::from_tensors(&info, [("model.norm.weight".to_string(), weight)].into())
                .unwrap();
        let x = Tensor::new(&[[3.0f32, -4.0, 0.0]], &Device::Cpu).unwrap();
        let y: Vec<f32> = norm
            .call(&params, &x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let rms = ((9.0f32 + 16.0) / 3.0 + 1e-6).sqrt();
        let want = [3.0 / rms, -8.0 / rms, 0.0];
        for (a, b) in y.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{y:?} vs {want:?}");
        }
    }
}
