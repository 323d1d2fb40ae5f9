//! Settings made in the training program's code: the strongest source, resolved through the
//! same schema as files and environment.

use super::choices::{
    AllGatherDtype, AutoWrapPolicy, BackwardPrefetch, CheckpointFormat, Choice, MixedPrecision,
    ReduceDtype, ShardingStrategy, StateDictType,
};
use super::error::ConfigError;
use super::layer::Layer;
use super::resolve::ResolvedConfig;
use super::schema::Key;
use super::settings::FsdpPlugin;
use super::value::{Source, Value};

/// Builds an [`FsdpPlugin`] from values set in code, the `FSDP_*`/`ACCELERATE_*` environment
/// (which `fsdp launch` fills from the config file) and the defaults, in that order.
#[derive(Debug, Clone, Default)]
pub struct FsdpPluginBuilder {
    code: Layer,
}

macro_rules! setters {
    ($($(#[$doc:meta])* $fn_name:ident($ty:ty) => $key:ident, $conv:expr;)+) => {
        $(
            $(#[$doc])*
            pub fn $fn_name(mut self, value: $ty) -> Self {
                #[allow(clippy::redundant_closure_call)]
                let v: Value = ($conv)(value);
                self.code.set(Key::$key, v, Source::Code);
                self
            }
        )+
    };
}

fn choice<T: Choice>(c: T) -> Value {
    Value::Text(c.name().to_string())
}

impl FsdpPluginBuilder {
    setters! {
        /// `fsdp_sharding_strategy`.
        sharding_strategy(ShardingStrategy) => FsdpShardingStrategy, choice;
        /// `fsdp_version` (1 or 2).
        version(u8) => FsdpVersion, |v: u8| Value::UInt(v.into());
        /// `fsdp_offload_params`.
        offload_params(bool) => FsdpOffloadParams, Value::Bool;
        /// `fsdp_offload_dir` (fsdp-rs): where offloaded state lives.
        offload_dir(&str) => FsdpOffloadDir, |s: &str| Value::Text(s.into());
        /// `fsdp_offload_optimizer` (fsdp-rs): only the optimizer state in `offload_dir`.
        offload_optimizer(bool) => FsdpOffloadOptimizer, Value::Bool;
        /// `fsdp_auto_wrap_policy`.
        auto_wrap_policy(AutoWrapPolicy) => FsdpAutoWrapPolicy, choice;
        /// `fsdp_transformer_layer_cls_to_wrap`, comma-separated.
        transformer_layer_cls_to_wrap(&str) => FsdpTransformerLayerClsToWrap, |s: &str| Value::Text(s.into());
        /// `fsdp_min_num_params`.
        min_num_params(u64) => FsdpMinNumParams, Value::UInt;
        /// `fsdp_backward_prefetch`.
        backward_prefetch(BackwardPrefetch) => FsdpBackwardPrefetch, choice;
        /// `fsdp_forward_prefetch`.
        forward_prefetch(bool) => FsdpForwardPrefetch, Value::Bool;
        /// `fsdp_state_dict_type`.
        state_dict_type(StateDictType) => FsdpStateDictType, choice;
        /// `fsdp_no_reshard_after_forward` (a regex on unit paths).
        no_reshard_after_forward(&str) => FsdpNoReshardAfterForward, |s: &str| Value::Text(s.into());
        /// `fsdp_trace_dir`: where each rank writes its timeline.
        trace_dir(&str) => FsdpTraceDir, |s: &str| Value::Text(s.into());
        /// `fsdp_checkpoint_format`.
        checkpoint_format(CheckpointFormat) => FsdpCheckpointFormat, choice;
        /// `fsdp_cpu_ram_efficient_loading`.
        cpu_ram_efficient_loading(bool) => FsdpCpuRamEfficientLoading, Value::Bool;
        /// `fsdp_sync_module_states`.
        sync_module_states(bool) => FsdpSyncModuleStates, Value::Bool;
        /// `fsdp_activation_checkpointing`.
        activation_checkpointing(bool) => FsdpActivationCheckpointing, Value::Bool;
        /// `fsdp_ignored_modules` (a regex on module paths).
        ignored_modules(&str) => FsdpIgnoredModules, |s: &str| Value::Text(s.into());
        /// `mixed_precision`.
        mixed_precision(MixedPrecision) => MixedPrecision, choice;
        /// `fsdp_reduce_dtype`: what gradients are reduced in (f32 unless set).
        reduce_dtype(ReduceDtype) => FsdpReduceDtype, choice;
        /// `fsdp_all_gather_dtype`: what parameters are gathered in (the compute dtype
        /// unless `int8`).
        all_gather_dtype(AllGatherDtype) => FsdpAllGatherDtype, choice;
        /// `fsdp_hpz_partition_size`: ranks backward gathers from (ZeRO++'s hpZ; 0 for none).
        hpz_partition_size(u64) => FsdpHpzPartitionSize, Value::UInt;
        /// `fsdp_hierarchical_collectives`: two-hop collectives across machines (default on).
        hierarchical_collectives(bool) => FsdpHierarchicalCollectives, Value::Bool;
        /// `debug`: check FSDP state transitions, poison released parameters.
        debug(bool) => Debug, Value::Bool;
    }

    /// Resolves against this process's environment and the defaults.
    pub fn build(self) -> Result<FsdpPlugin, ConfigError> {
        Ok(self.resolve(&Layer::from_process_env()?, None)?.fsdp)
    }

    /// Resolves against a given environment layer and, optionally, a file layer; the whole
    /// resolved configuration is returned (launch settings and sources included).
    pub fn resolve(self, env: &Layer, file: Option<&Layer>) -> Result<ResolvedConfig, ConfigError> {
        let mut layers = vec![&self.code, env];
        layers.extend(file);
        ResolvedConfig::resolve(&layers)
    }
}

impl FsdpPlugin {
    /// A builder for settings made in code.
    pub fn builder() -> FsdpPluginBuilder {
        FsdpPluginBuilder::default()
    }
}
