//! [`Placement`]: where a model's state is stored between steps (parameter shards, reduced
//! gradients, optimizer state) and where its forward and backward compute. They differ with
//! `fsdp_offload_params` on an accelerator: shards in host memory, moved to the device for
//! the all-gather and gradients moved back after the reduction. On the CPU they are one
//! memory, so offloading moves nothing; the engine says so once instead of refusing or
//! ignoring the setting silently.

use std::sync::{Arc, Once};

use candle_core::Device;

use crate::engine::cpu_plane::CpuPlane;
use crate::engine::data_plane::DataPlane;
use crate::engine::error::EngineError;
use crate::engine::staged_plane::HostStagedPlane;

/// What `fsdp_offload_params: true` does when training computes on the CPU.
pub const OFFLOAD_ON_CPU: &str = "training computes on the CPU, whose memory is the host memory: parameter shards, gradients and optimizer state already live there, so offloading moves nothing";

/// Storage and compute devices of a sharded model.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Where shards, reduced gradients and optimizer state live between steps.
    pub storage: Device,
    /// Where gathered parameters, activations and gradients live during a step.
    pub compute: Device,
    /// `fsdp_offload_params` was asked for.
    pub offload: bool,
}

impl Placement {
    /// State on `compute`, or in host memory with `offload`.
    pub fn new(compute: Device, offload: bool) -> Placement {
        let storage = if offload {
            Device::Cpu
        } else {
            compute.clone()
        };
        Placement {
            storage,
            compute,
            offload,
        }
    }

    /// The data plane of the compute device.
    pub(crate) fn data_plane(&self) -> Result<Arc<dyn DataPlane>, EngineError> {
        match &self.compute {
            Device::Cpu => Ok(Arc::new(CpuPlane)),
            gpu @ Device::Cuda(_) => Ok(Arc::new(HostStagedPlane::new(gpu.clone()))),
            other => Err(EngineError::Unsupported {
                setting: format!("computing on {other:?}"),
                hint: "the engine computes on the CPU and on CUDA GPUs",
            }),
        }
    }

    /// Offloading was asked for but storage and compute are the same memory.
    pub fn offload_moves_nothing(&self) -> bool {
        self.offload && self.storage.same_device(&self.compute)
    }

    /// Logs [`OFFLOAD_ON_CPU`] once per process when offloading moves nothing (not when
    /// the state goes `to_disk`, `fsdp_offload_dir`: that moves everything).
    pub(crate) fn warn_once(&self, to_disk: bool) {
        static WARNED: Once = Once::new();
        if self.offload_moves_nothing() && !to_disk {
            WARNED.call_once(|| tracing::warn!("fsdp_offload_params: true: {OFFLOAD_ON_CPU}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offload_on_the_cpu_stores_and_computes_in_one_memory() {
        let p = Placement::new(Device::Cpu, true);
        assert!(p.storage.same_device(&Device::Cpu));
        assert!(p.offload_moves_nothing());
        assert!(!Placement::new(Device::Cpu, false).offload_moves_nothing());
    }
}
