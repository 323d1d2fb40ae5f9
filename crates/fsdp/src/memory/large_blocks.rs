//! Large allocations on mappings of their own, freed ones kept for reuse while they fit under
//! the highest live total: the memory of [`super::TrainingAllocator`].
//!
//! Training frees and allocates the same multi-megabyte activations and gradients every
//! step. From one heap they fragment it (a peak RSS some hundreds of MiB above the live
//! peak, varying run to run); from mappings returned at every free each new one costs a
//! page fault per 4 KiB (llama_example: 20% slower). Here each large block is a mapping of
//! its own, so nothing fragments, and a freed block is kept for the next request of exactly
//! its size (a training step asks for the same sizes again) as long as the resident bytes of
//! the blocks in use and the kept ones together stay within the most ever resident in use at
//! once: keeping freed memory never raises the peak. Resident: less the pages the engine
//! returned inside live allocations (released full parameters, which stay allocated while
//! the autograd graph holds them; see [`super::note_released`]) — kept blocks are wholly
//! resident, so mapped bytes would be the wrong measure.
//!
//! Blocks of [`HUGE_PAGE`] and more start on a huge-page boundary and are advised for
//! transparent huge pages: a fresh block, or one refilled after its pages were returned,
//! then costs one fault per 2 MiB instead of 512 (llama_example in bf16: 8.8M faults ->
//! 3.4M, 8% more tokens/s). Setting the system's
//! `/sys/kernel/mm/transparent_hugepage/enabled` to `never` turns it off.

use std::sync::Mutex;

use super::PAGE;

/// Allocations of at least this many bytes (and an alignment of at most a page) get a
/// mapping of their own under [`super::TrainingAllocator`].
pub(super) const LARGE: usize = 1 << 20;

/// Freed blocks kept at most (a fixed table: the allocator cannot allocate).
const SLOTS: usize = 2048;

/// The blocks' bookkeeping. Every figure is in whole pages' bytes.
struct Blocks {
    /// Kept blocks (address, bytes), oldest first.
    kept: [(usize, usize); SLOTS],
    count: usize,
    kept_bytes: usize,
    /// Bytes of blocks handed out and not yet freed.
    in_use: usize,
    /// The most [`Blocks::resident`] has been.
    high_water: usize,
}

static BLOCKS: Mutex<Blocks> = Mutex::new(Blocks {
    kept: [(0, 0); SLOTS],
    count: 0,
    kept_bytes: 0,
    in_use: 0,
    high_water: 0,
});

fn blocks() -> std::sync::MutexGuard<'static, Blocks> {
    BLOCKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether an allocation of `size` bytes aligned to `align` is served here by an allocator
/// taking blocks of `from` bytes and more.
pub(super) fn is_large(size: usize, align: usize, from: usize) -> bool {
    size >= from && align <= PAGE
}

/// `size` rounded up to whole pages: a block's length.
fn pages(size: usize) -> usize {
    size.div_ceil(PAGE) * PAGE
}

impl Blocks {
    /// Bytes of blocks in use that are resident: `in_use` less the pages returned inside
    /// live allocations (all of them counted here, also those inside heap allocations, so
    /// the figure errs low and fewer blocks are kept, never more), parked pages counting as
    /// resident.
    fn resident(&self) -> usize {
        self.in_use.saturating_sub(super::returned_bytes())
    }

    /// Raises the high-water mark to what is resident now.
    fn note_high_water(&mut self) {
        self.high_water = self.high_water.max(self.resident());
    }

    /// Takes a kept block of exactly `bytes`, the newest first.
    fn take(&mut self, bytes: usize) -> Option<usize> {
        let i = self.kept[..self.count]
            .iter()
            .rposition(|&(_, b)| b == bytes)?;
        let (address, _) = self.kept[i];
        self.kept.copy_within(i + 1..self.count, i);
        self.count -= 1;
        self.kept_bytes -= bytes;
        Some(address)
    }

    /// Unmaps the oldest kept block; false when none is kept.
    fn evict_oldest(&mut self) -> bool {
        if self.count == 0 {
            return false;
        }
        let (address, bytes) = self.kept[0];
        self.kept.copy_within(1..self.count, 0);
        self.count -= 1;
        self.kept_bytes -= bytes;
        unmap(address, bytes);
        true
    }

    /// Unmaps kept blocks, oldest first, until `extra` more bytes fit under the high-water
    /// mark.
    fn make_room(&mut self, extra: usize) {
        while self.resident() + self.kept_bytes + extra > self.high_water && self.evict_oldest() {}
    }
}

/// Returns pages of ours: a whole block, or the unused ends of `map`'s larger mapping.
fn unmap(address: usize, bytes: usize) {
    // SAFETY: (address, bytes) lies in a mapping made by `map_anonymous` and is not (or no
    // longer) handed out.
    unsafe { libc::munmap(address as *mut libc::c_void, bytes) };
}

/// Blocks of at least this many bytes are aligned to it and advised for transparent huge
/// pages (the x86-64 and arm64 huge page with 4 KiB base pages).
pub(super) const HUGE_PAGE: usize = 2 << 20;

/// A fresh mapping of `bytes` (zero-filled by the kernel), or null; from [`HUGE_PAGE`] on,
/// aligned to it and advised for huge pages.
fn map(bytes: usize) -> *mut u8 {
    if bytes < HUGE_PAGE {
        return map_anonymous(bytes);
    }
    // Map enough that a huge-page boundary falls within reach, then return both ends.
    let slack = HUGE_PAGE - PAGE;
    let start = map_anonymous(bytes + slack) as usize;
    if start == 0 {
        return std::ptr::null_mut();
    }
    let aligned = start.next_multiple_of(HUGE_PAGE);
    if aligned > start {
        unmap(start, aligned - start);
    }
    let (end, used_end) = (start + bytes + slack, aligned + bytes);
    if end > used_end {
        unmap(used_end, end - used_end);
    }
    // SAFETY: [aligned, used_end) is a mapping of ours. Where the kernel has no transparent
    // huge pages the advice fails and the block keeps base pages.
    unsafe { libc::madvise(aligned as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
    aligned as *mut u8
}

/// An anonymous private mapping of `bytes` where the kernel chooses, or null.
pub(super) fn map_anonymous(bytes: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p.cast()
    }
}

/// A block of at least `size` bytes, page-aligned, zero-filled when `zeroed`; null when the
/// system has no memory for it.
pub(super) fn allocate(size: usize, zeroed: bool) -> *mut u8 {
    let bytes = pages(size);
    let reused = {
        let mut b = blocks();
        b.in_use += bytes;
        b.note_high_water();
        let reused = b.take(bytes);
        if reused.is_none() {
            b.make_room(0);
        }
        reused
    };
    if let Some(address) = reused {
        let p = address as *mut u8;
        if zeroed {
            // SAFETY: the block is `bytes` long and now belongs to this caller alone.
            unsafe { std::ptr::write_bytes(p, 0, size) };
        }
        return p;
    }
    let mut p = map(bytes);
    if p.is_null() {
        // Out of memory: kept blocks go back to the system before giving up.
        while blocks().evict_oldest() {}
        p = map(bytes);
    }
    if p.is_null() {
        blocks().in_use -= bytes;
    }
    p
}

/// Takes back a block of `size` bytes from [`allocate`]: kept for reuse, or unmapped when
/// keeping it would pass the limit.
pub(super) fn free(p: *mut u8, size: usize) {
    let bytes = pages(size);
    let mut b = blocks();
    b.in_use -= bytes;
    // Refilled pages are resident again without an allocation to see them.
    b.note_high_water();
    if b.count == SLOTS {
        b.evict_oldest();
    }
    b.make_room(bytes);
    if b.resident() + b.kept_bytes + bytes > b.high_water {
        drop(b);
        unmap(p as usize, bytes);
        return;
    }
    let slot = b.count;
    b.kept[slot] = (p as usize, bytes);
    b.count += 1;
    b.kept_bytes += bytes;
}

/// Resizes a block from [`allocate`] of `old` bytes to `new` (both large): in place or moved
/// by the kernel, without copying through user space; null when it cannot.
pub(super) fn resize(p: *mut u8, old: usize, new: usize) -> *mut u8 {
    let (old_bytes, new_bytes) = (pages(old), pages(new));
    if old_bytes == new_bytes {
        return p;
    }
    // SAFETY: (p, old_bytes) is a whole mapping of ours handed out to this caller.
    let q = unsafe { libc::mremap(p.cast(), old_bytes, new_bytes, libc::MREMAP_MAYMOVE) };
    if q == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    let mut b = blocks();
    b.in_use = b.in_use - old_bytes + new_bytes;
    b.note_high_water();
    q.cast()
}

/// Bytes of freed blocks kept for reuse now.
pub(super) fn kept_bytes() -> usize {
    blocks().kept_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// Blocks whose pages were returned (released full parameters) do not count toward the
    /// limit: once they are refilled, what is kept must shrink to what was ever resident.
    #[test]
    fn the_limit_counts_resident_bytes_not_mapped_ones() {
        super::super::CountingAllocator::mark_installed();
        // 8 blocks of 4 MiB, resident: the high-water mark is 32 MiB.
        let first: Vec<*mut u8> = (0..8).map(|_| allocate(4 * MIB, true)).collect();
        // Their pages returned, as the engine releases full parameters after forward.
        for &p in &first {
            super::super::note_released(p, 4 * MIB);
        }
        // 8 more in use and freed: kept (resident in use 0, so all 32 MiB fit).
        let second: Vec<*mut u8> = (0..8).map(|_| allocate(4 * MIB, true)).collect();
        for p in second {
            free(p, 4 * MIB);
        }
        assert_eq!(kept_bytes(), 32 * MIB);
        // The first ones refilled: 32 MiB resident in use again, and with the kept 32 MiB
        // the process would hold 64 where it never held more than 32 (mapped, it had 64).
        for &p in &first {
            super::super::note_refilled(p);
        }
        let other = allocate(5 * MIB, false);
        assert!(
            kept_bytes() <= 4 * MIB,
            "{} MiB kept beside 37 resident in use, against a high-water mark of 37",
            kept_bytes() / MIB
        );
        free(other, 5 * MIB);
        for p in first {
            free(p, 4 * MIB);
        }
    }
}
