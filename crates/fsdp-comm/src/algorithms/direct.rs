//! Direct exchanges: small all-reduces (every rank sends its whole buffer to every other and
//! reduces in rank order, one round), the all-to-all (every rank sends each other rank its
//! part, one round) and the barrier.

use crate::dtype::{Element, ReduceOp, as_bytes, finish_avg, reduce_into};
use crate::error::Result;
use crate::protocol::{Engine, Op, Out};
use crate::transport::Header;

/// All-reduces of at most this many bytes exchange whole buffers directly (one round).
pub(crate) const DIRECT_ALL_REDUCE_BYTES: usize = 64 << 10;

/// Bytes of each part a shared-memory all-to-all exchanges per round when it receives into
/// its input: scratch that stays in cache, and few enough rounds that their headers cost
/// nothing.
const IN_PLACE_ROUND_BYTES: usize = 256 << 10;

impl Engine {
    /// All-reduce of a small buffer in one round; identical results on every rank.
    pub(crate) fn direct_all_reduce<T: Element>(
        &mut self,
        h: Header,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Vec<T>> {
        let n = self.size;
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
        Ok(out)
    }

    /// See [`crate::ProcessGroup::all_to_all`].
    pub fn all_to_all<T: Element>(&mut self, input: Vec<T>) -> Result<Vec<T>> {
        let n = self.size;
        if !input.len().is_multiple_of(n) {
            return Err(self.invalid(
                "all_to_all",
                format!("{} elements do not split into {n} equal parts", input.len()),
            ));
        }
        let k = input.len() / n;
        let h = self.begin::<T>(Op::AllToAll, input.len(), None);
        if self.net.sends_complete_alone() && k > 0 {
            // Part p goes to peer p and comes back from it in the same place: received into
            // the input itself once its parts are sent.
            let mut buf = input;
            let outs: Vec<Out> = (self.others().into_iter())
                .map(|p| (p, 0, as_bytes(&buf[p * k..(p + 1) * k])))
                .collect();
            self.transfer(h, &outs, Vec::new())?;
            let me = self.rank;
            let ins = (buf.chunks_mut(k).enumerate())
                .filter(|(p, _)| *p != me)
                .map(|(p, part)| Self::into_slice(p, 0, part))
                .collect();
            self.transfer(h, &[], ins)?;
            return Ok(buf);
        }
        let me = self.rank;
        let chunk = (IN_PLACE_ROUND_BYTES / std::mem::size_of::<T>()).max(1);
        if k > chunk {
            return self.all_to_all_in_rounds(h, input, chunk);
        }
        let mut out = vec![T::default(); input.len()];
        out[me * k..(me + 1) * k].copy_from_slice(&input[me * k..(me + 1) * k]);
        let outs: Vec<Out> = self
            .others()
            .into_iter()
            .map(|p| (p, 0, as_bytes(&input[p * k..(p + 1) * k])))
            .collect();
        // One receive per peer, empty parts included (a peer sends an empty frame for them).
        let mut ins = Vec::with_capacity(n - 1);
        let mut rest = out.as_mut_slice();
        for p in 0..n {
            let (part, tail) = rest.split_at_mut(k);
            rest = tail;
            if p != me {
                ins.push(Self::into_slice(p, 0, part));
            }
        }
        self.transfer(h, &outs, ins)?;
        Ok(out)
    }

    /// An all-to-all of parts larger than `chunk` elements over a transport whose sends and
    /// receives progress together (shared memory): received into the input in rounds of
    /// `chunk` elements of every part, each round's pieces landing in a small scratch buffer
    /// per peer and copied into place once the round has sent the bytes they replace. A
    /// fresh output of the input's size would fault in every page on every call (0.53x
    /// gloo at 64 MiB).
    fn all_to_all_in_rounds<T: Element>(
        &mut self,
        h: Header,
        mut buf: Vec<T>,
        chunk: usize,
    ) -> Result<Vec<T>> {
        let (n, me) = (self.size, self.rank);
        let k = buf.len() / n;
        let others = self.others();
        let mut scratch: Vec<Vec<T>> = (0..n)
            .map(|p| {
                if p == me {
                    Vec::new()
                } else {
                    vec![T::default(); chunk]
                }
            })
            .collect();
        for (round, start) in (0..k).step_by(chunk).enumerate() {
            let len = chunk.min(k - start);
            let part = |p: usize| p * k + start..p * k + start + len;
            let outs: Vec<Out> = (others.iter())
                .map(|&p| (p, round as u32, as_bytes(&buf[part(p)])))
                .collect();
            let ins = (scratch.iter_mut().enumerate())
                .filter(|(p, _)| *p != me)
                .map(|(p, s)| Self::into_slice(p, round as u32, &mut s[..len]))
                .collect();
            self.transfer(h, &outs, ins)?;
            for &p in &others {
                buf[part(p)].copy_from_slice(&scratch[p][..len]);
            }
        }
        Ok(buf)
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
}
