//! The graph ops that put FSDP into candle's autograd: [`Unshard`] makes each gathered
//! parameter a graph node whose backward receives the parameter's complete gradient (the
//! post-backward hook), and [`PreBackward`], an identity on a unit's output, runs before any
//! backward node of the unit (the pre-backward hook). They reach their step through a
//! `Weak` reference, so no reference cycle keeps a step alive.

use std::sync::{Mutex, Weak};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

/// What the graph ops call back into: the step they belong to.
pub(crate) trait StepHooks: Send + Sync {
    /// Unit `unit`'s output is being back-propagated: its parameters must be gathered.
    fn pre_backward(&self, unit: usize) -> candle_core::Result<()>;
    /// The complete gradient of parameter `param` of unit `unit` is `grad`.
    fn post_backward(&self, unit: usize, param: usize, grad: &Tensor) -> candle_core::Result<()>;
}

fn live(step: &Weak<dyn StepHooks>) -> candle_core::Result<std::sync::Arc<dyn StepHooks>> {
    step.upgrade()
        .ok_or_else(|| candle_core::Error::Msg(super::EngineError::StepEnded.to_string()))
}

/// Produces a gathered parameter as the output of an op on the unit's anchor variable, so the
/// parameter is a node of the graph; its backward receives the full gradient after every
/// consumer ran.
pub(crate) struct Unshard {
    /// The parameter's values, moved into the graph at the first (only) forward.
    pub data: Mutex<Option<CpuStorage>>,
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
        let data = self
            .data
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg("fsdp-unshard: parameter already materialised".into())
            })?;
        Ok((data, self.shape.clone()))
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

/// Identity on a unit's output; its backward runs before any backward node of the unit and
/// refills the unit's parameters.
pub(crate) struct PreBackward {
    pub step: Weak<dyn StepHooks>,
    pub unit: usize,
}

impl CustomOp1 for PreBackward {
    fn name(&self) -> &'static str {
        "fsdp-pre-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (start, end) = l.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("fsdp-pre-backward: unit output must be contiguous".into())
        })?;
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(v[start..end].to_vec()),
            CpuStorage::F64(v) => CpuStorage::F64(v[start..end].to_vec()),
            CpuStorage::BF16(v) => CpuStorage::BF16(v[start..end].to_vec()),
            CpuStorage::F16(v) => CpuStorage::F16(v[start..end].to_vec()),
            other => {
                return Err(candle_core::Error::Msg(format!(
                    "fsdp-pre-backward: unit outputs are floats, not {:?}",
                    other.dtype()
                )));
            }
        };
        Ok((out, l.shape().clone()))
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
