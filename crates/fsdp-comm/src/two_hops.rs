//! [`TwoHops`]: a group's all-gather and reductions over several machines as two hops — one
//! among a machine's processes (shared memory), one among the processes at the same place on
//! each machine (the network) — so what crosses the network is each process's own share
//! once, not every process's copy of every share: with L processes per machine a flat
//! all-gather or reduction sends each machine ~L× the bytes over the link that two hops send.
//! NCCL's tree and PXN algorithms and ZeRO++'s hierarchical all-to-all are the same idea.
//!
//! A [`TwoHops`] owns its two groups and issues on them from one thread, job after job in the
//! order they were submitted, so every member issues its hops in one order whatever the
//! timing; the second hop of one job runs while the first hop of the next one is in flight.
//! Dropping it finishes the jobs submitted (as dropping a group finishes its queued work), so
//! its groups go with it: an MPI world whose last owner went is finalized before the process
//! exits, even with a collective no one waited for.
//! [`MachineHops`] keeps gathers and reductions apart (one [`TwoHops`] each), because a
//! program issues them from places whose order against each other is its own.

use std::sync::{Arc, OnceLock, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::buffer::Buffer;
use crate::communicator::Communicator;
use crate::dtype::ReduceOp;
use crate::error::{CommError, Result};
use crate::work::{RunTimes, Work};

/// The second hop of a job, issued once its first hop is done.
type Then = Box<dyn FnOnce(Buffer) -> Result<Work<Buffer>> + Send>;

/// A job's two hops and where its result goes.
struct Job {
    first: Box<dyn FnOnce() -> Work<Buffer> + Send>,
    then: Then,
    reply: mpsc::Sender<Result<Buffer>>,
    ran: RunTimes,
}

/// A job whose second hop is in flight.
struct Landing {
    second: Result<Work<Buffer>>,
    reply: mpsc::Sender<Result<Buffer>>,
    ran: RunTimes,
    started: Instant,
}

/// Collectives of a group whose consecutive runs of `machine_size` ranks are machines, in two
/// hops (see the module doc). Rank g of the group is process `g % machine_size` of machine
/// `g / machine_size`, as `fsdp launch` numbers ranks.
pub struct TwoHops {
    /// This machine's processes.
    within: Arc<dyn Communicator>,
    /// The processes at this one's place on every machine.
    across: Arc<dyn Communicator>,
    /// Closed when dropped, which ends the threads once they finished every job.
    jobs: Option<mpsc::Sender<Job>>,
    /// The thread issuing hops and the one landing second hops, joined when dropped.
    threads: Vec<JoinHandle<()>>,
    rank: usize,
}

impl TwoHops {
    /// Splits `group` into machines of `machine_size` consecutive ranks and the groups across
    /// them. Every member of `group` calls it, in the same order as its other splits.
    pub fn new(group: &dyn Communicator, machine_size: usize) -> Result<TwoHops> {
        let (within, across) = group.split_2d(machine_size)?;
        let rank = group.global_rank();
        let spawn_failed = |e: std::io::Error| CommError::Io {
            rank,
            what: "starting the two-hop collectives' threads".into(),
            message: e.to_string(),
        };
        let (jobs, queued) = mpsc::channel::<Job>();
        let (landing, landed) = mpsc::channel::<Landing>();
        let issuing = std::thread::Builder::new()
            .name(format!("fsdp-two-hops-{rank}"))
            .spawn(move || {
                for job in queued {
                    let started = Instant::now();
                    let second = (job.first)().wait().and_then(job.then);
                    let _ = landing.send(Landing {
                        second,
                        reply: job.reply,
                        ran: job.ran,
                        started,
                    });
                }
            })
            .map_err(spawn_failed)?;
        let lands = std::thread::Builder::new()
            .name(format!("fsdp-two-hops-landing-{rank}"))
            .spawn(move || {
                for l in landed {
                    let result = l.second.and_then(Work::wait);
                    let _ = l.ran.set((l.started, Instant::now()));
                    let _ = l.reply.send(result);
                }
            })
            .map_err(spawn_failed)?;
        Ok(TwoHops {
            within,
            across,
            jobs: Some(jobs),
            threads: vec![issuing, lands],
            rank,
        })
    }

    /// This member's job-wide rank (for messages).
    pub fn global_rank(&self) -> usize {
        self.rank
    }

    /// Processes per machine.
    pub fn machine_size(&self) -> usize {
        self.within.size()
    }

    /// Machines the group spans.
    pub fn machines(&self) -> usize {
        self.across.size()
    }

    /// Payload bytes this member has sent (inside its machine, across machines).
    pub fn bytes_sent(&self) -> (u64, u64) {
        (self.within.bytes_sent(), self.across.bytes_sent())
    }

    /// Queues a job: `first` issued once every job before it has issued its second hop,
    /// `then` issued on `first`'s result.
    fn submit(
        &self,
        first: impl FnOnce() -> Work<Buffer> + Send + 'static,
        then: impl FnOnce(Buffer) -> Result<Work<Buffer>> + Send + 'static,
    ) -> Work<Buffer> {
        let (reply, rx) = mpsc::channel();
        let ran: RunTimes = Arc::new(OnceLock::new());
        let job = Job {
            first: Box::new(first),
            then: Box::new(then),
            reply,
            ran: ran.clone(),
        };
        if self
            .jobs
            .as_ref()
            .is_none_or(|jobs| jobs.send(job).is_err())
        {
            return Work::ready(Err(CommError::Closed { rank: self.rank }));
        }
        Work::from_channel_timed(rx, self.rank, ran)
    }

    /// The group's all-gather: every member's `input` (all the same length) in group rank
    /// order. Each member's input crosses the network once per other machine; the machine's
    /// processes then share what each received.
    pub fn all_gather(&self, input: Buffer) -> Work<Buffer> {
        let (within, across) = (self.within.clone(), self.across.clone());
        let (l, m, rank) = (self.machine_size(), self.machines(), self.rank);
        self.submit(
            move || across.all_gather(input),
            move |from_machines| {
                // [process][machine] blocks, wanted as [machine][process] (group rank order).
                Ok(within
                    .all_gather(from_machines)
                    .map(move |b| regrouped(b, l, m, rank, "all_gather")))
            },
        )
    }

    /// The group's reduce-scatter: member g gets part g of the reduction of every member's
    /// `input` (`size` equal parts). Each machine reduces its processes' inputs first and
    /// sends only its sums across; `op` is applied in each hop (an average of averages over
    /// equal groups is the average).
    pub fn reduce_scatter(&self, input: Buffer, op: ReduceOp) -> Work<Buffer> {
        let (within, across) = (self.within.clone(), self.across.clone());
        let (l, m, rank) = (self.machine_size(), self.machines(), self.rank);
        self.submit(
            move || match regrouped(input, m, l, rank, "reduce_scatter") {
                Ok(by_process) => within.reduce_scatter(by_process, op),
                Err(e) => Work::ready(Err(e)),
            },
            move |sums| Ok(across.reduce_scatter(sums, op)),
        )
    }

    /// A reduction the caller performs itself (quantized gradients summed in f32), as an
    /// all-to-all in two hops. `input` holds one equal part per group member, in group rank
    /// order. `between` gets the parts this member's machine sent it — for every process of
    /// the machine, its part for each machine, process by process — and returns one part
    /// per machine, in machine order (the machine's reduction, say); the result holds every
    /// machine's part for this member, machine by machine.
    pub fn all_to_all_through(
        &self,
        input: Buffer,
        between: impl FnOnce(Buffer) -> Result<Buffer> + Send + 'static,
    ) -> Work<Buffer> {
        let (within, across) = (self.within.clone(), self.across.clone());
        let (l, m, rank) = (self.machine_size(), self.machines(), self.rank);
        self.submit(
            move || match regrouped(input, m, l, rank, "all_to_all") {
                Ok(by_process) => within.all_to_all(by_process),
                Err(e) => Work::ready(Err(e)),
            },
            move |from_machine| Ok(across.all_to_all(between(from_machine)?)),
        )
    }
}

impl Drop for TwoHops {
    fn drop(&mut self) {
        // Each job's wait is bounded by its groups' timeout.
        self.jobs.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// `buf` seen as `rows` × `cols` equal blocks, regrouped column by column; a length that
/// does not divide is the named op's error.
fn regrouped(buf: Buffer, rows: usize, cols: usize, rank: usize, op: &str) -> Result<Buffer> {
    let len = buf.len();
    buf.transpose_blocks(rows, cols)
        .ok_or_else(|| CommError::InvalidArgument {
            rank,
            op: format!("two-hop {op}"),
            reason: format!("{len} elements do not split into {rows} x {cols} equal host blocks"),
        })
}

/// The two-hop collectives of a group spread over machines: one [`TwoHops`] for parameter
/// gathers and one for gradient reductions, each with its own groups.
pub struct MachineHops {
    /// Carries all-gathers.
    pub gathers: TwoHops,
    /// Carries reductions.
    pub reductions: TwoHops,
}

impl MachineHops {
    /// Both, over machines of `machine_size` consecutive ranks of `group`. Every member of
    /// `group` calls it.
    pub fn new(group: &dyn Communicator, machine_size: usize) -> Result<MachineHops> {
        Ok(MachineHops {
            gathers: TwoHops::new(group, machine_size)?,
            reductions: TwoHops::new(group, machine_size)?,
        })
    }

    /// Payload bytes this member has sent through both (inside its machine, across
    /// machines).
    pub fn bytes_sent(&self) -> (u64, u64) {
        let (a, b) = (self.gathers.bytes_sent(), self.reductions.bytes_sent());
        (a.0 + b.0, a.1 + b.1)
    }
}
