//! Float element access shared by the engine's graph ops and its collectives: a contiguous
//! copy of a CPU storage's floats, and matching a CPU storage with a host buffer of the same
//! element type.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout};

/// A contiguous copy of a unit output's float elements.
pub(crate) fn float_copy(
    s: &CpuStorage,
    l: &Layout,
    op: &'static str,
) -> candle_core::Result<CpuStorage> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: unit output must be contiguous")))?;
    Ok(match s {
        CpuStorage::F32(v) => CpuStorage::F32(v[start..end].to_vec()),
        CpuStorage::F64(v) => CpuStorage::F64(v[start..end].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[start..end].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[start..end].to_vec()),
        other => {
            return Err(candle_core::Error::Msg(format!(
                "{op}: unit outputs are floats, not {:?}",
                other.dtype()
            )));
        }
    })
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
