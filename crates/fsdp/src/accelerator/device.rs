//! Which device a process computes on (Accelerate's `accelerator.device`): the CPU with
//! `use_cpu: true`; otherwise the GPU of its local rank among those it sees, where this
//! build (feature `cuda`) and this machine can open one, else the CPU, as Accelerate falls
//! back, said in the log. And the prepared model's weights read for that device.

use candle_core::Device;
use fsdp_nn::device::{DeviceError, cuda, cuda_device_count};

use crate::nn::{ParamSpec, WeightSource};

use super::error::AcceleratorError;

/// The compute device of the process with `local_rank` (see the module doc). More local
/// processes than visible GPUs is an error naming both counts.
pub(super) fn compute_device(use_cpu: bool, local_rank: usize) -> Result<Device, AcceleratorError> {
    if use_cpu {
        return Ok(Device::Cpu);
    }
    let on_cpu = |why: &DeviceError| {
        // Said where a GPU was to be expected: an NVIDIA driver is loaded and this build
        // could use it. A machine without one (a config without `use_cpu: true` on a CPU
        // machine) trains on the CPU as it always did.
        let driver = std::path::Path::new("/proc/driver/nvidia/version").exists();
        let built = !matches!(why, DeviceError::NotBuilt { .. });
        if local_rank == 0 && driver && built {
            tracing::info!("use_cpu: false, but no GPU can be used ({why}): training on the CPU");
        } else {
            tracing::debug!("training on the CPU: {why}");
        }
        Ok(Device::Cpu)
    };
    match cuda_device_count() {
        Err(e) => on_cpu(&e),
        Ok(0) => on_cpu(&DeviceError::Unavailable {
            ordinal: local_rank,
            reason: "the driver reports no device".into(),
        }),
        Ok(n) if local_rank >= n => Err(AcceleratorError::Device(DeviceError::Unavailable {
            ordinal: local_rank,
            reason: format!(
                "use_cpu: false gives each of a machine's processes a GPU of its own, and local process {local_rank} sees {n} GPU(s){}: start at most {n} processes per machine (num_processes), name more GPUs (gpu_ids), or set use_cpu: true",
                std::env::var("CUDA_VISIBLE_DEVICES")
                    .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})"))
                    .unwrap_or_default()
            ),
        })),
        Ok(_) => Ok(cuda(local_rank)?),
    }
}

/// A weight source read as it is, whose weights the engine places on `device` (the
/// engine computes where its weight source says).
pub(super) struct PlacedWeights<'a> {
    pub source: &'a dyn WeightSource,
    pub device: Device,
}

impl WeightSource for PlacedWeights<'_> {
    fn values(&self, spec: &ParamSpec) -> candle_core::Result<Vec<f32>> {
        self.source.values(spec)
    }

    fn read_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> candle_core::Result<()>,
    ) -> candle_core::Result<()> {
        self.source.read_rows(spec, take)
    }

    fn packed_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> candle_core::Result<()>,
    ) -> candle_core::Result<()> {
        self.source.packed_rows(spec, take)
    }

    fn device(&self) -> Device {
        self.device.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_cpu_is_the_cpu_and_no_gpu_falls_back_to_it() {
        assert!(compute_device(true, 3).unwrap().is_cpu());
        match cuda_device_count() {
            // No GPU here: every local rank computes on the CPU.
            Err(_) | Ok(0) => {
                for rank in [0, 5] {
                    assert!(compute_device(false, rank).unwrap().is_cpu());
                }
            }
            Ok(n) => {
                assert!(compute_device(false, 0).unwrap().is_cuda());
                let e = compute_device(false, n).unwrap_err().to_string();
                assert!(e.contains(&format!("sees {n} GPU(s)")), "{e}");
            }
        }
    }
}
