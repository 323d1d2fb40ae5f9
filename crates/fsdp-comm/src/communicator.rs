//! [`Communicator`]: the collectives every backend offers on typed [`Buffer`]s, asynchronously.
//! The FSDP engine holds `Arc<dyn Communicator>`, so the shared-memory/TCP [`crate::ProcessGroup`],
//! NCCL groups, the in-process [`crate::LocalGroup`] and a single rank ([`SingleRank`]) are
//! interchangeable.

use std::sync::Arc;
use std::time::Duration;

use crate::buffer::{Buffer, BufferElement};
use crate::dtype::ReduceOp;
use crate::error::{CommError, Result};
use crate::shm::SharedBlocks;
use crate::work::Work;

/// Collectives over a group of ranks. Every member calls the same collectives in the same
/// order; results come back as [`Work`] handles. A failure (a mismatch, a dead peer, a
/// timeout) is an error on every member that names the rank and the op, never a hang.
pub trait Communicator: Send + Sync {
    /// This member's rank in the group.
    fn rank(&self) -> usize;
    /// Number of members.
    fn size(&self) -> usize;
    /// This member's job-wide rank (for messages).
    fn global_rank(&self) -> usize;
    /// What carries the data (`shm`, `tcp`, `nccl`, `local`, `single`), for reports.
    fn backend(&self) -> &'static str;
    /// Concatenation of every member's `input` (all the same length) in rank order. The
    /// input is freed as soon as the collective is done with it, not when the handle is
    /// waited for.
    fn all_gather(&self, input: Buffer) -> Work<Buffer>;
    /// [`Communicator::all_gather`] written into `output` (resized to fit where the backend
    /// can); returns both buffers for reuse.
    fn all_gather_into(&self, input: Buffer, output: Buffer) -> Work<(Buffer, Buffer)>;
    /// [`Communicator::all_gather`] into `output` (`size` × k elements) whose block
    /// `rank` (`rank*k..(rank+1)*k`) already holds this member's input: the other blocks are
    /// written, this member's is not copied (PyTorch's `all_gather_into_tensor` with the input
    /// a view of the output). Members may mix it with [`Communicator::all_gather`]. This
    /// default copies the block out and gathers it; backends that can skip the copy override
    /// it.
    fn all_gather_in_place(&self, output: Buffer) -> Work<Buffer> {
        let (size, rank) = (self.size(), self.rank());
        if !output.len().is_multiple_of(size) {
            return Work::ready(Err(in_place_length(self.global_rank(), output.len(), size)));
        }
        let k = output.len() / size;
        match output.copy_range(rank * k..(rank + 1) * k) {
            Some(input) => self.all_gather_into(input, output).map(|(_, out)| Ok(out)),
            None => Work::ready(Err(CommError::InvalidArgument {
                rank: self.global_rank(),
                op: "all_gather_in_place".into(),
                reason: format!(
                    "{} groups gather device memory only out of place",
                    self.backend()
                ),
            })),
        }
    }
    /// Reduces `input` (`size` × k elements) across members; member r gets elements
    /// `r*k..(r+1)*k`. The input is freed as soon as the collective is done with it.
    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Work<Buffer>;
    /// Reduces `input` (`size` × k elements) across members; member r gets elements
    /// `r*k..(r+1)*k` in `output`. `input` may be used as scratch; both come back.
    fn reduce_scatter_into(
        &self,
        input: Buffer,
        output: Buffer,
        op: ReduceOp,
    ) -> Work<(Buffer, Buffer)>;
    /// Element-wise reduction across members; every member gets the result.
    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer>;
    /// Every member's `input` (`size` × k elements) cut into `size` parts: member r gets part
    /// r of every member, in rank order — a reduce-scatter's traffic without the reduction,
    /// for reductions the caller performs itself (quantized gradients summed in f32).
    fn all_to_all(&self, input: Buffer) -> Work<Buffer>;
    /// `root`'s buffer on every member (every member passes a buffer of the same length).
    fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer>;
    /// Every member's `input` (same length) concatenated on `root`; `None` elsewhere.
    fn gather(&self, input: Buffer, root: usize) -> Work<Option<Buffer>>;
    /// `root`'s `input` (`size` × k elements) split in rank order: member r gets elements
    /// `r*k..(r+1)*k`. Elsewhere `input` only gives the element type. Only each member's
    /// part crosses the wire to it. This default reduce-scatters root's input against zeros
    /// (every member holds `size` × k elements meanwhile); backends with a scatter override
    /// it.
    fn scatter(&self, input: Buffer, k: usize, root: usize) -> Work<Buffer> {
        let input = if self.rank() == root {
            input
        } else {
            Buffer::zeros(input.dtype(), k * self.size())
        };
        self.reduce_scatter(input, ReduceOp::Sum)
    }
    /// Completes when every member has reached it.
    fn barrier(&self) -> Work<()>;
    /// Returns when every member has called `join` with the same `what`, or fails within
    /// `timeout` naming the members that did not: the entry of a collective step that a
    /// program might call on some ranks only (saving a checkpoint), which must fail fast
    /// instead of waiting out the collective timeout.
    fn join(&self, what: &str, timeout: Duration) -> Result<()>;
    /// Payload bytes this member has sent so far (to compare with an algorithm's theory).
    fn bytes_sent(&self) -> u64;
    /// Completes once every collective this member issued on the group before it has run
    /// (it moves nothing): what work done outside the group's queue waits for to keep the
    /// queue's order (a gather read from [`crate::SharedBlocks`] after the reductions issued
    /// before it). The default, for backends without such a queue, is complete at once.
    fn fence(&self) -> Work<()> {
        Work::ready(Ok(()))
    }
    /// One block of `block_bytes` per member in `slots` slots, in memory every member maps
    /// ([`crate::SharedBlocks`]: collectives that copy each byte once). Every member calls it,
    /// in the same order as its other `shared_blocks` calls, with the same arguments. `None`
    /// where the members share no memory (TCP, MPI, NCCL, threads as ranks): the default.
    fn shared_blocks(&self, block_bytes: usize, slots: usize) -> Result<Option<SharedBlocks>> {
        let _ = (block_bytes, slots);
        Ok(None)
    }
    /// Cuts the group into a 2-D mesh (hybrid sharding): groups of `shard_size`
    /// consecutive ranks (this member's comes first) and the groups of the members at the
    /// same place in each (second). Every member calls it. The default refuses.
    fn split_2d(
        &self,
        shard_size: usize,
    ) -> Result<(Arc<dyn Communicator>, Arc<dyn Communicator>)> {
        Err(CommError::InvalidArgument {
            rank: self.global_rank(),
            op: format!("split_2d({shard_size})"),
            reason: format!(
                "a {} group cannot be divided into sub-groups",
                self.backend()
            ),
        })
    }
}

/// The error of an in-place all-gather whose output does not split into one block per member.
pub(crate) fn in_place_length(rank: usize, len: usize, size: usize) -> CommError {
    CommError::InvalidArgument {
        rank,
        op: "all_gather_in_place".into(),
        reason: format!("an output of {len} elements does not split into {size} equal blocks"),
    }
}

/// Checks that `shard_size` divides a group of `size` (for [`Communicator::split_2d`]).
pub(crate) fn check_split(rank: usize, size: usize, shard_size: usize) -> Result<()> {
    if shard_size == 0 || !size.is_multiple_of(shard_size) {
        return Err(CommError::InvalidArgument {
            rank,
            op: format!("split_2d({shard_size})"),
            reason: format!("shard size {shard_size} does not divide the group's {size} members"),
        });
    }
    Ok(())
}

/// Typed conveniences over any [`Communicator`]: vectors in, vectors out.
pub trait CommunicatorExt: Communicator {
    /// [`Communicator::all_reduce`] of a vector.
    fn all_reduce_vec<T: BufferElement>(&self, v: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let rank = self.global_rank();
        self.all_reduce(T::into_buffer(v), op)
            .map(move |b| typed(b, rank, "all_reduce"))
    }

    /// [`Communicator::all_gather_into`] of a vector into a fresh one.
    fn all_gather_vec<T: BufferElement>(&self, v: Vec<T>) -> Work<Vec<T>> {
        let rank = self.global_rank();
        self.all_gather(T::into_buffer(v))
            .map(move |b| typed(b, rank, "all_gather"))
    }

    /// [`Communicator::broadcast`] of a vector.
    fn broadcast_vec<T: BufferElement>(&self, v: Vec<T>, root: usize) -> Work<Vec<T>> {
        let rank = self.global_rank();
        self.broadcast(T::into_buffer(v), root)
            .map(move |b| typed(b, rank, "broadcast"))
    }

    /// [`Communicator::gather`] of a vector.
    fn gather_vec<T: BufferElement>(&self, v: Vec<T>, root: usize) -> Work<Option<Vec<T>>> {
        let rank = self.global_rank();
        self.gather(T::into_buffer(v), root)
            .map(move |b| b.map(|b| typed(b, rank, "gather")).transpose())
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

fn typed<T: BufferElement>(b: Buffer, rank: usize, op: &str) -> Result<Vec<T>> {
    b.into_vec::<T>().map_err(|b| CommError::InvalidArgument {
        rank,
        op: op.into(),
        reason: format!(
            "the result holds {:?} elements, not {:?}",
            b.dtype(),
            T::DTYPE
        ),
    })
}

/// A group of one: every collective returns its input at once. NO_SHARD's shard dimension,
/// and a job of one process.
#[derive(Debug, Clone)]
pub struct SingleRank {
    global_rank: usize,
}

impl SingleRank {
    /// The group of this process alone (`global_rank` for messages).
    pub fn new(global_rank: usize) -> SingleRank {
        SingleRank { global_rank }
    }

    fn check_root(&self, op: &str, root: usize) -> Result<()> {
        if root == 0 {
            Ok(())
        } else {
            Err(CommError::InvalidArgument {
                rank: self.global_rank,
                op: op.into(),
                reason: format!("root {root} is not a rank of this group of 1"),
            })
        }
    }
}

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn global_rank(&self) -> usize {
        self.global_rank
    }

    fn backend(&self) -> &'static str {
        "single"
    }

    fn all_gather(&self, input: Buffer) -> Work<Buffer> {
        Work::ready(Ok(input))
    }

    fn all_gather_into(&self, input: Buffer, _output: Buffer) -> Work<(Buffer, Buffer)> {
        let out = input.clone();
        Work::ready(Ok((input, out)))
    }

    fn reduce_scatter(&self, input: Buffer, _op: ReduceOp) -> Work<Buffer> {
        Work::ready(Ok(input))
    }

    fn reduce_scatter_into(
        &self,
        input: Buffer,
        _output: Buffer,
        _op: ReduceOp,
    ) -> Work<(Buffer, Buffer)> {
        let out = input.clone();
        Work::ready(Ok((input, out)))
    }

    fn all_reduce(&self, buf: Buffer, _op: ReduceOp) -> Work<Buffer> {
        Work::ready(Ok(buf))
    }

    fn all_to_all(&self, input: Buffer) -> Work<Buffer> {
        Work::ready(Ok(input))
    }

    fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
        Work::ready(self.check_root("broadcast", root).map(|()| buf))
    }

    fn gather(&self, input: Buffer, root: usize) -> Work<Option<Buffer>> {
        Work::ready(self.check_root("gather", root).map(|()| Some(input)))
    }

    fn scatter(&self, input: Buffer, _k: usize, root: usize) -> Work<Buffer> {
        Work::ready(self.check_root("scatter", root).map(|()| input))
    }

    fn barrier(&self) -> Work<()> {
        Work::ready(Ok(()))
    }

    fn join(&self, _what: &str, _timeout: Duration) -> Result<()> {
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        0
    }

    fn split_2d(
        &self,
        shard_size: usize,
    ) -> Result<(Arc<dyn Communicator>, Arc<dyn Communicator>)> {
        check_split(self.global_rank, 1, shard_size)?;
        Ok((Arc::new(self.clone()), Arc::new(self.clone())))
    }
}
