//! [`LocalGroup`]: a [`Communicator`](crate::Communicator) whose members are threads of one process, so code built
//! on collectives (the FSDP engine) can be unit-tested without spawning processes. Same
//! contract as a process group: FIFO per member, asynchronous handles, identical results on
//! every member (reductions in rank order), and mismatches, departed members and timeouts
//! reported as errors naming the ranks and the op.
//!
//! This module is the members' rendezvous (a round per collective, checked and combined
//! once every member arrived); `communicator.rs` is the [`Communicator`](crate::Communicator) on top of it.

mod communicator;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use crate::buffer::{Buffer, BufferElement};
use crate::dtype::{DType, Element, ReduceOp, finish_avg, reduce_into};
use crate::error::{CommError, Result};
use crate::work::Work;

/// What a member called, compared across members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    AllGather,
    ReduceScatter(ReduceOp),
    AllReduce(ReduceOp),
    AllToAll,
    Broadcast(usize),
    Gather(usize),
    Barrier,
    Join,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::AllGather => "all_gather",
            Call::ReduceScatter(_) => "reduce_scatter",
            Call::AllReduce(_) => "all_reduce",
            Call::AllToAll => "all_to_all",
            Call::Broadcast(_) => "broadcast",
            Call::Gather(_) => "gather",
            Call::Barrier => "barrier",
            Call::Join => "join",
        }
    }
}

struct Arrival {
    call: Call,
    dtype: DType,
    input: Arc<Buffer>,
}

#[derive(Default)]
struct Round {
    arrivals: HashMap<usize, Arrival>,
    /// Members that have taken their result; the last one removes the round.
    done: usize,
}

struct State {
    rounds: HashMap<u64, Round>,
    departed: Vec<bool>,
    failed: Option<(usize, String)>,
}

struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
    /// Sub-groups made by `split_2d`, by (split number, shard size): each member takes its
    /// pair (shard group, replicate group) out.
    splits: Mutex<HashMap<(u64, usize), SplitSlots>>,
}

/// The members' (shard group, replicate group) pairs of one `split_2d`, each taken once.
type SplitSlots = Vec<Option<(LocalGroup, LocalGroup)>>;

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

type Job = Box<dyn FnOnce(&mut Member) + Send>;

/// One member's side, owned by its communication thread.
struct Member {
    rank: usize,
    seq: u64,
    shared: Arc<Shared>,
    bytes_sent: Arc<AtomicU64>,
}

/// One member of an in-process group (see the module docs).
pub struct LocalGroup {
    rank: usize,
    size: usize,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Shared>,
    bytes_sent: Arc<AtomicU64>,
    /// `split_2d` calls made by this member.
    splits_made: AtomicU64,
}

impl LocalGroup {
    /// The `size` members of a new group (give one to each thread), with a 60 s timeout.
    pub fn create(size: usize) -> Vec<LocalGroup> {
        LocalGroup::with_timeout(size, Duration::from_secs(60))
    }

    /// As [`LocalGroup::create`], waiting at most `timeout` for the other members.
    pub fn with_timeout(size: usize, timeout: Duration) -> Vec<LocalGroup> {
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(State {
                rounds: HashMap::new(),
                departed: vec![false; size],
                failed: None,
            }),
            changed: Condvar::new(),
            splits: Mutex::new(HashMap::new()),
        });
        (0..size)
            .map(|rank| {
                let (tx, rx) = mpsc::channel::<Job>();
                let bytes_sent = Arc::new(AtomicU64::new(0));
                let mut member = Member {
                    rank,
                    seq: 0,
                    shared: shared.clone(),
                    bytes_sent: bytes_sent.clone(),
                };
                let thread = std::thread::Builder::new()
                    .name(format!("fsdp-local-{rank}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            job(&mut member);
                        }
                    })
                    .ok();
                LocalGroup {
                    rank,
                    size,
                    jobs: Mutex::new(Some(tx)),
                    thread,
                    shared: shared.clone(),
                    bytes_sent,
                    splits_made: AtomicU64::new(0),
                }
            })
            .collect()
    }

    /// Queues a collective; `invalid` is this member's argument error, which breaks the
    /// group for every member (as in a process group) instead of leaving them waiting.
    fn submit<T: Send + 'static>(
        &self,
        call: Call,
        input: Buffer,
        invalid: Option<String>,
        finish: impl FnOnce(&Member, &[Arc<Buffer>]) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let timeout = self.shared.timeout;
        self.submit_within(call, input, invalid, timeout, finish)
    }

    /// [`LocalGroup::submit`] waiting at most `timeout` for the other members.
    fn submit_within<T: Send + 'static>(
        &self,
        call: Call,
        input: Buffer,
        invalid: Option<String>,
        timeout: Duration,
        finish: impl FnOnce(&Member, &[Arc<Buffer>]) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let ran = crate::work::RunTimes::default();
        let times = ran.clone();
        let job: Job = Box::new(move |m: &mut Member| {
            let result = crate::work::run_timed(&times, || match invalid {
                Some(reason) => {
                    let err = m.invalid(call.name(), reason);
                    Err(m.fail(m.shared.lock(), err))
                }
                None => m
                    .collective(call, input, timeout)
                    .and_then(|all| finish(m, &all))
                    // A join that others missed is reported, not a broken group.
                    .map_err(|e| match call {
                        Call::Join => e,
                        _ => m.fail(m.shared.lock(), e),
                    }),
            });
            let _ = tx.send(result);
        });
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(sender) = jobs.as_ref() {
            let _ = sender.send(job);
        }
        Work::from_channel_timed(rx, self.rank, ran)
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.shared.lock().departed[self.rank] = true;
        self.shared.changed.notify_all();
    }
}

impl Member {
    fn invalid(&self, op: &str, reason: String) -> CommError {
        CommError::InvalidArgument {
            rank: self.rank,
            op: op.into(),
            reason,
        }
    }

    /// Deposits this member's input for its next collective, waits for every member's, and
    /// returns all inputs in rank order. The first failure breaks the group for everyone.
    fn collective(
        &mut self,
        call: Call,
        input: Buffer,
        timeout: Duration,
    ) -> Result<Vec<Arc<Buffer>>> {
        self.seq += 1;
        let seq = self.seq;
        let shared = self.shared.clone();
        let mut state = shared.lock();
        if let Some((origin, message)) = &state.failed {
            return Err(self.aborted(*origin, message.clone()));
        }
        let dtype = input.dtype();
        let round = state.rounds.entry(seq).or_default();
        round.arrivals.insert(
            self.rank,
            Arrival {
                call,
                dtype,
                input: Arc::new(input),
            },
        );
        let mismatch = round
            .arrivals
            .iter()
            .find(|(_, a)| a.call != call || a.dtype != dtype)
            .map(|(&peer, a)| CommError::Mismatch {
                rank: self.rank,
                peer,
                mine: format!("{call:?}({dtype:?}) as collective #{seq}"),
                theirs: format!("{:?}({:?}) as collective #{seq}", a.call, a.dtype),
            });
        if let Some(err) = mismatch {
            return Err(self.fail(state, err));
        }
        shared.changed.notify_all();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((origin, message)) = &state.failed {
                return Err(self.aborted(*origin, message.clone()));
            }
            let round = state.rounds.get(&seq);
            let arrived = round.map_or(0, |r| r.arrivals.len());
            if arrived == shared.size {
                break;
            }
            let missing: Vec<usize> = (0..shared.size)
                .filter(|r| round.is_none_or(|x| !x.arrivals.contains_key(r)))
                .collect();
            if let Some(&peer) = missing.iter().find(|&&r| state.departed[r]) {
                let err = CommError::PeerLost {
                    rank: self.rank,
                    peer,
                    op: Some(format!("{call:?} as collective #{seq}")),
                };
                return Err(self.fail(state, err));
            }
            let now = Instant::now();
            if now >= deadline {
                if call == Call::Join {
                    // Every waiting member reports the absent ones itself.
                    return Err(CommError::NotJoined {
                        rank: self.rank,
                        what: "join".into(),
                        missing,
                        timeout,
                    });
                }
                let err = {
                    CommError::Timeout {
                        rank: self.rank,
                        what: format!(
                            "{call:?} as collective #{seq} waiting for ranks {missing:?}"
                        ),
                        timeout,
                    }
                };
                return Err(self.fail(state, err));
            }
            state = shared
                .changed
                .wait_timeout(state, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        let round = state
            .rounds
            .get_mut(&seq)
            .ok_or(CommError::Closed { rank: self.rank })?;
        let mut inputs = Vec::with_capacity(shared.size);
        for r in 0..shared.size {
            let a = round
                .arrivals
                .get(&r)
                .ok_or(CommError::Closed { rank: self.rank })?;
            inputs.push(a.input.clone());
        }
        round.done += 1;
        if round.done == shared.size {
            state.rounds.remove(&seq);
        }
        Ok(inputs)
    }

    fn aborted(&self, origin: usize, message: String) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            origin,
            message,
        }
    }

    /// Records the first failure so every member stops, and returns it.
    fn fail(&self, mut state: MutexGuard<'_, State>, err: CommError) -> CommError {
        if state.failed.is_none() {
            state.failed = Some((self.rank, err.to_string()));
        }
        self.shared.changed.notify_all();
        err
    }

    fn sent(&self, bytes: f64) {
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// All inputs must have the same length (`op` names the collective in the error).
    fn same_lengths(&self, op: &str, inputs: &[Arc<Buffer>]) -> Result<usize> {
        let len = inputs[self.rank].len();
        match inputs.iter().position(|b| b.len() != len) {
            None => Ok(len),
            Some(peer) => Err(self.invalid(
                op,
                format!(
                    "rank {peer} passed {} elements where this rank passed {len}",
                    inputs[peer].len()
                ),
            )),
        }
    }
}

/// The reduction of `range` of every input, in rank order (host buffers of one type: checked
/// when they were contributed).
fn reduce_range(inputs: &[Arc<Buffer>], range: Range<usize>, op: ReduceOp) -> Buffer {
    fn reduce<T: Element + BufferElement>(
        first: &[T],
        rest: &[Arc<Buffer>],
        range: Range<usize>,
        op: ReduceOp,
    ) -> Buffer {
        let mut out = first.to_vec();
        for v in rest.iter().filter_map(|b| T::slice_of(b)) {
            reduce_into(&mut out, &v[range.clone()], op);
        }
        finish_avg(&mut out, op, rest.len() + 1);
        T::into_buffer(out)
    }
    crate::with_host_vec!(&*inputs[0], v => reduce(&v[range.clone()], &inputs[1..], range, op),
        cuda => unreachable!("local groups refuse device buffers on entry"))
}

/// Every input concatenated in rank order.
fn concat(inputs: &[Arc<Buffer>]) -> Buffer {
    /// `first` only names the element type.
    fn cat<T: BufferElement>(_first: &[T], inputs: &[Arc<Buffer>]) -> Buffer {
        let mut out = Vec::with_capacity(inputs.iter().map(|b| b.len()).sum());
        for v in inputs.iter().filter_map(|b| T::slice_of(b)) {
            out.extend_from_slice(v);
        }
        T::into_buffer(out)
    }
    crate::with_host_vec!(&*inputs[0], v => cat(v, inputs),
        cuda => unreachable!("local groups refuse device buffers on entry"))
}

/// Part `range` of every input, concatenated in rank order (an all-to-all's result).
fn concat_range(inputs: &[Arc<Buffer>], range: Range<usize>) -> Buffer {
    /// `first` only names the element type.
    fn cat<T: BufferElement>(_first: &[T], inputs: &[Arc<Buffer>], range: Range<usize>) -> Buffer {
        let mut out = Vec::with_capacity(range.len() * inputs.len());
        for v in inputs.iter().filter_map(|b| T::slice_of(b)) {
            out.extend_from_slice(&v[range.clone()]);
        }
        T::into_buffer(out)
    }
    crate::with_host_vec!(&*inputs[0], v => cat(v, inputs, range),
        cuda => unreachable!("local groups refuse device buffers on entry"))
}

fn bytes(b: &Buffer) -> f64 {
    (b.len() * b.dtype().size()) as f64
}

/// Why this member's arguments cannot work, if they cannot.
fn check(buf: &Buffer, size: usize, call: Call) -> Option<String> {
    if !buf.is_host() {
        return Some("a local group moves host buffers, not device memory".into());
    }
    match call {
        Call::ReduceScatter(_) | Call::AllToAll if !buf.len().is_multiple_of(size) => {
            Some(format!(
                "input length {} is not a multiple of the group size {size}",
                buf.len()
            ))
        }
        Call::Broadcast(root) | Call::Gather(root) if root >= size => {
            Some(format!("root {root} is not a rank of this group of {size}"))
        }
        _ => None,
    }
}
