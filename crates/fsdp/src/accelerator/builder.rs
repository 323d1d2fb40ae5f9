//! [`AcceleratorBuilder`]: the settings a program makes in code (the FSDP plugin, gradient
//! accumulation, loss scaling, where checkpoints and metrics go, trackers, the seed), over
//! what the launch environment says, and joining the job with them.

use std::path::PathBuf;
use std::sync::Arc;

use fsdp_comm::Communicator;

use super::logging::init_logging;
use super::tracking::Tracker;
use super::{Accelerator, AcceleratorError};
use crate::config::{FsdpPluginBuilder, Layer};
use crate::engine::GradScalerConfig;

/// Where checkpoints go, as Accelerate's `ProjectConfiguration`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProjectConfiguration {
    /// The project's folder (metrics and numbered checkpoints go in it).
    pub project_dir: PathBuf,
    /// Save into `project_dir/checkpoints/checkpoint_<n>`.
    pub automatic_checkpoint_naming: bool,
    /// With automatic naming, keep at most this many checkpoints.
    pub total_limit: Option<usize>,
}

impl Default for ProjectConfiguration {
    fn default() -> Self {
        ProjectConfiguration {
            project_dir: PathBuf::from("."),
            automatic_checkpoint_naming: false,
            total_limit: None,
        }
    }
}

/// How full state dicts are gathered (Accelerate's `FullStateDictConfig`): fsdp-rs always
/// gathers onto rank 0 only, into host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullStateDictConfig {
    /// Gather into host memory (on the CPU it always is).
    pub offload_to_cpu: bool,
    /// Only rank 0 holds the full state.
    pub rank0_only: bool,
}

impl Default for FullStateDictConfig {
    fn default() -> Self {
        FullStateDictConfig {
            offload_to_cpu: true,
            rank0_only: true,
        }
    }
}

/// Settings made in code, over what the environment (`fsdp launch`) says.
#[derive(Default)]
pub struct AcceleratorBuilder {
    plugin: Option<FsdpPluginBuilder>,
    accumulation: Option<usize>,
    sync_each_batch: bool,
    grad_scaler: Option<GradScalerConfig>,
    project: Option<ProjectConfiguration>,
    full_state_dict: Option<FullStateDictConfig>,
    trackers: Vec<Tracker>,
    seed: u64,
    skip_non_finite_steps: bool,
    group: Option<Arc<dyn Communicator>>,
}

impl AcceleratorBuilder {
    /// Runs over `group` instead of joining the job from the environment (a group the
    /// program already joined, or threads as peers in tests).
    pub fn communicator(mut self, group: Arc<dyn Communicator>) -> Self {
        self.group = Some(group);
        self
    }

    /// FSDP settings in code (the strongest source, as Accelerate's
    /// `FullyShardedDataParallelPlugin`).
    pub fn fsdp_plugin(mut self, plugin: FsdpPluginBuilder) -> Self {
        self.plugin = Some(plugin);
        self
    }

    /// Optimizer steps every `n` backward passes (gradients summed in between).
    pub fn gradient_accumulation_steps(mut self, n: usize) -> Self {
        self.accumulation = Some(n);
        self
    }

    /// Reduces gradients after every micro-batch of an accumulation (Accelerate's
    /// `GradientAccumulationPlugin(sync_each_batch=True)`): only this rank's rows are kept
    /// in between, at the price of a reduction per micro-batch. Off by default, as in
    /// Accelerate: micro-batches before the last run without sync (`no_sync`), keeping whole
    /// local gradients and reducing once — except with parameters offloaded to disk
    /// (`fsdp_offload_dir`), where whole gradients would not fit either, so every micro-batch
    /// reduces (DeepSpeed ZeRO's way).
    pub fn sync_each_batch(mut self, on: bool) -> Self {
        self.sync_each_batch = on;
        self
    }

    /// fp16 loss scaling settings (Accelerate's `GradScalerKwargs`); PyTorch's defaults
    /// otherwise. Only used with `mixed_precision: fp16`.
    pub fn grad_scaler(mut self, config: GradScalerConfig) -> Self {
        self.grad_scaler = Some(config);
        self
    }

    /// Where checkpoints and metrics go.
    pub fn project_config(mut self, project: ProjectConfiguration) -> Self {
        self.project = Some(project);
        self
    }

    /// How full state dicts are gathered (only `rank0_only: true` is possible).
    pub fn full_state_dict_config(mut self, config: FullStateDictConfig) -> Self {
        self.full_state_dict = Some(config);
        self
    }

    /// Writes metrics given to [`Accelerator::log`] as JSON lines in the project folder
    /// (`log_with(&[Tracker::JsonLines])`; `false` logs nowhere).
    pub fn log_metrics(self, on: bool) -> Self {
        self.log_with(if on { &[Tracker::JsonLines] } else { &[] })
    }

    /// The trackers [`Accelerator::log`] writes to (Accelerate's `log_with`), in the run
    /// folder [`Accelerator::init_trackers`] names under the project folder.
    pub fn log_with(mut self, trackers: &[Tracker]) -> Self {
        self.trackers = trackers.to_vec();
        self
    }

    /// The run's seed (recorded in checkpoints with the step, from which programs derive
    /// their dropout and shuffling).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Skips an optimizer step whose gradients hold a NaN or inf on some rank (with a
    /// warning naming the parameter; the scheduler does not step, as with fp16's
    /// overflows) instead of failing with [`AcceleratorError::NonFiniteGradient`]. Off by
    /// default: a diverged run stops with its weights finite.
    pub fn skip_non_finite_steps(mut self, skip: bool) -> Self {
        self.skip_non_finite_steps = skip;
        self
    }

    /// Joins the job (or starts a job of one) and resolves the configuration.
    pub fn build(self) -> Result<Accelerator, AcceleratorError> {
        // Before the communication threads start: they must share the training thread's heap.
        crate::memory::retain_freed_memory();
        let resolved = self
            .plugin
            .unwrap_or_default()
            .resolve(&Layer::from_process_env()?, None)?;
        if let Some(c) = self.full_state_dict
            && !c.rank0_only
        {
            return Err(AcceleratorError::FullStateDictOnEveryRank);
        }
        let (group, notice) = match self.group {
            Some(g) => (g, None),
            None => {
                let joined = fsdp_comm::join_job()?;
                (joined.group, joined.selection.notice)
            }
        };
        // This process's place on its machine, as the launch environment gives it
        // (`fsdp launch`, srun, mpirun or mpiexec; LOCAL_RANK alone missed the cluster
        // launchers, where every process took itself for its machine's first).
        let world =
            fsdp_comm::WorldInfo::from_env().map_err(AcceleratorError::LaunchEnvironment)?;
        let (local_rank, restart_count) = (world.local_rank, world.restart_count);
        let device = super::device::compute_device(resolved.launch.use_cpu, local_rank)?;
        let accumulation = self.accumulation.unwrap_or(1).max(1);
        let rank = group.rank();
        init_logging((!world.output_prefixed).then_some(rank));
        if let Some(notice) = notice
            && rank == 0
        {
            tracing::info!("{notice}");
        }
        tracing::debug!(
            rank,
            processes = group.size(),
            local_rank,
            strategy = %resolved.fsdp.sharding_strategy,
            accumulation,
            "joined the job"
        );
        let on_disk = resolved.fsdp.offload_params && resolved.fsdp.offload_dir.is_some();
        if on_disk && accumulation > 1 && !self.sync_each_batch {
            tracing::info!(
                "gradient accumulation with parameters offloaded to disk reduces every micro-batch (sync_each_batch): whole local gradients kept without sync would need the memory offloading saves"
            );
        }
        Ok(Accelerator {
            group,
            restart_count,
            plugin: resolved.fsdp,
            local_rank,
            device,
            accumulation,
            sync_each_batch: self.sync_each_batch || on_disk,
            grad_scaler: self.grad_scaler.unwrap_or_default(),
            models: 0,
            optimizers: 0,
            sync: true,
            skipped: false,
            skip_non_finite_steps: self.skip_non_finite_steps,
            steps: 0,
            project: self.project.unwrap_or_default(),
            trackers: self.trackers,
            active_trackers: std::sync::Mutex::new(None),
            seed: self.seed,
            pending_save: std::sync::Mutex::new(None),
            output_lock: std::sync::Mutex::new(None),
        })
    }
}
