//! [`SharedBlocks`]: one block of memory per rank of a shared-memory group that every rank
//! maps, so a collective can copy each byte once — its owner writes a block in place and
//! every peer reads it straight from there — where the rings copy it twice (into the ring on
//! the sender's core, out of it on the receiver's).
//!
//! Each rank's block has `slots` copies, used in turn by the rounds it publishes: round `k`
//! (from 1) lives in slot `(k - 1) % slots`. A header per rank holds the last round its owner
//! published and, per reader and slot, the last round that reader finished reading there (its
//! owner among the readers), so an owner never
//! rewrites a slot a peer may still be reading and a reader never reads a round its owner has
//! not finished writing. Waits spin, yield, then sleep on the group segment's doorbell; they
//! end with an error when the group aborts, a peer's process is gone, or the group's timeout
//! passes. Every file is unlinked as soon as every rank has mapped it.

use std::fs::OpenOptions;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Segment;
use crate::dtype::{
    Element, ReduceOp, STREAM_BYTES, as_uninit_mut, reduce_into_finished, reduce_pair_streaming,
    stream_copy,
};
use crate::error::{CommError, Result};
use crate::transport::Inbox;

const MAGIC: u64 = 0x4653_4450_424c_4b31; // "FSDPBLK1"
const PAGE: usize = 4096;
/// Header words: magic, ranks, block bytes, slots (offsets 0..32), then the published round
/// at 64 and one cache line per reader from 128: the last round it read in each slot.
const PUBLISHED: usize = 64;
const READERS: usize = 128;
/// The most slots a reader's cache line has words for.
pub const MAX_SLOTS: usize = 8;

fn header_bytes(n: usize) -> usize {
    (READERS + 64 * n).next_multiple_of(PAGE)
}

fn slot_bytes(block_bytes: usize) -> usize {
    block_bytes.next_multiple_of(PAGE)
}

fn file_bytes(n: usize, block_bytes: usize, slots: usize) -> usize {
    header_bytes(n) + slots * slot_bytes(block_bytes)
}

/// One rank's file, mapped here.
struct Mapping {
    base: *mut u8,
    len: usize,
}

impl Mapping {
    /// Creates the file at `path` (exclusive, mode 0600) with `len` bytes and maps it.
    fn create(path: &Path, len: usize) -> std::io::Result<Mapping> {
        Mapping::map(&super::create_file(path, len)?, len)
    }

    /// Maps the file at `path` whole, whatever its length (at least a header's).
    fn open(path: &Path) -> std::io::Result<Mapping> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len() as usize;
        if len < PAGE {
            return Err(std::io::Error::other(format!(
                "is {len} bytes, shorter than its header"
            )));
        }
        Mapping::map(&file, len)
    }

    fn map(file: &std::fs::File, len: usize) -> std::io::Result<Mapping> {
        // Populated: the pages are allocated (by their owner, who maps its file first) and
        // entered in this process's page tables now, so no collective takes a page fault.
        let base = super::map_shared(file, len, libc::MAP_POPULATE)?;
        Ok(Mapping { base, len })
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.len);
        // SAFETY: in bounds, 8-aligned (page-aligned base), shared memory accessed atomically.
        unsafe { &*self.base.add(off).cast::<AtomicU64>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

/// One block per rank of a shared-memory group, mapped by every rank: its owner writes it
/// ([`SharedBlocks::next_block`], [`SharedBlocks::publish`]) and every rank reads it in place
/// ([`SharedBlocks::read`]). Made by [`crate::Communicator::shared_blocks`]; every rank
/// publishes the same sequence of rounds and reads each before it publishes `slots` more.
pub struct SharedBlocks {
    maps: Vec<Mapping>,
    seg: Arc<Segment>,
    inbox: Arc<Inbox>,
    me: usize,
    global_ranks: Vec<usize>,
    block_bytes: usize,
    slots: usize,
    /// Rounds this rank has published.
    published: u64,
    timeout: Duration,
    /// The group's count of payload bytes sent.
    bytes_sent: Arc<AtomicU64>,
}

// SAFETY: the mappings are shared memory ordered by the header's atomics: an owner writes a
// slot only after every reader released the round that last used it (acquire), and publishes
// it with a release store; readers read a slot only after acquiring its round.
unsafe impl Send for SharedBlocks {}
unsafe impl Sync for SharedBlocks {}

/// What [`SharedBlocks::open_all`] needs to know about the group.
pub(crate) struct BlocksGroup<'a> {
    pub seg: Arc<Segment>,
    pub inbox: Arc<Inbox>,
    pub me: usize,
    pub global_ranks: &'a [usize],
    pub timeout: Duration,
    pub bytes_sent: Arc<AtomicU64>,
}

impl SharedBlocks {
    /// Creates this rank's file at `path` (exclusive, mode 0600) for blocks of `block_bytes`
    /// in `slots` slots; the caller hands the path to its peers, then calls
    /// [`SharedBlocks::open_all`] and unlinks it once every peer has opened it.
    pub(crate) fn create_file(
        path: &Path,
        n: usize,
        block_bytes: usize,
        slots: usize,
    ) -> std::io::Result<()> {
        let map = Mapping::create(path, file_bytes(n, block_bytes, slots))?;
        for (off, v) in [(8, n), (16, block_bytes), (24, slots)] {
            map.word(off).store(v as u64, Ordering::Relaxed);
        }
        map.word(0).store(MAGIC, Ordering::Release);
        Ok(())
    }

    /// Maps every rank's file (`paths` in group-rank order), checking each was made for the
    /// same ranks, block size and slots as this rank asks for.
    pub(crate) fn open_all(
        group: BlocksGroup<'_>,
        paths: &[std::path::PathBuf],
        block_bytes: usize,
        slots: usize,
    ) -> Result<SharedBlocks> {
        let n = paths.len();
        let rank = group.global_ranks[group.me];
        let mut maps = Vec::with_capacity(n);
        for (r, path) in paths.iter().enumerate() {
            let what = format!(
                "mapping rank {}'s shared blocks {}",
                group.global_ranks[r],
                path.display()
            );
            let io = |message: String| CommError::Io {
                rank,
                what: what.clone(),
                message,
            };
            let map = Mapping::open(path).map_err(|e| io(e.to_string()))?;
            let made = [0, 8, 16, 24].map(|off| map.word(off).load(Ordering::Acquire));
            if made[0] != MAGIC {
                return Err(io("it is not a shared-blocks file".into()));
            }
            let asked = [MAGIC, n as u64, block_bytes as u64, slots as u64];
            if made != asked {
                return Err(CommError::Mismatch {
                    rank,
                    peer: group.global_ranks[r],
                    mine: format!("shared_blocks({block_bytes} bytes, {slots} slots, {n} ranks)"),
                    theirs: format!(
                        "shared_blocks({} bytes, {} slots, {} ranks)",
                        made[2], made[3], made[1]
                    ),
                });
            }
            if map.len != file_bytes(n, block_bytes, slots) {
                return Err(io(format!(
                    "it is {} bytes where its header makes {}",
                    map.len,
                    file_bytes(n, block_bytes, slots)
                )));
            }
            maps.push(map);
        }
        Ok(SharedBlocks {
            maps,
            seg: group.seg,
            inbox: group.inbox,
            me: group.me,
            global_ranks: group.global_ranks.to_vec(),
            block_bytes,
            slots,
            published: 0,
            timeout: group.timeout,
            bytes_sent: group.bytes_sent,
        })
    }

    /// Bytes in each rank's block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Ranks in the group.
    pub fn ranks(&self) -> usize {
        self.maps.len()
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.me
    }

    /// Rounds this rank has published.
    pub fn published(&self) -> u64 {
        self.published
    }

    fn slot_of(&self, round: u64) -> usize {
        header_bytes(self.ranks())
            + ((round - 1) as usize % self.slots) * slot_bytes(self.block_bytes)
    }

    fn published_by(&self, owner: usize) -> &AtomicU64 {
        self.maps[owner].word(PUBLISHED)
    }

    /// The last round `reader` finished reading in the slot `round` uses, of `owner`'s block.
    fn read_by(&self, owner: usize, reader: usize, round: u64) -> &AtomicU64 {
        let slot = (round - 1) as usize % self.slots;
        self.maps[owner].word(READERS + 64 * reader + 8 * slot)
    }

    /// Whether this rank may publish its next round: it is done reading the round that last
    /// used that slot (every rank decides alike when every rank publishes and reads the same
    /// rounds in the same order; a peer still reading is waited for by
    /// [`SharedBlocks::next_block`]).
    pub fn can_publish(&self) -> bool {
        let round = self.published + 1;
        match round.checked_sub(self.slots as u64).filter(|r| *r > 0) {
            Some(reused) => {
                self.read_by(self.me, self.me, round)
                    .load(Ordering::Relaxed)
                    >= reused
            }
            None => true,
        }
    }

    /// This rank's block for the next round, to write before [`SharedBlocks::publish`]:
    /// waits until every peer has read the round that last used its slot.
    pub fn next_block(&mut self) -> Result<&mut [u8]> {
        let round = self.published + 1;
        if !self.can_publish() {
            return Err(CommError::InvalidArgument {
                rank: self.global_ranks[self.me],
                op: "shared_blocks next_block".into(),
                reason: format!(
                    "round {round} would overwrite round {}, which this rank has not finished reading",
                    round - self.slots as u64
                ),
            });
        }
        if let Some(reused) = round.checked_sub(self.slots as u64).filter(|r| *r > 0) {
            let me = self.me;
            let peers: Vec<usize> = (0..self.ranks()).filter(|&p| p != me).collect();
            self.wait(
                "writing its shared block",
                round,
                &peers,
                Need::All,
                |b, p| b.read_by(me, p, round).load(Ordering::Acquire) >= reused,
            )?;
        }
        let off = self.slot_of(round);
        // SAFETY: the slot is inside this rank's mapping, no peer reads it until the round is
        // published (every reader of its last round is done: waited above), and `&mut self`
        // keeps this rank from reading it meanwhile.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.maps[self.me].base.add(off), self.block_bytes)
        })
    }

    /// Publishes what [`SharedBlocks::next_block`] returned as this rank's block of the next
    /// round, and returns that round; `sent` is how many of its bytes the peers will read in
    /// all (the group's count of bytes sent, which the theory of the rings' traffic is
    /// compared with).
    pub fn publish(&mut self, sent: usize) -> u64 {
        self.bytes_sent.fetch_add(sent as u64, Ordering::Relaxed);
        self.published += 1;
        self.published_by(self.me)
            .store(self.published, Ordering::Release);
        for p in (0..self.ranks()).filter(|&p| p != self.me) {
            self.seg.ring_doorbell(p);
        }
        self.published
    }

    /// Calls `read(rank, block)` with every rank's block of `round` (this rank's first, then
    /// each peer's as soon as it is published), telling each owner this rank is done with its
    /// block as soon as `read` returns.
    pub fn read(&self, round: u64, read: impl FnMut(usize, &[u8])) -> Result<()> {
        self.read_blocks(round, read, true)
    }

    /// Calls `read` with every rank's block of `round` at once, in rank order, once every one
    /// is published, then tells each owner this rank is done with it.
    pub fn read_all<R>(&self, round: u64, read: impl FnOnce(&[&[u8]]) -> R) -> Result<R> {
        let mut blocks: Vec<(usize, &[u8])> = Vec::with_capacity(self.ranks());
        let waited = self.read_blocks(round, |r, block| blocks.push((r, block)), false);
        let result = waited.map(|()| {
            blocks.sort_by_key(|b| b.0);
            let blocks: Vec<&[u8]> = blocks.iter().map(|b| b.1).collect();
            read(&blocks)
        });
        self.release(round);
        result
    }

    /// [`SharedBlocks::read`], where `report` says whether each block is reported read as
    /// soon as it is handed over (otherwise the caller reports them all with
    /// [`SharedBlocks::release`], and the blocks stay valid until then).
    fn read_blocks<'a>(
        &'a self,
        round: u64,
        mut read: impl FnMut(usize, &'a [u8]),
        report: bool,
    ) -> Result<()> {
        let rank = self.global_ranks[self.me];
        let invalid = |reason: String| CommError::InvalidArgument {
            rank,
            op: "shared_blocks read".into(),
            reason,
        };
        if round == 0 || round > self.published {
            return Err(invalid(format!(
                "round {round} is not one this rank has published (it published {})",
                self.published
            )));
        }
        if round + self.slots as u64 <= self.published {
            return Err(invalid(format!(
                "round {round} was overwritten: this rank has published {} since, with {} slots",
                self.published - round,
                self.slots
            )));
        }
        read(self.me, self.block(self.me, round));
        if report {
            self.report_read(self.me, round);
        }
        let mut pending: Vec<usize> = (0..self.ranks()).filter(|&p| p != self.me).collect();
        let ready = |b: &SharedBlocks, p: usize| b.published_by(p).load(Ordering::Acquire) >= round;
        while !pending.is_empty() {
            if let Some(i) = pending.iter().position(|&p| ready(self, p)) {
                let p = pending.swap_remove(i);
                read(p, self.block(p, round));
                if report {
                    self.report_read(p, round);
                }
                continue;
            }
            self.wait(
                "reading a peer's shared block",
                round,
                &pending,
                Need::Any,
                ready,
            )?;
        }
        Ok(())
    }

    /// Tells every rank this rank is done with its block of `round` (after a read that did
    /// not report them, or instead of reading a round at all: every rank must release each
    /// round it publishes, read or not, before the slot comes round again).
    pub fn release(&self, round: u64) {
        for p in 0..self.ranks() {
            self.report_read(p, round);
        }
    }

    fn report_read(&self, owner: usize, round: u64) {
        let word = self.read_by(owner, self.me, round);
        if word.load(Ordering::Relaxed) < round {
            word.store(round, Ordering::Release);
            self.seg.ring_doorbell(owner);
        }
    }

    fn block(&self, owner: usize, round: u64) -> &[u8] {
        let off = self.slot_of(round);
        // SAFETY: inside the owner's mapping; the round is published (acquired by the caller)
        // and its slot is not rewritten until this rank says it has read it.
        unsafe { std::slice::from_raw_parts(self.maps[owner].base.add(off), self.block_bytes) }
    }

    /// Waits until `ready(self, peer)` holds for `need` of `peers`, failing on an abort, a
    /// lost peer or the timeout.
    fn wait(
        &self,
        what: &str,
        round: u64,
        peers: &[usize],
        need: Need,
        ready: impl Fn(&SharedBlocks, usize) -> bool,
    ) -> Result<()> {
        let done = |b: &SharedBlocks| match need {
            Need::All => peers.iter().all(|&p| ready(b, p)),
            Need::Any => peers.iter().any(|&p| ready(b, p)),
        };
        let rank = self.global_ranks[self.me];
        let start = Instant::now();
        loop {
            let seen = self.seg.doorbell_value();
            if done(self) {
                return Ok(());
            }
            if let Some((origin, message)) = self.seg.aborted() {
                return Err(CommError::Aborted {
                    rank,
                    origin: self.global_ranks.get(origin).copied().unwrap_or(origin),
                    message,
                });
            }
            let waiting = peers.iter().copied().filter(|&p| !ready(self, p));
            let failed = if let Some(p) = waiting.clone().find(|&p| self.inbox.is_lost(p)) {
                Some(CommError::PeerLost {
                    rank,
                    peer: self.global_ranks[p],
                    op: Some(format!("{what} (round {round})")),
                })
            } else if start.elapsed() >= self.timeout {
                let ranks: Vec<usize> = waiting.map(|p| self.global_ranks[p]).collect();
                Some(CommError::Timeout {
                    rank,
                    what: format!("{what} (round {round}), waiting for ranks {ranks:?}"),
                    timeout: self.timeout,
                })
            } else {
                None
            };
            if let Some(error) = failed {
                // As a collective's failure does: the group stops on every rank.
                self.seg.abort(self.me, &error.to_string());
                return Err(error);
            }
            self.seg.back_off(start.elapsed(), seen, || done(self));
        }
    }

    /// Writes `values` (exactly a block's bytes) as this rank's block of the next round
    /// ([`SharedBlocks::next_block`] and a copy; publish it next).
    pub fn write_block<T: Element>(&mut self, values: &[T]) -> Result<()> {
        let bytes = crate::dtype::as_bytes(values);
        self.check_len("shared_blocks write_block", bytes.len(), self.block_bytes)?;
        self.next_block()?.copy_from_slice(bytes);
        Ok(())
    }

    /// The in-place all-gather over the blocks: publishes this rank's block as written
    /// through [`SharedBlocks::next_block`] and copies every peer's block of that round into
    /// its place in `out` (rank `r`'s at `r * block_bytes` bytes; this rank's own place is
    /// left as it is, as [`crate::Communicator::all_gather_in_place`] leaves it). Each peer's
    /// byte is copied once. Returns the round.
    pub fn all_gather_into<T: Element>(&mut self, out: &mut [T]) -> Result<u64> {
        let len = std::mem::size_of_val(out);
        self.check_len(
            "shared_blocks all_gather",
            len,
            self.ranks() * self.block_bytes,
        )?;
        // SAFETY: `Element`s are plain data: any bytes written are valid elements.
        let out = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), len) };
        let round = self.publish((self.ranks() - 1) * self.block_bytes);
        let (me, bb) = (self.me, self.block_bytes);
        // As the rings' receives: a gathered buffer this large leaves the cache before it is
        // read, so it is written past it.
        let streaming = len >= STREAM_BYTES;
        self.read(round, |r, block| {
            let place = &mut out[r * bb..(r + 1) * bb];
            match (r == me, streaming) {
                (true, _) => {}
                // SAFETY: only initialised bytes are written.
                (false, true) => stream_copy(unsafe { as_uninit_mut(place) }, block),
                (false, false) => place.copy_from_slice(block),
            }
        })?;
        Ok(round)
    }

    /// The reduce-scatter over the blocks: publishes this rank's block (its input: `ranks`
    /// parts of `out.len()` elements of `T`, written through [`SharedBlocks::next_block`]) and
    /// writes into `out` part `rank` of every rank's block combined by `op`, in rank order
    /// (bitwise the same on every run). Each rank reads its part of every block once, in
    /// place.
    pub fn reduce_scatter_into<T: Element>(&mut self, out: &mut [T], op: ReduceOp) -> Result<u64> {
        let part = std::mem::size_of_val(out);
        self.check_len(
            "shared_blocks reduce_scatter",
            part * self.ranks(),
            self.block_bytes,
        )?;
        let round = self.publish((self.ranks() - 1) * part);
        let (me, n) = (self.me, self.ranks());
        self.read_all(round, |blocks| {
            let parts: Vec<&[T]> = blocks
                .iter()
                .map(|block| {
                    let bytes = &block[me * part..(me + 1) * part];
                    // SAFETY: `Element`s are plain data of any bit pattern; slots are
                    // page-aligned and `me * part` a multiple of the element size, so the part
                    // is aligned.
                    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), out.len()) }
                })
                .collect();
            match parts.as_slice() {
                [] => {}
                [only] => out.copy_from_slice(only),
                [a, b, rest @ ..] => {
                    // The partial sums of an average are sums; the last part divides.
                    let step = |last: bool| match op {
                        ReduceOp::Avg if !last => ReduceOp::Sum,
                        other => other,
                    };
                    // SAFETY: every element of `out` is written by the pair reduction.
                    let uninit = unsafe { crate::dtype::as_uninit_mut(out) };
                    reduce_pair_streaming(uninit, a, b, step(rest.is_empty()), n);
                    for (i, p) in rest.iter().enumerate() {
                        reduce_into_finished(out, p, step(i + 1 == rest.len()), n);
                    }
                }
            }
        })?;
        Ok(round)
    }

    fn check_len(&self, op: &str, len: usize, expected: usize) -> Result<()> {
        if len == expected {
            return Ok(());
        }
        Err(CommError::InvalidArgument {
            rank: self.global_ranks[self.me],
            op: op.into(),
            reason: format!("{len} bytes where the blocks make {expected}"),
        })
    }
}

/// How many of the peers waited for must be ready.
#[derive(Clone, Copy)]
enum Need {
    All,
    Any,
}
