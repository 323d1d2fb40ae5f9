//! Embedding lookup with PyTorch's `padding_idx`: the padding row is read like any other, but
//! receives no gradient (Hugging Face BERT's `pad_token_id` row stays as loaded). Backward
//! adds each position's gradient into its row of a fresh table-sized buffer. On a GPU the
//! ids are checked on the host, the rows gathered by candle's `index_select`, and backward
//! runs `kernels/embedding.cu`: each row's positions, grouped on the host, added in the
//! CPU's order (the CPU's bits, no atomics).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, tensor, with_slice};

struct Embedding {
    padding_idx: Option<usize>,
    /// The ids as forward read and checked them, for backward (on a GPU they were copied to
    /// the host once).
    ids: Mutex<Option<Vec<usize>>>,
}

impl Embedding {
    /// The ids forward kept, else `ids` read (and checked) anew.
    fn ids_for_backward(&self, ids: &Tensor, rows: usize) -> Result<Vec<usize>> {
        let kept = self.ids.lock().unwrap_or_else(|e| e.into_inner()).take();
        match kept {
            Some(ids) => Ok(ids),
            None => ids_of(
                &ids.to_device(&candle_core::Device::Cpu)?,
                rows,
                self.name(),
            ),
        }
    }

    fn keep(&self, ids: Vec<usize>) {
        *self.ids.lock().unwrap_or_else(|e| e.into_inner()) = Some(ids);
    }
}

/// The ids in a contiguous integer tensor, checked against the table's `rows`.
fn ids_of(t: &Tensor, rows: usize, op: &str) -> Result<Vec<usize>> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => ids_from_storage(s, layout, rows, op),
        _ => Err(candle_core::Error::Msg(format!(
            "{op}: only CPU tensors are supported"
        ))),
    }
}

fn ids_from_storage(s: &CpuStorage, l: &Layout, rows: usize, op: &str) -> Result<Vec<usize>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: ids must be contiguous")))?;
    let raw: Vec<i64> = match s {
        CpuStorage::U32(v) => v[start..end].iter().map(|&x| i64::from(x)).collect(),
        CpuStorage::I64(v) => v[start..end].to_vec(),
        CpuStorage::U8(v) => v[start..end].iter().map(|&x| i64::from(x)).collect(),
        other => {
            return Err(candle_core::Error::Msg(format!(
                "{op}: ids must be u32, i64 or u8, not {:?}",
                other.dtype()
            )));
        }
    };
    raw.into_iter()
        .map(|id| {
            usize::try_from(id)
                .ok()
                .filter(|&i| i < rows)
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "{op}: id {id} is outside the table's {rows} rows"
                    ))
                })
        })
        .collect()
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        ws: &CpuStorage,
        wl: &Layout,
        is: &CpuStorage,
        il: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, d) = wl.shape().dims2()?;
        let ids = ids_from_storage(is, il, rows, self.name())?;
        let mut dims = il.dims().to_vec();
        dims.push(d);
        let rows_read = float_dispatch!(ws.dtype(), self.name(), T => {
            let w = contiguous::<T>(ws, wl, self.name())?;
            let mut out = Vec::with_capacity(ids.len() * d);
            for &id in &ids {
                out.extend_from_slice(&w[id * d..(id + 1) * d]);
            }
            Ok((T::storage(out), Shape::from(dims)))
        });
        self.keep(ids);
        rows_read
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        is: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, d) = wl.shape().dims2()?;
        // An id past the table would read outside it on the device: checked here first.
        self.keep(ids_from_storage(
            &is.to_cpu_storage()?,
            il,
            rows,
            self.name(),
        )?);
        let mut dims = il.dims().to_vec();
        dims.push(d);
        Ok((ws.index_select(is, wl, il, 0)?, Shape::from(dims)))
    }

    fn bwd(
        &self,
        weight: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (rows, d) = weight.dims2()?;
        let ids = self.ids_for_backward(ids, rows)?;
        #[cfg(feature = "cuda")]
        if weight.device().is_cuda() {
            return self.cuda_bwd(weight, &ids, grad).map(|dw| (Some(dw), None));
        }
        float_dispatch!(grad.dtype(), self.name(), T => {
            with_slice::<T, _>(grad, self.name(), |g| {
                // Summed in the gradient's type in position order, as PyTorch's CPU kernel.
                let mut dw = vec![T::of(0.0); rows * d];
                for (pos, &id) in ids.iter().enumerate() {
                    if Some(id) == self.padding_idx {
                        continue;
                    }
                    let row = &mut dw[id * d..(id + 1) * d];
                    for (acc, &x) in row.iter_mut().zip(&g[pos * d..(pos + 1) * d]) {
                        *acc = T::of(acc.f() + x.f());
                    }
                }
                Ok((Some(tensor(dw, weight.shape(), weight)?), None))
            })
        })
    }
}

#[cfg(feature = "cuda")]
impl Embedding {
    /// The table's gradient on the GPU for the (host) `ids`.
    fn cuda_bwd(&self, weight: &Tensor, ids: &[usize], grad: &Tensor) -> Result<Tensor> {
        use super::cuda_kernels::{self, Output, take_tensor};
        use super::kernel_plan::{EmbeddingShape, embedding_buffers as plan, positions_by_row};
        let (rows, d) = weight.dims2()?;
        let types = [("table", weight.dtype()), ("gradient", grad.dtype())];
        cuda_kernels::same_types(self.name(), &types)?;
        let (starts, mut positions) = positions_by_row(ids, rows, self.padding_idx);
        if positions.is_empty() {
            positions.push(0); // never read; a device buffer of no elements has no address
        }
        let dev = weight.device();
        let starts = Tensor::from_vec(starts, rows + 1, dev)?;
        let positions = Tensor::new(positions.as_slice(), dev)?;
        let shape = EmbeddingShape {
            rows,
            d,
            positions: ids.len(),
            dtype: grad.dtype(),
        };
        let inputs = [
            (plan::GRAD, grad, "embedding output gradient"),
            (plan::STARTS, &starts, "embedding row starts"),
            (plan::POSITIONS, &positions, "embedding positions"),
        ];
        let outputs = [Output::tensor(plan::DW, rows * d)];
        let mut out = cuda_kernels::execute_on_tensors(&shape.backward()?, &inputs, &outputs)?;
        take_tensor(&mut out, plan::DW, weight.shape())
    }
}

/// Rows of `weight` [rows, dim] for integer `ids` of any shape (output `ids.shape + [dim]`);
/// the `padding_idx` row, if any, gets no gradient (PyTorch's `nn.Embedding(padding_idx=)`).
pub fn embedding(weight: &Tensor, ids: &Tensor, padding_idx: Option<usize>) -> Result<Tensor> {
    if !super::has_kernels(weight) && !super::has_cuda_kernels(weight) {
        return super::composed::embedding(weight, ids, padding_idx);
    }
    weight.contiguous()?.apply_op2(
        &ids.contiguous()?,
        Embedding {
            padding_idx,
            ids: Mutex::new(None),
        },
    )
}
