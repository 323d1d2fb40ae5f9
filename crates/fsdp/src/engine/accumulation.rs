//! Gradient accumulation over micro-batches, in the engine as FSDP2 keeps it on the
//! parameters: a backward with sync reduces each unit's gradients (with whatever earlier
//! backwards without sync kept) and adds the reduced rows to the sum no step has taken yet;
//! a backward without sync (`no_sync`) adds each unit's whole local gradients to what it
//! carries to the next reduction. The caller only says which ([`Fsdp::accumulate_backward`]).

use candle_core::Tensor;

use super::error::EngineError;
use super::fsdp::Fsdp;
use super::grad_scaler::GradScaler;
use super::grads::Gradients;
use super::step::StepParams;

impl Fsdp {
    /// Back-propagates `loss` (see [`Fsdp::backward`]) into the gradients this engine
    /// accumulates until a step takes them: with `sync` reduced and added to the reduced sum;
    /// without, kept whole per unit and reduced by the next backward with sync (fewer bytes on
    /// the wire, whole gradients held meanwhile). Scale each micro-batch's loss as the
    /// accumulation needs: nothing is scaled here.
    pub fn accumulate_backward(
        &mut self,
        params: StepParams,
        loss: Tensor,
        sync: bool,
    ) -> Result<(), EngineError> {
        if !sync {
            return self.backward_no_sync(params, loss);
        }
        let grads = self.backward(params, loss)?;
        match self.accumulated.reduced.as_mut() {
            Some(sum) => sum.accumulate(grads),
            None => {
                self.accumulated.reduced = Some(grads);
                Ok(())
            }
        }
    }

    /// Back-propagates `loss` without reducing: each unit's whole local gradients are added
    /// to those kept by earlier calls, and the next [`Fsdp::backward`] reduces the sum once
    /// (`no_sync`: fewer bytes on the wire for gradient accumulation, at the cost of holding
    /// whole gradients of the model on every rank until then). Scale each micro-batch's loss
    /// as the accumulation needs: nothing is scaled here.
    pub fn backward_no_sync(
        &mut self,
        params: StepParams,
        loss: Tensor,
    ) -> Result<(), EngineError> {
        self.run_backward(&params, loss, false)?;
        self.accumulated.unreduced = params.shared.take_unreduced();
        Ok(())
    }

    /// Bytes of gradients kept by [`Fsdp::backward_no_sync`], waiting for a backward with sync.
    pub fn unreduced_bytes(&self) -> usize {
        self.accumulated
            .unreduced
            .iter()
            .flatten()
            .map(|(b, _)| b.len() * b.dtype().size())
            .sum()
    }

    /// The reduced gradients accumulated by [`Fsdp::accumulate_backward`] with sync, by
    /// parameter name; `None` before any.
    pub fn gradients(&self) -> Option<&Gradients> {
        self.accumulated.reduced.as_ref()
    }

    /// Takes the accumulated reduced gradients (for [`Fsdp::step`]); the sum starts anew.
    pub fn take_gradients(&mut self) -> Option<Gradients> {
        self.accumulated.reduced.take()
    }

    /// Drops the accumulated reduced gradients (`optimizer.zero_grad()`).
    pub fn zero_grad(&mut self) {
        self.accumulated.reduced = None;
    }

    /// fp16: unscales the accumulated reduced gradients by `scaler`'s scale; whether any
    /// rank found an overflow in them (collective). `None` before any gradient.
    pub fn unscale_gradients(&mut self, scaler: &GradScaler) -> Result<Option<bool>, EngineError> {
        self.on_gradients(|engine, grads| scaler.unscale(engine, grads))
    }

    /// [`Fsdp::clip_grad_norm`] of the accumulated reduced gradients: the global norm and
    /// whether they were scaled. `None` before any gradient.
    pub fn clip_gradients(&mut self, max_norm: f64) -> Result<Option<(f64, bool)>, EngineError> {
        self.on_gradients(|engine, grads| engine.clip_grad_norm(grads, Some(max_norm)))
    }

    /// Runs `f` on the engine and its accumulated reduced gradients (a collective may need
    /// both); `None` before any gradient.
    fn on_gradients<T>(
        &mut self,
        f: impl FnOnce(&Fsdp, &mut Gradients) -> Result<T, EngineError>,
    ) -> Result<Option<T>, EngineError> {
        let Some(mut grads) = self.accumulated.reduced.take() else {
            return Ok(None);
        };
        let out = f(self, &mut grads);
        self.accumulated.reduced = Some(grads);
        out.map(Some)
    }
}
