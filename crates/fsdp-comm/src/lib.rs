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

pub mod address;
mod algorithms;
pub mod backend;
pub mod buffer;
pub mod communicator;
#[cfg(feature = "nccl")]
mod cuda_buffer;
pub mod dtype;
pub mod error;
pub mod group;
mod group_communicator;
pub mod local;
pub mod local_job;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod options;
mod protocol;
mod rendezvous;
mod shm;
pub mod store;
mod transport;
pub mod work;
pub mod world;

pub use address::{ListenAddress, SOCKET_IFNAME_ENVS, listen_address};
pub use backend::{Joined, Selection, join_job};
pub use buffer::{Buffer, BufferElement};
pub use communicator::{Communicator, CommunicatorExt, SingleRank};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use group::ProcessGroup;
pub use local::LocalGroup;
pub use local_job::{LocalJob, WorkerEnv, WorkerOutput};
pub use mesh::Mesh;
pub use options::{
    ABORT_KEY, BACKEND_ENV, BackendChoice, GroupOptions, OUTPUT_PREFIXED_ENV, PREFIX_ENV,
    RENDEZVOUS_TIMEOUT_ENV, RESTART_COUNT_ENV, SECRET_ENV, STORE_HOSTED_ENV, TIMEOUT_ENV,
    TRANSPORT_ENV, TransportChoice, parse_seconds,
};
pub use shm::remove_segments_of as remove_shm_segments_of;
pub use work::Work;
pub use world::{Launcher, WorldError, WorldInfo};
