//! `TrainingAllocator`'s promises: large blocks are reused for requests of their size without
//! new mappings, come back zeroed when asked, keep their contents through every kind of
//! resize, and freed ones are kept only while the total stays within the most ever in use,
//! so keeping them never raises the peak (that pages returned inside blocks in use do not
//! count is `memory::large_blocks`'s own test); blocks of 2 MiB and more start on a huge-page
//! boundary, advised for transparent huge pages.
//!
//! One test function: the allocator's figures are process-wide, and other tests' threads
//! would move them.

use std::alloc::{GlobalAlloc, Layout};

use fsdp::memory::{self, TrainingAllocator};

#[path = "common/large_blocks.rs"]
mod large_blocks;

#[global_allocator]
static ALLOC: TrainingAllocator = TrainingAllocator;

const MIB: usize = 1 << 20;

/// Resident bytes of this process (VmRSS).
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<usize>()
        .unwrap()
        * 1024
}

/// A vector of `n` bytes with every page written.
fn touched(n: usize, value: u8) -> Vec<u8> {
    vec![value; n]
}

fn reuses_a_freed_block_of_the_same_size_zeroed_when_asked() {
    let address = large_blocks::reuses_a_freed_block(3 * MIB, TrainingAllocator::kept_bytes);
    // Another size gets a block of its own.
    let other = vec![1u8; 5 * MIB];
    assert_ne!(other.as_ptr() as usize, address);
}

/// Whether transparent huge pages can be had by advice (`always` or `madvise`).
fn transparent_huge_pages() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
}

/// The `smaps` entry of the mapping that holds `address`.
fn smaps_entry(address: usize) -> String {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut entry = String::new();
    let mut inside = false;
    for line in smaps.lines() {
        let range = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'));
        let header = range.and_then(|(a, b)| {
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        });
        if let Some((start, end)) = header {
            if inside {
                break;
            }
            inside = (start..end).contains(&address);
        }
        if inside {
            entry.push_str(line);
            entry.push('\n');
        }
    }
    entry
}

fn blocks_of_a_huge_page_and_more_are_aligned_and_advised_for_huge_pages() {
    let v = touched(4 * MIB + 123, 7);
    let address = v.as_ptr() as usize;
    assert_eq!(
        address % (2 * MIB),
        0,
        "a block of 4 MiB starts on a 2 MiB boundary"
    );
    let entry = smaps_entry(address);
    assert!(!entry.is_empty(), "no mapping holds {address:#x}");
    if transparent_huge_pages() {
        assert!(
            entry
                .lines()
                .any(|l| l.split_whitespace().eq(["THPeligible:", "1"])),
            "the block's mapping is not eligible for huge pages:\n{entry}"
        );
    } else {
        println!("transparent huge pages are off on this machine: only the alignment is checked");
    }
    // Smaller blocks keep base pages (a huge page there would hold memory nobody asked for).
    let small = touched(MIB + 5, 1);
    let entry = smaps_entry(small.as_ptr() as usize);
    assert!(
        !entry
            .lines()
            .any(|l| l.split_whitespace().eq(["THPeligible:", "1"]))
            || std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
                .is_ok_and(|s| s.contains("[always]")),
        "a 1 MiB block was advised for huge pages:\n{entry}"
    );
}

fn keeps_contents_through_resizes() {
    let pattern = |n: usize| (0..n).map(|i| (i % 251) as u8).collect::<Vec<u8>>();
    // Heap to mapping, mapping to a larger mapping, and back to the heap.
    let mut v = pattern(512 * 1024);
    for size in [2 * MIB, 9 * MIB + 77] {
        v.reserve_exact(size - v.len());
        let start = v.len();
        v.extend((start..size).map(|i| (i % 251) as u8));
        assert_eq!(v, pattern(size));
    }
    v.truncate(100_000);
    v.shrink_to_fit();
    assert_eq!(v, pattern(100_000));
    // A mapping shrunk to a smaller mapping.
    let mut w = pattern(8 * MIB);
    w.truncate(3 * MIB + 5);
    w.shrink_to_fit();
    assert_eq!(w, pattern(3 * MIB + 5));
}

fn serves_alignments_beyond_a_page_from_the_heap() {
    let layout = Layout::from_size_align(2 * MIB, 64 * 1024).unwrap();
    // SAFETY: a valid layout, freed below with the same layout.
    unsafe {
        let p = ALLOC.alloc(layout);
        assert!(!p.is_null());
        assert_eq!(p as usize % (64 * 1024), 0);
        p.write_bytes(7, layout.size());
        ALLOC.dealloc(p, layout);
    }
}

fn kept_blocks_never_raise_the_peak() {
    // Settle: whatever earlier checks left kept, then a high-water mark well above it.
    let blocks: Vec<Vec<u8>> = (0..20).map(|_| touched(4 * MIB, 1)).collect();
    drop(blocks);
    let kept = TrainingAllocator::kept_bytes();
    assert!(kept >= 80 * MIB, "the freed 4 MiB blocks are kept ({kept})");
    let before = rss();
    // Sizes never seen: every request maps afresh, and kept blocks make room.
    let blocks: Vec<Vec<u8>> = (0..20).map(|_| touched(6 * MIB, 2)).collect();
    let kept = TrainingAllocator::kept_bytes();
    assert!(
        kept <= 4 * MIB,
        "in use 120 MiB at its high-water mark: nothing more than one block kept, not {} MiB",
        kept / MIB
    );
    let grown = rss().saturating_sub(before);
    assert!(
        grown <= 60 * MIB,
        "120 MiB in use where 80 were kept: RSS grew {} MiB (40 expected), kept blocks were not given back",
        grown / MIB
    );
    drop(blocks);
}

fn counts_live_bytes() {
    TrainingAllocator::mark_installed();
    let before = memory::resident_bytes();
    let block = touched(6 * MIB, 3);
    assert_eq!(memory::resident_bytes() - before, 6 * MIB);
    drop(block);
    assert_eq!(memory::resident_bytes(), before);
}

#[test]
fn training_allocator() {
    blocks_of_a_huge_page_and_more_are_aligned_and_advised_for_huge_pages();
    reuses_a_freed_block_of_the_same_size_zeroed_when_asked();
    keeps_contents_through_resizes();
    serves_alignments_beyond_a_page_from_the_heap();
    kept_blocks_never_raise_the_peak();
    counts_live_bytes();
}
