//! The keys and values of the positions a generation has seen, per attention layer, so each
//! new token attends to them instead of the whole sequence running again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Result, Tensor};

/// Rotated keys and values `[batch, positions, kv_heads * head_dim]` by attention module
/// path, and how many positions they hold. One per generated sequence batch; every rank of
/// an FSDP job keeps its own (the layers' outputs are the same on every rank).
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Mutex<HashMap<String, (Tensor, Tensor)>>,
    len: AtomicUsize,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> KvCache {
        KvCache::default()
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Layer `path`'s keys and values with `k`, `v` (the new positions') appended, and
    /// whether attention over them is causal (only when nothing was cached: a prompt). More
    /// than one new position after a cached one is refused (it would need an offset mask).
    pub(super) fn extend(
        &self,
        path: &str,
        k: Tensor,
        v: Tensor,
    ) -> Result<(Tensor, Tensor, bool)> {
        let mut layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        let Some((pk, pv)) = layers.get(path) else {
            layers.insert(path.to_string(), (k.clone(), v.clone()));
            return Ok((k, v, true));
        };
        if k.dim(1)? != 1 {
            candle_core::bail!(
                "key/value cache of {path}: {} new positions after {} cached; continue one token at a time",
                k.dim(1)?,
                pk.dim(1)?
            );
        }
        let (k, v) = (Tensor::cat(&[pk, &k], 1)?, Tensor::cat(&[pv, &v], 1)?);
        layers.insert(path.to_string(), (k.clone(), v.clone()));
        Ok((k, v, false))
    }

    /// The model ran `n` more positions through every layer.
    pub(super) fn advance(&self, n: usize) {
        self.len.fetch_add(n, Ordering::Relaxed);
    }
}

/// Attention of new positions `q` `[batch, 1, heads * head_dim]` over every cached key and
/// value `[batch, len, kv_heads * head_dim]` (all visible; each K/V head serves its group of
/// query heads as transformers' `repeat_kv` orders them), from candle ops: generation's step
/// runs without a graph, and the fused op wants as many keys as queries.
pub(super) fn attend_cached(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    kv_heads: usize,
) -> Result<Tensor> {
    let (b, s, width) = q.dims3()?;
    let head_dim = width / heads;
    let len = k.dim(1)?;
    let group = heads / kv_heads;
    // [b, kv, group * s, d] queries against [b, kv, len, d] keys.
    let q = q
        .reshape((b, s, kv_heads, group, head_dim))?
        .permute((0, 2, 3, 1, 4))?
        .reshape((b, kv_heads, group * s, head_dim))?
        .contiguous()?;
    let k = k
        .reshape((b, len, kv_heads, head_dim))?
        .transpose(1, 2)?
        .contiguous()?;
    let v = v
        .reshape((b, len, kv_heads, head_dim))?
        .transpose(1, 2)?
        .contiguous()?;
    let scores = (q.matmul(&k.t()?)? / (head_dim as f64).sqrt())?;
    let probs = crate::nn::ops::softmax_last_dim(&scores.to_dtype(candle_core::DType::F32)?)?
        .to_dtype(v.dtype())?;
    probs
        .matmul(&v)?
        .reshape((b, kv_heads, group, s, head_dim))?
        .permute((0, 3, 1, 2, 4))?
        .reshape((b, s, width))
}
