//! fsdp-rs's models' building blocks, as `fsdp::nn`: the module system (modules that name
//! their parameters once, `Params` that give them to a forward), layers, fused training
//! kernels with hand-written backwards (CustomOps on candle), quantized weight formats,
//! weight sources, and the seeded random streams every draw comes from ([`rng`]). It knows
//! nothing of sharding: the `fsdp` crate's engine gives a model's forward its parameters.

/// The workspace's skip registry for this crate's unit tests (`skipped!`,
/// `skipped_optional!`), shared with the test crates.
#[cfg(test)]
#[macro_use]
#[path = "../../fsdp/tests/common/skip.rs"]
mod skip;
/// The crate by its own name, so the test helpers it shares with `tests/` (by `#[path]`)
/// name it alike.
#[cfg(test)]
extern crate self as fsdp_nn;
/// The numeric comparisons the test crates use (random tensors, per-element errors,
/// gradients of a function), shared by the unit tests.
#[cfg(test)]
#[path = "../tests/support/numerics.rs"]
mod numerics;
/// The unit tests allocate through the workspace's poisoning allocator: a kernel that
/// returns memory it never wrote shows garbage instead of fresh pages' zeros.
#[cfg(test)]
#[path = "../../fsdp/tests/common/poisoned.rs"]
mod poisoned;
/// Where the registry's macros look for it, as in the test crates.
#[cfg(test)]
mod common {
    pub(crate) use super::skip;
}

// First: its macro serves the modules below.
#[macro_use]
mod multiversion;

/// The tensor library, re-exported so users build on the same version.
pub use candle_core as candle;

mod composite;
pub mod device;
pub mod layers;
pub mod lora;
pub mod module;
pub mod ops;
pub mod quant;
pub mod rng;
mod weights;

/// Moved to [`crate::rng`]; re-exported where it was.
pub use crate::rng::NormalRng;
pub use composite::ModuleChildren;
pub use module::{
    Forward, Init, LoadReport, LocalParams, Model, Module, ModuleInfo, ModuleOutput, ParamSpec,
    Params, Recompute, call_checkpointable, join, load_by_name, match_names,
};
pub use weights::{SafetensorsWeights, SeededWeights, WeightSource, read_param, read_param_rows};
