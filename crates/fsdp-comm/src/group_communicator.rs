//! [`Communicator`] for [`ProcessGroup`]: typed buffers in, the group's generic collectives
//! underneath. A device buffer is an argument error that stops the group on every rank, like
//! any other bad argument.

use std::sync::Arc;

use crate::buffer::{Buffer, BufferElement};
use crate::communicator::Communicator;
use crate::dtype::ReduceOp;
use crate::error::Result;
use crate::group::ProcessGroup;
#[cfg(feature = "nccl")]
use crate::protocol::Engine;
use crate::work::Work;

/// Calls `$call(engine, vec)` on the vector inside host buffer `$buf` (a device buffer is
/// refused on the communication thread, so every rank learns of it); `$wrap` turns the typed
/// result back into buffers.
macro_rules! on_host {
    ($self:expr, $op:expr, $buf:expr, |$e:ident, $v:ident| $call:expr, $wrap:expr) => {
        match $buf {
            Buffer::F32($v) => $self.submit(move |$e| $call.map($wrap)),
            Buffer::F64($v) => $self.submit(move |$e| $call.map($wrap)),
            Buffer::F16($v) => $self.submit(move |$e| $call.map($wrap)),
            Buffer::BF16($v) => $self.submit(move |$e| $call.map($wrap)),
            Buffer::I32($v) => $self.submit(move |$e| $call.map($wrap)),
            Buffer::I64($v) => $self.submit(move |$e| $call.map($wrap)),
            Buffer::U8($v) => $self.submit(move |$e| $call.map($wrap)),
            #[cfg(feature = "nccl")]
            Buffer::Cuda(_) => $self.submit(move |e: &mut Engine| -> Result<_> {
                Err(e.invalid(
                    $op,
                    "a CUDA buffer was passed to a host process group; use an NCCL group".into(),
                ))
            }),
        }
    };
}

/// The caller's output buffer as a vector of `T` (reused when it holds `T`).
fn reuse<T: BufferElement>(output: Buffer) -> Vec<T> {
    output.into_vec::<T>().unwrap_or_default()
}

fn pair<T: BufferElement>((a, b): (Vec<T>, Vec<T>)) -> (Buffer, Buffer) {
    (T::into_buffer(a), T::into_buffer(b))
}

impl Communicator for ProcessGroup {
    fn rank(&self) -> usize {
        ProcessGroup::rank(self)
    }

    fn size(&self) -> usize {
        ProcessGroup::size(self)
    }

    fn global_rank(&self) -> usize {
        ProcessGroup::global_rank(self)
    }

    fn backend(&self) -> &'static str {
        self.transport()
    }

    fn all_gather(&self, input: Buffer) -> Work<Buffer> {
        on_host!(
            self,
            "all_gather",
            input,
            |e, v| e.all_gather(v),
            Buffer::from
        )
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Work<Buffer> {
        on_host!(
            self,
            "reduce_scatter",
            input,
            |e, v| e.reduce_scatter(v, op),
            Buffer::from
        )
    }

    fn all_gather_into(&self, input: Buffer, output: Buffer) -> Work<(Buffer, Buffer)> {
        on_host!(
            self,
            "all_gather",
            input,
            |e, v| e.all_gather_into(v, reuse(output)),
            pair
        )
    }

    fn all_gather_in_place(&self, output: Buffer) -> Work<Buffer> {
        on_host!(
            self,
            "all_gather_in_place",
            output,
            |e, v| e.all_gather_in_place(v),
            Buffer::from
        )
    }

    fn reduce_scatter_into(
        &self,
        input: Buffer,
        output: Buffer,
        op: ReduceOp,
    ) -> Work<(Buffer, Buffer)> {
        on_host!(
            self,
            "reduce_scatter",
            input,
            |e, v| e.reduce_scatter_into(v, reuse(output), op),
            pair
        )
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        on_host!(
            self,
            "all_reduce",
            buf,
            |e, v| e.all_reduce(v, op),
            Buffer::from
        )
    }

    fn all_to_all(&self, input: Buffer) -> Work<Buffer> {
        on_host!(
            self,
            "all_to_all",
            input,
            |e, v| e.all_to_all(v),
            Buffer::from
        )
    }

    fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
        on_host!(
            self,
            "broadcast",
            buf,
            |e, v| e.broadcast(v, root),
            Buffer::from
        )
    }

    fn gather(&self, input: Buffer, root: usize) -> Work<Option<Buffer>> {
        on_host!(
            self,
            "gather",
            input,
            |e, v| e.gather(v, root),
            |o: Option<Vec<_>>| o.map(Buffer::from)
        )
    }

    fn scatter(&self, input: Buffer, k: usize, root: usize) -> Work<Buffer> {
        on_host!(
            self,
            "scatter",
            input,
            |e, v| e.scatter(v, k, root),
            Buffer::from
        )
    }

    fn barrier(&self) -> Work<()> {
        ProcessGroup::barrier(self)
    }

    fn join(&self, what: &str, timeout: std::time::Duration) -> crate::error::Result<()> {
        ProcessGroup::join(self, what, timeout)
    }

    fn bytes_sent(&self) -> u64 {
        ProcessGroup::bytes_sent(self)
    }

    fn fence(&self) -> Work<()> {
        self.submit(|_| Ok(()))
    }

    fn shared_blocks(
        &self,
        block_bytes: usize,
        slots: usize,
    ) -> Result<Option<crate::SharedBlocks>> {
        ProcessGroup::shared_blocks(self, block_bytes, slots)
    }

    fn split_2d(
        &self,
        shard_size: usize,
    ) -> Result<(Arc<dyn Communicator>, Arc<dyn Communicator>)> {
        let (shard, replicate) = self.mesh_2d(shard_size)?;
        Ok((Arc::new(shard), Arc::new(replicate)))
    }
}
