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

use crate::dtype::ReduceOp;
use crate::error::{CommError, Result};
use crate::group::ProcessGroup;

/// A communicator over the ranks of a host group, one CUDA device per rank.
pub struct NcclGroup {
    comm: Comm,
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
                    "the CUDA driver or NCCL library could not be loaded".into(),
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
            comm,
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
            self.comm.all_reduce_in_place(buf, &nccl_op(op)),
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
        self.nccl("all_gather", self.comm.all_gather(input, output))
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
            self.comm.reduce_scatter(input, output, &nccl_op(op)),
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
        self.nccl("broadcast", self.comm.broadcast_in_place(buf, root as i32))
    }

    /// Sends `buf` to rank `dst`.
    pub fn send<T: NcclType + DeviceRepr>(&self, buf: &CudaSlice<T>, dst: usize) -> Result<()> {
        self.check("send", dst < self.size && dst != self.rank, || {
            format!("peer {dst} must be another rank below {}", self.size)
        })?;
        self.nccl("send", self.comm.send(buf, dst as i32))
    }

    /// Receives into `buf` from rank `src`.
    pub fn recv<T: NcclType + DeviceRepr>(&self, buf: &mut CudaSlice<T>, src: usize) -> Result<()> {
        self.check("recv", src < self.size && src != self.rank, || {
            format!("peer {src} must be another rank below {}", self.size)
        })?;
        self.nccl("recv", self.comm.recv(buf, src as i32))
    }
}
