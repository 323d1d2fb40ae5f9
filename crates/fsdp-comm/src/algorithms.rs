//! The collectives, run on a group's communication thread: ring algorithms for bandwidth
//! (each rank moves (n-1)/n of the data for all-gather and reduce-scatter), a direct exchange
//! for small all-reduces, and mismatch and failure handling.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::dtype::{DType, Element, ReduceOp, as_bytes, as_bytes_mut, finish_avg, reduce_into};
use crate::error::{CommError, Result};
use crate::shm::{InFrame, OutFrame, Segment, Sink, TransferError};
use crate::transport::{Header, KIND_DATA, Links, RecvFailure};

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
    fn links(&self) -> &Links {
        match self {
            Net::Tcp(l) | Net::Shm { links: l, .. } => l,
        }
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
type Out<'a> = (usize, u32, &'a [u8]);

/// One frame to receive in a transfer: the expected byte length and where the bytes go
/// (called with each piece's offset).
struct In<'a> {
    peer: usize,
    step: u32,
    len: usize,
    sink: Sink<'a>,
}

/// Collective kinds on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    Gather = 5,
    Scatter = 6,
    Barrier = 7,
    SendRecv = 8,
    AllGatherV = 9,
}

const OP_NAMES: [&str; 10] = [
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
];

/// All-reduces of at most this many bytes exchange whole buffers directly (one round).
const DIRECT_ALL_REDUCE_BYTES: usize = 64 << 10;

fn describe(h: &Header) -> String {
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
    rank: usize,
    size: usize,
    global_ranks: Vec<usize>,
    net: Net,
    timeout: Duration,
    seq: u64,
    sent: Vec<u64>,
    received: Vec<u64>,
    failed: Option<CommError>,
    current: Option<Header>,
    bytes_sent: Arc<AtomicU64>,
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

    fn me(&self) -> usize {
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

    fn begin<T: Element>(&mut self, op: Op, count: usize, reduce: Option<ReduceOp>) -> Header {
        self.seq += 1;
        let h = Header {
            kind: KIND_DATA,
            op: op as u8,
            dtype: T::DTYPE as u8,
            reduce: reduce.map_or(0, |r| r as u8),
            step: 0,
            seq: self.seq,
            count: count as u64,
            len: 0,
        };
        self.current = Some(h);
        h
    }

    fn invalid(&self, op: &str, reason: String) -> CommError {
        CommError::InvalidArgument {
            rank: self.me(),
            op: op.into(),
            reason,
        }
    }

    fn lost(&self, peer: usize) -> CommError {
        CommError::PeerLost {
            rank: self.me(),
            peer: self.global_ranks[peer],
            op: self.current.as_ref().map(describe),
        }
    }

    fn aborted(&self, origin: usize, message: String) -> CommError {
        CommError::Aborted {
            rank: self.me(),
            origin: self.global_ranks[origin],
            message,
        }
    }

    /// Checks a received header against what this rank expects.
    fn check_header(&self, peer: usize, want: &Header, got: &Header, len: usize) -> Result<()> {
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
    fn transfer(&mut self, h: Header, outs: &[Out<'_>], ins: Vec<In<'_>>) -> Result<()> {
        let payload: usize = outs.iter().map(|(_, _, data)| data.len()).sum();
        self.bytes_sent.fetch_add(payload as u64, Ordering::Relaxed);
        let with = |step: u32, len: usize| Header {
            step,
            len: len as u64,
            ..h
        };
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
                            r.sink,
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

    /// [`Engine::transfer`] over the TCP links: sends are queued to the writer threads (so
    /// they never wait for the receiver), receives wait on the inbox.
    fn transfer_over_links(
        &self,
        links: &Links,
        h: Header,
        outs: &[Out<'_>],
        ins: Vec<In<'_>>,
    ) -> Result<()> {
        let with = |step: u32, len: usize| Header {
            step,
            len: len as u64,
            ..h
        };
        for &(peer, step, data) in outs {
            if !links.send(peer, with(step, data.len()), data.to_vec()) {
                return Err(self.lost(peer));
            }
        }
        for mut r in ins {
            let want = with(r.step, r.len);
            match links.inbox.recv(r.peer, self.timeout) {
                Ok(frame) => {
                    self.check_header(r.peer, &want, &frame.header, r.len)?;
                    (r.sink)(0, frame.payload.as_slice());
                }
                Err(RecvFailure::Lost) => return Err(self.lost(r.peer)),
                Err(RecvFailure::Aborted(origin, message)) => {
                    return Err(self.aborted(origin, message));
                }
                Err(RecvFailure::Timeout) => return Err(self.timed_out(&want, r.peer)),
            }
        }
        Ok(())
    }

    fn timed_out(&self, h: &Header, peer: usize) -> CommError {
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
    fn into_slice<'a, T: Element>(peer: usize, step: u32, dst: &'a mut [T]) -> In<'a> {
        let bytes = as_bytes_mut(dst);
        In {
            peer,
            step,
            len: bytes.len(),
            sink: Box::new(move |off, piece| bytes[off..off + piece.len()].copy_from_slice(piece)),
        }
    }

    /// A receive that reduces into `dst`.
    fn reducing<'a, T: Element>(peer: usize, step: u32, dst: &'a mut [T], op: ReduceOp) -> In<'a> {
        let size = std::mem::size_of::<T>();
        let len = std::mem::size_of_val(dst);
        In {
            peer,
            step,
            len,
            sink: Box::new(move |off, piece| {
                let start = off / size;
                let src = cast::<T>(piece);
                reduce_into(&mut dst[start..start + src.len()], src, op);
            }),
        }
    }

    /// One ring step: send `buf[send]` to the next rank while receiving the previous rank's
    /// part into `buf[recv]` (copied, or reduced with `op`).
    fn ring_step<T: Element>(
        &mut self,
        h: Header,
        step: u32,
        buf: &mut [T],
        send: (usize, usize),
        recv: (usize, usize),
        op: Option<ReduceOp>,
    ) -> Result<()> {
        let (next, prev) = (self.next(), self.prev());
        let (send_part, recv_part) = disjoint(buf, send, recv);
        let sink = match op {
            Some(op) => Self::reducing(prev, step, recv_part, op),
            None => Self::into_slice(prev, step, recv_part),
        };
        self.transfer(h, &[(next, step, as_bytes(send_part))], vec![sink])
    }

    /// Every other group rank.
    fn others(&self) -> Vec<usize> {
        (0..self.size).filter(|p| *p != self.rank).collect()
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn prev(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// Ring reduce-scatter over `parts` (the chunk boundaries); on return this rank's part
    /// `rank` holds the reduction of every rank's part `rank`.
    fn ring_reduce_scatter<T: Element>(
        &mut self,
        h: Header,
        buf: &mut [T],
        parts: &[(usize, usize)],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size;
        for s in 0..n - 1 {
            let send = (self.rank + 2 * n - 1 - s) % n;
            let recv = (self.rank + 2 * n - 2 - s) % n;
            self.ring_step(h, s as u32, buf, parts[send], parts[recv], Some(op))?;
        }
        Ok(())
    }

    /// Ring all-gather: part `rank` of `buf` is this rank's; on return every part is filled.
    fn ring_all_gather<T: Element>(
        &mut self,
        h: Header,
        buf: &mut [T],
        parts: &[(usize, usize)],
        first_step: u32,
    ) -> Result<()> {
        let n = self.size;
        for s in 0..n - 1 {
            let send = (self.rank + n - s) % n;
            let recv = (self.rank + 2 * n - 1 - s) % n;
            self.ring_step(
                h,
                first_step + s as u32,
                buf,
                parts[send],
                parts[recv],
                None,
            )?;
        }
        Ok(())
    }

    /// See [`crate::ProcessGroup::all_reduce`].
    pub fn all_reduce<T: Element>(&mut self, mut buf: Vec<T>, op: ReduceOp) -> Result<Vec<T>> {
        let h = self.begin::<T>(Op::AllReduce, buf.len(), Some(op));
        let n = self.size;
        if n == 1 || buf.is_empty() {
            finish_avg(&mut buf, op, n);
            return Ok(buf);
        }
        if std::mem::size_of_val(buf.as_slice()) <= DIRECT_ALL_REDUCE_BYTES {
            // Everyone gets everyone's buffer and reduces in rank order: identical results.
            let mine = std::mem::take(&mut buf);
            let mut received: Vec<Vec<T>> = (0..n)
                .map(|p| {
                    if p == self.rank {
                        Vec::new()
                    } else {
                        vec![T::default(); mine.len()]
                    }
                })
                .collect();
            let others = self.others();
            let outs: Vec<Out> = others.iter().map(|&p| (p, 0, as_bytes(&mine))).collect();
            let ins = received
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != self.rank)
                .map(|(p, v)| Self::into_slice(p, 0, v.as_mut_slice()))
                .collect();
            self.transfer(h, &outs, ins)?;
            let mut out = if self.rank == 0 {
                mine.clone()
            } else {
                std::mem::take(&mut received[0])
            };
            for (p, contribution) in received.iter().enumerate().skip(1) {
                reduce_into(
                    &mut out,
                    if p == self.rank { &mine } else { contribution },
                    op,
                );
            }
            finish_avg(&mut out, op, n);
            return Ok(out);
        }
        let parts = split(buf.len(), n);
        self.ring_reduce_scatter(h, &mut buf, &parts, op)?;
        let (a, b) = parts[self.rank];
        finish_avg(&mut buf[a..b], op, n);
        self.ring_all_gather(h, &mut buf, &parts, n as u32)?;
        Ok(buf)
    }

    /// See [`crate::ProcessGroup::all_gather`].
    pub fn all_gather<T: Element>(&mut self, input: Vec<T>) -> Result<Vec<T>> {
        self.all_gather_into(input, Vec::new()).map(|(_, out)| out)
    }

    /// See [`crate::ProcessGroup::all_gather_into`].
    pub fn all_gather_into<T: Element>(
        &mut self,
        input: Vec<T>,
        out: Vec<T>,
    ) -> Result<(Vec<T>, Vec<T>)> {
        let counts = vec![input.len(); self.size];
        self.gather_parts(Op::AllGather, input, out, &counts)
    }

    /// See [`crate::ProcessGroup::all_gather_v`].
    pub fn all_gather_v<T: Element>(
        &mut self,
        input: Vec<T>,
        counts: Vec<usize>,
    ) -> Result<Vec<T>> {
        if counts.len() != self.size || counts[self.rank] != input.len() {
            return Err(self.invalid(
                "all_gather_v",
                format!(
                    "counts {counts:?} must have one entry per rank ({}) and entry {} must equal the input length {}",
                    self.size,
                    self.rank,
                    input.len()
                ),
            ));
        }
        self.gather_parts(Op::AllGatherV, input, Vec::new(), &counts)
            .map(|(_, out)| out)
    }

    fn gather_parts<T: Element>(
        &mut self,
        op: Op,
        input: Vec<T>,
        mut out: Vec<T>,
        counts: &[usize],
    ) -> Result<(Vec<T>, Vec<T>)> {
        let total: usize = counts.iter().sum();
        let h = self.begin::<T>(op, total, None);
        let mut parts = Vec::with_capacity(counts.len());
        let mut start = 0;
        for c in counts {
            parts.push((start, start + c));
            start += c;
        }
        out.resize(total, T::default());
        let (a, b) = parts[self.rank];
        out[a..b].copy_from_slice(&input);
        if self.size > 1 {
            self.ring_all_gather(h, &mut out, &parts, 0)?;
        }
        Ok((input, out))
    }

    /// See [`crate::ProcessGroup::reduce_scatter`].
    pub fn reduce_scatter<T: Element>(&mut self, input: Vec<T>, op: ReduceOp) -> Result<Vec<T>> {
        self.reduce_scatter_into(input, Vec::new(), op)
            .map(|(_, out)| out)
    }

    /// See [`crate::ProcessGroup::reduce_scatter_into`].
    pub fn reduce_scatter_into<T: Element>(
        &mut self,
        mut input: Vec<T>,
        mut out: Vec<T>,
        op: ReduceOp,
    ) -> Result<(Vec<T>, Vec<T>)> {
        let n = self.size;
        if input.len() % n != 0 {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "input length {} is not a multiple of the group size {n}",
                    input.len()
                ),
            ));
        }
        let h = self.begin::<T>(Op::ReduceScatter, input.len(), Some(op));
        let k = input.len() / n;
        let parts: Vec<(usize, usize)> = (0..n).map(|r| (r * k, (r + 1) * k)).collect();
        if n > 1 && k > 0 {
            self.ring_reduce_scatter(h, &mut input, &parts, op)?;
        }
        let (a, b) = parts[self.rank];
        out.clear();
        out.extend_from_slice(&input[a..b]);
        finish_avg(&mut out, op, n);
        Ok((input, out))
    }

    /// See [`crate::ProcessGroup::broadcast`].
    pub fn broadcast<T: Element>(&mut self, mut buf: Vec<T>, root: usize) -> Result<Vec<T>> {
        self.check_root("broadcast", root)?;
        let h = self.begin::<T>(Op::Broadcast, buf.len(), None);
        if self.rank == root {
            let outs: Vec<Out> = self
                .others()
                .into_iter()
                .map(|p| (p, 0, as_bytes(&buf)))
                .collect();
            self.transfer(h, &outs, Vec::new())?;
        } else {
            self.transfer(h, &[], vec![Self::into_slice(root, 0, &mut buf)])?;
        }
        Ok(buf)
    }

    /// See [`crate::ProcessGroup::gather`].
    pub fn gather<T: Element>(&mut self, input: Vec<T>, root: usize) -> Result<Option<Vec<T>>> {
        self.check_root("gather", root)?;
        let k = input.len();
        let h = self.begin::<T>(Op::Gather, k * self.size, None);
        if self.rank != root {
            self.transfer(h, &[(root, 0, as_bytes(&input))], Vec::new())?;
            return Ok(None);
        }
        let mut out = vec![T::default(); k * self.size];
        out[root * k..(root + 1) * k].copy_from_slice(&input);
        {
            let mut parts: Vec<&mut [T]> = Vec::with_capacity(self.size);
            let mut rest = out.as_mut_slice();
            for _ in 0..self.size {
                let (part, tail) = rest.split_at_mut(k);
                parts.push(part);
                rest = tail;
            }
            let ins = parts
                .into_iter()
                .enumerate()
                .filter(|(peer, _)| *peer != root)
                .map(|(peer, part)| Self::into_slice(peer, 0, part))
                .collect();
            self.transfer(h, &[], ins)?;
        }
        Ok(Some(out))
    }

    /// See [`crate::ProcessGroup::scatter`].
    pub fn scatter<T: Element>(&mut self, input: Vec<T>, k: usize, root: usize) -> Result<Vec<T>> {
        self.check_root("scatter", root)?;
        if self.rank == root && input.len() != k * self.size {
            return Err(self.invalid(
                "scatter",
                format!(
                    "root input has {} elements, expected {k} x {} ranks",
                    input.len(),
                    self.size
                ),
            ));
        }
        let h = self.begin::<T>(Op::Scatter, k * self.size, None);
        if self.rank == root {
            let outs: Vec<Out> = self
                .others()
                .into_iter()
                .map(|p| (p, 0, as_bytes(&input[p * k..(p + 1) * k])))
                .collect();
            self.transfer(h, &outs, Vec::new())?;
            return Ok(input[root * k..(root + 1) * k].to_vec());
        }
        let mut out = vec![T::default(); k];
        self.transfer(h, &[], vec![Self::into_slice(root, 0, &mut out)])?;
        Ok(out)
    }

    /// See [`crate::ProcessGroup::barrier`].
    pub fn barrier(&mut self) -> Result<()> {
        let h = self.begin::<u8>(Op::Barrier, 0, None);
        let others = self.others();
        let outs: Vec<Out> = others.iter().map(|&p| (p, 0, &[][..])).collect();
        let ins = others
            .iter()
            .map(|&p| Self::into_slice::<u8>(p, 0, &mut []))
            .collect();
        self.transfer(h, &outs, ins)
    }

    /// Point-to-point messages are numbered per direction and peer, apart from collectives.
    fn p2p_header<T: Element>(&mut self, peer: usize, count: usize, sending: bool) -> Header {
        let counter = if sending {
            &mut self.sent[peer]
        } else {
            &mut self.received[peer]
        };
        *counter += 1;
        let seq = *counter;
        let h = Header {
            kind: KIND_DATA,
            op: Op::SendRecv as u8,
            dtype: T::DTYPE as u8,
            reduce: 0,
            step: 0,
            seq,
            count: count as u64,
            len: 0,
        };
        self.current = Some(h);
        h
    }

    /// See [`crate::ProcessGroup::send`].
    pub fn send<T: Element>(&mut self, buf: Vec<T>, dst: usize) -> Result<()> {
        self.check_peer("send", dst)?;
        let h = self.p2p_header::<T>(dst, buf.len(), true);
        // Point-to-point always goes over the links: a send must not wait for its receiver
        // (the two may be queued behind each other's sends), which a bounded ring cannot
        // promise.
        self.bytes_sent.fetch_add(
            std::mem::size_of_val(buf.as_slice()) as u64,
            Ordering::Relaxed,
        );
        self.transfer_over_links(self.net.links(), h, &[(dst, 0, as_bytes(&buf))], Vec::new())
    }

    /// See [`crate::ProcessGroup::recv`].
    pub fn recv<T: Element>(&mut self, len: usize, src: usize) -> Result<Vec<T>> {
        self.check_peer("recv", src)?;
        let h = self.p2p_header::<T>(src, len, false);
        let mut out = vec![T::default(); len];
        let ins = vec![Self::into_slice(src, 0, &mut out)];
        self.transfer_over_links(self.net.links(), h, &[], ins)?;
        Ok(out)
    }

    fn check_root(&self, op: &str, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(self.invalid(
                op,
                format!("root {root} is not a rank of this group of {}", self.size),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(self.invalid(
                op,
                format!("peer {peer} must be another rank below {}", self.size),
            ));
        }
        Ok(())
    }
}

/// `buf[send]` to read and `buf[recv]` to write, for ranges that do not overlap.
fn disjoint<T>(buf: &mut [T], send: (usize, usize), recv: (usize, usize)) -> (&[T], &mut [T]) {
    if send.1 <= recv.0 {
        let (a, b) = buf.split_at_mut(recv.0);
        (&a[send.0..send.1], &mut b[..recv.1 - recv.0])
    } else {
        let (a, b) = buf.split_at_mut(send.0);
        (&b[..send.1 - send.0], &mut a[recv.0..recv.1])
    }
}

/// `len` elements split into `n` contiguous parts differing by at most one element.
fn split(len: usize, n: usize) -> Vec<(usize, usize)> {
    let (base, extra) = (len / n, len % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let size = base + usize::from(i < extra);
            let part = (start, start + size);
            start += size;
            part
        })
        .collect()
}

/// Reads aligned payload bytes as elements.
fn cast<T: Element>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    debug_assert_eq!(bytes.as_ptr() as usize % std::mem::align_of::<T>(), 0);
    // SAFETY: payloads are 8-byte aligned (`AlignedBytes`), `Element`s are plain old data, and
    // the length is truncated to whole elements.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / size) }
}
