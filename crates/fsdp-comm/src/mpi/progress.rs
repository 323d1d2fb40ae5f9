//! The MPI thread: the one thread of the process that calls MPI. It initializes MPI with
//! `MPI_THREAD_FUNNELED` (only the initializing thread calls MPI; nothing more is needed, and
//! every MPI library provides it, where `MPI_THREAD_MULTIPLE` is often slower or missing),
//! starts each collective as a non-blocking MPI call the moment it is asked for, tests every
//! call in flight, and answers each [`Call`] when its requests complete — so several
//! collectives (a prefetched all-gather beside a reduce-scatter, the two dimensions of a
//! mesh) progress together, as on the other transports. A call that does not complete
//! within its deadline fails naming the op; the communicators are then unusable, and MPI is
//! not finalized (a finalize would wait for the call forever).

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mpi::ffi;

use super::FINALIZED;
use super::types::{Reductions, datatype, error_text};
use crate::buffer::Buffer;
use crate::dtype::ReduceOp;
use crate::error::{CommError, Result};
use crate::with_host_vec;

/// What a [`Call`] does with its buffers.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    /// `[input, output]`: output holds size × input's elements.
    AllGather,
    /// `[input, output]`: output holds input's elements / size.
    ReduceScatter(ReduceOp),
    /// `[input, output]` of one length (MPI's in-place marker is not portable: Open MPI and
    /// MPICH spell it differently and rsmpi does not export it).
    AllReduce(ReduceOp),
    /// `[input, output]` of one length, a multiple of the group's size (given).
    AllToAll(usize),
    /// `[buffer]` from the root.
    Broadcast(usize),
    /// `[input, output]`: output holds size × input's elements on the root, none elsewhere.
    Gather(usize),
    /// `[input, output]`: input holds size × output's elements on the root.
    Scatter(usize),
    /// No buffers.
    Barrier,
    /// `[record, one record per member]`: this member's record goes to every other member
    /// and theirs arrive; on the deadline the call still succeeds, listing in
    /// [`Finished::missing`] the members whose record never arrived.
    Join { tag: c_int },
}

/// One collective for the MPI thread.
pub(super) struct Call {
    /// The op's name for messages (`all_gather #12 (f32 × 1024)`).
    pub what: String,
    pub kind: Kind,
    pub bufs: Vec<Buffer>,
    /// How long it may take once started.
    pub deadline: Duration,
    pub reply: mpsc::Sender<Result<Finished>>,
}

/// A completed call's buffers (and, for a join, who never came).
pub(super) struct Finished {
    pub bufs: Vec<Buffer>,
    pub missing: Vec<usize>,
}

/// A request to the MPI thread; `comm` is an index into its communicators (0: the world).
pub(super) enum Command {
    Call {
        comm: usize,
        call: Call,
    },
    /// `MPI_Comm_split` of `comm`; answers the new communicator's index.
    Split {
        comm: usize,
        color: c_int,
        key: c_int,
        reply: mpsc::Sender<Result<usize>>,
    },
    /// A sub-group's handle was dropped.
    Free {
        comm: usize,
    },
}

/// What the MPI thread reports once MPI is up.
pub(super) struct Started {
    pub rank: usize,
    pub size: usize,
}

struct InFlight {
    call: Call,
    requests: Vec<ffi::MPI_Request>,
    /// For a join: the member each receive request (from index `size - 1` on) is from.
    peers: Vec<usize>,
    started: Instant,
}

/// Runs the MPI thread until every sender is gone and every call in flight has finished.
/// `started` gets the world's rank and size, or why MPI could not start.
pub(super) fn run(commands: mpsc::Receiver<Command>, started: mpsc::Sender<Result<Started>>) {
    let mut thread = match MpiThread::init() {
        Ok((thread, info)) => {
            let _ = started.send(Ok(info));
            thread
        }
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    thread.serve(commands);
    thread.finish();
}

struct MpiThread {
    rank: usize,
    /// Communicators by index; `None` once freed.
    comms: Vec<Option<ffi::MPI_Comm>>,
    reductions: Reductions,
    in_flight: Vec<InFlight>,
    /// Set by the first call that failed or timed out: later calls fail with it.
    broken: Option<String>,
}

fn check(code: c_int, rank: usize, what: impl FnOnce() -> String) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(CommError::Io {
            rank,
            what: what(),
            message: error_text(code),
        })
    }
}

impl MpiThread {
    fn init() -> Result<(MpiThread, Started)> {
        let fail = |what: &str, message: String| CommError::Io {
            rank: 0,
            what: what.into(),
            message,
        };
        // SAFETY: plain MPI calls with out-pointers to locals, on the thread that will make
        // every later MPI call of the process.
        unsafe {
            let mut initialized: c_int = 0;
            ffi::MPI_Initialized(&mut initialized);
            if initialized != 0 {
                return Err(fail(
                    "starting MPI",
                    "MPI was initialized already in this process (it can be initialized once; one MPI world group per process)".into(),
                ));
            }
            let mut provided: c_int = 0;
            let code = ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_FUNNELED,
                &mut provided,
            );
            if code != 0 {
                return Err(fail("MPI_Init_thread", error_text(code)));
            }
            if provided < ffi::RSMPI_THREAD_FUNNELED {
                ffi::MPI_Finalize();
                return Err(fail(
                    "MPI_Init_thread",
                    format!(
                        "this MPI library provides thread level {provided} only; fsdp-rs needs MPI_THREAD_FUNNELED (one thread calls MPI while others compute)"
                    ),
                ));
            }
            let world = ffi::RSMPI_COMM_WORLD;
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            ffi::MPI_Comm_rank(world, &mut rank);
            ffi::MPI_Comm_size(world, &mut size);
            let rank = usize::try_from(rank).unwrap_or(0);
            // fsdp-rs's traffic on a communicator of its own, errors returned, not fatal (on
            // the world too, where MPI reports errors it cannot tie to a communicator).
            ffi::MPI_Comm_set_errhandler(world, ffi::RSMPI_ERRORS_RETURN);
            let mut ours: ffi::MPI_Comm = std::mem::zeroed();
            check(ffi::MPI_Comm_dup(world, &mut ours), rank, || {
                "MPI_Comm_dup of MPI_COMM_WORLD".into()
            })?;
            check(
                ffi::MPI_Comm_set_errhandler(ours, ffi::RSMPI_ERRORS_RETURN),
                rank,
                || "MPI_Comm_set_errhandler".into(),
            )?;
            let reductions = Reductions::create().map_err(|code| CommError::Io {
                rank,
                what: "MPI_Op_create (16-bit float reductions)".into(),
                message: error_text(code),
            })?;
            Ok((
                MpiThread {
                    rank,
                    comms: vec![Some(ours)],
                    reductions,
                    in_flight: Vec::new(),
                    broken: None,
                },
                Started {
                    rank,
                    size: usize::try_from(size).unwrap_or(0),
                },
            ))
        }
    }

    fn serve(&mut self, commands: mpsc::Receiver<Command>) {
        let mut open = true;
        let mut last_progress = Instant::now();
        while open || !self.in_flight.is_empty() {
            let next = if !open {
                None
            } else if self.in_flight.is_empty() {
                match commands.recv() {
                    Ok(c) => Some(c),
                    Err(_) => {
                        open = false;
                        None
                    }
                }
            } else if last_progress.elapsed() < Duration::from_micros(200) {
                match commands.try_recv() {
                    Ok(c) => Some(c),
                    Err(mpsc::TryRecvError::Empty) => None,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            } else {
                // Nothing completed for a while: wait for a command a little, not spinning.
                match commands.recv_timeout(Duration::from_micros(50)) {
                    Ok(c) => Some(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        open = false;
                        None
                    }
                }
            };
            if let Some(command) = next {
                self.command(command);
                last_progress = Instant::now();
            }
            if self.progress() {
                last_progress = Instant::now();
            }
        }
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Call { comm, call } => self.start(comm, call),
            Command::Split {
                comm,
                color,
                key,
                reply,
            } => {
                let _ = reply.send(self.split(comm, color, key));
            }
            Command::Free { comm } => {
                if let Some(slot) = self.comms.get_mut(comm)
                    && let Some(mut c) = slot.take()
                {
                    // SAFETY: a communicator this thread created; none of its calls are
                    // pending (the handle that dropped it waited for them or gave up).
                    unsafe { ffi::MPI_Comm_free(&mut c) };
                }
            }
        }
    }

    fn comm(&self, index: usize) -> Result<ffi::MPI_Comm> {
        match self.comms.get(index).copied().flatten() {
            Some(c) => Ok(c),
            None => Err(CommError::Closed { rank: self.rank }),
        }
    }

    fn split(&mut self, comm: usize, color: c_int, key: c_int) -> Result<usize> {
        if let Some(reason) = &self.broken {
            return Err(self.unusable(reason));
        }
        let parent = self.comm(comm)?;
        // SAFETY: a collective over a live communicator, with an out-pointer to a local.
        unsafe {
            let mut child: ffi::MPI_Comm = std::mem::zeroed();
            check(
                ffi::MPI_Comm_split(parent, color, key, &mut child),
                self.rank,
                || format!("MPI_Comm_split (color {color})"),
            )?;
            check(
                ffi::MPI_Comm_set_errhandler(child, ffi::RSMPI_ERRORS_RETURN),
                self.rank,
                || "MPI_Comm_set_errhandler".into(),
            )?;
            self.comms.push(Some(child));
        }
        Ok(self.comms.len() - 1)
    }

    fn unusable(&self, reason: &str) -> CommError {
        CommError::Io {
            rank: self.rank,
            what: "MPI group".into(),
            message: format!("unusable after an earlier failure: {reason}"),
        }
    }

    /// Starts `call`'s MPI requests, or answers its error at once.
    fn start(&mut self, comm: usize, mut call: Call) {
        if let Some(reason) = &self.broken {
            let _ = call.reply.send(Err(self.unusable(reason)));
            return;
        }
        let result = self.comm(comm).and_then(|c| self.post(c, &mut call));
        match result {
            Ok((requests, peers)) => self.in_flight.push(InFlight {
                call,
                requests,
                peers,
                started: Instant::now(),
            }),
            Err(e) => {
                self.broken = Some(e.to_string());
                let _ = call.reply.send(Err(e));
            }
        }
    }

    /// Posts the non-blocking MPI calls of `call` on `comm`.
    fn post(
        &self,
        comm: ffi::MPI_Comm,
        call: &mut Call,
    ) -> Result<(Vec<ffi::MPI_Request>, Vec<usize>)> {
        let rank = self.rank;
        let what = &call.what;
        let dtype = call.bufs.first().map(|b| b.dtype());
        let dt = dtype.map(datatype);
        let mut ptrs: Vec<(*mut c_void, c_int)> = Vec::with_capacity(call.bufs.len());
        for b in &mut call.bufs {
            let (ptr, len) = with_host_vec!(b, v => (v.as_mut_ptr().cast::<c_void>(), v.len()),
            cuda => return Err(CommError::InvalidArgument {
                rank,
                op: what.clone(),
                reason: "a CUDA buffer was passed to an MPI group; use an NCCL group".into(),
            }));
            let len = c_int::try_from(len).map_err(|_| CommError::InvalidArgument {
                rank,
                op: what.clone(),
                reason: format!("{len} elements: MPI counts are 32-bit (at most 2^31-1)"),
            })?;
            ptrs.push((ptr, len));
        }
        if ptrs.iter().all(|&(_, n)| n == 0) && !matches!(call.kind, Kind::Barrier) {
            // Nothing to move (and an empty vector's dangling pointers may look to MPI like
            // aliased buffers or its in-place marker): complete at once, on every rank alike.
            return Ok((Vec::new(), Vec::new()));
        }
        let mpi_call = |name: &str| format!("{name} for {what}");
        let op_of = |op: ReduceOp| self.reductions.op(dtype.unwrap_or(crate::DType::F32), op);
        // SAFETY: every pointer is into a vector owned by `call`, which stays in `in_flight`
        // (not touched) until MPI reports the requests complete; counts are the vectors'
        // lengths, checked to fit MPI's int; `dt` is the datatype of exactly those elements.
        unsafe {
            let mut req: ffi::MPI_Request = std::mem::zeroed();
            let code = match (call.kind, ptrs.as_slice(), dt) {
                (Kind::AllGather, [(i, k), (o, _)], Some(dt)) => {
                    ffi::MPI_Iallgather(*i, *k, dt, *o, *k, dt, comm, &mut req)
                }
                (Kind::ReduceScatter(op), [(i, _), (o, k)], Some(dt)) => {
                    ffi::MPI_Ireduce_scatter_block(*i, *o, *k, dt, op_of(op), comm, &mut req)
                }
                (Kind::AllReduce(op), [(i, n), (o, _)], Some(dt)) => {
                    ffi::MPI_Iallreduce(*i, *o, *n, dt, op_of(op), comm, &mut req)
                }
                (Kind::AllToAll(size), [(i, n), (o, _)], Some(dt)) => {
                    // `n` fits an int, so its share does too.
                    let k = *n / c_int::try_from(size.max(1)).unwrap_or(c_int::MAX);
                    ffi::MPI_Ialltoall(*i, k, dt, *o, k, dt, comm, &mut req)
                }
                (Kind::Broadcast(root), [(b, n)], Some(dt)) => {
                    ffi::MPI_Ibcast(*b, *n, dt, root as c_int, comm, &mut req)
                }
                (Kind::Gather(root), [(i, k), (o, _)], Some(dt)) => {
                    ffi::MPI_Igather(*i, *k, dt, *o, *k, dt, root as c_int, comm, &mut req)
                }
                (Kind::Scatter(root), [(i, _), (o, k)], Some(dt)) => {
                    ffi::MPI_Iscatter(*i, *k, dt, *o, *k, dt, root as c_int, comm, &mut req)
                }
                (Kind::Barrier, [], _) => ffi::MPI_Ibarrier(comm, &mut req),
                (Kind::Join { tag }, [(mine, n), records @ ..], Some(dt)) => {
                    return self.post_join(comm, tag, (*mine, *n), records, dt, what);
                }
                _ => {
                    return Err(CommError::InvalidArgument {
                        rank,
                        op: what.clone(),
                        reason: "wrong buffers for the collective (a bug in fsdp-comm)".into(),
                    });
                }
            };
            check(code, rank, || mpi_call(kind_call(call.kind)))?;
            Ok((vec![req], Vec::new()))
        }
    }

    /// A join's sends and receives: `records[r]` receives member r's record (the slot of
    /// this member itself is left alone).
    ///
    /// # Safety
    /// The pointers must stay valid until the requests complete or are cancelled.
    unsafe fn post_join(
        &self,
        comm: ffi::MPI_Comm,
        tag: c_int,
        mine: (*mut c_void, c_int),
        records: &[(*mut c_void, c_int)],
        dt: ffi::MPI_Datatype,
        what: &str,
    ) -> Result<(Vec<ffi::MPI_Request>, Vec<usize>)> {
        let me = self.rank_in(comm);
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let mut peers = Vec::new();
        for (r, &(ptr, n)) in records.iter().enumerate() {
            if r == me {
                continue;
            }
            // SAFETY: as the caller promises; out-pointers to locals.
            unsafe {
                let mut req: ffi::MPI_Request = std::mem::zeroed();
                check(
                    ffi::MPI_Isend(mine.0, mine.1, dt, r as c_int, tag, comm, &mut req),
                    self.rank,
                    || format!("MPI_Isend to member {r} for {what}"),
                )?;
                sends.push(req);
                let mut req: ffi::MPI_Request = std::mem::zeroed();
                check(
                    ffi::MPI_Irecv(ptr, n, dt, r as c_int, tag, comm, &mut req),
                    self.rank,
                    || format!("MPI_Irecv from member {r} for {what}"),
                )?;
                recvs.push(req);
                peers.push(r);
            }
        }
        sends.extend(recvs);
        Ok((sends, peers))
    }

    fn rank_in(&self, comm: ffi::MPI_Comm) -> usize {
        let mut r: c_int = 0;
        // SAFETY: a live communicator and an out-pointer to a local.
        unsafe { ffi::MPI_Comm_rank(comm, &mut r) };
        usize::try_from(r).unwrap_or(0)
    }

    /// Tests every call in flight, answering those that completed or ran out of time.
    /// Whether any did.
    fn progress(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.in_flight.len() {
            match self.test(i) {
                Ok(false) => i += 1,
                Ok(true) => {
                    let done = self.in_flight.swap_remove(i);
                    let _ = done.call.reply.send(Ok(Finished {
                        bufs: done.call.bufs,
                        missing: Vec::new(),
                    }));
                    any = true;
                }
                Err(answer) => {
                    let mut done = self.in_flight.swap_remove(i);
                    if answer.is_err() {
                        // MPI may still write into a failed or abandoned call's buffers (a
                        // schedule aborted half way, a receive still posted): they are never
                        // freed. The group is unusable from here on anyway.
                        std::mem::forget(std::mem::take(&mut done.call.bufs));
                    }
                    let _ = done.call.reply.send(answer);
                    any = true;
                }
            }
        }
        any
    }

    /// Whether call `i` is complete; `Err` holds the answer to send when it failed, timed
    /// out, or is a join that ended without everyone.
    fn test(&mut self, i: usize) -> std::result::Result<bool, Result<Finished>> {
        let rank = self.rank;
        let f = &mut self.in_flight[i];
        let mut all = true;
        for req in &mut f.requests {
            let mut flag: c_int = 0;
            // SAFETY: a request this thread posted (MPI sets it to MPI_REQUEST_NULL once
            // complete, and testing a null request reports it complete).
            let code = unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            if code != 0 {
                let e = CommError::Io {
                    rank,
                    what: format!("MPI_Test for {}", f.call.what),
                    message: error_text(code),
                };
                self.broken = Some(e.to_string());
                return Err(Err(e));
            }
            all &= flag != 0;
        }
        if all {
            return Ok(true);
        }
        if f.started.elapsed() < f.call.deadline {
            return Ok(false);
        }
        if let Kind::Join { .. } = f.call.kind {
            // The members whose record never came: cancel those receives (a receive can
            // always be cancelled) and answer who is missing.
            let sends = f.requests.len() - f.peers.len();
            let mut missing = Vec::new();
            for (req, &peer) in f.requests[sends..].iter_mut().zip(&f.peers) {
                // SAFETY: requests this thread posted; a null one is skipped.
                unsafe {
                    if *req != ffi::RSMPI_REQUEST_NULL {
                        ffi::MPI_Cancel(req);
                        ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE);
                        missing.push(peer);
                    }
                }
            }
            // Unmatched sends to the missing stay queued inside MPI (they are small and
            // buffered); the group is unusable from here on.
            self.broken = Some(format!("{} ended without members {missing:?}", f.call.what));
            let bufs = std::mem::take(&mut f.call.bufs);
            return Err(Ok(Finished { bufs, missing }));
        }
        let e = CommError::Timeout {
            rank,
            what: format!(
                "{} (MPI reports nothing while a member is stuck or never calls it)",
                f.call.what
            ),
            timeout: f.call.deadline,
        };
        self.broken = Some(e.to_string());
        Err(Err(e))
    }

    /// Frees what MPI allows and finalizes, unless a call is still pending inside MPI.
    fn finish(self) {
        if self.broken.is_some() {
            // A call may still be pending inside MPI, and MPI_Finalize would wait for it:
            // leave MPI as it is; the process is failing anyway.
            std::mem::forget(self.in_flight);
            return;
        }
        // SAFETY: no call is in flight; every communicator was created by this thread.
        unsafe {
            for mut c in self.comms.into_iter().flatten() {
                ffi::MPI_Comm_free(&mut c);
            }
            if ffi::MPI_Finalize() == 0 {
                FINALIZED.store(true, Ordering::SeqCst);
            }
        }
    }
}

fn kind_call(kind: Kind) -> &'static str {
    match kind {
        Kind::AllGather => "MPI_Iallgather",
        Kind::ReduceScatter(_) => "MPI_Ireduce_scatter_block",
        Kind::AllReduce(_) => "MPI_Iallreduce",
        Kind::AllToAll(_) => "MPI_Ialltoall",
        Kind::Broadcast(_) => "MPI_Ibcast",
        Kind::Gather(_) => "MPI_Igather",
        Kind::Scatter(_) => "MPI_Iscatter",
        Kind::Barrier => "MPI_Ibarrier",
        Kind::Join { .. } => "MPI_Isend/MPI_Irecv",
    }
}
