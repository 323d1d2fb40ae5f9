//! Attention as candle custom ops: [`Sdpa`] on three operands, `PackedSdpa` on one fused
//! QKV projection, and the public functions. Half-precision inputs are multiplied in their
//! own type with f32 sums (the bf16 GEMM's dot products); scores, softmax, probabilities'
//! gradients and the accumulated dQ/dK/dV stay in f32, and only the products' operands
//! (probabilities, their gradients) are rounded to half precision, as flash attention does.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};

use std::sync::Mutex;

use super::{Dims, GradOut, Mask, PackedSequences, Sdpa, View, dims3, view};
use crate::ops::{Float, float_dispatch, tensor, with_slice};

/// Attention on three operands q, k, v.
impl CustomOp3 for Sdpa {
    fn name(&self) -> &'static str {
        "fused-sdpa"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims(dims3(l1)?, dims3(l2)?, dims3(l3)?)?;
        float_dispatch!(s1.dtype(), self.name(), T => {
            let operand = |s, l| {
                view::<T>(s, l, 0, self.name()).map(|mut v| {
                    v.batch = self.batch_stride(v.batch);
                    v
                })
            };
            let out = self.forward::<T>(
                &operand(s1, l1)?,
                &operand(s2, l2)?,
                &operand(s3, l3)?,
                dims,
            )?;
            Ok((T::storage(out), l1.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.gpu_forward(s1, l1, s2, l2, s3, l3)
    }

    fn bwd(
        &self,
        q_t: &Tensor,
        k_t: &Tensor,
        v_t: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if q_t.device().is_cuda() {
            return self.gpu_backward(q_t, k_t, v_t, res, grad);
        }
        let dims = self.dims(q_t.dims3()?, k_t.dims3()?, v_t.dims3()?)?;
        let (s, qw, kw) = (
            self.batch_stride(dims.seq),
            self.heads * dims.head_dim,
            self.kv_heads * dims.head_dim,
        );
        float_dispatch!(q_t.dtype(), self.name(), T => {
            // In `T::Acc` (f32 for half precision: dK and dV sum over heads and blocks),
            // rounded once at the end.
            let (mut dq, mut dk, mut dv) = (
                vec![<T as Float>::Acc::of(0.0); q_t.elem_count()],
                vec![<T as Float>::Acc::of(0.0); k_t.elem_count()],
                vec![<T as Float>::Acc::of(0.0); v_t.elem_count()],
            );
            with_slice::<T, _>(q_t, self.name(), |q| {
                with_slice::<T, _>(k_t, self.name(), |k| {
                    with_slice::<T, _>(v_t, self.name(), |v| {
                        self.with_output_grad::<T, _>(res, grad, |o, g| {
                            self.backward::<T>(
                                &View::dense(q, s, qw, 0),
                                &View::dense(k, s, kw, 0),
                                &View::dense(v, s, kw, 0),
                                o,
                                g,
                                dims,
                                &mut GradOut::Separate([&mut dq, &mut dk, &mut dv]),
                            )
                        })
                    })
                })
            })?;
            Ok((
                Some(tensor(T::from_acc_vec(dq), q_t.shape(), q_t)?),
                Some(tensor(T::from_acc_vec(dk), k_t.shape(), k_t)?),
                Some(tensor(T::from_acc_vec(dv), v_t.shape(), v_t)?),
            ))
        })
    }
}

/// Attention on one packed `[batch, seq, 3 * width]` projection (q, k, v side by side): its
/// gradient is one tensor written in place, where slicing the projection would cost candle a
/// zero-padded copy per slice in backward.
struct PackedSdpa(Sdpa);

impl PackedSdpa {
    /// (batch, seq, width of one projection) of a packed `[batch, seq, 3 * width]` layout.
    fn width(l: &Layout) -> Result<(usize, usize, usize)> {
        let (b, s, w3) = dims3(l)?;
        if w3 % 3 != 0 {
            return Err(candle_core::Error::Msg(format!(
                "sdpa: packed qkv {:?} is not three projections wide",
                l.dims()
            )));
        }
        Ok((b, s, w3 / 3))
    }
}

impl CustomOp1 for PackedSdpa {
    fn name(&self) -> &'static str {
        "fused-sdpa-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = Self::width(l)?;
        let (dims, w) = (self.0.dims(shape, shape, shape)?, shape.2);
        float_dispatch!(s.dtype(), self.name(), T => {
            let part = |i| view::<T>(s, l, i * w, self.name());
            let out = self.0.forward::<T>(&part(0)?, &part(1)?, &part(2)?, dims)?;
            Ok((T::storage(out), Shape::from(shape)))
        })
    }

    fn bwd(&self, qkv_t: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let shape = Self::width(qkv_t.layout())?;
        let (dims, (b, s, w)) = (self.0.dims(shape, shape, shape)?, shape);
        float_dispatch!(qkv_t.dtype(), self.name(), T => {
            let dqkv = with_slice::<T, _>(qkv_t, self.name(), |qkv| {
                self.0.with_output_grad::<T, _>(res, grad, |o, g| {
                    let part = |i: usize| View::dense(qkv, s, 3 * w, i * w);
                    let mut dqkv = vec![<T as Float>::Acc::of(0.0); 3 * b * s * w];
                    let mut out = GradOut::Packed(&mut dqkv);
                    self.0.backward::<T>(&part(0), &part(1), &part(2), o, g, dims, &mut out)?;
                    Ok(T::from_acc_vec(dqkv))
                })
            })?;
            Ok(Some(tensor(dqkv, qkv_t.shape(), qkv_t)?))
        })
    }
}

/// How many query and K/V heads an attention call has, and whether it is causal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionHeads {
    /// Query heads.
    pub heads: usize,
    /// K/V heads (`num_key_value_heads`): equal to `heads` for multi-head attention, a divisor
    /// of it for grouped-query attention (each serves `heads / kv_heads` consecutive query
    /// heads, as transformers' `repeat_kv` orders them), 1 for multi-query.
    pub kv_heads: usize,
    /// Query `i` attends to keys `0..=i` only (decoder self-attention); the masked half of
    /// the work is skipped rather than computed and masked.
    pub causal: bool,
}

impl AttentionHeads {
    /// Multi-head attention, every key visible (unless a mask hides it).
    pub fn full(heads: usize) -> AttentionHeads {
        AttentionHeads {
            heads,
            kv_heads: heads,
            causal: false,
        }
    }
}

impl Sdpa {
    /// The call's extents from the shapes of q, k and v, checked against the head counts.
    pub(super) fn dims(
        &self,
        (batch, seq, qw): (usize, usize, usize),
        k: (usize, usize, usize),
        v: (usize, usize, usize),
    ) -> Result<Dims> {
        let head_dim = qw / self.heads;
        let kv = (batch, seq, self.kv_heads * head_dim);
        if head_dim == 0 || qw % self.heads != 0 || k != kv || v != kv {
            return Err(candle_core::Error::Msg(format!(
                "sdpa: q {:?}, k {k:?} and v {v:?} do not fit {} query and {} K/V heads (k and v must be [batch, seq, kv_heads * head_dim] for q [batch, seq, heads * head_dim])",
                (batch, seq, qw),
                self.heads,
                self.kv_heads
            )));
        }
        match &self.packed {
            None => Ok(Dims {
                batch,
                seq,
                head_dim,
            }),
            Some(p) if batch == 1 && seq == p.tokens() => Ok(Dims {
                batch: p.sequences(),
                seq: p.padded_len(),
                head_dim,
            }),
            Some(p) => Err(candle_core::Error::Msg(format!(
                "sdpa: packed operands of {} tokens must be [1, {}, width] (got [{batch}, {seq}, {qw}])",
                p.tokens(),
                p.tokens()
            ))),
        }
    }
}

/// Checks the attention settings and builds the op (mask broadcast to
/// `[batch, heads, seq, seq]`).
fn sdpa_op(
    (batch, seq, width): (usize, usize, usize),
    dtype: candle_core::DType,
    heads: AttentionHeads,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Sdpa> {
    let AttentionHeads {
        heads,
        kv_heads,
        causal,
    } = heads;
    if heads == 0 || width % heads != 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(candle_core::Error::Msg(format!(
            "sdpa: width {width} is not a multiple of {heads} heads, or {heads} query heads are not a multiple of {kv_heads} K/V heads"
        )));
    }
    if let Some((p, _)) = dropout
        && !(0.0..1.0).contains(&p)
    {
        return Err(candle_core::Error::Msg(format!(
            "attention dropout probability {p} is not in [0, 1)"
        )));
    }
    let mask = match mask {
        None => None,
        Some(m) => {
            let md = m.dims();
            if md.len() > 4 {
                return Err(candle_core::Error::Msg(format!(
                    "sdpa: mask has {} dims (at most 4)",
                    md.len()
                )));
            }
            let mut dims = [1usize; 4];
            dims[4 - md.len()..].copy_from_slice(md);
            let full = [batch, heads, seq, seq];
            if dims.iter().zip(full).any(|(&d, f)| d != 1 && d != f) {
                return Err(candle_core::Error::Msg(format!(
                    "sdpa: mask {md:?} does not broadcast to {full:?}"
                )));
            }
            // Added to the scores, which half precision keeps in f32.
            let acc = match dtype {
                DType::BF16 | DType::F16 => DType::F32,
                other => other,
            };
            Some(Mask {
                values: m.detach().to_dtype(acc)?.contiguous()?,
                dims,
            })
        }
    };
    Ok(Sdpa {
        heads,
        kv_heads,
        causal,
        scale: 1.0 / ((width / heads) as f64).sqrt(),
        mask,
        dropout: dropout.filter(|(p, _)| *p > 0.0),
        packed: None,
        lse: Mutex::new(Vec::new()),
        #[cfg(feature = "cuda")]
        gpu_lse: Mutex::new(None),
    })
}

/// `softmax(Q K^T / sqrt(head_dim) + mask) V` per head, with optional dropout
/// `(probability, seed)` on the probabilities. `q`, `k`, `v`: `[batch, seq, heads * head_dim]`
/// (rows may be strided); `mask`: additive, broadcastable to `[batch, heads, seq, seq]`
/// (e.g. `[batch, 1, 1, seq]` padding or `[1, 1, seq, seq]` causal). Returns
/// `[batch, seq, heads * head_dim]`.
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    grouped_query_attention(q, k, v, AttentionHeads::full(heads), mask, dropout)
}

/// [`grouped_query_attention`] of packed sequences: `q` `[tokens, heads * head_dim]`, `k`
/// and `v` `[tokens, kv_heads * head_dim]` (rows may be strided), each sequence of `seqs`
/// attending within itself; dropout `(probability, seed)` draws the masks of the padded
/// batch `seqs` came from. Returns `[tokens, heads * head_dim]`: on every token, what the
/// padded call with a padding mask computes, up to the order of its sums. On the CPU and (f32,
/// bf16) on a CUDA device it attends over the real tokens only; elsewhere it composes candle's
/// ops over the padded batch.
pub fn varlen_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: AttentionHeads,
    seqs: &PackedSequences,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    let (tokens, width) = q.dims2()?;
    if !super::super::has_kernels(q) && !on_gpu_kernels(q, width, heads.heads) {
        return super::super::composed::varlen_attention(
            q,
            k,
            v,
            (heads.heads, heads.kv_heads),
            heads.causal,
            seqs,
            dropout,
        );
    }
    let rows = |t: &Tensor| -> Result<Tensor> {
        let (n, w) = t.dims2()?;
        t.reshape((1, n, w))
    };
    let mut op = sdpa_op(
        (seqs.sequences(), seqs.padded_len(), width),
        q.dtype(),
        heads,
        None,
        dropout,
    )?;
    op.packed = Some(seqs.clone());
    rows(q)?
        .apply_op3(&rows(k)?, &rows(v)?, op)?
        .reshape((tokens, width))
}

/// Attention with `heads.kv_heads` K/V heads serving `heads.heads` query heads, causal or
/// not: `q` `[batch, seq, heads * head_dim]`, `k` and `v` `[batch, seq, kv_heads * head_dim]`
/// (rows may be strided), `mask` additive and broadcastable to `[batch, heads, seq, seq]`
/// (padding; causality is `heads.causal`, not a mask), optional dropout
/// `(probability, seed)`. The K/V heads are read in place, never repeated. Returns
/// `[batch, seq, heads * head_dim]`. Half-precision inputs keep f32 scores and sums.
pub fn grouped_query_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: AttentionHeads,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    if !super::super::has_kernels(q) && !on_gpu_kernels(q, q.dims3()?.2, heads.heads) {
        return super::super::composed::attention(
            q,
            k,
            v,
            (heads.heads, heads.kv_heads),
            heads.causal,
            mask,
            dropout,
        );
    }
    let op = sdpa_op(q.dims3()?, q.dtype(), heads, mask, dropout)?;
    q.apply_op3(k, v, op)
}

/// Whether attention on `q` (`width` columns of `heads` heads) runs on fsdp-nn's CUDA
/// kernels: a GPU tensor of a type they take, heads they fit.
fn on_gpu_kernels(q: &Tensor, width: usize, heads: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        super::super::has_cuda_kernels(q)
            && heads > 0
            && width.is_multiple_of(heads)
            && crate::ops::kernel_plan::AttentionShape::fits(width / heads)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, width, heads);
        false
    }
}

/// [`scaled_dot_product_attention`] on a fused projection `qkv` `[batch, seq, 3 * width]`
/// holding q, k and v side by side (BERT's query/key/value or GPT-2's `c_attn` computed by
/// one GEMM); `causal` limits query `i` to keys `0..=i`. Returns `[batch, seq, width]`.
pub fn packed_attention(
    qkv: &Tensor,
    heads: usize,
    causal: bool,
    mask: Option<&Tensor>,
    dropout: Option<(f64, u64)>,
) -> Result<Tensor> {
    let heads = AttentionHeads {
        causal,
        ..AttentionHeads::full(heads)
    };
    if !super::super::has_kernels(qkv) {
        let width = qkv.dim(2)? / 3;
        let part = |i: usize| qkv.narrow(2, i * width, width);
        // The GPU kernels read the three parts in place (their rows are strided).
        let probe = part(0)?;
        if on_gpu_kernels(&probe, width, heads.heads) {
            return grouped_query_attention(&probe, &part(1)?, &part(2)?, heads, mask, dropout);
        }
        return super::super::composed::attention(
            &part(0)?,
            &part(1)?,
            &part(2)?,
            (heads.heads, heads.kv_heads),
            heads.causal,
            mask,
            dropout,
        );
    }
    let shape = PackedSdpa::width(qkv.layout())?;
    let op = sdpa_op(shape, qkv.dtype(), heads, mask, dropout)?;
    qkv.apply_op1(PackedSdpa(op))
}
