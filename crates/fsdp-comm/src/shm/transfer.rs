//! A transfer over the segment's rings: every frame of one step of a collective, sent and
//! received at once.

use std::time::{Duration, Instant};

use super::{PIECE, Segment};

/// Where received payload bytes go: called with each piece and its offset in the payload.
pub type Sink<'a> = Box<dyn FnMut(usize, &[u8]) + 'a>;
/// Checks a received header; returns the payload length to read, or `None` to refuse it.
pub type HeaderCheck<'a> = Box<dyn FnMut(&[u8; 40]) -> Option<usize> + 'a>;

/// One outgoing frame in a transfer.
pub struct OutFrame<'a> {
    /// Destination group rank.
    pub peer: usize,
    /// Encoded header.
    pub header: [u8; 40],
    /// Payload.
    pub data: &'a [u8],
    written: Option<usize>,
}

impl<'a> OutFrame<'a> {
    /// A frame to send.
    pub fn new(peer: usize, header: [u8; 40], data: &'a [u8]) -> Self {
        OutFrame {
            peer,
            header,
            data,
            written: None,
        }
    }
}

/// One incoming frame in a transfer: the header is handed to `on_header` (which may refuse
/// it), then the payload to `sink` in pieces with their offsets.
pub struct InFrame<'a> {
    /// Source group rank.
    pub peer: usize,
    /// Called with the header; returns the payload length to read, or `None` to refuse it.
    pub on_header: HeaderCheck<'a>,
    /// Receives payload pieces as (offset, bytes).
    pub sink: Sink<'a>,
    state: Option<(usize, usize)>, // (payload length, bytes delivered)
    done: bool,
}

impl<'a> InFrame<'a> {
    /// A frame to receive.
    pub fn new(
        peer: usize,
        on_header: impl FnMut(&[u8; 40]) -> Option<usize> + 'a,
        sink: impl FnMut(usize, &[u8]) + 'a,
    ) -> Self {
        InFrame {
            peer,
            on_header: Box::new(on_header),
            sink: Box::new(sink),
            state: None,
            done: false,
        }
    }
}

/// Why a transfer stopped.
pub enum TransferError {
    /// `on_header` refused a frame from this peer.
    Refused(usize),
    /// The group was aborted: (origin, message).
    Aborted(usize, String),
    /// `check_lost` reported this peer gone.
    Lost(usize),
    /// Nothing moved for the whole timeout: waiting for this peer.
    Timeout(usize),
}

fn pad8(n: usize) -> usize {
    n.div_ceil(8) * 8
}

impl Segment {
    /// Moves every frame, making progress on all of them at once (so rings smaller than the
    /// frames cannot deadlock). `lost(peer)` reports peers whose process is known dead.
    pub fn transfer(
        &self,
        outs: &mut [OutFrame<'_>],
        ins: &mut [InFrame<'_>],
        timeout: Duration,
        lost: &dyn Fn(usize) -> bool,
    ) -> Result<(), TransferError> {
        let mut last_progress = Instant::now();
        let mut looked_again = false;
        loop {
            let seen = self.doorbell_value();
            let mut progressed = false;
            let mut all_done = true;
            for out in outs.iter_mut() {
                if self.progress_out(out) {
                    progressed = true;
                }
                if out.written != Some(usize::MAX) {
                    all_done = false;
                }
            }
            for inf in ins.iter_mut() {
                if inf.done {
                    continue;
                }
                match self.progress_in(inf) {
                    Ok(p) => progressed |= p,
                    Err(e) => return Err(e),
                }
                if !inf.done {
                    all_done = false;
                }
            }
            if all_done {
                return Ok(());
            }
            if progressed {
                last_progress = Instant::now();
                looked_again = false;
                continue;
            }
            if let Some((origin, msg)) = self.aborted() {
                return Err(TransferError::Aborted(origin, msg));
            }
            let mut pending = ins.iter().filter(|i| !i.done).map(|i| i.peer).chain(
                outs.iter()
                    .filter(|o| o.written != Some(usize::MAX))
                    .map(|o| o.peer),
            );
            let waiting_on = pending.clone().next().unwrap_or(0);
            if let Some(p) = pending.find(|p| lost(*p)) {
                // What the peer wrote before it ended stays in the rings: a peer that sent its
                // part and exited between this pass and the check is read in one more pass
                // (lost only when a pass after seeing it gone moves nothing).
                if looked_again {
                    return Err(TransferError::Lost(p));
                }
                looked_again = true;
                continue;
            }
            if last_progress.elapsed() >= timeout {
                return Err(TransferError::Timeout(waiting_on));
            }
            let can_move = || {
                outs.iter()
                    .any(|o| o.written != Some(usize::MAX) && self.space(o.peer) > 0)
                    || ins.iter().any(|i| !i.done && self.available(i.peer) > 0)
                    || self.aborted().is_some()
            };
            self.back_off(last_progress.elapsed(), seen, can_move);
        }
    }

    /// Writes what fits of a frame; `written == Some(usize::MAX)` marks it complete.
    fn progress_out(&self, out: &mut OutFrame<'_>) -> bool {
        if out.written == Some(usize::MAX) {
            return false;
        }
        let mut progressed = false;
        if out.written.is_none() {
            if self.space(out.peer) < 40 {
                return false;
            }
            self.produce(out.peer, &out.header, 40);
            out.written = Some(0);
            progressed = true;
        }
        loop {
            let done = out.written.unwrap_or(0);
            let remaining = out.data.len() - done;
            if remaining == 0 {
                out.written = Some(usize::MAX);
                if progressed {
                    self.ring_doorbell(out.peer);
                }
                return true;
            }
            let space = self.space(out.peer);
            // Whole 8-byte words only, except for the (padded) final piece.
            let take = if pad8(remaining) <= space.min(PIECE) {
                remaining
            } else {
                (space.min(PIECE).min(remaining)) / 8 * 8
            };
            if take == 0 {
                if progressed {
                    self.ring_doorbell(out.peer);
                }
                return progressed;
            }
            let advance = if take == remaining { pad8(take) } else { take };
            self.produce(out.peer, &out.data[done..done + take], advance);
            out.written = Some(done + take);
            progressed = true;
            self.ring_doorbell(out.peer);
        }
    }

    /// Reads what has arrived of a frame.
    fn progress_in(&self, inf: &mut InFrame<'_>) -> Result<bool, TransferError> {
        let mut progressed = false;
        if inf.state.is_none() {
            if self.available(inf.peer) < 40 {
                return Ok(false);
            }
            let mut header = [0u8; 40];
            let mut at = 0;
            self.consume(inf.peer, 40, 40, &mut |piece| {
                header[at..at + piece.len()].copy_from_slice(piece);
                at += piece.len();
            });
            let len = (inf.on_header)(&header).ok_or(TransferError::Refused(inf.peer))?;
            inf.state = Some((len, 0));
            progressed = true;
            self.ring_doorbell(inf.peer);
        }
        loop {
            let Some((len, delivered)) = inf.state else {
                return Ok(progressed);
            };
            let remaining = len - delivered;
            if remaining == 0 {
                inf.done = true;
                return Ok(true);
            }
            let avail = self.available(inf.peer);
            let take = if pad8(remaining) <= avail {
                remaining
            } else {
                avail.min(remaining) / 8 * 8
            };
            if take == 0 {
                return Ok(progressed);
            }
            let advance = if take == remaining { pad8(take) } else { take };
            let mut offset = delivered;
            let sink = &mut inf.sink;
            self.consume(inf.peer, take, advance, &mut |piece| {
                sink(offset, piece);
                offset += piece.len();
            });
            inf.state = Some((len, delivered + take));
            progressed = true;
            self.ring_doorbell(inf.peer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_sent_its_frame_and_ended_is_read_before_it_is_called_lost() {
        let path = super::super::segment_path("transfer-test");
        let first = Segment::create(&path, 2, 0).unwrap();
        let second = Segment::open(&path, 2, 1).unwrap();
        std::fs::remove_file(&path).unwrap();
        let payload: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let header = [7u8; 40];
        // Rank 0 writes its whole frame and ends between rank 1's pass over the rings and its
        // check of rank 0's process: what a loaded machine's scheduler can do.
        let sent = std::cell::Cell::new(false);
        let ended_after_sending = |peer: usize| {
            assert_eq!(peer, 0);
            if !sent.replace(true) {
                let mut outs = [OutFrame::new(1, header, &payload)];
                let wrote = first.transfer(&mut outs, &mut [], Duration::from_secs(5), &|_| false);
                assert!(wrote.is_ok());
            }
            true
        };
        let mut got = vec![0u8; payload.len()];
        let mut ins = [InFrame::new(
            0,
            |h: &[u8; 40]| (h == &header).then_some(1000),
            |at, piece: &[u8]| got[at..at + piece.len()].copy_from_slice(piece),
        )];
        let read = second.transfer(
            &mut [],
            &mut ins,
            Duration::from_secs(5),
            &ended_after_sending,
        );
        assert!(
            read.is_ok(),
            "the frame sent before the peer ended was not read"
        );
        drop(ins);
        assert_eq!(got, payload);

        // A peer that ended without sending is lost, at once.
        let mut ins = [InFrame::new(0, |_: &[u8; 40]| Some(8), |_, _: &[u8]| {})];
        let started = Instant::now();
        let read = second.transfer(&mut [], &mut ins, Duration::from_secs(5), &|_| true);
        assert!(matches!(read, Err(TransferError::Lost(0))));
        assert!(started.elapsed() < Duration::from_secs(1));
    }
}
