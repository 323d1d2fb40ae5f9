//! Two-hop collectives across machines (`fsdp_hierarchical_collectives`, on unless set
//! false): when parameters are sharded over the processes of several machines, a unit's
//! all-gather and its gradients' reduce-scatter run inside each machine and among the
//! processes at the same place on each machine ([`fsdp_comm::TwoHops`]), so what crosses the
//! network is each process's share once instead of once per process of the other machines.
//! Gathers deliver the same bytes as a flat all-gather; reductions add in another order.

use fsdp_comm::{Communicator, Launcher, Mesh, WorldInfo};

use super::error::EngineError;
use crate::config::{FsdpPlugin, machines_spanned};

/// The machine size two-hop collectives would use over `group` as a shard group (the
/// processes of each machine), when `plugin` allows them and the launch environment says the
/// group spans machines of two or more processes each; `None` for flat collectives. Ranks
/// compare it ([`super::agreement`]): machines of different sizes decide differently.
pub(crate) fn machine_size(plugin: &FsdpPlugin, group: &dyn Communicator) -> Option<usize> {
    // NCCL arranges its own rings and trees across machines.
    if !plugin.hierarchical_collectives || group.backend() == "nccl" {
        return None;
    }
    let info = WorldInfo::from_env().ok()?;
    let standalone = info.launcher == Launcher::Standalone;
    spanned_machines(
        group.size(),
        info.world_size,
        info.local_world_size,
        standalone,
    )
}

/// The processes of each machine when a group of `world` ranks, the whole launched job of
/// `launched` (ranks numbered machine by machine, as every launcher does), spans machines of
/// `per_machine` ≥ 2 processes: several of them, the same size.
fn spanned_machines(
    world: usize,
    launched: usize,
    per_machine: usize,
    standalone: bool,
) -> Option<usize> {
    if standalone || launched != world {
        return None;
    }
    machines_spanned(world, per_machine)
}

/// `mesh` with two-hop collectives over machines of `machine_size` processes, if any.
pub(crate) fn attach(mesh: Mesh, machine_size: Option<usize>) -> Result<Mesh, EngineError> {
    match machine_size {
        Some(n) if mesh.machines.is_none() => Ok(mesh.with_machines(n)?),
        _ => Ok(mesh),
    }
}

#[cfg(test)]
mod tests {
    use super::spanned_machines;

    #[test]
    fn two_hops_only_over_several_machines_of_two_or_more() {
        assert_eq!(spanned_machines(4, 4, 2, false), Some(2));
        assert_eq!(spanned_machines(6, 6, 3, false), Some(3));
        // One machine, one process a machine, a sub-group, a standalone run.
        assert_eq!(spanned_machines(4, 4, 4, false), None);
        assert_eq!(spanned_machines(4, 4, 1, false), None);
        assert_eq!(spanned_machines(2, 4, 2, false), None);
        assert_eq!(spanned_machines(4, 4, 2, true), None);
        // Machines of 4 and 2 (mpirun over uneven hosts): the rank on a machine of 4 keeps
        // flat collectives, the ranks on the machine of 2 would go two hops — the settings
        // agreement refuses that pair.
        assert_eq!(spanned_machines(6, 6, 4, false), None);
        assert_eq!(spanned_machines(6, 6, 2, false), Some(2));
    }
}
