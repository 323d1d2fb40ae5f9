//! The FSDP engine: parameters sharded on dim 0 per unit, each rank keeping its rows and its
//! optimizer state; a training step is `begin_step` (units gathered as forward reaches them),
//! `backward` (units refilled and their gradients reduce-scattered as backward passes them,
//! see `engine::step`), and `step` (global gradient-norm clipping and the optimizer on the
//! local shards only).
//!
//! FULL_SHARD frees a unit's full parameters after its forward and again after its backward;
//! SHARD_GRAD_OP keeps them from forward through backward and frees them after; NO_SHARD keeps
//! whole parameters on every rank and all-reduces gradients (DDP).

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use fsdp_comm::{ProcessGroup, ReduceOp};

use super::plan::{PlanError, UnitPlan};
pub use super::step::StepParams;
use super::step::{StepOptions, StepShared, UnitSpec};
use crate::config::{BackwardPrefetch, FsdpPlugin, ShardingStrategy};
use crate::nn::ModuleInfo;
use crate::optim::{Optimizer, ParamState};

/// Why the engine stopped.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The unit plan could not be built.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A collective failed (names the rank and the op).
    #[error(transparent)]
    Comm(#[from] fsdp_comm::CommError),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    /// The initial weights do not match the model.
    #[error("initial weights: {0}")]
    Weights(String),
    /// The model was used against the engine's rules (a parameter outside its unit, a unit
    /// output not hooked, ...); names the parameter and unit.
    #[error("FSDP usage: {0}")]
    Usage(String),
    /// The optimizer's settings are invalid.
    #[error("optimizer: {0}")]
    Optimizer(String),
    /// A configured feature this engine does not provide yet: refused rather than ignored.
    #[error("{setting} is not supported by the FSDP engine yet; {hint}")]
    Unsupported {
        /// The setting as configured.
        setting: String,
        /// What to do instead.
        hint: &'static str,
    },
}

/// Refuses settings that would change results or memory but are not implemented yet.
fn check_supported(plugin: &FsdpPlugin) -> Result<(), EngineError> {
    let refuse = |setting: String, hint| Err(EngineError::Unsupported { setting, hint });
    if plugin.offload_params {
        return refuse("fsdp_offload_params: true".into(), "set it to false");
    }
    if plugin.mixed_precision != crate::config::MixedPrecision::No {
        return refuse(
            format!("mixed_precision: {}", plugin.mixed_precision),
            "train with mixed_precision: no (f32)",
        );
    }
    if plugin.activation_checkpointing {
        return refuse(
            "fsdp_activation_checkpointing: true".into(),
            "set it to false",
        );
    }
    if plugin.cpu_ram_efficient_loading {
        return refuse(
            "fsdp_cpu_ram_efficient_loading: true".into(),
            "set it to false (every rank loads the weights; fsdp_sync_module_states broadcasts rank 0's)",
        );
    }
    if plugin.sharding_strategy.is_hybrid() {
        return refuse(
            format!("fsdp_sharding_strategy: {}", plugin.sharding_strategy),
            "use FULL_SHARD or SHARD_GRAD_OP",
        );
    }
    Ok(())
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// The global gradient norm before clipping (over every parameter, all ranks).
    pub grad_norm: f64,
    /// Whether gradients were scaled down to `max_grad_norm`.
    pub clipped: bool,
    /// Bytes of live allocations just after the update, measured by
    /// [`crate::memory::CountingAllocator`] when the program installed it.
    pub resident_bytes: Option<usize>,
}

/// One backward's gradients, reduced: each rank holds the rows of the parameters it owns
/// (whole parameters with NO_SHARD). Dropping them is `zero_grad`.
pub struct Gradients {
    units: Vec<Option<Vec<f32>>>,
    has_grad: Vec<Vec<bool>>,
    replicated: BTreeMap<String, Vec<f32>>,
}

impl Gradients {
    /// Adds another backward's gradients (gradient accumulation over micro-batches).
    pub fn accumulate(&mut self, other: Gradients) {
        for (mine, theirs) in self.units.iter_mut().zip(other.units) {
            match (mine.as_mut(), theirs) {
                (Some(a), Some(b)) => a.iter_mut().zip(&b).for_each(|(x, y)| *x += y),
                (None, Some(b)) => *mine = Some(b),
                _ => {}
            }
        }
        for (mine, theirs) in self.has_grad.iter_mut().zip(other.has_grad) {
            mine.iter_mut().zip(theirs).for_each(|(a, b)| *a |= b);
        }
        for (name, g) in other.replicated {
            match self.replicated.get_mut(&name) {
                Some(a) => a.iter_mut().zip(&g).for_each(|(x, y)| *x += y),
                None => {
                    self.replicated.insert(name, g);
                }
            }
        }
    }

    /// Scales every gradient (e.g. by 1/accumulation steps).
    pub fn scale(&mut self, factor: f32) {
        self.units
            .iter_mut()
            .flatten()
            .chain(self.replicated.values_mut())
            .for_each(|g| g.iter_mut().for_each(|x| *x *= factor));
    }
}

/// This rank's shards of one unit, packed in the unit's parameter order (the all-gather's
/// input), shared with the step in flight without a copy.
struct UnitShards {
    packed: Arc<Vec<f32>>,
    /// Optimizer state per parameter, in the unit's order.
    optim: Vec<ParamState>,
}

/// A model's parameters sharded across a process group.
pub struct Fsdp {
    plan: UnitPlan,
    pg: Arc<ProcessGroup>,
    /// Poison released parameters with NaN instead of returning their memory, and check the
    /// graph before backward.
    debug: bool,
    forward_prefetch: bool,
    backward_prefetch: BackwardPrefetch,
    shards: Vec<UnitShards>,
    replicated: BTreeMap<String, (Var, ParamState)>,
    step: u64,
    device: Device,
    /// The previous step's forward order of units.
    forward_order: Vec<usize>,
}

impl Fsdp {
    /// Shards `initial` (every parameter of `model`, full, identical on every rank) across
    /// `pg` per `plugin`'s wrap policy.
    pub fn new(
        model: &ModuleInfo,
        initial: &BTreeMap<String, Tensor>,
        plugin: &FsdpPlugin,
        default_wrap: &[&str],
        pg: impl Into<Arc<ProcessGroup>>,
    ) -> Result<Fsdp, EngineError> {
        let pg: Arc<ProcessGroup> = pg.into();
        check_supported(plugin)?;
        crate::memory::retain_freed_memory();
        let plan = UnitPlan::build(model, plugin, default_wrap, pg.size())?;
        // fsdp_sync_module_states: every rank starts from rank 0's weights.
        let synced;
        let initial = if plugin.sync_module_states && pg.size() > 1 {
            let mut out = BTreeMap::new();
            for (name, t) in initial {
                let values: Vec<f32> = t
                    .flatten_all()?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1()?;
                let values = pg.broadcast(values, 0).wait()?;
                out.insert(
                    name.clone(),
                    Tensor::from_vec(values, t.dims(), t.device())?,
                );
            }
            synced = out;
            &synced
        } else {
            initial
        };
        let rank = pg.rank();
        let mut shards = Vec::with_capacity(plan.units.len());
        for unit in &plan.units {
            let mut packed = Vec::with_capacity(unit.shard_numel());
            for layout in &unit.params {
                let full = initial
                    .get(&layout.name)
                    .ok_or_else(|| EngineError::Weights(format!("missing {}", layout.name)))?;
                if full.dims() != layout.shape.as_slice() {
                    return Err(EngineError::Weights(format!(
                        "{} has shape {:?}, the model expects {:?}",
                        layout.name,
                        full.dims(),
                        layout.shape
                    )));
                }
                let values: Vec<f32> = full
                    .flatten_all()?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1()?;
                // NO_SHARD (group of one): every rank holds the whole parameter.
                let (start, end) = layout.rows_of(if plan.group_size == 1 { 0 } else { rank });
                let rows = &values[start * layout.row_elems..end * layout.row_elems];
                packed.extend_from_slice(rows);
                // Padding rows hold zeros (so squares and reductions ignore them).
                packed.resize(packed.len() + layout.shard_numel() - rows.len(), 0.0);
            }
            shards.push(UnitShards {
                packed: Arc::new(packed),
                optim: vec![ParamState::default(); unit.params.len()],
            });
        }
        let mut replicated = BTreeMap::new();
        for layout in &plan.ignored {
            let full = initial
                .get(&layout.name)
                .ok_or_else(|| EngineError::Weights(format!("missing {}", layout.name)))?;
            replicated.insert(
                layout.name.clone(),
                (
                    Var::from_tensor(&full.to_dtype(candle_core::DType::F32)?)?,
                    ParamState::default(),
                ),
            );
        }
        let device = initial
            .values()
            .next()
            .map_or(Device::Cpu, |t| t.device().clone());
        let debug = std::env::var("FSDP_DEBUG").is_ok_and(|v| v == "1")
            || std::env::var("ACCELERATE_DEBUG_MODE")
                .is_ok_and(|v| crate::config::parse_bool(&v) == Ok(true));
        Ok(Fsdp {
            plan,
            pg,
            debug,
            forward_prefetch: plugin.forward_prefetch,
            backward_prefetch: plugin.backward_prefetch,
            shards,
            replicated,
            step: 0,
            device,
            forward_order: Vec::new(),
        })
    }

    /// The plan in use.
    pub fn plan(&self) -> &UnitPlan {
        &self.plan
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// True when units are replicated rather than sharded (NO_SHARD, or one rank).
    fn replicated_units(&self) -> bool {
        self.plan.group_size == 1 || self.pg.size() == 1
    }

    /// Turns debug mode on or off (also `FSDP_DEBUG=1` or `ACCELERATE_DEBUG_MODE=true`):
    /// released parameters are poisoned with NaN, and the graph is checked before backward.
    pub fn set_debug(&mut self, on: bool) {
        self.debug = on;
    }

    /// Starts a step: the returned parameters gather each unit when forward first reads it.
    pub fn begin_step(&self) -> Result<StepParams, EngineError> {
        let sharded = !self.replicated_units();
        let units = self
            .plan
            .units
            .iter()
            .enumerate()
            .map(|(u, unit)| UnitSpec {
                path: unit.path.clone(),
                params: unit.params.clone(),
                packed: self.shards[u].packed.clone(),
                release_after_forward: sharded
                    && !unit.path.is_empty()
                    && matches!(
                        self.plan.strategy,
                        ShardingStrategy::FullShard | ShardingStrategy::HybridShard
                    ),
            })
            .collect();
        let opts = StepOptions {
            sharded,
            release_after_backward: sharded,
            forward_prefetch: self.forward_prefetch,
            backward_prefetch: self.backward_prefetch,
            debug: self.debug,
            device: self.device.clone(),
        };
        let shared = StepShared::new(self.pg.clone(), units, self.forward_order.clone(), opts);
        let replicated = self
            .replicated
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.as_tensor().clone()))
            .collect();
        Ok(StepParams { shared, replicated })
    }

    /// Back-propagates `loss` (consumed, so the graph is freed when this returns): plans the
    /// units' backward order from the graph (and, in debug mode, checks it), runs backward
    /// with each unit refilled before and reduced right after its gradient computation, and
    /// returns this rank's reduced gradients.
    pub fn backward(&mut self, params: StepParams, loss: Tensor) -> Result<Gradients, EngineError> {
        params
            .shared
            .plan_backward(&loss, self.debug)
            .map_err(EngineError::Usage)?;
        if self.debug {
            if let Some(problem) = params.shared.diagnose_non_finite(&loss) {
                return Err(EngineError::Usage(problem));
            }
        }
        let store = loss.backward()?;
        let mut pending = Vec::new();
        for (name, (var, _)) in &self.replicated {
            if let Some(g) = store.get(var) {
                let g: Vec<f32> = g.flatten_all()?.to_vec1()?;
                pending.push((name.clone(), self.pg.all_reduce(g, ReduceOp::Avg)));
            }
        }
        drop(store);
        drop(loss);
        let (units, has_grad) = params.shared.finish()?;
        self.forward_order = params.shared.forward_order();
        drop(params);
        let mut replicated = BTreeMap::new();
        for (name, work) in pending {
            replicated.insert(name, work.wait()?);
        }
        Ok(Gradients {
            units,
            has_grad,
            replicated,
        })
    }

    /// Clips by the global gradient norm when `max_grad_norm` is set (the norm over all
    /// shards, not a rank's own) and updates this rank's shards with `optimizer`. Parameters
    /// that received no gradient are left alone, as PyTorch's optimizers do.
    pub fn step(
        &mut self,
        mut grads: Gradients,
        optimizer: &Optimizer,
        max_grad_norm: Option<f64>,
    ) -> Result<StepReport, EngineError> {
        optimizer.validate().map_err(EngineError::Optimizer)?;
        self.step += 1;
        // Global norm: shards are disjoint across ranks (padding holds zeros), so their
        // squares are summed over ranks; whole copies are counted once.
        let square = |v: &[f32]| v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>();
        let mut sharded_sq: f64 = grads.units.iter().flatten().map(|g| square(g)).sum();
        if !self.replicated_units() {
            sharded_sq = self.pg.all_reduce(vec![sharded_sq], ReduceOp::Sum).wait()?[0];
        }
        let total_sq = sharded_sq + grads.replicated.values().map(|g| square(g)).sum::<f64>();
        let grad_norm = total_sq.sqrt();
        let scale = match max_grad_norm {
            Some(max) if grad_norm > max => (max / (grad_norm + 1e-6)) as f32,
            _ => 1.0,
        };
        if scale != 1.0 {
            grads.scale(scale);
        }
        for (u, (reduced, has_grad)) in grads.units.iter().zip(&grads.has_grad).enumerate() {
            let Some(reduced) = reduced else { continue };
            let unit = &self.plan.units[u];
            let shards = &mut self.shards[u];
            // The step in flight has ended, so the packed shards are not shared: no copy.
            let packed = Arc::make_mut(&mut shards.packed);
            for ((p, &has), state) in unit.params.iter().zip(has_grad).zip(&mut shards.optim) {
                if p.requires_grad && has {
                    let rows = p.shard_range();
                    optimizer.update(&mut packed[rows.clone()], &reduced[rows], state, self.step);
                }
            }
        }
        for (name, g) in &grads.replicated {
            let Some((var, state)) = self.replicated.get_mut(name) else {
                continue;
            };
            let mut p: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
            optimizer.update(&mut p, g, state, self.step);
            var.set(&Tensor::from_vec(p, var.dims(), &self.device)?)
                .map_err(|e| EngineError::Weights(format!("{name}: {e}")))?;
        }
        let resident_bytes = crate::memory::counting().then(crate::memory::resident_bytes);
        drop(grads);
        Ok(StepReport {
            grad_norm,
            clipped: scale != 1.0,
            resident_bytes,
        })
    }

    /// Every parameter's full value (gathered unit by unit; identical on every rank).
    pub fn full_state(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        let mut out = BTreeMap::new();
        let ranks = if self.replicated_units() {
            1
        } else {
            self.pg.size()
        };
        for (u, unit) in self.plan.units.iter().enumerate() {
            let packed = &self.shards[u].packed;
            let gathered = if ranks == 1 {
                packed.to_vec()
            } else {
                self.pg.all_gather(packed.to_vec()).wait()?
            };
            for p in &unit.params {
                let mut full = vec![0f32; p.numel()];
                p.unpack(&gathered, packed.len(), ranks, &mut full);
                out.insert(
                    p.name.clone(),
                    Tensor::from_vec(full, p.shape.as_slice(), &self.device)?,
                );
            }
        }
        for (name, (var, _)) in &self.replicated {
            out.insert(name.clone(), var.as_tensor().clone());
        }
        Ok(out)
    }

    /// Bytes of model state this rank holds between steps: parameter shards (and replicated
    /// parameters) and optimizer state.
    pub fn model_state_bytes(&self) -> usize {
        let shards: usize = self
            .shards
            .iter()
            .map(|s| s.packed.len() * 4 + s.optim.iter().map(ParamState::bytes).sum::<usize>())
            .sum();
        let replicated: usize = self
            .replicated
            .values()
            .map(|(v, s)| v.elem_count() * 4 + s.bytes())
            .sum();
        shards + replicated
    }
}
