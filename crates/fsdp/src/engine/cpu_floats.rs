//! Matching a CPU storage with a host buffer of the same float element type, shared by the
//! CPU data plane (refilling parameters) and gradient packing; and f32 values made a host
//! buffer of a float type, shared by the gathers and the CPU data plane.

use fsdp_comm::{Buffer, DType};

/// `values` as a host buffer of `dtype` (`None` for a type that is not a float): bf16
/// rounded with the vector kernel where `Buffer::from_f32` rounds one element at a time
/// (the same values).
pub(crate) fn float_buffer(values: &[f32], dtype: DType) -> Option<Buffer> {
    match dtype {
        DType::BF16 => Some(Buffer::BF16(fsdp_nn::ops::bf16_from_f32(values))),
        _ => Buffer::from_f32(values, dtype),
    }
}

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
