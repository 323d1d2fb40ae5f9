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
use crate::quant::Packing;

/// `x Wᵀ` (+ `u`) over the last dimension of `x` (any leading shape), `W` the quantized
/// `[out, packing.cols]` weight held as `words` `[out, packing.row_words()]`
/// ([`crate::quant`]), `u` of the output's shape. f32 only.
pub fn quantized_linear(
    x: &Tensor,
    words: &Tensor,
    packing: Packing,
    update: Option<&Tensor>,
) -> Result<Tensor> {
    if !super::has_kernels(x) {
        candle_core::bail!(
            "quantized linear: the input is on {:?}; the quantized base computes on the CPU only (its CUDA dequantize kernel has not landed)",
            x.device().location()
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

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
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

    fn bwd(
        &self,
        x_t: &Tensor,
        w_t: &Tensor,
        _u_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((self.input_grad(x_t, w_t, grad)?, None, Some(grad.clone())))
    }
}
