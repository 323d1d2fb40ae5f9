//! SwiGLU, the gated MLP activation of Llama, Mistral and Qwen2: `silu(gate) * up` in one pass
//! with a hand-written backward. Composed from candle ops it keeps `sigmoid(gate)`,
//! `silu(gate)` and the product's operands alive until backward; this op keeps only its two
//! inputs (which the projections' outputs are anyway).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::{
    Float, composed, contiguous, float_dispatch, has_cuda_kernels, has_kernels, tensor, with_slice,
};
#[cfg(feature = "cuda")]
use super::{
    cuda_kernels::{self, Output, device_operand, take_storage, take_tensor},
    kernel_plan::{ElementShape, swiglu as plan},
};

/// `(silu(g), silu'(g))` in f64: `silu(g) = g σ(g)`, `silu'(g) = σ(g) (1 + g (1 - σ(g)))`.
#[inline]
fn silu_and_grad(g: f64) -> (f64, f64) {
    let s = 1.0 / (1.0 + (-g).exp());
    (g * s, s * (1.0 + g * (1.0 - s)))
}

/// `out = silu(gate) * up` in f64 arithmetic (the f32 path is `simd::swiglu_forward`).
pub(super) fn forward_scalar<T: Float>(gate: &[T], up: &[T], out: &mut [T]) {
    for ((&g, &u), o) in gate.iter().zip(up).zip(out.iter_mut()) {
        *o = T::of(silu_and_grad(g.f()).0 * u.f());
    }
}

/// `dgate = dy * up * silu'(gate)`, `dup = dy * silu(gate)` in f64 arithmetic.
pub(super) fn backward_scalar<T: Float>(
    gate: &[T],
    up: &[T],
    dy: &[T],
    dgate: &mut [T],
    dup: &mut [T],
) {
    for (((&g, &u), &d), (dg, du)) in gate
        .iter()
        .zip(up)
        .zip(dy)
        .zip(dgate.iter_mut().zip(dup.iter_mut()))
    {
        let (silu, grad) = silu_and_grad(g.f());
        *dg = T::of(d.f() * u.f() * grad);
        *du = T::of(d.f() * silu);
    }
}

/// An error unless `gate` (`l1`) and `up` (`l2`) have one shape.
fn check_shapes(op: &str, l1: &Layout, l2: &Layout) -> Result<()> {
    if l1.shape() != l2.shape() {
        candle_core::bail!(
            "{op}: gate {:?} and up {:?} differ in shape",
            l1.dims(),
            l2.dims()
        );
    }
    Ok(())
}

struct SwiGlu;

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        check_shapes(self.name(), l1, l2)?;
        float_dispatch!(s1.dtype(), self.name(), T => {
            let gate = contiguous::<T>(s1, l1, self.name())?;
            let up = contiguous::<T>(s2, l2, self.name())?;
            let mut y = vec![T::of(0.0); gate.len()];
            T::swiglu_forward(gate, up, &mut y);
            Ok((T::storage(y), l1.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        check_shapes(self.name(), l1, l2)?;
        cuda_kernels::same_types(self.name(), &[("gate", s1.dtype()), ("up", s2.dtype())])?;
        let shape = ElementShape::over(l1.shape(), s1.dtype());
        let inputs = [
            (plan::GATE, device_operand(s1, l1, self.name())?),
            (plan::UP, device_operand(s2, l2, self.name())?),
        ];
        let y = Output::tensor(plan::Y, l1.shape().elem_count());
        let mut out = cuda_kernels::execute(shape.dtype, &shape.swiglu_forward()?, &inputs, &[y])?;
        Ok((take_storage(&mut out, plan::Y)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate_t: &Tensor,
        up_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if gate_t.device().is_cuda() {
            let types = [
                ("gate", gate_t.dtype()),
                ("up", up_t.dtype()),
                ("gradient", grad.dtype()),
            ];
            cuda_kernels::same_types(self.name(), &types)?;
            let shape = ElementShape::over(gate_t.shape(), gate_t.dtype());
            let n = gate_t.elem_count();
            let inputs = [
                (plan::GATE, gate_t, "swiglu gate"),
                (plan::UP, up_t, "swiglu up"),
                (plan::Y, grad, "swiglu output gradient"),
            ];
            let outputs = [Output::tensor(plan::DGATE, n), Output::tensor(plan::DUP, n)];
            let mut out =
                cuda_kernels::execute_on_tensors(&shape.swiglu_backward()?, &inputs, &outputs)?;
            return Ok((
                Some(take_tensor(&mut out, plan::DGATE, gate_t.shape())?),
                Some(take_tensor(&mut out, plan::DUP, up_t.shape())?),
            ));
        }
        float_dispatch!(gate_t.dtype(), self.name(), T => {
            with_slice::<T, _>(gate_t, self.name(), |gate| {
                with_slice::<T, _>(up_t, self.name(), |up| {
                    with_slice::<T, _>(grad, self.name(), |dy| {
                        let mut dgate = vec![T::of(0.0); gate.len()];
                        let mut dup = vec![T::of(0.0); gate.len()];
                        T::swiglu_backward(gate, up, dy, &mut dgate, &mut dup);
                        Ok((
                            Some(tensor(dgate, gate_t.shape(), gate_t)?),
                            Some(tensor(dup, up_t.shape(), up_t)?),
                        ))
                    })
                })
            })
        })
    }
}

/// `silu(gate) * up` (transformers' `act_fn(gate_proj(x)) * up_proj(x)` with `hidden_act:
/// silu`), `gate` and `up` of one shape. f32 and f64 compute in their own precision; bf16
/// and f16 in f32, rounded once.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if !has_kernels(gate) && !has_cuda_kernels(gate) {
        return composed::swiglu(gate, up);
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}
