//! The first FSDP engine: parameters sharded on dim 0 per unit, gathered with one all-gather
//! per unit, gradients captured at each full parameter's autograd node and reduce-scattered
//! with one collective per unit, AdamW on the local shards only.
//!
//! With FULL_SHARD (and HYBRID_SHARD) a unit's full parameters are released as soon as its
//! forward is done (their pages go back to the system; in debug mode they are poisoned with
//! NaN instead, so a stray read shows) and re-gathered in place just before its backward, by
//! an identity op on the unit's output whose backward runs first. SHARD_GRAD_OP keeps them
//! from forward through backward. Prefetch and NO_SHARD's all-reduce path come next.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Device, InplaceOp1, Layout, Shape, Tensor, Var};
use fsdp_comm::{ProcessGroup, ReduceOp};

use super::plan::{PlanError, ShardLayout, UnitPlan};
use crate::config::{FsdpPlugin, ShardingStrategy};
use crate::nn::{ModuleInfo, Params};
use crate::optim::{AdamWConfig, AdamWState};

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
}

/// A gradient slot filled by a full parameter's backward.
type Slot = Arc<Mutex<Option<Vec<f32>>>>;

/// Produces a gathered parameter as the output of an op on the unit's anchor variable, so the
/// parameter is a node of the graph; its backward receives the full gradient after every
/// consumer ran, keeps it for the reduce-scatter, and sends nothing to the anchor.
struct Unshard {
    data: Mutex<Option<Vec<f32>>>,
    shape: Shape,
    slot: Slot,
    name: String,
}

impl CustomOp1 for Unshard {
    fn name(&self) -> &'static str {
        "fsdp-unshard"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let data = self
            .data
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("parameter {} was already materialised", self.name))
            })?;
        Ok((CpuStorage::F32(data), self.shape.clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g: Vec<f32> = grad.flatten_all()?.to_vec1()?;
        let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_mut() {
            Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
            None => *slot = Some(g),
        }
        Ok(None)
    }
}

struct ShardState {
    data: Vec<f32>,
    adam: AdamWState,
}

/// A model's parameters sharded across a process group.
pub struct Fsdp {
    plan: UnitPlan,
    pg: Arc<ProcessGroup>,
    /// Poison released parameters with NaN instead of returning their memory.
    debug: bool,
    shards: BTreeMap<String, ShardState>,
    replicated: BTreeMap<String, (Var, AdamWState)>,
    step: u64,
    device: Device,
}

/// Full values of a unit's parameters from an all-gathered block (rank r's shards at
/// `r * block`), without the padding rows.
fn unpack(params: &[ShardLayout], gathered: &[f32], ranks: usize) -> Vec<(ShardLayout, Vec<f32>)> {
    let block: usize = params.iter().map(ShardLayout::shard_numel).sum();
    let mut out = Vec::with_capacity(params.len());
    let mut offset = 0;
    for p in params {
        let mut full = Vec::with_capacity(p.numel());
        for r in 0..ranks {
            let (start, end) = p.rows_of(r);
            let base = r * block + offset;
            full.extend_from_slice(&gathered[base..base + (end - start) * p.row_elems]);
        }
        offset += p.shard_numel();
        out.push((p.clone(), full));
    }
    out
}

/// What a resharded unit needs to release its parameters after forward and refill them
/// before backward.
struct UnitHandle {
    pg: Arc<ProcessGroup>,
    /// This rank's shards of the unit (unchanged until the optimizer step).
    packed: Vec<f32>,
    tensors: Vec<(ShardLayout, Tensor)>,
    debug: bool,
}

/// Releases a full parameter's memory in place, keeping the storage's length (candle's
/// kernels index without bounds checks, so a shorter storage would be unsound).
struct Release {
    poison: bool,
}

impl InplaceOp1 for Release {
    fn name(&self) -> &'static str {
        "fsdp-release"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, _l: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = s else {
            return Err(candle_core::Error::Msg(
                "fsdp-release: parameters are f32".into(),
            ));
        };
        if self.poison {
            v.iter_mut().for_each(|x| *x = f32::NAN);
            return Ok(());
        }
        // Return the whole pages inside the buffer; they read as zeros until refilled.
        let page = 4096usize;
        let start = v.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(v.as_slice());
        let (first, last) = (start.div_ceil(page) * page, end / page * page);
        if last > first {
            // SAFETY: [first, last) lies inside the vector's allocation; MADV_DONTNEED on
            // private anonymous memory keeps the mapping valid (pages read back as zeros).
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_DONTNEED,
                );
            }
        }
        Ok(())
    }
}

/// Writes gathered values back into a released parameter's storage.
struct Refill<'a> {
    values: &'a [f32],
}

impl InplaceOp1 for Refill<'_> {
    fn name(&self) -> &'static str {
        "fsdp-refill"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = s else {
            return Err(candle_core::Error::Msg(
                "fsdp-refill: parameters are f32".into(),
            ));
        };
        let start = l.start_offset();
        v[start..start + self.values.len()].copy_from_slice(self.values);
        Ok(())
    }
}

impl UnitHandle {
    fn release(&self) -> candle_core::Result<()> {
        for (_, t) in &self.tensors {
            t.inplace_op1(&Release { poison: self.debug })?;
        }
        Ok(())
    }

    fn refill(&self) -> candle_core::Result<()> {
        let gathered = self
            .pg
            .all_gather(self.packed.clone())
            .wait()
            .map_err(|e| {
                candle_core::Error::Msg(format!("re-gathering a unit before its backward: {e}"))
            })?;
        let layouts: Vec<ShardLayout> = self.tensors.iter().map(|(l, _)| l.clone()).collect();
        for ((_, t), (_, values)) in
            self.tensors
                .iter()
                .zip(unpack(&layouts, &gathered, self.pg.size()))
        {
            t.inplace_op1(&Refill { values: &values })?;
        }
        Ok(())
    }
}

/// Identity on a unit's output; its backward runs before any backward node of the unit and
/// refills the unit's parameters.
struct PreBackward {
    unit: Arc<UnitHandle>,
}

impl CustomOp1 for PreBackward {
    fn name(&self) -> &'static str {
        "fsdp-pre-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(v) = s else {
            return Err(candle_core::Error::Msg(
                "fsdp-pre-backward: activations are f32".into(),
            ));
        };
        let (start, end) = l.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("fsdp-pre-backward: unit output must be contiguous".into())
        })?;
        Ok((CpuStorage::F32(v[start..end].to_vec()), l.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        self.unit.refill()?;
        Ok(Some(grad.clone()))
    }
}

/// The parameters of one step: gathered full tensors (graph nodes) and replicated variables.
pub struct StepParams {
    full: HashMap<String, Tensor>,
    slots: HashMap<String, Slot>,
    replicated: HashMap<String, Tensor>,
    /// Resharded units by module path.
    units: HashMap<String, Arc<UnitHandle>>,
    _anchors: Vec<Var>,
}

impl Params for StepParams {
    fn get(&self, name: &str) -> candle_core::Result<Tensor> {
        self.full
            .get(name)
            .or_else(|| self.replicated.get(name))
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg(format!("unknown parameter {name}")))
    }

    fn module_output(&self, path: &str, output: Tensor) -> candle_core::Result<Tensor> {
        let Some(unit) = self.units.get(path) else {
            return Ok(output);
        };
        let hooked = output
            .contiguous()?
            .apply_op1(PreBackward { unit: unit.clone() })?;
        unit.release()?;
        Ok(hooked)
    }
}

impl Fsdp {
    /// Shards `initial` (every parameter of `model`, full, identical on every rank) across
    /// `pg` per `plugin`'s wrap policy.
    pub fn new(
        model: &ModuleInfo,
        initial: &BTreeMap<String, Tensor>,
        plugin: &FsdpPlugin,
        default_wrap: &[&str],
        pg: ProcessGroup,
    ) -> Result<Fsdp, EngineError> {
        check_supported(plugin)?;
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
        let mut shards = BTreeMap::new();
        for layout in plan.units.iter().flat_map(|u| &u.params) {
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
            let mut data = values[start * layout.row_elems..end * layout.row_elems].to_vec();
            data.resize(layout.shard_numel(), 0.0);
            shards.insert(
                layout.name.clone(),
                ShardState {
                    data,
                    adam: AdamWState::default(),
                },
            );
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
                    AdamWState::default(),
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
            pg: Arc::new(pg),
            debug,
            shards,
            replicated,
            step: 0,
            device,
        })
    }

    /// Configured behaviours that do not change results and are not applied yet (so callers
    /// can report them): backward and forward prefetch.
    pub fn unapplied_settings(plugin: &FsdpPlugin) -> Vec<String> {
        let mut out = Vec::new();
        if plugin.backward_prefetch != crate::config::BackwardPrefetch::NoPrefetch {
            out.push(format!(
                "fsdp_backward_prefetch: {} (collectives are not overlapped with compute yet)",
                plugin.backward_prefetch
            ));
        }
        if plugin.forward_prefetch {
            out.push(
                "fsdp_forward_prefetch: true (collectives are not overlapped with compute yet)"
                    .into(),
            );
        }
        out
    }

    /// The plan in use.
    pub fn plan(&self) -> &UnitPlan {
        &self.plan
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// All-gathers one unit's shards; returns each parameter's full values.
    /// With NO_SHARD every rank holds whole parameters: nothing to gather.
    fn gather_unit(&self, unit: usize) -> Result<Vec<(ShardLayout, Vec<f32>)>, EngineError> {
        let params = &self.plan.units[unit].params;
        if self.replicated_units() {
            return Ok(unpack(params, &self.packed_unit(unit), 1));
        }
        let gathered = self.pg.all_gather(self.packed_unit(unit)).wait()?;
        Ok(unpack(params, &gathered, self.pg.size()))
    }

    /// True when units are replicated rather than sharded (NO_SHARD, or one rank).
    fn replicated_units(&self) -> bool {
        self.plan.group_size == 1
    }

    /// Turns on NaN poisoning of released parameters (also `FSDP_DEBUG=1` or
    /// `ACCELERATE_DEBUG_MODE=true`).
    pub fn set_debug(&mut self, on: bool) {
        self.debug = on;
    }

    /// Gathers every unit and returns the parameters for this step's forward and backward.
    pub fn begin_step(&self) -> Result<StepParams, EngineError> {
        let mut full = HashMap::new();
        let mut slots = HashMap::new();
        let mut anchors = Vec::new();
        let mut units = HashMap::new();
        let reshard = matches!(
            self.plan.strategy,
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard
        ) && self.pg.size() > 1;
        for unit in 0..self.plan.units.len() {
            let anchor = Var::zeros(1, candle_core::DType::F32, &self.device)?;
            let mut unit_tensors = Vec::new();
            for (layout, values) in self.gather_unit(unit)? {
                let slot: Slot = Arc::new(Mutex::new(None));
                let op = Unshard {
                    data: Mutex::new(Some(values)),
                    shape: Shape::from(layout.shape.clone()),
                    slot: slot.clone(),
                    name: layout.name.clone(),
                };
                let t = if layout.requires_grad {
                    anchor.as_tensor().apply_op1(op)?
                } else {
                    anchor.as_tensor().detach().apply_op1_no_bwd(&op)?
                };
                unit_tensors.push((layout.clone(), t.clone()));
                full.insert(layout.name.clone(), t);
                slots.insert(layout.name.clone(), slot);
            }
            anchors.push(anchor);
            let path = &self.plan.units[unit].path;
            if reshard && !path.is_empty() {
                units.insert(
                    path.clone(),
                    Arc::new(UnitHandle {
                        pg: self.pg.clone(),
                        packed: self.packed_unit(unit),
                        tensors: unit_tensors,
                        debug: self.debug,
                    }),
                );
            }
        }
        let replicated = self
            .replicated
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.as_tensor().clone()))
            .collect();
        Ok(StepParams {
            full,
            slots,
            replicated,
            units,
            _anchors: anchors,
        })
    }

    /// This rank's shards of one unit, packed in the unit's parameter order.
    fn packed_unit(&self, unit: usize) -> Vec<f32> {
        self.plan.units[unit]
            .params
            .iter()
            .flat_map(|p| self.shards[&p.name].data.iter().copied())
            .collect()
    }

    /// Reduce-scatters every unit's gradients (mean over ranks; all-reduce for NO_SHARD),
    /// all-reduces replicated ones, clips by the global gradient norm when `max_grad_norm` is
    /// set (the norm over all shards, not a rank's own), and updates this rank's shards with
    /// AdamW. `grads` is the store `backward` returned.
    pub fn finish_step(
        &mut self,
        params: StepParams,
        grads: &GradStore,
        adamw: &AdamWConfig,
        max_grad_norm: Option<f64>,
    ) -> Result<StepReport, EngineError> {
        self.step += 1;
        let replicated_units = self.replicated_units();
        // Sharded units reduce-scatter their gradients; replicated ones (NO_SHARD) all-reduce.
        let n = if replicated_units { 1 } else { self.pg.size() };
        let mut unit_grads = Vec::with_capacity(self.plan.units.len());
        for unit in &self.plan.units {
            let block: usize = unit.params.iter().map(ShardLayout::shard_numel).sum();
            let mut packed = vec![0f32; block * n];
            let mut offset = 0;
            for p in &unit.params {
                let grad = params.slots[&p.name]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                if let Some(g) = grad {
                    for r in 0..n {
                        let (start, end) = p.rows_of(r);
                        let src = &g[start * p.row_elems..end * p.row_elems];
                        let dst = r * block + offset;
                        packed[dst..dst + src.len()].copy_from_slice(src);
                    }
                }
                offset += p.shard_numel();
            }
            unit_grads.push(if replicated_units {
                self.pg.all_reduce(packed, ReduceOp::Avg).wait()?
            } else {
                self.pg.reduce_scatter(packed, ReduceOp::Avg).wait()?
            });
        }
        let mut replicated_grads = Vec::new();
        for (name, (var, _)) in &self.replicated {
            if let Some(g) = grads.get(var) {
                let g: Vec<f32> = g.flatten_all()?.to_vec1()?;
                replicated_grads.push((name.clone(), self.pg.all_reduce(g, ReduceOp::Avg).wait()?));
            }
        }
        // Global norm: shards are disjoint across ranks (padding holds zeros), so their
        // squares are summed over ranks; whole copies are counted once.
        let square = |v: &[f32]| v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>();
        let mut sharded_sq: f64 = unit_grads.iter().map(|g| square(g)).sum();
        if !replicated_units && self.pg.size() > 1 {
            sharded_sq = self.pg.all_reduce(vec![sharded_sq], ReduceOp::Sum).wait()?[0];
        }
        let total_sq = sharded_sq + replicated_grads.iter().map(|(_, g)| square(g)).sum::<f64>();
        let grad_norm = total_sq.sqrt();
        let scale = match max_grad_norm {
            Some(max) if grad_norm > max => (max / (grad_norm + 1e-6)) as f32,
            _ => 1.0,
        };
        for (unit, reduced) in self.plan.units.iter().zip(&mut unit_grads) {
            if scale != 1.0 {
                reduced.iter_mut().for_each(|g| *g *= scale);
            }
            let mut offset = 0;
            for p in &unit.params {
                let len = p.shard_numel();
                if p.requires_grad {
                    let state = self
                        .shards
                        .get_mut(&p.name)
                        .ok_or_else(|| EngineError::Weights(format!("no shard for {}", p.name)))?;
                    adamw.update(
                        &mut state.data,
                        &reduced[offset..offset + len],
                        &mut state.adam,
                        self.step,
                    );
                }
                offset += len;
            }
        }
        for (name, mut g) in replicated_grads {
            if scale != 1.0 {
                g.iter_mut().for_each(|v| *v *= scale);
            }
            let Some((var, state)) = self.replicated.get_mut(&name) else {
                continue;
            };
            let mut p: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
            adamw.update(&mut p, &g, state, self.step);
            var.set(&Tensor::from_vec(p, var.dims(), &self.device)?)
                .map_err(|e| EngineError::Weights(format!("{name}: {e}")))?;
        }
        drop(params);
        Ok(StepReport {
            grad_norm,
            clipped: scale != 1.0,
        })
    }

    /// Every parameter's full value (gathered; identical on every rank).
    pub fn full_state(&self) -> Result<BTreeMap<String, Tensor>, EngineError> {
        let mut out = BTreeMap::new();
        for unit in 0..self.plan.units.len() {
            for (layout, values) in self.gather_unit(unit)? {
                out.insert(
                    layout.name.clone(),
                    Tensor::from_vec(values, layout.shape.as_slice(), &self.device)?,
                );
            }
        }
        for (name, (var, _)) in &self.replicated {
            out.insert(name.clone(), var.as_tensor().clone());
        }
        Ok(out)
    }

    /// Bytes of parameter, gradient-free optimizer and shard state this rank holds between
    /// steps (f32 shards and AdamW moments).
    pub fn resident_bytes(&self) -> usize {
        self.shards
            .values()
            .map(|s| (s.data.len() + s.adam.exp_avg.len() + s.adam.exp_avg_sq.len()) * 4)
            .sum()
    }
}
