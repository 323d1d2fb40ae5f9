//! `HeapTrainingAllocator`'s promises: requests of 32 MiB and more (which glibc would map and
//! unmap at every call) get blocks of their own that are kept and reused for requests of
//! their size, zeroed when asked and keeping their contents through resizes across the
//! threshold; smaller requests stay on the heap and are never kept as blocks.
//!
//! One test function: the allocator's figures are process-wide, and other tests' threads
//! would move them.

use fsdp::memory::{self, HeapTrainingAllocator};

#[path = "common/large_blocks.rs"]
mod large_blocks;

#[global_allocator]
static ALLOC: HeapTrainingAllocator = HeapTrainingAllocator;

const MIB: usize = 1 << 20;

fn reuses_a_freed_block_of_32_mib_and_more() {
    large_blocks::reuses_a_freed_block(40 * MIB, HeapTrainingAllocator::kept_bytes);
    large_blocks::reuses_a_freed_block(32 * MIB, HeapTrainingAllocator::kept_bytes);
}

fn keeps_smaller_requests_on_the_heap() {
    let kept_before = HeapTrainingAllocator::kept_bytes();
    for mib in [1, 8, 31] {
        let v = vec![7u8; mib * MIB];
        drop(v);
        assert_eq!(
            HeapTrainingAllocator::kept_bytes(),
            kept_before,
            "{mib} MiB is the heap's, not a kept block"
        );
    }
    // Just under the threshold stays on the heap too.
    drop(vec![1u8; 32 * MIB - 4096]);
    assert_eq!(HeapTrainingAllocator::kept_bytes(), kept_before);
}

fn keeps_contents_through_resizes_across_the_threshold() {
    let mut v: Vec<u32> = (0..(6 * MIB as u32)).collect(); // 24 MiB, on the heap
    v.reserve_exact(6 * MIB); // 48 MiB: a block
    assert!((0..6 * MIB).all(|i| v[i] == i as u32));
    v.extend(0..(6 * MIB as u32));
    v.truncate(3 * MIB);
    v.shrink_to_fit(); // 12 MiB: back on the heap
    assert!((0..3 * MIB).all(|i| v[i] == i as u32));
}

fn counts_live_bytes() {
    let before = memory::resident_bytes();
    let block = vec![3u8; 36 * MIB];
    assert_eq!(memory::resident_bytes() - before, 36 * MIB);
    drop(block);
    assert_eq!(memory::resident_bytes(), before);
}

#[test]
fn heap_training_allocator() {
    HeapTrainingAllocator::mark_installed();
    memory::retain_freed_memory();
    reuses_a_freed_block_of_32_mib_and_more();
    keeps_smaller_requests_on_the_heap();
    keeps_contents_through_resizes_across_the_threshold();
    counts_live_bytes();
}
