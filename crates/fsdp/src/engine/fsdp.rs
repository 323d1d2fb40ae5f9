//! [`Fsdp`]: a model's parameters sharded on dim 0 per unit over a [`Mesh`], each rank
//! keeping its rows. A training step is `begin_step` (units gathered as forward reaches
//! them), `backward` (units refilled and their gradients reduced as backward passes them,
//! see `engine::step`; the engine holds the reduced sum until the step), and `step`
//! (the optimizer on this rank's rows only).
//!
//! FULL_SHARD frees a unit's full parameters after its forward and again after its backward;
//! SHARD_GRAD_OP keeps them from forward through backward and frees them after; NO_SHARD keeps
//! whole parameters on every rank and all-reduces gradients (DDP).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use candle_core::Tensor;
use fsdp_comm::{Communicator, CommunicatorExt, Mesh, ReduceOp};

use super::collectives::CommDtypes;
use super::data_plane::DataPlane;
use super::error::EngineError;
use super::grads::{Accumulated, GradIndex, GradPlace, Gradients};
use super::intake::WeightIntake;
use super::offload::Placement;
use super::param::FsdpParam;
use super::plan::{ShardLayout, UnitKind, UnitPlan};
use super::shared_gather::GatherBlocks;
use super::step::{ReducedGrads, StepOptions, StepParams, StepShared};
use super::unit::{FsdpUnit, IGNORED_MODULES, Prefetch};
use super::{ShardStore, StateOnDisk};
use crate::config::{CheckpointFormat, FsdpPlugin, StateDictType};
use crate::nn::{Model, ModuleInfo, ParamSpec, WeightSource};
use crate::optim::Optimizer;
use crate::trace::Tracer;

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Bytes of live allocations as the update began (parameters, gradients, and the
    /// optimizer's state from the second step on), measured by
    /// [`crate::memory::CountingAllocator`] when the program installed it.
    pub resident_bytes: Option<usize>,
}

/// A model's parameters sharded over a mesh.
pub struct Fsdp {
    pub(crate) plan: UnitPlan,
    pub(crate) mesh: Mesh,
    /// Poison released parameters with NaN instead of returning their memory, and check the
    /// graph before backward.
    debug: bool,
    prefetch: Prefetch,
    dtypes: CommDtypes,
    /// The plan's units, then (when the plan ignores modules) the unit of the ignored
    /// modules' parameters, whole on every rank ([`UnitKind::Replicated`]).
    pub(crate) units: Vec<Arc<FsdpUnit>>,
    /// Where state is stored and where steps compute (`fsdp_offload_params`).
    pub(crate) placement: Placement,
    /// What moves parameters and gradients in the compute device's memory.
    plane: Arc<dyn DataPlane>,
    /// The shard group's shared blocks that units are gathered through where they can
    /// (every rank on this host).
    gather_blocks: Option<Arc<GatherBlocks>>,
    pub(crate) grad_index: Arc<GradIndex>,
    state_dict_type: StateDictType,
    checkpoint_format: CheckpointFormat,
    /// Where this rank's timeline is recorded (`fsdp_trace_dir`).
    tracer: Option<Arc<Tracer>>,
    /// Gradients accumulated over micro-batches (held until the step): each unit's whole local
    /// gradients kept by backwards without sync for the next reduction, and the reduced
    /// rows of backwards with sync that no step has taken yet.
    pub(crate) accumulated: Accumulated,
    /// `fsdp_activation_checkpointing`.
    checkpointing: bool,
    /// Units recomputed in backward so far (activation checkpointing).
    recomputed: Arc<AtomicU64>,
    /// Per unit: whether running it without reporting its output was warned about.
    unhooked_reported: Arc<[AtomicBool]>,
    /// Optimizer state in the disk tier (`fsdp_offload_dir`; the tier holds the shards too
    /// with `fsdp_offload_params`, through the units' [`ShardStore`]).
    pub(crate) state_on_disk: Option<StateOnDisk>,
}

impl Fsdp {
    /// Shards `initial` (every parameter of `model`, identical on every rank unless
    /// `fsdp_sync_module_states` makes them so; with `fsdp_cpu_ram_efficient_loading` only
    /// rank 0 reads it, a unit at a time, and the others receive their rows) across the
    /// ranks of `group` per `plugin`:
    /// over all of them for FULL_SHARD and SHARD_GRAD_OP (in two hops, inside each machine and
    /// across, when they span machines: `fsdp_hierarchical_collectives`), none for NO_SHARD,
    /// and for the
    /// hybrid strategies over the processes of each machine (`LOCAL_WORLD_SIZE`, as
    /// `fsdp launch` sets it), replicated across machines.
    pub fn new(
        model: &ModuleInfo,
        initial: &dyn WeightSource,
        plugin: &FsdpPlugin,
        default_wrap: &[&str],
        group: Arc<dyn Communicator>,
    ) -> Result<Fsdp, EngineError> {
        let mesh = super::mesh_layout::build(plugin, group)?;
        Fsdp::with_mesh(model, initial, plugin, default_wrap, mesh)
    }

    /// [`Fsdp::new`] for a [`Model`] (its module tree and default units).
    pub fn wrap(
        model: &dyn Model,
        initial: &dyn WeightSource,
        plugin: &FsdpPlugin,
        group: Arc<dyn Communicator>,
    ) -> Result<Fsdp, EngineError> {
        Fsdp::new(
            &model.info(),
            initial,
            plugin,
            model.no_split_modules(),
            group,
        )
    }

    /// [`Fsdp::new`] on a mesh built by the caller: parameters sharded over `mesh.shard`,
    /// gradients also averaged over `mesh.replicate`.
    pub fn with_mesh(
        model: &ModuleInfo,
        initial: &dyn WeightSource,
        plugin: &FsdpPlugin,
        default_wrap: &[&str],
        mesh: Mesh,
    ) -> Result<Fsdp, EngineError> {
        let dtypes = CommDtypes::for_plugin(plugin);
        let mesh = super::secondary::attach(plugin, mesh)?;
        crate::memory::retain_freed_memory();
        let plan = UnitPlan::build(model, plugin, default_wrap, mesh.shard_size())?;
        super::sparse_rows::refuse_hybrid(&plan, &mesh)?;
        let placement = Placement::new(initial.device(), plugin.offload_params);
        let plane = placement.data_plane()?;
        placement.warn_once(plugin.offload_dir.is_some());
        let specs: HashMap<&str, &ParamSpec> = model
            .all_params()
            .into_iter()
            .map(|p| (p.name.as_str(), p))
            .collect();
        let intake = WeightIntake {
            source: initial,
            specs,
            mesh: &mesh,
            sync: plugin.sync_module_states && mesh.world_size() > 1,
            rank0_only: plugin.cpu_ram_efficient_loading && mesh.world_size() > 1,
        };
        let rank = mesh.shard.rank();
        let reshard = mesh.shard_size() > 1;
        let tier = super::offload::from_plan::offload_tier(plugin, &plan, &mesh)?;
        // Where the shards live between steps: the tier when it holds parameters too.
        let shard_store = match tier.as_ref().filter(|t| t.params) {
            Some(tier) => ShardStore::Disk(tier.clone()),
            None => ShardStore::Memory,
        };
        let mut units = Vec::with_capacity(plan.units.len() + 1);
        // Unit `u`'s parameters from their `rows` on this `rank`.
        let shard_params = |layouts: &[ShardLayout], rows: Vec<Vec<f32>>, rank| {
            let storage = || placement.storage.clone();
            let params = layouts.iter().zip(rows);
            params
                .map(|(layout, rows)| FsdpParam::from_rows(layout.clone(), rows, rank, storage()))
                .collect::<Result<Vec<_>, _>>()
        };
        for (u, unit) in plan.units.iter().enumerate() {
            let mut params = shard_params(&unit.params, intake.unit_rows(unit)?, rank)?;
            shard_store.take_shards(u, &mut params)?;
            units.push(Arc::new(FsdpUnit::new(
                unit.path.clone(),
                u,
                shard_store.clone(),
                params,
                (reshard && unit.reshard_after_forward, reshard),
                (UnitKind::Sharded, mesh.shard_size()),
            )));
        }
        if !plan.ignored.is_empty() {
            // The ignored modules' parameters: one unit, whole on every rank (rank 0's rows of
            // a one-rank layout are all of them).
            let whole = plan.ignored.iter().map(|l| intake.whole(l));
            let params = shard_params(&plan.ignored, whole.collect::<Result<_, _>>()?, 0)?;
            let (path, u) = (IGNORED_MODULES.to_string(), units.len());
            units.push(Arc::new(FsdpUnit::new(
                path,
                u,
                ShardStore::Memory,
                params,
                (false, false),
                (UnitKind::Replicated, mesh.shard_size()),
            )));
        }
        // Every parameter by name: its unit, and its rows in the unit's gradient block.
        let mut grad_index = HashMap::new();
        for (u, unit) in units.iter().enumerate() {
            for (i, p) in unit.params.iter().enumerate() {
                let elements = unit.grad_elements(i);
                let place = GradPlace {
                    unit: u,
                    param: i,
                    elements,
                };
                grad_index.insert(p.layout.name.clone(), place);
            }
        }
        // The units gathered over the shard group (not the ignored modules', whole everywhere).
        let sharded = units.iter().filter(|u| u.kind == UnitKind::Sharded);
        let blocks: Vec<usize> = sharded.map(|u| u.gather_block).collect();
        let on_disk = matches!(shard_store, ShardStore::Disk(_));
        let gather_blocks = GatherBlocks::for_units(&mesh, dtypes, &blocks, on_disk)?;
        let unhooked_reported = units.iter().map(|_| AtomicBool::new(false)).collect();
        let tracer = match &plugin.trace_dir {
            Some(dir) => Some(Arc::new(Tracer::create(dir, mesh.rank()).map_err(
                |source| EngineError::Trace {
                    dir: dir.clone(),
                    source,
                },
            )?)),
            None => None,
        };
        Ok(Fsdp {
            plan,
            mesh,
            debug: plugin.debug,
            prefetch: Prefetch {
                forward: plugin.forward_prefetch,
                backward: plugin.backward_prefetch,
                forward_order: Vec::new(),
            },
            dtypes,
            units,
            placement,
            plane,
            gather_blocks,
            grad_index: Arc::new(grad_index),
            state_dict_type: plugin.state_dict_type,
            checkpoint_format: plugin.checkpoint_format,
            tracer,
            accumulated: Accumulated::default(),
            checkpointing: plugin.activation_checkpointing,
            recomputed: Arc::default(),
            unhooked_reported,
            state_on_disk: tier.map(StateOnDisk::new),
        })
    }

    /// The plan in use.
    pub fn plan(&self) -> &UnitPlan {
        &self.plan
    }

    /// How checkpoints of this model are cut (`fsdp_state_dict_type`).
    pub(crate) fn state_dict_type(&self) -> StateDictType {
        self.state_dict_type
    }

    /// Where this rank's timeline is recorded, when `fsdp_trace_dir` is set.
    pub(crate) fn tracer(&self) -> Option<&Tracer> {
        self.tracer.as_deref()
    }

    /// The files its SHARDED_STATE_DICT checkpoints are written as (`fsdp_checkpoint_format`).
    pub(crate) fn checkpoint_format(&self) -> CheckpointFormat {
        self.checkpoint_format
    }

    /// Where state is stored and where steps compute.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The disk tier's folder and what it has moved, when state is offloaded to disk.
    pub fn offload(&self) -> Option<(&std::path::Path, super::OffloadStats)> {
        self.state_on_disk.as_ref().map(StateOnDisk::stats)
    }

    /// This rank's bytes of shared memory that units are gathered through (0 where the
    /// shard group's ranks share no memory, or gathers cannot go through it): resident
    /// outside the heap, so not in the counting allocator's figures.
    pub fn shared_gather_bytes(&self) -> usize {
        self.gather_blocks.as_ref().map_or(0, |b| b.bytes())
    }

    /// The mesh: `shard` (the ranks a parameter is split over) and `replicate`.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// How many unit forwards activation checkpointing has recomputed in backward so far.
    pub fn recomputed_units(&self) -> u64 {
        self.recomputed.load(Ordering::Relaxed)
    }

    /// Turns debug mode on or off (the `debug` setting, `ACCELERATE_DEBUG_MODE=true`):
    /// released parameters are poisoned with NaN, and the graph is checked before backward.
    pub fn set_debug(&mut self, on: bool) {
        self.debug = on;
    }

    /// Starts a training step: the returned parameters gather each unit when forward first
    /// reads it. One step is open at a time (the units hold its state): refused with
    /// [`EngineError::StepOpen`] while another step's parameters are held; a step ends at
    /// its backward, or when its parameters are dropped.
    pub fn begin_step(&self) -> Result<StepParams, EngineError> {
        self.begin(true, false)
    }

    /// Starts an evaluation forward: no graph is recorded (outputs carry no gradient), so
    /// nothing waits for a backward; units are gathered and released as in training, or with
    /// `hold` kept gathered until the parameters drop (many passes in a row: generation).
    /// Refused like [`Fsdp::begin_step`] while another step is open.
    pub fn begin_eval(&self, hold: bool) -> Result<StepParams, EngineError> {
        self.begin(false, hold)
    }

    fn begin(&self, train: bool, hold: bool) -> Result<StepParams, EngineError> {
        if super::unit::in_step(&self.units) {
            return Err(EngineError::StepOpen {
                op: if train {
                    "a training forward"
                } else {
                    "an evaluation"
                },
            });
        }
        for unit in &self.units {
            unit.reset_step();
        }
        let opts = StepOptions {
            debug: self.debug,
            dtypes: self.dtypes,
            device: self.placement.compute.clone(),
            train,
            hold,
            checkpointing: self.checkpointing,
            recomputed: self.recomputed.clone(),
            unhooked_reported: self.unhooked_reported.clone(),
            trace: self.tracer.clone(),
        };
        if let (true, Some(t)) = (train, &self.tracer) {
            t.begin_step();
        }
        let shared = StepShared::new(
            self.mesh.clone(),
            (self.plane.clone(), self.gather_blocks.clone()),
            self.units.clone(),
            self.prefetch.clone(),
            opts,
        );
        Ok(StepParams { shared })
    }

    /// Runs backward (see [`Fsdp::backward`]): returns the units' reductions (none without
    /// `sync`).
    pub(crate) fn run_backward(
        &mut self,
        params: &StepParams,
        loss: Tensor,
        sync: bool,
    ) -> Result<ReducedGrads, EngineError> {
        let shared = params.shared.clone();
        shared.plan_backward(&loss)?;
        let carried = std::mem::take(&mut self.accumulated.unreduced);
        shared.begin_backward(sync, carried);
        if self.debug
            && let Some(problem) = shared.diagnose_non_finite(&loss)
        {
            return Err(problem);
        }
        let store = match loss.backward() {
            Ok(store) => store,
            Err(e) => return Err(shared.take_error().unwrap_or(EngineError::Tensor(e))),
        };
        drop(store);
        drop(loss);
        let reduced = shared.finish()?;
        self.prefetch.forward_order = shared.forward_order();
        Ok(reduced)
    }

    /// Refuses a step on gradients with a NaN or inf on any rank, naming the first such
    /// parameter in the plan's order (every rank the same one), before anything is
    /// updated: a diverged run stops with its weights finite instead of training on NaN.
    /// Collective (one all-reduce of one number) unless a finite norm proved them finite.
    fn check_finite(&self, grads: &Gradients) -> Result<(), EngineError> {
        if grads.known_finite {
            return Ok(());
        }
        // The parameter's place in the plan's order (units, then their parameters): the same
        // numbering on every rank, so the smallest is the first such parameter anywhere.
        let offsets: Vec<usize> = self
            .units
            .iter()
            .scan(0, |at, u| {
                let first = *at;
                *at += u.params.len();
                Some(first)
            })
            .collect();
        let mine = grads.first_non_finite()?.map_or(f64::MAX, |(u, p)| {
            (offsets.get(u).copied().unwrap_or_default() + p) as f64
        });
        let first = self
            .mesh
            .all_reduce(fsdp_comm::Buffer::F64(vec![mine]), ReduceOp::Min)?;
        let first = first
            .as_slice::<f64>()
            .and_then(|v| v.first().copied())
            .unwrap_or(f64::MAX);
        if first == f64::MAX {
            return Ok(());
        }
        let name = self
            .units
            .iter()
            .flat_map(|u| &u.params)
            .nth(first as usize)
            .map_or_else(
                || format!("parameter number {first} of the plan"),
                |p| p.layout.name.clone(),
            );
        Err(EngineError::NonFiniteGradient { name })
    }

    /// Updates this rank's rows with `optimizer` from the held gradients (taken: the next
    /// step needs a new backward). Parameters that received no gradient are left alone, as
    /// PyTorch's optimizers do. Gradients with a NaN or inf on any rank are refused on every
    /// rank ([`EngineError::NonFiniteGradient`]) before anything is updated, and dropped.
    /// Refused ([`EngineError::StepOpen`], gradients kept) while a step's parameters are
    /// held.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<StepReport, EngineError> {
        if super::unit::in_step(&self.units) {
            return Err(EngineError::StepOpen {
                op: "the optimizer step",
            });
        }
        let Some(mut grads) = self.accumulated.reduced.take() else {
            return Err(EngineError::NoGradients { op: "step" });
        };
        self.check_finite(&grads)?;
        let resident_bytes = crate::memory::counting().then(crate::memory::resident_bytes);
        let began = std::time::Instant::now();
        if let Some(state) = &mut self.state_on_disk {
            state.step(&mut self.units, &mut grads, optimizer)?;
        }
        // The unit the next forward gathers first is updated first and its gather issued at
        // once, so it crosses the wire while the rest is updated.
        let first = self.prefetch.forward_order.first().copied();
        let rest = (0..self.units.len()).filter(|&u| Some(u) != first);
        for u in first.into_iter().chain(rest) {
            let (Some(reduced), Some(has_grad)) = (grads.units.get(u), grads.has_grad.get(u))
            else {
                continue;
            };
            if let Some(reduced) = reduced.as_ref().and_then(|r| r.memory()) {
                let unit = super::unit::exclusive(&mut self.units[u], "the optimizer step")?;
                unit.update(reduced, has_grad, optimizer)?;
            }
            if Some(u) == first {
                let blocks = self.gather_blocks.as_ref();
                self.units[u].gather_ahead(&self.mesh, self.dtypes, blocks)?;
            }
        }
        if let Some(t) = &self.tracer {
            let args = serde_json::json!({ "optimizer": optimizer.name() });
            t.since("optimizer step", "optimizer", began, args);
            t.end_step();
        }
        drop(grads);
        Ok(StepReport { resident_bytes })
    }

    // The gradients the engine holds between backward and the optimizer step, as FSDP2
    // keeps them on the parameters: a backward with sync reduces each unit's gradients (with
    // whatever earlier backwards without sync kept) and adds the reduced rows to the sum no
    // step has taken yet; one without sync (`no_sync`) adds each unit's whole local
    // gradients to what it carries to the next reduction. Clipping, fp16 unscaling and the
    // step act on the held sum; `zero_grad` drops it.

    /// Back-propagates `loss` (consumed, so the graph is freed when this returns): plans the
    /// units' backward order from the graph (and, in debug mode, checks it) and runs
    /// backward with each unit refilled before and its gradients packed right after its
    /// gradient computation. With `sync` each unit's gradients, and those earlier backwards
    /// without sync kept, are reduced in one collective and added to the held sum
    /// ([`Fsdp::gradients`]); without, they are kept whole per unit for the next backward
    /// with sync (`no_sync`: fewer bytes on the wire, whole gradients held meanwhile).
    /// Scale each micro-batch's loss as the accumulation needs: nothing is scaled here.
    ///
    /// ```no_run
    /// # fn step(engine: &mut fsdp::engine::Fsdp, model: &impl fsdp::nn::Forward<fsdp::nn::candle::Tensor, Output = fsdp::nn::candle::Tensor>, x: &fsdp::nn::candle::Tensor, optimizer: &mut dyn fsdp::optim::Optimizer) -> Result<(), Box<dyn std::error::Error>> {
    /// let params = engine.begin_step()?;
    /// let loss = model.forward(&params, x.clone())?.sqr()?.mean_all()?;
    /// engine.backward(params, loss, true)?;
    /// engine.clip_grad_norm(Some(1.0))?;
    /// engine.step(optimizer)?;
    /// # Ok(()) }
    /// ```
    pub fn backward(
        &mut self,
        params: StepParams,
        loss: Tensor,
        sync: bool,
    ) -> Result<(), EngineError> {
        let (units, has_grad) = self.run_backward(&params, loss, sync)?;
        if !sync {
            self.accumulated.unreduced = params.shared.take_unreduced();
            return Ok(());
        }
        drop(params);
        let grads = Gradients {
            units,
            has_grad,
            kinds: self.units.iter().map(|u| u.kind).collect(),
            index: self.grad_index.clone(),
            known_finite: false,
        };
        match self.accumulated.reduced.as_mut() {
            Some(sum) => sum.accumulate(grads),
            None => {
                self.accumulated.reduced = Some(grads);
                Ok(())
            }
        }
    }

    /// Bytes of gradients kept by backwards without sync, waiting for one with sync.
    pub fn unreduced_bytes(&self) -> usize {
        self.accumulated
            .unreduced
            .iter()
            .flatten()
            .map(|(b, _)| b.len() * b.dtype().size())
            .sum()
    }

    /// This rank's reduced gradients held for the next step, by parameter name; `None`
    /// before any backward with sync.
    pub fn gradients(&self) -> Option<&Gradients> {
        self.accumulated.reduced.as_ref()
    }

    /// The held gradients, writable (a caller's own scaling or clipping).
    pub fn gradients_mut(&mut self) -> Option<&mut Gradients> {
        self.accumulated.reduced.as_mut()
    }

    /// Drops the held gradients (`optimizer.zero_grad()`).
    pub fn zero_grad(&mut self) {
        self.accumulated.reduced = None;
    }

    /// The global norm of the held gradients (over every parameter on every rank: shards'
    /// squares summed over the shard group, whole copies counted once), and, when
    /// `max_norm` is set, the gradients multiplied by `min(1, max_norm / (norm + 1e-6))` in
    /// f32, as PyTorch's `clip_grad_norm_` does (so a norm at the limit is still scaled, by
    /// a hair); whether they were scaled. Collective.
    pub fn clip_grad_norm(&mut self, max_norm: Option<f64>) -> Result<(f64, bool), EngineError> {
        self.with_gradients("clip_grad_norm", |engine, grads| {
            let (mut sharded_sq, replicated_sq) = grads.squares()?;
            if engine.mesh.shard_size() > 1 {
                sharded_sq = engine
                    .mesh
                    .shard
                    .all_reduce_vec(vec![sharded_sq], ReduceOp::Sum)
                    .wait()?[0];
            }
            let norm = (sharded_sq + replicated_sq).sqrt();
            let scale = match max_norm {
                Some(max) => (max as f32 / (norm as f32 + 1e-6)).min(1.0),
                None => 1.0,
            };
            if scale < 1.0 {
                grads.scale(scale)?;
            }
            grads.known_finite = norm.is_finite();
            Ok((norm, scale < 1.0))
        })
    }

    /// Runs `f` (operation `op`) on the engine and its held gradients (a collective may
    /// need both); [`EngineError::NoGradients`] when none are held.
    pub(crate) fn with_gradients<T>(
        &mut self,
        op: &'static str,
        f: impl FnOnce(&Fsdp, &mut Gradients) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let Some(mut grads) = self.accumulated.reduced.take() else {
            return Err(EngineError::NoGradients { op });
        };
        let out = f(self, &mut grads);
        self.accumulated.reduced = Some(grads);
        out
    }
}
