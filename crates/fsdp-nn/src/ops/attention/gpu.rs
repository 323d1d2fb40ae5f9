//! [`Sdpa`] on a CUDA device: fsdp-nn's attention kernels
//! (`kernels/attention.cu`), which keep each score row's log-sum-exp on the device for
//! backward (`Sdpa::gpu_lse`) instead of any `[seq, seq]` matrix, over a padded batch or over
//! packed sequences (`varlen_attention`).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CudaStorage, Layout, Result, Shape, Tensor};

use super::{Dims, Sdpa, dims3};
use crate::ops::cuda_kernels::{
    self, Operand, Output, gradient_tensor, operand, take_storage, take_tensor,
};
use crate::ops::kernel_plan::{AttentionShape, attention_buffers as ab};

/// An operand's (batch, row) element strides; its rows must be contiguous.
fn strides(l: &Layout, what: &str) -> Result<(usize, usize)> {
    match l.stride() {
        [batch, row, 1] => Ok((*batch, *row)),
        other => candle_core::bail!(
            "sdpa on a GPU: {what} must be [batch, seq, width] with contiguous rows (strides {other:?})"
        ),
    }
}

impl Sdpa {
    /// The kernels' description of this call on `dims`, operands at the given strides (a
    /// packed call's have no batch stride).
    fn gpu_shape(
        &self,
        dims: Dims,
        dtype: candle_core::DType,
        strides: [(usize, usize); 3],
    ) -> Result<AttentionShape> {
        let [q, k, v] = strides.map(|(batch, row)| (self.batch_stride(batch), row));
        Ok(AttentionShape {
            batch: dims.batch,
            seq: dims.seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: dims.head_dim,
            dtype,
            causal: self.causal,
            scale: self.scale,
            q,
            k,
            v,
            mask: self.mask.as_ref().map(|m| m.dims),
            dropout: self.dropout,
            tiled: AttentionShape::tiles(dims.head_dim),
            packed: self.packed.is_some(),
        })
    }

    /// The forward of q, k, v (rows may be strided) on their GPU; keeps the log-sum-exps.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gpu_forward(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let types = [("q", s1.dtype()), ("k", s2.dtype()), ("v", s3.dtype())];
        cuda_kernels::same_types("sdpa", &types)?;
        let dims = self.dims(dims3(l1)?, dims3(l2)?, dims3(l3)?)?;
        let all = [strides(l1, "q")?, strides(l2, "k")?, strides(l3, "v")?];
        let shape = self.gpu_shape(dims, s1.dtype(), all)?;
        let mask = self.mask.as_ref().map(|m| m.values.storage_and_layout());
        let starts = match &self.packed {
            Some(p) => Some(s1.device().storage_from_slice(&p.row_starts())?),
            None => None,
        };
        let mut inputs: Vec<(usize, Operand<'_>)> = vec![
            (ab::Q, (s1, l1.start_offset())),
            (ab::K, (s2, l2.start_offset())),
            (ab::V, (s3, l3.start_offset())),
        ];
        if let Some((storage, layout)) = &mask {
            inputs.push((ab::MASK, operand(storage, layout, "sdpa mask")?));
        }
        if let Some(starts) = &starts {
            inputs.push((ab::STARTS, (starts, 0)));
        }
        let rows = dims.batch * self.heads * dims.seq;
        let width = self.heads * dims.head_dim;
        let outputs = [
            Output::tensor(ab::OUT, self.rows(dims) * width),
            Output::scratch(ab::LSE, rows),
        ];
        let mut out = cuda_kernels::execute(s1.dtype(), &shape.forward()?, &inputs, &outputs)?;
        let lse = gradient_tensor(take_storage(&mut out, ab::LSE)?, &Shape::from(rows));
        *self.gpu_lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        let y = take_storage(&mut out, ab::OUT)?;
        Ok((y, l1.shape().clone()))
    }

    /// dQ, dK, dV on the GPU from the output `res`, its gradient and forward's
    /// log-sum-exps.
    pub(super) fn gpu_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let types = [
            ("q", q.dtype()),
            ("k", k.dtype()),
            ("v", v.dtype()),
            ("output", res.dtype()),
            ("output gradient", grad.dtype()),
        ];
        cuda_kernels::same_types("sdpa backward", &types)?;
        let dims = self.dims(q.dims3()?, k.dims3()?, v.dims3()?)?;
        let (s, qw, kw) = (
            dims.seq,
            self.heads * dims.head_dim,
            self.kv_heads * dims.head_dim,
        );
        // Every operand is made contiguous by `execute_on_tensors` (packed ones have no batch
        // stride).
        let dense = [(s * qw, qw), (s * kw, kw), (s * kw, kw)]
            .map(|(batch, row)| (self.batch_stride(batch), row));
        let shape = self.gpu_shape(dims, q.dtype(), dense)?;
        let lse = self
            .gpu_lse
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("sdpa: backward before forward".into()))?;
        let mut inputs = vec![
            (ab::Q, q, "sdpa q"),
            (ab::K, k, "sdpa k"),
            (ab::V, v, "sdpa v"),
            (ab::OUT, res, "sdpa output"),
            (ab::DOUT, grad, "sdpa output gradient"),
            (ab::LSE, &lse, "sdpa log-sum-exps"),
        ];
        if let Some(m) = &self.mask {
            inputs.push((ab::MASK, &m.values, "sdpa mask"));
        }
        let starts = match &self.packed {
            Some(p) => Some(Tensor::new(p.row_starts(), q.device())?),
            None => None,
        };
        if let Some(starts) = &starts {
            inputs.push((ab::STARTS, starts, "packed sequences' starts"));
        }
        let outputs = [
            Output::scratch(ab::DELTA, dims.batch * self.heads * s),
            Output::tensor(ab::DQ, q.elem_count()),
            Output::tensor(ab::DK, k.elem_count()),
            Output::tensor(ab::DV, v.elem_count()),
        ];
        let plan = shape.backward(dense[0], dense[1])?;
        let mut out = cuda_kernels::execute_on_tensors(&plan, &inputs, &outputs)?;
        Ok((
            Some(take_tensor(&mut out, ab::DQ, q.shape())?),
            Some(take_tensor(&mut out, ab::DK, k.shape())?),
            Some(take_tensor(&mut out, ab::DV, v.shape())?),
        ))
    }
}
