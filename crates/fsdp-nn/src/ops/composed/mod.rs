//! The fused ops as compositions of candle's tensor ops, with candle's own backward: what the
//! ops compute on a device they have no kernel for (CUDA, until theirs land). Each takes the
//! fused op's arguments and gives its values and gradients (tested against it on the CPU);
//! half-precision inputs compute in f32 and round once, as the fused ops do. Slower and
//! hungrier than the fused ops (attention keeps its `[seq, seq]` scores; every norm keeps
//! its intermediates): a first step, each to be replaced by a kernel.

use candle_core::{D, DType, Device, Tensor};

use candle_core::Result;

use super::PackedSequences;
use crate::rng::dropout_keep;

/// `x` in f32 (a no-op for f32).
fn f32(x: &Tensor) -> Result<Tensor> {
    x.to_dtype(DType::F32)
}

/// LayerNorm over the last dimension (biased variance), in f32.
pub(super) fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = f32(x)?;
    let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    centred
        .broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(&f32(gamma)?)?
        .broadcast_add(&f32(beta)?)?
        .to_dtype(dtype)
}

/// `LayerNorm(x + residual)`, the sum in f32.
pub(super) fn add_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let sum = (f32(x)? + f32(residual)?)?;
    layer_norm(&sum, gamma, beta, eps)?.to_dtype(x.dtype())
}

/// RMSNorm over the last dimension, in f32.
pub(super) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = f32(x)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?
        .broadcast_mul(&f32(weight)?)?
        .to_dtype(dtype)
}

/// GELU in f32, its tanh form or (`tanh` false) the exact one.
pub(super) fn gelu(x: &Tensor, tanh: bool) -> Result<Tensor> {
    let y = if tanh {
        f32(x)?.gelu()?
    } else {
        f32(x)?.gelu_erf()?
    };
    y.to_dtype(x.dtype())
}

/// `gelu(x + bias)`, the sum in f32.
pub(super) fn bias_gelu(x: &Tensor, bias: &Tensor, tanh: bool) -> Result<Tensor> {
    gelu(&f32(x)?.broadcast_add(&f32(bias)?)?, tanh)?.to_dtype(x.dtype())
}

/// `silu(gate) * up`, in f32.
pub(super) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    (f32(gate)?.silu()? * f32(up)?)?.to_dtype(gate.dtype())
}

/// Softmax over the last dimension, in f32.
pub(super) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let x32 = f32(x)?;
    let e = x32
        .broadcast_sub(&x32.max_keepdim(D::Minus1)?.detach())?
        .exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .to_dtype(x.dtype())
}

/// `x W^T` (`w_out_in`) or `x W` over the last dimension of `x` (any leading shape), `+ b`,
/// then GELU (`Some(tanh)`, as [`gelu`]): every projection of `linear.rs`, one cuBLAS
/// product in the inputs' type.
pub(super) fn project(
    x: &Tensor,
    w: &Tensor,
    w_out_in: bool,
    bias: Option<&Tensor>,
    gelu_after: Option<bool>,
) -> Result<Tensor> {
    let w = if w_out_in { w.t()? } else { w.clone() };
    let (inner, outer) = w.dims2()?;
    let mut dims = x.dims().to_vec();
    let rows = x.elem_count() / inner.max(1);
    let mut y = x.contiguous()?.reshape((rows, inner))?.matmul(&w)?;
    if let Some(b) = bias {
        y = y.broadcast_add(b)?;
    }
    if let Some(tanh) = gelu_after {
        y = gelu(&y, tanh)?;
    }
    if let Some(last) = dims.last_mut() {
        *last = outer;
    }
    y.reshape(dims)
}

/// `scaling · (x Aᵀ) Bᵀ` over the last dimension of `x`.
pub(super) fn lora_update(x: &Tensor, a: &Tensor, b: &Tensor, scaling: f64) -> Result<Tensor> {
    project(&project(x, a, true, None, None)?, b, true, None, None)? * scaling
}

/// Rows of `weight` for `ids`; rows read for `padding_idx` pass no gradient back.
pub(super) fn embedding(
    weight: &Tensor,
    ids: &Tensor,
    padding_idx: Option<usize>,
) -> Result<Tensor> {
    let ids32 = ids.to_dtype(DType::U32)?;
    let (_, dim) = weight.dims2()?;
    let mut out_dims = ids.dims().to_vec();
    out_dims.push(dim);
    let rows = weight.index_select(&ids32.flatten_all()?, 0)?;
    let rows = match padding_idx {
        None => rows,
        Some(pad) => {
            let is_pad = ids32
                .flatten_all()?
                .eq(pad as u32)?
                .unsqueeze(1)?
                .broadcast_as(rows.shape())?;
            is_pad.where_cond(&rows.detach(), &rows)?
        }
    };
    rows.reshape(out_dims)
}

/// A keep-mask scaled by `1 / (1 - p)` of `shape` on `device`, element `i` kept as
/// [`dropout_keep`]`(seed, i, p)` decides: the fused ops' masks, drawn on the host.
fn dropout_scale(shape: &[usize], p: f64, seed: u64, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let scale = (1.0 / (1.0 - p)) as f32;
    let mask: Vec<f32> = (0..n as u64)
        .map(|i| if dropout_keep(seed, i, p) { scale } else { 0.0 })
        .collect();
    Tensor::from_vec(mask, shape, device)
}

/// Seeded dropout with the fused op's mask.
pub(super) fn dropout(x: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    let scale = dropout_scale(x.dims(), p, seed, x.device())?;
    (f32(x)? * scale)?.to_dtype(x.dtype())
}

/// The real rows of a padded `[sequences, padded_len, width]` tensor, packed.
fn packed_rows(padded: &Tensor, seqs: &PackedSequences) -> Result<Tensor> {
    let (b, len, width) = padded.dims3()?;
    let rows = Tensor::from_slice(seqs.padded_rows(), seqs.tokens(), padded.device())?;
    padded.reshape((b * len, width))?.index_select(&rows, 0)
}

/// Dropout of packed rows `x` `[tokens, width]` with the padded batch's mask: dropout of the
/// padded batch, its real rows taken back.
pub(super) fn dropout_packed(
    x: &Tensor,
    p: f64,
    seed: u64,
    seqs: &PackedSequences,
) -> Result<Tensor> {
    packed_rows(&dropout(&seqs.pad(x)?, p, seed)?, seqs)
}

/// Attention of packed sequences: the padded batch's attention under a mask hiding each
/// sequence's padding (the padded rows' dropout draws), its real rows taken back.
pub(super) fn varlen_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: (usize, usize),
    causal: bool,
    seqs: &PackedSequences,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    let len = seqs.padded_len();
    let hidden: Vec<f32> = (0..seqs.sequences())
        .flat_map(|b| (0..len).map(move |j| (b, j)))
        .map(|(b, j)| {
            if j < seqs.len(b) {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let mask = Tensor::from_vec(hidden, (seqs.sequences(), 1, 1, len), q.device())?;
    let (q, k, v) = (seqs.pad(q)?, seqs.pad(k)?, seqs.pad(v)?);
    let out = attention(&q, &k, &v, heads, causal, Some(&mask), dropout)?;
    packed_rows(&out, seqs)
}

/// Cross-entropy of `logits` `[N, C]` (taken in f32) against `targets` `[N]`: PyTorch's,
/// targets equal to `ignore_index` counted out, `label_smoothing`, the mean over the counted
/// targets or (`mean` false) their sum.
pub(super) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
    label_smoothing: f64,
    mean: bool,
) -> Result<Tensor> {
    let logits = f32(logits)?;
    let (n, c) = logits.dims2()?;
    let targets: Vec<i64> = targets.to_dtype(DType::I64)?.to_vec1()?;
    if targets.len() != n {
        candle_core::bail!(
            "cross_entropy: {} targets for {n} rows of logits",
            targets.len()
        );
    }
    let mut picked = Vec::with_capacity(n);
    let mut weights = Vec::with_capacity(n);
    for (row, &t) in targets.iter().enumerate() {
        let counts = t != ignore_index;
        if counts && (t < 0 || t as usize >= c) {
            candle_core::bail!("cross_entropy: target {t} of row {row} is not a class of {c}");
        }
        picked.push(if counts { t as u32 } else { 0 });
        weights.push(if counts { 1f32 } else { 0.0 });
    }
    let counted: f32 = weights.iter().sum();
    let device = logits.device();
    let max = logits.max_keepdim(1)?.detach();
    let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + &max)?;
    let log_p = logits.broadcast_sub(&lse)?;
    let picked = Tensor::from_vec(picked, (n, 1), device)?;
    let nll = log_p.gather(&picked, 1)?.neg()?.squeeze(1)?;
    let per_row = if label_smoothing > 0.0 {
        let uniform = (log_p.mean(1)?.neg()? * label_smoothing)?;
        ((nll * (1.0 - label_smoothing))? + uniform)?
    } else {
        nll
    };
    let total = (per_row * Tensor::from_vec(weights, n, device)?)?.sum_all()?;
    match (mean, counted > 0.0) {
        (false, _) => Ok(total),
        (true, true) => total / f64::from(counted),
        // PyTorch gives NaN for a mean over no targets; the fused op gives 0.
        (true, false) => total.zeros_like(),
    }
}

/// Rotary embedding in f32, `x cos + rotate_half(x) sin`, with the fused op's angles: `cos`
/// and `sin` `[positions, head_dim / 2]`, the positions of one sequence (shared by the batch)
/// or of each; `x` `[batch, heads, seq, head_dim]` or (`seq_first`) `[batch, seq, heads,
/// head_dim]`.
pub(super) fn rope(
    x: &Tensor,
    cos: &[f32],
    sin: &[f32],
    positions: usize,
    seq_first: bool,
) -> Result<Tensor> {
    let (b, a, c, d) = x.dims4()?;
    let seq = if seq_first { a } else { c };
    let rows = positions / seq.max(1);
    if rows * seq != positions || (rows != 1 && rows != b) || cos.len() != positions * (d / 2) {
        candle_core::bail!(
            "rope: angles of {positions} position(s) do not fit an input of {:?}",
            x.dims()
        );
    }
    let full = |v: &[f32]| -> Result<Tensor> {
        let t = if seq_first {
            Tensor::from_slice(v, (rows, seq, 1, d / 2), x.device())?
        } else {
            Tensor::from_slice(v, (rows, 1, seq, d / 2), x.device())?
        };
        Tensor::cat(&[&t, &t], 3)
    };
    let (cos, sin) = (full(cos)?, full(sin)?);
    let x32 = f32(x)?;
    let (x1, x2) = (x32.narrow(3, 0, d / 2)?, x32.narrow(3, d / 2, d / 2)?);
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
    (x32.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?.to_dtype(x.dtype())
}

/// Attention of `heads` query heads over `kv_heads` K/V heads (each serving `heads /
/// kv_heads` consecutive query heads), `[batch, seq, heads * head_dim]` operands: scores in
/// f32, the whole `[seq, seq]` score matrix per head, the fused op's dropout mask.
#[allow(clippy::too_many_arguments)] // the fused op's arguments, its head counts unpacked
pub(super) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (heads, kv_heads): (usize, usize),
    causal: bool,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    let (b, s, width) = q.dims3()?;
    let hd = width / heads.max(1);
    let split = |t: &Tensor, n: usize| -> Result<Tensor> {
        let t = f32(t)?
            .contiguous()?
            .reshape((b, s, n, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        if n == heads {
            return Ok(t);
        }
        // Each K/V head serves heads / kv_heads consecutive query heads.
        let group = heads / n.max(1);
        t.unsqueeze(2)?
            .broadcast_as((b, n, group, s, hd))?
            .contiguous()?
            .reshape((b, heads, s, hd))
    };
    let (q4, k4, v4) = (split(q, heads)?, split(k, kv_heads)?, split(v, kv_heads)?);
    let mut scores = (q4.matmul(&k4.t()?)? / (hd as f64).sqrt())?;
    if let Some(m) = mask {
        scores = scores.broadcast_add(&f32(m)?)?;
    }
    if causal {
        let above: Vec<f32> = (0..s * s)
            .map(|i| {
                if i % s > i / s {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        scores = scores.broadcast_add(&Tensor::from_vec(above, (s, s), q.device())?)?;
    }
    let mut p = softmax_last_dim(&scores)?;
    if let Some((prob, seed)) = dropout.filter(|(prob, _)| *prob > 0.0) {
        p = (p * dropout_scale(&[b, heads, s, s], prob, seed, q.device())?)?;
    }
    p.matmul(&v4)?
        .transpose(1, 2)?
        .reshape((b, s, width))?
        .to_dtype(q.dtype())
}

#[cfg(test)]
mod tests;
