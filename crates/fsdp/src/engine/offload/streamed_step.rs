//! The optimizer step over offloaded state: unit by unit, the unit's shards, reduced
//! gradients and optimizer state stream through memory once — read (the next unit's read
//! already under way), updated by the optimizer exactly as in memory, written behind — so a
//! rank holds about two units' state, whatever the model's size.

use std::collections::{BTreeMap, BTreeSet};

use super::{DiskTier, Region};
use crate::engine::error::EngineError;
use crate::engine::grads::Gradients;
use crate::engine::unit::FsdpUnit;
use crate::optim::{Optimizer, ParamState};

/// Which optimizer state of a parameter lives in the tier: its step count and buffer names
/// (the buffers are its rows in the unit's `Region::State(name)` files).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct OffloadedState {
    pub step: u64,
    pub buffers: Vec<String>,
}

/// Parameter name → its offloaded state.
pub(crate) type OffloadedStates = BTreeMap<String, OffloadedState>;

/// Starts reading unit `unit`'s regions that the step will need.
fn read_ahead(
    tier: &DiskTier,
    unit: &FsdpUnit,
    grads: &Gradients,
    states: &OffloadedStates,
) -> Result<(), EngineError> {
    let block = unit.block();
    if grads.units[unit.index].is_none() {
        return Ok(());
    }
    unit.read_ahead()?;
    if let Some(g) = &grads.units[unit.index] {
        g.read_ahead()?;
    }
    for name in state_names(unit, states) {
        tier.read_ahead(&(unit.index, Region::State(name)), block)?;
    }
    Ok(())
}

/// The state buffer names any parameter of `unit` has in the tier.
fn state_names(unit: &FsdpUnit, states: &OffloadedStates) -> BTreeSet<String> {
    unit.params
        .iter()
        .filter_map(|p| states.get(&p.layout.name))
        .flat_map(|s| s.buffers.iter().cloned())
        .collect()
}

/// Updates every unit's rows that received a gradient with `optimizer`, streaming offloaded
/// shards (when `units` are offloaded) and optimizer state (always) through memory.
pub(crate) fn update_units(
    tier: &DiskTier,
    units: &mut [std::sync::Arc<FsdpUnit>],
    grads: &mut Gradients,
    optimizer: &mut dyn Optimizer,
    states: &mut OffloadedStates,
) -> Result<(), EngineError> {
    let order: Vec<usize> = (0..units.len())
        .filter(|&u| grads.units[u].is_some())
        .collect();
    if let Some(&first) = order.first() {
        read_ahead(tier, &units[first], grads, states)?;
    }
    for (k, &u) in order.iter().enumerate() {
        if let Some(&next) = order.get(k + 1) {
            read_ahead(tier, &units[next], grads, states)?;
        }
        let Some(reduced) = grads.units[u].take() else {
            continue;
        };
        let reduced = reduced.into_values()?;
        let block = units[u].block();
        let names = state_names(&units[u], states);
        let mut blocks: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        for name in names {
            let values = tier.read(&(u, Region::State(name.clone())), block)?;
            blocks.insert(name, values);
        }
        let offloaded = units[u].store.on_disk();
        let mut master = if offloaded {
            units[u].master_block()?
        } else {
            Vec::new()
        };
        let unit = crate::engine::unit::exclusive(&mut units[u], "the optimizer step")?;
        let layouts = unit.params.iter_mut().zip(&unit.grad_layouts);
        for ((p, g), &has) in layouts.zip(&grads.has_grad[u]) {
            if !(p.layout.requires_grad && has) {
                continue;
            }
            let at = crate::engine::unit::grad_elements(p, g);
            // Shards and optimizer state are laid out by the parameters' blocks, gradients by
            // the trainable ones'.
            let (off, n) = (p.layout.offset, at.len());
            let name = p.layout.name.clone();
            if optimizer.state(&name).is_none()
                && let Some(saved) = states.get(&name)
            {
                let buffers = saved
                    .buffers
                    .iter()
                    .map(|b| (b.clone(), blocks[b][off..off + n].to_vec()))
                    .collect();
                let state = ParamState {
                    step: saved.step,
                    buffers,
                };
                optimizer.set_state(&name, state)?;
            }
            let rows = if offloaded {
                &mut master[off..off + n]
            } else {
                &mut p.shard.values_mut()?[..n]
            };
            optimizer.update(&name, rows, &reduced[at])?;
            if let Some(state) = optimizer.take_state(&name) {
                let saved = stash(&mut blocks, block, off, &name, state)?;
                states.insert(name, saved);
            }
        }
        drop(reduced);
        if offloaded {
            tier.write(&(u, Region::Params), master)?;
        }
        for (name, values) in blocks {
            tier.write(&(u, Region::State(name)), values)?;
        }
    }
    tier.flush()?;
    Ok(())
}

/// Copies `state`'s buffers (parameter `name`'s `n` owned elements) into the unit's state
/// blocks at `off`, making blocks of `block` zeros for buffers the unit had none of.
fn stash(
    blocks: &mut BTreeMap<String, Vec<f32>>,
    block: usize,
    off: usize,
    name: &str,
    state: ParamState,
) -> Result<OffloadedState, EngineError> {
    for (b, values) in &state.buffers {
        let dst = blocks.entry(b.clone()).or_insert_with(|| vec![0.0; block]);
        let Some(dst) = dst.get_mut(off..off + values.len()) else {
            return Err(EngineError::State {
                name: name.into(),
                problem: format!(
                    "optimizer state `{b}` has {} values, more than the parameter's rows",
                    values.len()
                ),
            });
        };
        dst.copy_from_slice(values);
    }
    Ok(OffloadedState {
        step: state.step,
        buffers: state.buffers.into_keys().collect(),
    })
}
