//! Matching a CPU storage with a host buffer of the same float element type, shared by the
//! CPU data plane (refilling parameters) and gradient packing.

/// Runs `$body` with `$v` bound to the float vector of a CPU storage or host buffer of the
/// same element type; `$other` otherwise.
macro_rules! float_pair {
    ($storage:expr, $buffer:expr, |$s:ident, $b:ident| $body:expr, $other:expr) => {
        match ($storage, $buffer) {
            (CpuStorage::F32($s), Buffer::F32($b)) => $body,
            (CpuStorage::F64($s), Buffer::F64($b)) => $body,
            (CpuStorage::BF16($s), Buffer::BF16($b)) => $body,
            (CpuStorage::F16($s), Buffer::F16($b)) => $body,
            _ => $other,
        }
    };
}
pub(crate) use float_pair;
