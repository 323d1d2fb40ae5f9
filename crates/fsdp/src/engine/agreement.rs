//! The settings that decide which collectives a rank issues — their order, element types and
//! sizes, and the groups they run on — must be the same on every rank, or the job fails in a
//! mismatch mid-step, or waits for peers that build a group they never join. A config file
//! that differs between machines is the usual cause. The engine compares them once, when it
//! is made: a difference fails every rank, naming the key, this rank's value and the ranks
//! that have another.

use fsdp_comm::{Communicator, CommunicatorExt};

use super::error::EngineError;
use crate::config::{Choice, FsdpPlugin};

/// Each setting that shapes the collectives, by its configuration key, as this rank has it;
/// `layout` is the machine size its collectives use (hybrid sharding's shard groups, two
/// hops' machines; 0 for none).
fn settings(plugin: &FsdpPlugin, layout: usize) -> Vec<(&'static str, String)> {
    let pattern = |r: &Option<regex::Regex>| r.as_ref().map_or(String::new(), |r| r.to_string());
    vec![
        (
            "fsdp_sharding_strategy",
            plugin.sharding_strategy.name().into(),
        ),
        ("mixed_precision", plugin.mixed_precision.name().into()),
        ("fsdp_reduce_dtype", plugin.reduce_dtype.name().into()),
        (
            "fsdp_all_gather_dtype",
            plugin.all_gather_dtype.name().into(),
        ),
        (
            "fsdp_hpz_partition_size",
            plugin.hpz_partition_size.to_string(),
        ),
        (
            "fsdp_hierarchical_collectives",
            plugin.hierarchical_collectives.to_string(),
        ),
        (
            "fsdp_backward_prefetch",
            plugin.backward_prefetch.name().into(),
        ),
        ("fsdp_forward_prefetch", plugin.forward_prefetch.to_string()),
        (
            "fsdp_activation_checkpointing",
            plugin.activation_checkpointing.to_string(),
        ),
        (
            "fsdp_auto_wrap_policy",
            plugin.auto_wrap_policy.name().into(),
        ),
        (
            "fsdp_transformer_layer_cls_to_wrap",
            plugin
                .transformer_layer_cls_to_wrap
                .as_ref()
                .map_or(String::new(), |c| c.join(",")),
        ),
        ("fsdp_min_num_params", plugin.min_num_params.to_string()),
        ("fsdp_ignored_modules", pattern(&plugin.ignored_modules)),
        (
            "fsdp_no_reshard_after_forward",
            pattern(&plugin.no_reshard_after_forward),
        ),
        (
            "processes per machine the collectives use (LOCAL_WORLD_SIZE; 0: none)",
            layout.to_string(),
        ),
    ]
}

/// Fails on every rank of `group` when a setting that shapes the collectives, or the
/// machine `layout` they use, differs between ranks (one all-gather of a checksum per
/// setting). Machines of different sizes agree when neither uses a layout (flat
/// collectives).
pub(crate) fn check(
    plugin: &FsdpPlugin,
    group: &dyn Communicator,
    layout: usize,
) -> Result<(), EngineError> {
    if group.size() < 2 {
        return Ok(());
    }
    let mine = settings(plugin, layout);
    let sums: Vec<i64> = mine
        .iter()
        .map(|(_, v)| i64::from(crc32c::crc32c(v.as_bytes())))
        .collect();
    let k = sums.len();
    let all = group.all_gather_vec(sums.clone()).wait()?;
    for (i, (key, value)) in mine.into_iter().enumerate() {
        let others: Vec<usize> = (0..group.size())
            .filter(|&r| all.get(r * k + i) != Some(&sums[i]))
            .collect();
        if !others.is_empty() {
            return Err(EngineError::Setting {
                key,
                value: if value.is_empty() {
                    "(unset)".into()
                } else {
                    value
                },
                reason: format!(
                    "on rank {} differs from rank(s) {others:?}: every process must run with the same FSDP settings (does a config file or an FSDP_* variable differ between machines?)",
                    group.global_rank()
                ),
            });
        }
    }
    Ok(())
}
