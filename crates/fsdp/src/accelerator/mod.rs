//! [`Accelerator`]: what a training program written for Accelerate expects — the process's
//! place in the job, `prepare` for models, optimizers, schedulers and data loaders,
//! `backward` with gradient accumulation, global-norm clipping, an optimizer step that counts
//! once per optimizer step, metrics gathered without duplicated samples, checkpoints, and
//! progress and logs — over the FSDP engine, with no process group in sight.
//!
//! ```no_run
//! use fsdp::accelerator::Accelerator;
//! use fsdp::data::{DataLoader, TextExample, TextTokenizer, collate};
//! use fsdp::models::{BertConfig, BertForSequenceClassification};
//! use fsdp::nn::{LocalParams, Module};
//! use fsdp::nn::candle::{DType, Device};
//! use fsdp::nn::ops::{CrossEntropy, cross_entropy};
//! use fsdp::optim::{AdamW, AdamWConfig, LrSchedule, is_bias_or_norm, split_no_decay};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // Under `fsdp launch` this reads the job and the FSDP configuration from the environment;
//! // alone, it is a job of one process.
//! let mut acc = Accelerator::new()?;
//! let model = BertForSequenceClassification::new(BertConfig::default())?;
//! let weights = LocalParams::init(&model.info(), 42, DType::F32, &Device::Cpu)?.tensors();
//! let names: Vec<String> = weights.keys().cloned().collect();
//! let mut model = acc.prepare_model(model, &weights)?;
//! let adamw = AdamW::with_groups(split_no_decay(names, AdamWConfig::default(), is_bias_or_norm))?;
//! let mut optimizer = acc.prepare_optimizer(adamw)?;
//! acc.prepare_scheduler(&mut optimizer, LrSchedule::Linear { warmup: 10, total: 100 })?;
//!
//! let tokenizer = TextTokenizer::from_file("tokenizer.json".as_ref(), Some(128))?;
//! let examples = vec![TextExample { text: "a fine film".into(), pair: None, label: 1 }];
//! let loader = DataLoader::new(examples, 16, move |ex: &[TextExample]| collate(&tokenizer, ex, &Device::Cpu))
//!     .shuffle(42);
//! let mut loader = acc.prepare_data_loader(loader);   // this rank's share of every step
//! for epoch in 0..3 {
//!     loader.set_epoch(epoch);
//!     while let Some(batch) = loader.next_batch() {
//!         let b = batch?.batch;
//!         let logits = model.forward(|m, p| {
//!             m.forward(p, &b.inputs.input_ids, Some(&b.inputs.attention_mask), Some(&b.inputs.token_type_ids))
//!         })?;
//!         let loss = cross_entropy(&logits, &b.labels, CrossEntropy::default())?;
//!         acc.backward(&mut model, loss)?;
//!         if acc.sync_gradients() {
//!             acc.clip_grad_norm(&mut model, 1.0)?;
//!         }
//!         acc.optimizer_step(&mut model, &mut optimizer)?;   // steps the scheduler once
//!     }
//! }
//! # Ok(()) }
//! ```

mod builder;
mod checkpoints;
mod device;
mod error;
mod gather;
mod logging;
mod mfu;
mod mlflow;
mod output_lock;
mod prepared;
mod tensorboard;
mod tracking;

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::Tensor;
/// What `reduce` takes (f32, f64, i32, i64, u8, f16, bf16; `gather` takes more, see
/// [`Gatherable`]) and how it combines, re-exported so programs need not depend on fsdp-comm.
pub use fsdp_comm::{BufferElement, ReduceOp};
use fsdp_comm::{Communicator, CommunicatorExt};

/// The global allocator a training program may install (large allocations in mappings of
/// their own, kept for reuse only below the resident peak; live bytes counted) and the
/// memory figures a program reports: here so that a program imports them from the
/// `accelerator`, as Accelerate's memory utilities are its own.
pub use crate::memory::{HeapTrainingAllocator, TrainingAllocator, peak_rss_bytes, resident_bytes};
pub use builder::{AcceleratorBuilder, FullStateDictConfig, ProjectConfiguration};
pub use error::AcceleratorError;
pub use gather::Gatherable;
pub use logging::{Progress, init_logging};
pub use mfu::MfuLine;
pub use prepared::{ModelHandle, PreparedModel, PreparedOptimizer};
pub use tracking::{Tracker, run_name_now};

use crate::config::{FsdpPlugin, MixedPrecision};
use crate::data::{DataLoader, Dataset};
use crate::engine::{Fsdp, GradScaler, GradScalerConfig};
use crate::nn::{Model, WeightSource};
use crate::optim::{LrSchedule, Optimizer};

/// The process's view of a training job (see the module docs).
pub struct Accelerator {
    group: Arc<dyn Communicator>,
    /// Which attempt of the job this is (0: the first).
    restart_count: u32,
    plugin: FsdpPlugin,
    local_rank: usize,
    /// Where this process computes (`use_cpu`, the local rank's GPU).
    device: candle_core::Device,
    accumulation: usize,
    sync_each_batch: bool,
    grad_scaler: GradScalerConfig,
    models: usize,
    optimizers: usize,
    sync: bool,
    /// The last optimizer step was skipped (fp16 overflow, or non-finite gradients skipped).
    skipped: bool,
    /// Skip steps with non-finite gradients instead of failing.
    skip_non_finite_steps: bool,
    steps: u64,
    project: ProjectConfiguration,
    trackers: Vec<Tracker>,
    /// The run's open trackers (main process, after `init_trackers` or the first `log`).
    active_trackers: std::sync::Mutex<Option<tracking::ActiveTrackers>>,
    seed: u64,
    /// The asynchronous save being written, if any (waited for by the next save or load).
    pending_save: std::sync::Mutex<Option<crate::checkpoint::PendingSave>>,
    /// The output folder this run holds (main process, after `lock_output_dir`).
    output_lock: std::sync::Mutex<Option<output_lock::OutputLock>>,
}

impl Accelerator {
    /// The job and configuration from the environment (`fsdp launch`), or one process.
    pub fn new() -> Result<Accelerator, AcceleratorError> {
        AcceleratorBuilder::default().build()
    }

    /// Settings in code.
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    /// The FSDP settings in force.
    pub fn plugin(&self) -> &FsdpPlugin {
        &self.plugin
    }

    /// Which attempt of the job this process belongs to: 0 for the first, counting up with
    /// each restart after a failure (`fsdp launch --max_restarts`; torchrun's and SLURM's
    /// counts too). A program resumes from [`Accelerator::latest_checkpoint`] either way;
    /// this says whether it is resuming after a crash.
    pub fn restart_count(&self) -> u32 {
        self.restart_count
    }

    /// This process's rank.
    pub fn process_index(&self) -> usize {
        self.group.rank()
    }

    /// This process's rank on its machine.
    pub fn local_process_index(&self) -> usize {
        self.local_rank
    }

    /// The device this process computes on, as Accelerate's `accelerator.device`: the CPU
    /// with `use_cpu: true`; otherwise its local rank's GPU where the build (feature `cuda`)
    /// and the machine can open one, else the CPU. Prepared models compute there; put each
    /// batch there too.
    pub fn device(&self) -> &candle_core::Device {
        &self.device
    }

    /// Processes in the job.
    pub fn num_processes(&self) -> usize {
        self.group.size()
    }

    /// Whether this is rank 0.
    pub fn is_main_process(&self) -> bool {
        self.process_index() == 0
    }

    /// Whether this is rank 0 of its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }

    /// Prints on the main process only. Standard output closed early (a pipe into `head`)
    /// loses the line instead of ending the program.
    pub fn print(&self, text: impl std::fmt::Display) {
        if self.is_main_process() {
            use std::io::Write;
            let _ = writeln!(std::io::stdout().lock(), "{text}");
        }
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.steps
    }

    /// The run's seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Backward passes per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.accumulation
    }

    /// Shards `model` (its `initial` weights, identical on every rank or broadcast from
    /// rank 0 with `fsdp_sync_module_states`; read on rank 0 only, a unit at a time, with
    /// `fsdp_cpu_ram_efficient_loading` — pass a [`crate::nn::SafetensorsWeights`] so the
    /// other ranks never read the file) over the job per the configuration. Models
    /// are numbered in the order they are prepared; optimizer i updates model i.
    pub fn prepare_model<M: Model>(
        &mut self,
        model: M,
        initial: &dyn WeightSource,
    ) -> Result<PreparedModel<M>, AcceleratorError> {
        let placed = device::PlacedWeights {
            source: initial,
            device: self.device.clone(),
        };
        let engine = Fsdp::wrap(&model, &placed, &self.plugin, self.group.clone())?;
        // fp16 needs its loss scaled; bf16 has f32's range.
        let scaler = match self.plugin.mixed_precision {
            MixedPrecision::Fp16 => Some(GradScaler::new(self.grad_scaler)?),
            _ => None,
        };
        self.models += 1;
        Ok(PreparedModel::new(self.models - 1, model, engine, scaler))
    }

    /// Takes `optimizer` for the model prepared in the same position (the first optimizer
    /// for the first model, ...); an error when that model has not been prepared.
    pub fn prepare_optimizer(
        &mut self,
        optimizer: impl Optimizer + 'static,
    ) -> Result<PreparedOptimizer, AcceleratorError> {
        let index = self.optimizers;
        if index >= self.models {
            return Err(AcceleratorError::OptimizerBeforeModel {
                index,
                models: self.models,
            });
        }
        self.optimizers += 1;
        Ok(PreparedOptimizer::new(index, Box::new(optimizer)))
    }

    /// Attaches a learning-rate schedule to `optimizer`: it sets the rates before the first
    /// step and moves once per optimizer step (never once per process or per micro-batch).
    pub fn prepare_scheduler(
        &self,
        optimizer: &mut PreparedOptimizer,
        schedule: LrSchedule,
    ) -> Result<(), AcceleratorError> {
        optimizer.attach(schedule)
    }

    /// Gives `loader` this rank's share of every step.
    pub fn prepare_data_loader<D: Dataset, B>(&self, loader: DataLoader<D, B>) -> DataLoader<D, B> {
        loader.shard(self.process_index(), self.num_processes())
    }

    /// The model inside a prepared one.
    pub fn unwrap_model<'a, M>(&self, model: &'a PreparedModel<M>) -> &'a M {
        model.module()
    }

    /// Back-propagates `loss` through `model`'s open forward (scaled by 1/accumulation
    /// steps). The last micro-batch of an accumulation reduces the gradients; the others keep
    /// whole local gradients for it (`no_sync`), or reduce and add theirs too with
    /// [`AcceleratorBuilder::sync_each_batch`].
    pub fn backward<M>(
        &mut self,
        model: &mut PreparedModel<M>,
        loss: Tensor,
    ) -> Result<(), AcceleratorError> {
        let loss = if self.accumulation > 1 {
            (loss / self.accumulation as f64)?
        } else {
            loss
        };
        let boundary = (model.backward_passes() + 1).is_multiple_of(self.accumulation as u64);
        let passes = model.backward(loss, boundary || self.sync_each_batch)?;
        self.sync = passes % self.accumulation as u64 == 0;
        Ok(())
    }

    /// transformers' `num_items_in_batch`: `local`, this rank's label tokens in every
    /// micro-batch of the coming optimizer step ([`crate::models::causal_lm_label_count`]
    /// summed), summed over the ranks (collective).
    pub fn num_items_in_batch(&self, local: u64) -> Result<u64, AcceleratorError> {
        let sum = self
            .group
            .all_reduce_vec(vec![local as i64], ReduceOp::Sum)
            .wait()?;
        Ok(sum.first().copied().unwrap_or(0).max(0) as u64)
    }

    /// Backward of a micro-batch's loss summed over its label tokens
    /// (`LlamaForCausalLM::forward_loss_sum`), normalised as transformers does with
    /// `num_items_in_batch` and `average_tokens_across_devices`: the step's gradient is the
    /// sum of every token's over all micro-batches and ranks divided by `num_items_in_batch`
    /// ([`Accelerator::num_items_in_batch`]), the single-process mean over the global batch
    /// whatever the padding of each rank and micro-batch. (A mean per micro-batch averaged
    /// over micro-batches and ranks, what [`Accelerator::backward`] of a mean gives, weighs
    /// a token of a short batch more.) A count of 0 is an error: nothing to normalise by.
    pub fn backward_sum<M>(
        &mut self,
        model: &mut PreparedModel<M>,
        loss_sum: Tensor,
        num_items_in_batch: u64,
    ) -> Result<(), AcceleratorError> {
        if num_items_in_batch == 0 {
            return Err(AcceleratorError::NoItemsInBatch);
        }
        // Gradients are averaged over the ranks and `backward` divides by the accumulation
        // steps: undo both, leaving one division by the step's token count.
        let scale = (self.num_processes() * self.accumulation) as f64 / num_items_in_batch as f64;
        self.backward(model, (loss_sum * scale)?)
    }

    /// Whether the last optimizer step was skipped because fp16 loss scaling found an
    /// overflow (as Accelerate's `optimizer_step_was_skipped`).
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.skipped
    }

    /// Whether the last backward pass ended an accumulation: the optimizer steps now.
    pub fn sync_gradients(&self) -> bool {
        self.sync
    }

    /// Clips `model`'s accumulated gradients by their global norm (over every rank); returns
    /// the norm before clipping.
    pub fn clip_grad_norm<M>(
        &self,
        model: &mut PreparedModel<M>,
        max_norm: f64,
    ) -> Result<f64, AcceleratorError> {
        model.clip_grad_norm(max_norm)
    }

    /// Updates `model` with its `optimizer` (and steps the optimizer's scheduler once) when
    /// `model`'s accumulation is complete; a no-op returning false in the middle of one, and
    /// false when fp16 loss scaling found an overflow on some rank and every rank skipped the
    /// step ([`Accelerator::optimizer_step_was_skipped`]). Gradients with a NaN or inf on
    /// some rank are [`AcceleratorError::NonFiniteGradient`] on every rank, nothing updated
    /// (or a skipped step with `AcceleratorBuilder::skip_non_finite_steps`).
    pub fn optimizer_step<M>(
        &mut self,
        model: &mut PreparedModel<M>,
        optimizer: &mut PreparedOptimizer,
    ) -> Result<bool, AcceleratorError> {
        if !model
            .backward_passes()
            .is_multiple_of(self.accumulation as u64)
        {
            return Ok(false);
        }
        let stepped = match optimizer.step(model) {
            Ok(stepped) => stepped,
            Err(AcceleratorError::Engine(e)) => match *e {
                crate::engine::EngineError::NonFiniteGradient { name } => {
                    let step = self.steps + 1;
                    if !self.skip_non_finite_steps {
                        return Err(AcceleratorError::NonFiniteGradient { step, name });
                    }
                    tracing::warn!(
                        "optimizer step {step} skipped: the gradient of `{name}` is not finite"
                    );
                    false
                }
                other => return Err(AcceleratorError::Engine(Box::new(other))),
            },
            Err(e) => return Err(e),
        };
        self.skipped = !stepped;
        if stepped && model.index() == 0 {
            self.steps += 1;
        }
        Ok(stepped)
    }

    /// Element-wise reduction of `values` over the ranks.
    pub fn reduce<T: BufferElement>(
        &self,
        values: Vec<T>,
        op: ReduceOp,
    ) -> Result<Vec<T>, AcceleratorError> {
        Ok(self.group.all_reduce_vec(values, op).wait()?)
    }

    /// Returns when every rank has reached it.
    pub fn wait_for_everyone(&self) -> Result<(), AcceleratorError> {
        Ok(self.group.barrier().wait()?)
    }

    /// A progress bar on the main process (hidden on the others).
    pub fn progress(&self, total: u64, what: &str) -> Progress {
        Progress::new(self.is_main_process(), total, what)
    }

    /// Opens the trackers (`log_with`) in a new folder `project_dir/run_name` on the main
    /// process (Accelerate's `init_trackers`), writing `config` (the run's settings; null
    /// for none) as `config.json` and as TensorBoard text. Returns the run's folder: when
    /// `run_name` exists already (another run of the same name, or started in the same
    /// second), `run_name_2`, `run_name_3`, ... — two runs never share one, and on the
    /// main process only the returned name is the folder written. Without it the first
    /// [`Accelerator::log`] opens them in the project folder itself.
    pub fn init_trackers(
        &self,
        run_name: &str,
        config: serde_json::Value,
    ) -> Result<PathBuf, AcceleratorError> {
        let dir = self.project.project_dir.join(run_name);
        if self.trackers.is_empty() || !self.is_main_process() {
            return Ok(dir);
        }
        let dir = tracking::new_folder(&dir).map_err(|source| AcceleratorError::Io {
            path: dir.clone(),
            source,
        })?;
        let opened = tracking::ActiveTrackers::open(
            &self.project.project_dir,
            &dir,
            &self.trackers,
            &config,
        )
        .map_err(|(path, source)| AcceleratorError::Io { path, source })?;
        *self
            .active_trackers
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(opened);
        Ok(dir)
    }

    /// Writes `metrics` (a JSON object; nested numbers become `a/b` scalars in TensorBoard)
    /// at the current optimizer step to every tracker, on the main process.
    pub fn log(&self, metrics: serde_json::Value) -> Result<(), AcceleratorError> {
        if self.trackers.is_empty() || !self.is_main_process() {
            return Ok(());
        }
        let mut active = self
            .active_trackers
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if active.is_none() {
            let dir = &self.project.project_dir;
            *active = Some(
                tracking::ActiveTrackers::open(dir, dir, &self.trackers, &serde_json::Value::Null)
                    .map_err(|(path, source)| AcceleratorError::Io { path, source })?,
            );
        }
        match active.as_mut() {
            Some(t) => t
                .log(self.steps, &metrics)
                .map_err(|(path, source)| AcceleratorError::Io { path, source }),
            None => Ok(()),
        }
    }

    /// Closes the trackers (Accelerate's `end_training`), marking MLflow's run finished;
    /// the run's folder, when open. A run whose trackers are dropped without it (the program
    /// failed) is marked failed in MLflow.
    pub fn end_training(&self) -> Result<Option<PathBuf>, AcceleratorError> {
        let mut active = self
            .active_trackers
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match active.take() {
            Some(mut t) => {
                t.finish()
                    .map_err(|(path, source)| AcceleratorError::Io { path, source })?;
                Ok(Some(t.dir().to_path_buf()))
            }
            None => Ok(None),
        }
    }
}

/// This machine's name, where the system says it (event file names, the output lock's
/// holder).
fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
}
