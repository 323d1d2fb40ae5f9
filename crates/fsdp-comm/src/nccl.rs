//! NCCL process groups for buffers in CUDA memory (feature `nccl`). The communicator is built
//! from a host [`ProcessGroup`]: rank 0 creates NCCL's unique id and the host group broadcasts
//! it, so NCCL needs no rendezvous of its own. Operations are queued on the group's CUDA
//! stream and complete asynchronously with respect to the host, like every CUDA operation on
//! that stream (synchronise the stream, or order later work on it, before reading results).

use std::sync::Arc;

/// The CUDA bindings the NCCL group is built on (for creating contexts, streams and buffers).
pub use cudarc;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp as NcclOp};

pub use crate::cuda_buffer::{CudaBuffer, CudaElement};
use crate::dtype::ReduceOp;
use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use crate::work::Work;

/// An NCCL communicator that any thread may use, one call at a time.
struct SerialComm(std::sync::Mutex<Comm>);

// SAFETY: an `ncclComm_t` is not tied to the thread that created it; NCCL only forbids
// concurrent calls on one communicator, which the mutex rules out.
unsafe impl Send for SerialComm {}
// SAFETY: as above; every use goes through the mutex.
unsafe impl Sync for SerialComm {}

impl SerialComm {
    fn get(&self) -> std::sync::MutexGuard<'_, Comm> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A communicator over the ranks of a host group, one CUDA device per rank.
pub struct NcclGroup {
    comm: SerialComm,
    rank: usize,
    size: usize,
    global_rank: usize,
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Avg => NcclOp::Avg,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

impl NcclGroup {
    /// Creates the communicator for `pg`'s ranks on `stream`'s device. Every rank of `pg`
    /// must call it.
    pub fn new(pg: &ProcessGroup, stream: Arc<CudaStream>) -> Result<NcclGroup> {
        let global_rank = pg.global_ranks()[pg.rank()];
        let err = |what: &str, e: String| CommError::Io {
            rank: global_rank,
            what: format!("NCCL {what}"),
            message: e,
        };
        // cudarc panics when it cannot load libnccl / libcuda: turn that into an error.
        let loaded = |what: &str, f: &mut dyn FnMut() -> Result<()>| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
                Err(err(
                    what,
                    "the CUDA driver (libcuda.so.1) or NCCL (libnccl.so) could not be loaded: \
                     NCCL is loaded by the name libnccl.so, which its development package \
                     provides; where only libnccl.so.2 is installed (pip's nvidia-nccl-cu*, \
                     Debian's libnccl2), link it as libnccl.so in a directory on \
                     LD_LIBRARY_PATH (`fsdp env` shows what it finds)"
                        .into(),
                ))
            })
        };
        let id_bytes: Vec<u8> = if pg.rank() == 0 {
            let mut bytes = Vec::new();
            loaded("unique id", &mut || {
                let id = Id::new().map_err(|e| err("unique id", format!("{e:?}")))?;
                bytes = id.internal().iter().map(|c| *c as u8).collect();
                Ok(())
            })?;
            bytes
        } else {
            vec![0u8; 128]
        };
        let id_bytes = pg.broadcast(id_bytes, 0).wait()?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (dst, src) in internal.iter_mut().zip(&id_bytes) {
            *dst = *src as std::ffi::c_char;
        }
        let mut comm = None;
        let mut stream = Some(stream);
        loaded("communicator initialisation", &mut || {
            let s = stream
                .take()
                .ok_or_else(|| err("communicator initialisation", "retried".into()))?;
            comm = Some(
                Comm::from_rank(s, pg.rank(), pg.size(), Id::uninit(internal))
                    .map_err(|e| err("communicator initialisation", format!("{e:?}")))?,
            );
            Ok(())
        })?;
        let comm =
            comm.ok_or_else(|| err("communicator initialisation", "no communicator".into()))?;
        Ok(NcclGroup {
            comm: SerialComm(std::sync::Mutex::new(comm)),
            rank: pg.rank(),
            size: pg.size(),
            global_rank,
        })
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    fn check(&self, op: &str, ok: bool, reason: impl FnOnce() -> String) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(CommError::InvalidArgument {
                rank: self.global_rank,
                op: op.into(),
                reason: reason(),
            })
        }
    }

    fn nccl<R, E: std::fmt::Debug>(&self, op: &str, r: std::result::Result<R, E>) -> Result<()> {
        r.map(|_| ()).map_err(|e| CommError::Io {
            rank: self.global_rank,
            what: format!("NCCL {op}"),
            message: format!("{e:?}"),
        })
    }

    /// In-place element-wise reduction across ranks.
    pub fn all_reduce<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.nccl(
            "all_reduce",
            self.comm.get().all_reduce_in_place(buf, &nccl_op(op)),
        )
    }

    /// Every rank's `input` concatenated in rank order into `output` (`size` × input length).
    pub fn all_gather<T: NcclType + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<()> {
        self.check(
            "all_gather",
            output.len() == input.len() * self.size,
            || {
                format!(
                    "output has {} elements, expected {} x {} ranks",
                    output.len(),
                    input.len(),
                    self.size
                )
            },
        )?;
        self.nccl("all_gather", self.comm.get().all_gather(input, output))
    }

    /// Reduces `input` (`size` × output length) across ranks; rank r gets part r in `output`.
    pub fn reduce_scatter<T: NcclType + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check(
            "reduce_scatter",
            input.len() == output.len() * self.size,
            || {
                format!(
                    "input has {} elements, expected {} x {} ranks",
                    input.len(),
                    output.len(),
                    self.size
                )
            },
        )?;
        self.nccl(
            "reduce_scatter",
            self.comm.get().reduce_scatter(input, output, &nccl_op(op)),
        )
    }

    /// `root`'s buffer on every rank, in place.
    pub fn broadcast<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        self.check("broadcast", root < self.size, || {
            format!("root {root} is not below {}", self.size)
        })?;
        self.nccl(
            "broadcast",
            self.comm.get().broadcast_in_place(buf, root as i32),
        )
    }

    /// Sends `buf` to rank `dst`.
    pub fn send<T: NcclType + DeviceRepr>(&self, buf: &CudaSlice<T>, dst: usize) -> Result<()> {
        self.check("send", dst < self.size && dst != self.rank, || {
            format!("peer {dst} must be another rank below {}", self.size)
        })?;
        self.nccl("send", self.comm.get().send(buf, dst as i32))
    }

    /// Receives into `buf` from rank `src`.
    pub fn recv<T: NcclType + DeviceRepr>(&self, buf: &mut CudaSlice<T>, src: usize) -> Result<()> {
        self.check("recv", src < self.size && src != self.rank, || {
            format!("peer {src} must be another rank below {}", self.size)
        })?;
        self.nccl("recv", self.comm.get().recv(buf, src as i32))
    }
}

/// Calls `$self.$method::<T>(input, rest...)` for the element type of `$input` (a
/// [`CudaBuffer`]).
macro_rules! dispatch {
    ($self:ident, $input:expr, $method:ident ( $($arg:expr),* )) => {
        match $input {
            CudaBuffer::F32(i) => $self.$method::<f32>(i, $($arg),*),
            CudaBuffer::F64(i) => $self.$method::<f64>(i, $($arg),*),
            CudaBuffer::F16(i) => $self.$method::<half::f16>(i, $($arg),*),
            CudaBuffer::BF16(i) => $self.$method::<half::bf16>(i, $($arg),*),
            CudaBuffer::I32(i) => $self.$method::<i32>(i, $($arg),*),
            CudaBuffer::I64(i) => $self.$method::<i64>(i, $($arg),*),
            CudaBuffer::U8(i) => $self.$method::<u8>(i, $($arg),*),
        }
    };
}

impl NcclGroup {
    fn device_buffer(&self, op: &str, b: crate::Buffer) -> Result<CudaBuffer> {
        match b {
            crate::Buffer::Cuda(c) => Ok(c),
            host => Err(CommError::InvalidArgument {
                rank: self.global_rank,
                op: op.into(),
                reason: format!(
                    "an NCCL group moves CUDA buffers, not host memory ({:?} x {})",
                    host.dtype(),
                    host.len()
                ),
            }),
        }
    }

    /// The only reference to a device buffer, for writing.
    fn exclusive<'a, T>(
        &self,
        op: &str,
        s: &'a mut Arc<CudaSlice<T>>,
    ) -> Result<&'a mut CudaSlice<T>> {
        let rank = self.global_rank;
        Arc::get_mut(s).ok_or_else(|| CommError::InvalidArgument {
            rank,
            op: op.into(),
            reason: "the buffer is shared; pass the only reference to it".into(),
        })
    }

    /// `output` when it holds `len` elements of `T`, else a fresh zeroed buffer on the
    /// group's stream.
    fn output_of<T: CudaElement>(
        &self,
        op: &str,
        output: crate::Buffer,
        len: usize,
    ) -> Result<Arc<CudaSlice<T>>> {
        if let crate::Buffer::Cuda(o) = output
            && let Some(o) = T::unwrap(o)
            && o.len() == len
        {
            return Ok(o);
        }
        self.comm
            .get()
            .stream()
            .alloc_zeros::<T>(len)
            .map(Arc::new)
            .map_err(|e| CommError::Io {
                rank: self.global_rank,
                what: format!("NCCL {op}: allocating {len} elements"),
                message: format!("{e:?}"),
            })
    }

    fn typed_all_gather<T: CudaElement>(
        &self,
        input: Arc<CudaSlice<T>>,
        output: crate::Buffer,
    ) -> Result<(crate::Buffer, crate::Buffer)> {
        let mut out = self.output_of::<T>("all_gather", output, input.len() * self.size)?;
        self.all_gather(&input, self.exclusive("all_gather", &mut out)?)?;
        Ok((
            crate::Buffer::Cuda(T::wrap(input)),
            crate::Buffer::Cuda(T::wrap(out)),
        ))
    }

    fn typed_reduce_scatter<T: CudaElement>(
        &self,
        input: Arc<CudaSlice<T>>,
        output: crate::Buffer,
        op: ReduceOp,
    ) -> Result<(crate::Buffer, crate::Buffer)> {
        let len = input.len() / self.size.max(1);
        let mut out = self.output_of::<T>("reduce_scatter", output, len)?;
        self.reduce_scatter(&input, self.exclusive("reduce_scatter", &mut out)?, op)?;
        Ok((
            crate::Buffer::Cuda(T::wrap(input)),
            crate::Buffer::Cuda(T::wrap(out)),
        ))
    }

    fn typed_all_reduce<T: CudaElement>(
        &self,
        mut buf: Arc<CudaSlice<T>>,
        op: ReduceOp,
    ) -> Result<crate::Buffer> {
        self.all_reduce(self.exclusive("all_reduce", &mut buf)?, op)?;
        Ok(crate::Buffer::Cuda(T::wrap(buf)))
    }

    fn typed_broadcast<T: CudaElement>(
        &self,
        mut buf: Arc<CudaSlice<T>>,
        root: usize,
    ) -> Result<crate::Buffer> {
        self.broadcast(self.exclusive("broadcast", &mut buf)?, root)?;
        Ok(crate::Buffer::Cuda(T::wrap(buf)))
    }
}

impl crate::Communicator for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn global_rank(&self) -> usize {
        self.global_rank
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_gather(&self, input: crate::Buffer) -> Work<crate::Buffer> {
        self.all_gather_into(input, crate::Buffer::empty(crate::DType::U8))
            .map(|(_, out)| Ok(out))
    }

    fn reduce_scatter(&self, input: crate::Buffer, op: ReduceOp) -> Work<crate::Buffer> {
        self.reduce_scatter_into(input, crate::Buffer::empty(crate::DType::U8), op)
            .map(|(_, out)| Ok(out))
    }

    fn all_gather_into(
        &self,
        input: crate::Buffer,
        output: crate::Buffer,
    ) -> Work<(crate::Buffer, crate::Buffer)> {
        Work::ready(
            self.device_buffer("all_gather", input)
                .and_then(|i| dispatch!(self, i, typed_all_gather(output))),
        )
    }

    fn reduce_scatter_into(
        &self,
        input: crate::Buffer,
        output: crate::Buffer,
        op: ReduceOp,
    ) -> Work<(crate::Buffer, crate::Buffer)> {
        Work::ready(
            self.device_buffer("reduce_scatter", input)
                .and_then(|i| dispatch!(self, i, typed_reduce_scatter(output, op))),
        )
    }

    fn all_reduce(&self, buf: crate::Buffer, op: ReduceOp) -> Work<crate::Buffer> {
        Work::ready(
            self.device_buffer("all_reduce", buf)
                .and_then(|b| dispatch!(self, b, typed_all_reduce(op))),
        )
    }

    fn broadcast(&self, buf: crate::Buffer, root: usize) -> Work<crate::Buffer> {
        Work::ready(
            self.device_buffer("broadcast", buf)
                .and_then(|b| dispatch!(self, b, typed_broadcast(root))),
        )
    }

    /// Not offered on NCCL groups yet (NCCL builds it from grouped sends and receives): an
    /// error naming the op. Quantized reductions, its one user, run on host process groups.
    fn all_to_all(&self, _input: crate::Buffer) -> Work<crate::Buffer> {
        Work::ready(Err(CommError::InvalidArgument {
            rank: self.global_rank,
            op: "all_to_all".into(),
            reason: "NCCL groups do not offer all_to_all yet; quantized gradient reductions \
                     (fsdp_reduce_dtype: int8) run on host process groups"
                .into(),
        }))
    }

    /// NCCL has no gather: an all-gather whose result only `root` keeps.
    fn gather(&self, input: crate::Buffer, root: usize) -> Work<Option<crate::Buffer>> {
        let rank = self.rank;
        crate::Communicator::all_gather(self, input)
            .map(move |out| Ok((rank == root).then_some(out)))
    }

    fn barrier(&self) -> Work<()> {
        let stream = self.comm.get().stream();
        let mut flag = match stream.alloc_zeros::<u8>(1) {
            Ok(f) => f,
            Err(e) => {
                return Work::ready(Err(CommError::Io {
                    rank: self.global_rank,
                    what: "NCCL barrier".into(),
                    message: format!("{e:?}"),
                }));
            }
        };
        let rank = self.global_rank;
        let result = self.all_reduce(&mut flag, ReduceOp::Sum).and_then(|()| {
            stream.synchronize().map_err(|e| CommError::Io {
                rank,
                what: "NCCL barrier".into(),
                message: format!("{e:?}"),
            })
        });
        Work::ready(result)
    }

    /// NCCL has no way to name absent ranks: a barrier (the host group's `join` does).
    fn join(&self, _what: &str, _timeout: std::time::Duration) -> Result<()> {
        crate::Communicator::barrier(self).wait()
    }

    fn bytes_sent(&self) -> u64 {
        0
    }
}
