//! fsdp-nn's own CUDA kernels on a GPU: their PTX (built from `kernels/*.cu` by build.rs with
//! nvcc), launched as [`super::kernel_plan`] plans them on the device's stream, and the norms'
//! forward and backward through them. Their logic is tested on the CPU emulator
//! (`kernel_plan/tests.rs`); on a GPU by `every_op_on_a_gpu_matches_the_cpu`.

use std::collections::BTreeMap;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
    SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Layout, Result, Shape, Storage, Tensor};

use super::kernel_plan::{KernelArg, Launch, NormShape, backward, forward};

/// The PTX modules, one per `kernels/*.cu` file, as `const`s named after the files.
mod ptx {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// The name a module is loaded under on each device.
const NORM_MODULE: &str = "fsdp_nn_norm";

fn cuda_error(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

/// Runs `plan` on `dev`'s stream; `pointers` holds each plan buffer's device address.
fn run(dev: &CudaDevice, plan: &[Launch], pointers: &BTreeMap<usize, u64>) -> Result<()> {
    enum Value {
        Pointer(u64),
        Int(i32),
        Float(f32),
    }
    for launch in plan {
        let func = dev.get_or_load_custom_func(&launch.kernel, NORM_MODULE, ptx::NORM)?;
        let values = launch
            .args
            .iter()
            .map(|a| match a {
                KernelArg::Buffer(i) => {
                    pointers.get(i).map(|p| Value::Pointer(*p)).ok_or_else(|| {
                        candle_core::Error::Msg(format!("{}: buffer {i} not bound", launch.kernel))
                    })
                }
                KernelArg::Null => Ok(Value::Pointer(0)),
                KernelArg::Int(v) => Ok(Value::Int(*v)),
                KernelArg::Float(v) => Ok(Value::Float(*v)),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut args = func.builder();
        for v in &values {
            match v {
                Value::Pointer(p) => args.arg(p),
                Value::Int(i) => args.arg(i),
                Value::Float(f) => args.arg(f),
            };
        }
        let [gx, gy, gz] = launch.grid;
        let [bx, by, bz] = launch.block;
        let config = LaunchConfig {
            grid_dim: (gx, gy, gz),
            block_dim: (bx, by, bz),
            shared_mem_bytes: 0,
        };
        // SAFETY: the plan gives each kernel its parameters in its declared order and types
        // (`kernel_plan` and `kernels/*.cu` agree; the emulator test runs the same plans), and
        // every bound buffer holds the elements the plan's shape asks for.
        unsafe { args.launch(config) }.map_err(cuda_error)?;
    }
    Ok(())
}

/// A plan's buffers bound to device memory, kept readable and writable until the launches
/// are queued.
struct Bound<'a> {
    pointers: BTreeMap<usize, u64>,
    guards: Vec<SyncOnDrop<'a>>,
    stream: &'a CudaStream,
}

impl<'a> Bound<'a> {
    fn new(stream: &'a CudaStream) -> Bound<'a> {
        Bound {
            pointers: BTreeMap::new(),
            guards: Vec::new(),
            stream,
        }
    }

    /// Binds plan buffer `index` to `storage`'s elements from `start` on.
    fn input<T: CudaDType + DeviceRepr + 'static>(
        &mut self,
        index: usize,
        storage: &'a CudaStorage,
        start: usize,
    ) -> Result<()> {
        let (ptr, guard) = storage.as_cuda_slice::<T>()?.device_ptr(self.stream);
        self.pointers
            .insert(index, ptr + (start * std::mem::size_of::<T>()) as u64);
        self.guards.push(guard);
        Ok(())
    }

    /// Binds plan buffer `index` to `slice`, which the kernels write.
    fn output<T: 'static>(&mut self, index: usize, slice: &'a mut CudaSlice<T>) {
        let (ptr, guard) = slice.device_ptr_mut(self.stream);
        self.pointers.insert(index, ptr);
        self.guards.push(guard);
    }
}

/// `t`'s device storage and layout; `what` names it in errors.
fn on_device<'a>(
    storage: &'a Storage,
    layout: &Layout,
    what: &str,
) -> Result<(&'a CudaStorage, usize)> {
    match storage {
        Storage::Cuda(s) if layout.is_contiguous() => Ok((s, layout.start_offset())),
        Storage::Cuda(_) => candle_core::bail!("{what}: the CUDA kernel needs it contiguous"),
        _ => candle_core::bail!("{what}: not on a CUDA device"),
    }
}

/// An operand of a norm: storage and the offset of its first element.
pub(crate) type Operand<'a> = (&'a CudaStorage, usize);

/// The norm `shape` of `x` (plus `residual`), scaled by `gamma` and shifted by `beta`, on
/// `x`'s GPU.
pub(crate) fn norm_forward(
    shape: NormShape,
    x: Operand<'_>,
    residual: Option<Operand<'_>>,
    gamma: Operand<'_>,
    beta: Option<Operand<'_>>,
) -> Result<CudaStorage> {
    fn as_type<T: CudaDType + DeviceRepr + 'static>(
        shape: NormShape,
        x: Operand<'_>,
        residual: Option<Operand<'_>>,
        gamma: Operand<'_>,
        beta: Option<Operand<'_>>,
    ) -> Result<CudaStorage> {
        let dev = x.0.device().clone();
        let stream = dev.cuda_stream();
        // SAFETY: the forward kernel writes every element of `y` (one block per row, each
        // thread its columns) before anything reads it.
        let mut y = unsafe { dev.alloc::<T>(shape.rows * shape.d)? };
        {
            let mut bound = Bound::new(&stream);
            bound.input::<T>(forward::X, x.0, x.1)?;
            if let Some(r) = residual {
                bound.input::<T>(forward::RESIDUAL, r.0, r.1)?;
            }
            bound.input::<T>(forward::GAMMA, gamma.0, gamma.1)?;
            if let Some(b) = beta {
                bound.input::<T>(forward::BETA, b.0, b.1)?;
            }
            bound.output(forward::Y, &mut y);
            run(&dev, &shape.forward()?, &bound.pointers)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(y, dev))
    }
    match shape.dtype {
        DType::F32 => as_type::<f32>(shape, x, residual, gamma, beta),
        DType::BF16 => as_type::<half::bf16>(shape, x, residual, gamma, beta),
        other => candle_core::bail!("fused norms: no CUDA kernel for {other:?}"),
    }
}

/// The gradients of a norm on the GPU: the input's (also the residual's), the scale's, and
/// the shift's where `shape.beta`. `gamma` is the scale's `[d]` elements (a view is fine).
pub(crate) fn norm_backward(
    shape: NormShape,
    x: &Tensor,
    residual: Option<&Tensor>,
    gamma: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    fn as_type<T: CudaDType + DeviceRepr + 'static>(
        shape: NormShape,
        x: &Tensor,
        residual: Option<&Tensor>,
        gamma: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let x = x.contiguous()?;
        let (xs, xl) = x.storage_and_layout();
        let x_op = on_device(&xs, xl, "norm input")?;
        let dev = x_op.0.device().clone();
        let stream = dev.cuda_stream();
        let grad = grad.contiguous()?;
        let (gs, gl) = grad.storage_and_layout();
        let grad_op = on_device(&gs, gl, "norm output gradient")?;
        let gamma = gamma.contiguous()?;
        let (ps, pl) = gamma.storage_and_layout();
        let gamma_op = on_device(&ps, pl, "norm scale")?;
        let residual = residual.map(|r| r.contiguous()).transpose()?;
        let residual_storage = residual.as_ref().map(|r| r.storage_and_layout());
        let residual_op = match &residual_storage {
            Some((rs, rl)) => Some(on_device(rs, rl, "norm residual")?),
            None => None,
        };
        let (rows, d) = (shape.rows, shape.d);
        // SAFETY (all four): the row kernel writes every element of `dx` and both stats of
        // every row, the partials kernel every partial, the totals kernel every element of
        // `dgamma` (and of `dbeta` where bound), each before a later kernel or the caller
        // reads it.
        let mut dx = unsafe { dev.alloc::<T>(rows * d)? };
        let mut stats = unsafe { dev.alloc::<f32>(2 * rows)? };
        let mut partials = unsafe { dev.alloc::<f32>(2 * shape.chunks() * d)? };
        let mut dgamma = unsafe { dev.alloc::<T>(d)? };
        let mut dbeta = if shape.beta {
            Some(unsafe { dev.alloc::<T>(d)? })
        } else {
            None
        };
        {
            let mut bound = Bound::new(&stream);
            bound.input::<T>(backward::X, x_op.0, x_op.1)?;
            if let Some(r) = residual_op {
                bound.input::<T>(backward::RESIDUAL, r.0, r.1)?;
            }
            bound.input::<T>(backward::GAMMA, gamma_op.0, gamma_op.1)?;
            bound.input::<T>(backward::GRAD, grad_op.0, grad_op.1)?;
            bound.output(backward::DX, &mut dx);
            bound.output(backward::ROW_STATS, &mut stats);
            bound.output(backward::PARTIALS, &mut partials);
            bound.output(backward::DGAMMA, &mut dgamma);
            if let Some(dbeta) = dbeta.as_mut() {
                bound.output(backward::DBETA, dbeta);
            }
            run(&dev, &shape.backward()?, &bound.pointers)?;
        }
        let tensor = |slice: CudaSlice<T>, shape: Shape| {
            let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
            Tensor::from_storage(storage, shape, BackpropOp::none(), false)
        };
        Ok((
            tensor(dx, x.shape().clone()),
            tensor(dgamma, gamma.shape().clone()),
            dbeta.map(|b| tensor(b, gamma.shape().clone())),
        ))
    }
    match shape.dtype {
        DType::F32 => as_type::<f32>(shape, x, residual, gamma, grad),
        DType::BF16 => as_type::<half::bf16>(shape, x, residual, gamma, grad),
        other => candle_core::bail!("fused norms: no CUDA kernel for {other:?}"),
    }
}
