//! [`Work`]: the handle of a collective that is queued or running, so callers overlap
//! communication with compute and wait only when they need the result.

use std::sync::{Arc, OnceLock, mpsc};
use std::time::Instant;

use crate::error::{CommError, Result};

/// When a communication thread started and finished running a collective (what a timeline
/// shows as its span; set by the thread before it answers).
pub type RunTimes = Arc<OnceLock<(Instant, Instant)>>;

/// Runs `f` on a communication thread, recording in `times` when it started and ended.
pub(crate) fn run_timed<T>(times: &RunTimes, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let result = f();
    let _ = times.set((started, Instant::now()));
    result
}

/// A handle to a collective that is queued, running or done.
#[must_use = "a collective's result is only known after wait()"]
pub struct Work<T> {
    finish: Box<dyn FnOnce() -> Result<T> + Send>,
    ran: Option<RunTimes>,
}

impl<T: Send + 'static> Work<T> {
    /// A handle whose result arrives on `rx` (from a communication thread); a thread that
    /// went away without answering reads as [`CommError::Closed`] for `rank`.
    pub fn from_channel(rx: mpsc::Receiver<Result<T>>, rank: usize) -> Work<T> {
        Work {
            finish: Box::new(move || rx.recv().unwrap_or(Err(CommError::Closed { rank }))),
            ran: None,
        }
    }

    /// [`Work::from_channel`] of a thread that records when it ran the collective in `ran`.
    pub fn from_channel_timed(
        rx: mpsc::Receiver<Result<T>>,
        rank: usize,
        ran: RunTimes,
    ) -> Work<T> {
        Work {
            ran: Some(ran),
            ..Work::from_channel(rx, rank)
        }
    }

    /// A handle that is already complete (operations a backend runs or enqueues at once).
    pub fn ready(result: Result<T>) -> Work<T> {
        Work {
            finish: Box::new(move || result),
            ran: None,
        }
    }

    /// A handle to `f` applied to this one's result, when waited for.
    pub fn map<U: Send + 'static>(
        self,
        f: impl FnOnce(T) -> Result<U> + Send + 'static,
    ) -> Work<U> {
        Work {
            finish: Box::new(move || (self.finish)().and_then(f)),
            ran: self.ran,
        }
    }

    /// Whether the communication thread has finished running the collective, so
    /// [`Work::wait`] returns without blocking; false where the transport does not say.
    pub fn is_finished(&self) -> bool {
        self.ran.as_ref().is_some_and(|r| r.get().is_some())
    }

    /// Blocks until the collective finishes and returns its result.
    pub fn wait(self) -> Result<T> {
        (self.finish)()
    }

    /// [`Work::wait`], with when the communication thread ran the collective (`None` where
    /// the transport does not say).
    pub fn wait_timed(self) -> Result<(T, Option<(Instant, Instant)>)> {
        let ran = self.ran;
        let value = (self.finish)()?;
        Ok((value, ran.and_then(|r| r.get().copied())))
    }
}
