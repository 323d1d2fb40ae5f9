//! The one table of configuration keys: names, sections, types, defaults, environment
//! variables, aliases and whether fsdp-rs acts on them. Code, YAML, environment, CLI and the
//! questionnaire all read their defaults and spellings from here.

use super::choices::{
    AllGatherDtype, AutoWrapPolicy, BackwardPrefetch, CheckpointFormat, Choice, ComputeEnvironment,
    DistributedType, MixedPrecision, ReduceDtype, RendezvousBackend, ShardingStrategy,
    StateDictType,
};

/// Where a key lives in an Accelerate config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// At the top level.
    Top,
    /// Inside the `fsdp_config:` mapping.
    Fsdp,
}

/// The type of a key's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `true`/`false` (also yes/no/on/off/1/0, any case).
    Bool,
    /// A whole number in `min..=max`, written as one (`4`, `1_000`).
    UInt {
        /// Smallest accepted value.
        min: u64,
        /// Largest accepted value.
        max: u64,
    },
    /// A parameter count: a whole number, also written `1e8` or `1.5e6`.
    ParamCount,
    /// Free text.
    Text,
    /// One of a fixed list of names (or their 1-based numbers).
    Choice(&'static [&'static str]),
    /// `fsdp_reshard_after_forward`: a bool (FSDP2) or a sharding strategy name (FSDP1).
    BoolOrStrategy,
    /// A list of strings.
    TextList,
    /// A nested section of another paradigm (DeepSpeed, Megatron, dynamo, ...): kept verbatim.
    Opaque,
}

/// Whether fsdp-rs acts on a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applicability {
    /// The key changes what fsdp-rs does.
    Used,
    /// Accepted so Accelerate files load unchanged, but it has no effect here; the reason is
    /// reported to the user.
    NotApplicable(&'static str),
}

/// A default value in the schema table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultValue {
    /// No value unless one is given (or derived at run time, as the help text says).
    Unset,
    /// A boolean default.
    Bool(bool),
    /// A number default.
    UInt(u64),
    /// A text or choice default (canonical spelling).
    Text(&'static str),
    /// An empty list.
    EmptyList,
}

/// Everything the project knows about one configuration key.
#[derive(Debug)]
pub struct KeySpec {
    /// The key.
    pub key: Key,
    /// Its YAML name.
    pub name: &'static str,
    /// Where it lives in the file.
    pub section: Section,
    /// Its value type.
    pub kind: Kind,
    /// Its default.
    pub default: DefaultValue,
    /// The environment variable that sets it, if any.
    pub env: Option<&'static str>,
    /// Other accepted YAML spellings.
    pub aliases: &'static [&'static str],
    /// Whether fsdp-rs acts on it.
    pub applies: Applicability,
    /// One line for help texts and `fsdp env`.
    pub help: &'static str,
}

macro_rules! key_table {
    ($($variant:ident: $name:literal, $section:ident, $kind:expr, $default:expr, $env:expr,
        $aliases:expr, $applies:expr, $help:literal;)+) => {
        /// A configuration key; see [`KeySpec`] for what is known about each.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        #[allow(missing_docs)]
        pub enum Key { $($variant),+ }

        static SPECS: &[KeySpec] = &[$(KeySpec {
            key: Key::$variant,
            name: $name,
            section: Section::$section,
            kind: $kind,
            default: $default,
            env: $env,
            aliases: $aliases,
            applies: $applies,
            help: $help,
        }),+];
    };
}

use Applicability::{NotApplicable as Na, Used};
use DefaultValue as D;

const TPU: Applicability = Na("TPU-only setting");
const OTHER_PARADIGM: Applicability = Na("section of another training paradigm; fsdp-rs runs FSDP");
const ANY_PORT: Kind = Kind::UInt { min: 0, max: 65535 };
const POSITIVE: Kind = Kind::UInt {
    min: 1,
    max: u32::MAX as u64,
};
const NON_NEGATIVE: Kind = Kind::UInt {
    min: 0,
    max: u32::MAX as u64,
};

key_table! {
    ComputeEnvironment: "compute_environment", Top, Kind::Choice(ComputeEnvironment::NAMES),
        D::Text("LOCAL_MACHINE"), None, &[], Used, "where the job runs";
    Debug: "debug", Top, Kind::Bool, D::Bool(false), Some("ACCELERATE_DEBUG_MODE"), &[], Used,
        "check collectives and FSDP state transitions while running (slower)";
    DistributedType: "distributed_type", Top, Kind::Choice(DistributedType::NAMES),
        D::Text("FSDP"), Some("ACCELERATE_USE_FSDP"), &[], Used, "kind of job";
    DowncastBf16: "downcast_bf16", Top, Kind::Text, D::Text("no"), None, &[], TPU,
        "TPU bf16 downcasting";
    EnableCpuAffinity: "enable_cpu_affinity", Top, Kind::Bool, D::Bool(false), None, &[],
        Na("NUMA affinity for NVIDIA GPUs; workers on CPU get thread counts instead"),
        "NUMA affinity";
    GpuIds: "gpu_ids", Top, Kind::Text, D::Text("all"), None, &[], Used,
        "GPU ids to use on this machine, comma-separated, or `all`";
    MachineRank: "machine_rank", Top, NON_NEGATIVE, D::UInt(0), None, &[], Used,
        "rank of this machine, 0..num_machines";
    MainProcessIp: "main_process_ip", Top, Kind::Text, D::Unset, None, &[], Used,
        "address of the machine hosting rank 0 (127.0.0.1 on one machine)";
    MainProcessPort: "main_process_port", Top, ANY_PORT, D::Unset, None, &[], Used,
        "rendezvous port on the main machine (unset: 29500; 0: pick a free port)";
    MainTrainingFunction: "main_training_function", Top, Kind::Text, D::Text("main"), None, &[],
        Na("names a Python function for notebook/TPU launches; fsdp-rs launches programs"),
        "function to launch";
    MixedPrecision: "mixed_precision", Top, Kind::Choice(MixedPrecision::NAMES), D::Text("no"),
        Some("ACCELERATE_MIXED_PRECISION"), &[], Used, "compute precision";
    NumCpuThreadsPerProcess: "num_cpu_threads_per_process", Top, POSITIVE, D::Unset, None, &[],
        Used, "compute threads per worker (unset: cores / local processes)";
    NumMachines: "num_machines", Top, POSITIVE, D::UInt(1), None, &[], Used,
        "number of machines";
    NumProcesses: "num_processes", Top, POSITIVE, D::UInt(1), None, &[], Used,
        "total number of processes over all machines";
    RdzvBackend: "rdzv_backend", Top, Kind::Choice(RendezvousBackend::NAMES), D::Text("static"),
        None, &[], Used, "rendezvous backend";
    SameNetwork: "same_network", Top, Kind::Bool, D::Bool(true), None, &[],
        Na("static rendezvous always connects to main_process_ip"), "machines share a network";
    UseCpu: "use_cpu", Top, Kind::Bool, D::Bool(false), None, &[], Used,
        "train on CPU even when a GPU is available";
    TpuEnv: "tpu_env", Top, Kind::TextList, D::EmptyList, None, &[], TPU, "TPU pod environment";
    TpuUseCluster: "tpu_use_cluster", Top, Kind::Bool, D::Bool(false), None, &[], TPU,
        "TPU cluster";
    TpuUseSudo: "tpu_use_sudo", Top, Kind::Bool, D::Bool(false), None, &[], TPU, "TPU sudo";
    TpuName: "tpu_name", Top, Kind::Text, D::Unset, None, &[], TPU, "TPU name";
    TpuZone: "tpu_zone", Top, Kind::Text, D::Unset, None, &[], TPU, "TPU zone";
    TpuVm: "tpu_vm", Top, Kind::TextList, D::Unset, None, &[], TPU, "TPU VMs";
    Commands: "commands", Top, Kind::TextList, D::Unset, None, &[], TPU, "TPU startup commands";
    CommandFile: "command_file", Top, Kind::Text, D::Unset, None, &[], TPU, "TPU startup script";
    DeepspeedConfig: "deepspeed_config", Top, Kind::Opaque, D::Unset, None, &[], OTHER_PARADIGM,
        "DeepSpeed settings";
    MegatronLmConfig: "megatron_lm_config", Top, Kind::Opaque, D::Unset, None, &[],
        OTHER_PARADIGM, "Megatron-LM settings";
    DynamoConfig: "dynamo_config", Top, Kind::Opaque, D::Unset, None, &[], OTHER_PARADIGM,
        "torch.compile settings";
    IpexConfig: "ipex_config", Top, Kind::Opaque, D::Unset, None, &[], OTHER_PARADIGM,
        "Intel extension settings";
    MpirunConfig: "mpirun_config", Top, Kind::Opaque, D::Unset, None, &[], OTHER_PARADIGM,
        "mpirun settings";
    Fp8Config: "fp8_config", Top, Kind::Opaque, D::Unset, None, &[], OTHER_PARADIGM,
        "FP8 settings";
    ParallelismConfig: "parallelism_config", Top, Kind::Opaque, D::Unset, None, &[],
        OTHER_PARADIGM, "tensor/context parallel settings";
    FsdpVersion: "fsdp_version", Fsdp, Kind::UInt { min: 1, max: 2 }, D::UInt(1),
        Some("FSDP_VERSION"), &[], Used, "FSDP API generation (both run the same engine)";
    FsdpShardingStrategy: "fsdp_sharding_strategy", Fsdp, Kind::Choice(ShardingStrategy::NAMES),
        D::Text("FULL_SHARD"), Some("FSDP_SHARDING_STRATEGY"), &[], Used, "sharding strategy";
    FsdpReshardAfterForward: "fsdp_reshard_after_forward", Fsdp, Kind::BoolOrStrategy, D::Unset,
        Some("FSDP_RESHARD_AFTER_FORWARD"), &[], Used,
        "FSDP2: true = FULL_SHARD, false = SHARD_GRAD_OP; FSDP1: a strategy name";
    FsdpOffloadParams: "fsdp_offload_params", Fsdp, Kind::Bool, D::Bool(false),
        Some("FSDP_OFFLOAD_PARAMS"), &[], Used, "offload parameter shards, gradients and optimizer state between uses: to fsdp_offload_dir when it is set (disk), else to host memory (on a CPU job already there: moves nothing)";
    FsdpAutoWrapPolicy: "fsdp_auto_wrap_policy", Fsdp, Kind::Choice(AutoWrapPolicy::NAMES),
        D::Text("TRANSFORMER_BASED_WRAP"), Some("FSDP_AUTO_WRAP_POLICY"), &[], Used,
        "how the model is split into units";
    FsdpTransformerLayerClsToWrap: "fsdp_transformer_layer_cls_to_wrap", Fsdp, Kind::Text,
        D::Unset, Some("FSDP_TRANSFORMER_CLS_TO_WRAP"), &[], Used,
        "module type names that become units, comma-separated (unset: the model's default)";
    FsdpMinNumParams: "fsdp_min_num_params", Fsdp, Kind::ParamCount, D::UInt(100_000_000),
        Some("FSDP_MIN_NUM_PARAMS"), &[], Used, "parameters per unit for SIZE_BASED_WRAP";
    FsdpBackwardPrefetch: "fsdp_backward_prefetch", Fsdp, Kind::Choice(BackwardPrefetch::NAMES),
        D::Text("BACKWARD_PRE"), Some("FSDP_BACKWARD_PREFETCH"),
        &["fsdp_backward_prefetch_policy"], Used, "when backward gathers the next unit";
    FsdpForwardPrefetch: "fsdp_forward_prefetch", Fsdp, Kind::Bool, D::Bool(false),
        Some("FSDP_FORWARD_PREFETCH"), &[], Used, "gather the next unit during forward";
    FsdpStateDictType: "fsdp_state_dict_type", Fsdp, Kind::Choice(StateDictType::NAMES),
        D::Text("SHARDED_STATE_DICT"), Some("FSDP_STATE_DICT_TYPE"), &[], Used,
        "checkpoint layout";
    FsdpNoReshardAfterForward: "fsdp_no_reshard_after_forward", Fsdp, Kind::Text, D::Unset,
        Some("FSDP_NO_RESHARD_AFTER_FORWARD"), &[], Used,
        "regex on unit paths kept gathered from forward to backward, as FSDP2's fully_shard(module, reshard_after_forward=False): no re-gather in backward, their full parameters held meanwhile (fsdp-rs)";
    FsdpTraceDir: "fsdp_trace_dir", Fsdp, Kind::Text, D::Unset, Some("FSDP_TRACE"), &[], Used,
        "folder where each rank writes its timeline, trace_rank<N>.json (Chrome trace; open in Perfetto, or draw with `fsdp trace plot`) (fsdp-rs)";
    FsdpCheckpointFormat: "fsdp_checkpoint_format", Fsdp, Kind::Choice(CheckpointFormat::NAMES),
        D::Text("fsdp-rs"), Some("FSDP_CHECKPOINT_FORMAT"), &[], Used,
        "files of a SHARDED_STATE_DICT checkpoint: fsdp-rs (checksummed safetensors) or torch-dcp (PyTorch DCP, resumable by Accelerate) (fsdp-rs)";
    FsdpUseOrigParams: "fsdp_use_orig_params", Fsdp, Kind::Bool, D::Bool(true),
        Some("FSDP_USE_ORIG_PARAMS"), &[],
        Na("fsdp-rs always shards per parameter, as use_orig_params=true does"),
        "keep original parameters visible";
    FsdpCpuRamEfficientLoading: "fsdp_cpu_ram_efficient_loading", Fsdp, Kind::Bool,
        D::Bool(false), Some("FSDP_CPU_RAM_EFFICIENT_LOADING"), &[], Used,
        "only rank 0 loads full weights; others receive their shards";
    FsdpSyncModuleStates: "fsdp_sync_module_states", Fsdp, Kind::Bool, D::Bool(true),
        Some("FSDP_SYNC_MODULE_STATES"), &[], Used, "broadcast rank 0's initial weights";
    FsdpActivationCheckpointing: "fsdp_activation_checkpointing", Fsdp, Kind::Bool,
        D::Bool(false), Some("FSDP_ACTIVATION_CHECKPOINTING"), &[], Used,
        "recompute each unit's activations in backward";
    FsdpIgnoredModules: "fsdp_ignored_modules", Fsdp, Kind::Text, D::Unset,
        Some("FSDP_IGNORED_MODULES"), &[], Used,
        "regex on module paths kept out of FSDP (replicated)";
    FsdpReduceDtype: "fsdp_reduce_dtype", Fsdp, Kind::Choice(ReduceDtype::NAMES), D::Text("fp32"),
        Some("FSDP_REDUCE_DTYPE"), &[], Used,
        "dtype gradients are reduced in: fp32, bf16, fp16 (PyTorch's MixedPrecision.reduce_dtype), int8 (blocks of 128 with an f32 scale each, exchanged all-to-all and summed in f32; ZeRO++'s quantized gradients) or int4 (the same with 4-bit values in blocks of 128; fsdp-rs)";
    FsdpAllGatherDtype: "fsdp_all_gather_dtype", Fsdp, Kind::Choice(AllGatherDtype::NAMES),
        D::Text("auto"), Some("FSDP_ALL_GATHER_DTYPE"), &[], Used,
        "dtype parameters are all-gathered in: auto (the compute dtype) or int8 (blocks of 128 with an f32 scale each, dequantized into the compute dtype; ZeRO++'s quantized weights; fsdp-rs)";
    ZeroQuantizedWeights: "zero_quantized_weights", Fsdp, Kind::Bool, D::Bool(false),
        None, &[], Used,
        "DeepSpeed's name for ZeRO++'s quantized weights: true is fsdp_all_gather_dtype: int8, false its default";
    ZeroQuantizedGradients: "zero_quantized_gradients", Fsdp, Kind::Bool, D::Bool(false),
        None, &[], Used,
        "DeepSpeed's name for ZeRO++'s quantized gradients: true is fsdp_reduce_dtype: int4 (DeepSpeed's 4 bits; int8 where fsdp_reduce_dtype says so), false its default";
    FsdpHpzPartitionSize: "fsdp_hpz_partition_size", Fsdp, NON_NEGATIVE, D::UInt(0),
        Some("FSDP_HPZ_PARTITION_SIZE"), &["zero_hpz_partition_size"], Used,
        "ZeRO++'s secondary partition (hpZ): after forward's all-gather each rank keeps 1/N of every gathered unit, so backward gathers it again from the N consecutive ranks of its group only (a machine's processes); 0 or 1 for none (fsdp-rs)";
    FsdpHierarchicalCollectives: "fsdp_hierarchical_collectives", Fsdp, Kind::Bool,
        D::Bool(true), Some("FSDP_HIERARCHICAL_COLLECTIVES"), &[], Used,
        "when parameters are sharded over processes of several machines, gathers and reductions run in two hops, inside each machine and then across machines, so each process's share crosses the network once (ZeRO++'s hierarchical collectives); false for flat collectives (fsdp-rs)";
    FsdpCommBackend: "fsdp_comm_backend", Fsdp, Kind::Choice(fsdp_comm::BackendChoice::NAMES),
        D::Text("auto"), Some("FSDP_COMM_BACKEND"), &[], Used,
        "engine carrying collectives: auto (shared memory on one host, MPI across hosts under mpirun, else TCP), shm, tcp, mpi (fsdp-rs)";
    FsdpOffloadDir: "fsdp_offload_dir", Fsdp, Kind::Text, D::Unset, Some("FSDP_OFFLOAD_DIR"),
        &[], Used,
        "local folder where offloaded state lives in private per-job files: with fsdp_offload_params, parameter shards, gradients and optimizer state; with fsdp_offload_optimizer, the optimizer state (fsdp-rs)";
    FsdpOffloadOptimizer: "fsdp_offload_optimizer", Fsdp, Kind::Bool, D::Bool(false),
        Some("FSDP_OFFLOAD_OPTIMIZER"), &[], Used,
        "keep only the optimizer state in fsdp_offload_dir (DeepSpeed's offload_optimizer; fsdp-rs)";
}

impl Key {
    /// Every key in table order.
    pub fn all() -> impl Iterator<Item = Key> {
        SPECS.iter().map(|s| s.key)
    }

    /// What the schema knows about this key.
    pub fn spec(self) -> &'static KeySpec {
        &SPECS[self as usize]
    }

    /// The YAML name.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// Looks a YAML name or alias up within a section.
    pub fn from_yaml_name(section: Section, name: &str) -> Option<Key> {
        SPECS
            .iter()
            .find(|s| s.section == section && (s.name == name || s.aliases.contains(&name)))
            .map(|s| s.key)
    }

    /// Looks an environment variable up.
    pub fn from_env_var(var: &str) -> Option<Key> {
        SPECS.iter().find(|s| s.env == Some(var)).map(|s| s.key)
    }
}

/// The YAML name of the nested FSDP section.
pub const FSDP_SECTION: &str = "fsdp_config";

/// The valid names in a section (including aliases), for "did you mean" suggestions.
pub fn names_in(section: Section) -> impl Iterator<Item = &'static str> {
    SPECS
        .iter()
        .filter(move |s| s.section == section)
        .flat_map(|s| std::iter::once(s.name).chain(s.aliases.iter().copied()))
        .chain((section == Section::Top).then_some(FSDP_SECTION))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_indexed_by_key() {
        for (i, spec) in SPECS.iter().enumerate() {
            assert_eq!(spec.key as usize, i, "{}", spec.name);
        }
    }

    #[test]
    fn names_and_env_vars_are_unique() {
        let mut names: Vec<_> = SPECS
            .iter()
            .flat_map(|s| std::iter::once(s.name).chain(s.aliases.iter().copied()))
            .collect();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n);
        let mut envs: Vec<_> = SPECS.iter().filter_map(|s| s.env).collect();
        let n = envs.len();
        envs.sort();
        envs.dedup();
        assert_eq!(envs.len(), n);
    }

    #[test]
    fn choice_defaults_are_valid_choices() {
        for spec in SPECS {
            if let (Kind::Choice(names), DefaultValue::Text(d)) = (spec.kind, spec.default) {
                assert!(names.contains(&d), "{}", spec.name);
            }
        }
    }
}
