//! A projection by a frozen quantized weight (QLoRA's base layer): `x Wᵀ`, optionally plus an
//! update made beside it (the LoRA adapter's), with `W` dequantized from its blocks into a
//! scratch buffer for the product and dropped after it — in forward, and again in backward for
//! `dx = g · W`. No gradient for the weight (it is frozen), and no full-precision copy of it
//! lives between the two.

use std::cell::RefCell;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::linear::on_rows;
use super::{contiguous, gemm_into, gemm_new, with_slice};
#[cfg(feature = "cuda")]
use super::{
    cuda_kernels::{self, Operand, Output, device_operand, gradient_tensor, operand, take_storage},
    kernel_plan::{Nf4Shape, quant_buffers},
};
use crate::quant::{Packing, QuantFormat};

/// `x Wᵀ` (+ `u`) over the last dimension of `x` (any leading shape), `W` the quantized
/// `[out, packing.cols]` weight held as `words` `[out, packing.row_words()]`
/// ([`crate::quant`]), `u` of the output's shape. f32 only.
pub fn quantized_linear(
    x: &Tensor,
    words: &Tensor,
    packing: Packing,
    update: Option<&Tensor>,
) -> Result<Tensor> {
    let on_gpu = super::has_cuda_kernels(x) && packing.format == QuantFormat::Nf4;
    if !super::has_kernels(x) && !on_gpu {
        candle_core::bail!(
            "quantized linear: the input is on {:?}; the quantized base computes on the CPU, and on a GPU in nf4 only ({} has no CUDA dequantize kernel)",
            x.device().location(),
            packing.format
        );
    }
    let (n, w) = words.dims2()?;
    if w != packing.row_words() || words.dtype() != DType::F32 {
        candle_core::bail!(
            "quantized linear: the weight's words are {:?} {:?}, {} rows of {} words expected for {} rows of {} {} elements",
            words.dtype(),
            words.dims(),
            n,
            packing.row_words(),
            n,
            packing.cols,
            packing.format
        );
    }
    if x.dtype() != DType::F32 {
        candle_core::bail!(
            "quantized linear: the input is {:?}; a quantized base computes in f32 (mixed precision with one is not supported)",
            x.dtype()
        );
    }
    let op = QuantizedLinear {
        packing,
        want_dx: x.track_op(),
    };
    let words = words.contiguous()?;
    on_rows(x, n, |x2| match update {
        None => x2.apply_op2(&words, op),
        Some(u) => {
            let u2 = u.reshape((u.elem_count() / n.max(1), n))?.contiguous()?;
            x2.apply_op3(&words, &u2, op)
        }
    })
}

/// The op's name in errors.
const OP: &str = "quantized-linear";

struct QuantizedLinear {
    packing: Packing,
    /// Whether backward forms dx (an input outside the graph gets none).
    want_dx: bool,
}

thread_local! {
    /// The dequantized weight of the product running on this thread: kept between products
    /// (the largest layer's f32 weight), so each use writes into pages already mapped instead
    /// of faulting in a fresh allocation of that size.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl QuantizedLinear {
    /// Runs `f` on the weight `[n, k]` dequantized from its words.
    fn with_weight<R>(&self, words: &[f32], f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
        let len = words.len() / self.packing.row_words().max(1) * self.packing.cols;
        let fill = |w: &mut [f32]| {
            self.packing
                .dequantize_into(words, w)
                .map_err(|e| candle_core::Error::Msg(format!("{OP}: {e}")))
        };
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut buf) => {
                if buf.len() < len {
                    buf.resize(len, 0.0);
                }
                let w = &mut buf[..len];
                fill(w)?;
                f(w)
            }
            // A product inside a product (never in practice): a buffer of its own.
            Err(_) => {
                let mut w = vec![0f32; len];
                fill(&mut w)?;
                f(&w)
            }
        })
    }

    /// (m, k, n) after checking the operands.
    fn dims(&self, l1: &Layout, l2: &Layout) -> Result<(usize, usize, usize)> {
        let (m, k) = l1.shape().dims2()?;
        let (n, _) = l2.shape().dims2()?;
        if k != self.packing.cols {
            candle_core::bail!(
                "quantized linear: input {:?} for a weight of {} inputs",
                l1.shape().dims(),
                self.packing.cols
            );
        }
        Ok((m, k, n))
    }

    /// `dst (+)= x Wᵀ` for the forward's operands.
    fn product(
        &self,
        (s1, l1): (&CpuStorage, &Layout),
        (s2, l2): (&CpuStorage, &Layout),
        update: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k, n) = self.dims(l1, l2)?;
        let x = contiguous::<f32>(s1, l1, OP)?;
        let y = match update {
            None => None,
            Some((s3, l3)) => {
                if l3.shape().dims() != [m, n] {
                    candle_core::bail!(
                        "quantized linear + update: update {:?} for an output [{m}, {n}]",
                        l3.shape().dims()
                    );
                }
                Some(contiguous::<f32>(s3, l3, OP)?.to_vec())
            }
        };
        let y = self.with_weight(contiguous::<f32>(s2, l2, OP)?, |w| {
            Ok(match y {
                None => gemm_new(m, n, k, x, k, 1, w, 1, k, 1.0),
                Some(mut y) => {
                    gemm_into(m, n, k, &mut y, n, true, x, k, 1, w, 1, k, 1.0);
                    y
                }
            })
        })?;
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }

    /// `dx = g · W`, when wanted.
    fn input_grad(&self, x_t: &Tensor, w_t: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !self.want_dx {
            return Ok(None);
        }
        let (m, k) = x_t.dims2()?;
        let n = w_t.dim(0)?;
        let dx = with_slice::<f32, _>(w_t, OP, |words| {
            self.with_weight(words, |w| {
                with_slice::<f32, _>(grad, OP, |g| Ok(gemm_new(m, k, n, g, n, 1, w, k, 1, 1.0)))
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, (m, k), x_t.device())?))
    }
}

#[cfg(feature = "cuda")]
impl QuantizedLinear {
    /// The weight `[n, cols]` dequantized on the GPU from its words (NF4).
    fn gpu_weight(&self, words: Operand<'_>, n: usize) -> Result<candle_core::CudaStorage> {
        if self.packing.format != QuantFormat::Nf4 {
            candle_core::bail!(
                "{OP}: {} has no CUDA dequantize kernel (nf4 has)",
                self.packing.format
            );
        }
        let shape = Nf4Shape {
            rows: n,
            cols: self.packing.cols,
            row_words: self.packing.row_words(),
        };
        let out = Output::tensor(quant_buffers::OUT, n * self.packing.cols);
        let inputs = [(quant_buffers::WORDS, words)];
        let mut w = cuda_kernels::execute(DType::F32, &shape.dequantize()?, &inputs, &[out])?;
        take_storage(&mut w, quant_buffers::OUT)
    }

    /// `x Wᵀ (+ u)` on the GPU: the weight dequantized into scratch for cuBLAS's product and
    /// dropped after it.
    fn gpu_product(
        &self,
        (s1, l1): (&candle_core::CudaStorage, &Layout),
        (s2, l2): (&candle_core::CudaStorage, &Layout),
        update: Option<(&candle_core::CudaStorage, &Layout)>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, k, n) = self.dims(l1, l2)?;
        cuda_kernels::same_types(OP, &[("input", s1.dtype()), ("weight words", s2.dtype())])?;
        let w = self.gpu_weight(device_operand(s2, l2, OP)?, n)?;
        let w_t = Layout::contiguous((n, k)).transpose(0, 1)?;
        let y = s1.matmul(&w, (1, m, n, k), l1, &w_t)?;
        let Some((s3, l3)) = update else {
            return Ok((y, Shape::from((m, n))));
        };
        if l3.shape().dims() != [m, n] || s3.dtype() != DType::F32 {
            candle_core::bail!(
                "quantized linear + update: update {:?} {:?} for an f32 output [{m}, {n}]",
                s3.dtype(),
                l3.shape().dims()
            );
        }
        let sum = y.binary_impl::<candle_core::op::Add>(s3, &Layout::contiguous((m, n)), l3)?;
        Ok((sum, Shape::from((m, n))))
    }

    /// `dx = g · W` on the GPU (W dequantized again), when wanted.
    fn gpu_input_grad(&self, x_t: &Tensor, w_t: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !self.want_dx {
            return Ok(None);
        }
        let (n, k) = (w_t.dim(0)?, x_t.dim(1)?);
        let words = w_t.contiguous()?;
        let (storage, layout) = words.storage_and_layout();
        let w = self.gpu_weight(operand(&storage, layout, OP)?, n)?;
        let w = gradient_tensor(w, &Shape::from((n, k)));
        Ok(Some(grad.matmul(&w)?))
    }
}

impl CustomOp2 for QuantizedLinear {
    fn name(&self) -> &'static str {
        "quantized-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.product((s1, l1), (s2, l2), None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.gpu_product((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x_t.device().is_cuda() {
            return Ok((self.gpu_input_grad(x_t, w_t, grad)?, None));
        }
        Ok((self.input_grad(x_t, w_t, grad)?, None))
    }
}

impl CustomOp3 for QuantizedLinear {
    fn name(&self) -> &'static str {
        "quantized-linear-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if s3.dtype() != DType::F32 {
            candle_core::bail!("quantized linear + update: the update is {:?}", s3.dtype());
        }
        self.product((s1, l1), (s2, l2), Some((s3, l3)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.gpu_product((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        _u_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x_t.device().is_cuda() {
            return Ok((
                self.gpu_input_grad(x_t, w_t, grad)?,
                None,
                Some(grad.clone()),
            ));
        }
        Ok((self.input_grad(x_t, w_t, grad)?, None, Some(grad.clone())))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::*;
    use crate::numerics::{max_rel_diff, rand};

    /// An NF4 weight `[n, k]`: its packing and words.
    fn nf4_weight(n: usize, k: usize) -> (Packing, Tensor) {
        let packing = Packing::new("w", QuantFormat::Nf4, k).unwrap();
        let values: Vec<f32> = rand(&[n, k], 7, 1.0, DType::F32)
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let words = packing.quantize(&values);
        let rw = packing.row_words();
        let words = Tensor::from_vec(words, (n, rw), &Device::Cpu).unwrap();
        (packing, words)
    }

    /// `quantized_linear` with an NF4 base on a GPU against the CPU op: the product, with and
    /// without an update, and the input's gradient (f32 within 1e-5 of each element's size).
    /// Skips where no GPU is usable; fails under `FSDP_REQUIRE_GPU=1`.
    #[test]
    fn nf4_quantized_linear_on_a_gpu_matches_the_cpu() {
        let Some(gpu) = crate::device::gpu_for_tests() else {
            return;
        };
        let (packing, words) = nf4_weight(24, 128);
        let x = rand(&[5, 128], 8, 1.0, DType::F32);
        let update = rand(&[5, 24], 9, 1.0, DType::F32);
        let g = rand(&[5, 24], 10, 1.0, DType::F32);
        let run = |device: &Device, with_update: bool| {
            let x = Var::from_tensor(&x.to_device(device).unwrap()).unwrap();
            let words = words.to_device(device).unwrap();
            let u = update.to_device(device).unwrap();
            let u = with_update.then_some(&u);
            let y = quantized_linear(x.as_tensor(), &words, packing, u).unwrap();
            let g = g.to_device(device).unwrap();
            let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = grads
                .get(x.as_tensor())
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap();
            (y.to_device(&Device::Cpu).unwrap(), dx)
        };
        for with_update in [false, true] {
            let (y_cpu, dx_cpu) = run(&Device::Cpu, with_update);
            let (y_gpu, dx_gpu) = run(&gpu, with_update);
            assert!(
                max_rel_diff(&y_gpu, &y_cpu) < 1e-5,
                "output, update {with_update}"
            );
            assert!(
                max_rel_diff(&dx_gpu, &dx_cpu) < 1e-5,
                "dx, update {with_update}"
            );
        }
    }
}
