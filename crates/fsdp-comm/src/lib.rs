//! Process groups for fsdp-rs: the launch environment, a rendezvous store, peer links and
//! collectives (all-reduce, all-gather, reduce-scatter, broadcast, gather, scatter, barrier,
//! send/recv) with asynchronous work handles, sub-groups and a 2-D mesh for hybrid sharding.
//!
//! Failures never hang: collectives carry a sequence number, kind, dtype and size, so ranks
//! calling different collectives get a `Mismatch` error; a peer that dies is seen as soon as
//! its connection closes; any failure is broadcast so every rank stops.

mod algorithms;
pub mod dtype;
pub mod error;
pub mod group;
#[cfg(feature = "nccl")]
pub mod nccl;
mod shm;
pub mod store;
mod transport;
pub mod world;

pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use group::{
    GroupOptions, PREFIX_ENV, ProcessGroup, SECRET_ENV, STORE_HOSTED_ENV, TransportChoice, Work,
};
pub use world::{Launcher, WorldError, WorldInfo};
