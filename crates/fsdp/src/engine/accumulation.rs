//! The gradients the engine holds between backward and the optimizer step, as FSDP2 keeps
//! them on the parameters: a backward with sync reduces each unit's gradients (with
//! whatever earlier backwards without sync kept) and adds the reduced rows to the sum no
//! step has taken yet; a backward without sync (`no_sync`) adds each unit's whole local
//! gradients to what it carries to the next reduction. Clipping, fp16 unscaling and the
//! step act on the held sum; `zero_grad` drops it.

use candle_core::Tensor;
use fsdp_comm::{CommunicatorExt, ReduceOp};

use super::error::EngineError;
use super::fsdp::Fsdp;
use super::grads::Gradients;
use super::step::StepParams;

impl Fsdp {
    /// Back-propagates `loss` (consumed, so the graph is freed when this returns): plans the
    /// units' backward order from the graph (and, in debug mode, checks it) and runs
    /// backward with each unit refilled before and its gradients packed right after its
    /// gradient computation. With `sync` each unit's gradients, and those earlier backwards
    /// without sync kept, are reduced in one collective and added to the held sum
    /// ([`Fsdp::gradients`]); without, they are kept whole per unit for the next backward
    /// with sync (`no_sync`: fewer bytes on the wire, whole gradients held meanwhile).
    /// Scale each micro-batch's loss as the accumulation needs: nothing is scaled here.
    ///
    /// ```no_run
    /// # fn step(engine: &mut fsdp::engine::Fsdp, model: &impl fsdp::nn::Forward<fsdp::nn::candle::Tensor, Output = fsdp::nn::candle::Tensor>, x: &fsdp::nn::candle::Tensor, optimizer: &mut dyn fsdp::optim::Optimizer) -> Result<(), Box<dyn std::error::Error>> {
    /// let params = engine.begin_step()?;
    /// let loss = model.forward(&params, x.clone())?.sqr()?.mean_all()?;
    /// engine.backward(params, loss, true)?;
    /// engine.clip_grad_norm(Some(1.0))?;
    /// engine.step(optimizer)?;
    /// # Ok(()) }
    /// ```
    pub fn backward(
        &mut self,
        params: StepParams,
        loss: Tensor,
        sync: bool,
    ) -> Result<(), EngineError> {
        let (units, has_grad) = self.run_backward(&params, loss, sync)?;
        if !sync {
            self.accumulated.unreduced = params.shared.take_unreduced();
            return Ok(());
        }
        drop(params);
        let grads = Gradients {
            units,
            has_grad,
            replicated: self.units.iter().map(|u| u.replicated).collect(),
            index: self.grad_index.clone(),
            known_finite: false,
        };
        match self.accumulated.reduced.as_mut() {
            Some(sum) => sum.accumulate(grads),
            None => {
                self.accumulated.reduced = Some(grads);
                Ok(())
            }
        }
    }

    /// Bytes of gradients kept by backwards without sync, waiting for one with sync.
    pub fn unreduced_bytes(&self) -> usize {
        self.accumulated
            .unreduced
            .iter()
            .flatten()
            .map(|(b, _)| b.len() * b.dtype().size())
            .sum()
    }

    /// This rank's reduced gradients held for the next step, by parameter name; `None`
    /// before any backward with sync.
    pub fn gradients(&self) -> Option<&Gradients> {
        self.accumulated.reduced.as_ref()
    }

    /// The held gradients, writable (a caller's own scaling or clipping).
    pub fn gradients_mut(&mut self) -> Option<&mut Gradients> {
        self.accumulated.reduced.as_mut()
    }

    /// Drops the held gradients (`optimizer.zero_grad()`).
    pub fn zero_grad(&mut self) {
        self.accumulated.reduced = None;
    }

    /// The global norm of the held gradients (over every parameter on every rank: shards'
    /// squares summed over the shard group, whole copies counted once), and, when
    /// `max_norm` is set, the gradients multiplied by `min(1, max_norm / (norm + 1e-6))` in
    /// f32, as PyTorch's `clip_grad_norm_` does (so a norm at the limit is still scaled, by
    /// a hair); whether they were scaled. Collective.
    pub fn clip_grad_norm(&mut self, max_norm: Option<f64>) -> Result<(f64, bool), EngineError> {
        self.with_gradients("clip_grad_norm", |engine, grads| {
            let (mut sharded_sq, replicated_sq) = grads.squares()?;
            if engine.mesh.shard_size() > 1 {
                sharded_sq = engine
                    .mesh
                    .shard
                    .all_reduce_vec(vec![sharded_sq], ReduceOp::Sum)
                    .wait()?[0];
            }
            let norm = (sharded_sq + replicated_sq).sqrt();
            let scale = match max_norm {
                Some(max) => (max as f32 / (norm as f32 + 1e-6)).min(1.0),
                None => 1.0,
            };
            if scale < 1.0 {
                grads.scale(scale)?;
            }
            grads.known_finite = norm.is_finite();
            Ok((norm, scale < 1.0))
        })
    }

    /// Runs `f` (operation `op`) on the engine and its held gradients (a collective may
    /// need both); [`EngineError::NoGradients`] when none are held.
    pub(crate) fn with_gradients<T>(
        &mut self,
        op: &'static str,
        f: impl FnOnce(&Fsdp, &mut Gradients) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let Some(mut grads) = self.accumulated.reduced.take() else {
            return Err(EngineError::NoGradients { op });
        };
        let out = f(self, &mut grads);
        self.accumulated.reduced = Some(grads);
        out
    }
}
