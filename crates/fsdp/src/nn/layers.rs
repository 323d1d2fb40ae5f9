//! Layers as functions of [`Params`]: each reads its parameters by name at call time, so the
//! same model code runs on plain and on sharded parameters.

use candle_core::{Result, Tensor};

use super::module::{Init, ModuleInfo, Params};
use super::ops::{self, GeluApprox};

/// A `Linear` module (`weight` [out, in], `bias` [out]).
pub fn linear_info(path: String, d_in: usize, d_out: usize, std: f64) -> ModuleInfo {
    ModuleInfo::new(path, "Linear")
        .param("weight", &[d_out, d_in], Init::Normal { std })
        .param("bias", &[d_out], Init::Zeros)
}

/// `x W^T + b` over the last dimension, as one fused op.
pub fn linear(p: &dyn Params, path: &str, x: &Tensor) -> Result<Tensor> {
    let w = p.get(&format!("{path}.weight"))?;
    let b = p.get(&format!("{path}.bias"))?;
    p.module_output(path, ops::linear(x, &w, &b)?)
}

/// `gelu(x W^T + b)`.
pub fn linear_gelu(p: &dyn Params, path: &str, x: &Tensor, approx: GeluApprox) -> Result<Tensor> {
    let w = p.get(&format!("{path}.weight"))?;
    let b = p.get(&format!("{path}.bias"))?;
    p.module_output(path, ops::linear_gelu(x, &w, &b, approx)?)
}

/// An `Embedding` module (`weight` [count, dim]).
pub fn embedding_info(path: String, count: usize, dim: usize, std: f64) -> ModuleInfo {
    ModuleInfo::new(path, "Embedding").param("weight", &[count, dim], Init::Normal { std })
}

/// Rows of the embedding table for integer `ids` of any shape; output shape `ids.shape + [dim]`.
pub fn embedding(p: &dyn Params, path: &str, ids: &Tensor) -> Result<Tensor> {
    let w = p.get(&format!("{path}.weight"))?;
    let mut dims = ids.dims().to_vec();
    dims.push(w.dim(1)?);
    p.module_output(path, w.index_select(&ids.flatten_all()?, 0)?.reshape(dims)?)
}

/// A `LayerNorm` module (`weight` ones, `bias` zeros).
pub fn layer_norm_info(path: String, dim: usize) -> ModuleInfo {
    ModuleInfo::new(path, "LayerNorm")
        .param("weight", &[dim], Init::Ones)
        .param("bias", &[dim], Init::Zeros)
}

/// LayerNorm over the last dimension with the fused kernel.
pub fn layer_norm(p: &dyn Params, path: &str, x: &Tensor, eps: f64) -> Result<Tensor> {
    let y = ops::layer_norm(
        x,
        &p.get(&format!("{path}.weight"))?,
        &p.get(&format!("{path}.bias"))?,
        eps,
    )?;
    p.module_output(path, y)
}

/// LayerNorm of `x + residual` with the fused kernel (post-norm residual blocks).
pub fn add_layer_norm(
    p: &dyn Params,
    path: &str,
    x: &Tensor,
    residual: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let y = ops::add_layer_norm(
        x,
        residual,
        &p.get(&format!("{path}.weight"))?,
        &p.get(&format!("{path}.bias"))?,
        eps,
    )?;
    p.module_output(path, y)
}
