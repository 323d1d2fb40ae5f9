//! What `prepare` returns: [`PreparedModel`] (a model and its FSDP engine, holding the forward
//! pass in flight and with fp16 its loss scaler; the engine accumulates the gradients until
//! the optimizer steps) and
//! [`PreparedOptimizer`] (an optimizer paired with the model of the same preparation order,
//! and its learning-rate scheduler).

use candle_core::Tensor;

use super::AcceleratorError;
use crate::engine::{Fsdp, GradScaler, Gradients, StepParams};
use crate::nn::Params;
use crate::optim::{LrSchedule, LrScheduler, Optimizer};

/// A model sharded by [`super::Accelerator::prepare_model`].
pub struct PreparedModel<M> {
    index: usize,
    module: M,
    engine: Fsdp,
    open: Option<StepParams>,
    backward_passes: u64,
    /// fp16's loss scaler.
    scaler: Option<GradScaler>,
    /// Whether the accumulated gradients were unscaled, and whether a rank found an
    /// overflow in them.
    found_inf: Option<bool>,
}

impl<M> PreparedModel<M> {
    pub(super) fn new(index: usize, module: M, engine: Fsdp, scaler: Option<GradScaler>) -> Self {
        PreparedModel {
            index,
            module,
            engine,
            open: None,
            backward_passes: 0,
            scaler,
            found_inf: None,
        }
    }

    /// The loss scaler (with `mixed_precision: fp16`).
    pub fn grad_scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    /// Unscales the accumulated gradients once per step; whether any rank found an overflow.
    fn unscale(&mut self) -> Result<bool, AcceleratorError> {
        if let Some(found) = self.found_inf {
            return Ok(found);
        }
        let Some(scaler) = self.scaler.as_ref() else {
            return Ok(false);
        };
        if self.engine.gradients().is_none() {
            return Ok(false);
        }
        let found = scaler.unscale(&mut self.engine)?;
        self.found_inf = Some(found);
        Ok(found)
    }

    /// The model itself (`unwrap_model`).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The model itself, writable (to set the step's dropout seed, say).
    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    /// The engine holding the shards (state by name, plans, memory estimates).
    pub fn engine(&self) -> &Fsdp {
        &self.engine
    }

    /// A training forward pass: `f(model, parameters)`. Units are gathered as it reads
    /// them; the pass stays open until the accelerator's `backward`.
    ///
    /// ```
    /// # use fsdp::accelerator::Accelerator;
    /// # use fsdp::models::{BertConfig, BertForSequenceClassification};
    /// # use fsdp::nn::SeededWeights;
    /// # use fsdp::nn::candle::{Device, Tensor};
    /// # use fsdp::optim::{AdamW, AdamWConfig};
    /// # fn main() -> anyhow::Result<()> {
    /// # let mut acc = Accelerator::new()?;
    /// # let config = BertConfig { vocab_size: 32, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 32, max_position_embeddings: 8, ..BertConfig::default() };
    /// # let mut model = acc.prepare_model(BertForSequenceClassification::new(config.clone())?, &SeededWeights(1))?;
    /// # let mut opt = acc.prepare_optimizer(AdamW::new(AdamWConfig::default())?)?;
    /// # let ids = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
    /// # let labels = Tensor::new(&[0u32, 1], &Device::Cpu)?;
    /// use fsdp::nn::ops::{CrossEntropy, cross_entropy};
    ///
    /// // The closure gets the model and the parameters FSDP gathered; it runs your forward.
    /// let loss = model.forward(|m, p| {
    ///     let logits = m.forward(p, &ids, None, None)?;
    ///     cross_entropy(&logits, &labels, CrossEntropy::default())
    /// })?;
    /// acc.backward(&mut model, loss)?;            // closes the pass, reduces the gradients
    /// acc.optimizer_step(&mut model, &mut opt)?;
    /// // Evaluation: no graph, nothing waits for a backward.
    /// let predicted = model.evaluate(|m, p| m.forward(p, &ids, None, None)?.argmax(1))?;
    /// assert_eq!(predicted.dims(), [2]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn forward<T>(
        &mut self,
        f: impl FnOnce(&M, &dyn Params) -> candle_core::Result<T>,
    ) -> Result<T, AcceleratorError> {
        if self.open.is_some() {
            return Err(AcceleratorError::CallOrder {
                model: self.index,
                problem: "a second forward before backward: call Accelerator::backward on the first loss, or evaluate()",
            });
        }
        let params = self.engine.begin_step()?;
        let out = f(&self.module, &params)?;
        self.open = Some(params);
        Ok(out)
    }

    /// An evaluation forward pass: no graph is recorded and nothing waits for a backward.
    pub fn evaluate<T>(
        &self,
        f: impl FnOnce(&M, &dyn Params) -> candle_core::Result<T>,
    ) -> Result<T, AcceleratorError> {
        self.refuse_open_forward()?;
        let params = self.engine.begin_eval(false)?;
        Ok(f(&self.module, &params)?)
    }

    /// [`PreparedModel::evaluate`] for many forward passes in one call (generation: one per
    /// token): each unit is gathered once, at its first forward, and held until `f` returns
    /// (the whole model on every rank meanwhile), instead of gathered again every pass.
    pub fn evaluate_gathered<T>(
        &self,
        f: impl FnOnce(&M, &dyn Params) -> candle_core::Result<T>,
    ) -> Result<T, AcceleratorError> {
        self.refuse_open_forward()?;
        let params = self.engine.begin_eval(true)?;
        Ok(f(&self.module, &params)?)
    }

    /// A call-order error while a training forward waits for its backward: the model's
    /// units are in that step until then.
    fn refuse_open_forward(&self) -> Result<(), AcceleratorError> {
        match self.open {
            Some(_) => Err(AcceleratorError::CallOrder {
                model: self.index,
                problem: "an evaluation while a training forward waits for its backward: call Accelerator::backward on its loss first",
            }),
            None => Ok(()),
        }
    }

    /// Backward of the open forward, its gradients accumulated by the engine: reduced
    /// (`sync`) or kept whole until the next backward with sync (`no_sync`); returns how many
    /// backward passes this model has had.
    pub(super) fn backward(&mut self, loss: Tensor, sync: bool) -> Result<u64, AcceleratorError> {
        let loss = match &self.scaler {
            Some(s) => s.scale_loss(&loss)?,
            None => loss,
        };
        let params = self
            .open
            .take()
            .ok_or_else(|| AcceleratorError::CallOrder {
                model: self.index,
                problem: "backward without a forward: run PreparedModel::forward first",
            })?;
        self.engine.backward(params, loss, sync)?;
        self.backward_passes += 1;
        Ok(self.backward_passes)
    }

    /// Backward passes so far.
    pub fn backward_passes(&self) -> u64 {
        self.backward_passes
    }

    pub(super) fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, AcceleratorError> {
        // fp16: clipping applies to the true gradients; an overflow skips the step anyway.
        if self.unscale()? {
            return Ok(f64::INFINITY);
        }
        self.require_gradients("clip_grad_norm without gradients: call backward first")?;
        let (norm, _) = self.engine.clip_grad_norm(Some(max_norm))?;
        Ok(norm)
    }

    /// A call-order error saying `problem` unless the engine holds gradients.
    fn require_gradients(&self, problem: &'static str) -> Result<(), AcceleratorError> {
        match self.engine.gradients() {
            Some(_) => Ok(()),
            None => Err(AcceleratorError::CallOrder {
                model: self.index,
                problem,
            }),
        }
    }

    /// The optimizer step on the accumulated gradients; false when fp16 loss scaling found
    /// an overflow on some rank and every rank skipped it (the scale backs off).
    pub(super) fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<bool, AcceleratorError> {
        self.require_gradients("an optimizer step without gradients: call backward first")?;
        let found_inf = self.unscale()?;
        self.found_inf = None;
        if let Some(s) = self.scaler.as_mut() {
            s.update(found_inf);
        }
        if found_inf {
            // Every rank skips the step; the overflowed gradients are dropped.
            self.engine.zero_grad();
            return Ok(false);
        }
        self.engine.step(optimizer)?;
        Ok(true)
    }

    /// Drops accumulated gradients (`optimizer.zero_grad()`).
    pub fn zero_grad(&mut self) {
        self.engine.zero_grad();
        self.found_inf = None;
    }

    /// This rank's accumulated gradients, by parameter name.
    pub fn gradients(&self) -> Option<&Gradients> {
        self.engine.gradients()
    }
}

/// A prepared model of any type, as checkpoints take them (several models of different
/// types in one call).
pub trait ModelHandle {
    /// The preparation order (model i pairs with optimizer i).
    fn index(&self) -> usize;
    /// The engine holding the shards.
    fn engine(&self) -> &Fsdp;
    /// The engine, writable (loading state).
    fn engine_mut(&mut self) -> &mut Fsdp;
    /// The fp16 loss scaler, whose state checkpoints keep.
    fn grad_scaler_mut(&mut self) -> Option<&mut GradScaler>;
    /// The fp16 loss scaler.
    fn scaler(&self) -> Option<&GradScaler>;
}

impl<M> ModelHandle for PreparedModel<M> {
    fn index(&self) -> usize {
        self.index
    }

    fn engine(&self) -> &Fsdp {
        &self.engine
    }

    fn engine_mut(&mut self) -> &mut Fsdp {
        &mut self.engine
    }

    fn grad_scaler_mut(&mut self) -> Option<&mut GradScaler> {
        self.scaler.as_mut()
    }

    fn scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }
}

/// An optimizer from [`super::Accelerator::prepare_optimizer`]: it updates the model
/// prepared in the same position, and steps its scheduler once per optimizer step.
pub struct PreparedOptimizer {
    index: usize,
    optimizer: Box<dyn Optimizer>,
    scheduler: Option<LrScheduler>,
}

impl PreparedOptimizer {
    pub(super) fn new(index: usize, optimizer: Box<dyn Optimizer>) -> Self {
        PreparedOptimizer {
            index,
            optimizer,
            scheduler: None,
        }
    }

    /// The preparation order (optimizer i updates model i).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The optimizer (its state by name, its groups' rates).
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// The optimizer, writable.
    pub fn optimizer_mut(&mut self) -> &mut dyn Optimizer {
        self.optimizer.as_mut()
    }

    /// The attached scheduler.
    pub fn scheduler(&self) -> Option<&LrScheduler> {
        self.scheduler.as_ref()
    }

    /// The learning rate of `group` for the next step.
    pub fn lr(&self, group: usize) -> f64 {
        self.optimizer.lr(group)
    }

    /// Every group's learning rate for the next step, in group order (what a tracker logs).
    pub fn lrs(&self) -> Vec<f64> {
        (0..self.optimizer.num_groups())
            .map(|g| self.optimizer.lr(g))
            .collect()
    }

    /// Attaches `schedule` (at step 0) and sets the first step's rates.
    pub(super) fn attach(&mut self, schedule: LrSchedule) -> Result<(), AcceleratorError> {
        let scheduler = LrScheduler::new(schedule);
        scheduler.start(self.optimizer.as_mut())?;
        self.scheduler = Some(scheduler);
        Ok(())
    }

    /// Replaces the scheduler's state (loading a checkpoint) and sets its rates.
    pub(super) fn restore_scheduler(&mut self, s: LrScheduler) -> Result<(), AcceleratorError> {
        s.start(self.optimizer.as_mut())?;
        self.scheduler = Some(s);
        Ok(())
    }

    /// Continues the attached scheduler from a PyTorch scheduler's state (`file`,
    /// `last_epoch`, `base_lrs` as the checkpoint reader gives them): PyTorch saves no
    /// schedule, only how far it went, so the schedule stays the one attached here and takes
    /// the step, once its base rates are checked to be the saved ones.
    pub(super) fn restore_pytorch_scheduler(
        &mut self,
        saved: &serde_json::Value,
    ) -> Result<(), AcceleratorError> {
        let file = saved["file"].as_str().unwrap_or("scheduler.bin");
        let Some(mut s) = self.scheduler.clone() else {
            return Err(AcceleratorError::PytorchSchedulerWithoutOurs {
                file: file.to_string(),
                optimizer: self.index,
            });
        };
        let base: Vec<f64> = saved["base_lrs"]
            .as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
        let ours: Vec<f64> = (0..self.optimizer.num_groups())
            .map(|g| self.optimizer.initial_lr(g))
            .collect();
        let same = base.len() == ours.len()
            && base
                .iter()
                .zip(&ours)
                .all(|(a, b)| (a - b).abs() <= 1e-12 * a.abs().max(b.abs()));
        if !same {
            return Err(AcceleratorError::PytorchSchedulerRates {
                file: file.to_string(),
                optimizer: self.index,
                base,
                ours,
            });
        }
        s.steps = saved["last_epoch"].as_u64().unwrap_or(0);
        self.restore_scheduler(s)
    }

    /// One optimizer step of `model`, then one scheduler step; false (neither stepped) when
    /// loss scaling skipped the step.
    pub(super) fn step<M>(
        &mut self,
        model: &mut PreparedModel<M>,
    ) -> Result<bool, AcceleratorError> {
        if model.index != self.index {
            return Err(AcceleratorError::OptimizerOfAnotherModel {
                optimizer: self.index,
                model: model.index,
            });
        }
        if !model.step(self.optimizer.as_mut())? {
            return Ok(false);
        }
        if let Some(s) = self.scheduler.as_mut() {
            s.step(self.optimizer.as_mut())?;
        }
        Ok(true)
    }
}
