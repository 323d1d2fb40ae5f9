//! The GEMMs every op calls: [`gemm_into`] and [`gemm_new`] check the operands' strides and
//! go through [`Float::gemm`], which is the `gemm` crate's for f32 and f64
//! ([`native_gemm`]) and an f32 GEMM on converted operands for the half-precision types.

use super::Float;

fn parallelism() -> ::gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => ::gemm::Parallelism::None,
        n => ::gemm::Parallelism::Rayon(n),
    }
}

/// `dst[m×n] = (dst if accumulate) + scale · lhs[m×k] · rhs[k×n]`, every operand given by
/// (row, column) strides (`dst` by its row stride, columns contiguous).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_into<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[T],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[T],
    rhs_rs: usize,
    rhs_cs: usize,
    scale: f64,
) {
    if m == 0 || n == 0 {
        return;
    }
    check_destination((m, n), dst.len(), dst_rs);
    // SAFETY: the check above keeps every destination index inside `dst`.
    unsafe {
        gemm_raw(
            (m, n, k),
            dst.as_mut_ptr(),
            dst_rs,
            accumulate,
            (lhs, lhs_rs, lhs_cs),
            (rhs, rhs_rs, rhs_cs),
            scale,
        )
    }
}

/// [`gemm_into`] with the results in `T::Acc` (f32 sums of half-precision operands).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_acc_into<T: Float>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T::Acc],
    dst_rs: usize,
    accumulate: bool,
    lhs: (&[T], usize, usize),
    rhs: (&[T], usize, usize),
    scale: f64,
) {
    if m == 0 || n == 0 {
        return;
    }
    check_destination((m, n), dst.len(), dst_rs);
    check_operands((m, n, k), lhs, rhs);
    // SAFETY: the checks above keep every index inside its slice.
    unsafe {
        T::gemm_acc(
            (m, n, k),
            dst.as_mut_ptr(),
            dst_rs,
            accumulate,
            lhs,
            rhs,
            scale,
        )
    }
}

/// Checks that an m x n destination of row stride `dst_rs` fits in `len` elements (m, n > 0).
fn check_destination((m, n): (usize, usize), len: usize, dst_rs: usize) {
    assert!(len >= (m - 1) * dst_rs + n, "gemm: destination too short");
}

/// Checks that the operands' strides stay inside their slices.
fn check_operands<T>(
    (m, n, k): (usize, usize, usize),
    (lhs, lhs_rs, lhs_cs): (&[T], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[T], usize, usize),
) {
    if m > 0 && n > 0 && k > 0 {
        assert!(
            lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs,
            "gemm: lhs too short"
        );
        assert!(
            rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs,
            "gemm: rhs too short"
        );
    }
}

/// `scale · lhs[m×k] · rhs[k×n]` into a new row-major vector, written by the GEMM directly
/// (no zero-fill first: outputs here are activation- and weight-sized).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_new<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    lhs: &[T],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[T],
    rhs_rs: usize,
    rhs_cs: usize,
    scale: f64,
) -> Vec<T> {
    if m == 0 || n == 0 || k == 0 {
        return vec![T::of(0.0); m * n];
    }
    let mut dst: Vec<T> = Vec::with_capacity(m * n);
    // SAFETY: the destination is the vector's m·n reserved elements, which a GEMM that does
    // not read its destination (`accumulate` false) writes in full before the length is set.
    unsafe {
        gemm_raw(
            (m, n, k),
            dst.as_mut_ptr(),
            n,
            false,
            (lhs, lhs_rs, lhs_cs),
            (rhs, rhs_rs, rhs_cs),
            scale,
        );
        dst.set_len(m * n);
    }
    dst
}

/// The one call into `gemm`; checks that the operands' strides stay inside their slices.
///
/// # Safety
/// `dst` must be valid for writes (and for reads when `accumulate`) at every
/// `i * dst_rs + j`, `i < m`, `j < n`.
unsafe fn gemm_raw<T: Float>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[T], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[T], usize, usize),
    scale: f64,
) {
    if m == 0 || n == 0 {
        return;
    }
    check_operands((m, n, k), (lhs, lhs_rs, lhs_cs), (rhs, rhs_rs, rhs_cs));
    // SAFETY: the caller vouches for `dst`; the checks above for the operands.
    unsafe {
        T::gemm(
            (m, n, k),
            dst,
            dst_rs,
            accumulate,
            (lhs, lhs_rs, lhs_cs),
            (rhs, rhs_rs, rhs_cs),
            scale,
        )
    }
}

/// The `gemm` crate's GEMM for the types it has (f32, f64).
///
/// # Safety
/// As [`gemm_raw`], whose checks have been made.
pub(super) unsafe fn native_gemm<T: 'static + Copy + Float>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): (&[T], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[T], usize, usize),
    scale: f64,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            T::of(1.0),
            T::of(scale),
            false,
            false,
            false,
            parallelism(),
        )
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    /// Bytes this thread has read by system calls so far (`rchar` of /proc/thread-self/io).
    fn bytes_read_by_this_thread() -> u64 {
        let io = std::fs::read_to_string("/proc/thread-self/io").unwrap();
        let line = io.lines().find(|l| l.starts_with("rchar:")).unwrap();
        line["rchar:".len()..].trim().parse().unwrap()
    }

    /// The products ask candle for the thread count each time, and candle found it by
    /// reading /proc/cpuinfo on every call unless `RAYON_NUM_THREADS` was set (the launcher
    /// sets it; a program started by hand or an in-process test did not): a read per product
    /// (vendor/README.md, the sixth change). The vendored copy detects it once.
    #[test]
    fn products_read_no_file_for_their_thread_count() {
        if std::env::var_os("RAYON_NUM_THREADS").is_some() {
            skipped_optional!("RAYON_NUM_THREADS is set, so no thread count is detected");
            return;
        }
        let (a, b) = (vec![1.0f32; 64 * 64], vec![2.0f32; 64 * 64]);
        let x = Tensor::new(a.as_slice(), &Device::Cpu)
            .unwrap()
            .reshape((64, 64))
            .unwrap();
        // The first product may detect the count.
        let _ = super::gemm_new(64, 64, 64, &a, 64, 1, &b, 64, 1, 1.0);
        let before = bytes_read_by_this_thread();
        for _ in 0..100 {
            let ours = super::gemm_new(64, 64, 64, &a, 64, 1, &b, 64, 1, 1.0);
            assert_eq!(ours[0], 128.0);
            let candles = x.matmul(&x).unwrap();
            assert_eq!(
                candles
                    .get(0)
                    .unwrap()
                    .get(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap(),
                64.0
            );
        }
        // The first reading of this thread's counters is all it read (a few hundred bytes;
        // /proc/cpuinfo alone is kilobytes per core).
        let read = bytes_read_by_this_thread() - before;
        assert!(read < 4096, "200 products read {read} bytes");
    }
}
