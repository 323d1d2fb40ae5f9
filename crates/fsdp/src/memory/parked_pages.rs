//! Pages moved out of a released full parameter and into the next one gathered or refilled,
//! instead of returned to the system and faulted in (and zeroed by the kernel) again.
//!
//! FSDP releases a unit's full parameters after its forward and gathers the next unit's of
//! the same shapes; backward refills them in reverse. Returned with `madvise`, every page of
//! those costs a fault and a kernel memset at the next write (llama_example in bf16: over a
//! third of a step's page faults). Here the released range's pages move, page tables and
//! all, to an address of their own (`mremap` with `MREMAP_DONTUNMAP`: the range stays mapped
//! and reads as zeros, as after `madvise`), and a later range of the same length takes them
//! (`mremap` to a fixed address) just before it is overwritten. The engine hands the pages
//! of one unit at a time: [`flush`] before a unit's release returns what the previous one
//! left, so at most one unit's parameters are held here per thread (per rank).
//!
//! Only ranges inside [`super::TrainingAllocator`]'s large blocks are moved: those are
//! mappings of this process's own, which stay two mappings at most (the moved pages and the
//! partial last page) however often their pages move.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::PAGE;

/// A thread's parked ranges (address, bytes), each a mapping of its own, oldest first: a
/// rank releases and gathers on its training thread, and ranks sharing a process (threads of
/// an in-process group) keep their pages apart.
struct Parked(Vec<(usize, usize)>);

impl Drop for Parked {
    fn drop(&mut self) {
        for &(at, bytes) in &self.0 {
            unmap(at, bytes);
        }
    }
}

thread_local! {
    static PARKED: RefCell<Parked> = const { RefCell::new(Parked(Vec::new())) };
}

/// Bytes parked now, on every thread (resident memory that belongs to no allocation).
static PARKED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Bytes of pages parked now.
pub(super) fn parked_bytes() -> usize {
    PARKED_BYTES.load(Ordering::Relaxed)
}

/// The whole pages inside `[address, address + bytes)`: their first address and length.
pub(super) fn whole_pages(address: usize, bytes: usize) -> (usize, usize) {
    let first = address.div_ceil(PAGE) * PAGE;
    let last = (address + bytes) / PAGE * PAGE;
    (first, last.saturating_sub(first))
}

fn unmap(address: usize, bytes: usize) {
    // SAFETY: a parked range: a mapping of ours that no allocation refers to.
    unsafe { libc::munmap(address as *mut libc::c_void, bytes) };
    PARKED_BYTES.fetch_sub(bytes, Ordering::Relaxed);
}

/// Moves the pages of `[from, from + len)` with `mremap`: onto `to` (replacing what is mapped
/// there), or with `to` `None` to an address the kernel picks, the range staying mapped and
/// empty (`MREMAP_DONTUNMAP`). Their new address, or `None` when the kernel refused.
///
/// # Safety
/// Both ranges are this process's own and nothing else uses them meanwhile.
unsafe fn move_pages(from: usize, len: usize, to: Option<usize>) -> Option<usize> {
    let (flags, target) = match to {
        Some(to) => (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, to),
        // The target is read whatever the flags: a stray value there fails the call.
        None => (libc::MREMAP_MAYMOVE | libc::MREMAP_DONTUNMAP, 0),
    };
    // SAFETY: the caller's.
    let moved = unsafe {
        libc::mremap(
            from as *mut libc::c_void,
            len,
            len,
            flags,
            target as *mut libc::c_void,
        )
    };
    (moved != libc::MAP_FAILED).then_some(moved as usize)
}

/// Moves the pages `[first, first + len)` (whole pages inside a large block) out and parks
/// them; the range stays mapped and reads as zeros. The bytes moved: 0 when the kernel
/// refused (before Linux 5.7), and the caller returns the pages with `madvise` instead.
///
/// # Safety
/// `[first, first + len)` is whole pages of an anonymous private mapping the caller owns and
/// nobody reads or writes during the call, and zeros are valid values of what it holds.
pub(super) unsafe fn park(first: usize, len: usize) -> usize {
    // SAFETY: the range is inside a large block of the caller's; its pages move to a new
    // mapping and it keeps its mapping, empty, so every reference into it stays valid.
    let Some(moved) = (unsafe { move_pages(first, len, None) }) else {
        return 0;
    };
    PARKED_BYTES.fetch_add(len, Ordering::Relaxed);
    PARKED.with_borrow_mut(|p| p.0.push((moved, len)));
    len
}

/// Moves parked pages onto `[first, first + len)` (whole pages inside a large block, about
/// to be overwritten: what they hold now is lost) when a parked range has that length.
/// The bytes moved in.
///
/// # Safety
/// `[first, first + len)` is whole pages of an anonymous private mapping the caller owns and
/// nobody reads or writes during the call, and any bytes are valid values of what it holds.
pub(super) unsafe fn unpark(first: usize, len: usize) -> usize {
    if len == 0 || parked_bytes() == 0 {
        return 0;
    }
    let taken = PARKED.with_borrow_mut(|p| {
        let i = p.0.iter().rposition(|&(_, b)| b == len)?;
        Some(p.0.remove(i).0)
    });
    let Some(taken) = taken else {
        return 0;
    };
    // SAFETY: `taken` is a parked mapping of `len` bytes, ours alone now; the destination is
    // inside the caller's large block, whose contents the caller is about to overwrite.
    if unsafe { move_pages(taken, len, Some(first)) }.is_none() {
        unmap(taken, len);
        return 0;
    }
    PARKED_BYTES.fetch_sub(len, Ordering::Relaxed);
    len
}

/// Returns every page this thread parked to the system.
pub(super) fn flush() {
    if parked_bytes() > 0 {
        PARKED.with_borrow_mut(|p| {
            for (at, bytes) in p.0.drain(..) {
                unmap(at, bytes);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minor page faults of the calling thread so far.
    fn minor_faults() -> i64 {
        // SAFETY: getrusage writes the struct it is given.
        unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut usage);
            usage.ru_minflt
        }
    }

    /// A fresh mapping of base pages (not advised for huge ones).
    fn mapping(bytes: usize) -> *mut u8 {
        let p = super::super::large_blocks::map_anonymous(bytes);
        assert!(!p.is_null());
        p
    }

    /// [`park`] of the whole pages inside `[address, address + bytes)`.
    fn park(address: usize, bytes: usize) -> usize {
        let (first, len) = whole_pages(address, bytes);
        // SAFETY: the tests' ranges are inside their own mappings of plain bytes.
        unsafe { super::park(first, len) }
    }

    /// [`unpark`] onto the whole pages inside `[address, address + bytes)`.
    fn unpark(address: usize, bytes: usize) -> usize {
        let (first, len) = whole_pages(address, bytes);
        // SAFETY: as in `park`.
        unsafe { super::unpark(first, len) }
    }

    fn this_thread_parked() -> usize {
        PARKED.with_borrow(|p| p.0.iter().map(|&(_, b)| b).sum())
    }

    /// The pages move, contents and all: the source reads zeros and stays mapped, the
    /// destination holds what the source held and writing it faults in nothing; a length
    /// with nothing parked takes nothing; a flush returns what is left.
    #[test]
    fn parked_pages_move_to_the_next_range_of_their_length() {
        const PAGES: usize = 64;
        let bytes = PAGES * PAGE;
        // The source and destination start 100 bytes into their mappings, as a vector's
        // data inside a larger block may: only the whole pages inside move.
        let (src_map, dst_map) = (mapping(bytes + PAGE), mapping(bytes + PAGE));
        // SAFETY (every block below): the ranges lie inside the two mappings, which this
        // test alone uses; moved pages leave them mapped.
        let (src, dst) = unsafe { (src_map.add(100), dst_map.add(100)) };
        let src_slice = unsafe { std::slice::from_raw_parts_mut(src, bytes) };
        for (i, b) in src_slice.iter_mut().enumerate() {
            *b = (i % 251) as u8 + 1;
        }
        let moved = park(src as usize, bytes);
        assert_eq!(
            moved,
            (PAGES - 1) * PAGE,
            "the whole pages inside the range"
        );
        assert_eq!(this_thread_parked(), moved);
        let (first, len) = whole_pages(src as usize, bytes);
        let inner = unsafe { std::slice::from_raw_parts(first as *const u8, len) };
        assert!(
            inner.iter().all(|&b| b == 0),
            "a parked range reads as zeros"
        );
        assert_ne!(src_slice[0], 0, "the partial first page stays");

        // Touch the destination's pages first: taking parked pages replaces them.
        unsafe { std::ptr::write_bytes(dst, 9, bytes) };
        assert_eq!(unpark(dst as usize, bytes), moved);
        assert_eq!(this_thread_parked(), 0);
        let (dst_first, _) = whole_pages(dst as usize, bytes);
        let got = unsafe { std::slice::from_raw_parts(dst_first as *const u8, len) };
        let want = unsafe { std::slice::from_raw_parts(first as *const u8, len) };
        let source_offset = first - src as usize;
        assert!(
            got.iter()
                .enumerate()
                .all(|(i, &b)| b == ((i + source_offset) % 251) as u8 + 1),
            "the destination holds the source's pages"
        );
        assert!(want.iter().all(|&b| b == 0));
        let before = minor_faults();
        unsafe { std::ptr::write_bytes(dst_first as *mut u8, 3, len) };
        assert_eq!(
            minor_faults() - before,
            0,
            "writing moved pages faults nothing"
        );

        // Nothing of another length is parked; a flush returns what is.
        assert_eq!(unpark(dst as usize, bytes - PAGE), 0);
        assert_eq!(park(dst as usize, bytes), moved);
        assert_eq!(unpark(src as usize, bytes / 2), 0);
        flush();
        assert_eq!(this_thread_parked(), 0);
        assert_eq!(unpark(src as usize, bytes), 0, "flushed pages are gone");
        unsafe {
            libc::munmap(src_map.cast(), bytes + PAGE);
            libc::munmap(dst_map.cast(), bytes + PAGE);
        }
    }
}
