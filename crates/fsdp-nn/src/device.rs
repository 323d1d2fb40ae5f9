//! The devices a process can compute on: the CPU always, CUDA GPUs where this build has the
//! `cuda` feature and the machine a driver and cuBLAS. Asking never panics: cudarc loads the
//! CUDA libraries when first used and panics where one is missing, so every question here
//! looks for them first and reports what is absent by name.

use candle_core::Device;

/// Why a CUDA device cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The crates were built without the `cuda` feature.
    #[error(
        "CUDA device {ordinal}: this build has no CUDA support (build with the `cuda` feature; \
         in fsdp-rs, tools/install-cuda-toolchain.sh installs the nvcc it needs from PyPI)"
    )]
    NotBuilt {
        /// The device asked for.
        ordinal: usize,
    },
    /// The driver, a CUDA library or the device itself is missing or failed.
    #[error("CUDA device {ordinal}: {reason}")]
    Unavailable {
        /// The device asked for.
        ordinal: usize,
        /// What is missing or what CUDA said.
        reason: String,
    },
}

/// The CUDA libraries candle's CUDA backend loads when a device opens, by the names cudarc
/// looks for them under (CUDA 13: libcublas.so.13, libcurand.so.10, ...).
#[cfg(feature = "cuda")]
fn missing_libraries() -> Vec<&'static str> {
    use candle_core::cuda_backend::cudarc;
    // SAFETY: each call only tries to open the library by name (dlopen) and drops it.
    let present = unsafe {
        [
            (
                "the CUDA driver (libcuda.so.1)",
                cudarc::driver::sys::is_culib_present(),
            ),
            (
                "cuBLAS (libcublas.so.13)",
                cudarc::cublas::sys::is_culib_present(),
            ),
            (
                "cuBLASLt (libcublasLt.so.13)",
                cudarc::cublaslt::sys::is_culib_present(),
            ),
            (
                "cuRAND (libcurand.so.10)",
                cudarc::curand::sys::is_culib_present(),
            ),
        ]
    };
    present
        .into_iter()
        .filter(|(_, found)| !found)
        .map(|(name, _)| name)
        .collect()
}

/// How many CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`), or why none can
/// be used.
pub fn cuda_device_count() -> Result<usize, DeviceError> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc;
        let unavailable = |reason: String| DeviceError::Unavailable { ordinal: 0, reason };
        let missing = missing_libraries();
        if !missing.is_empty() {
            return Err(unavailable(format!(
                "not found on the library path: {} (LD_LIBRARY_PATH; pip's nvidia-* wheels \
                 keep them in site-packages/nvidia/cu13/lib)",
                missing.join(", ")
            )));
        }
        let counted = std::panic::catch_unwind(|| {
            cudarc::driver::result::init()?;
            cudarc::driver::result::device::get_count()
        });
        match counted {
            Ok(Ok(n)) => Ok(usize::try_from(n).unwrap_or(0)),
            Ok(Err(e)) => Err(unavailable(format!("the driver did not start: {e}"))),
            Err(_) => Err(unavailable("loading the CUDA driver failed".into())),
        }
    }
    #[cfg(not(feature = "cuda"))]
    Err(DeviceError::NotBuilt { ordinal: 0 })
}

/// Opens CUDA device `ordinal` (counted among the visible devices) for candle's tensors:
/// cuBLAS products with f32 accumulation, TF32 off, so f32 products match the CPU's.
pub fn cuda(ordinal: usize) -> Result<Device, DeviceError> {
    #[cfg(feature = "cuda")]
    {
        let count = cuda_device_count().map_err(|e| match e {
            DeviceError::Unavailable { reason, .. } => DeviceError::Unavailable { ordinal, reason },
            other => other,
        })?;
        if ordinal >= count {
            return Err(DeviceError::Unavailable {
                ordinal,
                reason: format!(
                    "this process sees {count} CUDA device(s){}",
                    std::env::var("CUDA_VISIBLE_DEVICES")
                        .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})"))
                        .unwrap_or_default()
                ),
            });
        }
        candle_core::cuda_backend::set_gemm_reduced_precision_f32(false);
        let opened = std::panic::catch_unwind(|| Device::new_cuda(ordinal));
        match opened {
            Ok(Ok(device)) => {
                keep_freed_memory(&device).map_err(|reason| DeviceError::Unavailable {
                    ordinal,
                    reason: format!("keeping freed memory in its allocator's pool: {reason}"),
                })?;
                Ok(device)
            }
            Ok(Err(e)) => Err(DeviceError::Unavailable {
                ordinal,
                reason: e.to_string(),
            }),
            Err(_) => Err(DeviceError::Unavailable {
                ordinal,
                reason: "opening the device panicked in cudarc (a CUDA library failed to load)"
                    .into(),
            }),
        }
    }
    #[cfg(not(feature = "cuda"))]
    Err(DeviceError::NotBuilt { ordinal })
}

/// The memory pool candle's allocations on `device` come from (cudarc allocates
/// stream-ordered, `cuMemAllocAsync`, where the device has pools), or `None` without one.
#[cfg(feature = "cuda")]
fn memory_pool(
    device: &Device,
) -> Result<Option<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool>, String> {
    use candle_core::cuda_backend::cudarc::driver::result;
    let stream = device
        .as_cuda_device()
        .map_err(|e| e.to_string())?
        .cuda_stream();
    let context = stream.context();
    if !context.has_async_alloc() {
        return Ok(None);
    }
    context.bind_to_thread().map_err(|e| e.to_string())?;
    // SAFETY: the device is the open context's own.
    let pool = unsafe { result::device::get_mem_pool(context.cu_device()) };
    pool.map(Some).map_err(|e| e.to_string())
}

/// Makes `device`'s allocator keep freed memory for reuse instead of handing it back to the
/// driver at every synchronisation (the pool's default release threshold is 0), so a step
/// that frees and allocates the same buffers unit after unit does not map device memory
/// anew each time (a caching allocator's behaviour; the footprint stays at the step's peak).
#[cfg(feature = "cuda")]
fn keep_freed_memory(device: &Device) -> Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let Some(pool) = memory_pool(device)? else {
        return Ok(());
    };
    let mut keep = u64::MAX;
    let attribute = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: a valid pool; the release threshold is a u64 (cuMemPoolSetAttribute).
    unsafe { result::mem_pool::set_attribute(pool, attribute, (&raw mut keep).cast()) }
        .map_err(|e| e.to_string())
}

/// How many freed bytes `device`'s allocator keeps past a synchronisation (its pool's
/// release threshold; [`cuda`] sets it to keep all), or `None` where it allocates without a
/// pool.
pub fn cuda_pool_release_threshold(device: &Device) -> Result<Option<u64>, DeviceError> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let failed = |reason: String| DeviceError::Unavailable {
            ordinal: ordinal_of(device),
            reason,
        };
        let Some(pool) = memory_pool(device).map_err(failed)? else {
            return Ok(None);
        };
        let mut threshold = 0u64;
        let attribute = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        // SAFETY: a valid pool; the release threshold is a u64 (cuMemPoolGetAttribute).
        unsafe { result::mem_pool::get_attribute(pool, attribute, (&raw mut threshold).cast()) }
            .map_err(|e| failed(e.to_string()))?;
        Ok(Some(threshold))
    }
    #[cfg(not(feature = "cuda"))]
    Err(DeviceError::NotBuilt {
        ordinal: ordinal_of(device),
    })
}

/// `device`'s GPU number (0 for the CPU).
fn ordinal_of(device: &Device) -> usize {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id }
        | candle_core::DeviceLocation::Metal { gpu_id } => gpu_id,
        candle_core::DeviceLocation::Cpu => 0,
    }
}

/// The GPU this crate's tests compare on, or `None` once the skip is recorded.
#[cfg(test)]
pub(crate) fn gpu_for_tests() -> Option<Device> {
    match cuda(0) {
        Ok(device) => Some(device),
        Err(e) => {
            skipped_gpu!("{e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_for_a_gpu_answers_without_panicking() {
        match cuda_device_count() {
            Ok(0) | Err(_) => {
                let e = cuda(0).expect_err("no usable GPU, yet a device opened");
                let text = e.to_string();
                assert!(text.starts_with("CUDA device 0: "), "{text}");
            }
            Ok(n) => {
                let e = cuda(n).expect_err("a device past the last one opened");
                assert!(
                    e.to_string().contains(&format!("sees {n} CUDA device")),
                    "{e}"
                );
                let gpu = cuda(0).expect("the first GPU opens");
                assert!(gpu.is_cuda());
                // Freed memory stays in the allocator's pool past synchronisations.
                let kept = cuda_pool_release_threshold(&gpu).unwrap();
                assert!(matches!(kept, None | Some(u64::MAX)), "{kept:?}");
            }
        }
    }
}
