//! [`CudaBuffer`]: a buffer in CUDA memory of one element type (feature `nccl`), what
//! `Buffer::Cuda` carries to an NCCL group.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr};
use cudarc::nccl::safe::NcclType;

use crate::dtype::DType;

/// A buffer in CUDA memory, of one element type: what [`crate::Buffer::Cuda`] carries. Shared
/// (`Arc`) so a buffer value can be cloned cheaply; collectives need the only reference.
#[derive(Debug, Clone)]
pub enum CudaBuffer {
    /// 32-bit floats.
    F32(Arc<CudaSlice<f32>>),
    /// 64-bit floats.
    F64(Arc<CudaSlice<f64>>),
    /// IEEE halves.
    F16(Arc<CudaSlice<half::f16>>),
    /// bfloat16s.
    BF16(Arc<CudaSlice<half::bf16>>),
    /// 32-bit integers.
    I32(Arc<CudaSlice<i32>>),
    /// 64-bit integers.
    I64(Arc<CudaSlice<i64>>),
    /// Bytes.
    U8(Arc<CudaSlice<u8>>),
}

/// An element type NCCL moves, with its [`CudaBuffer`] variant.
pub trait CudaElement:
    Sized + NcclType + DeviceRepr + cudarc::driver::ValidAsZeroBits + Send + Sync + 'static
{
    /// Wraps a slice.
    fn wrap(s: Arc<CudaSlice<Self>>) -> CudaBuffer;
    /// The slice inside `b`, if it holds this type.
    fn unwrap(b: CudaBuffer) -> Option<Arc<CudaSlice<Self>>>;
}

macro_rules! cuda_element {
    ($t:ty, $v:ident) => {
        impl CudaElement for $t {
            fn wrap(s: Arc<CudaSlice<Self>>) -> CudaBuffer {
                CudaBuffer::$v(s)
            }
            fn unwrap(b: CudaBuffer) -> Option<Arc<CudaSlice<Self>>> {
                match b {
                    CudaBuffer::$v(s) => Some(s),
                    _ => None,
                }
            }
        }
    };
}

cuda_element!(f32, F32);
cuda_element!(f64, F64);
cuda_element!(half::f16, F16);
cuda_element!(half::bf16, BF16);
cuda_element!(i32, I32);
cuda_element!(i64, I64);
cuda_element!(u8, U8);

impl CudaBuffer {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            CudaBuffer::F32(_) => DType::F32,
            CudaBuffer::F64(_) => DType::F64,
            CudaBuffer::F16(_) => DType::F16,
            CudaBuffer::BF16(_) => DType::BF16,
            CudaBuffer::I32(_) => DType::I32,
            CudaBuffer::I64(_) => DType::I64,
            CudaBuffer::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CudaBuffer::F32(s) => s.len(),
            CudaBuffer::F64(s) => s.len(),
            CudaBuffer::F16(s) => s.len(),
            CudaBuffer::BF16(s) => s.len(),
            CudaBuffer::I32(s) => s.len(),
            CudaBuffer::I64(s) => s.len(),
            CudaBuffer::U8(s) => s.len(),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
