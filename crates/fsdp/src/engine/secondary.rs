//! ZeRO++'s secondary partition (hpZ, `fsdp_hpz_partition_size`): after forward's all-gather
//! of a unit that reshards, each rank keeps its share of the gathered block — 1/N of it for a
//! group of N consecutive ranks, a machine's processes — so backward gathers the unit again
//! from that group only, inside the machine, instead of across the whole shard group. The
//! block comes back exactly as forward received it (int8 bytes included), so backward
//! computes with the same values.

use fsdp_comm::{Buffer, Communicator, Mesh};

use super::error::EngineError;
use crate::config::FsdpPlugin;

/// `mesh` with its secondary groups when `plugin` asks for them (and parameters are sharded
/// over more than one rank); a size that cannot work is refused naming the key.
pub(crate) fn attach(plugin: &FsdpPlugin, mesh: Mesh) -> Result<Mesh, EngineError> {
    if mesh.secondary.is_some() || !wanted(plugin, mesh.shard_size())? {
        return Ok(mesh);
    }
    Ok(mesh.with_secondary(plugin.hpz_partition_size)?)
}

/// Whether `plugin` asks for a secondary partition that can work over a shard group of
/// `shard` ranks (none with one rank: nothing is gathered); one that cannot is refused
/// naming the key, before any collective.
pub(crate) fn wanted(plugin: &FsdpPlugin, shard: usize) -> Result<bool, EngineError> {
    let size = plugin.hpz_partition_size;
    if size < 2 {
        return Ok(false);
    }
    let refuse = |reason: String| EngineError::Setting {
        key: "fsdp_hpz_partition_size",
        value: size.to_string(),
        reason,
    };
    let strategy = plugin.sharding_strategy;
    if !strategy.reshards_after_forward() {
        return Err(refuse(format!(
            "keeps a partition for backward's second all-gather, which {strategy} does not make: use FULL_SHARD or HYBRID_SHARD, or leave it unset"
        )));
    }
    if shard < 2 {
        // Nothing is gathered (one rank holds every parameter): nothing to keep.
        return Ok(false);
    }
    if !shard.is_multiple_of(size) {
        return Err(refuse(format!(
            "does not divide the {shard} ranks parameters are sharded over: use a divisor, such as the processes per machine"
        )));
    }
    Ok(true)
}

/// This rank's share of a gathered block in host memory (its part of `group`'s equal
/// parts, by rank); `None` for a device buffer (backward then gathers from the shard group).
pub(crate) fn share(gathered: &Buffer, group: &dyn Communicator) -> Option<Buffer> {
    let k = gathered.len() / group.size().max(1);
    let me = group.rank();
    gathered.copy_range(me * k..(me + 1) * k)
}
