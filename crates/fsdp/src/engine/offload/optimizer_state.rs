//! Optimizer state kept in the disk tier (`fsdp_offload_dir`), by parameter name: which
//! state each parameter has there, the streamed optimizer step that updates it, and what
//! checkpoints read and write of it, one buffer at a time. Each buffer is a unit's
//! `Region::State(name)` file laid out like the unit's parameter block (each parameter's
//! rows at its offset there), whatever the gradients' layout.

use std::sync::Arc;

use super::streamed_step::{OffloadedStates, update_units};
use super::{DiskTier, OffloadStats, Region};
use crate::engine::error::EngineError;
use crate::engine::grads::{GradPlace, Gradients};
use crate::engine::unit::FsdpUnit;
use crate::optim::Optimizer;

/// The engine's optimizer state in the disk tier.
pub(crate) struct StateOnDisk {
    tier: Arc<DiskTier>,
    /// Which parameters' state is in the tier (the rest is the optimizer's own).
    states: OffloadedStates,
}

impl StateOnDisk {
    /// State to be kept in `tier`; none is there yet.
    pub fn new(tier: Arc<DiskTier>) -> StateOnDisk {
        StateOnDisk {
            tier,
            states: OffloadedStates::new(),
        }
    }

    /// The tier's folder and what it has moved.
    pub fn stats(&self) -> (&std::path::Path, OffloadStats) {
        (self.tier.path(), self.tier.stats())
    }

    /// The optimizer step over `units` with `grads`, streaming offloaded shards (when the
    /// units keep them on disk) and the state through memory.
    pub fn step(
        &mut self,
        units: &mut [Arc<FsdpUnit>],
        grads: &mut Gradients,
        optimizer: &mut dyn Optimizer,
    ) -> Result<(), EngineError> {
        update_units(&self.tier, units, grads, optimizer, &mut self.states)
    }

    /// A checkpoint's state is about to be loaded: what the tier and `optimizer` held for
    /// `units`' parameters is forgotten.
    pub fn begin_load(&mut self, units: &[Arc<FsdpUnit>], optimizer: &mut dyn Optimizer) {
        self.states.clear();
        for p in units.iter().flat_map(|u| &u.params) {
            optimizer.take_state(&p.layout.name);
        }
    }

    /// Writes this rank's rows (`values`) of parameter `param`'s buffer `key` from a
    /// checkpoint straight into the tier, at the parameter's place in its unit's block.
    pub fn load_buffer(
        &mut self,
        units: &[Arc<FsdpUnit>],
        place: &GradPlace,
        (param, key): (&str, &str),
        values: &[f32],
    ) -> Result<(), EngineError> {
        if values.len() != place.elements.len() {
            return Err(EngineError::State {
                name: param.into(),
                problem: format!(
                    "optimizer state `{key}` has {} values for {} owned elements",
                    values.len(),
                    place.elements.len()
                ),
            });
        }
        let unit = &units[place.unit];
        let region = (place.unit, Region::State(key.to_string()));
        let at = unit.params[place.param].layout.offset;
        self.tier.write_at(&region, at, values, unit.block())?;
        let saved = self.states.entry(param.to_string()).or_default();
        if !saved.buffers.iter().any(|b| b == key) {
            saved.buffers.push(key.to_string());
            saved.buffers.sort();
        }
        Ok(())
    }

    /// Sets parameter `param`'s step count.
    pub fn load_step(&mut self, param: &str, step: u64) {
        self.states.entry(param.to_string()).or_default().step = step;
    }

    /// The step count and buffer names of `name`'s state in the tier (nothing is read).
    pub fn info(&self, name: &str) -> Option<(u64, Vec<String>)> {
        (self.states.get(name)).map(|s| (s.step, s.buffers.clone()))
    }

    /// Whether the tier holds buffer `key` of parameter `name`.
    pub fn has(&self, name: &str, key: &str) -> bool {
        (self.states.get(name)).is_some_and(|s| s.buffers.iter().any(|b| b == key))
    }

    /// This rank's rows of buffer `key` of parameter `name` (at `place`), read back from the
    /// tier; `None` when the tier has no such buffer.
    pub fn buffer(
        &self,
        units: &[Arc<FsdpUnit>],
        place: &GradPlace,
        (name, key): (&str, &str),
    ) -> Result<Option<Vec<f32>>, EngineError> {
        if !self.has(name, key) {
            return Ok(None);
        }
        let at = units[place.unit].params[place.param].layout.offset;
        let region = (place.unit, Region::State(key.to_string()));
        Ok(Some(self.tier.read_at(
            &region,
            at,
            place.elements.len(),
        )?))
    }
}
