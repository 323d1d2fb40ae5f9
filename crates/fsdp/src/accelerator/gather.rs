//! Gathering values over the ranks for metrics: vectors of any element type a program
//! computes (`bool` predictions, `u32` token ids, floats of every width) and tensors of every
//! dtype the engine computes in, concatenated in rank order, with the repeats that filled up
//! the last step of an epoch dropped by the `_for_metrics` forms.

use candle_core::{DType, Tensor};
use fsdp_comm::{BufferElement, CommunicatorExt};
use half::{bf16, f16};

use super::{Accelerator, AcceleratorError};
use crate::data::LoadedBatch;

/// An element type [`Accelerator::gather`] moves: the collectives' own types as they are,
/// the others through a wider one that holds every value exactly (`bool` as `u8`, `u16`,
/// `i16` and `i8` as `i32`, `u32` as `i64`, `u64` and `usize` as the bits of an `i64`).
pub trait Gatherable: Copy + Send + 'static {
    /// The type on the wire.
    type Wire: BufferElement;
    /// The value as sent.
    fn to_wire(self) -> Self::Wire;
    /// The value as received (what [`Gatherable::to_wire`] made, from any rank).
    fn from_wire(w: Self::Wire) -> Self;
}

macro_rules! gatherable {
    ($($t:ty => $wire:ty, |$a:ident| $to:expr, |$b:ident| $from:expr;)*) => {
        $(impl Gatherable for $t {
            type Wire = $wire;
            fn to_wire(self) -> $wire {
                let $a = self;
                $to
            }
            fn from_wire(w: $wire) -> $t {
                let $b = w;
                $from
            }
        })*
    };
}

gatherable! {
    f32 => f32, |x| x, |w| w;
    f64 => f64, |x| x, |w| w;
    f16 => f16, |x| x, |w| w;
    bf16 => bf16, |x| x, |w| w;
    i32 => i32, |x| x, |w| w;
    i64 => i64, |x| x, |w| w;
    u8 => u8, |x| x, |w| w;
    bool => u8, |x| u8::from(x), |w| w != 0;
    i8 => i32, |x| i32::from(x), |w| w as i8;
    i16 => i32, |x| i32::from(x), |w| w as i16;
    u16 => i32, |x| i32::from(x), |w| w as u16;
    u32 => i64, |x| i64::from(x), |w| w as u32;
    u64 => i64, |x| x as i64, |w| w as u64;
    usize => i64, |x| x as i64, |w| w as usize;
}

impl Accelerator {
    /// Every rank's `values` (the same length on all), concatenated in rank order, on every
    /// rank.
    pub fn gather<T: Gatherable>(&self, values: Vec<T>) -> Result<Vec<T>, AcceleratorError> {
        let wire: Vec<T::Wire> = values.into_iter().map(T::to_wire).collect();
        let all = self.group.all_gather_vec(wire).wait()?;
        Ok(all.into_iter().map(T::from_wire).collect())
    }

    /// [`Accelerator::gather`] of per-example values of `batch`, without the repeats that
    /// filled up the last step of the epoch, so every example counts once.
    ///
    /// ```
    /// # use fsdp::accelerator::Accelerator;
    /// # use fsdp::models::{BertConfig, BertForSequenceClassification};
    /// # use fsdp::nn::SeededWeights;
    /// # use fsdp::nn::candle::{Device, Tensor};
    /// # use fsdp::optim::{AdamW, AdamWConfig};
    /// # fn main() -> anyhow::Result<()> {
    /// # let mut acc = Accelerator::new()?;
    /// # let config = BertConfig { vocab_size: 32, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 32, max_position_embeddings: 8, ..BertConfig::default() };
    /// # let mut model = acc.prepare_model(BertForSequenceClassification::new(config.clone())?, &SeededWeights(1))?;
    /// # let mut opt = acc.prepare_optimizer(AdamW::new(AdamWConfig::default())?)?;
    /// use fsdp::data::{CollateError, DataLoader};
    ///
    /// // 10 held-out examples in steps of 4 per rank: the last step is filled up with repeats.
    /// let examples: Vec<(Vec<u32>, u32)> = (0..10).map(|i| (vec![1 + i % 7, 2, 3], i % 2)).collect();
    /// let collate = |ex: &[(Vec<u32>, u32)]| -> Result<(Tensor, Tensor), CollateError> {
    ///     let ids: Vec<u32> = ex.iter().flat_map(|(ids, _)| ids.clone()).collect();
    ///     let labels: Vec<u32> = ex.iter().map(|(_, label)| *label).collect();
    ///     Ok((Tensor::from_vec(ids, (ex.len(), 3), &Device::Cpu)?, Tensor::from_vec(labels, ex.len(), &Device::Cpu)?))
    /// };
    /// let mut held_out = acc.prepare_data_loader(DataLoader::new(examples, 4, collate));
    /// let (mut correct, mut seen) = (0, 0);
    /// while let Some(batch) = held_out.next_batch() {
    ///     let batch = batch?;
    ///     let (ids, labels) = &batch.batch;
    ///     let predicted: Vec<u32> = model.evaluate(|m, p| m.forward(p, ids, None, None)?.argmax(1)?.to_vec1())?;
    ///     let hits: Vec<bool> = predicted.iter().zip(labels.to_vec1::<u32>()?).map(|(p, l)| *p == l).collect();
    ///     let hits = acc.gather_for_metrics(hits, &batch)?;   // every rank's, repeats dropped
    ///     correct += hits.iter().filter(|&&hit| hit).count();
    ///     seen += hits.len();
    /// }
    /// assert_eq!(seen, 10);
    /// # let _ = correct;
    /// # Ok(())
    /// # }
    /// ```
    pub fn gather_for_metrics<T: Gatherable, B>(
        &self,
        values: Vec<T>,
        batch: &LoadedBatch<B>,
    ) -> Result<Vec<T>, AcceleratorError> {
        let mut all = self.gather(values)?;
        all.truncate(batch.real);
        Ok(all)
    }

    /// Every rank's `tensor` concatenated along dimension 0 in rank order, on every rank
    /// (Accelerate's `gather`). Any dtype the engine computes in (u8, u32, i16, i32, i64,
    /// bf16, f16, f32, f64); the shapes must agree on every rank (checked: an error names
    /// the ranks that differ, on all of them).
    pub fn gather_tensor(&self, tensor: &Tensor) -> Result<Tensor, AcceleratorError> {
        let dims = tensor.dims().to_vec();
        if dims.is_empty() {
            return Err(AcceleratorError::GatherScalar);
        }
        // The shapes first (rank, then dims), so a mismatch is an error, not a scrambled tensor.
        let mut shape: Vec<i64> = vec![dims.len() as i64];
        shape.extend(dims.iter().map(|&d| d as i64));
        let shapes = self.gather(self.pad_shape(shape)?)?;
        let width = shapes.len() / self.num_processes();
        let ours = &shapes[self.process_index() * width..][..width];
        let differing: Vec<usize> = (0..self.num_processes())
            .filter(|r| &shapes[r * width..][..width] != ours)
            .collect();
        if !differing.is_empty() {
            return Err(AcceleratorError::GatherShapes {
                rank: self.process_index(),
                dims,
                differing,
            });
        }
        let mut out_dims = dims.clone();
        out_dims[0] *= self.num_processes();
        let flat = tensor.flatten_all()?;
        let device = tensor.device();
        macro_rules! gathered {
            ($t:ty) => {
                Tensor::from_vec(self.gather(flat.to_vec1::<$t>()?)?, out_dims, device)?
            };
        }
        Ok(match tensor.dtype() {
            DType::U8 => gathered!(u8),
            DType::U32 => gathered!(u32),
            DType::I16 => gathered!(i16),
            DType::I32 => gathered!(i32),
            DType::I64 => gathered!(i64),
            DType::BF16 => gathered!(bf16),
            DType::F16 => gathered!(f16),
            DType::F32 => gathered!(f32),
            DType::F64 => gathered!(f64),
            other => {
                return Err(AcceleratorError::GatherDtype { dtype: other });
            }
        })
    }

    /// [`Accelerator::gather_tensor`] of a tensor with one row (dimension 0) per example of
    /// `batch`, without the repeats that filled up the last step of the epoch (Accelerate's
    /// `gather_for_metrics`).
    pub fn gather_tensor_for_metrics<B>(
        &self,
        tensor: &Tensor,
        batch: &LoadedBatch<B>,
    ) -> Result<Tensor, AcceleratorError> {
        let all = self.gather_tensor(tensor)?;
        let rows = batch.real.min(all.dim(0)?);
        Ok(all.narrow(0, 0, rows)?)
    }

    /// `shape` (its rank first) padded to the same length on every rank (the longest rank's
    /// count of dimensions), so the shapes can be gathered.
    fn pad_shape(&self, mut shape: Vec<i64>) -> Result<Vec<i64>, AcceleratorError> {
        let longest = self.reduce(vec![shape.len() as i64], fsdp_comm::ReduceOp::Max)?[0];
        shape.resize(longest as usize, -1);
        Ok(shape)
    }
}
