//! Zeroed vectors whose pages the kernel zeroes on first write, so a large table that is
//! written row by row costs only the pages its rows touch.

/// Zeroed allocations of at least this many bytes leave their whole pages to the kernel.
const LAZY_ZEROS_BYTES: usize = 1 << 20;

/// `len` zeros, whose whole pages are zero pages the kernel fills on first write: a table
/// written row by row then faults in only the pages its rows touch. A zeroed allocation
/// (`calloc`) gets fresh pages only when the memory is newly mapped; out of freed memory the
/// allocator reuses, it writes every byte (and faults in every page that was returned).
pub(crate) fn lazily_zeroed<T: bytemuck::Zeroable + Copy>(len: usize) -> Vec<T> {
    if len * std::mem::size_of::<T>() < LAZY_ZEROS_BYTES {
        return bytemuck::allocation::zeroed_vec(len);
    }
    let mut v = Vec::with_capacity(len);
    zero_lazily(&mut v, len);
    v
}

/// Makes `v` (capacity at least `len`) `len` zeros in place: its whole pages returned to the
/// kernel, whatever they held, the bytes around them written.
fn zero_lazily<T: bytemuck::Zeroable + Copy>(v: &mut Vec<T>, len: usize) {
    v.clear();
    assert!(v.capacity() >= len, "zero_lazily: capacity below {len}");
    let bytes = len * std::mem::size_of::<T>();
    let start = v.as_mut_ptr().cast::<u8>();
    let (first, pages) = super::parked_pages::whole_pages(start as usize, bytes);
    // SAFETY: [first, first + pages) is whole pages inside `v`'s allocation, borrowed
    // mutably here.
    let returned = pages > 0 && unsafe { super::return_pages(first, pages) };
    // SAFETY: inside the allocation (capacity >= len); afterwards every byte of the first
    // `len` elements is zero, a valid `T`.
    unsafe {
        if returned {
            let head = first - start as usize;
            std::ptr::write_bytes(start, 0, head);
            std::ptr::write_bytes(start.add(head + pages), 0, bytes - head - pages);
        } else {
            std::ptr::write_bytes(start, 0, bytes);
        }
        v.set_len(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    /// Pages of `[address, address + bytes)` resident now (`mincore`).
    fn resident_pages(address: usize, bytes: usize) -> usize {
        let first = address / PAGE * PAGE;
        let pages = (address + bytes).div_ceil(PAGE) - first / PAGE;
        let mut map = vec![0u8; pages];
        // SAFETY: the range lies in one live allocation; `map` has a byte per page.
        let rc =
            unsafe { libc::mincore(first as *mut libc::c_void, pages * PAGE, map.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        map.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn lazily_zeroed_vectors_are_zeros_on_either_side_of_the_threshold() {
        for len in [
            7,
            1000,
            (LAZY_ZEROS_BYTES / 4) - 3,
            3 * LAZY_ZEROS_BYTES / 4 + 5,
        ] {
            let v: Vec<f32> = lazily_zeroed(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|x| x.to_bits() == 0), "len {len}");
            let h: Vec<half::bf16> = lazily_zeroed(2 * len);
            assert!(h.iter().all(|x| x.to_bits() == 0), "bf16 len {}", 2 * len);
        }
    }

    #[test]
    fn memory_that_held_other_bytes_reads_zero_and_faults_in_only_the_pages_written() {
        let len = LAZY_ZEROS_BYTES + 1; // 4 MiB of f32 and one more element
        // Resident and holding ones, as memory the allocator hands out again can be.
        let mut v = vec![1.0f32; len];
        // Pages of 4 KiB whatever the machine's transparent huge page setting: a huge page
        // faulted in (or collapsed) by one write would count 512.
        // SAFETY: advice on `v`'s own allocation; it changes no byte.
        unsafe {
            let (first, pages) =
                crate::memory::parked_pages::whole_pages(v.as_ptr() as usize, len * 4);
            libc::madvise(first as *mut libc::c_void, pages, libc::MADV_NOHUGEPAGE);
        }
        v.truncate(len - 9); // the zeroing covers elements past the length too
        zero_lazily(&mut v, len);
        let (address, bytes) = (v.as_ptr() as usize, len * 4);
        // The partial first and last pages were written with zeros; nothing else (checked
        // before any read: a read maps the kernel's zero page, which counts as resident).
        let before = resident_pages(address, bytes);
        assert!(before <= 2, "{before} pages resident before any write");
        let per_page = PAGE / 4;
        for row in (0..len).step_by(16 * per_page) {
            v[row] = 2.0;
        }
        let after = resident_pages(address, bytes);
        let written = len.div_ceil(16 * per_page);
        assert!(
            after <= before + written,
            "{after} pages resident after writing {written} pages"
        );
        assert_eq!(v.iter().filter(|&&x| x == 2.0).count(), written);
        assert_eq!(v.iter().filter(|&&x| x == 0.0).count(), len - written);
    }
}
