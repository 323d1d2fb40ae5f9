//! The wire protocol of a process group's communication thread: frames with a header that
//! carries the collective's sequence number, kind, dtype, size and step; transfers that
//! progress every send and receive of a step together (shared memory or TCP links); header
//! checks that turn a mismatch into an error naming both calls; and the abort that stops
//! every rank after the first failure. The algorithms are built on it.

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::dtype::{
    DType, Element, ReduceOp, STREAM_BYTES, as_uninit_mut, reduce_into, reduce_into_finished,
    reduce_pair_into, reduce_pair_streaming, stream_copy, uninit_bytes_mut, write_copy,
};
use crate::error::{CommError, Result};
use crate::shm::{InFrame, OutFrame, Segment, Sink, TransferError};
use crate::transport::{Header, KIND_DATA, Links};

mod over_links;

/// How a group's ranks reach each other.
pub enum Net {
    /// TCP links only.
    Tcp(Links),
    /// Shared memory for data; the TCP links stay open to notice peers that die.
    Shm {
        /// The group's segment.
        seg: Arc<Segment>,
        /// Liveness (and abort) links.
        links: Links,
    },
}

impl Net {
    pub(crate) fn links(&self) -> &Links {
        match self {
            Net::Tcp(l) | Net::Shm { links: l, .. } => l,
        }
    }

    /// Whether a transfer of sends alone completes while the peers' engines receive
    /// nothing (the TCP links' reader threads take every frame; shared memory's rings hold
    /// only so much): then a buffer may send everything in one transfer and receive into the
    /// bytes it sent in the next. Either way a transfer returns only once its sends are out
    /// of the caller's buffers.
    pub(crate) fn sends_complete_alone(&self) -> bool {
        matches!(self, Net::Tcp(_))
    }

    /// Which transport carries data, for reports.
    pub fn kind(&self) -> &'static str {
        match self {
            Net::Tcp(_) => "tcp",
            Net::Shm { .. } => "shm",
        }
    }
}

/// One frame to send in a transfer: (peer, step, bytes).
pub(crate) type Out<'a> = (usize, u32, &'a [u8]);

/// One frame to receive in a transfer: the expected byte length and where the bytes go.
pub(crate) struct In<'a> {
    pub(crate) peer: usize,
    pub(crate) step: u32,
    pub(crate) len: usize,
    pub(crate) target: Target<'a>,
}

/// Where a received frame's bytes go.
pub(crate) enum Target<'a> {
    /// Copied into these bytes, which over TCP a reader thread writes straight into. They
    /// may be uninitialised: a receive writes every one of them before the transfer returns
    /// `Ok`, so a fresh output needs no zero fill first.
    Bytes(&'a mut [MaybeUninit<u8>]),
    /// Handed to the sink piece by piece with each piece's offset (reductions).
    Sink(Sink<'a>),
}

impl<'a> Target<'a> {
    /// The target as a sink of pieces.
    fn into_sink(self) -> Sink<'a> {
        match self {
            Target::Bytes(bytes) if bytes.len() >= STREAM_BYTES => Box::new(move |off, piece| {
                stream_copy(&mut bytes[off..off + piece.len()], piece);
            }),
            Target::Bytes(bytes) => Box::new(move |off, piece| {
                write_copy(&mut bytes[off..off + piece.len()], piece);
            }),
            Target::Sink(sink) => sink,
        }
    }
}

/// Collective kinds on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Op {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    Gather = 5,
    Scatter = 6,
    Barrier = 7,
    SendRecv = 8,
    AllGatherV = 9,
    AllToAll = 10,
}

const OP_NAMES: [&str; 11] = [
    "?",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "gather",
    "scatter",
    "barrier",
    "send/recv",
    "all_gather_v",
    "all_to_all",
];

pub(crate) fn describe(h: &Header) -> String {
    let op = OP_NAMES.get(h.op as usize).copied().unwrap_or("?");
    let dtype =
        DType::from_u8(h.dtype).map_or("?".to_string(), |d| format!("{d:?}").to_lowercase());
    let reduce = match h.reduce {
        1 => ", sum",
        2 => ", avg",
        3 => ", max",
        4 => ", min",
        _ => "",
    };
    format!(
        "{op}({dtype} x {}{reduce}) as collective #{}",
        h.count, h.seq
    )
}

/// The state a group's communication thread owns.
pub struct Engine {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) global_ranks: Vec<usize>,
    pub(crate) net: Net,
    pub(crate) timeout: Duration,
    pub(crate) seq: u64,
    pub(crate) sent: Vec<u64>,
    pub(crate) received: Vec<u64>,
    pub(crate) failed: Option<CommError>,
    pub(crate) current: Option<Header>,
    pub(crate) bytes_sent: Arc<AtomicU64>,
}

/// The largest frame a TCP transfer is cut into (a multiple of every element's size, so
/// each piece is whole elements): 1 MiB is 8 ms at 1 Gbit/s, long against the copies it
/// hides, short against a 64 MiB transfer.
pub(crate) const PIECE_BYTES: usize = 1 << 20;

/// The pieces of a transfer of `len` bytes: (index, byte range); one empty piece for `len` 0.
fn pieces(len: usize) -> impl Iterator<Item = (u32, std::ops::Range<usize>)> {
    let n = len.div_ceil(PIECE_BYTES).max(1);
    (0..n).map(move |i| {
        let start = i * PIECE_BYTES;
        (i as u32, start..(start + PIECE_BYTES).min(len))
    })
}

impl Engine {
    /// An engine for group rank `rank` of `global_ranks.len()` ranks.
    pub fn new(rank: usize, global_ranks: Vec<usize>, net: Net, timeout: Duration) -> Engine {
        let size = global_ranks.len();
        Engine {
            rank,
            size,
            global_ranks,
            net,
            timeout,
            seq: 0,
            sent: vec![0; size],
            received: vec![0; size],
            failed: None,
            current: None,
            bytes_sent: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A counter of the payload bytes this rank has sent (headers excluded), shared with the
    /// group so callers can measure traffic against theory.
    pub fn bytes_sent(&self) -> Arc<AtomicU64> {
        self.bytes_sent.clone()
    }

    pub(crate) fn me(&self) -> usize {
        self.global_ranks[self.rank]
    }

    /// Runs one operation. After the first failure the group is broken: peers are told, and
    /// every later operation fails with the same error instead of hanging.
    pub fn run<T>(&mut self, f: impl FnOnce(&mut Engine) -> Result<T>) -> Result<T> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let result = f(self);
        self.current = None;
        if let Err(err) = &result {
            // Even a bad argument breaks the group: the other ranks are already inside the
            // collective and would otherwise wait for this rank until they time out.
            let message = err.to_string();
            if let Net::Shm { seg, .. } = &self.net {
                seg.abort(self.rank, &message);
            }
            self.net.links().broadcast_abort(&message);
            self.failed = Some(err.clone());
        }
        result
    }

    pub(crate) fn begin<T: Element>(
        &mut self,
        op: Op,
        count: usize,
        reduce: Option<ReduceOp>,
    ) -> Header {
        self.seq += 1;
        let h = Header {
            kind: KIND_DATA,
            op: op as u8,
            dtype: T::DTYPE as u8,
            reduce: reduce.map_or(0, |r| r as u8),
            step: 0,
            part: 0,
            seq: self.seq,
            count: count as u64,
            len: 0,
        };
        self.current = Some(h);
        h
    }

    pub(crate) fn invalid(&self, op: &str, reason: String) -> CommError {
        CommError::InvalidArgument {
            rank: self.me(),
            op: op.into(),
            reason,
        }
    }

    pub(crate) fn lost(&self, peer: usize) -> CommError {
        CommError::PeerLost {
            rank: self.me(),
            peer: self.global_ranks[peer],
            op: self.current.as_ref().map(describe),
        }
    }

    pub(crate) fn aborted(&self, origin: usize, message: String) -> CommError {
        CommError::Aborted {
            rank: self.me(),
            origin: self.global_ranks[origin],
            message,
        }
    }

    /// Checks a received header against what this rank expects.
    pub(crate) fn check_header(
        &self,
        peer: usize,
        want: &Header,
        got: &Header,
        len: usize,
    ) -> Result<()> {
        if !got.same_collective(want) {
            return Err(CommError::Mismatch {
                rank: self.me(),
                peer: self.global_ranks[peer],
                mine: describe(want),
                theirs: describe(got),
            });
        }
        if got.len as usize != len {
            return Err(CommError::InvalidArgument {
                rank: self.me(),
                op: describe(want),
                reason: format!(
                    "rank {} sent {} bytes where this rank expected {len}: ranks passed buffers of different sizes",
                    self.global_ranks[peer], got.len
                ),
            });
        }
        Ok(())
    }

    /// Sends and receives frames of the current collective, progressing all of them together.
    pub(crate) fn transfer(&mut self, h: Header, outs: &[Out<'_>], ins: Vec<In<'_>>) -> Result<()> {
        let payload: usize = outs.iter().map(|(_, _, data)| data.len()).sum();
        self.bytes_sent.fetch_add(payload as u64, Ordering::Relaxed);
        let with = |step: u32, len: usize| h.frame(step, 0, len);
        match &self.net {
            Net::Tcp(links) => self.transfer_over_links(links, h, outs, ins),
            Net::Shm { seg, links } => {
                let mut out_frames: Vec<OutFrame> = outs
                    .iter()
                    .map(|&(peer, step, data)| {
                        OutFrame::new(peer, with(step, data.len()).encode(), data)
                    })
                    .collect();
                let refused: RefCell<Option<CommError>> = RefCell::new(None);
                let this = &*self;
                let mut in_frames: Vec<InFrame> = ins
                    .into_iter()
                    .map(|r| {
                        let want = with(r.step, r.len);
                        let (peer, len, refused) = (r.peer, r.len, &refused);
                        InFrame::new(
                            peer,
                            move |bytes| {
                                let got = Header::decode(bytes)
                                    .ok_or_else(|| "corrupt header".to_string());
                                let checked = got
                                    .map_err(|m| CommError::Io {
                                        rank: this.me(),
                                        what: describe(&want),
                                        message: m,
                                    })
                                    .and_then(|got| this.check_header(peer, &want, &got, len));
                                match checked {
                                    Ok(()) => Some(len),
                                    Err(e) => {
                                        *refused.borrow_mut() = Some(e);
                                        None
                                    }
                                }
                            },
                            r.target.into_sink(),
                        )
                    })
                    .collect();
                let lost = |peer: usize| links.inbox.is_lost(peer);
                let result = seg.transfer(&mut out_frames, &mut in_frames, self.timeout, &lost);
                drop(in_frames);
                match result {
                    Ok(()) => Ok(()),
                    Err(TransferError::Refused(peer)) => {
                        Err(refused.into_inner().unwrap_or_else(|| self.lost(peer)))
                    }
                    Err(TransferError::Aborted(origin, message)) => {
                        Err(self.aborted(origin, message))
                    }
                    Err(TransferError::Lost(peer)) => Err(match links.inbox.abort_received() {
                        Some((origin, message)) => self.aborted(origin, message),
                        None => self.lost(peer),
                    }),
                    Err(TransferError::Timeout(peer)) => {
                        let want = with(0, 0);
                        Err(self.timed_out(&want, peer))
                    }
                }
            }
        }
    }

    pub(crate) fn timed_out(&self, h: &Header, peer: usize) -> CommError {
        CommError::Timeout {
            rank: self.me(),
            what: format!(
                "{} waiting for rank {}",
                describe(h),
                self.global_ranks[peer]
            ),
            timeout: self.timeout,
        }
    }

    /// A receive that copies into `dst`.
    pub(crate) fn into_slice<'a, T: Element>(peer: usize, step: u32, dst: &'a mut [T]) -> In<'a> {
        // SAFETY: a receive writes only bytes that arrived, never uninitialised ones, and
        // every byte pattern is a valid `Element`.
        Self::into_uninit(peer, step, unsafe { as_uninit_mut(dst) })
    }

    /// A receive that copies into `dst`, which need not be initialised: once the transfer
    /// returns `Ok` every element of it is written.
    pub(crate) fn into_uninit<'a, T: Element>(
        peer: usize,
        step: u32,
        dst: &'a mut [MaybeUninit<T>],
    ) -> In<'a> {
        let bytes = uninit_bytes_mut(dst);
        In {
            peer,
            step,
            len: bytes.len(),
            target: Target::Bytes(bytes),
        }
    }

    /// A receive of `count` elements of `T`, each piece handed to `apply` as elements with
    /// the index of its first.
    fn elements<'a, T: Element>(
        peer: usize,
        step: u32,
        count: usize,
        mut apply: impl FnMut(usize, &[T]) + 'a,
    ) -> In<'a> {
        let size = std::mem::size_of::<T>();
        In {
            peer,
            step,
            len: count * size,
            target: Target::Sink(Box::new(move |off, piece| {
                apply(off / size, cast::<T>(piece))
            })),
        }
    }

    /// A receive that reduces into `dst`, finished where `finish` gives the group size (an
    /// average divided as it is written: the last step of a reduction).
    pub(crate) fn reducing<'a, T: Element>(
        peer: usize,
        step: u32,
        dst: &'a mut [T],
        (op, finish): (ReduceOp, Option<usize>),
    ) -> In<'a> {
        Self::elements(peer, step, dst.len(), move |start, src: &[T]| {
            let dst = &mut dst[start..start + src.len()];
            match finish {
                Some(ranks) => reduce_into_finished(dst, src, op, ranks),
                None => reduce_into(dst, src, op),
            }
        })
    }

    /// A receive that writes `own` reduced with what arrives into `dst` (same length) and
    /// finished (an average divided by `ranks`), bit for bit what [`Engine::reducing`] into a
    /// copy of `own` and then [`crate::finish_avg`] give. `dst` may be uninitialised: once
    /// the transfer returns `Ok` every element of it is written.
    pub(crate) fn reducing_to<'a, T: Element>(
        peer: usize,
        step: u32,
        own: &'a [T],
        dst: &'a mut [MaybeUninit<T>],
        (op, ranks): (ReduceOp, usize),
    ) -> In<'a> {
        let reduce = if size_of_val(dst) >= STREAM_BYTES {
            reduce_pair_streaming::<T>
        } else {
            reduce_pair_into::<T>
        };
        Self::elements(peer, step, dst.len(), move |start, src: &[T]| {
            let end = start + src.len();
            reduce(&mut dst[start..end], &own[start..end], src, op, ranks)
        })
    }

    /// Every other group rank.
    pub(crate) fn others(&self) -> Vec<usize> {
        (0..self.size).filter(|p| *p != self.rank).collect()
    }

    pub(crate) fn next(&self) -> usize {
        (self.rank + 1) % self.size
    }

    pub(crate) fn prev(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    pub(crate) fn check_root(&self, op: &str, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(self.invalid(
                op,
                format!("root {root} is not a rank of this group of {}", self.size),
            ));
        }
        Ok(())
    }

    pub(crate) fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(self.invalid(
                op,
                format!("peer {peer} must be another rank below {}", self.size),
            ));
        }
        Ok(())
    }
}

/// Reads aligned payload bytes as elements.
pub(crate) fn cast<T: Element>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    debug_assert_eq!(bytes.as_ptr() as usize % std::mem::align_of::<T>(), 0);
    // SAFETY: payloads are 8-byte aligned (`AlignedBytes`), `Element`s are plain old data, and
    // the length is truncated to whole elements.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / size) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_a_transfer_in_order_with_one_for_nothing() {
        assert_eq!(pieces(0).collect::<Vec<_>>(), vec![(0, 0..0)]);
        let n = 2 * PIECE_BYTES + 3;
        let p: Vec<_> = pieces(n).collect();
        assert_eq!(
            p,
            vec![
                (0, 0..PIECE_BYTES),
                (1, PIECE_BYTES..2 * PIECE_BYTES),
                (2, 2 * PIECE_BYTES..n)
            ]
        );
        assert_eq!(pieces(PIECE_BYTES).count(), 1);
        // Every element size divides a piece, so no element is split between frames.
        assert!([1, 2, 4, 8].iter().all(|s| PIECE_BYTES.is_multiple_of(*s)));
    }
}
