//! One attempt of the worker group: start every local worker (tearing down the started ones
//! if any cannot start or a signal arrives meanwhile), watch their exits in the order they happen, and stop the group on
//! the first failure or signal — at once, not when the failed worker's output pipes close —
//! reporting the failed rank, its code and last lines, and the ranks still running then.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::exits::ExitWatcher;
use super::spawn::{Attempt, Worker, spawn};
use super::{INTERRUPTED, Outcome};

/// How long workers get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(5);
/// How long a failed worker's output may take to drain before the report is printed.
const REPORT_DRAIN: Duration = Duration::from_millis(500);
/// How long output relays may take to drain after the group is gone.
const FINAL_DRAIN: Duration = Duration::from_secs(2);

/// Exits as the watcher reports them, in the order they happened.
type Exits = std::sync::mpsc::Receiver<(usize, std::process::ExitStatus)>;

/// Runs one attempt to its end.
pub(super) fn run_attempt(a: &Attempt<'_>, say: &dyn Fn(String)) -> Result<Outcome> {
    let (exit_tx, exits) = std::sync::mpsc::channel();
    let mut watcher = ExitWatcher::new(exit_tx);
    let mut workers: Vec<Worker> = Vec::new();
    for local_rank in 0..a.plan.local {
        // A signal while workers start stops the ones started, at once.
        let sig = INTERRUPTED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            say(format!(
                "received signal {sig} while starting workers; stopping the {} started of {}",
                workers.len(),
                a.plan.local
            ));
            watcher.all_watched();
            stop_all(&mut workers, &exits, sig);
            watcher.finish();
            return Ok(Outcome::Interrupted(128 + sig));
        }
        match spawn(a, local_rank, &mut watcher) {
            Ok(w) => workers.push(w),
            Err(e) => {
                let started = workers.len();
                watcher.all_watched();
                stop_all(&mut workers, &exits, libc::SIGTERM);
                watcher.finish();
                return Err(e.context(format!(
                    "rank {} could not start; the {started} worker(s) already started were stopped",
                    a.plan.first_rank() + local_rank
                )));
            }
        }
    }
    watcher.all_watched();
    let outcome = supervise(&mut workers, &exits, say);
    watcher.finish();
    outcome
}

fn supervise(workers: &mut [Worker], exits: &Exits, say: &dyn Fn(String)) -> Result<Outcome> {
    loop {
        let sig = INTERRUPTED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            say(format!("received signal {sig}; stopping the workers"));
            stop_all(workers, exits, sig);
            return Ok(Outcome::Interrupted(128 + sig));
        }
        let (rank, status) = match exits.recv_timeout(Duration::from_millis(50)) {
            Ok(exit) => exit,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(Outcome::Success),
        };
        let Some(i) = workers.iter().position(|w| w.rank == rank) else {
            continue;
        };
        workers[i].done = Some(status);
        if status.success() {
            if workers.iter().all(|w| w.done.is_some()) {
                stop_all(workers, exits, libc::SIGTERM);
                return Ok(Outcome::Success);
            }
            continue;
        }
        let (code, how) = describe_status(status);
        let running: Vec<String> = workers
            .iter()
            .filter(|w| w.done.is_none())
            .map(|w| w.rank.to_string())
            .collect();
        // Its last words, if its pipes close soon (a child it left behind may hold them).
        let w = &mut workers[i];
        let deadline = Instant::now() + REPORT_DRAIN;
        w.relays = std::mem::take(&mut w.relays)
            .into_iter()
            .filter_map(|r| r.finish(deadline))
            .collect();
        let last = w.tail.lock().unwrap_or_else(|e| e.into_inner()).lines();
        let still = if running.is_empty() {
            String::new()
        } else {
            format!(" (still running: rank {})", running.join(", "))
        };
        // One message, so no worker's output lands between its lines.
        let mut report = format!(
            "rank {rank} (pid {}) {how}; stopping the other workers{still}.",
            w.pid
        );
        if !last.is_empty() {
            report.push_str(&format!("\nlast output of rank {rank}:"));
            for line in &last {
                report.push_str(&format!("\n  {line}"));
            }
        }
        super::relay::say(&report);
        stop_all(workers, exits, libc::SIGTERM);
        return Ok(Outcome::Failed(code));
    }
}

fn describe_status(status: std::process::ExitStatus) -> (i32, String) {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => (code, format!("exited with code {code}")),
        (None, Some(sig)) => (128 + sig, format!("was killed by signal {sig}")),
        _ => (1, "ended abnormally".into()),
    }
}

/// Sends `sig` to every running worker's process group, waits up to the grace period, then
/// kills what is left, including what exited workers left behind in their groups and what
/// they moved out of them (reparented to the launcher); reaps everything, drains the output
/// relays for a bounded time, and removes shared memory a killed worker may have left.
fn stop_all(workers: &mut [Worker], exits: &Exits, sig: i32) {
    let signal_running = |workers: &[Worker], sig: i32| {
        for w in workers.iter().filter(|w| w.done.is_none()) {
            // SAFETY: signalling a process group we created (its leader is not reaped yet).
            unsafe {
                libc::kill(-(w.pid as i32), sig);
            }
        }
    };
    signal_running(workers, sig);
    let deadline = Instant::now() + GRACE;
    let mut killed = false;
    while workers.iter().any(|w| w.done.is_none()) {
        if !killed && Instant::now() >= deadline {
            signal_running(workers, libc::SIGKILL);
            killed = true;
        }
        if let Ok((rank, status)) = exits.recv_timeout(Duration::from_millis(20))
            && let Some(w) = workers.iter_mut().find(|w| w.rank == rank)
        {
            w.done = Some(status);
        }
    }
    for w in workers.iter_mut() {
        // The leader has exited but is not reaped yet, so its group id cannot have been
        // reused: stragglers in its group (its children) go too, then it is reaped.
        // SAFETY: as above.
        unsafe {
            libc::kill(-(w.pid as i32), libc::SIGKILL);
        }
        let _ = w.child.wait();
        fsdp_comm::remove_shm_segments_of(w.pid);
    }
    // What workers started outside their groups (reparented here, the subreaper).
    let pids: Vec<u32> = workers.iter().map(|w| w.pid).collect();
    super::orphans::end_orphans(&pids);
    let deadline = Instant::now() + FINAL_DRAIN;
    for w in workers.iter_mut() {
        w.relays = std::mem::take(&mut w.relays)
            .into_iter()
            .filter_map(|r| r.finish(deadline))
            .collect();
    }
}
