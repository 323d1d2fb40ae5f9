//! The graph ops that put FSDP into candle's autograd: [`Unshard`] makes each gathered
//! parameter a graph node whose backward receives the parameter's complete gradient (the
//! post-backward hook), [`PreBackward`], an identity on a unit's output, runs before any
//! backward node of the unit (the pre-backward hook), and [`Checkpoint`] stands for a whole
//! unit's forward under activation checkpointing, recomputing it in its backward. They reach
//! their step through a `Weak` reference, so no reference cycle keeps a step alive.

use std::sync::{Mutex, Weak};

use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DeviceLocation, Layout, Shape, Storage, Tensor,
};

use crate::nn::Recompute;

/// What the graph ops call back into: the step they belong to.
pub(crate) trait StepHooks: Send + Sync {
    /// Unit `unit`'s output is being back-propagated: its parameters must be gathered.
    fn pre_backward(&self, unit: usize) -> candle_core::Result<()>;
    /// The complete gradient of parameter `param` of unit `unit` is `grad`.
    fn post_backward(&self, unit: usize, param: usize, grad: &Tensor) -> candle_core::Result<()>;
    /// Activation checkpointing: runs a unit's `forward` again on `x` (reading the unit's
    /// refilled parameters), back-propagates `grad` through it (the parameters' gradients
    /// reach [`StepHooks::post_backward`]) and returns the gradient of `x` when `x` needs one.
    fn recompute(
        &self,
        x: &Tensor,
        forward: &Recompute,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>>;
}

/// The step behind a weak reference, or the "step has ended" error once it is gone.
pub(crate) fn live<S: ?Sized>(step: &Weak<S>) -> candle_core::Result<std::sync::Arc<S>> {
    step.upgrade()
        .ok_or_else(|| candle_core::Error::Msg(super::EngineError::StepEnded.to_string()))
}

/// Produces a gathered parameter as the output of an op on the unit's anchor variable, so the
/// parameter is a node of the graph; its backward receives the full gradient after every
/// consumer ran.
pub(crate) struct Unshard {
    /// The parameter's values (as the step's data plane made them), moved into the graph at
    /// the first (only) forward.
    pub data: Mutex<Option<Storage>>,
    pub shape: Shape,
    pub step: Weak<dyn StepHooks>,
    pub unit: usize,
    pub param: usize,
}

impl CustomOp1 for Unshard {
    fn name(&self) -> &'static str {
        "fsdp-unshard"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((take_cpu(&self.data, "fsdp-unshard")?, self.shape.clone()))
    }

    fn cuda_fwd(&self, _s: &CudaStorage, _l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok((take_cuda(&self.data, "fsdp-unshard")?, self.shape.clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        live(&self.step)?.post_backward(self.unit, self.param, grad)?;
        Ok(None)
    }
}

/// The pre-backward hook on a unit's output: the output's view in the graph
/// (`Tensor::hooked_view`, nothing copied), whose backward runs before any backward node of
/// the unit and refills the unit's parameters.
pub(crate) struct PreBackward {
    pub step: Weak<dyn StepHooks>,
    pub unit: usize,
}

impl CustomOp1 for PreBackward {
    fn name(&self) -> &'static str {
        "fsdp-pre-backward"
    }

    /// Never called: the hook is a view of the output, not a computed tensor.
    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(candle_core::Error::Msg(
            "fsdp-pre-backward is a view of a unit's output (Tensor::hooked_view), never computed"
                .into(),
        ))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        live(&self.step)?.pre_backward(self.unit)?;
        Ok(Some(grad.clone()))
    }
}

/// The values an op moves into the graph at its first (only) forward, without a copy.
fn take_once(slot: &Mutex<Option<Storage>>, op: &str) -> candle_core::Result<Storage> {
    slot.lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .ok_or_else(|| {
            candle_core::Error::Msg(format!("{op}: values already moved into the graph"))
        })
}

/// [`take_once`] for a forward on `backend`, whose storage `pick` takes (handing back any
/// other).
fn take_as<S>(
    slot: &Mutex<Option<Storage>>,
    op: &str,
    backend: &str,
    pick: fn(Storage) -> Result<S, DeviceLocation>,
) -> candle_core::Result<S> {
    pick(take_once(slot, op)?).map_err(|other| {
        candle_core::Error::Msg(format!("{op}: values on {other:?} for a {backend} forward"))
    })
}

/// [`take_once`] for a CPU forward.
fn take_cpu(slot: &Mutex<Option<Storage>>, op: &str) -> candle_core::Result<CpuStorage> {
    take_as(slot, op, "CPU", |s| match s {
        Storage::Cpu(s) => Ok(s),
        other => Err(other.device().location()),
    })
}

/// [`take_once`] for a CUDA forward.
fn take_cuda(slot: &Mutex<Option<Storage>>, op: &str) -> candle_core::Result<CudaStorage> {
    take_as(slot, op, "CUDA", |s| match s {
        Storage::Cuda(s) => Ok(s),
        other => Err(other.device().location()),
    })
}

/// A unit's forward under activation checkpointing as one graph node on (the unit's input,
/// the unit's anchor variable): its output is the forward's result, computed while no graph
/// was kept; its backward recomputes the forward with a graph and back-propagates through it.
pub(crate) struct Checkpoint {
    /// The forward's output, moved into the graph at the first (only) forward.
    pub data: Mutex<Option<Storage>>,
    pub shape: Shape,
    pub step: Weak<dyn StepHooks>,
    pub forward: Recompute,
}

impl CustomOp2 for Checkpoint {
    fn name(&self) -> &'static str {
        "fsdp-checkpoint"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _xl: &Layout,
        _anchor: &CpuStorage,
        _al: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((take_cpu(&self.data, "fsdp-checkpoint")?, self.shape.clone()))
    }

    fn cuda_fwd(
        &self,
        _x: &CudaStorage,
        _xl: &Layout,
        _anchor: &CudaStorage,
        _al: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok((
            take_cuda(&self.data, "fsdp-checkpoint")?,
            self.shape.clone(),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let gx = live(&self.step)?.recompute(x, &self.forward, grad)?;
        Ok((gx, None))
    }
}
