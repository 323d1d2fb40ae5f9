//! A transfer over the TCP links without copies of its own for large pieces: writer threads
//! send straight from the caller's buffers, reader threads read straight into receives
//! posted for them, and the transfer takes both back before it returns.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Engine, In, Out, Target, pieces};
use crate::error::Result;
use crate::shm::Sink;
use crate::transport::{Header, Leases, Links, Payload, RecvFailure};

/// Pieces of at most this many bytes are sent as copies the writer owns: copying them costs
/// less than waiting for the writer to finish with the caller's bytes (a broadcast of 4-16
/// KiB took 10-20% longer lent).
const COPIED_SENDS: usize = 64 << 10;

impl Engine {
    /// [`Engine::transfer`] over the TCP links. The writer threads send straight from the
    /// caller's buffers, pieces over [`COPIED_SENDS`] bytes (so a send never waits for its
    /// receiver's engine, only for its reader thread), and a receive into bytes is posted
    /// first, so the reader thread reads each piece straight into them if it arrives after
    /// the posting; the transfer returns once every send is written and every posting taken
    /// back. A transfer travels as pieces of at most [`super::PIECE_BYTES`], so a piece a
    /// receiver reduces (or copies, when it came before its posting) overlaps the next one
    /// on the wire.
    pub(crate) fn transfer_over_links(
        &self,
        links: &Links,
        h: Header,
        outs: &[Out<'_>],
        ins: Vec<In<'_>>,
    ) -> Result<()> {
        let mut open = OpenTransfer {
            links,
            timeout: self.timeout,
            leases: Leases::new(self.size),
            posted: Vec::new(),
        };
        // Receives into bytes become raw destinations here, so that the reader thread's
        // writes and this thread's copies go through the same pointer.
        let mut receives = Vec::with_capacity(ins.len());
        for r in ins {
            let into = match r.target {
                Target::Bytes(bytes) => {
                    let at = bytes.as_mut_ptr().cast::<u8>();
                    let mut ids = Vec::new();
                    for (part, range) in pieces(r.len) {
                        let want = h.frame(r.step, part, range.len());
                        // SAFETY: `at` is valid for `r.len` bytes for the whole call (the
                        // borrow is consumed here), and `open` withdraws every posting before
                        // the call returns or unwinds; nothing else touches the bytes.
                        let id = unsafe { links.inbox.post(r.peer, want, at.add(range.start)) };
                        open.posted.push((r.peer, id));
                        ids.push(id);
                    }
                    Landing::Bytes(at, ids)
                }
                Target::Sink(sink) => Landing::Sink(sink),
            };
            receives.push((r.peer, r.step, r.len, into));
        }
        for &(peer, step, data) in outs {
            for (part, range) in pieces(data.len()) {
                let header = h.frame(step, part, range.len());
                let queued = if range.len() <= COPIED_SENDS {
                    links.send(peer, header, data[range].to_vec())
                } else {
                    let lease = open.leases.lend(peer);
                    // SAFETY: `outs` is borrowed for the whole call and only read, and `open`
                    // waits for every lease before the call returns or unwinds.
                    unsafe { links.send_lent(peer, header, &data[range], lease) }
                };
                if !queued {
                    return Err(self.lost(peer));
                }
            }
        }
        for (peer, step, len, mut into) in receives {
            for (part, range) in pieces(len) {
                let want = h.frame(step, part, range.len());
                let frame = match links.inbox.recv(peer, self.timeout) {
                    Ok(frame) => frame,
                    Err(RecvFailure::Lost) => return Err(self.lost(peer)),
                    Err(RecvFailure::Aborted(origin, message)) => {
                        return Err(self.aborted(origin, message));
                    }
                    Err(RecvFailure::Timeout) => return Err(self.timed_out(&want, peer)),
                };
                self.check_header(peer, &want, &frame.header, range.len())?;
                let Payload::Bytes(bytes) = frame.payload else {
                    // Landed in place: only a posting of exactly this header is written into.
                    continue;
                };
                match &mut into {
                    Landing::Bytes(at, ids) => {
                        open.take_back(peer, ids[part as usize]);
                        // SAFETY: the piece's range lies in the destination, whose posting for
                        // it is withdrawn: no reader writes there.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes.as_slice().as_ptr(),
                                at.add(range.start),
                                range.len(),
                            )
                        }
                    }
                    Landing::Sink(sink) => sink(range.start, bytes.as_slice()),
                }
            }
        }
        // Done only once every send is out of the caller's buffers, and written: the bytes
        // of a link that failed are not sent.
        match open.leases.wait(Some(Instant::now() + self.timeout)) {
            Ok(None) => Ok(()),
            Ok(Some(peer)) => Err(self.lost(peer)),
            Err(peer) => {
                open.cut_sends();
                Err(self.timed_out(&h.frame(0, 0, 0), peer))
            }
        }
    }
}

/// Where a TCP receive's pieces go once its posting is made: raw bytes or a sink.
enum Landing<'a> {
    /// The destination and its pieces' posting ids.
    Bytes(*mut u8, Vec<u64>),
    Sink(Sink<'a>),
}

/// A transfer over the links in progress: what it has lent to writer threads and posted to
/// reader threads, all taken back when it is dropped — on return, error or unwind — so no
/// thread touches the caller's buffers after the transfer.
struct OpenTransfer<'l> {
    links: &'l Links,
    timeout: Duration,
    leases: Arc<Leases>,
    /// (peer, posting id) of every receive posted.
    posted: Vec<(usize, u64)>,
}

impl OpenTransfer<'_> {
    /// Takes back posting `id` of `peer`, waiting for a write into it to end (a write past
    /// the transfer's timeout is ended by cutting the link).
    fn take_back(&self, peer: usize, id: u64) {
        let deadline = Instant::now() + self.timeout;
        if !self.links.inbox.withdraw(peer, id, Some(deadline)) {
            self.links.cut(peer);
            self.links.inbox.withdraw(peer, id, None);
        }
    }

    /// Cuts the links whose writers still hold a lent payload, and waits for them to let go.
    fn cut_sends(&self) {
        for peer in self.leases.peers_out() {
            self.links.cut(peer);
        }
        let _ = self.leases.wait(None);
    }
}

impl Drop for OpenTransfer<'_> {
    fn drop(&mut self) {
        // Each wait is bounded by the transfer's timeout; a peer that stops reading (or
        // sending mid-frame) has its link cut, which ends the blocked call at once.
        if self
            .leases
            .wait(Some(Instant::now() + self.timeout))
            .is_err()
        {
            self.cut_sends();
        }
        for &(peer, id) in &self.posted {
            self.take_back(peer, id);
        }
    }
}
