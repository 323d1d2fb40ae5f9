//! Cross-entropy, and the LM head fused with it, on a CUDA device: fsdp-nn's cross-entropy
//! kernels (`kernels/cross_entropy.cu`) for the rows, cuBLAS (candle's matmul) for the head's
//! products. The loss is computed before the op that carries it into the graph, whose
//! backward then only scales: cross-entropy keeps each row's log-sum-exp and forms the
//! logits' gradient in backward, as the CPU op does; the fused head forms the gradients of
//! the hidden states and the weight chunk by chunk in forward, never keeping the `[N, V]`
//! logits.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::cuda_kernels::{self, Output, take_tensor};
use super::kernel_plan::{CrossEntropyShape, cross_entropy_buffers as cb};
use super::{CrossEntropy, Reduction};

/// Logit elements made at once by the fused head (rows of the vocabulary's width).
const CHUNK_ELEMS: usize = 8 << 20;

/// The targets on the device as i64, checked on the host, and how many count.
struct Targets {
    on_device: Tensor,
    counted: usize,
}

impl Targets {
    /// `targets` `[rows]` against `classes` classes: each in range or ignored.
    fn new(targets: &Tensor, rows: usize, classes: usize, settings: &CrossEntropy) -> Result<Self> {
        let host: Vec<i64> = targets.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?;
        if host.len() != rows {
            candle_core::bail!(
                "cross_entropy: {} targets for {rows} rows of logits",
                host.len()
            );
        }
        for &t in &host {
            settings.check(t, classes)?;
        }
        let counted = host.iter().filter(|&&t| t != settings.ignore_index).count();
        Ok(Targets {
            on_device: Tensor::new(host.as_slice(), targets.device())?,
            counted,
        })
    }

    /// What the sum of the rows' losses (and their gradients) is multiplied by.
    fn scale(&self, settings: &CrossEntropy) -> f64 {
        match settings.reduction {
            Reduction::Sum => 1.0,
            // PyTorch's mean over no targets is NaN (0 times infinity).
            Reduction::Mean => 1.0 / self.counted as f64,
        }
    }
}

/// The kernels' shape for `logits` `[rows, classes]`.
fn shape(logits: &Tensor, settings: &CrossEntropy) -> Result<CrossEntropyShape> {
    let (rows, classes) = logits.dims2()?;
    Ok(CrossEntropyShape {
        rows,
        classes,
        dtype: logits.dtype(),
        ignore_index: settings.ignore_index,
        label_smoothing: settings.label_smoothing,
    })
}

/// The scaled sum of `logits`' row losses (an f32 `[1]`) and each row's log-sum-exp.
fn forward(
    logits: &Tensor,
    targets: &Tensor,
    settings: &CrossEntropy,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let shape = shape(logits, settings)?;
    let inputs = [
        (cb::LOGITS, logits, "cross_entropy logits"),
        (cb::TARGETS, targets, "cross_entropy targets"),
    ];
    let outputs = [
        Output::scratch(cb::LOSS_ROWS, shape.rows),
        Output::scratch(cb::LSE, shape.rows),
        Output::scratch(cb::LOSS, 1),
    ];
    let mut out = cuda_kernels::execute_on_tensors(&shape.forward(scale)?, &inputs, &outputs)?;
    let loss = take_tensor(&mut out, cb::LOSS, &Shape::from(1))?;
    let lse = take_tensor(&mut out, cb::LSE, &Shape::from(shape.rows))?;
    Ok((loss, lse))
}

/// The logits' gradient, `(softmax - q) * scale`, from forward's log-sum-exps.
fn logits_grad(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    settings: &CrossEntropy,
    scale: f64,
) -> Result<Tensor> {
    let shape = shape(logits, settings)?;
    let inputs = [
        (cb::LOGITS, logits, "cross_entropy logits"),
        (cb::TARGETS, targets, "cross_entropy targets"),
        (cb::LSE, lse, "cross_entropy log-sum-exps"),
    ];
    let outputs = [Output::tensor(cb::DLOGITS, shape.rows * shape.classes)];
    let mut out = cuda_kernels::execute_on_tensors(&shape.backward(scale)?, &inputs, &outputs)?;
    take_tensor(&mut out, cb::DLOGITS, logits.shape())
}

/// The storage of a loss computed before its op: the op's forward returns a copy.
fn loss_storage(loss: &Tensor) -> Result<(CudaStorage, Shape)> {
    let (storage, layout) = loss.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cuda(s) => Ok((s.try_clone(layout)?, Shape::from(()))),
        _ => candle_core::bail!("a GPU loss not on the GPU"),
    }
}

/// The upstream gradient of a scalar loss, on the host.
fn upstream(grad: &Tensor) -> Result<f64> {
    Ok(grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?[0] as f64)
}

/// Carries a cross-entropy computed on the GPU into the graph of its logits.
struct CrossEntropyLoss {
    settings: CrossEntropy,
    targets: Tensor,
    scale: f64,
    loss: Tensor,
    lse: Tensor,
}

impl CustomOp1 for CrossEntropyLoss {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-gpu"
    }

    fn cpu_fwd(
        &self,
        _s: &candle_core::CpuStorage,
        _l: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{}: the logits are on a GPU", self.name())
    }

    fn cuda_fwd(&self, _s: &CudaStorage, _l: &Layout) -> Result<(CudaStorage, Shape)> {
        loss_storage(&self.loss)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let scale = self.scale * upstream(grad)?;
        logits_grad(arg, &self.targets, &self.lse, &self.settings, scale).map(Some)
    }
}

/// [`super::cross_entropy`] of `logits` `[N, C]` on their GPU.
pub(super) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    settings: CrossEntropy,
) -> Result<Tensor> {
    let (rows, classes) = logits.dims2()?;
    let t = Targets::new(targets, rows, classes, &settings)?;
    let scale = t.scale(&settings);
    let logits = logits.contiguous()?;
    let (loss, lse) = forward(&logits.detach(), &t.on_device, &settings, scale)?;
    let op = CrossEntropyLoss {
        settings,
        targets: t.on_device,
        scale,
        loss,
        lse,
    };
    logits.apply_op1(op)
}

/// Carries the fused head's loss into the graph of the hidden states and the weight, with
/// the gradients forward formed (at an upstream gradient of one).
struct HeadLoss {
    loss: Tensor,
    grads: (Option<Tensor>, Option<Tensor>),
}

impl CustomOp2 for HeadLoss {
    fn name(&self) -> &'static str {
        "fused-linear-cross-entropy-gpu"
    }

    fn cpu_fwd(
        &self,
        _s1: &candle_core::CpuStorage,
        _l1: &Layout,
        _s2: &candle_core::CpuStorage,
        _l2: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{}: the hidden states are on a GPU", self.name())
    }

    fn cuda_fwd(
        &self,
        _s1: &CudaStorage,
        _l1: &Layout,
        _s2: &CudaStorage,
        _l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        loss_storage(&self.loss)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = upstream(grad)?;
        let scaled = |t: &Option<Tensor>| match t {
            Some(t) if g == 1.0 => Ok(Some(t.clone())),
            Some(t) => t.affine(g, 0.0).map(Some),
            None => Ok(None),
        };
        Ok((scaled(&self.grads.0)?, scaled(&self.grads.1)?))
    }
}

/// [`super::linear_cross_entropy`] on the GPU of `hidden` `[N, H]` and `weight` `[V, H]`: a
/// few rows of logits at a time, each chunk's gradients folded into the hidden states' and
/// the weight's while it is at hand (the weight's summed in f32, rounded once).
pub(super) fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    settings: CrossEntropy,
) -> Result<Tensor> {
    let (n, _) = hidden.dims2()?;
    let v = weight.dim(0)?;
    let t = Targets::new(targets, n, v, &settings)?;
    let scale = t.scale(&settings);
    let (want_x, want_w) = (hidden.track_op(), weight.track_op());
    let (x, w) = (hidden.detach().contiguous()?, weight.detach().contiguous()?);
    let rows = (CHUNK_ELEMS / v.max(1)).clamp(1, n.max(1));
    let mut loss: Option<Tensor> = None;
    let mut gx = Vec::new();
    let mut gw: Option<Tensor> = None;
    for r0 in (0..n).step_by(rows) {
        let m = rows.min(n - r0);
        let xc = x.narrow(0, r0, m)?;
        let tc = t.on_device.narrow(0, r0, m)?;
        let logits = xc.matmul(&w.t()?)?;
        let (part, lse) = forward(&logits, &tc, &settings, scale)?;
        loss = Some(match loss {
            None => part,
            Some(total) => (total + part)?,
        });
        if !(want_x || want_w) {
            continue;
        }
        let dz = logits_grad(&logits, &tc, &lse, &settings, scale)?;
        if want_x {
            gx.push(dz.matmul(&w)?);
        }
        if want_w {
            let part = dz.t()?.matmul(&xc)?.to_dtype(DType::F32)?;
            gw = Some(match gw {
                None => part,
                Some(sum) => (sum + part)?,
            });
        }
    }
    let loss = match loss {
        Some(l) => l,
        // No rows: the CPU's 0 for a sum, 0 / 0 for a mean.
        None => Tensor::new(&[(0.0 * scale) as f32], hidden.device())?,
    };
    let gx = match want_x && !gx.is_empty() {
        true => Some(Tensor::cat(&gx, 0)?),
        false => None,
    };
    let gw = gw.map(|g| g.to_dtype(weight.dtype())).transpose()?;
    let op = HeadLoss {
        loss,
        grads: (gx, gw),
    };
    hidden.contiguous()?.apply_op2(&weight.contiguous()?, op)
}
