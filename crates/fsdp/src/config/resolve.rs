//! Merging layers (code, command line, environment, file, defaults), checking the result as a
//! whole, and the typed views the launcher and the engine use.

use std::collections::BTreeMap;

use super::choices::{
    AllGatherDtype, AutoWrapPolicy, BackwardPrefetch, CheckpointFormat, Choice, DistributedType,
    MixedPrecision, ReduceDtype, ShardingStrategy, StateDictType,
};
use super::error::ConfigError;
use super::layer::Layer;
use super::schema::{Applicability, Key, Section};
use super::value::{Setting, Source, Value};

/// The launch-related settings, typed.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchSettings {
    /// Kind of job.
    pub distributed_type: DistributedType,
    /// Total processes over all machines.
    pub num_processes: usize,
    /// Number of machines.
    pub num_machines: usize,
    /// This machine's rank.
    pub machine_rank: usize,
    /// Address of the machine hosting rank 0, if set.
    pub main_process_ip: Option<String>,
    /// Rendezvous port, if set (0 = pick a free one).
    pub main_process_port: Option<u16>,
    /// Compute precision.
    pub mixed_precision: MixedPrecision,
    /// Train on CPU even when a GPU is present.
    pub use_cpu: bool,
    /// Run with collective and state checks.
    pub debug: bool,
    /// GPUs to use on this machine; `None` means all.
    pub gpu_ids: Option<Vec<usize>>,
    /// Compute threads per worker, if set.
    pub num_cpu_threads_per_process: Option<usize>,
}

impl LaunchSettings {
    /// Processes started on each machine.
    pub fn processes_per_machine(&self) -> usize {
        self.num_processes / self.num_machines.max(1)
    }

    /// The mesh `strategy` makes of the job's processes: (ranks a parameter is sharded over,
    /// copies of each shard) — every process for FULL_SHARD and SHARD_GRAD_OP, one for
    /// NO_SHARD, a machine's processes for hybrid sharding.
    pub fn mesh_shape(&self, strategy: ShardingStrategy) -> (usize, usize) {
        let n = self.num_processes.max(1);
        let shard = match strategy {
            ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => n,
            ShardingStrategy::NoShard => 1,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
                self.processes_per_machine().clamp(1, n)
            }
        };
        (shard, n / shard)
    }
}

/// The FSDP settings, typed: what the engine is configured with (Accelerate's
/// `FullyShardedDataParallelPlugin`).
#[derive(Debug, Clone)]
pub struct FsdpPlugin {
    /// FSDP API generation (1 or 2); both run the same per-parameter engine.
    pub version: u8,
    /// The effective strategy (from `fsdp_sharding_strategy` or `fsdp_reshard_after_forward`).
    pub sharding_strategy: ShardingStrategy,
    /// Keep parameters and gradients in host memory between uses (on disk, with their
    /// optimizer state, when `offload_dir` is set).
    pub offload_params: bool,
    /// The folder offloaded state lives in (`fsdp_offload_dir`).
    pub offload_dir: Option<std::path::PathBuf>,
    /// Keep the optimizer state in `offload_dir` (`fsdp_offload_optimizer`).
    pub offload_optimizer: bool,
    /// How the model is split into units.
    pub auto_wrap_policy: AutoWrapPolicy,
    /// Module type names that become units; `None` means the model's default list.
    pub transformer_layer_cls_to_wrap: Option<Vec<String>>,
    /// Minimum parameters per unit for size-based wrapping.
    pub min_num_params: u64,
    /// When backward gathers the next unit.
    pub backward_prefetch: BackwardPrefetch,
    /// Gather the next unit during forward.
    pub forward_prefetch: bool,
    /// Checkpoint layout.
    pub state_dict_type: StateDictType,
    /// The files a SHARDED_STATE_DICT checkpoint is written as.
    pub checkpoint_format: CheckpointFormat,
    /// Where each rank writes its timeline (`fsdp_trace_dir`, `FSDP_TRACE`).
    pub trace_dir: Option<std::path::PathBuf>,
    /// Only rank 0 materialises full weights at load time.
    pub cpu_ram_efficient_loading: bool,
    /// Broadcast rank 0's initial weights.
    pub sync_module_states: bool,
    /// Recompute unit activations in backward.
    pub activation_checkpointing: bool,
    /// Module paths kept out of FSDP (replicated).
    pub ignored_modules: Option<regex::Regex>,
    /// Unit paths kept gathered from forward to backward (`fsdp_no_reshard_after_forward`).
    pub no_reshard_after_forward: Option<regex::Regex>,
    /// Compute precision.
    pub mixed_precision: MixedPrecision,
    /// What gradients are reduced in.
    pub reduce_dtype: ReduceDtype,
    /// What parameters are all-gathered in.
    pub all_gather_dtype: AllGatherDtype,
    /// Ranks of the secondary partition backward gathers from (`fsdp_hpz_partition_size`,
    /// ZeRO++'s hpZ: 0 or 1 for none).
    pub hpz_partition_size: usize,
    /// Check FSDP state transitions and poison released parameters (the `debug` key).
    pub debug: bool,
}

/// A configuration after merging every source and checking it as a whole.
#[derive(Debug, Clone)]
pub struct ResolvedConfig {
    settings: BTreeMap<Key, Setting>,
    /// Launch settings.
    pub launch: LaunchSettings,
    /// FSDP settings.
    pub fsdp: FsdpPlugin,
}

impl ResolvedConfig {
    /// Merges layers, strongest first, over the schema defaults, then validates.
    pub fn resolve(layers: &[&Layer]) -> Result<ResolvedConfig, ConfigError> {
        let mut settings = BTreeMap::new();
        for key in Key::all() {
            let chosen = layers.iter().find_map(|l| l.get(key)).cloned().or_else(|| {
                Value::from_default(key.spec().default).map(|value| Setting {
                    value,
                    source: Source::Default,
                })
            });
            if let Some(setting) = chosen {
                settings.insert(key, setting);
            }
        }
        let mut errors = cluster_layout_conflicts(layers, &settings);
        let view = View(&settings);
        let launch = view.launch();
        let (fsdp, fsdp_errors) = view.fsdp();
        errors.extend(fsdp_errors);
        errors.extend(view.check(&launch, &fsdp));
        ConfigError::collect(errors)?;
        Ok(ResolvedConfig {
            settings,
            launch,
            fsdp,
        })
    }

    /// The winning setting for a key (`None` when unset with no default).
    pub fn get(&self, key: Key) -> Option<&Setting> {
        self.settings.get(&key)
    }

    /// Every key with a value, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (Key, &Setting)> {
        self.settings.iter().map(|(k, s)| (*k, s))
    }

    /// Keys set to a non-default value that fsdp-rs does not act on, each with the reason:
    /// reported to the user rather than silently dropped.
    pub fn not_applicable(&self) -> Vec<(Key, &Setting, &'static str)> {
        self.iter()
            .filter_map(|(key, setting)| match key.spec().applies {
                Applicability::NotApplicable(reason)
                    if Some(&setting.value) != Value::from_default(key.spec().default).as_ref() =>
                {
                    Some((key, setting, reason))
                }
                _ => None,
            })
            .collect()
    }
}

/// Typed reads over merged settings. Values were parsed per the schema, so a mismatch here
/// can only be a schema bug; it falls back to the default rather than panicking.
struct View<'a>(&'a BTreeMap<Key, Setting>);

impl View<'_> {
    fn value(&self, key: Key) -> Option<&Value> {
        self.0.get(&key).map(|s| &s.value)
    }

    fn source(&self, key: Key) -> Source {
        self.0
            .get(&key)
            .map_or(Source::Default, |s| s.source.clone())
    }

    fn explicit(&self, key: Key) -> bool {
        self.0
            .get(&key)
            .is_some_and(|s| s.source != Source::Default)
    }

    fn flag(&self, key: Key) -> bool {
        matches!(self.value(key), Some(Value::Bool(true)))
    }

    fn uint(&self, key: Key) -> Option<u64> {
        match self.value(key) {
            Some(Value::UInt(n)) => Some(*n),
            _ => None,
        }
    }

    fn text(&self, key: Key) -> Option<&str> {
        match self.value(key) {
            Some(Value::Text(t)) => Some(t),
            _ => None,
        }
    }

    fn choice<T: Choice>(&self, key: Key) -> T {
        self.text(key)
            .and_then(T::parse_choice)
            .unwrap_or(T::ALL[0])
    }

    /// `key`'s choice, or what DeepSpeed's switch `deepspeed` says when only it is set
    /// (true: `on`; false: the default); both set and disagreeing is an error naming both.
    fn deepspeed_choice<T: Choice + PartialEq>(
        &self,
        key: Key,
        deepspeed: Key,
        on: T,
        errors: &mut Vec<ConfigError>,
    ) -> T {
        let chosen = self.choice::<T>(key);
        if !self.explicit(deepspeed) {
            return chosen;
        }
        let switched = if self.flag(deepspeed) { on } else { T::ALL[0] };
        if self.explicit(key) && chosen != switched {
            errors.push(ConfigError::Inconsistent {
                keys: vec![key.name(), deepspeed.name()],
                message: format!(
                    "{} and {} ask for different settings; set only one",
                    self.describe(key),
                    self.describe(deepspeed)
                ),
            });
            return chosen;
        }
        switched
    }

    /// "`key: value` (origin)" for messages.
    fn describe(&self, key: Key) -> String {
        match self.0.get(&key) {
            Some(s) => format!("`{}: {}` ({})", key.name(), s.value, s.source),
            None => format!("`{}` (unset)", key.name()),
        }
    }

    fn launch(&self) -> LaunchSettings {
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

    fn gpu_ids(&self) -> Result<Option<Vec<usize>>, String> {
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
    fn fsdp(&self) -> (FsdpPlugin, Vec<ConfigError>) {
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
            reduce_dtype: self.deepspeed_choice(
                Key::FsdpReduceDtype,
                Key::ZeroQuantizedGradients,
                ReduceDtype::Int8,
                &mut errors,
            ),
            all_gather_dtype: self.deepspeed_choice(
                Key::FsdpAllGatherDtype,
                Key::ZeroQuantizedWeights,
                AllGatherDtype::Int8,
                &mut errors,
            ),
            hpz_partition_size: self.uint(Key::FsdpHpzPartitionSize).unwrap_or(0) as usize,
            debug: self.flag(Key::Debug),
        };
        (plugin, errors)
    }

    /// Rules that involve more than one key.
    fn check(&self, launch: &LaunchSettings, fsdp: &FsdpPlugin) -> Vec<ConfigError> {
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
            && !matches!(
                fsdp.sharding_strategy,
                ShardingStrategy::FullShard | ShardingStrategy::HybridShard
            )
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
fn cluster_layout_conflicts(
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
