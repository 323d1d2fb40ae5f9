//! Rotary position embedding in Hugging Face's rotate-half layout (Llama, Qwen2, Mistral,
//! SmolLM2): `x * cos + rotate_half(x) * sin`, where `rotate_half(x) = cat(-x2, x1)` over the
//! two halves of the head dimension, as one op with a hand-written backward. The angles
//! follow transformers: `inv_freq = 1 / theta^(2i / d)`, rescaled by `rope_scaling` (`linear`:
//! divided by the factor; `llama3`: Llama 3.1's by-wavelength blend), times the position, in
//! f32, then cos and sin (times the attention factor, 1 for these types).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::{Float, contiguous, float_dispatch, tensor, with_slice};
#[cfg(feature = "cuda")]
use super::{
    cuda_kernels::{self, Operand, Output, device_operand, operand, take_storage},
    kernel_plan::{RopeShape, rope_buffers},
};

/// `rope_scaling` of a transformers `config.json`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `{"rope_type": "linear", "factor": f}`: positions divided by `factor`.
    Linear {
        /// The factor.
        factor: f64,
    },
    /// `{"rope_type": "llama3", ...}`: long wavelengths divided by `factor`, short ones
    /// kept, those between blended (Llama 3.1 and later).
    Llama3 {
        /// `factor`.
        factor: f64,
        /// `low_freq_factor`.
        low_freq_factor: f64,
        /// `high_freq_factor`.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f64,
    },
}

impl RopeScaling {
    /// The scaling a `rope_scaling` object describes (`rope_type`, or the older `type`);
    /// `None` for `default`, an error naming an unknown type or a missing field.
    pub fn from_config(v: &serde_json::Value) -> std::result::Result<Option<RopeScaling>, String> {
        let kind = v
            .get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        let field = |name: &str| {
            v.get(name)
                .and_then(|f| f.as_f64())
                .ok_or_else(|| format!("rope_scaling of type {kind} has no number `{name}`"))
        };
        match kind {
            "default" => Ok(None),
            "linear" => Ok(Some(RopeScaling::Linear {
                factor: field("factor")?,
            })),
            "llama3" => Ok(Some(RopeScaling::Llama3 {
                factor: field("factor")?,
                low_freq_factor: field("low_freq_factor")?,
                high_freq_factor: field("high_freq_factor")?,
                original_max_position_embeddings: field("original_max_position_embeddings")?,
            })),
            other => Err(format!(
                "rope_scaling type `{other}` is not supported (default, linear, llama3)"
            )),
        }
    }
}

/// The rotation frequencies of one attention head size: what [`rope`] turns positions into
/// angles with.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    /// One frequency per pair of dimensions (`head_dim / 2`), as transformers' `inv_freq`
    /// (f32).
    pub inv_freq: Arc<[f32]>,
}

impl RopeTable {
    /// The frequencies for heads of `head_dim` (even) with base `theta` (`rope_theta`).
    pub fn new(head_dim: usize, theta: f64, scaling: Option<RopeScaling>) -> Result<RopeTable> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(candle_core::Error::Msg(format!(
                "rope: head_dim {head_dim} must be even and positive"
            )));
        }
        // transformers: 1 / base ** (arange(0, dim, 2).float() / dim), in f32.
        let base: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let inv_freq = match scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => {
                base.iter().map(|f| f / factor as f32).collect()
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                let (factor, low, high, old) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    old as f32,
                );
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        if wavelen < high_wavelen || wavelen > low_wavelen {
                            scaled
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        }
                    })
                    .collect()
            }
        };
        Ok(RopeTable {
            inv_freq: inv_freq.into(),
        })
    }

    /// The angles of `positions`: one per sequence position (shared by the batch) or
    /// `batch * seq` (each sequence its own, as transformers' `position_ids`). Made once per
    /// forward, they serve every layer's [`rope_with`].
    pub fn angles_at(&self, positions: &[u32]) -> RopeAngles {
        let n = positions.len() * self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &p in positions {
            for &f in self.inv_freq.iter() {
                let angle = f * p as f32;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeAngles {
            cos: cos.into(),
            sin: sin.into(),
            rows: positions.len(),
            #[cfg(feature = "cuda")]
            on_gpus: Default::default(),
        }
    }
}

/// cos and sin of every (position, frequency) angle, `[positions, head_dim / 2]` each, in
/// f32 as transformers computes them (`RopeTable::angles_at`).
#[derive(Debug, Clone)]
pub struct RopeAngles {
    cos: Arc<[f32]>,
    sin: Arc<[f32]>,
    rows: usize,
    /// cos and sin copied to each GPU that asked, once: every layer's rope reuses them.
    #[cfg(feature = "cuda")]
    on_gpus: Arc<std::sync::Mutex<Vec<GpuAngles>>>,
}

/// A GPU's copy of the angles: the device, cos, sin.
#[cfg(feature = "cuda")]
type GpuAngles = (candle_core::cuda_backend::DeviceId, Tensor, Tensor);

impl RopeAngles {
    /// cos and sin, `[positions, head_dim / 2]` each, and the number of positions.
    pub(super) fn parts(&self) -> (&[f32], &[f32], usize) {
        (&self.cos, &self.sin, self.rows)
    }

    /// cos and sin on the GPU `dev`, copied there at its first call.
    #[cfg(feature = "cuda")]
    fn on_gpu(&self, dev: &candle_core::CudaDevice) -> Result<(Tensor, Tensor)> {
        let mut copies = self.on_gpus.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, cos, sin)) = copies.iter().find(|(id, ..)| *id == dev.id()) {
            return Ok((cos.clone(), sin.clone()));
        }
        let device = candle_core::Device::Cuda(dev.clone());
        let cos = Tensor::from_slice(&self.cos, self.cos.len(), &device)?;
        let sin = Tensor::from_slice(&self.sin, self.sin.len(), &device)?;
        copies.push((dev.id(), cos.clone(), sin.clone()));
        Ok((cos, sin))
    }
}

/// Where the heads and the sequence sit in rope's input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// `[batch, heads, seq, head_dim]` (transformers' layout after its head transpose).
    HeadsFirst,
    /// `[batch, seq, heads, head_dim]`: a projection's output `[batch, seq, heads *
    /// head_dim]` reshaped, no transpose (what [`super::grouped_query_attention`] takes).
    SeqFirst,
}

/// The op: the angles of its positions, kept for backward.
struct Rope {
    angles: RopeAngles,
    layout: RopeLayout,
}

impl Rope {
    /// (batch, heads, seq, head_dim) of an input of this op's layout.
    fn extents(&self, dims: &[usize]) -> (usize, usize, usize, usize) {
        match self.layout {
            RopeLayout::HeadsFirst => (dims[0], dims[1], dims[2], dims[3]),
            RopeLayout::SeqFirst => (dims[0], dims[2], dims[1], dims[3]),
        }
    }

    /// `out = rotate(x)` (forward, `sign` 1) or its transpose (backward, `sign` -1) over the
    /// head rows of `x`, in `x`'s own precision: in f32 the same products and sum, rounded
    /// the same way, as transformers' `q * cos + rotate_half(q) * sin`.
    fn apply<T: Real>(&self, x: &[T], dims: &[usize], sign: f32) -> Vec<T> {
        let (batch, heads, seq, d) = self.extents(dims);
        let half = d / 2;
        let mut out = vec![T::default(); x.len()];
        let per_batch = self.angles.rows != seq;
        let (cos, sin) = (&self.angles.cos, &self.angles.sin);
        for b in 0..batch {
            for h in 0..heads {
                for s in 0..seq {
                    let row = match self.layout {
                        RopeLayout::HeadsFirst => ((b * heads + h) * seq + s) * d,
                        RopeLayout::SeqFirst => ((b * seq + s) * heads + h) * d,
                    };
                    let t = if per_batch { b * seq + s } else { s } * half;
                    let (xr, or) = (&x[row..row + d], &mut out[row..row + d]);
                    for i in 0..half {
                        let (c, sn) = (T::from(cos[t + i]), T::from(sign * sin[t + i]));
                        let (a, z) = (xr[i], xr[i + half]);
                        or[i] = a * c - z * sn;
                        or[i + half] = z * c + a * sn;
                    }
                }
            }
        }
        out
    }

    /// The rotation (or, `backward`, its transpose) of `x` of `dims` on its GPU.
    #[cfg(feature = "cuda")]
    fn on_gpu(
        &self,
        x: Operand<'_>,
        dims: &[usize],
        dtype: candle_core::DType,
        backward: bool,
    ) -> Result<candle_core::CudaStorage> {
        let (batch, heads, seq, head_dim) = self.extents(dims);
        let shape = RopeShape {
            batch,
            heads,
            seq,
            head_dim,
            dtype,
            per_batch: self.angles.rows != seq,
            seq_first: self.layout == RopeLayout::SeqFirst,
        };
        let (cos, sin) = self.angles.on_gpu(x.0.device())?;
        let (cos_storage, cos_layout) = cos.storage_and_layout();
        let (sin_storage, sin_layout) = sin.storage_and_layout();
        let inputs = [
            (rope_buffers::X, x),
            (
                rope_buffers::COS,
                operand(&cos_storage, cos_layout, "rope cos")?,
            ),
            (
                rope_buffers::SIN,
                operand(&sin_storage, sin_layout, "rope sin")?,
            ),
        ];
        let y = Output::tensor(rope_buffers::Y, dims.iter().product());
        let mut out = cuda_kernels::execute(dtype, &shape.plan(backward)?, &inputs, &[y])?;
        take_storage(&mut out, rope_buffers::Y)
    }

    fn check(&self, dims: &[usize]) -> Result<()> {
        let rows = self.angles.rows;
        let ok = dims.len() == 4 && {
            let (batch, _, seq, d) = self.extents(dims);
            d.is_multiple_of(2)
                && self.angles.cos.len() == rows * d / 2
                && (rows == seq || rows == batch * seq)
        };
        if ok {
            Ok(())
        } else {
            let expected = match self.layout {
                RopeLayout::HeadsFirst => "[batch, heads, seq, head_dim]",
                RopeLayout::SeqFirst => "[batch, seq, heads, head_dim]",
            };
            Err(candle_core::Error::Msg(format!(
                "rope: x must be {expected} with head_dim twice the table's frequencies and seq or batch * seq positions; got {dims:?} for {rows} positions"
            )))
        }
    }
}

/// The precisions the rotation computes in (half-precision inputs are widened to f32).
trait Real:
    Copy
    + Default
    + From<f32>
    + std::ops::Mul<Output = Self>
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
{
}

impl Real for f32 {}
impl Real for f64 {}

/// An element type the op takes: f32 and f64 rotate in their own precision, bf16 and f16
/// widened to f32 and rounded once.
trait RopeElement: Float {
    fn rotate(op: &Rope, x: &[Self], dims: &[usize], sign: f32) -> Vec<Self>;
}

impl RopeElement for f32 {
    fn rotate(op: &Rope, x: &[f32], dims: &[usize], sign: f32) -> Vec<f32> {
        op.apply(x, dims, sign)
    }
}

impl RopeElement for f64 {
    fn rotate(op: &Rope, x: &[f64], dims: &[usize], sign: f32) -> Vec<f64> {
        op.apply(x, dims, sign)
    }
}

impl RopeElement for half::bf16 {
    /// Through f32 with the vectorised conversions the bf16 kernels use.
    fn rotate(op: &Rope, x: &[half::bf16], dims: &[usize], sign: f32) -> Vec<half::bf16> {
        let mut wide = Vec::new();
        super::simd::extend_bf16_as_f32(x, &mut wide);
        let rotated = op.apply(&wide, dims, sign);
        super::simd::bf16_vec_from_f32(&rotated)
    }
}

/// f16 through f32 (`half`'s slice conversions, F16C where the CPU has it).
macro_rules! through_f32 {
    ($($t:ty),*) => {$(
        impl RopeElement for $t {
            fn rotate(op: &Rope, x: &[$t], dims: &[usize], sign: f32) -> Vec<$t> {
                use half::slice::HalfFloatSliceExt;
                let mut wide = vec![0f32; x.len()];
                x.convert_to_f32_slice(&mut wide);
                let rotated = op.apply(&wide, dims, sign);
                let mut out = vec![<$t>::ZERO; x.len()];
                out.convert_from_f32_slice(&rotated);
                out
            }
        }
    )*};
}
through_f32!(half::f16);

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.check(l.shape().dims())?;
        float_dispatch!(s.dtype(), self.name(), T => {
            let x = contiguous::<T>(s, l, self.name())?;
            Ok((T::storage(T::rotate(self, x, l.shape().dims(), 1.0)), l.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.check(l.shape().dims())?;
        let x = device_operand(s, l, self.name())?;
        let y = self.on_gpu(x, l.shape().dims(), s.dtype(), false)?;
        Ok((y, l.shape().clone()))
    }

    /// The rotation is orthogonal: the gradient turns back by the same angles.
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if arg.device().is_cuda() {
            let dx = cuda_kernels::gradient_by(grad, "rope output gradient", arg.shape(), |g| {
                self.on_gpu(g, arg.dims(), arg.dtype(), true)
            })?;
            return Ok(Some(dx));
        }
        float_dispatch!(arg.dtype(), self.name(), T => {
            with_slice::<T, _>(grad, self.name(), |g| {
                tensor(T::rotate(self, g, arg.dims(), -1.0), arg.shape(), arg).map(Some)
            })
        })
    }
}

/// Rotary position embedding of `x` `[batch, heads, seq, head_dim]` at `positions`: one per
/// sequence position (shared by the batch) or `batch * seq` (each sequence its own, as
/// transformers' `position_ids`), with `table`'s frequencies. f32 computes as transformers
/// does; bf16 and f16 compute in f32 and round once (their gradients likewise).
pub fn rope(x: &Tensor, table: &RopeTable, positions: &[u32]) -> Result<Tensor> {
    rope_with(x, &table.angles_at(positions), RopeLayout::HeadsFirst)
}

/// [`rope`] with angles made once (`RopeTable::angles_at`) on an input of either layout.
pub fn rope_with(x: &Tensor, angles: &RopeAngles, layout: RopeLayout) -> Result<Tensor> {
    if !super::has_kernels(x) && !super::has_cuda_kernels(x) {
        let (cos, sin, positions) = angles.parts();
        return super::composed::rope(x, cos, sin, positions, layout == RopeLayout::SeqFirst);
    }
    let op = Rope {
        angles: angles.clone(),
        layout,
    };
    x.contiguous()?.apply_op1(op)
}

#[cfg(test)]
mod tests;
