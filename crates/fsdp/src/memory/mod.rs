//! Live-byte accounting: a counting global allocator a binary can install, plus the bytes the
//! engine has handed back to the system inside allocations that stay live (released full
//! parameters keep their storage, see `engine::sharded`), so "resident model memory" can be
//! measured rather than estimated. glibc keeps freed blocks, so peak RSS alone cannot show
//! what FSDP frees. Returned bytes count as resident again exactly when their allocation is
//! refilled or freed (the allocator itself sees the free): not when the engine lets go of
//! its handle while the autograd graph still holds the storage.
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: fsdp::memory::CountingAllocator = fsdp::memory::CountingAllocator;
//! ```

mod activations;
mod large_blocks;
mod lazy_zeros;
mod parked_pages;

#[doc(hidden)] // `fsdp estimate-memory`
pub use activations::ActivationShape;
pub(crate) use lazy_zeros::lazily_zeroed;

use std::alloc::{GlobalAlloc, Layout, System};
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);
static RELEASED: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Bytes returned to the system inside live allocations: released less what of it is parked
/// (moved out, still resident, waiting for the next parameter).
fn returned_bytes() -> usize {
    RELEASED
        .load(Ordering::Relaxed)
        .saturating_sub(parked_pages::parked_bytes())
}

/// How many allocations can have returned pages at once; beyond it a release is not counted
/// (the figures then overstate what is resident, never understate it).
const RELEASED_CAPACITY: usize = 4096;

/// The live allocations with pages returned inside them: (address, bytes returned). A fixed
/// array, so the allocator's free path can consult it without allocating.
struct ReleasedAllocations {
    len: usize,
    entries: [(usize, usize); RELEASED_CAPACITY],
}

impl ReleasedAllocations {
    fn position(&self, address: usize) -> Option<usize> {
        self.entries[..self.len]
            .iter()
            .position(|&(a, _)| a == address)
    }

    /// Forgets `address`; the bytes it had returned.
    fn remove(&mut self, address: usize) -> usize {
        let Some(i) = self.position(address) else {
            return 0;
        };
        let (_, bytes) = self.entries[i];
        self.len -= 1;
        self.entries[i] = self.entries[self.len];
        RELEASED_COUNT.store(self.len, Ordering::Relaxed);
        bytes
    }

    /// Records `bytes` returned inside `address` (not yet in the table); false when full.
    fn insert(&mut self, address: usize, bytes: usize) -> bool {
        if self.len == RELEASED_CAPACITY {
            return false;
        }
        self.entries[self.len] = (address, bytes);
        self.len += 1;
        RELEASED_COUNT.store(self.len, Ordering::Relaxed);
        true
    }
}

static RELEASED_ALLOCATIONS: Mutex<ReleasedAllocations> = Mutex::new(ReleasedAllocations {
    len: 0,
    entries: [(0, 0); RELEASED_CAPACITY],
});
/// Entries in [`RELEASED_ALLOCATIONS`], read without its lock so frees skip it when empty.
static RELEASED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// A page: the smallest allocation that can hold a whole returned one, and the unit and
/// largest alignment of `large_blocks`' mappings.
const PAGE: usize = 4096;

fn released_allocations() -> std::sync::MutexGuard<'static, ReleasedAllocations> {
    RELEASED_ALLOCATIONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The allocation at `address` is resident again (refilled or freed): the bytes it had
/// returned stop being subtracted.
fn forget_released(address: usize) {
    if RELEASED_COUNT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let bytes = released_allocations().remove(address);
    if bytes > 0 {
        RELEASED.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The allocation at `address` (of `size` bytes) is being freed, after its own bytes left
/// the live count.
fn note_freed(address: *mut u8, size: usize) {
    if size >= PAGE {
        forget_released(address as usize);
    }
}

/// The system allocator, counting live bytes and their peak (less the engine's released bytes).
pub struct CountingAllocator;

/// The allocator for training programs: counts as [`CountingAllocator`] does, and serves
/// allocations of 1 MiB and more (activations, gradients, gathered parameters) from mappings
/// of their own, keeping freed ones for the next request of the same size while the resident
/// bytes of the blocks in use and kept stay within the most ever resident at once (pages the
/// engine returned inside live allocations do not count). Nothing large fragments the heap and
/// a step's repeated sizes cost no page faults, so peak RSS follows the live peak (measured on
/// llama_example, 2 processes: 1,900-2,045 MiB per rank from glibc's heap, varying run to
/// run, against 1,755-1,757 with this allocator, about 45 MiB above the live peak, tokens/s
/// unchanged).
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: fsdp::accelerator::TrainingAllocator = fsdp::accelerator::TrainingAllocator;
/// ```
pub struct TrainingAllocator;

/// The largest request glibc serves from its heap (larger ones it maps and unmaps at every
/// call; its mapping threshold cannot be raised above this on 64-bit systems).
pub(crate) const HEAP_LARGEST: usize = 32 << 20;

/// [`TrainingAllocator`] for the allocations glibc's heap cannot keep: those of 32 MiB and more
/// (which glibc maps and unmaps at every call, so each costs a page fault per 4 KiB every
/// time) on kept mappings, everything smaller from glibc's heap as
/// [`retain_freed_memory`] tunes it. For jobs whose repeated allocations are mostly under 32
/// MiB, where the heap serves them without faults and [`TrainingAllocator`]'s mappings of
/// every block from 1 MiB cost more than they save (nlp_example's 47 MB embeddings unit:
/// docs/BENCHMARKS.md). Install and mark it as [`TrainingAllocator`].
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: fsdp::accelerator::HeapTrainingAllocator = fsdp::accelerator::HeapTrainingAllocator;
/// ```
pub struct HeapTrainingAllocator;

impl HeapTrainingAllocator {
    /// Marks the allocator as installed (call once from `main`), as
    /// [`CountingAllocator::mark_installed`].
    pub fn mark_installed() {
        mark_large_blocks_from(HEAP_LARGEST);
    }

    /// Bytes of freed large blocks kept for reuse now (resident, not live).
    pub fn kept_bytes() -> usize {
        large_blocks::kept_bytes()
    }
}

/// The large blocks' threshold of the installed and marked [`TrainingAllocator`] or
/// [`HeapTrainingAllocator`] (0: neither marked, no allocation is a large block).
static LARGE_FROM: AtomicUsize = AtomicUsize::new(0);

/// Marks an allocator serving blocks of `from` bytes and more as installed.
fn mark_large_blocks_from(from: usize) {
    CountingAllocator::mark_installed();
    LARGE_FROM.store(from, Ordering::Relaxed);
}

fn note_alloc(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    let resident = live as i64 - returned_bytes() as i64;
    PEAK.fetch_max(resident, Ordering::Relaxed);
}

/// Blocks of `FROM` bytes and more from [`large_blocks`], the rest from the system: what
/// [`TrainingAllocator`] (`FROM` = [`large_blocks::LARGE`]) and [`HeapTrainingAllocator`]
/// (`FROM` = [`HEAP_LARGEST`]) count. Which way an allocation went follows from its layout
/// alone, so it is freed the way it came.
struct LargeBlocksOrSystem<const FROM: usize>;

fn large<const FROM: usize>(layout: Layout) -> bool {
    large_blocks::is_large(layout.size(), layout.align(), FROM)
}

// SAFETY: large layouts get whole page-aligned mappings of at least their size (alignment at
// most a page, checked by `large`) and go back to `large_blocks` with the same layout; the
// rest is forwarded to `System` unchanged.
unsafe impl<const FROM: usize> GlobalAlloc for LargeBlocksOrSystem<FROM> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if large::<FROM>(layout) {
            return large_blocks::allocate(layout.size(), false);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if large::<FROM>(layout) {
            return large_blocks::allocate(layout.size(), true);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if large::<FROM>(layout) {
            return large_blocks::free(ptr, layout.size());
        }
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size`, rounded up to `layout.align()`, fits isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (large::<FROM>(layout), large::<FROM>(new_layout)) {
            (true, true) => {
                let p = large_blocks::resize(ptr, layout.size(), new_size);
                if !p.is_null() {
                    return p;
                }
                // A block whose pages were parked and taken back is several mappings, which
                // the kernel does not resize as one.
                // SAFETY: the caller's contract, forwarded.
                unsafe { self.copied(ptr, layout, new_layout) }
            }
            // SAFETY: forwarded with the caller's pointer, layout and size.
            (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
            // Between the heap and a mapping.
            // SAFETY: the caller's contract, forwarded.
            _ => unsafe { self.copied(ptr, layout, new_layout) },
        }
    }
}

impl<const FROM: usize> LargeBlocksOrSystem<FROM> {
    /// Reallocation by copying: a new block, the common bytes, the old one freed.
    ///
    /// # Safety
    /// As [`GlobalAlloc::realloc`], `new_layout` being the new size with the old alignment.
    unsafe fn copied(&self, ptr: *mut u8, layout: Layout, new_layout: Layout) -> *mut u8 {
        // SAFETY: `new_layout` is the caller's valid layout for the new size.
        let p = unsafe { self.alloc(new_layout) };
        if !p.is_null() {
            // SAFETY: both blocks hold at least the smaller size and do not overlap; the old
            // one is the caller's, freed with its own layout.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_layout.size()));
                self.dealloc(ptr, layout);
            }
        }
        p
    }
}

/// `inner.alloc`, counted.
///
/// # Safety
/// As [`GlobalAlloc::alloc`].
unsafe fn counted_alloc(inner: &impl GlobalAlloc, layout: Layout, zeroed: bool) -> *mut u8 {
    // SAFETY: forwarded with the caller's layout.
    let p = unsafe {
        if zeroed {
            inner.alloc_zeroed(layout)
        } else {
            inner.alloc(layout)
        }
    };
    if !p.is_null() {
        note_alloc(layout.size());
    }
    p
}

/// `inner.dealloc`, counted.
///
/// # Safety
/// As [`GlobalAlloc::dealloc`].
unsafe fn counted_dealloc(inner: &impl GlobalAlloc, ptr: *mut u8, layout: Layout) {
    // Before the address can be handed out again.
    LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    note_freed(ptr, layout.size());
    // SAFETY: forwarded with the caller's pointer and layout.
    unsafe { inner.dealloc(ptr, layout) };
}

/// `inner.realloc`, counted.
///
/// # Safety
/// As [`GlobalAlloc::realloc`].
unsafe fn counted_realloc(
    inner: &impl GlobalAlloc,
    ptr: *mut u8,
    layout: Layout,
    new_size: usize,
) -> *mut u8 {
    // SAFETY: forwarded with the caller's pointer, layout and size.
    let p = unsafe { inner.realloc(ptr, layout, new_size) };
    if !p.is_null() {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        note_freed(ptr, layout.size());
        note_alloc(new_size);
    }
    p
}

/// A counting global allocator over `$inner`.
macro_rules! counting_over {
    ($allocator:ty, $inner:expr) => {
        // SAFETY: every call is forwarded to the inner allocator unchanged; only counters
        // are updated.
        unsafe impl GlobalAlloc for $allocator {
            unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
                // SAFETY: the caller's contract, forwarded.
                unsafe { counted_alloc(&$inner, layout, false) }
            }

            unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
                // SAFETY: the caller's contract, forwarded.
                unsafe { counted_alloc(&$inner, layout, true) }
            }

            unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
                // SAFETY: the caller's contract, forwarded.
                unsafe { counted_dealloc(&$inner, ptr, layout) }
            }

            unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
                // SAFETY: the caller's contract, forwarded.
                unsafe { counted_realloc(&$inner, ptr, layout, new_size) }
            }
        }
    };
}

counting_over!(CountingAllocator, System);
counting_over!(
    TrainingAllocator,
    LargeBlocksOrSystem::<{ large_blocks::LARGE }>
);
counting_over!(HeapTrainingAllocator, LargeBlocksOrSystem::<HEAP_LARGEST>);

impl CountingAllocator {
    /// Marks the allocator as installed (call once from `main`), so [`counting`] can tell
    /// measured figures from zeros.
    pub fn mark_installed() {
        INSTALLED.store(true, Ordering::Relaxed);
    }
}

impl TrainingAllocator {
    /// Marks the allocator as installed (call once from `main`), as
    /// [`CountingAllocator::mark_installed`].
    pub fn mark_installed() {
        mark_large_blocks_from(large_blocks::LARGE);
    }

    /// Bytes of freed large blocks kept for reuse now (resident, not live).
    pub fn kept_bytes() -> usize {
        large_blocks::kept_bytes()
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
        .saturating_sub(returned_bytes())
}

/// Bytes of released full parameters' pages held for the next unit's parameters instead of
/// returned to the system (under [`TrainingAllocator`]; one unit's at most per rank), counted
/// in [`resident_bytes`].
#[doc(hidden)] // the page-parking tests
pub fn parked_bytes() -> usize {
    parked_pages::parked_bytes()
}

/// The highest [`resident_bytes`] seen since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed).max(0) as usize
}

/// Starts a new peak measurement from the current resident bytes.
pub fn reset_peak() {
    PEAK.store(resident_bytes() as i64, Ordering::Relaxed);
}

/// Records `bytes` returned to the system inside the live allocation starting at
/// `allocation`, until [`note_refilled`] or the allocation's free. Not recorded without an
/// installed [`CountingAllocator`] (nothing would see the free).
pub(crate) fn note_released(allocation: *const u8, bytes: usize) {
    if !INSTALLED.load(Ordering::Relaxed) || bytes == 0 {
        return;
    }
    let mut table = released_allocations();
    let before = table.remove(allocation as usize);
    if table.insert(allocation as usize, bytes) {
        // Added before the old figure leaves: the resident count may dip, never overshoot.
        RELEASED.fetch_add(bytes, Ordering::Relaxed);
    }
    RELEASED.fetch_sub(before, Ordering::Relaxed);
}

/// Records the allocation starting at `allocation` resident again (its pages written back).
pub(crate) fn note_refilled(allocation: *const u8) {
    forget_released(allocation as usize);
}

/// Whether an allocation of `capacity` bytes is one of the installed [`TrainingAllocator`]'s
/// (or [`HeapTrainingAllocator`]'s) large blocks.
fn large_block(capacity: usize) -> bool {
    let from = LARGE_FROM.load(Ordering::Relaxed);
    from > 0 && large_blocks::is_large(capacity, 1, from)
}

/// Releases the whole pages inside `v`'s elements: parked for the next parameter when its
/// allocation is a large block ([`parked_pages`]), returned to the system otherwise. Either
/// way they read as zeros (a valid `T`) until written and count as released until
/// [`note_refilled`].
pub(crate) fn release_pages<T: bytemuck::Zeroable>(v: &mut Vec<T>) {
    let allocation = v.as_ptr().cast::<u8>();
    let capacity = v.capacity() * std::mem::size_of::<T>();
    let (first, len) = parked_pages::whole_pages(allocation as usize, size_of_val(v.as_slice()));
    if len == 0 {
        return;
    }
    // SAFETY: [first, first + len) lies inside `v`'s elements, borrowed mutably here, and
    // holds whole pages of its allocation; parking leaves the range mapped, reading zeros.
    if !(large_block(capacity) && unsafe { parked_pages::park(first, len) } == len) {
        // SAFETY: as above.
        if !unsafe { return_pages(first, len) } {
            return;
        }
    }
    note_released(allocation, len);
}

/// Returns the whole pages `[first, first + len)` to the system (`MADV_DONTNEED`): they stay
/// mapped and read as zeros until written. False where the system refused.
///
/// # Safety
/// The range must be whole pages of private anonymous memory (the allocator's) that the
/// caller may overwrite.
unsafe fn return_pages(first: usize, len: usize) -> bool {
    // SAFETY: the caller's; MADV_DONTNEED on private anonymous memory keeps the mapping valid.
    unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_DONTNEED) == 0 }
}

/// Before the caller overwrites all of elements `range` of `v` (inside its capacity, set or
/// not): their whole pages take parked pages of their length, when there are, instead of
/// faulting in fresh ones. What the elements held is replaced by bytes of another parameter
/// (any bit pattern is a valid `T`).
pub(crate) fn prefill_pages<T: bytemuck::AnyBitPattern>(v: &mut Vec<T>, range: Range<usize>) {
    let size = std::mem::size_of::<T>();
    if range.end > v.capacity() || range.is_empty() || !large_block(v.capacity() * size) {
        return;
    }
    let address = v.as_mut_ptr().wrapping_add(range.start) as usize;
    let (first, len) = parked_pages::whole_pages(address, range.len() * size);
    // SAFETY: [first, first + len) lies inside `v`'s capacity, borrowed mutably here, in
    // whole pages of its large block; any bytes are valid there.
    unsafe { parked_pages::unpark(first, len) };
}

/// Returns the pages the last unit's release parked and no parameter took (called before
/// the next unit's release, so pages of one unit at most are parked).
pub(crate) fn flush_parked_pages() {
    parked_pages::flush();
}

/// Makes glibc keep freed memory for reuse instead of returning it to the system after every
/// large free: training allocates and frees the same multi-megabyte activations every step,
/// and returning them costs a page fault per 4 KiB on the next allocation (measured: one BERT
/// layer's forward+backward 117 ms -> 89 ms). Big blocks (up to 32 MiB) come from the heap
/// and the heap is trimmed only above 1 GiB of free space.
///
/// It also keeps every thread on one heap (arena): the communication threads allocate the
/// gathered parameters and the reduced gradient shards, and on heaps of their own they could
/// not reuse the activations that backward frees on the training thread's (measured on
/// llama_example: peak RSS 2,145-2,163 -> 1,900-2,045 MiB per rank, tokens/s unchanged; the one
/// heap's fragmentation varies run to run, which [`TrainingAllocator`] removes).
/// glibc binds a thread to its heap at its first allocation, so call this before starting
/// threads ([`crate::accelerator::Accelerator`] does, before it joins the job); threads that
/// allocated earlier keep their heaps.
///
/// Skipped when `FSDP_MALLOC_TUNING=0` or when the user set glibc's own `MALLOC_*` variables;
/// a no-op off glibc.
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
            libc::mallopt(libc::M_ARENA_MAX, 1);
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

/// The machine's physical memory in bytes, where the system reports it (what bounds on
/// declared model sizes compare against).
pub(crate) fn physical_memory_bytes() -> Option<u64> {
    // SAFETY: sysconf only reads system values.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && size > 0).then(|| pages as u64 * size as u64)
}
