//! Debug mode's checks (`debug: true` in the configuration, `ACCELERATE_DEBUG_MODE=true`, or
//! `Fsdp::set_debug`): released parameters are poisoned with NaN rather than returned (see
//! `FsdpUnit::post_forward`), the graph is checked before backward runs, and a non-finite loss
//! is traced back to the released parameter read outside its unit.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{CpuStorage, Tensor, TensorId};

use super::error::EngineError;
use std::sync::Arc;

use super::unit::{FsdpUnit, ShardedState};

/// Before backward: every unit released after its forward reported its output (else nothing
/// refills it), and each of its parameters in the graph reaches the loss through that
/// output (else it was used outside its unit).
pub(crate) fn check_graph(
    units: &[Arc<FsdpUnit>],
    in_graph: &HashSet<TensorId>,
) -> Result<(), EngineError> {
    for unit in units {
        if unit.unhooked() {
            return Err(EngineError::UnhookedOutput { unit: unit.name() });
        }
        if unit.sharded_state() == ShardedState::Sharded || unit.path.is_empty() {
            continue;
        }
        let outputs = unit.outputs();
        if outputs.is_empty() {
            continue;
        }
        let mut reach: HashSet<TensorId> = HashSet::new();
        for o in &outputs {
            reach.extend(o.sorted_nodes().iter().map(|t| t.id()));
        }
        for (p, f) in unit.params.iter().zip(&unit.full()) {
            let id = f.id();
            if in_graph.contains(&id) && !reach.contains(&id) {
                return Err(EngineError::UsedOutsideUnit {
                    param: p.layout.name.clone(),
                    unit: unit.name(),
                });
            }
        }
    }
    Ok(())
}

/// Released parameters read as NaN in debug mode, so a non-finite loss may come from a
/// parameter used after its unit released it. Finds the first computed (not a view of a
/// released parameter) non-finite value in forward order (values computed before a release
/// stay finite) and names the released parameters it depends on; `None` when the cause is
/// not a released parameter.
pub(crate) fn diagnose_non_finite(units: &[Arc<FsdpUnit>], loss: &Tensor) -> Option<EngineError> {
    let finite = |t: &Tensor| -> bool {
        t.to_dtype(candle_core::DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map(|v| v.iter().all(|x| x.is_finite()))
            .unwrap_or(true)
    };
    let buffer = |t: &Tensor| -> usize {
        let (storage, _) = t.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr() as usize,
            _ => 0,
        }
    };
    if finite(loss) {
        return None;
    }
    let mut released: HashMap<TensorId, (String, &str)> = HashMap::new();
    let mut released_buffers = HashSet::new();
    for unit in units {
        if unit.sharded_state() != ShardedState::ReleasedAfterForward {
            continue;
        }
        for (p, f) in unit.params.iter().zip(&unit.full()) {
            released.insert(f.id(), (unit.name(), p.layout.name.as_str()));
            released_buffers.insert(buffer(f));
        }
    }
    if released.is_empty() {
        return None;
    }
    let sorted = loss.sorted_nodes();
    let first_bad = sorted
        .iter()
        .rev()
        .find(|n| !n.is_variable() && !released_buffers.contains(&buffer(n)) && !finite(n))?;
    let culprits: Vec<String> = first_bad
        .sorted_nodes()
        .iter()
        .filter_map(|a| released.get(&a.id()))
        .map(|(unit, name)| format!("`{name}` of {unit}"))
        .collect();
    (!culprits.is_empty()).then(|| EngineError::ReleasedParameterRead {
        params: culprits.join(" or "),
    })
}

/// Warns (rank 0, once per unit and engine: `reported`) about units that stayed gathered
/// through forward because their output never passed through `module_output`: training is
/// correct, but FSDP's memory saving for them is gone, which nothing else would show.
pub(crate) fn report_unhooked(units: &[Arc<FsdpUnit>], reported: &[AtomicBool], rank: usize) {
    for (unit, reported) in units.iter().zip(reported) {
        if unit.unhooked() && !reported.swap(true, Ordering::Relaxed) && rank == 0 {
            tracing::warn!(
                "{} was gathered in forward, but its output never passed through Params::module_output, so it stays gathered until its backward and FSDP saves no memory on it: run the module with `Forward::call` (`module.call(p, input)`), not `forward` (reported once per unit)",
                unit.name()
            );
        }
    }
}
