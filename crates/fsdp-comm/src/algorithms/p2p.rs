//! Point-to-point send and receive, numbered per direction and peer apart from collectives.

use std::sync::atomic::Ordering;

use crate::dtype::{Element, as_bytes};
use crate::error::Result;
use crate::protocol::{Engine, Op};
use crate::transport::{Header, KIND_DATA};

impl Engine {
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
            part: 0,
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
}
