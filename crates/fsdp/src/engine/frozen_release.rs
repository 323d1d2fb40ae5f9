//! When backward is done with a unit's frozen parameters. A unit whose parameters all train
//! reshards when its last gradient arrives; one with frozen parameters (LoRA's base weights)
//! cannot tell from its gradients, since a backward node may read a frozen weight after the
//! unit's last trained gradient (the base projection's dX beside its adapter's). The graph
//! tells: backward runs `loss.sorted_nodes()` in order, so when a hook fires on a node every
//! node before it has run, and a unit whose frozen parameters no later node reads may
//! release them there. Reads are found by storage, so views of a frozen weight count.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Tensor, TensorId};

use super::backward_reads;
use super::error::EngineError;
use super::unit::{FsdpUnit, RunContext};

/// The address of `t`'s storage: equal for a tensor and its views.
fn storage_address(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    std::ptr::from_ref(&*storage).addr()
}

/// Where the coming backward stands relative to the reads of frozen parameters.
#[derive(Default)]
pub(crate) struct FrozenReleases {
    /// Each graph node's position in backward order.
    positions: HashMap<TensorId, usize>,
    /// Per unit with frozen parameters: the position of the last node whose backward reads
    /// one (0 when none does).
    last_read: HashMap<usize, usize>,
}

impl FrozenReleases {
    /// Plans from `sorted` (`loss.sorted_nodes()`) for `units`.
    pub fn plan(sorted: &[&Tensor], units: &[Arc<FsdpUnit>]) -> FrozenReleases {
        let mut frozen: HashMap<usize, usize> = HashMap::new();
        let mut last_read = HashMap::new();
        for (u, unit) in units.iter().enumerate() {
            for (p, f) in unit.params.iter().zip(&unit.full()) {
                if !p.layout.requires_grad {
                    frozen.insert(storage_address(f), u);
                    last_read.insert(u, 0);
                }
            }
        }
        let mut positions = HashMap::with_capacity(sorted.len());
        for (at, node) in sorted.iter().enumerate() {
            positions.insert(node.id(), at);
            let Some(op) = node.op() else { continue };
            for (arg, reads) in backward_reads::inputs(op).0 {
                if let Some(&u) = reads.then(|| frozen.get(&storage_address(arg))).flatten() {
                    last_read.insert(u, at);
                }
            }
        }
        FrozenReleases {
            positions,
            last_read,
        }
    }

    /// Backward reached the node of unit `u`'s full parameter `i`: releases the frozen
    /// parameters no later node reads.
    pub fn at_param(
        &self,
        units: &[Arc<FsdpUnit>],
        (u, i): (usize, usize),
        cx: &RunContext,
    ) -> Result<(), EngineError> {
        if self.last_read.is_empty() {
            return Ok(());
        }
        let at = units[u]
            .full_id(i)
            .and_then(|id| self.positions.get(&id).copied());
        self.release_before(units, at, cx)
    }

    /// Backward reached an output of unit `u` (the earliest of them, to be safe).
    pub fn at_outputs(
        &self,
        units: &[Arc<FsdpUnit>],
        u: usize,
        cx: &RunContext,
    ) -> Result<(), EngineError> {
        if self.last_read.is_empty() {
            return Ok(());
        }
        let at = units[u]
            .outputs()
            .iter()
            .filter_map(|o| self.positions.get(&o.id()).copied())
            .min();
        self.release_before(units, at, cx)
    }

    fn release_before(
        &self,
        units: &[Arc<FsdpUnit>],
        at: Option<usize>,
        cx: &RunContext,
    ) -> Result<(), EngineError> {
        let Some(at) = at else { return Ok(()) };
        for (&u, &last) in &self.last_read {
            if last < at {
                units[u].reshard_frozen(cx)?;
            }
        }
        Ok(())
    }
}
