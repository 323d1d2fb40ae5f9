//! An optimizer's parameter groups in checkpoints, as PyTorch's `param_groups`: which of the
//! model's parameters each group holds and its settings. Loading refuses groups that differ
//! (PyTorch's `load_state_dict` refuses a group of another size; by name we can say which
//! parameter moved) before anything is changed, and then restores the saved settings.

use std::path::Path;

use super::error::CheckpointError;
use super::format::{GroupDoc, OptimizerDoc};
use crate::engine::Fsdp;
use crate::optim::Optimizer;

/// Each group of `o` with the parameters of `model` it holds, in the model's order.
pub(crate) fn recorded(model: &Fsdp, o: &dyn Optimizer) -> Vec<GroupDoc> {
    let names: Vec<&str> = model.parameters().into_iter().map(|(n, _)| n).collect();
    (0..o.num_groups())
        .map(|g| GroupDoc {
            params: names
                .iter()
                .filter(|n| o.param_group(n) == Some(g))
                .map(|n| n.to_string())
                .collect(),
            settings: o.group_settings(g),
        })
        .collect()
}

/// Refuses a checkpoint whose groups hold other parameters than `o`'s do (same count
/// checked already), naming the group and a parameter that moved. Changes nothing.
pub(crate) fn check(
    dir: &Path,
    saved: &OptimizerDoc,
    model: &Fsdp,
    o: &dyn Optimizer,
) -> Result<(), CheckpointError> {
    let mismatch = |reason: String| CheckpointError::Mismatch {
        path: dir.to_path_buf(),
        reason,
    };
    let now = recorded(model, o);
    // Without membership on either side (a checkpoint from before groups were recorded, or
    // an optimizer that does not say), only the count can be compared.
    let known = |groups: &[GroupDoc]| groups.iter().any(|g| !g.params.is_empty());
    if !known(&saved.groups) || !known(&now) {
        return Ok(());
    }
    let group_in = |groups: &[GroupDoc], name: &str| {
        groups
            .iter()
            .position(|g| g.params.iter().any(|p| p == name))
    };
    for (g, (was, is)) in saved.groups.iter().zip(&now).enumerate() {
        if was.params == is.params {
            continue;
        }
        let moved = was
            .params
            .iter()
            .chain(&is.params)
            .find(|p| group_in(&saved.groups, p) != group_in(&now, p))
            .map(|p| {
                let at =
                    |i: Option<usize>| i.map_or("no group".to_string(), |i| format!("group {i}"));
                format!(
                    "; `{p}` is in {} of the checkpoint and {} of the optimizer",
                    at(group_in(&saved.groups, p)),
                    at(group_in(&now, p))
                )
            })
            .unwrap_or_default();
        return Err(mismatch(format!(
            "parameter group {g} holds {} parameter(s) in the checkpoint and {} in the optimizer{moved}: build the optimizer's groups as the run that saved it did",
            was.params.len(),
            is.params.len()
        )));
    }
    Ok(())
}

/// Gives `o`'s groups the saved settings (learning rates, betas, weight decay, ...): all of
/// them, or, when one is refused, none (the groups set already get their settings back).
pub(crate) fn restore(
    dir: &Path,
    saved: &OptimizerDoc,
    o: &mut dyn Optimizer,
) -> Result<(), CheckpointError> {
    let before: Vec<serde_json::Value> = (0..saved.groups.len())
        .map(|g| o.group_settings(g))
        .collect();
    for (g, group) in saved.groups.iter().enumerate() {
        if let Err(e) = o.set_group_settings(g, &group.settings) {
            for (earlier, settings) in before.iter().enumerate().take(g) {
                let _ = o.set_group_settings(earlier, settings);
            }
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                reason: format!("the saved settings of parameter group {g}: {e}"),
            });
        }
    }
    Ok(())
}
