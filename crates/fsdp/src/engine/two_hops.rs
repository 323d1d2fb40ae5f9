//! Two-hop collectives across machines (`fsdp_hierarchical_collectives`, on unless set
//! false): when parameters are sharded over the processes of several machines, a unit's
//! all-gather and its gradients' reduce-scatter run inside each machine and among the
//! processes at the same place on each machine ([`fsdp_comm::TwoHops`]), so what crosses the
//! network is each process's share once instead of once per process of the other machines.
//! Gathers deliver the same bytes as a flat all-gather; reductions add in another order.

use fsdp_comm::{Launcher, Mesh, WorldInfo};

use super::error::EngineError;
use crate::config::FsdpPlugin;

/// `mesh` with two-hop collectives over its shard group when `plugin` allows them and the
/// launch environment says the group spans machines of two or more processes each.
pub(crate) fn attach(plugin: &FsdpPlugin, mesh: Mesh) -> Result<Mesh, EngineError> {
    // NCCL arranges its own rings and trees across machines.
    if !plugin.hierarchical_collectives || mesh.machines.is_some() || mesh.shard.backend() == "nccl"
    {
        return Ok(mesh);
    }
    match processes_per_machine(mesh.shard_size()) {
        Some(per_machine) => Ok(mesh.with_machines(per_machine)?),
        None => Ok(mesh),
    }
}

/// The processes of each machine, when a group of `world` launched ranks spans several
/// machines of two or more processes (ranks numbered machine by machine, as every launcher
/// does); `None` on one machine or where the environment does not say.
fn processes_per_machine(world: usize) -> Option<usize> {
    let info = WorldInfo::from_env().ok()?;
    let n = info.local_world_size;
    let spans = info.launcher != Launcher::Standalone
        && info.world_size == world
        && n >= 2
        && n < world
        && world.is_multiple_of(n);
    spans.then_some(n)
}
