//! Incoming frames of every peer, filed by the links' reader threads, and the receives a
//! transfer posts ahead of its frames so a reader writes their payloads straight into the
//! caller's buffer instead of a frame of their own.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Header, KIND_ABORT};

/// A received frame.
pub struct Frame {
    /// Its header.
    pub header: Header,
    /// Where its payload is.
    pub payload: Payload,
}

/// Where a received frame's payload is.
pub enum Payload {
    /// Read into bytes of its own.
    Bytes(AlignedBytes),
    /// Read straight into the receive posted for it ([`Inbox::post`]).
    Landed,
}

/// Bytes stored 8-byte aligned, so a payload can be read as any element type in place.
pub struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    /// Zeroed bytes.
    pub fn zeroed(len: usize) -> AlignedBytes {
        AlignedBytes {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
}

/// Why a receive did not produce a frame.
pub enum RecvFailure {
    /// The connection to the peer closed.
    Lost,
    /// A peer sent an abort: (origin group rank, message).
    Aborted(usize, String),
    /// Nothing arrived in time.
    Timeout,
}

/// Where a posted receive's payload goes.
struct Destination(*mut u8);

// SAFETY: a destination is written by one reader thread at a time, and only between its
// posting and its withdrawal, which [`Inbox::post`]'s caller keeps the memory valid for.
unsafe impl Send for Destination {}

/// A receive posted ahead of its frame: the frame's exact header (its length included) and
/// where its payload goes.
struct Posting {
    id: u64,
    header: Header,
    dst: Destination,
}

#[derive(Default)]
struct InboxState {
    queues: Vec<VecDeque<Frame>>,
    lost: Vec<bool>,
    abort: Option<(usize, String)>,
    /// Per peer, the receives posted for its frames.
    posted: Vec<Vec<Posting>>,
    /// Per peer, the posting whose payload its reader is writing now.
    landing: Vec<Option<u64>>,
    next_posting: u64,
}

/// Incoming frames of every peer, and the failures seen so far.
pub struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
    /// Also called when a peer is lost or an abort arrives (wakes a shared-memory waiter).
    waker: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Inbox {
    pub(super) fn new(size: usize) -> Inbox {
        Inbox {
            state: Mutex::new(InboxState {
                queues: (0..size).map(|_| VecDeque::new()).collect(),
                lost: vec![false; size],
                posted: (0..size).map(|_| Vec::new()).collect(),
                landing: vec![None; size],
                ..InboxState::default()
            }),
            arrived: Condvar::new(),
            waker: std::sync::OnceLock::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Installs a callback run whenever a peer is lost or an abort arrives.
    pub fn set_waker(&self, waker: Box<dyn Fn() + Send + Sync>) {
        let _ = self.waker.set(waker);
    }

    /// True once the connection to `peer` has closed.
    pub fn is_lost(&self, peer: usize) -> bool {
        self.lock().lost[peer]
    }

    /// The first abort received over the links, if any: (origin, message).
    pub fn abort_received(&self) -> Option<(usize, String)> {
        self.lock().abort.clone()
    }

    fn wake(&self) {
        if let Some(w) = self.waker.get() {
            w();
        }
    }

    /// The next frame from `peer`, waiting up to `timeout`. Frames already queued are
    /// delivered before an abort or loss is reported.
    pub fn recv(&self, peer: usize, timeout: Duration) -> Result<Frame, RecvFailure> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(frame) = state.queues[peer].pop_front() {
                return Ok(frame);
            }
            if let Some((origin, msg)) = &state.abort {
                return Err(RecvFailure::Aborted(*origin, msg.clone()));
            }
            if state.lost[peer] {
                return Err(RecvFailure::Lost);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RecvFailure::Timeout);
            }
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Posts a receive of the frame from `peer` whose header is exactly `header`: if it has
    /// not arrived yet, `peer`'s reader reads its payload straight into `dst` and files it as
    /// [`Payload::Landed`]. Returns the posting's id for [`Inbox::withdraw`].
    ///
    /// # Safety
    /// `dst` must be valid for writes of `header.len` bytes, and nothing else may read or
    /// write them, until the frame is received as landed or [`Inbox::withdraw`] returns true.
    pub unsafe fn post(&self, peer: usize, header: Header, dst: *mut u8) -> u64 {
        let mut state = self.lock();
        state.next_posting += 1;
        let id = state.next_posting;
        state.posted[peer].push(Posting {
            id,
            header,
            dst: Destination(dst),
        });
        id
    }

    /// Takes back posting `id` of `peer`: true once no reader can write into it any more,
    /// false if `peer`'s reader is still writing its payload at `deadline` (the caller then
    /// cuts the link, which ends the write, and asks again).
    pub fn withdraw(&self, peer: usize, id: u64, deadline: Option<Instant>) -> bool {
        let mut state = self.lock();
        state.posted[peer].retain(|p| p.id != id);
        let waiting = |s: &mut InboxState| s.landing[peer] == Some(id);
        !super::wait_while(&self.arrived, state, deadline, waiting).1
    }

    /// For `peer`'s reader, holding a data frame's `header`: where to read its payload, if a
    /// receive was posted for exactly that frame (it is then being landed until
    /// [`Inbox::landed`]).
    pub(super) fn claim(&self, peer: usize, header: &Header) -> Option<*mut u8> {
        let mut state = self.lock();
        let at = state.posted[peer]
            .iter()
            .position(|p| p.header == *header)?;
        let posting = state.posted[peer].swap_remove(at);
        state.landing[peer] = Some(posting.id);
        Some(posting.dst.0)
    }

    /// For `peer`'s reader: the claimed payload is written (`ok`) or its read failed.
    pub(super) fn landed(&self, peer: usize, header: Header, ok: bool) {
        let mut state = self.lock();
        state.landing[peer] = None;
        if ok {
            state.queues[peer].push_back(Frame {
                header,
                payload: Payload::Landed,
            });
        }
        self.arrived.notify_all();
    }

    pub(super) fn push(&self, peer: usize, frame: Frame) {
        let mut state = self.lock();
        if frame.header.kind == KIND_ABORT {
            if state.abort.is_none() {
                let msg = match &frame.payload {
                    Payload::Bytes(b) => String::from_utf8_lossy(b.as_slice()).into_owned(),
                    Payload::Landed => String::new(),
                };
                state.abort = Some((peer, msg));
            }
            drop(state);
            self.wake();
            self.arrived.notify_all();
            return;
        }
        state.queues[peer].push_back(frame);
        self.arrived.notify_all();
    }

    pub(super) fn mark_lost(&self, peer: usize) {
        let mut state = self.lock();
        state.lost[peer] = true;
        drop(state);
        self.wake();
        self.arrived.notify_all();
    }
}
