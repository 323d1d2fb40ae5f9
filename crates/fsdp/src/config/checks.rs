//! The configuration's rules that involve more than one key, or more than one source of one
//! key: what [`super::ResolvedConfig::resolve`] reports beside each value's own checks.

use std::collections::BTreeMap;

use super::choices::{AutoWrapPolicy, CheckpointFormat, DistributedType, StateDictType};
use super::error::ConfigError;
use super::layer::Layer;
use super::schema::{Key, Section};
use super::settings::{FsdpPlugin, LaunchSettings};
use super::value::{Setting, Source};
use super::view::View;

impl View<'_> {
    /// Rules that involve more than one key.
    pub(super) fn check(&self, launch: &LaunchSettings, fsdp: &FsdpPlugin) -> Vec<ConfigError> {
        let mut errors = Vec::new();
        let mut inconsistent = |keys: &[Key], message: String| {
            errors.push(ConfigError::Inconsistent {
                keys: keys.iter().map(|k| k.name()).collect(),
                message,
            })
        };
        if let Err(reason) = self.gpu_ids() {
            inconsistent(
                &[Key::GpuIds],
                format!("{}: {reason}", self.describe(Key::GpuIds)),
            );
        }
        if fsdp.cpu_ram_efficient_loading && !fsdp.sync_module_states {
            inconsistent(
                &[Key::FsdpCpuRamEfficientLoading, Key::FsdpSyncModuleStates],
                format!(
                    "{} requires `fsdp_sync_module_states: true` (only rank 0 loads the weights, so they must be broadcast), but {}",
                    self.describe(Key::FsdpCpuRamEfficientLoading),
                    self.describe(Key::FsdpSyncModuleStates)
                ),
            );
        }
        if fsdp.checkpoint_format == CheckpointFormat::TorchDcp
            && fsdp.state_dict_type != StateDictType::ShardedStateDict
        {
            inconsistent(
                &[Key::FsdpCheckpointFormat, Key::FsdpStateDictType],
                format!(
                    "{} writes SHARDED_STATE_DICT checkpoints only (as Accelerate's DCP checkpoints are), but {}",
                    self.describe(Key::FsdpCheckpointFormat),
                    self.describe(Key::FsdpStateDictType)
                ),
            );
        }
        if fsdp.offload_optimizer && fsdp.offload_dir.is_none() {
            inconsistent(
                &[Key::FsdpOffloadOptimizer, Key::FsdpOffloadDir],
                format!(
                    "{} needs `fsdp_offload_dir`, the folder the optimizer state is kept in",
                    self.describe(Key::FsdpOffloadOptimizer)
                ),
            );
        }
        if fsdp.offload_dir.is_some() && !fsdp.offload_params && !fsdp.offload_optimizer {
            inconsistent(
                &[
                    Key::FsdpOffloadDir,
                    Key::FsdpOffloadParams,
                    Key::FsdpOffloadOptimizer,
                ],
                format!(
                    "{} offloads nothing: set `fsdp_offload_params: true` (parameters, gradients and optimizer state) or `fsdp_offload_optimizer: true` (optimizer state)",
                    self.describe(Key::FsdpOffloadDir)
                ),
            );
        }
        if fsdp.no_reshard_after_forward.is_some()
            && !fsdp.sharding_strategy.reshards_after_forward()
        {
            inconsistent(
                &[Key::FsdpNoReshardAfterForward, Key::FsdpShardingStrategy],
                format!(
                    "{} keeps units gathered after forward, which only FULL_SHARD and HYBRID_SHARD release; {} keeps every unit gathered already",
                    self.describe(Key::FsdpNoReshardAfterForward),
                    self.describe(Key::FsdpShardingStrategy)
                ),
            );
        }
        if self.explicit(Key::FsdpMinNumParams)
            && fsdp.auto_wrap_policy != AutoWrapPolicy::SizeBasedWrap
        {
            inconsistent(
                &[Key::FsdpMinNumParams, Key::FsdpAutoWrapPolicy],
                format!(
                    "{} only applies with `fsdp_auto_wrap_policy: SIZE_BASED_WRAP`, but {}",
                    self.describe(Key::FsdpMinNumParams),
                    self.describe(Key::FsdpAutoWrapPolicy)
                ),
            );
        }
        if self.explicit(Key::FsdpTransformerLayerClsToWrap)
            && fsdp.auto_wrap_policy != AutoWrapPolicy::TransformerBasedWrap
        {
            inconsistent(
                &[Key::FsdpTransformerLayerClsToWrap, Key::FsdpAutoWrapPolicy],
                format!(
                    "{} only applies with `fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`, but {}",
                    self.describe(Key::FsdpTransformerLayerClsToWrap),
                    self.describe(Key::FsdpAutoWrapPolicy)
                ),
            );
        }
        if !launch.num_processes.is_multiple_of(launch.num_machines) {
            inconsistent(
                &[Key::NumProcesses, Key::NumMachines],
                format!(
                    "{} must be a multiple of {} (every machine runs the same number of processes)",
                    self.describe(Key::NumProcesses),
                    self.describe(Key::NumMachines)
                ),
            );
        }
        if launch.machine_rank >= launch.num_machines {
            inconsistent(
                &[Key::MachineRank, Key::NumMachines],
                format!(
                    "{} must be below {} (machine ranks are 0..{})",
                    self.describe(Key::MachineRank),
                    self.describe(Key::NumMachines),
                    launch.num_machines
                ),
            );
        }
        if launch.num_machines > 1 && launch.main_process_ip.is_none() {
            inconsistent(
                &[Key::MainProcessIp, Key::NumMachines],
                format!(
                    "{} needs `main_process_ip`: the address every machine uses to reach machine rank 0",
                    self.describe(Key::NumMachines)
                ),
            );
        }
        if launch.distributed_type == DistributedType::No && launch.num_processes > 1 {
            inconsistent(
                &[Key::DistributedType, Key::NumProcesses],
                format!(
                    "{} runs a single process, but {}",
                    self.describe(Key::DistributedType),
                    self.describe(Key::NumProcesses)
                ),
            );
        }
        if launch.distributed_type == DistributedType::Fsdp && fsdp.sharding_strategy.is_hybrid() {
            let strategy_key = if self.explicit(Key::FsdpReshardAfterForward) {
                Key::FsdpReshardAfterForward
            } else {
                Key::FsdpShardingStrategy
            };
            if launch.num_machines < 2 || !launch.num_processes.is_multiple_of(launch.num_machines)
            {
                inconsistent(
                    &[strategy_key, Key::NumMachines, Key::NumProcesses],
                    format!(
                        "{} shards inside each machine and replicates across machines, so it needs at least 2 machines with the same number of processes each; got {} and {} (on one machine use FULL_SHARD or SHARD_GRAD_OP)",
                        self.describe(strategy_key),
                        self.describe(Key::NumMachines),
                        self.describe(Key::NumProcesses)
                    ),
                );
            }
        }
        if launch.distributed_type != DistributedType::Fsdp {
            let fsdp_keys: Vec<Key> = Key::all()
                .filter(|k| k.spec().section == Section::Fsdp && self.explicit(*k))
                .collect();
            if !fsdp_keys.is_empty() {
                let described: Vec<String> = fsdp_keys.iter().map(|k| self.describe(*k)).collect();
                let mut keys = fsdp_keys.clone();
                keys.push(Key::DistributedType);
                inconsistent(
                    &keys,
                    format!(
                        "FSDP settings {} have no effect because {}; set `distributed_type: FSDP` or remove them",
                        described.join(", "),
                        self.describe(Key::DistributedType)
                    ),
                );
            }
        }
        errors
    }
}

/// A job that a cluster's launcher started (srun, mpirun, mpiexec) has the size that
/// launcher gave it; a weaker source (the file, `fsdp launch`'s environment) asking for
/// another process or machine count is an error naming both, not silently outvoted.
pub(super) fn cluster_layout_conflicts(
    layers: &[&Layer],
    settings: &BTreeMap<Key, Setting>,
) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    for key in [Key::NumProcesses, Key::NumMachines] {
        let Some(won) = settings.get(&key) else {
            continue;
        };
        let Source::Env { var } = &won.source else {
            continue;
        };
        if !super::layer::is_cluster_layout_var(var) {
            continue;
        }
        let weaker = layers.iter().filter_map(|l| l.get(key)).skip(1);
        for other in weaker.filter(|o| o.value != won.value) {
            errors.push(ConfigError::Inconsistent {
                keys: vec![key.name()],
                message: format!(
                    "the cluster's launcher started this job with `{}: {}` ({}), but `{}: {}` ({}) asks for another layout: start it with the layout the configuration describes, or drop the setting",
                    key.name(),
                    won.value,
                    won.source,
                    key.name(),
                    other.value,
                    other.source
                ),
            });
        }
    }
    errors
}
