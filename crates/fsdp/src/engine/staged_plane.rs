//! The data plane of a GPU whose collectives run in host memory ([`HostStagedPlane`]): the
//! shm/TCP/MPI collectives gather into host blocks, which are unpacked on the host and copied
//! to the device; gradients come back to the host to be packed for the reduction. Between
//! steps shards and optimizer state stay in host memory, as with PyTorch's `CPUOffload`.
//! What a GPU without NCCL uses, and what lets several processes share one GPU (NCCL refuses
//! two ranks on one device). Each unit's parameters cross the host link once per gather and
//! each gradient once per reduction; a NCCL plane keeps both on the device.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Storage, Tensor};
use fsdp_comm::{Buffer, DType};

use super::cpu_plane::{CpuPlane, WriteRows, unpack_storage};
use super::data_plane::DataPlane;
use super::error::EngineError;
use super::plan::ShardLayout;
use super::shared_gather::Gathered;

/// The data plane of a GPU fed through host memory (see the module doc).
pub(crate) struct HostStagedPlane {
    /// The GPU the step computes on.
    device: Device,
}

impl HostStagedPlane {
    /// The plane of `device`.
    pub fn new(device: Device) -> HostStagedPlane {
        HostStagedPlane { device }
    }

    /// `cpu`'s values as storage on the device.
    fn upload(&self, cpu: CpuStorage) -> Result<Storage, EngineError> {
        match &self.device {
            Device::Cuda(gpu) => Ok(Storage::Cuda(gpu.storage_from_cpu_storage_owned(cpu)?)),
            other => Err(EngineError::Unsupported {
                setting: format!("staging parameters through host memory to {other:?}"),
                hint: "the host-staged plane serves CUDA devices",
            }),
        }
    }
}

impl DataPlane for HostStagedPlane {
    fn unpack(
        &self,
        gathered: &Gathered<'_>,
        layout: &ShardLayout,
        block: usize,
        ranks: usize,
    ) -> Result<Storage, EngineError> {
        self.upload(unpack_storage(gathered, layout, block, ranks)?)
    }

    fn whole(&self, values: &[f32], dtype: DType) -> Result<Storage, EngineError> {
        match CpuPlane.whole(values, dtype)? {
            Storage::Cpu(cpu) => self.upload(cpu),
            other => Ok(other),
        }
    }

    fn zeros(&self, numel: usize, dtype: DType) -> Result<Storage, EngineError> {
        match CpuPlane.zeros(numel, dtype)? {
            Storage::Cpu(cpu) => self.upload(cpu),
            other => Ok(other),
        }
    }

    fn write_rows(
        &self,
        param: &Tensor,
        placed: &[(usize, usize)],
        values: &Buffer,
        row_elems: usize,
    ) -> Result<(), EngineError> {
        Ok(param.inplace_op1(&WriteRowsOnDevice(WriteRows {
            placed,
            values,
            row_elems,
        }))?)
    }

    fn release(&self, params: &[&Tensor], poison: bool) -> Result<(), EngineError> {
        for param in params {
            param.inplace_op1(&ReleaseOnDevice { poison })?;
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
        let values = unpack_storage(gathered, layout, block, ranks)?;
        Ok(param.inplace_op1(&RefillOnDevice {
            name: &layout.name,
            values,
        })?)
    }

    fn copy(&self, t: &Tensor, what: &str) -> Result<Storage, EngineError> {
        let copied = t.contiguous()?.copy()?;
        let (storage, layout) = copied.storage_and_layout();
        match &*storage {
            Storage::Cuda(gpu) => Ok(Storage::Cuda(gpu.try_clone(layout)?)),
            other => Err(EngineError::UnsupportedTensor {
                op: "activation checkpointing",
                what: what.to_string(),
                found: format!("{:?}", other.device().location()),
                expected: "a tensor on the CUDA device the step computes on",
            }),
        }
    }
}

/// Frees a full parameter's device memory while the graph still references it: its storage
/// becomes one element (a read before the refill is a device fault, never stale values);
/// with `poison` it keeps its length and reads as NaN.
struct ReleaseOnDevice {
    poison: bool,
}

impl InplaceOp1 for ReleaseOnDevice {
    fn name(&self) -> &'static str {
        "fsdp-release-on-device"
    }

    fn cpu_fwd(&self, _s: &mut CpuStorage, _l: &Layout) -> candle_core::Result<()> {
        candle_core::bail!(
            "fsdp-release-on-device: the parameter is in host memory, not on the GPU"
        )
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let gpu = s.device().clone();
        *s = if self.poison {
            let n = l.shape().elem_count();
            let nan = match s.dtype() {
                candle_core::DType::F32 => CpuStorage::F32(vec![f32::NAN; n]),
                candle_core::DType::F64 => CpuStorage::F64(vec![f64::NAN; n]),
                candle_core::DType::BF16 => CpuStorage::BF16(vec![half::bf16::NAN; n]),
                candle_core::DType::F16 => CpuStorage::F16(vec![half::f16::NAN; n]),
                other => candle_core::bail!(
                    "fsdp-release-on-device: parameters are floats, not {other:?}"
                ),
            };
            gpu.storage_from_cpu_storage_owned(nan)?
        } else {
            gpu.zeros_impl(&candle_core::Shape::from(1), s.dtype())?
        };
        Ok(())
    }
}

/// Writes a released parameter's values (unpacked on the host from a gathered block) back
/// into new device memory under the same tensor.
struct RefillOnDevice<'a> {
    name: &'a str,
    values: CpuStorage,
}

impl InplaceOp1 for RefillOnDevice<'_> {
    fn name(&self) -> &'static str {
        "fsdp-refill-on-device"
    }

    fn cpu_fwd(&self, _s: &mut CpuStorage, _l: &Layout) -> candle_core::Result<()> {
        candle_core::bail!(
            "fsdp-refill-on-device: `{}` is in host memory, not on the GPU",
            self.name
        )
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let whole = l.start_offset() == 0 && l.is_contiguous();
        if !whole || self.values.dtype() != s.dtype() {
            candle_core::bail!(
                "fsdp-refill-on-device: `{}` is {:?} {:?} (offset {}), refilled with {:?}",
                self.name,
                s.dtype(),
                l.dims(),
                l.start_offset(),
                self.values.dtype()
            );
        }
        *s = s.device().storage_from_cpu_storage(&self.values)?;
        Ok(())
    }
}

/// Writes a table's exchanged rows into its device memory, through a host copy of the table
/// (the rows are written on the host, the table copied back).
struct WriteRowsOnDevice<'a>(WriteRows<'a>);

impl InplaceOp1 for WriteRowsOnDevice<'_> {
    fn name(&self) -> &'static str {
        "fsdp-write-rows-on-device"
    }

    fn cpu_fwd(&self, _s: &mut CpuStorage, _l: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("fsdp-write-rows-on-device: the table is in host memory, not on the GPU")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let mut host = s.to_cpu_storage()?;
        self.0.cpu_fwd(&mut host, l)?;
        *s = s.device().storage_from_cpu_storage(&host)?;
        Ok(())
    }
}
