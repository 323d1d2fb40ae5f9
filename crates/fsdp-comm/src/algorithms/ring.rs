//! Ring algorithms, bandwidth-optimal for large buffers: each rank sends (n-1)/n of the data
//! for reduce-scatter and all-gather, and all-reduce is one of each.

use std::mem::MaybeUninit;

use crate::dtype::{Element, ReduceOp, as_bytes, as_uninit_mut, finish_avg, write_copy};
use crate::error::Result;
use crate::protocol::{Engine, Op};
use crate::transport::Header;

use super::direct::DIRECT_ALL_REDUCE_BYTES;

impl Engine {
    /// One reduce-scatter step: send `buf[send]` to the next rank while reducing the previous
    /// rank's part into `buf[recv]` with `reduce`'s op, finished (an average divided) where
    /// it also gives the group size (the last step).
    fn ring_step<T: Element>(
        &mut self,
        h: Header,
        step: u32,
        buf: &mut [T],
        (send, recv): ((usize, usize), (usize, usize)),
        reduce: (ReduceOp, Option<usize>),
    ) -> Result<()> {
        let (next, prev) = (self.next(), self.prev());
        let (send_part, recv_part) = disjoint(buf, send, recv);
        let sink = Self::reducing(prev, step, recv_part, reduce);
        self.transfer(h, &[(next, step, as_bytes(send_part))], vec![sink])
    }

    /// Ring reduce-scatter over `parts` (the chunk boundaries); on return this rank's part
    /// `rank` holds the finished reduction of every rank's part `rank` (an average divided
    /// as the last step writes it) — in `buf`, or, given `out` (that part's length, possibly
    /// uninitialised), in `out` (the last step reduces into it, sparing a copy, and writes
    /// every element).
    fn ring_reduce_scatter<T: Element>(
        &mut self,
        h: Header,
        buf: &mut [T],
        parts: &[(usize, usize)],
        op: ReduceOp,
        out: Option<&mut [MaybeUninit<T>]>,
    ) -> Result<()> {
        let n = self.size;
        let last = n - 2;
        for s in 0..last {
            let send = (self.rank + 2 * n - 1 - s) % n;
            let recv = (self.rank + 2 * n - 2 - s) % n;
            self.ring_step(h, s as u32, buf, (parts[send], parts[recv]), (op, None))?;
        }
        // The last step receives this rank's own part.
        let send = parts[(self.rank + 1) % n];
        let own = parts[self.rank];
        match out {
            None => self.ring_step(h, last as u32, buf, (send, own), (op, Some(n))),
            Some(out) => {
                let (prev, next) = (self.prev(), self.next());
                let sink = Self::reducing_to(prev, last as u32, &buf[own.0..own.1], out, (op, n));
                let outs = [(next, last as u32, as_bytes(&buf[send.0..send.1]))];
                self.transfer(h, &outs, vec![sink])
            }
        }
    }

    /// Ring all-gather: part `rank` of `buf` is this rank's and written; on return every
    /// part is written. The other parts may start uninitialised: each is received whole
    /// before it is sent on.
    fn ring_all_gather<T: Element>(
        &mut self,
        h: Header,
        buf: &mut [MaybeUninit<T>],
        parts: &[(usize, usize)],
        first_step: u32,
    ) -> Result<()> {
        let n = self.size;
        let (next, prev) = (self.next(), self.prev());
        for s in 0..n - 1 {
            let send = parts[(self.rank + n - s) % n];
            let recv = parts[(self.rank + 2 * n - 1 - s) % n];
            let step = first_step + s as u32;
            let (send_part, recv_part) = disjoint(buf, send, recv);
            // SAFETY: the part sent at step s is this rank's own (s = 0) or the one step s - 1
            // received, and that transfer returned `Ok`, so every element of it was written.
            let send_part = unsafe { &*(send_part as *const [MaybeUninit<T>] as *const [T]) };
            let sink = Self::into_uninit(prev, step, recv_part);
            self.transfer(h, &[(next, step, as_bytes(send_part))], vec![sink])?;
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
            return self.direct_all_reduce(h, buf, op);
        }
        let parts = split(buf.len(), n);
        self.ring_reduce_scatter(h, &mut buf, &parts, op, None)?;
        // SAFETY: the all-gather writes only received elements.
        let whole = unsafe { as_uninit_mut(&mut buf) };
        self.ring_all_gather(h, whole, &parts, n as u32)?;
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

    /// See [`crate::ProcessGroup::all_gather_in_place`]: the ring of
    /// [`Engine::all_gather_into`] without the copy of this rank's block.
    pub fn all_gather_in_place<T: Element>(&mut self, mut out: Vec<T>) -> Result<Vec<T>> {
        let n = self.size;
        if !out.len().is_multiple_of(n) {
            return Err(crate::communicator::in_place_length(
                self.me(),
                out.len(),
                n,
            ));
        }
        let h = self.begin::<T>(Op::AllGather, out.len(), None);
        if n > 1 {
            let parts = split(out.len(), n);
            // SAFETY: the all-gather writes only received elements.
            let whole = unsafe { as_uninit_mut(&mut out) };
            self.ring_all_gather(h, whole, &parts, 0)?;
        }
        Ok(out)
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
        // Every element is written (this rank's part from `input`, the others received), so
        // the output is not zero-filled first: its memory is only reserved, and it holds
        // elements once the gather has written all of them.
        let spare = emptied_for(&mut out, total);
        let (a, b) = parts[self.rank];
        write_copy(&mut spare[a..b], &input);
        if self.size > 1 {
            self.ring_all_gather(h, spare, &parts, 0)?;
        }
        // SAFETY: every part of the first `total` elements is written (above).
        unsafe { out.set_len(total) };
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
        if !input.len().is_multiple_of(n) {
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
            // The last step writes every element, so the output is not zero-filled first:
            // its memory is only reserved, and it holds elements once all are written.
            let spare = emptied_for(&mut out, k);
            self.ring_reduce_scatter(h, &mut input, &parts, op, Some(spare))?;
            // SAFETY: the reduce-scatter wrote all `k` elements (above), finished.
            unsafe { out.set_len(k) };
        } else {
            let (a, b) = parts[self.rank];
            out.clear();
            out.extend_from_slice(&input[a..b]);
            finish_avg(&mut out, op, n);
        }
        Ok((input, out))
    }
}

/// `out` emptied, with room for `len` elements to be written: its memory reused when large
/// enough, else a new allocation (growing it would copy contents about to be overwritten).
fn emptied_for<T>(out: &mut Vec<T>, len: usize) -> &mut [MaybeUninit<T>] {
    if out.capacity() < len {
        *out = Vec::with_capacity(len);
    } else {
        out.clear();
    }
    &mut out.spare_capacity_mut()[..len]
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
