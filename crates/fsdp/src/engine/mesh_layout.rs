//! The mesh a job's ranks shard over, from the strategy and the launch environment: every
//! rank for FULL_SHARD and SHARD_GRAD_OP (in two hops across machines where they span
//! several), none for NO_SHARD, each machine's processes for the hybrid strategies — after
//! the ranks have agreed on the settings that shape their collectives.

use std::sync::Arc;

use fsdp_comm::{Communicator, Mesh};

use super::error::EngineError;
use crate::config::{FsdpPlugin, ShardingStrategy};

/// The processes of one machine, which hybrid sharding shards over: from the launch
/// environment as `WorldInfo` reads it (`fsdp launch`'s `LOCAL_WORLD_SIZE`, or SLURM's,
/// Open MPI's or MPICH's per-node counts); the whole group for a process no launcher
/// started (one machine).
fn machine_size(world: usize) -> Result<usize, EngineError> {
    let unsupported = |what: String| EngineError::Unsupported {
        setting: format!("hybrid sharding with {what} in a group of {world}"),
        hint: "hybrid sharding shards over each machine's processes: their number must divide the group",
    };
    let info = fsdp_comm::WorldInfo::from_env()
        .map_err(|e| unsupported(format!("a launch environment that does not read ({e})")))?;
    if info.launcher == fsdp_comm::Launcher::Standalone {
        return Ok(world);
    }
    match info.local_world_size {
        n if n > 0 && world.is_multiple_of(n) => Ok(n),
        n => Err(unsupported(format!(
            "{n} processes on this machine ({:?} launch environment)",
            info.launcher
        ))),
    }
}

/// The mesh `plugin` makes of `group`'s ranks. What one rank can tell alone is refused
/// before any collective; then the ranks compare their settings before they build groups
/// on them.
pub(crate) fn build(
    plugin: &FsdpPlugin,
    group: Arc<dyn Communicator>,
) -> Result<Mesh, EngineError> {
    let strategy = plugin.sharding_strategy;
    // Ranks a parameter is sharded over, and the machine size the collectives use
    // (hybrid sharding's shard groups, two hops' machines; 0 for none).
    let (shard_size, layout) = match strategy {
        ShardingStrategy::NoShard => (1, 0),
        s if s.is_hybrid() => {
            let machine = machine_size(group.size())?;
            (machine, machine)
        }
        _ => {
            let two_hops = super::two_hops::machine_size(plugin, group.as_ref());
            (group.size(), two_hops.unwrap_or(0))
        }
    };
    super::secondary::wanted(plugin, shard_size)?;
    super::agreement::check(plugin, group.as_ref(), layout)?;
    match strategy {
        ShardingStrategy::NoShard => Ok(Mesh::replicated(group)),
        s if s.is_hybrid() => Ok(Mesh::hybrid(group.as_ref(), shard_size)?),
        _ => super::two_hops::attach(Mesh::sharded(group), (layout > 0).then_some(layout)),
    }
}
