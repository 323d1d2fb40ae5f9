//! Typed reads over merged settings, and the [`LaunchSettings`] and [`FsdpPlugin`] built from
//! them (with the errors a single key's value can raise).

use std::collections::BTreeMap;

use super::choices::{AllGatherDtype, Choice, ReduceDtype, ShardingStrategy};
use super::error::ConfigError;
use super::schema::Key;
use super::settings::{FsdpPlugin, LaunchSettings};
use super::value::{Setting, Source, Value};

/// Typed reads over merged settings. Values were parsed per the schema, so a mismatch here
/// can only be a schema bug; it falls back to the default rather than panicking.
pub(super) struct View<'a>(pub(super) &'a BTreeMap<Key, Setting>);

impl View<'_> {
    pub(super) fn value(&self, key: Key) -> Option<&Value> {
        self.0.get(&key).map(|s| &s.value)
    }

    pub(super) fn source(&self, key: Key) -> Source {
        self.0
            .get(&key)
            .map_or(Source::Default, |s| s.source.clone())
    }

    pub(super) fn explicit(&self, key: Key) -> bool {
        self.0
            .get(&key)
            .is_some_and(|s| s.source != Source::Default)
    }

    pub(super) fn flag(&self, key: Key) -> bool {
        matches!(self.value(key), Some(Value::Bool(true)))
    }

    pub(super) fn uint(&self, key: Key) -> Option<u64> {
        match self.value(key) {
            Some(Value::UInt(n)) => Some(*n),
            _ => None,
        }
    }

    pub(super) fn text(&self, key: Key) -> Option<&str> {
        match self.value(key) {
            Some(Value::Text(t)) => Some(t),
            _ => None,
        }
    }

    pub(super) fn choice<T: Choice>(&self, key: Key) -> T {
        self.text(key)
            .and_then(T::parse_choice)
            .unwrap_or(T::ALL[0])
    }

    /// `key`'s choice, or what DeepSpeed's switch `deepspeed` says when only it is set
    /// (true: `on[0]`, DeepSpeed's own; false: the default); both set is an error naming both
    /// unless they agree (`key` one of `on` for true, the default for false).
    fn deepspeed_choice<T: Choice + PartialEq>(
        &self,
        key: Key,
        deepspeed: Key,
        on: &[T],
        errors: &mut Vec<ConfigError>,
    ) -> T {
        let chosen = self.choice::<T>(key);
        if !self.explicit(deepspeed) {
            return chosen;
        }
        let switched_on = self.flag(deepspeed);
        if !self.explicit(key) {
            return if switched_on { on[0] } else { T::ALL[0] };
        }
        let agrees = if switched_on {
            on.contains(&chosen)
        } else {
            chosen == T::ALL[0]
        };
        if !agrees {
            errors.push(ConfigError::Inconsistent {
                keys: vec![key.name(), deepspeed.name()],
                message: format!(
                    "{} and {} ask for different settings; set only one",
                    self.describe(key),
                    self.describe(deepspeed)
                ),
            });
        }
        chosen
    }

    /// "`key: value` (origin)" for messages.
    pub(super) fn describe(&self, key: Key) -> String {
        match self.0.get(&key) {
            Some(s) => format!("`{}: {}` ({})", key.name(), s.value, s.source),
            None => format!("`{}` (unset)", key.name()),
        }
    }

    pub(super) fn launch(&self) -> LaunchSettings {
        let usize_of = |k| self.uint(k).map(|n| n as usize);
        LaunchSettings {
            distributed_type: self.choice(Key::DistributedType),
            num_processes: usize_of(Key::NumProcesses).unwrap_or(1),
            num_machines: usize_of(Key::NumMachines).unwrap_or(1),
            machine_rank: usize_of(Key::MachineRank).unwrap_or(0),
            main_process_ip: self.text(Key::MainProcessIp).map(String::from),
            main_process_port: self.uint(Key::MainProcessPort).map(|p| p as u16),
            mixed_precision: self.choice(Key::MixedPrecision),
            use_cpu: self.flag(Key::UseCpu),
            debug: self.flag(Key::Debug),
            gpu_ids: self.gpu_ids().ok().flatten(),
            num_cpu_threads_per_process: usize_of(Key::NumCpuThreadsPerProcess),
        }
    }

    pub(super) fn gpu_ids(&self) -> Result<Option<Vec<usize>>, String> {
        let text = self.text(Key::GpuIds).unwrap_or("all").trim();
        if text.eq_ignore_ascii_case("all") {
            return Ok(None);
        }
        text.split(',')
            .map(|id| id.trim().parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
            .map_err(|_| "expected `all` or comma-separated GPU ids such as `0,1`".to_string())
    }

    /// The typed plugin and the errors found while building it.
    pub(super) fn fsdp(&self) -> (FsdpPlugin, Vec<ConfigError>) {
        let mut errors = Vec::new();
        let invalid = |key: Key, reason: String| ConfigError::InvalidValue {
            origin: self.source(key),
            key: key.name(),
            value: self.value(key).map(|v| v.to_string()).unwrap_or_default(),
            reason,
        };
        let version = self.uint(Key::FsdpVersion).unwrap_or(1) as u8;
        let strategy_key: ShardingStrategy = self.choice(Key::FsdpShardingStrategy);
        let sharding_strategy = match self.value(Key::FsdpReshardAfterForward) {
            None => strategy_key,
            Some(Value::Bool(reshard)) => {
                if *reshard {
                    ShardingStrategy::FullShard
                } else {
                    ShardingStrategy::ShardGradOp
                }
            }
            Some(_) if version == 2 => {
                errors.push(invalid(
                    Key::FsdpReshardAfterForward,
                    "with fsdp_version 2 it must be true or false".into(),
                ));
                strategy_key
            }
            Some(_) => self.choice(Key::FsdpReshardAfterForward),
        };
        if self.explicit(Key::FsdpReshardAfterForward)
            && self.explicit(Key::FsdpShardingStrategy)
            && sharding_strategy != strategy_key
        {
            errors.push(ConfigError::Inconsistent {
                keys: vec![Key::FsdpShardingStrategy.name(), Key::FsdpReshardAfterForward.name()],
                message: format!(
                    "{} and {} ask for different strategies ({strategy_key} vs {sharding_strategy}); set only one",
                    self.describe(Key::FsdpShardingStrategy),
                    self.describe(Key::FsdpReshardAfterForward)
                ),
            });
        }
        let transformer_layer_cls_to_wrap =
            self.text(Key::FsdpTransformerLayerClsToWrap).map(|t| {
                t.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            });
        let mut pattern_of = |key: Key| {
            let pattern = self.text(key)?;
            regex::Regex::new(pattern)
                .map_err(|e| {
                    errors.push(invalid(key, format!("not a valid regular expression: {e}")))
                })
                .ok()
        };
        let ignored_modules = pattern_of(Key::FsdpIgnoredModules);
        let no_reshard_after_forward = pattern_of(Key::FsdpNoReshardAfterForward);
        let plugin = FsdpPlugin {
            version,
            sharding_strategy,
            offload_params: self.flag(Key::FsdpOffloadParams),
            offload_dir: self.text(Key::FsdpOffloadDir).map(std::path::PathBuf::from),
            offload_optimizer: self.flag(Key::FsdpOffloadOptimizer),
            auto_wrap_policy: self.choice(Key::FsdpAutoWrapPolicy),
            transformer_layer_cls_to_wrap,
            min_num_params: self.uint(Key::FsdpMinNumParams).unwrap_or(100_000_000),
            backward_prefetch: self.choice(Key::FsdpBackwardPrefetch),
            forward_prefetch: self.flag(Key::FsdpForwardPrefetch),
            state_dict_type: self.choice(Key::FsdpStateDictType),
            checkpoint_format: self.choice(Key::FsdpCheckpointFormat),
            trace_dir: self.text(Key::FsdpTraceDir).map(std::path::PathBuf::from),
            cpu_ram_efficient_loading: self.flag(Key::FsdpCpuRamEfficientLoading),
            sync_module_states: self.flag(Key::FsdpSyncModuleStates),
            activation_checkpointing: self.flag(Key::FsdpActivationCheckpointing),
            ignored_modules,
            no_reshard_after_forward,
            mixed_precision: self.choice(Key::MixedPrecision),
            // ZeRO++ quantizes gradients to 4 bits (qgZ) and weights to 8 (qwZ).
            reduce_dtype: self.deepspeed_choice(
                Key::FsdpReduceDtype,
                Key::ZeroQuantizedGradients,
                &[ReduceDtype::Int4, ReduceDtype::Int8],
                &mut errors,
            ),
            all_gather_dtype: self.deepspeed_choice(
                Key::FsdpAllGatherDtype,
                Key::ZeroQuantizedWeights,
                &[AllGatherDtype::Int8],
                &mut errors,
            ),
            hpz_partition_size: self.uint(Key::FsdpHpzPartitionSize).unwrap_or(0) as usize,
            hierarchical_collectives: self.flag(Key::FsdpHierarchicalCollectives),
            debug: self.flag(Key::Debug),
        };
        (plugin, errors)
    }
}
