//! Optimizers that run on flat f32 slices — a whole parameter in one process, or one rank's
//! rows of it under FSDP — with state kept per parameter name (PyTorch's state names), so it
//! can be checkpointed and resharded by name.
//!
//! [`Optimizer`] is what the engine calls: one `update` per parameter and step. Most
//! optimizers are an [`UpdateRule`] (AdamW, Adam, SGD here, or your own) inside [`Grouped`],
//! which adds parameter groups with their own settings, learning rates a schedule can set,
//! and the per-parameter state.

pub mod adamw;
pub mod groups;
mod kernels;
pub mod schedule;
pub mod sgd;

use std::collections::BTreeMap;

pub use adamw::{AdamConfig, AdamWConfig};
pub use groups::{
    Grouped, NORM_AND_EMBEDDING_MODULES, NORM_MODULES, ParamGroup, is_bias_or_norm,
    no_decay_by_module, split_no_decay,
};
pub use schedule::{LambdaSchedule, LrSchedule, LrScheduler};
pub use sgd::SgdConfig;

/// `torch.optim.AdamW` with parameter groups.
///
/// ```
/// use fsdp::optim::{AdamW, AdamWConfig, is_bias_or_norm, split_no_decay};
///
/// // One group: `torch.optim.AdamW(model.parameters(), lr=1e-3)`.
/// let single = AdamW::new(AdamWConfig { lr: 1e-3, ..AdamWConfig::default() })?;
/// // Two: no weight decay on biases and LayerNorm weights, as fine-tuning recipes do.
/// let names = ["bert.pooler.dense.weight", "bert.pooler.dense.bias"].map(String::from);
/// let grouped = AdamW::with_groups(split_no_decay(names, AdamWConfig::default(), is_bias_or_norm))?;
/// assert_eq!(grouped.groups().len(), 2);
/// # Ok::<(), fsdp::optim::OptimError>(())
/// ```
pub type AdamW = Grouped<AdamWConfig>;
/// `torch.optim.Adam` with parameter groups.
pub type Adam = Grouped<AdamConfig>;
/// `torch.optim.SGD` with parameter groups.
pub type Sgd = Grouped<SgdConfig>;

/// Why an optimizer could not update or load state.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimError {
    /// A group's settings are invalid (as PyTorch's constructors check them).
    #[error("{optimizer} parameter group {group}: {reason}")]
    InvalidSetting {
        /// The optimizer.
        optimizer: &'static str,
        /// The group index.
        group: usize,
        /// What is wrong.
        reason: String,
    },
    /// A parameter belongs to no group.
    #[error("{optimizer}: parameter `{param}` is in no parameter group")]
    NotInAnyGroup {
        /// The optimizer.
        optimizer: &'static str,
        /// The parameter.
        param: String,
    },
    /// A parameter is listed in two groups.
    #[error("{optimizer}: parameter `{param}` is in parameter groups {first} and {second}")]
    InTwoGroups {
        /// The optimizer.
        optimizer: &'static str,
        /// The parameter.
        param: String,
        /// One group.
        first: usize,
        /// The other.
        second: usize,
    },
    /// A parameter and its gradient (or its state) differ in length.
    #[error(
        "{optimizer}: parameter `{param}`: {what} has {got} elements, the parameter has {expected}"
    )]
    Length {
        /// The optimizer.
        optimizer: &'static str,
        /// The parameter.
        param: String,
        /// The gradient, or the state buffer by name.
        what: String,
        /// Its length.
        got: usize,
        /// The parameter's length.
        expected: usize,
    },
    /// A group index out of range.
    #[error("{optimizer} has {groups} parameter group(s); there is no group {group}")]
    NoSuchGroup {
        /// The optimizer.
        optimizer: &'static str,
        /// How many groups there are.
        groups: usize,
        /// The index asked for.
        group: usize,
    },
}

/// One parameter's optimizer state under PyTorch's names: the number of updates applied
/// (`step`) and buffers as long as the parameter's local elements (`exp_avg`, `exp_avg_sq`,
/// `momentum_buffer`). A parameter with no update yet has no state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParamState {
    /// Updates applied to this parameter.
    pub step: u64,
    /// Buffers by state name.
    pub buffers: BTreeMap<String, Vec<f32>>,
}

impl ParamState {
    /// Bytes held by the buffers.
    pub fn bytes(&self) -> usize {
        self.buffers.values().map(|b| b.len() * 4).sum()
    }

    /// Removes buffer `name` for an update, or gives `len` zeros when it is absent.
    pub fn take(&mut self, name: &str, len: usize) -> Vec<f32> {
        match self.buffers.remove(name) {
            Some(b) if b.len() == len => b,
            _ => vec![0.0; len],
        }
    }

    /// Puts a buffer back after an update.
    pub fn put(&mut self, name: &str, buffer: Vec<f32>) {
        self.buffers.insert(name.to_string(), buffer);
    }
}

/// What the engine asks of an optimizer: one update per parameter (whole, or this rank's
/// rows) per step, learning rates per parameter group for schedules, and state by parameter
/// name for checkpoints. Implement it (or an [`UpdateRule`] inside [`Grouped`]) to add an
/// optimizer that runs on shards.
pub trait Optimizer: Send {
    /// The optimizer's name (`AdamW`), for messages and checkpoints.
    fn name(&self) -> &'static str;

    /// Applies one update to `param` (named `name`) with its gradient.
    fn update(&mut self, name: &str, param: &mut [f32], grad: &[f32]) -> Result<(), OptimError>;

    /// Number of parameter groups.
    fn num_groups(&self) -> usize;

    /// The current learning rate of `group`.
    fn lr(&self, group: usize) -> f64;

    /// The learning rate `group` was created with (what schedules scale).
    fn initial_lr(&self, group: usize) -> f64;

    /// Sets the learning rate of `group` (what a schedule does each step).
    fn set_lr(&mut self, group: usize, lr: f64) -> Result<(), OptimError>;

    /// The state of parameter `name`, if it has been updated.
    fn state(&self, name: &str) -> Option<&ParamState>;

    /// Replaces the state of parameter `name` (loading a checkpoint).
    fn set_state(&mut self, name: &str, state: ParamState) -> Result<(), OptimError>;

    /// Removes and returns the state of parameter `name` (the engine keeps offloaded state
    /// on disk between steps and hands it back with [`Optimizer::set_state`]).
    fn take_state(&mut self, name: &str) -> Option<ParamState>;

    /// Names of the parameters that have state.
    fn state_names(&self) -> Vec<String>;

    /// The group parameter `name` belongs to, if the optimizer says (checkpoints record each
    /// group's members, and loading refuses groups that differ, as PyTorch's
    /// `load_state_dict` refuses groups of other sizes). The default says nothing.
    fn param_group(&self, name: &str) -> Option<usize> {
        let _ = name;
        None
    }

    /// `group`'s settings under PyTorch's `param_groups` names (`lr`, `betas`, `eps`,
    /// `weight_decay`, `initial_lr`, ...), as checkpoints record them; `Null` (the default)
    /// when there are none to record.
    fn group_settings(&self, group: usize) -> serde_json::Value {
        let _ = group;
        serde_json::Value::Null
    }

    /// Restores `group`'s settings from what [`Optimizer::group_settings`] gave (loading a
    /// checkpoint restores the saved settings, as PyTorch's `load_state_dict` does). The
    /// default keeps the current ones.
    fn set_group_settings(
        &mut self,
        group: usize,
        settings: &serde_json::Value,
    ) -> Result<(), OptimError> {
        let _ = (group, settings);
        Ok(())
    }
}

/// The update rule of one optimizer with one group's settings: what [`Grouped`] needs to
/// provide parameter groups and state around it.
pub trait UpdateRule: Clone + std::fmt::Debug + Send + 'static {
    /// The optimizer's name.
    const NAME: &'static str;

    /// The learning rate.
    fn lr(&self) -> f64;

    /// These settings with learning rate `lr`.
    fn set_lr(&mut self, lr: f64);

    /// These settings with weight decay `wd` (for no-decay groups).
    fn with_weight_decay(&self, wd: f64) -> Self;

    /// Checks the settings as PyTorch's constructor does.
    fn validate(&self) -> Result<(), String>;

    /// One update of `param` with `grad` (same length); `state.step` already counts it.
    fn update(&self, param: &mut [f32], grad: &[f32], state: &mut ParamState);

    /// These settings under PyTorch's names, for checkpoints; `Null` (the default) records
    /// none.
    fn settings(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// The settings [`UpdateRule::settings`] recorded (loading a checkpoint); the default
    /// keeps these.
    fn with_settings(&self, settings: &serde_json::Value) -> Result<Self, String> {
        let _ = settings;
        Ok(self.clone())
    }
}

/// [`UpdateRule::settings`] of a config that serialises under PyTorch's names.
pub(crate) fn settings_of<T: serde::Serialize>(config: &T) -> serde_json::Value {
    serde_json::to_value(config).unwrap_or(serde_json::Value::Null)
}

/// [`UpdateRule::with_settings`] of such a config: every field must be there (other keys,
/// such as PyTorch's `foreach` or our `initial_lr`, are ignored).
pub(crate) fn config_from<T: serde::de::DeserializeOwned>(
    settings: &serde_json::Value,
) -> Result<T, String> {
    serde_json::from_value(settings.clone()).map_err(|e| format!("settings {settings}: {e}"))
}

/// The common checks of learning rate, betas and epsilon.
pub(crate) fn check_lr_betas_eps(
    lr: f64,
    betas: Option<(f64, f64)>,
    eps: Option<f64>,
) -> Result<(), String> {
    if lr.is_nan() || lr < 0.0 {
        return Err(format!("learning rate {lr} is not >= 0"));
    }
    if let Some((b1, b2)) = betas
        && (!(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2))
    {
        return Err(format!("betas ({b1}, {b2}) must lie in [0, 1)"));
    }
    if let Some(eps) = eps
        && (eps.is_nan() || eps < 0.0)
    {
        return Err(format!("eps {eps} is not >= 0"));
    }
    Ok(())
}
