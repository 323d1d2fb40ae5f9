//! [`MpiGroup`] (feature `mpi`): a [`Communicator`] on MPI, the engine clusters tune for
//! their interconnect (InfiniBand, RoCE, EFA, Slingshot), for jobs that `mpirun` or
//! `srun --mpi=pmix` starts. Collectives are MPI's non-blocking ones (`MPI_Iallgather`,
//! `MPI_Ireduce_scatter_block`, `MPI_Iallreduce`, `MPI_Ialltoall`, `MPI_Ibcast`, `MPI_Igather`,
//! `MPI_Iscatter`, `MPI_Ibarrier`), posted and progressed by one MPI thread (`progress.rs`),
//! behind the same [`Work`] handles as every other backend; sub-groups and the hybrid mesh
//! come from `MPI_Comm_split`. f16 and bf16 reduce through user operations (`types.rs`).
//!
//! What MPI can and cannot report: an MPI error inside a call comes back as an error naming
//! this rank, the op and MPI's text (errors return, they do not abort); a member that dies
//! is MPI's launcher's to report (Open MPI's `mpirun` ends the job, naming the rank); a
//! member that is stuck or never calls the collective is not reported by MPI at all — the
//! collective timeout (`FSDP_COMM_TIMEOUT_SECS`) ends such a call with an error naming it.

mod progress;
mod types;

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use progress::{Call, Command, Finished, Kind};

use crate::buffer::Buffer;
use crate::communicator::{Communicator, check_split};
use crate::dtype::{DType, ReduceOp, finish_avg};
use crate::error::{CommError, Result};
use crate::options::GroupOptions;
use crate::with_host_vec;
use crate::work::Work;
use crate::world::started_under_mpi;

/// Set once MPI was started in this process (MPI can be initialized once per process).
static STARTED: AtomicBool = AtomicBool::new(false);

/// Set once this process finalized MPI (its last MPI group went).
static FINALIZED: AtomicBool = AtomicBool::new(false);

/// Whether this process started MPI and has finalized it since: every MPI group it made has
/// gone, and MPI's runtime was told the process is done. A program that must not exit with
/// MPI still open (Open MPI's `mpirun` fails a job whose process did) can check it last.
pub fn finalized() -> bool {
    FINALIZED.load(Ordering::SeqCst)
}

/// Bytes of a join record: a length and up to 256 bytes of the join's name.
const RECORD: usize = 4 + 256;

/// The MPI thread, shared by the world group and every sub-group split from it.
struct Runtime {
    commands: Mutex<Option<mpsc::Sender<Command>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Runtime {
    fn send(&self, command: Command) -> bool {
        let guard = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().is_some_and(|tx| tx.send(command).is_ok())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // No group is left: the thread finishes the calls in flight, finalizes MPI and ends.
        self.commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A group of MPI processes: the world of an `mpirun` / `srun` job, or a sub-group of it.
pub struct MpiGroup {
    runtime: Arc<Runtime>,
    /// The communicator's index on the MPI thread (0: the world's duplicate).
    comm: usize,
    rank: usize,
    size: usize,
    /// World ranks of the members, by group rank.
    global_ranks: Vec<usize>,
    timeout: Duration,
    calls: AtomicU64,
    joins: AtomicU64,
    bytes_sent: AtomicU64,
}

impl MpiGroup {
    /// Starts MPI (`MPI_THREAD_FUNNELED` on a thread of its own) and returns the world's
    /// group. Fails with a clear error when this process was not started under MPI, or when
    /// MPI was started already (once per process: keep the group and split it).
    pub fn world(options: &GroupOptions) -> Result<MpiGroup> {
        let refuse = |reason: &str| CommError::InvalidArgument {
            rank: 0,
            op: "starting MPI".into(),
            reason: reason.into(),
        };
        if !started_under_mpi() {
            return Err(refuse(
                "this process was not started under MPI (no OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK): start it with `mpirun -n N` or `srun --mpi=pmix -n N`",
            ));
        }
        if STARTED.swap(true, Ordering::SeqCst) {
            return Err(refuse(
                "MPI was started already in this process (once per process: keep the first world group and split it)",
            ));
        }
        let (tx, rx) = mpsc::channel();
        let (started_tx, started_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fsdp-mpi".into())
            .spawn(move || progress::run(rx, started_tx))
            .map_err(|e| CommError::Io {
                rank: 0,
                what: "starting the MPI thread".into(),
                message: e.to_string(),
            })?;
        let started = started_rx.recv();
        let runtime = Arc::new(Runtime {
            commands: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        });
        let started = started.unwrap_or(Err(CommError::Closed { rank: 0 }))?;
        Ok(MpiGroup {
            runtime,
            comm: 0,
            rank: started.rank,
            size: started.size,
            global_ranks: (0..started.size).collect(),
            timeout: options.timeout,
            calls: AtomicU64::new(0),
            joins: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
        })
    }

    fn invalid<T: Send + 'static>(&self, op: &str, reason: String) -> Work<T> {
        Work::ready(Err(CommError::InvalidArgument {
            rank: self.global_rank(),
            op: op.into(),
            reason,
        }))
    }

    /// Sends a call to the MPI thread; `payload` is what a bandwidth-optimal algorithm
    /// sends from this member for it (the count [`Communicator::bytes_sent`] reports).
    fn call(
        &self,
        kind: Kind,
        name: &str,
        bufs: Vec<Buffer>,
        deadline: Duration,
        payload: usize,
    ) -> Work<Finished> {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        let what = match bufs.first() {
            Some(b) => format!("{name} #{n} ({:?} × {})", b.dtype(), b.len()),
            None => format!("{name} #{n}"),
        };
        self.bytes_sent.fetch_add(payload as u64, Ordering::Relaxed);
        let (reply, rx) = mpsc::channel();
        let call = Call {
            what,
            kind,
            bufs,
            deadline,
            reply,
        };
        if !self.runtime.send(Command::Call {
            comm: self.comm,
            call,
        }) {
            return Work::ready(Err(CommError::Closed {
                rank: self.global_rank(),
            }));
        }
        Work::from_channel(rx, self.global_rank())
    }

    /// Rank `r` of this group, `None` (the op's error) when out of range.
    fn check_root<T: Send + 'static>(&self, op: &str, root: usize) -> Option<Work<T>> {
        (root >= self.size).then(|| {
            self.invalid(
                op,
                format!("root {root} is not a rank of this group of {}", self.size),
            )
        })
    }

    fn split(&self, color: usize, members: Vec<usize>) -> Result<MpiGroup> {
        let (reply, rx) = mpsc::channel();
        let color = c_int::try_from(color).unwrap_or(c_int::MAX);
        let sent = self.runtime.send(Command::Split {
            comm: self.comm,
            color,
            key: c_int::try_from(self.rank).unwrap_or(c_int::MAX),
            reply,
        });
        let closed = CommError::Closed {
            rank: self.global_rank(),
        };
        if !sent {
            return Err(closed);
        }
        let comm = rx.recv().unwrap_or(Err(closed))?;
        let rank = members.iter().position(|&m| m == self.rank).unwrap_or(0);
        Ok(MpiGroup {
            runtime: self.runtime.clone(),
            comm,
            rank,
            size: members.len(),
            global_ranks: members.iter().map(|&m| self.global_ranks[m]).collect(),
            timeout: self.timeout,
            calls: AtomicU64::new(0),
            joins: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
        })
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        if self.comm != 0 {
            self.runtime.send(Command::Free { comm: self.comm });
        }
    }
}

/// `output` holding `len` elements of `dtype` (reused when it has that type).
fn fit(output: Buffer, dtype: DType, len: usize) -> Buffer {
    if output.dtype() == dtype && output.is_host() {
        let mut output = output;
        with_host_vec!(&mut output, v => v.resize(len, Default::default()), cuda => ());
        output
    } else {
        Buffer::zeros(dtype, len)
    }
}

/// The two buffers a call returns.
fn two(rank: usize, op: &'static str) -> impl FnOnce(Finished) -> Result<(Buffer, Buffer)> {
    move |f| {
        let mut bufs = f.bufs.into_iter();
        match (bufs.next(), bufs.next()) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(CommError::InvalidArgument {
                rank,
                op: op.into(),
                reason: "the MPI thread returned too few buffers (a bug in fsdp-comm)".into(),
            }),
        }
    }
}

fn avg(mut buf: Buffer, op: ReduceOp, n: usize) -> Buffer {
    with_host_vec!(&mut buf, v => finish_avg(v, op, n), cuda => ());
    buf
}

impl Communicator for MpiGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn global_rank(&self) -> usize {
        self.global_ranks[self.rank]
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_gather(&self, input: Buffer) -> Work<Buffer> {
        let dtype = input.dtype();
        self.all_gather_into(input, Buffer::empty(dtype))
            .map(|(_, out)| Ok(out))
    }

    fn all_gather_into(&self, input: Buffer, output: Buffer) -> Work<(Buffer, Buffer)> {
        let (k, dtype) = (input.len(), input.dtype());
        let output = fit(output, dtype, k * self.size);
        let payload = (self.size - 1) * k * dtype.size();
        self.call(
            Kind::AllGather,
            "all_gather",
            vec![input, output],
            self.timeout,
            payload,
        )
        .map(two(self.global_rank(), "all_gather"))
    }

    fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Work<Buffer> {
        let dtype = input.dtype();
        self.reduce_scatter_into(input, Buffer::empty(dtype), op)
            .map(|(_, out)| Ok(out))
    }

    fn reduce_scatter_into(
        &self,
        input: Buffer,
        output: Buffer,
        op: ReduceOp,
    ) -> Work<(Buffer, Buffer)> {
        let (len, dtype, n) = (input.len(), input.dtype(), self.size);
        if !len.is_multiple_of(n) {
            return self.invalid(
                "reduce_scatter",
                format!("{len} elements do not split into {n} equal parts"),
            );
        }
        let output = fit(output, dtype, len / n);
        let payload = (n - 1) * (len / n) * dtype.size();
        self.call(
            Kind::ReduceScatter(op),
            "reduce_scatter",
            vec![input, output],
            self.timeout,
            payload,
        )
        .map(two(self.global_rank(), "reduce_scatter"))
        .map(move |(input, out)| Ok((input, avg(out, op, n))))
    }

    fn all_to_all(&self, input: Buffer) -> Work<Buffer> {
        let (len, dtype, n) = (input.len(), input.dtype(), self.size);
        if !len.is_multiple_of(n) {
            return self.invalid(
                "all_to_all",
                format!("{len} elements do not split into {n} equal parts"),
            );
        }
        let output = Buffer::zeros(dtype, len);
        let payload = (n - 1) * (len / n) * dtype.size();
        self.call(
            Kind::AllToAll(n),
            "all_to_all",
            vec![input, output],
            self.timeout,
            payload,
        )
        .map(two(self.global_rank(), "all_to_all"))
        .map(|(_, out)| Ok(out))
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        let (len, dtype, n) = (buf.len(), buf.dtype(), self.size);
        let output = Buffer::zeros(dtype, len);
        let payload = 2 * (n - 1) * len / n * dtype.size();
        self.call(
            Kind::AllReduce(op),
            "all_reduce",
            vec![buf, output],
            self.timeout,
            payload,
        )
        .map(two(self.global_rank(), "all_reduce"))
        .map(move |(_, out)| Ok(avg(out, op, n)))
    }

    fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
        if let Some(e) = self.check_root("broadcast", root) {
            return e;
        }
        let payload = if self.rank == root {
            buf.len() * buf.dtype().size()
        } else {
            0
        };
        let rank = self.global_rank();
        self.call(
            Kind::Broadcast(root),
            "broadcast",
            vec![buf],
            self.timeout,
            payload,
        )
        .map(move |f| {
            f.bufs.into_iter().next().ok_or(CommError::InvalidArgument {
                rank,
                op: "broadcast".into(),
                reason: "the MPI thread returned no buffer (a bug in fsdp-comm)".into(),
            })
        })
    }

    fn gather(&self, input: Buffer, root: usize) -> Work<Option<Buffer>> {
        if let Some(e) = self.check_root("gather", root) {
            return e;
        }
        let (k, dtype) = (input.len(), input.dtype());
        let is_root = self.rank == root;
        let output = Buffer::zeros(dtype, if is_root { k * self.size } else { 0 });
        let payload = if is_root { 0 } else { k * dtype.size() };
        self.call(
            Kind::Gather(root),
            "gather",
            vec![input, output],
            self.timeout,
            payload,
        )
        .map(two(self.global_rank(), "gather"))
        .map(move |(_, out)| Ok(is_root.then_some(out)))
    }

    fn scatter(&self, input: Buffer, k: usize, root: usize) -> Work<Buffer> {
        if let Some(e) = self.check_root("scatter", root) {
            return e;
        }
        let dtype = input.dtype();
        let is_root = self.rank == root;
        if is_root && input.len() != k * self.size {
            return self.invalid(
                "scatter",
                format!(
                    "the root's input holds {} elements, not {k} × {}",
                    input.len(),
                    self.size
                ),
            );
        }
        let input = if is_root { input } else { Buffer::empty(dtype) };
        let payload = if is_root {
            (self.size - 1) * k * dtype.size()
        } else {
            0
        };
        self.call(
            Kind::Scatter(root),
            "scatter",
            vec![input, Buffer::zeros(dtype, k)],
            self.timeout,
            payload,
        )
        .map(two(self.global_rank(), "scatter"))
        .map(|(_, out)| Ok(out))
    }

    fn barrier(&self) -> Work<()> {
        self.call(Kind::Barrier, "barrier", Vec::new(), self.timeout, 0)
            .map(|_| Ok(()))
    }

    fn join(&self, what: &str, timeout: Duration) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        let name = &what.as_bytes()[..what.len().min(RECORD - 4)];
        let mut mine = (name.len() as u32).to_le_bytes().to_vec();
        mine.extend_from_slice(name);
        mine.resize(RECORD, 0);
        let mut bufs = vec![Buffer::U8(mine.clone())];
        bufs.extend((0..self.size).map(|_| Buffer::U8(vec![0; RECORD])));
        let n = self.joins.fetch_add(1, Ordering::Relaxed);
        let tag = c_int::try_from(n % 30_000 + 1).unwrap_or(1);
        let finished = self
            .call(
                Kind::Join { tag },
                &format!("join({what})"),
                bufs,
                timeout,
                0,
            )
            .wait()?;
        let rank = self.global_rank();
        if !finished.missing.is_empty() {
            return Err(CommError::NotJoined {
                rank,
                what: what.into(),
                missing: finished
                    .missing
                    .iter()
                    .map(|&m| self.global_ranks[m])
                    .collect(),
                timeout,
            });
        }
        for (r, record) in finished.bufs.iter().skip(1).enumerate() {
            let theirs = record.as_slice::<u8>().unwrap_or_default();
            if r == self.rank || theirs == mine.as_slice() {
                continue;
            }
            let len = theirs
                .get(..4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
                .unwrap_or(0)
                .min(RECORD - 4);
            return Err(CommError::Mismatch {
                rank,
                peer: self.global_ranks[r],
                mine: format!("join({what})"),
                theirs: format!("join({})", String::from_utf8_lossy(&theirs[4..4 + len])),
            });
        }
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn split_2d(
        &self,
        shard_size: usize,
    ) -> Result<(Arc<dyn Communicator>, Arc<dyn Communicator>)> {
        check_split(self.global_rank(), self.size, shard_size)?;
        let (replica, place) = (self.rank / shard_size, self.rank % shard_size);
        let shard = self.split(
            replica,
            (0..shard_size).map(|s| replica * shard_size + s).collect(),
        )?;
        let replicate = self.split(
            place,
            (0..self.size / shard_size)
                .map(|r| r * shard_size + place)
                .collect(),
        )?;
        Ok((Arc::new(shard), Arc::new(replicate)))
    }
}
