//! How fsdp-rs's element types and reductions look to MPI: a datatype per [`DType`], MPI's
//! built-in operations where MPI has them, and user operations for f16 and bf16 sums,
//! maxima and minima (MPI has no 16-bit float types).
//!
//! The 16-bit operations combine each pair exactly as the shared-memory and TCP transports do
//! ([`reduce_into`]: widen to f32, combine, round to nearest even). That combination is
//! commutative bit for bit, so they are created commutative and MPI may pick any algorithm;
//! the all-reduce result is the same on every rank because MPI's reductions deliver one
//! result to all (the standard's advice to implementers, which Open MPI's and MPICH's
//! algorithms follow: each element is reduced once and the result distributed, or reduced
//! in mirrored pairs that commutativity makes equal) — the tests compare every rank's bits.

use std::ffi::{c_int, c_void};

use half::{bf16, f16};
use mpi::ffi;

use crate::dtype::{DType, Element, ReduceOp, reduce_into};

/// The MPI datatype that carries elements of `dtype` (16-bit floats travel as `uint16_t`;
/// only their reductions need to know what they are).
pub(super) fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading MPI's predefined handles, which are constants after MPI_Init.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

/// `inout[i] = inout[i] OP in[i]` on `len` elements of `T`: MPI's user-function contract.
unsafe extern "C" fn combine<T: Element, const OP: u8>(
    input: *mut c_void,
    inout: *mut c_void,
    len: *mut c_int,
    _datatype: *mut ffi::MPI_Datatype,
) {
    let op = match OP {
        1 => ReduceOp::Sum,
        3 => ReduceOp::Max,
        _ => ReduceOp::Min,
    };
    // SAFETY: MPI passes two buffers of `*len` elements of the datatype the collective was
    // called with, which for these operations is always T's (see `Reductions::op`).
    unsafe {
        let n = usize::try_from(*len).unwrap_or(0);
        let src = std::slice::from_raw_parts(input as *const T, n);
        let dst = std::slice::from_raw_parts_mut(inout as *mut T, n);
        reduce_into(dst, src, op);
    }
}

/// The user operations for 16-bit floats, created once after MPI_Init on the MPI thread.
pub(super) struct Reductions {
    /// Sum, max, min for f16.
    f16: [ffi::MPI_Op; 3],
    /// Sum, max, min for bf16.
    bf16: [ffi::MPI_Op; 3],
}

impl Reductions {
    /// Creates the six operations (MPI must be initialized); the MPI error code on failure.
    pub(super) fn create() -> Result<Reductions, c_int> {
        fn create(f: ffi::MPI_User_function) -> Result<ffi::MPI_Op, c_int> {
            // SAFETY: an out-pointer for the new handle; `f` has MPI's user-function type.
            unsafe {
                let mut op: ffi::MPI_Op = std::mem::zeroed();
                match ffi::MPI_Op_create(f, 1, &mut op) {
                    0 => Ok(op),
                    code => Err(code),
                }
            }
        }
        Ok(Reductions {
            f16: [
                create(Some(combine::<f16, 1>))?,
                create(Some(combine::<f16, 3>))?,
                create(Some(combine::<f16, 4>))?,
            ],
            bf16: [
                create(Some(combine::<bf16, 1>))?,
                create(Some(combine::<bf16, 3>))?,
                create(Some(combine::<bf16, 4>))?,
            ],
        })
    }

    /// The MPI operation reducing `dtype` by `op` (an average reduces as a sum and is
    /// divided afterwards).
    pub(super) fn op(&self, dtype: DType, op: ReduceOp) -> ffi::MPI_Op {
        let i = match op {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        };
        match dtype {
            DType::F16 => self.f16[i],
            DType::BF16 => self.bf16[i],
            // SAFETY: MPI's predefined operations, constants after MPI_Init.
            _ => unsafe { [ffi::RSMPI_SUM, ffi::RSMPI_MAX, ffi::RSMPI_MIN][i] },
        }
    }
}

/// MPI's text for error `code`.
pub(super) fn error_text(code: c_int) -> String {
    let mut text = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI writes at most MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH) bytes.
    let ok = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr().cast(), &mut len) } == 0;
    if !ok {
        return format!("MPI error code {code}");
    }
    text.truncate(usize::try_from(len).unwrap_or(0).min(512));
    format!("{} (MPI error code {code})", String::from_utf8_lossy(&text))
}
