//! The engine's optimizer state offloaded to the disk tier, as checkpoints read and write
//! it: by parameter name, one buffer at a time.

use super::fsdp::Fsdp;
use super::offload::{OffloadStats, Region};
use crate::engine::error::EngineError;
use crate::optim::Optimizer;

impl Fsdp {
    /// The disk tier's folder and what it has moved, when state is offloaded to disk.
    pub fn offload(&self) -> Option<(&std::path::Path, OffloadStats)> {
        self.tier.as_ref().map(|t| (t.path(), t.stats()))
    }

    /// A checkpoint's optimizer state is about to be loaded: with state offloaded to disk,
    /// what the tier and `optimizer` held for the sharded parameters is forgotten.
    pub(crate) fn begin_optimizer_load(&mut self, optimizer: &mut dyn Optimizer) {
        if self.tier.is_none() {
            return;
        }
        self.offloaded.clear();
        for p in self.units.iter().flat_map(|u| &u.params) {
            optimizer.take_state(&p.layout.name);
        }
    }

    /// With state offloaded to disk: writes this rank's rows of `param`'s optimizer buffer
    /// `key` from a checkpoint straight into the tier (so loading never holds the state in
    /// memory) and returns true; false when `param`'s state is kept by the optimizer.
    pub(crate) fn load_offloaded_state(
        &mut self,
        param: &str,
        key: &str,
        values: &[f32],
    ) -> Result<bool, EngineError> {
        let (Some(tier), Some(place)) = (&self.tier, self.grad_index.get(param)) else {
            return Ok(false);
        };
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
        // State is laid out as the parameters' shards are (their block), not as gradients.
        let unit = &self.units[place.unit];
        let region = (place.unit, Region::State(key.to_string()));
        let at = unit.params[place.param].layout.offset;
        tier.write_at(&region, at, values, unit.block())?;
        let saved = self.offloaded.entry(param.to_string()).or_default();
        if !saved.buffers.iter().any(|b| b == key) {
            saved.buffers.push(key.to_string());
            saved.buffers.sort();
        }
        Ok(true)
    }

    /// With state offloaded to disk: sets `param`'s step count there and returns true;
    /// false when its state is kept by the optimizer.
    pub(crate) fn load_offloaded_step(&mut self, param: &str, step: u64) -> bool {
        if self.tier.is_none() || !self.grad_index.contains_key(param) {
            return false;
        }
        self.offloaded.entry(param.to_string()).or_default().step = step;
        true
    }

    /// The step count and buffer names of parameter `name`'s optimizer state, wherever it
    /// lives (nothing is read).
    pub(crate) fn optimizer_state_info(
        &self,
        optimizer: &dyn Optimizer,
        name: &str,
    ) -> Option<(u64, Vec<String>)> {
        match optimizer.state(name) {
            Some(s) => Some((s.step, s.buffers.keys().cloned().collect())),
            None => self
                .offloaded
                .get(name)
                .map(|s| (s.step, s.buffers.clone())),
        }
    }

    /// Buffer `key` (`exp_avg`, ...) of parameter `name`'s optimizer state: a copy of
    /// `optimizer`'s own, or this rank's rows read back from the disk tier when the state is
    /// offloaded there (what checkpoints save, one buffer at a time).
    pub(crate) fn optimizer_state_buffer(
        &self,
        optimizer: &dyn Optimizer,
        name: &str,
        key: &str,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        if let Some(state) = optimizer.state(name) {
            return Ok(state.buffers.get(key).cloned());
        }
        let (Some(tier), Some(saved)) = (&self.tier, self.offloaded.get(name)) else {
            return Ok(None);
        };
        if !saved.buffers.iter().any(|b| b == key) {
            return Ok(None);
        }
        let place = self
            .grad_index
            .get(name)
            .ok_or_else(|| EngineError::UnknownParameter { name: name.into() })?;
        let region = (place.unit, Region::State(key.to_string()));
        Ok(Some(tier.read_at(
            &region,
            place.elements.start,
            place.elements.len(),
        )?))
    }
}
