//! [`StepParams`]: what a step's forward reads parameters through.

use std::sync::Arc;

use candle_core::Tensor;

use super::StepShared;
use crate::engine::error::EngineError;
use crate::nn::{Params, Recompute};

/// The parameters of one step: full tensors (graph nodes) gathered unit by unit as forward
/// reaches them.
pub struct StepParams {
    pub(crate) shared: Arc<StepShared>,
}

impl Params for StepParams {
    fn get(&self, name: &str) -> candle_core::Result<Tensor> {
        let Some(&(u, i)) = self.shared.index.get(name) else {
            return Err(candle_core::Error::Msg(
                EngineError::UnknownParameter { name: name.into() }.to_string(),
            ));
        };
        let mut inner = self.shared.lock();
        let result = self.shared.read(&mut inner, u, i);
        result.map_err(|e| self.shared.fail(&mut inner, e))
    }

    fn lookup(
        &self,
        name: &str,
        ids: &Tensor,
        padding_idx: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        let Some(&place) = self.shared.index.get(name) else {
            return Err(candle_core::Error::Msg(
                EngineError::UnknownParameter { name: name.into() }.to_string(),
            ));
        };
        let table = {
            let mut inner = self.shared.lock();
            let result = self.shared.look_up(&mut inner, place, ids);
            result.map_err(|e| self.shared.fail(&mut inner, e))?
        };
        crate::nn::ops::embedding(&table, ids, padding_idx)
    }

    fn module_output(&self, path: &str, output: Tensor) -> candle_core::Result<Tensor> {
        let Some(&u) = self.shared.by_path.get(path) else {
            return Ok(output);
        };
        let mut inner = self.shared.lock();
        let result = self.shared.output(u, output);
        result.map_err(|e| self.shared.fail(&mut inner, e))
    }

    fn checkpoints(&self, path: &str) -> bool {
        self.shared
            .by_path
            .get(path)
            .is_some_and(|&u| self.shared.checkpointable[u])
    }

    fn checkpointed(
        &self,
        path: &str,
        x: &Tensor,
        forward: Recompute,
    ) -> candle_core::Result<Tensor> {
        let Some(&u) = self.shared.by_path.get(path) else {
            return Err(candle_core::Error::Msg(format!(
                "activation checkpointing: `{path}` is not a unit"
            )));
        };
        let y = match self.shared.checkpointed(self, u, x, forward) {
            Ok(y) => y,
            Err(e) => {
                let mut inner = self.shared.lock();
                return Err(self.shared.fail(&mut inner, e));
            }
        };
        self.module_output(path, y)
    }
}
