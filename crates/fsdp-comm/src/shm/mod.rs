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
use std::time::Duration;

mod blocks;
mod transfer;

pub(crate) use blocks::BlocksGroup;
pub use blocks::{MAX_SLOTS, SharedBlocks};
pub use transfer::{InFrame, OutFrame, Sink, TransferError};

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
    pub fn create(path: &std::path::Path, n: usize, me: usize) -> std::io::Result<Segment> {
        let capacity = ring_capacity(n);
        let len = segment_bytes(n, capacity);
        let file = create_file(path, len)?;
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
        let base = map_shared(file, len, 0)?;
        Ok(Segment {
            base,
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

    /// Waits a little for progress after `idle` without any: spins briefly (the peer is
    /// usually about to publish), then yields, then sleeps on this rank's doorbell (seen at
    /// `seen`; `recheck` as in [`Segment::sleep`]) so an idle rank costs no CPU.
    pub fn back_off(&self, idle: Duration, seen: u32, recheck: impl FnOnce() -> bool) {
        if idle < SPIN_FOR {
            std::hint::spin_loop();
        } else if idle < YIELD_FOR {
            std::thread::yield_now();
        } else {
            self.sleep(seen, Duration::from_millis(100), recheck);
        }
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

/// A new file of `len` bytes at `path`: exclusive (an existing one is an error), mode 0600.
fn create_file(path: &std::path::Path, len: usize) -> std::io::Result<std::fs::File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.set_len(len as u64)?;
    Ok(file)
}

/// Maps the first `len` bytes of `file` shared, readable and writable, with `flags` added
/// (`MAP_POPULATE`).
fn map_shared(file: &std::fs::File, len: usize, flags: libc::c_int) -> std::io::Result<*mut u8> {
    use std::os::fd::AsRawFd;
    // SAFETY: mapping a file the caller holds open; the mapping outlives the descriptor.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | flags,
            file.as_raw_fd(),
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(base.cast())
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
