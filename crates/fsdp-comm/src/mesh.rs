//! [`Mesh`]: the ranks a model is sharded over (`shard`) and the groups of replicas that hold
//! the same shards (`replicate`): one dimension for FULL_SHARD / SHARD_GRAD_OP, only the
//! replicate dimension for NO_SHARD, both for hybrid sharding.

use std::sync::Arc;

use crate::buffer::{Buffer, BufferElement};
use crate::communicator::{Communicator, SingleRank};
use crate::dtype::ReduceOp;
use crate::error::Result;
use crate::two_hops::MachineHops;

/// A 1-D or 2-D device mesh: rank = replica × shard size + shard index.
#[derive(Clone)]
pub struct Mesh {
    /// The ranks that each hold a part of every parameter.
    pub shard: Arc<dyn Communicator>,
    /// The ranks holding the same part (replicas), when there is more than one.
    pub replicate: Option<Arc<dyn Communicator>>,
    /// A group of consecutive ranks of `shard` (a machine's processes) that backward gathers
    /// from when each keeps a secondary partition (ZeRO++'s hpZ).
    pub secondary: Option<Arc<dyn Communicator>>,
    /// Two-hop gathers and reductions over `shard` when it spans machines (within each
    /// machine, then across): each machine's share crosses the network once.
    pub machines: Option<Arc<MachineHops>>,
}

impl Mesh {
    /// Shards over every rank of `group` (FULL_SHARD, SHARD_GRAD_OP).
    pub fn sharded(group: Arc<dyn Communicator>) -> Mesh {
        Mesh {
            shard: group,
            replicate: None,
            secondary: None,
            machines: None,
        }
    }

    /// Replicates over every rank of `group` (NO_SHARD): the shard dimension is this rank
    /// alone.
    pub fn replicated(group: Arc<dyn Communicator>) -> Mesh {
        Mesh {
            shard: Arc::new(SingleRank::new(group.global_rank())),
            replicate: Some(group),
            secondary: None,
            machines: None,
        }
    }

    /// Shards within groups of `shard_size` consecutive ranks of `group` and replicates
    /// across them (hybrid sharding). Every rank of `group` must call it.
    pub fn hybrid(group: &dyn Communicator, shard_size: usize) -> Result<Mesh> {
        let (shard, replicate) = group.split_2d(shard_size)?;
        Ok(Mesh {
            shard,
            replicate: Some(replicate),
            secondary: None,
            machines: None,
        })
    }

    /// This mesh with a secondary group: the `size` consecutive ranks of the shard group
    /// this rank belongs to (ZeRO++'s hpZ partition). Every rank of the shard group must
    /// call it.
    pub fn with_secondary(mut self, size: usize) -> Result<Mesh> {
        let (secondary, _) = self.shard.split_2d(size)?;
        self.secondary = Some(secondary);
        Ok(self)
    }

    /// This mesh with two-hop collectives over its shard group, a machine being `size`
    /// consecutive ranks of it. Every rank of the shard group must call it.
    pub fn with_machines(mut self, size: usize) -> Result<Mesh> {
        self.machines = Some(Arc::new(MachineHops::new(self.shard.as_ref(), size)?));
        Ok(self)
    }

    /// Ranks a parameter is split over.
    pub fn shard_size(&self) -> usize {
        self.shard.size()
    }

    /// Number of replicas of each shard.
    pub fn replicas(&self) -> usize {
        self.replicate.as_ref().map_or(1, |r| r.size())
    }

    /// Ranks in the mesh.
    pub fn world_size(&self) -> usize {
        self.shard_size() * self.replicas()
    }

    /// This rank in the whole mesh.
    pub fn rank(&self) -> usize {
        let replica = self.replicate.as_ref().map_or(0, |r| r.rank());
        replica * self.shard_size() + self.shard.rank()
    }

    /// This rank's job-wide rank (for messages).
    pub fn global_rank(&self) -> usize {
        self.shard.global_rank()
    }

    /// All-reduce over every rank of the mesh (the shard dimension, then the replicate one).
    pub fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Result<Buffer> {
        let buf = self.shard.all_reduce(buf, op).wait()?;
        match &self.replicate {
            Some(r) => r.all_reduce(buf, op).wait(),
            None => Ok(buf),
        }
    }

    /// [`Mesh::all_reduce`] of a vector.
    pub fn all_reduce_vec<T: BufferElement>(&self, v: Vec<T>, op: ReduceOp) -> Result<Vec<T>> {
        let rank = self.global_rank();
        self.all_reduce(T::into_buffer(v), op)?
            .into_vec::<T>()
            .map_err(|b| crate::CommError::InvalidArgument {
                rank,
                op: "all_reduce".into(),
                reason: format!("the result holds {:?} elements", b.dtype()),
            })
    }

    /// Every rank's `v` (same length on all) concatenated in mesh-rank order, on every rank.
    pub fn all_gather_vec<T: BufferElement>(&self, v: Vec<T>) -> Result<Vec<T>> {
        use crate::communicator::CommunicatorExt;
        let mine = self.shard.all_gather_vec(v).wait()?;
        match &self.replicate {
            Some(r) => r.all_gather_vec(mine).wait(),
            None => Ok(mine),
        }
    }

    /// Rank 0's buffer on every rank of the mesh.
    pub fn broadcast_from_first(&self, buf: Buffer) -> Result<Buffer> {
        let buf = match &self.replicate {
            Some(r) => r.broadcast(buf, 0).wait()?,
            None => buf,
        };
        self.shard.broadcast(buf, 0).wait()
    }

    /// Payload bytes this rank has sent inside its secondary group.
    pub fn secondary_bytes_sent(&self) -> u64 {
        self.secondary.as_ref().map_or(0, |s| s.bytes_sent())
    }

    /// Payload bytes this rank has sent in two-hop collectives (inside its machine, across
    /// machines).
    pub fn two_hop_bytes_sent(&self) -> (u64, u64) {
        self.machines.as_ref().map_or((0, 0), |m| m.bytes_sent())
    }

    /// Payload bytes this rank has sent over both dimensions.
    pub fn bytes_sent(&self) -> (u64, u64) {
        (
            self.shard.bytes_sent(),
            self.replicate.as_ref().map_or(0, |r| r.bytes_sent()),
        )
    }
}
