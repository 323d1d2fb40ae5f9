//! The collectives, run on a group's communication thread: ring algorithms for bandwidth
//! (each rank moves (n-1)/n of the data for all-gather and reduce-scatter), a direct exchange
//! for small all-reduces, and mismatch and failure handling.

use std::time::Duration;

use crate::dtype::{DType, Element, ReduceOp, as_bytes, as_bytes_mut, finish_avg, reduce_into};
use crate::error::{CommError, Result};
use crate::transport::{Header, KIND_DATA, Links, RecvFailure};

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
    links: Links,
    timeout: Duration,
    seq: u64,
    sent: Vec<u64>,
    received: Vec<u64>,
    failed: Option<CommError>,
    current: Option<Header>,
}

impl Engine {
    /// An engine for group rank `rank` of `global_ranks.len()` ranks.
    pub fn new(rank: usize, global_ranks: Vec<usize>, links: Links, timeout: Duration) -> Engine {
        let size = global_ranks.len();
        Engine {
            rank,
            size,
            global_ranks,
            links,
            timeout,
            seq: 0,
            sent: vec![0; size],
            received: vec![0; size],
            failed: None,
            current: None,
        }
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
            self.links.broadcast_abort(&err.to_string());
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

    fn send_bytes(&mut self, peer: usize, mut h: Header, step: u32, data: &[u8]) -> Result<()> {
        h.step = step;
        h.len = data.len() as u64;
        if self.links.send(peer, h, data.to_vec()) {
            Ok(())
        } else {
            Err(self.lost(peer))
        }
    }

    fn lost(&self, peer: usize) -> CommError {
        CommError::PeerLost {
            rank: self.me(),
            peer: self.global_ranks[peer],
            op: self.current.as_ref().map(describe),
        }
    }

    /// Receives the frame for `step` of the current collective from `peer` and hands its
    /// payload (8-byte aligned) to `use_payload`.
    fn recv_with<R>(
        &mut self,
        peer: usize,
        mut h: Header,
        step: u32,
        use_payload: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        h.step = step;
        match self.links.inbox.recv(peer, self.timeout) {
            Ok(frame) if frame.header.same_collective(&h) => {
                Ok(use_payload(frame.payload.as_slice()))
            }
            Ok(frame) => Err(CommError::Mismatch {
                rank: self.me(),
                peer: self.global_ranks[peer],
                mine: describe(&h),
                theirs: describe(&frame.header),
            }),
            Err(RecvFailure::Lost) => Err(self.lost(peer)),
            Err(RecvFailure::Aborted(origin, message)) => Err(CommError::Aborted {
                rank: self.me(),
                origin: self.global_ranks[origin],
                message,
            }),
            Err(RecvFailure::Timeout) => Err(CommError::Timeout {
                rank: self.me(),
                what: format!(
                    "{} waiting for rank {}",
                    describe(&h),
                    self.global_ranks[peer]
                ),
                timeout: self.timeout,
            }),
        }
    }

    fn recv_into<T: Element>(
        &mut self,
        peer: usize,
        h: Header,
        step: u32,
        dst: &mut [T],
    ) -> Result<()> {
        let me = self.me();
        let want = std::mem::size_of_val(dst);
        let got = self.recv_with(peer, h, step, |p| {
            if p.len() == want {
                as_bytes_mut(dst).copy_from_slice(p);
            }
            p.len()
        })?;
        check_len(me, &h, got, want)
    }

    fn recv_reduce<T: Element>(
        &mut self,
        peer: usize,
        h: Header,
        step: u32,
        dst: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.me();
        let want = std::mem::size_of_val(dst);
        let got = self.recv_with(peer, h, step, |p| {
            if p.len() == want {
                reduce_into(dst, cast::<T>(p), op);
            }
            p.len()
        })?;
        check_len(me, &h, got, want)
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
            let (a, b) = parts[send];
            self.send_bytes(self.next(), h, s as u32, as_bytes(&buf[a..b]))?;
            let (a, b) = parts[recv];
            self.recv_reduce(self.prev(), h, s as u32, &mut buf[a..b], op)?;
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
            let step = first_step + s as u32;
            let (a, b) = parts[send];
            self.send_bytes(self.next(), h, step, as_bytes(&buf[a..b]))?;
            let (a, b) = parts[recv];
            self.recv_into(self.prev(), h, step, &mut buf[a..b])?;
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
            for peer in self.others() {
                self.send_bytes(peer, h, 0, as_bytes(&buf))?;
            }
            let mine = std::mem::take(&mut buf);
            let mut acc: Option<Vec<T>> = None;
            for peer in 0..n {
                let contribution = if peer == self.rank {
                    mine.clone()
                } else {
                    let mut v = vec![T::default(); mine.len()];
                    self.recv_into(peer, h, 0, &mut v)?;
                    v
                };
                match acc.as_mut() {
                    None => acc = Some(contribution),
                    Some(a) => reduce_into(a, &contribution, op),
                }
            }
            let mut out = acc.unwrap_or_default();
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
        let k = input.len();
        let counts = vec![k; self.size];
        self.gather_parts(Op::AllGather, input, &counts)
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
        self.gather_parts(Op::AllGatherV, input, &counts)
    }

    fn gather_parts<T: Element>(
        &mut self,
        op: Op,
        input: Vec<T>,
        counts: &[usize],
    ) -> Result<Vec<T>> {
        let total: usize = counts.iter().sum();
        let h = self.begin::<T>(op, total, None);
        let mut parts = Vec::with_capacity(counts.len());
        let mut start = 0;
        for c in counts {
            parts.push((start, start + c));
            start += c;
        }
        let mut out = vec![T::default(); total];
        let (a, b) = parts[self.rank];
        out[a..b].copy_from_slice(&input);
        drop(input);
        if self.size > 1 {
            self.ring_all_gather(h, &mut out, &parts, 0)?;
        }
        Ok(out)
    }

    /// See [`crate::ProcessGroup::reduce_scatter`].
    pub fn reduce_scatter<T: Element>(
        &mut self,
        mut input: Vec<T>,
        op: ReduceOp,
    ) -> Result<Vec<T>> {
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
        let mut out = input[a..b].to_vec();
        finish_avg(&mut out, op, n);
        Ok(out)
    }

    /// See [`crate::ProcessGroup::broadcast`].
    pub fn broadcast<T: Element>(&mut self, mut buf: Vec<T>, root: usize) -> Result<Vec<T>> {
        self.check_root("broadcast", root)?;
        let h = self.begin::<T>(Op::Broadcast, buf.len(), None);
        if self.rank == root {
            for peer in (0..self.size).filter(|p| *p != root) {
                self.send_bytes(peer, h, 0, as_bytes(&buf))?;
            }
        } else {
            self.recv_into(root, h, 0, &mut buf)?;
        }
        Ok(buf)
    }

    /// See [`crate::ProcessGroup::gather`].
    pub fn gather<T: Element>(&mut self, input: Vec<T>, root: usize) -> Result<Option<Vec<T>>> {
        self.check_root("gather", root)?;
        let k = input.len();
        let h = self.begin::<T>(Op::Gather, k * self.size, None);
        if self.rank != root {
            self.send_bytes(root, h, 0, as_bytes(&input))?;
            return Ok(None);
        }
        let mut out = vec![T::default(); k * self.size];
        for peer in 0..self.size {
            if peer == root {
                out[peer * k..(peer + 1) * k].copy_from_slice(&input);
            } else {
                self.recv_into(peer, h, 0, &mut out[peer * k..(peer + 1) * k])?;
            }
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
            for peer in (0..self.size).filter(|p| *p != root) {
                self.send_bytes(peer, h, 0, as_bytes(&input[peer * k..(peer + 1) * k]))?;
            }
            return Ok(input[root * k..(root + 1) * k].to_vec());
        }
        let mut out = vec![T::default(); k];
        self.recv_into(root, h, 0, &mut out)?;
        Ok(out)
    }

    /// See [`crate::ProcessGroup::barrier`].
    pub fn barrier(&mut self) -> Result<()> {
        let h = self.begin::<u8>(Op::Barrier, 0, None);
        for peer in self.others() {
            self.send_bytes(peer, h, 0, &[])?;
        }
        for peer in self.others() {
            self.recv_with(peer, h, 0, |_| ())?;
        }
        Ok(())
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
        self.send_bytes(dst, h, 0, as_bytes(&buf))
    }

    /// See [`crate::ProcessGroup::recv`].
    pub fn recv<T: Element>(&mut self, len: usize, src: usize) -> Result<Vec<T>> {
        self.check_peer("recv", src)?;
        let h = self.p2p_header::<T>(src, len, false);
        let mut out = vec![T::default(); len];
        self.recv_into(src, h, 0, &mut out)?;
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

fn check_len(rank: usize, h: &Header, got: usize, want: usize) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(CommError::InvalidArgument {
        rank,
        op: describe(h),
        reason: format!(
            "received {got} bytes where this rank expected {want}: ranks passed buffers of different sizes"
        ),
    })
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
