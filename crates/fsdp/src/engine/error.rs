//! [`EngineError`]: why the FSDP engine stopped, as structured variants naming the
//! parameter, the unit, the collective and the rank involved.

use fsdp_comm::CommError;

use super::plan::PlanError;
use crate::optim::OptimError;

/// Why the engine stopped.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The unit plan could not be built.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A collective outside a unit's lifecycle failed (names the rank and the op).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A unit's gather or gradient reduction failed.
    #[error("{op} of {unit}: {source}")]
    Collective {
        /// What the unit was doing (`all-gather before its forward`, ...).
        op: String,
        /// The unit (`unit `bert.encoder.layer.3``, `the root unit`).
        unit: String,
        /// The communication error (names the ranks).
        source: CommError,
    },
    /// Offloaded state could not be written or read (names the file and the bytes).
    #[error(transparent)]
    Offload(#[from] super::OffloadError),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    /// An initial weight could not be had (missing, wrong shape, unreadable file).
    #[error("initial weights: parameter `{name}`: {problem}")]
    InitialWeight {
        /// The parameter.
        name: String,
        /// What went wrong (naming the file where there is one).
        problem: String,
    },
    /// A parameter was read when its unit does not hold it gathered.
    #[error(
        "parameter `{param}` was read while {unit} is {state}: a parameter may only be used inside its own unit (tied weights must share a unit)"
    )]
    ReadOutsideUnit {
        /// The parameter.
        param: String,
        /// Its unit.
        unit: String,
        /// The unit's state.
        state: &'static str,
    },
    /// A gradient reached a parameter whose unit had already been released or reduced.
    #[error(
        "gradient of `{param}` arrived while {unit} is {state}: the parameter was used outside its unit"
    )]
    GradientOutsideUnit {
        /// The parameter.
        param: String,
        /// Its unit.
        unit: String,
        /// The unit's state.
        state: &'static str,
    },
    /// A unit released after its forward never reported its output, so nothing would
    /// refill it before its backward.
    #[error(
        "{unit} (gathered in forward) never passed its output through Params::module_output, so it cannot be released and refilled; run the module with Forward::call"
    )]
    UnhookedOutput {
        /// The unit.
        unit: String,
    },
    /// A parameter reaches the loss through another path than its unit's output.
    #[error(
        "parameter `{param}` of {unit} reaches the loss without going through the unit's output: it is used outside its unit (wrap or tie the modules so that it is used inside one unit)"
    )]
    UsedOutsideUnit {
        /// The parameter.
        param: String,
        /// Its unit.
        unit: String,
    },
    /// Debug mode: the loss is not finite because released (NaN-poisoned) parameters were
    /// read after their unit's forward.
    #[error(
        "the loss is not finite because a released parameter was read after its unit's forward (debug mode poisons released parameters with NaN): {params} used outside its unit"
    )]
    ReleasedParameterRead {
        /// The parameters and their units.
        params: String,
    },
    /// Activation checkpointing ran a unit whose forward read none of its parameters.
    #[error(
        "activation checkpointing: the forward of {unit} read none of its parameters, so there is nothing to recompute it against"
    )]
    CheckpointWithoutParameters {
        /// The unit.
        unit: String,
    },
    /// A graph op of a step ran after the step ended.
    #[error("fsdp: backward ran after its step ended")]
    StepEnded,
    /// The units are in a step whose parameters are still held (a forward not yet through
    /// its backward, or an evaluation's parameters not dropped): a step begins, and the
    /// shards change, only when none is open.
    #[error(
        "{op} while a step is open: finish the open forward with backward, or drop its parameters, first"
    )]
    StepOpen {
        /// What was refused (`begin a step`, `the optimizer step`, ...).
        op: &'static str,
    },
    /// A name that is no parameter of the model.
    #[error("unknown parameter `{name}`")]
    UnknownParameter {
        /// The name.
        name: String,
    },
    /// A tensor the engine's CPU kernels cannot take.
    #[error("{op}: {what} is {found}; the engine runs {expected}")]
    UnsupportedTensor {
        /// The operation.
        op: &'static str,
        /// Which tensor.
        what: String,
        /// Its dtype and device.
        found: String,
        /// What is supported.
        expected: &'static str,
    },
    /// Values given for a parameter's rows do not fit.
    #[error("parameter `{name}`: {problem}")]
    State {
        /// The parameter.
        name: String,
        /// What does not fit.
        problem: String,
    },
    /// The optimizer refused an update or its settings.
    #[error("optimizer: {0}")]
    Optimizer(#[from] OptimError),
    /// The timeline's folder (`fsdp_trace_dir`) cannot take this rank's file.
    #[error("fsdp_trace_dir `{}`: {source}", dir.display())]
    Trace {
        /// The folder.
        dir: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A step's gradients hold a NaN or inf on some rank: no weight was updated.
    #[error(
        "the gradient of `{name}` is not finite (NaN or inf) on some rank: the optimizer step was not taken, so the weights stay finite; the loss diverged or the inputs or weights hold non-finite values"
    )]
    NonFiniteGradient {
        /// The first such parameter in the plan's order.
        name: String,
    },
    /// A gradient operation with no gradient held: no backward with sync since the last
    /// step or `zero_grad`.
    #[error("{op} without gradients: call backward (with sync) first")]
    NoGradients {
        /// The operation (`step`, `clip_grad_norm`, `unscale`).
        op: &'static str,
    },
    /// A setting that cannot work with the rest of the configuration or the job.
    #[error("`{key}: {value}` {reason}")]
    Setting {
        /// The configuration key.
        key: &'static str,
        /// Its value.
        value: String,
        /// Why it cannot work, and what to do instead.
        reason: String,
    },
    /// A configured feature this engine does not provide yet: refused rather than ignored.
    #[error("{setting} is not supported by the FSDP engine yet; {hint}")]
    Unsupported {
        /// The setting as configured.
        setting: String,
        /// What to do instead.
        hint: &'static str,
    },
}

/// `the root unit` or ``unit `path` ``, for messages.
pub(crate) fn unit_name(path: &str) -> String {
    if path.is_empty() {
        "the root unit".into()
    } else {
        format!("unit `{path}`")
    }
}
