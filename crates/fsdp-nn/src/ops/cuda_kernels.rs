//! fsdp-nn's own CUDA kernels on a GPU: their PTX (built from `kernels/*.cu` by build.rs with
//! nvcc), launched as [`super::kernel_plan`] plans them on the device's stream, with the ops'
//! operands bound and their outputs allocated. Their logic is tested on the CPU emulator
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

use super::kernel_plan::{KernelArg, Launch, Module};

/// The PTX modules, one per `kernels/*.cu` file, as `const`s named after the files.
mod ptx {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// The name a module is loaded under on each device, and its PTX.
fn module(m: Module) -> (&'static str, &'static str) {
    match m {
        Module::Norm => ("fsdp_nn_norm", ptx::NORM),
        Module::Activations => ("fsdp_nn_activations", ptx::ACTIVATIONS),
        Module::Rope => ("fsdp_nn_rope", ptx::ROPE),
        Module::Attention => ("fsdp_nn_attention", ptx::ATTENTION),
        Module::CrossEntropy => ("fsdp_nn_cross_entropy", ptx::CROSS_ENTROPY),
        Module::Quant => ("fsdp_nn_quant", ptx::QUANT),
        Module::Embedding => ("fsdp_nn_embedding", ptx::EMBEDDING),
        Module::Softmax => ("fsdp_nn_softmax", ptx::SOFTMAX),
    }
}

fn cuda_error(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

/// Runs `plan` on `dev`'s stream; `pointers` holds each plan buffer's device address.
fn run(dev: &CudaDevice, plan: &[Launch], pointers: &BTreeMap<usize, u64>) -> Result<()> {
    enum Value {
        Pointer(u64),
        Int(i32),
        Long(i64),
        U64(u64),
        Float(f32),
    }
    for launch in plan {
        let (name, ptx) = module(launch.module);
        let func = dev.get_or_load_custom_func(&launch.kernel, name, ptx)?;
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
                KernelArg::Long(v) => Ok(Value::Long(*v)),
                KernelArg::U64(v) => Ok(Value::U64(*v)),
                KernelArg::Float(v) => Ok(Value::Float(*v)),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut args = func.builder();
        for v in &values {
            match v {
                Value::Pointer(p) => args.arg(p),
                Value::Int(i) => args.arg(i),
                Value::Long(l) => args.arg(l),
                Value::U64(u) => args.arg(u),
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

/// An operand of a plan: device storage and the index of its first element.
pub(crate) type Operand<'a> = (&'a CudaStorage, usize);

/// A buffer a plan writes: its index, its element count, and whether it is f32 scratch
/// rather than of the op's tensor type.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Output {
    pub index: usize,
    pub len: usize,
    pub scratch: bool,
}

impl Output {
    /// An output of the op's type.
    pub fn tensor(index: usize, len: usize) -> Output {
        Output {
            index,
            len,
            scratch: false,
        }
    }

    /// f32 scratch.
    pub fn scratch(index: usize, len: usize) -> Output {
        Output {
            index,
            len,
            scratch: true,
        }
    }
}

/// Runs `plan` for tensors of `dtype` on `inputs`' device, with `inputs` bound (of any
/// type: each kernel states its operands' types) and `outputs` allocated, of `dtype` or f32
/// scratch (the plan writes every element of each); returns the outputs by index.
pub(crate) fn execute(
    dtype: DType,
    plan: &[Launch],
    inputs: &[(usize, Operand<'_>)],
    outputs: &[Output],
) -> Result<BTreeMap<usize, CudaStorage>> {
    fn as_type<T: CudaDType + DeviceRepr + 'static>(
        plan: &[Launch],
        inputs: &[(usize, Operand<'_>)],
        outputs: &[Output],
    ) -> Result<BTreeMap<usize, CudaStorage>> {
        enum Slice<T> {
            Tensor(CudaSlice<T>),
            Scratch(CudaSlice<f32>),
        }
        let Some((_, (first, _))) = inputs.first() else {
            candle_core::bail!("a CUDA kernel plan without inputs has no device");
        };
        let dev = first.device().clone();
        let stream = dev.cuda_stream();
        let mut slices = outputs
            .iter()
            .map(|o| {
                // SAFETY: the plan writes every element of each output before a later kernel
                // or the caller reads it (the kernels' contract, tested on the emulator with
                // outputs that start as garbage).
                Ok(if o.scratch {
                    Slice::Scratch(unsafe { dev.alloc::<f32>(o.len)? })
                } else {
                    Slice::Tensor(unsafe { dev.alloc::<T>(o.len)? })
                })
            })
            .collect::<Result<Vec<Slice<T>>>>()?;
        {
            let mut pointers = BTreeMap::new();
            let mut guards: Vec<SyncOnDrop<'_>> = Vec::new();
            for (index, (storage, start)) in inputs {
                if storage.device().id() != dev.id() {
                    candle_core::bail!("a CUDA kernel's operands are on different GPUs");
                }
                let (ptr, guard) = input_pointer(storage, &stream)?;
                let offset = start * storage.dtype().size_in_bytes();
                pointers.insert(*index, ptr + offset as u64);
                guards.push(guard);
            }
            for (o, slice) in outputs.iter().zip(slices.iter_mut()) {
                let (ptr, guard) = match slice {
                    Slice::Tensor(s) => s.device_ptr_mut(&stream),
                    Slice::Scratch(s) => s.device_ptr_mut(&stream),
                };
                pointers.insert(o.index, ptr);
                guards.push(guard);
            }
            run(&dev, plan, &pointers)?;
        }
        Ok(outputs
            .iter()
            .zip(slices)
            .map(|(o, slice)| {
                let storage = match slice {
                    Slice::Tensor(s) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
                    Slice::Scratch(s) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
                };
                (o.index, storage)
            })
            .collect())
    }
    match dtype {
        DType::F32 => as_type::<f32>(plan, inputs, outputs),
        DType::BF16 => as_type::<half::bf16>(plan, inputs, outputs),
        other => candle_core::bail!("no CUDA kernel for {other:?}"),
    }
}

/// The device address of `storage`'s elements, whatever their type.
fn input_pointer<'a>(
    storage: &'a CudaStorage,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    fn of<'a, T: CudaDType + 'static>(
        storage: &'a CudaStorage,
        stream: &'a CudaStream,
    ) -> Result<(u64, SyncOnDrop<'a>)> {
        Ok(storage.as_cuda_slice::<T>()?.device_ptr(stream))
    }
    match storage.dtype() {
        DType::F32 => of::<f32>(storage, stream),
        DType::BF16 => of::<half::bf16>(storage, stream),
        DType::F16 => of::<half::f16>(storage, stream),
        DType::F64 => of::<f64>(storage, stream),
        DType::U32 => of::<u32>(storage, stream),
        DType::I64 => of::<i64>(storage, stream),
        DType::U8 => of::<u8>(storage, stream),
        other => candle_core::bail!("no CUDA kernel takes {other:?} operands"),
    }
}

/// An error unless every operand named in `operands` is of the first one's type: a kernel
/// reads its tensor operands as one element type (other operands, a mask or a table of
/// angles, have their own fixed types).
pub(crate) fn same_types(op: &str, operands: &[(&str, DType)]) -> Result<()> {
    let Some((first, want)) = operands.first() else {
        return Ok(());
    };
    match operands.iter().find(|(_, d)| d != want) {
        Some((name, got)) => {
            candle_core::bail!("{op}: {name} is {got:?} where {first} is {want:?}")
        }
        None => Ok(()),
    }
}

/// `storage`'s elements from `layout`'s start, which must be contiguous on a GPU; `what`
/// names it in errors.
pub(crate) fn operand<'a>(
    storage: &'a Storage,
    layout: &Layout,
    what: &str,
) -> Result<Operand<'a>> {
    match storage {
        Storage::Cuda(s) => device_operand(s, layout, what),
        _ => candle_core::bail!("{what}: not on a CUDA device"),
    }
}

/// A custom op's device operand: `storage`'s elements from `layout`'s start, which must be
/// contiguous; `what` names it in errors.
pub(crate) fn device_operand<'a>(
    storage: &'a CudaStorage,
    layout: &Layout,
    what: &str,
) -> Result<Operand<'a>> {
    if !layout.is_contiguous() {
        candle_core::bail!("{what}: the CUDA kernel needs it contiguous");
    }
    Ok((storage, layout.start_offset()))
}

/// [`execute`] over tensors (made contiguous first) for a backward pass: `inputs` by plan
/// index, each named for errors.
pub(crate) fn execute_on_tensors(
    plan: &[Launch],
    inputs: &[(usize, &Tensor, &str)],
    outputs: &[Output],
) -> Result<BTreeMap<usize, CudaStorage>> {
    let Some((_, first, _)) = inputs.first() else {
        candle_core::bail!("a CUDA kernel plan without inputs has no device");
    };
    let dtype = first.dtype();
    let contiguous = inputs
        .iter()
        .map(|(_, t, _)| t.contiguous())
        .collect::<Result<Vec<_>>>()?;
    let held: Vec<_> = contiguous.iter().map(|t| t.storage_and_layout()).collect();
    let operands = held
        .iter()
        .zip(inputs)
        .map(|((storage, layout), (index, _, what))| Ok((*index, operand(storage, layout, what)?)))
        .collect::<Result<Vec<_>>>()?;
    execute(dtype, plan, &operands, outputs)
}

/// Output `index` of `outputs` as a tensor of `shape` with no graph (a gradient).
pub(crate) fn take_tensor(
    outputs: &mut BTreeMap<usize, CudaStorage>,
    index: usize,
    shape: &Shape,
) -> Result<Tensor> {
    Ok(gradient_tensor(take_storage(outputs, index)?, shape))
}

/// The input gradient of shape `shape` that `f` computes on the GPU from the output gradient
/// `grad` (made contiguous; `what` names it in errors): an element-wise op's backward.
pub(crate) fn gradient_by(
    grad: &Tensor,
    what: &str,
    shape: &Shape,
    f: impl FnOnce(Operand<'_>) -> Result<CudaStorage>,
) -> Result<Tensor> {
    let grad = grad.contiguous()?;
    let (storage, layout) = grad.storage_and_layout();
    let dx = f(operand(&storage, layout, what)?)?;
    Ok(gradient_tensor(dx, shape))
}

/// `storage` as a tensor of `shape` with no graph (a gradient a backward returns).
pub(crate) fn gradient_tensor(storage: CudaStorage, shape: &Shape) -> Tensor {
    Tensor::from_storage(
        Storage::Cuda(storage),
        shape.clone(),
        BackpropOp::none(),
        false,
    )
}

/// Output `index` of `outputs` as the storage a custom op's forward returns.
pub(crate) fn take_storage(
    outputs: &mut BTreeMap<usize, CudaStorage>,
    index: usize,
) -> Result<CudaStorage> {
    outputs
        .remove(&index)
        .ok_or_else(|| candle_core::Error::Msg(format!("kernel output {index} missing")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Operands of mixed types are refused before any kernel reads one as the other, naming
    /// the op and both operands.
    #[test]
    fn operands_of_another_type_are_refused_by_name() {
        let same = [("q", DType::BF16), ("k", DType::BF16), ("v", DType::BF16)];
        assert!(same_types("sdpa", &same).is_ok());
        assert!(same_types("sdpa", &[]).is_ok());
        let mixed = [("q", DType::BF16), ("k", DType::BF16), ("v", DType::F32)];
        let e = same_types("sdpa", &mixed).unwrap_err().to_string();
        assert!(e.contains("sdpa: v is F32 where q is BF16"), "{e}");
    }
}
