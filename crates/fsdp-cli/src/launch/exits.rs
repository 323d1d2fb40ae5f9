//! Observing workers' exits, in the order they happen, without reaping them (a zombie keeps
//! its pid and process group id from being reused until the launcher is done with them).
//!
//! One thread waits on the workers' pidfds in an epoll set. The kernel queues a pidfd on the
//! set's ready list when its process exits, first in first out, so two exits a moment apart
//! are reported in their order even on a loaded machine: the launcher blames the rank that
//! failed first, not the peer that failed because of it. (With a thread per worker, the
//! order was whichever thread the scheduler ran first.)
//!
//! A worker can exit before the launcher has its pidfd in the set (a loaded machine may
//! not run the launcher for milliseconds after a spawn). Its place in the ready list then
//! says when it was added, not when it exited, so it could be reported after a peer that
//! failed because of it. Such a worker is marked when it is watched, the thread reports
//! nothing until every worker is watched, and then reports the marked ones first: a worker
//! that died before the launcher could even watch it is taken to have died first.
//!
//! A process closes its files before it becomes a zombie, and on a loaded machine the gap
//! can be long: a peer that sees its connection close may fail, exit and become a zombie
//! first. So the set also holds each worker's output pipes (duplicates of the relays' read
//! ends): they hang up, in the ready list's order too, when the worker closes its
//! descriptors as it begins to exit. An exit is reported only once no worker still running
//! had closed its outputs before this one began to exit (such a worker is waited for, up
//! to [`CLOSED_GRACE`]): the worker that began to exit first is reported first.
//!
//! Where pidfds are missing (Linux
//! before 5.3), each worker gets a thread of its own, as before; so does every worker still
//! running if `epoll_wait` ever fails, so that no exit goes unreported and the launcher
//! never waits forever.

use std::os::fd::OwnedFd;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustix::buffer::spare_capacity;
use rustix::event::Timespec;
use rustix::event::epoll::{self, EventData, EventFlags};
use rustix::process::{Pid, PidfdFlags, WaitId, WaitIdOptions, WaitIdStatus};

/// Where exits are reported: (rank, status), in the order they happened.
pub(super) type ExitSender = Sender<(usize, ExitStatus)>;

/// How long the epoll thread sleeps between checks that it is still needed.
const POLL: Duration = Duration::from_millis(50);

/// How long an exit's report waits for a running worker whose outputs closed before it:
/// one beginning to exit becomes a zombie within this, even on a loaded machine; one that
/// closed its outputs and goes on running only delays the report by this much.
const CLOSED_GRACE: Duration = Duration::from_secs(2);

/// Which of a worker's descriptors an event is for: its pidfd, or one of its outputs.
const PIDFD_SLOT: u64 = 0;
/// Bits of an event's number that hold the slot; the rest is the worker's index.
const SLOT_BITS: u32 = 2;

/// A worker in the epoll set.
struct Watched {
    rank: usize,
    pid: u32,
    /// In the set until its exit is seen.
    pidfd: Option<OwnedFd>,
    /// Its output pipes' read ends, each in the set until it hangs up.
    outputs: Vec<Option<OwnedFd>>,
    /// It had exited before its pidfd joined the set.
    exited_unwatched: bool,
    /// The number of the event at which its last output hung up.
    outputs_closed: Option<u64>,
    /// The number of the event at which it exited, and when that was seen.
    exited: Option<(u64, Instant)>,
    reported: bool,
}

impl Watched {
    /// Where its exit began in the order of events: its outputs closing, or its exit.
    fn exit_began(&self) -> Option<u64> {
        let (exited, _) = self.exited?;
        Some(self.outputs_closed.map_or(exited, |c| c.min(exited)))
    }
}

/// State the epoll thread shares with the launcher.
struct Shared {
    epoll: OwnedFd,
    watched: Mutex<Vec<Watched>>,
    /// Every worker is watched: the thread reports from then on.
    all_watched: AtomicBool,
    /// No worker will be added: the thread ends once every watched one has exited.
    closing: AtomicBool,
    /// `epoll_wait` failed and the thread has ended: workers get a thread each instead.
    /// Read and written with `watched` locked, so no worker joins a set nobody waits on.
    broken: AtomicBool,
}

/// Reports each watched worker's exit once, on `exits`.
pub(super) struct ExitWatcher {
    /// Dropped once every worker is watched, so the channel closes when the reporting
    /// threads are done.
    exits: Option<ExitSender>,
    epoll: Option<(Arc<Shared>, JoinHandle<()>)>,
    /// Threads of workers watched one thread each (no pidfd).
    threads: Vec<JoinHandle<()>>,
}

impl ExitWatcher {
    pub fn new(exits: ExitSender) -> ExitWatcher {
        ExitWatcher {
            epoll: start_epoll(exits.clone()),
            exits: Some(exits),
            threads: Vec::new(),
        }
    }

    /// Starts watching `pid` (rank `rank`), which must be an unreaped child; `outputs` are
    /// duplicates of the read ends of its output pipes.
    pub fn watch(&mut self, rank: usize, pid: u32, outputs: Vec<OwnedFd>) -> Result<()> {
        if let Some((shared, _)) = &self.epoll
            && let Some(pidfd) = pidfd_open(pid)
        {
            // Asked before the pidfd joins the set: one that exits after this has its
            // place in the ready list by its exit.
            let exited_unwatched = has_exited(pid);
            let mut watched = shared.watched.lock().unwrap_or_else(|e| e.into_inner());
            let index = (watched.len() as u64) << SLOT_BITS;
            // A broken set has nobody waiting on it: the worker gets a thread instead.
            let added = !shared.broken.load(Ordering::SeqCst)
                && add(shared, &pidfd, EventFlags::IN, index | PIDFD_SLOT);
            if added {
                // An output that cannot join the set only leaves its closing unobserved.
                let outputs = (1..)
                    .zip(outputs)
                    .filter(|&(slot, _)| slot < 1 << SLOT_BITS)
                    .map(|(slot, fd)| {
                        // Hang-ups only (the kernel always reports them), once.
                        add(shared, &fd, EventFlags::ONESHOT, index | slot).then_some(fd)
                    })
                    .collect();
                watched.push(Watched {
                    rank,
                    pid,
                    pidfd: Some(pidfd),
                    outputs,
                    exited_unwatched,
                    outputs_closed: None,
                    exited: None,
                    reported: false,
                });
                return Ok(());
            }
        }
        let tx = self
            .exits
            .clone()
            .context("a worker was started after the others were all watched")?;
        let thread = spawn_waiter(rank, pid, tx)
            .with_context(|| format!("starting a thread to watch rank {rank}"))?;
        self.threads.push(thread);
        Ok(())
    }

    /// Every worker is started: no more will be watched.
    pub fn all_watched(&mut self) {
        self.exits = None;
        if let Some((shared, _)) = &self.epoll {
            shared.all_watched.store(true, Ordering::SeqCst);
        }
    }

    /// Waits for the watching threads; call once every watched worker has exited.
    pub fn finish(self) {
        if let Some((shared, thread)) = self.epoll {
            shared.closing.store(true, Ordering::SeqCst);
            let _ = thread.join();
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// The epoll set and its thread; `None` where the system has no epoll or no pidfds.
fn start_epoll(exits: ExitSender) -> Option<(Arc<Shared>, JoinHandle<()>)> {
    let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).ok()?;
    let shared = Arc::new(Shared {
        epoll,
        watched: Mutex::new(Vec::new()),
        all_watched: AtomicBool::new(false),
        closing: AtomicBool::new(false),
        broken: AtomicBool::new(false),
    });
    let for_thread = shared.clone();
    let thread = std::thread::Builder::new()
        .name("fsdp-wait".into())
        .spawn(move || report_exits(&for_thread, &exits))
        .ok()?;
    Some((shared, thread))
}

/// The epoll thread: one ready descriptor at a time, so events are seen in the ready list's
/// order.
fn report_exits(shared: &Shared, exits: &ExitSender) {
    while !shared.all_watched.load(Ordering::SeqCst) && !shared.closing.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(2));
    }
    {
        let mut watched = shared.watched.lock().unwrap_or_else(|e| e.into_inner());
        for w in watched.iter_mut().filter(|w| w.exited_unwatched) {
            forget_pidfd(shared, w);
            report(w, exits);
        }
    }
    let mut events = 0u64;
    let poll = Timespec::try_from(POLL).unwrap_or_default();
    let mut ready: Vec<epoll::Event> = Vec::with_capacity(1);
    loop {
        ready.clear();
        let waited = epoll::wait(&shared.epoll, spare_capacity(&mut ready), Some(&poll));
        let mut watched = shared.watched.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(event) = ready.first() {
            events += 1;
            let data = event.data.u64();
            let (index, slot) = (data >> SLOT_BITS, data & ((1 << SLOT_BITS) - 1));
            if let Some(w) = watched.get_mut(index as usize) {
                if slot == PIDFD_SLOT {
                    if forget_pidfd(shared, w) {
                        w.exited = Some((events, Instant::now()));
                    }
                } else if let Some(fd) = w.outputs.get_mut(slot as usize - 1) {
                    forget(shared, fd.take());
                    if w.outputs.iter().all(Option::is_none) {
                        w.outputs_closed = Some(events);
                    }
                }
            }
        }
        report_in_order(&mut watched, exits);
        if waited.is_err_and(|e| e != rustix::io::Errno::INTR) {
            drop(watched);
            return hand_over(shared, exits);
        }
        if shared.closing.load(Ordering::SeqCst) && watched.iter().all(|w| w.reported) {
            return;
        }
    }
}

/// Reports the exits seen so far, the one that began first first; an exit waits while a
/// running worker had closed its outputs before it began (up to [`CLOSED_GRACE`]).
fn report_in_order(watched: &mut [Watched], exits: &ExitSender) {
    loop {
        let Some(next) = (0..watched.len())
            .filter(|&i| !watched[i].reported)
            .filter_map(|i| watched[i].exit_began().map(|began| (began, i)))
            .min()
        else {
            return;
        };
        let (began, i) = next;
        let closing_before = watched.iter().any(|w| {
            !w.reported && w.exited.is_none() && w.outputs_closed.is_some_and(|c| c < began)
        });
        let waited = watched[i]
            .exited
            .map_or(Duration::ZERO, |(_, at)| at.elapsed());
        if closing_before && waited < CLOSED_GRACE {
            return;
        }
        report(&mut watched[i], exits);
    }
}

/// Adds `fd` to the set for `events`, the event carrying `data`; whether it joined.
fn add(shared: &Shared, fd: &OwnedFd, events: EventFlags, data: u64) -> bool {
    epoll::add(&shared.epoll, fd, EventData::new_u64(data), events).is_ok()
}

/// Takes `fd` out of the set and closes it.
fn forget(shared: &Shared, fd: Option<OwnedFd>) {
    if let Some(fd) = fd {
        // A descriptor that is not in the set has nothing to remove; it is closed on drop.
        let _ = epoll::delete(&shared.epoll, &fd);
    }
}

/// Takes `w`'s pidfd out of the set (its outputs stay until they hang up); whether it was
/// still there.
fn forget_pidfd(shared: &Shared, w: &mut Watched) -> bool {
    let had = w.pidfd.is_some();
    forget(shared, w.pidfd.take());
    had
}

/// Reports `w`'s exit, unless it was reported already.
fn report(w: &mut Watched, exits: &ExitSender) {
    if std::mem::replace(&mut w.reported, true) {
        return;
    }
    if let Some(status) = wait_without_reaping(w.pid) {
        let _ = exits.send((w.rank, status));
    }
}

/// After a failed `epoll_wait`: every worker not yet reported is watched by a thread of its
/// own (or, if no thread can start, waited for here in turn), and those threads are joined
/// before the epoll thread ends.
fn hand_over(shared: &Shared, exits: &ExitSender) {
    let remaining: Vec<(usize, u32)> = {
        let mut watched = shared.watched.lock().unwrap_or_else(|e| e.into_inner());
        shared.broken.store(true, Ordering::SeqCst);
        watched
            .iter_mut()
            .filter_map(|w| (!std::mem::replace(&mut w.reported, true)).then_some((w.rank, w.pid)))
            .collect()
    };
    let mut threads = Vec::new();
    for (rank, pid) in remaining {
        match spawn_waiter(rank, pid, exits.clone()) {
            Ok(thread) => threads.push(thread),
            Err(_) => {
                if let Some(status) = wait_without_reaping(pid) {
                    let _ = exits.send((rank, status));
                }
            }
        }
    }
    for thread in threads {
        let _ = thread.join();
    }
}

/// A thread that reports worker `rank`'s exit on `exits`.
fn spawn_waiter(rank: usize, pid: u32, exits: ExitSender) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("fsdp-wait-{rank}"))
        .spawn(move || {
            if let Some(status) = wait_without_reaping(pid) {
                let _ = exits.send((rank, status));
            }
        })
}

/// A pidfd for `pid` (Linux 5.3 and later); `None` where the call is missing or fails.
fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    rustix::process::pidfd_open(child(pid)?, PidfdFlags::empty()).ok()
}

/// `pid` as rustix's `Pid`; `None` for 0 or one past `i32::MAX` (no child has those).
fn child(pid: u32) -> Option<Pid> {
    Pid::from_raw(i32::try_from(pid).ok()?)
}

/// `waitid` on child `pid` for its exit, with `WNOWAIT` (it stays unreaped) and `extra`
/// options: its status (`None` with `NOHANG` while it runs), or the error.
fn peek_exit(pid: u32, extra: WaitIdOptions) -> rustix::io::Result<Option<WaitIdStatus>> {
    let pid = child(pid).ok_or(rustix::io::Errno::CHILD)?;
    let options = WaitIdOptions::EXITED | WaitIdOptions::NOWAIT | extra;
    rustix::process::waitid(WaitId::Pid(pid), options)
}

/// Whether child `pid` has exited (it is left unreaped).
fn has_exited(pid: u32) -> bool {
    peek_exit(pid, WaitIdOptions::NOHANG).is_ok_and(|status| status.is_some())
}

/// Blocks until process `pid` exits and returns its status, leaving it unreaped.
pub(super) fn wait_without_reaping(pid: u32) -> Option<ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    loop {
        match peek_exit(pid, WaitIdOptions::empty()) {
            Ok(Some(status)) => {
                let raw = match (status.exit_status(), status.terminating_signal()) {
                    (Some(code), _) => (code & 0xff) << 8,
                    (None, Some(signal)) => signal & 0x7f,
                    (None, None) => return None,
                };
                return Some(ExitStatus::from_raw(raw));
            }
            Err(rustix::io::Errno::INTR) => continue,
            Ok(None) | Err(_) => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::process::Command;
    use std::sync::mpsc::channel;

    /// Replaces the epoll descriptor by /dev/null, so that the next `epoll_wait` fails.
    fn break_epoll(watcher: &ExitWatcher) {
        let (shared, _) = watcher.epoll.as_ref().expect("this kernel has epoll");
        let null = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: both descriptors are open; dup2 swaps what the epoll number refers to.
        assert!(unsafe { libc::dup2(null.as_raw_fd(), shared.epoll.as_raw_fd()) } >= 0);
    }

    #[test]
    fn exits_are_reported_after_epoll_wait_fails() {
        let (tx, rx) = channel();
        let mut watcher = ExitWatcher::new(tx);
        let mut first = Command::new("sleep").arg("0.4").spawn().unwrap();
        watcher.watch(0, first.id(), Vec::new()).unwrap();
        break_epoll(&watcher);
        // Watched after the failure (the set may be broken already, or not yet).
        std::thread::sleep(POLL * 3);
        let mut second = Command::new("sleep").arg("0.2").spawn().unwrap();
        watcher.watch(1, second.id(), Vec::new()).unwrap();
        watcher.all_watched();
        let mut ranks = Vec::new();
        for _ in 0..2 {
            let (rank, status) = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("an exit went unreported");
            assert!(status.success());
            ranks.push(rank);
        }
        ranks.sort();
        assert_eq!(ranks, [0, 1]);
        watcher.finish();
        first.wait().unwrap();
        second.wait().unwrap();
    }

    /// Waits until child `pid` has exited (unreaped).
    fn until_exited(pid: u32) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !has_exited(pid) {
            assert!(std::time::Instant::now() < deadline, "{pid} did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_worker_that_exited_before_it_was_watched_is_reported_first() {
        let (tx, rx) = channel();
        let mut watcher = ExitWatcher::new(tx);
        // Rank 0 is watched while it runs; rank 1 exits at once, then rank 0, and only then
        // is rank 1 watched: rank 0's exit is in the ready list before rank 1 is.
        let mut first = Command::new("sleep").arg("0.3").spawn().unwrap();
        watcher.watch(0, first.id(), Vec::new()).unwrap();
        let mut second = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        until_exited(second.id());
        until_exited(first.id());
        watcher.watch(1, second.id(), Vec::new()).unwrap();
        watcher.all_watched();
        let next = || rx.recv_timeout(Duration::from_secs(20)).unwrap();
        let (rank, status) = next();
        assert_eq!((rank, status.code()), (1, Some(3)));
        assert_eq!(next().0, 0);
        watcher.finish();
        first.wait().unwrap();
        second.wait().unwrap();
    }

    /// Starts `script` under `sh` with piped outputs; returns it and duplicates of its
    /// outputs' read ends.
    fn piped(script: &str) -> (std::process::Child, Vec<OwnedFd>) {
        use std::os::fd::AsFd;
        let child = Command::new("sh")
            .args(["-c", script])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let outputs = [
            child.stdout.as_ref().unwrap().as_fd(),
            child.stderr.as_ref().unwrap().as_fd(),
        ]
        .map(|fd| fd.try_clone_to_owned().unwrap());
        (child, outputs.into())
    }

    #[test]
    fn a_worker_whose_outputs_closed_first_is_reported_before_a_peer_that_became_a_zombie_first() {
        // Rank 1 begins to exit (its outputs close) but takes 0.4 s to become a zombie, as a
        // descheduled process can; rank 0 sees that and fails at once. Rank 0 is a zombie
        // first, and rank 1 must still be reported first.
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("closed");
        let m = marker.display();
        let (tx, rx) = channel();
        let mut watcher = ExitWatcher::new(tx);
        let (mut first, outputs) =
            piped(&format!("while [ ! -e {m} ]; do sleep 0.01; done; exit 1"));
        watcher.watch(0, first.id(), outputs).unwrap();
        let (mut second, outputs) = piped(&format!(
            "exec >&- 2>&-; sleep 0.2; touch {m}; sleep 0.4; exit 3"
        ));
        watcher.watch(1, second.id(), outputs).unwrap();
        watcher.all_watched();
        let next = || rx.recv_timeout(Duration::from_secs(20)).unwrap();
        let (rank, status) = next();
        assert_eq!((rank, status.code()), (1, Some(3)));
        assert_eq!(next(), (0, first.wait().unwrap()));
        watcher.finish();
        second.wait().unwrap();
    }

    #[test]
    fn a_worker_that_closed_its_outputs_and_runs_on_delays_a_report_by_the_grace_only() {
        let (tx, rx) = channel();
        let mut watcher = ExitWatcher::new(tx);
        let (mut first, outputs) = piped("sleep 0.3; exit 1");
        watcher.watch(0, first.id(), outputs).unwrap();
        let (mut second, outputs) = piped("exec >&- 2>&-; sleep 8");
        watcher.watch(1, second.id(), outputs).unwrap();
        watcher.all_watched();
        let start = std::time::Instant::now();
        let (rank, _) = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!(rank, 0);
        let waited = start.elapsed();
        assert!(
            waited >= CLOSED_GRACE && waited < CLOSED_GRACE * 2,
            "reported after {waited:?}"
        );
        second.kill().unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(20)).unwrap().0, 1);
        watcher.finish();
        first.wait().unwrap();
        second.wait().unwrap();
    }
}
