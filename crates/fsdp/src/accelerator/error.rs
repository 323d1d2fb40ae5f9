//! [`AcceleratorError`]: why the accelerator stopped — a refused configuration, a failed
//! collective, the engine's, optimizer's or checkpoint's error, or a call made out of order,
//! each naming what to do.

use std::path::PathBuf;

use fsdp_comm::CommError;

use crate::checkpoint::CheckpointError;
use crate::config::ConfigError;
use crate::engine::EngineError;
use crate::optim::OptimError;

/// Why the accelerator stopped.
#[derive(Debug, thiserror::Error)]
pub enum AcceleratorError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Joining the job or a collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The engine refused.
    #[error(transparent)]
    Engine(Box<EngineError>),
    /// The optimizer refused.
    #[error(transparent)]
    Optimizer(#[from] OptimError),
    /// A checkpoint could not be saved or loaded.
    #[error(transparent)]
    Checkpoint(Box<CheckpointError>),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    /// The GPU this process is to compute on cannot be used.
    #[error(transparent)]
    Device(#[from] crate::nn::device::DeviceError),
    /// A call out of order for model `model` (a second forward before backward, backward
    /// without a forward, a step without gradients).
    #[error("model {model}: {problem}")]
    CallOrder {
        /// The prepared model's index.
        model: usize,
        /// What was called out of order, and what to do.
        problem: &'static str,
    },
    /// Models or optimizers passed in another order than they were prepared in.
    #[error(
        "{what} {index} given in position {position}: pass every prepared {what} in the order they were prepared"
    )]
    OutOfOrder {
        /// `model` or `optimizer`.
        what: &'static str,
        /// Its index (the order of prepare).
        index: usize,
        /// Where it was given.
        position: usize,
    },
    /// More optimizers than models given to a checkpoint call.
    #[error("{optimizers} optimizers for {models} models: optimizer i updates model i")]
    OptimizersWithoutModels {
        /// Optimizers given.
        optimizers: usize,
        /// Models given.
        models: usize,
    },
    /// An optimizer prepared before its model.
    #[error(
        "optimizer {index} has no model: {models} model(s) prepared, and optimizer i updates model i (prepare the model first)"
    )]
    OptimizerBeforeModel {
        /// The optimizer's index.
        index: usize,
        /// Models prepared so far.
        models: usize,
    },
    /// An optimizer stepping another model than the one it was prepared for.
    #[error(
        "optimizer {optimizer} was prepared for model {optimizer} (models and optimizers pair by the order of prepare, as in Accelerate) but is stepping model {model}"
    )]
    OptimizerOfAnotherModel {
        /// The optimizer's index.
        optimizer: usize,
        /// The model it was asked to step.
        model: usize,
    },
    /// `save_state(None, ..)` without automatic checkpoint naming.
    #[error(
        "save_state(None, ..) needs ProjectConfiguration {{ automatic_checkpoint_naming: true, .. }}"
    )]
    NoCheckpointDir,
    /// `FullStateDictConfig { rank0_only: false }`, which fsdp-rs does not do.
    #[error(
        "FullStateDictConfig {{ rank0_only: false }}: fsdp-rs gathers full state dicts onto rank 0 only (every rank holding the whole model is what it avoids)"
    )]
    FullStateDictOnEveryRank,
    /// The launch environment (`RANK`, `WORLD_SIZE`, ...) is incomplete or contradictory.
    #[error("the launch environment: {0}")]
    LaunchEnvironment(fsdp_comm::WorldError),
    /// `gather_tensor` of a scalar.
    #[error("gather_tensor: a scalar has no dimension 0 to concatenate along; reshape it to [1]")]
    GatherScalar,
    /// `gather_tensor` of tensors whose shapes differ between ranks.
    #[error(
        "gather_tensor: rank {rank} has a tensor of shape {dims:?}, rank(s) {differing:?} of another shape; every rank must pass the same shape"
    )]
    GatherShapes {
        /// This rank.
        rank: usize,
        /// Its tensor's shape.
        dims: Vec<usize>,
        /// The ranks whose shape differs.
        differing: Vec<usize>,
    },
    /// `gather_tensor` of a dtype it does not gather.
    #[error(
        "gather_tensor: {dtype:?} tensors are not gathered; convert to a dtype the engine computes in (to_dtype)"
    )]
    GatherDtype {
        /// The tensor's dtype.
        dtype: candle_core::DType,
    },
    /// `backward_sum` with no label token in the whole step.
    #[error("backward_sum: num_items_in_batch is 0 (no label token in the whole step)")]
    NoItemsInBatch,
    /// What rank 0 looked up for every rank failed there.
    #[error("{what} (rank 0): {message}")]
    OnRank0 {
        /// What it looked for.
        what: String,
        /// Its error.
        message: String,
    },
    /// A scheduler's state or rank 0's answer could not be written or read as JSON.
    #[error("{what}: {source}")]
    Json {
        /// What it was.
        what: String,
        /// The serialiser's error.
        source: serde_json::Error,
    },
    /// A checkpoint's schedule cannot continue as the run's (another `LambdaLR` name, ...).
    #[error("{}: {reason}", dir.display())]
    SchedulerResume {
        /// The checkpoint.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// An optimizer with a scheduler and a checkpoint without one for it, or the reverse.
    #[error(
        "optimizer {optimizer} {} a scheduler but the checkpoint {} one for it",
        if *ours { "has" } else { "has no" },
        if *saved { "holds" } else { "holds none" }
    )]
    SchedulerPresence {
        /// The optimizer's index.
        optimizer: usize,
        /// Whether the run's optimizer has a scheduler.
        ours: bool,
        /// Whether the checkpoint holds one for it.
        saved: bool,
    },
    /// An Accelerate checkpoint's `scheduler.bin` for an optimizer without a scheduler.
    #[error(
        "{file} holds a learning-rate scheduler for optimizer {optimizer}, which has none: attach the run's schedule with `Accelerator::prepare_scheduler` before loading"
    )]
    PytorchSchedulerWithoutOurs {
        /// The scheduler's file.
        file: String,
        /// The optimizer's index.
        optimizer: usize,
    },
    /// An Accelerate checkpoint's scheduler whose base rates are not the optimizer's.
    #[error(
        "{file}: the scheduler's base_lrs {base:?} are not optimizer {optimizer}'s initial rates {ours:?}"
    )]
    PytorchSchedulerRates {
        /// The scheduler's file.
        file: String,
        /// The optimizer's index.
        optimizer: usize,
        /// The saved base rates.
        base: Vec<f64>,
        /// The optimizer's initial rates.
        ours: Vec<f64>,
    },
    /// A new run's output folder holds an earlier run's model or checkpoints
    /// ([`Accelerator::claim_output_dir`](super::Accelerator::claim_output_dir)).
    #[error(
        "{}: holds an earlier run's outputs ({}); a new run would replace its model, and resuming `latest` could pick its checkpoints: overwrite them (the examples' `--overwrite_output_dir`, after the `--` that ends fsdp launch's own flags: `fsdp launch ... --example NAME -- --overwrite_output_dir`), resume that run, or choose another output folder",
        dir.display(),
        found.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    OutputDirInUse {
        /// The output folder.
        dir: PathBuf,
        /// What is in it.
        found: Vec<PathBuf>,
    },
    /// Optimizer step `step`'s gradients hold a NaN or inf on some rank: nothing was updated.
    #[error(
        "optimizer step {step}: the gradient of `{name}` is not finite (NaN or inf) on some rank, so the step was not taken and the weights stay finite: the loss diverged, or the inputs or weights hold non-finite values (lower the learning rate, check the data; AcceleratorBuilder::skip_non_finite_steps skips such steps instead)"
    )]
    NonFiniteGradient {
        /// The step that would have been taken (1 for the first).
        step: u64,
        /// The first parameter, in the plan's order, with a non-finite gradient.
        name: String,
    },
    /// Another run holds the output folder
    /// ([`Accelerator::lock_output_dir`](super::Accelerator::lock_output_dir)).
    #[error("{}: {reason}", dir.display())]
    OutputDirLocked {
        /// The output folder.
        dir: PathBuf,
        /// Who holds it, or what failed.
        reason: String,
    },
    /// Writing logs or metrics failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
}

impl AcceleratorError {
    /// A JSON (de)serialisation failure of `what`.
    pub(crate) fn json(what: impl Into<String>, source: serde_json::Error) -> Self {
        AcceleratorError::Json {
            what: what.into(),
            source,
        }
    }
}

impl From<EngineError> for AcceleratorError {
    fn from(e: EngineError) -> Self {
        AcceleratorError::Engine(Box::new(e))
    }
}

impl From<CheckpointError> for AcceleratorError {
    fn from(e: CheckpointError) -> Self {
        AcceleratorError::Checkpoint(Box::new(e))
    }
}
