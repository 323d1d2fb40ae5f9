//! [`Work`]: the handle of a collective that is queued or running, so callers overlap
//! communication with compute and wait only when they need the result.

use std::sync::mpsc;

use crate::error::{CommError, Result};

/// A handle to a collective that is queued, running or done.
#[must_use = "a collective's result is only known after wait()"]
pub struct Work<T> {
    finish: Box<dyn FnOnce() -> Result<T> + Send>,
}

impl<T: Send + 'static> Work<T> {
    /// A handle whose result arrives on `rx` (from a communication thread); a thread that
    /// went away without answering reads as [`CommError::Closed`] for `rank`.
    pub fn from_channel(rx: mpsc::Receiver<Result<T>>, rank: usize) -> Work<T> {
        Work {
            finish: Box::new(move || rx.recv().unwrap_or(Err(CommError::Closed { rank }))),
        }
    }

    /// A handle that is already complete (operations a backend runs or enqueues at once).
    pub fn ready(result: Result<T>) -> Work<T> {
        Work {
            finish: Box::new(move || result),
        }
    }

    /// A handle to `f` applied to this one's result, when waited for.
    pub fn map<U: Send + 'static>(
        self,
        f: impl FnOnce(T) -> Result<U> + Send + 'static,
    ) -> Work<U> {
        Work {
            finish: Box::new(move || (self.finish)().and_then(f)),
        }
    }

    /// Blocks until the collective finishes and returns its result.
    pub fn wait(self) -> Result<T> {
        (self.finish)()
    }
}
