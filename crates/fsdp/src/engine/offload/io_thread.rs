//! The disk tier's one I/O thread: reads and writes of whole region files in the order they
//! were queued (a read queued after a write sees it), with byte and second counters and the
//! bytes of writes still waiting for the disk.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::OffloadError;

/// A read the I/O thread will answer.
pub(super) type PendingRead = Receiver<Result<Vec<f32>, OffloadError>>;

pub(super) enum Job {
    Read {
        file: Arc<File>,
        path: PathBuf,
        len: usize,
        reply: Sender<Result<Vec<f32>, OffloadError>>,
    },
    Write {
        file: Arc<File>,
        path: PathBuf,
        data: Vec<f32>,
    },
    Flush {
        reply: Sender<()>,
    },
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) read: AtomicU64,
    pub(super) written: AtomicU64,
    pub(super) read_ns: AtomicU64,
    pub(super) write_ns: AtomicU64,
    /// Bytes handed to the I/O thread and not written yet (each write holds its block).
    pub(super) queued: Mutex<u64>,
    /// Rung when queued bytes were written.
    pub(super) drained: std::sync::Condvar,
}

impl Counters {
    pub(super) fn written_out(&self, bytes: u64) {
        let mut q = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        *q = q.saturating_sub(bytes);
        self.drained.notify_all();
    }
}

/// Fills `out` from `file`, starting at element `offset`.
pub(super) fn read_exact(file: &File, out: &mut [f32], offset: usize) -> std::io::Result<()> {
    file.read_exact_at(bytemuck::cast_slice_mut(out), offset as u64 * 4)
}

/// The I/O thread: jobs in order, so a read queued after a write sees it.
pub(super) fn io_thread(
    rx: Receiver<Job>,
    failed: Arc<Mutex<Option<OffloadError>>>,
    c: Arc<Counters>,
) {
    let fail = |e: OffloadError| {
        failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };
    for job in rx {
        match job {
            Job::Read {
                file,
                path,
                len,
                reply,
            } => {
                let t = Instant::now();
                let mut out = vec![0f32; len];
                let result = read_exact(&file, &mut out, 0)
                    .map(|()| out)
                    .map_err(|source| OffloadError::Io {
                        path,
                        what: format!("reading {} bytes", len * 4),
                        source,
                    });
                c.read_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                if result.is_ok() {
                    c.read.fetch_add(len as u64 * 4, Ordering::Relaxed);
                }
                let _ = reply.send(result);
            }
            Job::Write { file, path, data } => {
                let t = Instant::now();
                let bytes = data.len() as u64 * 4;
                match file.write_all_at(bytemuck::cast_slice(&data), 0) {
                    Ok(()) => {
                        c.written.fetch_add(bytes, Ordering::Relaxed);
                    }
                    Err(source) => fail(OffloadError::Io {
                        path,
                        what: format!("writing {bytes} bytes"),
                        source,
                    }),
                }
                drop(data);
                c.write_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                c.written_out(bytes);
            }
            Job::Flush { reply } => {
                let _ = reply.send(());
            }
        }
    }
}
