//! The typed settings the launcher and the engine use: [`LaunchSettings`] and [`FsdpPlugin`]
//! (what [`super::ResolvedConfig`] holds after merging and checking every source).

use super::choices::{
    AllGatherDtype, AutoWrapPolicy, BackwardPrefetch, CheckpointFormat, DistributedType,
    MixedPrecision, ReduceDtype, ShardingStrategy, StateDictType,
};

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

    /// Processes per machine when `strategy`'s shard group spans several machines of two or
    /// more processes (two-hop collectives carry its gathers and reductions there unless
    /// `fsdp_hierarchical_collectives` is false); 1 otherwise.
    pub fn two_hop_machine_size(&self, strategy: ShardingStrategy) -> usize {
        let (shard, _) = self.mesh_shape(strategy);
        machines_spanned(shard, self.processes_per_machine()).unwrap_or(1)
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

/// The processes of each machine when a shard group of `group` ranks (numbered machine by
/// machine) spans several machines of `per_machine` ≥ 2 processes each, the rule two-hop
/// collectives go by; `None` when the group fits on one machine or a machine holds one.
pub(crate) fn machines_spanned(group: usize, per_machine: usize) -> Option<usize> {
    let spans = per_machine >= 2 && per_machine < group && group.is_multiple_of(per_machine);
    spans.then_some(per_machine)
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
    /// Gathers and reductions of a shard group that spans machines run in two hops, inside
    /// each machine then across (`fsdp_hierarchical_collectives`, on unless set false).
    pub hierarchical_collectives: bool,
    /// Check FSDP state transitions and poison released parameters (the `debug` key).
    pub debug: bool,
}
