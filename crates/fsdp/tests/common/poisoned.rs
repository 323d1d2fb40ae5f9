//! A test binary's allocator (and that of the worker processes it re-runs): every allocation
//! starts as `0xFF` bytes instead of what the system hands out (often zeros, from fresh
//! pages), so code that writes into reserved, uninitialised memory (collectives' outputs,
//! kernels' results) and returns some it never wrote shows garbage instead of passing by
//! luck. Installed (by including this file) in fsdp's and fsdp-comm's integration tests and
//! in fsdp's and fsdp-nn's unit tests.

use std::alloc::{GlobalAlloc, Layout, System};

/// The poison: a NaN as f64, f32, f16 and bf16, which no test expects and which survives
/// arithmetic (an unwritten padding element multiplied by a zero still shows).
const POISON: u8 = 0xFF;

/// The system allocator, poisoning what it hands out (zeroed requests stay zeroed).
pub struct Poisoned;

/// Including this file makes it the binary's allocator: that is what every includer wants,
/// and the self-test below relies on it.
#[global_allocator]
static ALLOCATOR: Poisoned = Poisoned;

// SAFETY: every call is the system allocator's; the bytes written are inside the block it
// returned (the whole block, or the part a reallocation added).
unsafe impl GlobalAlloc for Poisoned {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            unsafe { p.write_bytes(POISON, layout.size()) };
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() && new_size > layout.size() {
            unsafe {
                q.add(layout.size())
                    .write_bytes(POISON, new_size - layout.size())
            };
        }
        q
    }
}

#[test]
fn fresh_allocations_hold_the_poison_and_zeroed_ones_zeros() {
    let mut fresh: Vec<u8> = Vec::with_capacity(1 << 20);
    // SAFETY: this binary's allocator wrote every byte it handed out.
    let poisoned = |b: &std::mem::MaybeUninit<u8>| unsafe { b.assume_init() } == POISON;
    assert!(fresh.spare_capacity_mut().iter().all(poisoned));
    assert!(vec![0u8; 1 << 20].iter().all(|&b| b == 0));
}
