//! What every allocator with kept large blocks promises, for the test binaries that install
//! one (each its own binary: a global allocator is process-wide).

/// A freed block of `bytes` is kept (`kept` reads the allocator's kept bytes) and serves the
/// next request of its size, zeroed when asked. Returns the block's address.
pub fn reuses_a_freed_block(bytes: usize, kept: fn() -> usize) -> usize {
    let first = vec![0xABu8; bytes];
    let address = first.as_ptr() as usize;
    let before = kept();
    drop(first);
    assert!(
        kept() >= before + bytes,
        "the freed block of {bytes} bytes is kept"
    );
    let again = vec![0u8; bytes];
    assert_eq!(
        again.as_ptr() as usize,
        address,
        "the freed block serves its size again"
    );
    assert!(
        again.iter().all(|&b| b == 0),
        "a zeroed request is zeroed on reuse"
    );
    address
}
