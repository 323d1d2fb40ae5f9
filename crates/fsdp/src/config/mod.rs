//! Configuration: one schema for the plugin builder, `FSDP_*`/`ACCELERATE_*` environment
//! variables, Accelerate YAML files and command-line flags. Sources, strongest first: code,
//! command line, environment, file, defaults.

mod builder;
mod checks;
mod choices;
mod error;
mod layer;
mod paths;
mod resolve;
mod schema;
mod settings;
mod value;
mod view;
pub mod yaml;

pub use builder::FsdpPluginBuilder;
pub use choices::{
    AllGatherDtype, AutoWrapPolicy, BackwardPrefetch, CheckpointFormat, Choice, ComputeEnvironment,
    DistributedType, MixedPrecision, ReduceDtype, RendezvousBackend, ShardingStrategy,
    StateDictType, describe_choices, parse_choice_index,
};
pub use error::ConfigError;
pub use layer::Layer;
pub use paths::{
    CONFIG_FILE_ENV, accelerate_config_path, default_config_path, existing_default_config,
    fsdp_home,
};
pub use resolve::ResolvedConfig;
pub use schema::{Applicability, DefaultValue, FSDP_SECTION, Key, KeySpec, Kind, Section};
pub(crate) use settings::machines_spanned;
pub use settings::{FsdpPlugin, LaunchSettings};
pub use value::{Setting, Source, Value, parse_bool, parse_text};
