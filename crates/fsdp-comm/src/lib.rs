//! Process groups for fsdp-rs: the launch environment, a rendezvous store, peer links and
//! collectives (all-reduce, all-gather, reduce-scatter, broadcast, gather, scatter, barrier,
//! send/recv) with asynchronous work handles, sub-groups and a 2-D mesh for hybrid sharding.
//!
//! Every backend implements [`Communicator`] on typed [`Buffer`]s: the shared-memory / TCP
//! [`ProcessGroup`], NCCL groups (feature `nccl`), the in-process [`LocalGroup`] (threads as
//! peers, for tests) and [`SingleRank`]; a [`Mesh`] pairs a shard and a replicate dimension.
//!
//! Failures never hang: collectives carry a sequence number, kind, dtype and size, so ranks
//! calling different collectives get a `Mismatch` error; a peer that dies is seen as soon as
//! its connection closes; any failure is broadcast so every rank stops.

mod address;
mod algorithms;
mod backend;
mod buffer;
mod communicator;
#[cfg(feature = "nccl")]
mod cuda_buffer;
mod dtype;
mod error;
mod group;
mod group_communicator;
mod local;
mod local_job;
mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod options;
mod protocol;
mod rendezvous;
mod shm;
mod store;
mod transport;
mod two_hops;
mod work;
mod world;

pub use address::{ListenAddress, listen_address};
pub use backend::{
    Joined, MPI_BUILT, Selection, join_job, mpi_finalized, select as select_backend,
};
pub use buffer::{Buffer, BufferElement};
pub use communicator::{Communicator, CommunicatorExt, SingleRank};
pub use dtype::{DType, Element, ReduceOp, finish_avg, reduce_into};
pub use error::{CommError, Result};
pub use group::ProcessGroup;
pub use local::LocalGroup;
pub use local_job::{LocalJob, WorkerEnv, WorkerOutput};
pub use mesh::Mesh;
pub use options::{
    ABORT_KEY, BackendChoice, GroupOptions, SECRET_ENV, TransportChoice, parse_seconds,
};
pub use shm::SharedBlocks;
pub use shm::remove_segments_of as remove_shm_segments_of;
pub use store::{StoreClient, StoreServer};
pub use two_hops::{MachineHops, TwoHops};
pub use work::Work;
pub use world::{Launcher, WorldError, WorldInfo, first_host, started_under_mpi};
