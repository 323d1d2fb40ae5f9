//! Which engine carries a job's collectives — `FSDP_COMM_BACKEND=auto|shm|tcp|mpi` (the
//! configuration key `comm_backend` and `fsdp launch --comm_backend` set it for workers) —
//! and joining the job with it ([`join_job`]).
//!
//! `auto` (the default): shared memory when every rank is on this host; MPI when the job
//! spans machines, this program was built with the `mpi` feature and MPI started it; fsdp-rs's
//! TCP ring otherwise, with a one-line notice saying why.

use std::sync::Arc;

use crate::communicator::Communicator;
use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use crate::options::GroupOptions;
pub use crate::options::{BACKEND_ENV, BackendChoice};
use crate::world::WorldInfo;

/// Whether this build has the MPI communicator (feature `mpi`).
pub const MPI_BUILT: bool = cfg!(feature = "mpi");

/// Whether this process started MPI and has finalized it since (always false in a build
/// without the `mpi` feature): `mpi::finalized`, callable whatever the build's features.
pub fn mpi_finalized() -> bool {
    #[cfg(feature = "mpi")]
    {
        crate::mpi::finalized()
    }
    #[cfg(not(feature = "mpi"))]
    {
        false
    }
}

/// The engine a job's ranks will use, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The engine: `mpi`, or a process group's `shm`, `tcp` (or `auto` for a process group
    /// that picks shared memory when its members share a host).
    pub engine: BackendChoice,
    /// One line on why (for `fsdp env` and logs).
    pub why: String,
    /// A notice for the user when `auto` falls back to the TCP ring across machines.
    pub notice: Option<String>,
}

/// What `choice` means for a job laid out as `world`, `under_mpi` telling whether an MPI
/// launcher started this process; an error saying what is missing when it cannot work.
pub fn select(
    choice: BackendChoice,
    world: &WorldInfo,
    under_mpi: bool,
) -> std::result::Result<Selection, String> {
    let machines = world
        .world_size
        .div_ceil(world.local_world_size.max(1))
        .max(1);
    let why = |engine: BackendChoice, why: String| Selection {
        engine,
        why,
        notice: None,
    };
    match choice {
        BackendChoice::Mpi if !MPI_BUILT => Err(format!(
            "{BACKEND_ENV}=mpi, but this program was built without MPI (build it with fsdp-comm's `mpi` feature, e.g. `cargo build --features fsdp/mpi`; it needs an MPI library such as Debian's libopenmpi-dev)"
        )),
        BackendChoice::Mpi if !under_mpi => Err(format!(
            "{BACKEND_ENV}=mpi, but this process was not started under MPI: start it with `mpirun -n N` or `srun --mpi=pmix -n N`"
        )),
        BackendChoice::Mpi => Ok(why(BackendChoice::Mpi, format!("{BACKEND_ENV}=mpi"))),
        BackendChoice::Shm => Ok(why(BackendChoice::Shm, format!("{BACKEND_ENV}=shm"))),
        BackendChoice::Tcp => Ok(why(BackendChoice::Tcp, format!("{BACKEND_ENV}=tcp"))),
        BackendChoice::Auto if machines == 1 => Ok(why(
            BackendChoice::Auto,
            "auto, every rank on this host: shared memory".into(),
        )),
        BackendChoice::Auto if MPI_BUILT && under_mpi => Ok(why(
            BackendChoice::Mpi,
            format!("auto, {machines} machines, started under MPI"),
        )),
        BackendChoice::Auto => {
            let reason = if MPI_BUILT {
                "this process was not started under MPI"
            } else {
                "this program was built without the `mpi` feature"
            };
            Ok(Selection {
                engine: BackendChoice::Tcp,
                why: format!("auto, {machines} machines: fsdp-rs's TCP ring ({reason})"),
                notice: Some(format!(
                    "the job spans {machines} machines: collectives between them run on fsdp-rs's TCP ring ({reason}; an MPI build started by mpirun or srun --mpi=pmix uses MPI)"
                )),
            })
        }
    }
}

/// A joined job: its world group and the selection that made it.
pub struct Joined {
    /// The group of every rank.
    pub group: Arc<dyn Communicator>,
    /// Which engine carries it, and why.
    pub selection: Selection,
}

/// Joins the job this process belongs to, with the engine `FSDP_COMM_BACKEND` selects for
/// the launch environment ([`WorldInfo::from_env`]); errors name the variable or the
/// rank and what disagrees.
pub fn join_job() -> Result<Joined> {
    let invalid = |rank: usize, reason: String| CommError::InvalidArgument {
        rank,
        op: "joining the job".into(),
        reason,
    };
    let world = WorldInfo::from_env().map_err(|e| invalid(0, e.to_string()))?;
    let choice = BackendChoice::from_env().map_err(|e| invalid(world.rank, e))?;
    let selection = select(choice, &world, crate::world::started_under_mpi())
        .map_err(|e| invalid(world.rank, e))?;
    let options = GroupOptions::from_env()?;
    let group: Arc<dyn Communicator> = match selection.engine {
        BackendChoice::Mpi => join_mpi(&world, &options)?,
        engine => {
            let options = GroupOptions {
                transport: engine.transport(),
                ..options
            };
            Arc::new(ProcessGroup::init(&world, options).map_err(|e| {
                // Ranks of one MPI job on different backends never meet: the ones on MPI
                // wait inside MPI, the others at the rendezvous (whose store rank 0 would
                // have hosted), which times out.
                let unmet = matches!(
                    e,
                    CommError::RendezvousTimeout { .. } | CommError::StoreUnreachable { .. }
                );
                if unmet && crate::world::started_under_mpi() {
                    invalid(world.rank, format!(
                        "{e}. This job was started under MPI: ranks with different {BACKEND_ENV} (mpi on some, {} on others) never meet; give every rank the same",
                        engine.name()
                    ))
                } else {
                    e
                }
            })?)
        }
    };
    Ok(Joined { group, selection })
}

#[cfg(feature = "mpi")]
fn join_mpi(world: &WorldInfo, options: &GroupOptions) -> Result<Arc<dyn Communicator>> {
    let group = crate::mpi::MpiGroup::world(options)?;
    if (group.rank(), group.size()) != (world.rank, world.world_size) {
        return Err(CommError::InvalidArgument {
            rank: group.rank(),
            op: "joining the job over MPI".into(),
            reason: format!(
                "MPI places this process at rank {} of {}, but its launch environment ({:?}) says rank {} of {}",
                group.rank(),
                group.size(),
                world.launcher,
                world.rank,
                world.world_size
            ),
        });
    }
    Ok(Arc::new(group))
}

#[cfg(not(feature = "mpi"))]
fn join_mpi(world: &WorldInfo, _options: &GroupOptions) -> Result<Arc<dyn Communicator>> {
    Err(CommError::InvalidArgument {
        rank: world.rank,
        op: "joining the job".into(),
        reason: "this program was built without MPI".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::Launcher;

    fn world(size: usize, local: usize) -> WorldInfo {
        WorldInfo {
            rank: 0,
            world_size: size,
            local_rank: 0,
            local_world_size: local,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            launcher: Launcher::OpenMpi,
            output_prefixed: false,
            restart_count: 0,
        }
    }

    #[test]
    fn auto_picks_shared_memory_on_one_host_and_mpi_or_tcp_across_hosts() {
        let one = select(BackendChoice::Auto, &world(4, 4), true).unwrap();
        assert_eq!(one.engine, BackendChoice::Auto);
        assert!(one.notice.is_none());
        let across = select(BackendChoice::Auto, &world(4, 2), true).unwrap();
        if MPI_BUILT {
            assert_eq!(across.engine, BackendChoice::Mpi);
            assert!(across.notice.is_none());
        } else {
            assert_eq!(across.engine, BackendChoice::Tcp);
        }
        let tcp = select(BackendChoice::Auto, &world(4, 2), false).unwrap();
        assert_eq!(tcp.engine, BackendChoice::Tcp);
        let notice = tcp.notice.unwrap();
        assert!(
            notice.contains("2 machines") && notice.contains("TCP ring"),
            "{notice}"
        );
    }

    #[test]
    fn mpi_without_the_feature_or_outside_mpi_says_which() {
        let e = select(BackendChoice::Mpi, &world(2, 2), false).unwrap_err();
        if MPI_BUILT {
            assert!(e.contains("not started under MPI"), "{e}");
        } else {
            assert!(e.contains("built without MPI"), "{e}");
        }
        let ok = select(BackendChoice::Mpi, &world(2, 2), true);
        assert_eq!(ok.is_ok(), MPI_BUILT, "{ok:?}");
    }

    #[test]
    fn names_parse_in_any_case() {
        for (i, n) in BackendChoice::NAMES.iter().enumerate() {
            assert_eq!(
                BackendChoice::parse(&n.to_uppercase()),
                Some(BackendChoice::ALL[i])
            );
            assert_eq!(BackendChoice::ALL[i].name(), *n);
        }
        assert_eq!(BackendChoice::parse("4"), Some(BackendChoice::Mpi));
        assert_eq!(BackendChoice::parse("gloo"), None);
        assert_eq!(BackendChoice::parse("0"), None);
        assert_eq!(BackendChoice::parse("5"), None);
    }
}
