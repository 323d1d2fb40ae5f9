//! Shared memory between the processes of a group on one host: one segment per group holding
//! a single-producer single-consumer byte ring per ordered pair of ranks, a doorbell per rank
//! (a futex word every producer and consumer rings after making progress), and an abort slot.
//!
//! Data moves with two copies (sender's buffer into the ring, ring into the receiver's buffer
//! or straight into its reduction), no system call on the data path, and a futex sleep only
//! when a rank has nothing to do. The file behind the segment is unlinked as soon as every
//! rank has mapped it, so a crash cannot leave it behind.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

const MAGIC: u64 = 0x4653_4450_5348_4d31; // "FSDPSHM1"
const HEADER_BYTES: usize = 64;
const ABORT_BYTES: usize = 1024;
const DOORBELL_BYTES: usize = 64;
const RING_HEADER_BYTES: usize = 128;
/// How long a waiting rank spins, then yields, before sleeping on its doorbell.
const SPIN_FOR: Duration = Duration::from_micros(20);
const YIELD_FOR: Duration = Duration::from_millis(2);
/// Largest piece copied before the peer is told about it, so both sides work in parallel.
const PIECE: usize = 512 << 10;

/// The start of the names of the segments process `pid` creates in /dev/shm.
fn segment_prefix(pid: u32) -> String {
    format!("fsdp-{pid}-")
}

/// A new segment's path for group `name`, created by this process.
pub(crate) fn segment_path(name: &str) -> PathBuf {
    let safe: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    PathBuf::from(format!(
        "/dev/shm/{}{safe}-{nanos}",
        segment_prefix(std::process::id())
    ))
}

/// Removes the shared-memory segments process `pid` created: one killed between creating a
/// segment and unlinking it leaves it behind (launchers call this for each worker).
pub fn remove_segments_of(pid: u32) {
    let prefix = segment_prefix(pid);
    if let Ok(entries) = std::fs::read_dir("/dev/shm") {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Byte capacity of each ring for a group of `n` ranks.
pub fn ring_capacity(n: usize) -> usize {
    if n <= 4 { 4 << 20 } else { 1 << 20 }
}

fn segment_bytes(n: usize, capacity: usize) -> usize {
    HEADER_BYTES + ABORT_BYTES + n * DOORBELL_BYTES + n * n * (RING_HEADER_BYTES + capacity)
}

/// A mapped segment.
pub struct Segment {
    base: *mut u8,
    len: usize,
    n: usize,
    capacity: usize,
    me: usize,
}

// SAFETY: the segment is only accessed through atomics and through ring regions whose
// ownership (producer writes ahead of `head`, consumer reads behind it) is handed over with
// release/acquire on the ring counters.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates and maps a new segment file (exclusive, mode 0600).
    pub fn create(path: &PathBuf, n: usize, me: usize) -> std::io::Result<Segment> {
        let capacity = ring_capacity(n);
        let len = segment_bytes(n, capacity);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.set_len(len as u64)?;
        let seg = Segment::map(&file, len, n, capacity, me)?;
        seg.u64_at(0).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Maps an existing segment file.
    pub fn open(path: &PathBuf, n: usize, me: usize) -> std::io::Result<Segment> {
        let capacity = ring_capacity(n);
        let len = segment_bytes(n, capacity);
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        if file.metadata()?.len() != len as u64 {
            return Err(std::io::Error::other(
                "shared memory segment has the wrong size",
            ));
        }
        let seg = Segment::map(&file, len, n, capacity, me)?;
        if seg.u64_at(0).load(Ordering::Acquire) != MAGIC {
            return Err(std::io::Error::other(
                "shared memory segment is not initialised",
            ));
        }
        Ok(seg)
    }

    fn map(
        file: &std::fs::File,
        len: usize,
        n: usize,
        capacity: usize,
        me: usize,
    ) -> std::io::Result<Segment> {
        use std::os::fd::AsRawFd;
        // SAFETY: mapping a file we hold open, with its full length.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Segment {
            base: base.cast(),
            len,
            n,
            capacity,
            me,
        })
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.len);
        // SAFETY: in bounds, 8-aligned (page-aligned base), shared memory accessed atomically.
        unsafe { &*self.base.add(off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.len);
        // SAFETY: as above.
        unsafe { &*self.base.add(off).cast::<AtomicU32>() }
    }

    fn doorbell(&self, rank: usize) -> &AtomicU32 {
        self.u32_at(HEADER_BYTES + ABORT_BYTES + rank * DOORBELL_BYTES)
    }

    fn sleeping(&self, rank: usize) -> &AtomicU32 {
        self.u32_at(HEADER_BYTES + ABORT_BYTES + rank * DOORBELL_BYTES + 4)
    }

    fn ring_off(&self, src: usize, dst: usize) -> usize {
        HEADER_BYTES
            + ABORT_BYTES
            + self.n * DOORBELL_BYTES
            + (src * self.n + dst) * (RING_HEADER_BYTES + self.capacity)
    }

    /// Producer counter (bytes ever written) of ring src→dst.
    fn head(&self, src: usize, dst: usize) -> &AtomicU64 {
        self.u64_at(self.ring_off(src, dst))
    }

    /// Consumer counter (bytes ever read) of ring src→dst.
    fn tail(&self, src: usize, dst: usize) -> &AtomicU64 {
        self.u64_at(self.ring_off(src, dst) + 64)
    }

    fn data(&self, src: usize, dst: usize) -> *mut u8 {
        // SAFETY: in bounds of the mapping.
        unsafe { self.base.add(self.ring_off(src, dst) + RING_HEADER_BYTES) }
    }

    /// Wakes `rank` if it sleeps; call after making progress it may wait for.
    pub fn ring_doorbell(&self, rank: usize) {
        self.doorbell(rank).fetch_add(1, Ordering::SeqCst);
        if self.sleeping(rank).load(Ordering::SeqCst) != 0 {
            futex_wake(self.doorbell(rank));
        }
    }

    /// This rank's doorbell value; pass it to [`Segment::sleep`].
    pub fn doorbell_value(&self) -> u32 {
        self.doorbell(self.me).load(Ordering::SeqCst)
    }

    /// Sleeps until the doorbell moves past `seen` or `max` passes. `recheck` runs after
    /// announcing the sleep, closing the race with a concurrent ring.
    pub fn sleep(&self, seen: u32, max: Duration, recheck: impl FnOnce() -> bool) {
        let sleeping = self.sleeping(self.me);
        sleeping.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !recheck() {
            futex_wait(self.doorbell(self.me), seen, max);
        }
        sleeping.store(0, Ordering::SeqCst);
    }

    /// Records the first failure of the group and wakes every rank.
    pub fn abort(&self, origin: usize, message: &str) {
        let flag = self.u32_at(8);
        if flag
            .compare_exchange(0, u32::MAX, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let bytes = &message.as_bytes()[..message.len().min(ABORT_BYTES - 4)];
            // SAFETY: the abort area is written only by the rank that won the flag.
            unsafe {
                let area = self.base.add(HEADER_BYTES);
                area.cast::<u32>().write_unaligned(bytes.len() as u32);
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), area.add(4), bytes.len());
            }
            flag.store(origin as u32 + 1, Ordering::SeqCst);
        }
        for r in 0..self.n {
            self.ring_doorbell(r);
        }
    }

    /// The group's first failure, if any: (origin rank, message).
    pub fn aborted(&self) -> Option<(usize, String)> {
        match self.u32_at(8).load(Ordering::SeqCst) {
            0 | u32::MAX => None,
            origin => {
                // SAFETY: the message was written before the flag was set (SeqCst).
                let msg = unsafe {
                    let area = self.base.add(HEADER_BYTES);
                    let len = (area.cast::<u32>().read_unaligned() as usize).min(ABORT_BYTES - 4);
                    String::from_utf8_lossy(std::slice::from_raw_parts(area.add(4), len))
                        .into_owned()
                };
                Some((origin as usize - 1, msg))
            }
        }
    }

    /// Free bytes in ring me→peer.
    fn space(&self, peer: usize) -> usize {
        let head = self.head(self.me, peer).load(Ordering::Relaxed);
        let tail = self.tail(self.me, peer).load(Ordering::Acquire);
        self.capacity - (head - tail) as usize
    }

    /// Readable bytes in ring peer→me.
    fn available(&self, peer: usize) -> usize {
        let head = self.head(peer, self.me).load(Ordering::Acquire);
        let tail = self.tail(peer, self.me).load(Ordering::Relaxed);
        (head - tail) as usize
    }

    /// Copies `bytes` into ring me→peer at the current head (caller checked the space) and
    /// advances the head by `advance` (≥ `bytes.len()`, for padding).
    fn produce(&self, peer: usize, bytes: &[u8], advance: usize) {
        let head = self.head(self.me, peer).load(Ordering::Relaxed);
        let pos = (head % self.capacity as u64) as usize;
        let first = bytes.len().min(self.capacity - pos);
        let data = self.data(self.me, peer);
        // SAFETY: the region [head, head + advance) is free (checked by the caller) and only
        // this producer writes it until the head is published.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.add(pos), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), data, bytes.len() - first);
        }
        self.head(self.me, peer)
            .store(head + advance as u64, Ordering::Release);
    }

    /// Hands up to `len` readable bytes of ring peer→me to `sink` (at most two slices, split
    /// at the wrap), then advances the tail by `advance`.
    fn consume(&self, peer: usize, len: usize, advance: usize, sink: &mut dyn FnMut(&[u8])) {
        let tail = self.tail(peer, self.me).load(Ordering::Relaxed);
        let pos = (tail % self.capacity as u64) as usize;
        let first = len.min(self.capacity - pos);
        let data = self.data(peer, self.me);
        // SAFETY: [tail, tail + len) was published by the producer (acquire in `available`)
        // and is not reused until the tail moves past it.
        unsafe {
            sink(std::slice::from_raw_parts(data.add(pos), first));
            if len > first {
                sink(std::slice::from_raw_parts(data, len - first));
            }
        }
        self.tail(peer, self.me)
            .store(tail + advance as u64, Ordering::Release);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, max: Duration) {
    let ts = libc::timespec {
        tv_sec: max.as_secs() as libc::time_t,
        tv_nsec: max.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 in shared memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32 in shared memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

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
                return Err(TransferError::Lost(p));
            }
            if last_progress.elapsed() >= timeout {
                return Err(TransferError::Timeout(waiting_on));
            }
            // Spin briefly (the peer is usually about to publish), then yield, then sleep on
            // the doorbell so an idle rank costs no CPU.
            let idle = last_progress.elapsed();
            if idle < SPIN_FOR {
                std::hint::spin_loop();
                continue;
            }
            if idle < YIELD_FOR {
                std::thread::yield_now();
                continue;
            }
            let can_move = || {
                outs.iter()
                    .any(|o| o.written != Some(usize::MAX) && self.space(o.peer) > 0)
                    || ins.iter().any(|i| !i.done && self.available(i.peer) > 0)
                    || self.aborted().is_some()
            };
            self.sleep(seen, Duration::from_millis(100), can_move);
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
