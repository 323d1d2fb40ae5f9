//! The CPU's data plane ([`CpuPlane`]): parameters unpacked from gathered host blocks into
//! candle CPU storage, released in place by returning their pages (`madvise`) or poisoned
//! with NaN, refilled from a gathered block, gradients read as host slices and packed, a
//! checkpointed output copied.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};
use fsdp_comm::{Buffer, DType};

use super::cpu_floats::float_pair;
use super::data_plane::DataPlane;
use super::error::EngineError;
use super::plan::ShardLayout;
use super::shared_gather::Gathered;

/// The data plane of tensors in host memory.
pub(crate) struct CpuPlane;

impl DataPlane for CpuPlane {
    fn unpack(
        &self,
        gathered: &Gathered<'_>,
        layout: &ShardLayout,
        block: usize,
        ranks: usize,
    ) -> Result<Storage, EngineError> {
        unpack_storage(gathered, layout, block, ranks).map(Storage::Cpu)
    }

    fn whole(&self, values: &[f32], dtype: DType) -> Result<Storage, EngineError> {
        Ok(Storage::Cpu(
            match super::cpu_floats::float_buffer(values, dtype) {
                Some(Buffer::F32(v)) => CpuStorage::F32(v),
                Some(Buffer::F64(v)) => CpuStorage::F64(v),
                Some(Buffer::BF16(v)) => CpuStorage::BF16(v),
                Some(Buffer::F16(v)) => CpuStorage::F16(v),
                _ => {
                    return Err(EngineError::Unsupported {
                        setting: format!("computing in {dtype:?}"),
                        hint: "parameters are computed in a float type",
                    });
                }
            },
        ))
    }

    fn zeros(&self, numel: usize, dtype: DType) -> Result<Storage, EngineError> {
        // Untouched zero pages: only the pages rows are written to are ever faulted in.
        use crate::memory::lazily_zeroed;
        Ok(Storage::Cpu(match dtype {
            DType::F32 => CpuStorage::F32(lazily_zeroed(numel)),
            DType::F64 => CpuStorage::F64(lazily_zeroed(numel)),
            DType::BF16 => CpuStorage::BF16(lazily_zeroed(numel)),
            DType::F16 => CpuStorage::F16(lazily_zeroed(numel)),
            other => {
                return Err(EngineError::Unsupported {
                    setting: format!("computing in {other:?}"),
                    hint: "parameters are computed in a float type",
                });
            }
        }))
    }

    fn write_rows(
        &self,
        param: &Tensor,
        placed: &[(usize, usize)],
        values: &Buffer,
        row_elems: usize,
    ) -> Result<(), EngineError> {
        Ok(param.inplace_op1(&WriteRows {
            placed,
            values,
            row_elems,
        })?)
    }

    fn release(&self, params: &[&Tensor], poison: bool) -> Result<(), EngineError> {
        // Pages the previous unit's release parked and no parameter took go back first.
        crate::memory::flush_parked_pages();
        for param in params {
            param.inplace_op1(&Release { poison })?;
        }
        Ok(())
    }

    fn refill(
        &self,
        param: &Tensor,
        layout: &ShardLayout,
        gathered: &Gathered<'_>,
        block: usize,
        ranks: usize,
    ) -> Result<(), EngineError> {
        Ok(param.inplace_op1(&Refill {
            layout,
            gathered,
            block,
            ranks,
        })?)
    }

    fn copy(&self, t: &Tensor, what: &str) -> Result<Storage, EngineError> {
        let t = t.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        let unsupported = |found: String| EngineError::UnsupportedTensor {
            op: "activation checkpointing",
            what: what.to_string(),
            found,
            expected: "float tensors on the CPU",
        };
        let Storage::Cpu(cpu) = &*storage else {
            return Err(unsupported(format!("{:?}", t.device())));
        };
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| unsupported("a strided tensor".into()))?;
        Ok(Storage::Cpu(match cpu {
            CpuStorage::F32(v) => CpuStorage::F32(v[start..end].to_vec()),
            CpuStorage::F64(v) => CpuStorage::F64(v[start..end].to_vec()),
            CpuStorage::BF16(v) => CpuStorage::BF16(v[start..end].to_vec()),
            CpuStorage::F16(v) => CpuStorage::F16(v[start..end].to_vec()),
            other => return Err(unsupported(format!("{:?}", other.dtype()))),
        }))
    }
}

/// The full parameter `layout` out of a gathered unit, as a CPU storage of its dtype.
pub(super) fn unpack_storage(
    gathered: &Gathered<'_>,
    layout: &ShardLayout,
    block: usize,
    ranks: usize,
) -> Result<CpuStorage, EngineError> {
    let bad = || EngineError::UnsupportedTensor {
        op: "unshard",
        what: format!("the gathered blocks of `{}`", layout.name),
        found: format!("{:?} x {ranks} ranks", gathered.dtype()),
        expected: "float parameters, a block per rank",
    };
    let storage = match gathered.dtype() {
        DType::F32 => unpacked(gathered, layout, block, ranks).map(CpuStorage::F32),
        DType::F64 => unpacked(gathered, layout, block, ranks).map(CpuStorage::F64),
        DType::BF16 => unpacked(gathered, layout, block, ranks).map(CpuStorage::BF16),
        DType::F16 => unpacked(gathered, layout, block, ranks).map(CpuStorage::F16),
        _ => None,
    };
    storage.ok_or_else(bad)
}

/// Parameter `layout`'s values out of every rank's gathered block, in a buffer that takes
/// parked pages (a released parameter's) before it is written, written once (appended, not
/// zero-filled and then overwritten); `None` where the blocks are not of `T`.
fn unpacked<T: fsdp_comm::BufferElement + bytemuck::Pod>(
    gathered: &Gathered<'_>,
    layout: &ShardLayout,
    block: usize,
    ranks: usize,
) -> Option<Vec<T>> {
    let blocks = gathered.blocks_of::<T>(block, ranks)?;
    let n = layout.numel();
    let mut out = Vec::<T>::with_capacity(n);
    crate::memory::prefill_pages(&mut out, 0..n);
    for piece in layout.pieces_in(&blocks) {
        out.extend_from_slice(piece);
    }
    // The pieces are the parameter's rows, `n` elements; a storage shorter than its shape
    // must never reach candle's unchecked kernels, whatever a layout says.
    out.resize(n, T::zeroed());
    Some(out)
}

/// Releases a full parameter's memory in place, keeping the storage's length (candle's
/// kernels index without bounds checks, so a shorter storage would be unsound).
struct Release {
    poison: bool,
}

impl Release {
    fn release<T: bytemuck::Pod>(&self, v: &mut Vec<T>, nan: T) {
        if self.poison {
            v.fill(nan);
            return;
        }
        // The whole pages inside the buffer are parked or returned; they read as zeros until
        // refilled.
        crate::memory::release_pages(v);
    }
}

impl InplaceOp1 for Release {
    fn name(&self) -> &'static str {
        "fsdp-release"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, _l: &Layout) -> candle_core::Result<()> {
        match s {
            CpuStorage::F32(v) => self.release(v, f32::NAN),
            CpuStorage::F64(v) => self.release(v, f64::NAN),
            CpuStorage::BF16(v) => self.release(v, half::bf16::NAN),
            CpuStorage::F16(v) => self.release(v, half::f16::NAN),
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "fsdp-release: parameters are floats, not {:?}",
                    other.dtype()
                )));
            }
        }
        Ok(())
    }
}

/// Writes a parameter's rows from an all-gathered unit back into its released storage.
struct Refill<'a> {
    layout: &'a ShardLayout,
    gathered: &'a Gathered<'a>,
    block: usize,
    ranks: usize,
}

impl Refill<'_> {
    fn refill<T: fsdp_comm::BufferElement + bytemuck::Pod>(
        &self,
        v: &mut Vec<T>,
        start: usize,
    ) -> candle_core::Result<()> {
        let n = self.layout.numel();
        let Some(blocks) = self.gathered.blocks_of::<T>(self.block, self.ranks) else {
            return Err(candle_core::Error::Msg(format!(
                "fsdp-refill: `{}` is {:?} but was gathered as {:?}",
                self.layout.name,
                T::DTYPE,
                self.gathered.dtype()
            )));
        };
        crate::memory::prefill_pages(v, start..start + n);
        self.layout.unpack_blocks(&blocks, &mut v[start..start + n]);
        crate::memory::note_refilled(v.as_ptr().cast());
        Ok(())
    }
}

impl InplaceOp1 for Refill<'_> {
    fn name(&self) -> &'static str {
        "fsdp-refill"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let start = l.start_offset();
        match s {
            CpuStorage::F32(v) => self.refill(v, start),
            CpuStorage::F64(v) => self.refill(v, start),
            CpuStorage::BF16(v) => self.refill(v, start),
            CpuStorage::F16(v) => self.refill(v, start),
            other => Err(candle_core::Error::Msg(format!(
                "fsdp-refill: `{}` is {:?}, not a float",
                self.layout.name,
                other.dtype()
            ))),
        }
    }
}

/// Writes rows exchanged for a table looked up by rows into its storage.
pub(super) struct WriteRows<'a> {
    pub placed: &'a [(usize, usize)],
    pub values: &'a Buffer,
    pub row_elems: usize,
}

impl InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "fsdp-write-rows"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (start, n) = (l.start_offset(), l.shape().elem_count());
        let dtype = s.dtype();
        let row = self.row_elems;
        float_pair!(
            s,
            self.values,
            |v, g| {
                let table = &mut v[start..start + n];
                for &(to, from) in self.placed {
                    let (dst, src) = (to * row..(to + 1) * row, from * row..(from + 1) * row);
                    match (table.get_mut(dst), g.get(src)) {
                        (Some(dst), Some(src)) => dst.copy_from_slice(src),
                        _ => {
                            return Err(candle_core::Error::Msg(format!(
                                "fsdp-write-rows: row {to} from row {from} is outside the table or the rows received"
                            )));
                        }
                    }
                }
                Ok(())
            },
            Err(candle_core::Error::Msg(format!(
                "fsdp-write-rows: the table is {dtype:?} but its rows came as {:?}",
                self.values.dtype()
            )))
        )
    }
}
