//! Layers, the module system and fused training kernels on candle.

/// The tensor library, re-exported so users build on the same version.
pub use candle_core as candle;

mod composite;
pub mod layers;
pub mod lora;
pub mod module;
pub mod ops;
pub mod quant;
mod weights;

/// Moved to [`crate::rng`]; re-exported where it was.
pub use crate::rng::NormalRng;
pub use composite::ModuleChildren;
pub use module::{
    Forward, Init, LoadReport, LocalParams, Model, Module, ModuleInfo, ModuleOutput, ParamSpec,
    Params, Recompute, call_checkpointable, join, load_by_name, match_names,
};
pub use weights::{SafetensorsWeights, SeededWeights, WeightSource, read_param, read_param_rows};
