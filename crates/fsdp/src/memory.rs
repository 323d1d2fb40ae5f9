//! Live-byte accounting: a counting global allocator a binary can install, plus the bytes the
//! engine has handed back to the system inside allocations that stay live (released full
//! parameters keep their storage, see `engine::sharded`), so "resident model memory" can be
//! measured rather than estimated. glibc keeps freed blocks, so peak RSS alone cannot show
//! what FSDP frees.
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: fsdp::memory::CountingAllocator = fsdp::memory::CountingAllocator;
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);
static RELEASED: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes and their peak (less the engine's released bytes).
pub struct CountingAllocator;

fn note_alloc(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    let resident = live as i64 - RELEASED.load(Ordering::Relaxed) as i64;
    PEAK.fetch_max(resident, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are updated.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note_alloc(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's pointer, layout and size.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            note_alloc(new_size);
        }
        p
    }
}

impl CountingAllocator {
    /// Marks the allocator as installed (call once from `main`), so [`counting`] can tell
    /// measured figures from zeros.
    pub fn mark_installed() {
        INSTALLED.store(true, Ordering::Relaxed);
    }
}

/// Whether a [`CountingAllocator`] is installed and marked.
pub fn counting() -> bool {
    INSTALLED.load(Ordering::Relaxed) && LIVE.load(Ordering::Relaxed) > 0
}

/// Bytes currently allocated and resident: live allocations less the pages the engine
/// returned to the system inside them.
pub fn resident_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
        .saturating_sub(RELEASED.load(Ordering::Relaxed))
}

/// The highest [`resident_bytes`] seen since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed).max(0) as usize
}

/// Starts a new peak measurement from the current resident bytes.
pub fn reset_peak() {
    PEAK.store(resident_bytes() as i64, Ordering::Relaxed);
}

/// Records `bytes` returned to the system inside a live allocation.
pub(crate) fn note_released(bytes: usize) {
    RELEASED.fetch_add(bytes, Ordering::Relaxed);
}

/// Records `bytes` of a released allocation resident again (refilled or freed).
pub(crate) fn note_reclaimed(bytes: usize) {
    RELEASED.fetch_sub(bytes, Ordering::Relaxed);
}

/// Makes glibc keep freed memory for reuse instead of returning it to the system after every
/// large free: training allocates and frees the same multi-megabyte activations every step,
/// and returning them costs a page fault per 4 KiB on the next allocation (measured: one BERT
/// layer's forward+backward 117 ms -> 89 ms). Big blocks (up to 32 MiB) come from the heap
/// and the heap is trimmed only above 1 GiB of free space. Skipped when `FSDP_MALLOC_TUNING=0`
/// or when the user set glibc's own `MALLOC_*` variables; a no-op off glibc.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let user_set = std::env::vars()
            .any(|(k, _)| k.starts_with("MALLOC_") && k.ends_with('_') || k == "GLIBC_TUNABLES");
        if user_set || std::env::var("FSDP_MALLOC_TUNING").is_ok_and(|v| v == "0") {
            return;
        }
        // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

/// This process's peak resident set size (VmHWM) in bytes, where the system reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
