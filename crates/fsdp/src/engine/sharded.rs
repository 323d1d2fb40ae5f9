//! The first FSDP engine: parameters sharded on dim 0 per unit, gathered with one all-gather
//! per unit, gradients captured at each full parameter's autograd node and reduce-scattered
//! with one collective per unit, AdamW on the local shards only.
//!
//! This version gathers every unit for the step and releases them after the optimizer step
//! (SHARD_GRAD_OP's memory behaviour for every strategy); releasing after forward and
//! refilling before backward (FULL_SHARD), prefetch and NO_SHARD's all-reduce come next.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor, Var};
use fsdp_comm::{ProcessGroup, ReduceOp};

use super::plan::{PlanError, ShardLayout, UnitPlan};
use crate::config::FsdpPlugin;
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
    pg: ProcessGroup,
    shards: BTreeMap<String, ShardState>,
    replicated: BTreeMap<String, (Var, AdamWState)>,
    step: u64,
    device: Device,
}

/// The parameters of one step: gathered full tensors (graph nodes) and replicated variables.
pub struct StepParams {
    full: HashMap<String, Tensor>,
    slots: HashMap<String, Slot>,
    replicated: HashMap<String, Tensor>,
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
        let plan = UnitPlan::build(model, plugin, default_wrap, pg.size())?;
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
            let (start, end) = layout.rows_of(rank);
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
        Ok(Fsdp {
            plan,
            pg,
            shards,
            replicated,
            step: 0,
            device,
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

    /// All-gathers one unit's shards; returns each parameter's full values.
    fn gather_unit(&self, unit: usize) -> Result<Vec<(ShardLayout, Vec<f32>)>, EngineError> {
        let params = &self.plan.units[unit].params;
        let block: usize = params.iter().map(ShardLayout::shard_numel).sum();
        let mut packed = Vec::with_capacity(block);
        for p in params {
            packed.extend_from_slice(&self.shards[&p.name].data);
        }
        let gathered = self.pg.all_gather(packed).wait()?;
        let mut out = Vec::with_capacity(params.len());
        let mut offset = 0;
        for p in params {
            let mut full = Vec::with_capacity(p.numel());
            for r in 0..self.pg.size() {
                let (start, end) = p.rows_of(r);
                let base = r * block + offset;
                full.extend_from_slice(&gathered[base..base + (end - start) * p.row_elems]);
            }
            offset += p.shard_numel();
            out.push((p.clone(), full));
        }
        Ok(out)
    }

    /// Gathers every unit and returns the parameters for this step's forward and backward.
    pub fn begin_step(&self) -> Result<StepParams, EngineError> {
        let mut full = HashMap::new();
        let mut slots = HashMap::new();
        let mut anchors = Vec::new();
        for unit in 0..self.plan.units.len() {
            let anchor = Var::zeros(1, candle_core::DType::F32, &self.device)?;
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
                full.insert(layout.name.clone(), t);
                slots.insert(layout.name.clone(), slot);
            }
            anchors.push(anchor);
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
            _anchors: anchors,
        })
    }

    /// Reduce-scatters every unit's gradients (mean over ranks), all-reduces replicated ones,
    /// and updates this rank's shards with AdamW. `grads` is the store `backward` returned.
    pub fn finish_step(
        &mut self,
        params: StepParams,
        grads: &GradStore,
        adamw: &AdamWConfig,
    ) -> Result<(), EngineError> {
        self.step += 1;
        let n = self.pg.size();
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
            let reduced = self.pg.reduce_scatter(packed, ReduceOp::Avg).wait()?;
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
        for (name, (var, state)) in self.replicated.iter_mut() {
            let Some(g) = grads.get(var) else { continue };
            let g: Vec<f32> = g.flatten_all()?.to_vec1()?;
            let g = self.pg.all_reduce(g, ReduceOp::Avg).wait()?;
            let mut p: Vec<f32> = var.as_tensor().flatten_all()?.to_vec1()?;
            adamw.update(&mut p, &g, state, self.step);
            var.set(&Tensor::from_vec(p, var.dims(), &self.device)?)
                .map_err(|e| EngineError::Weights(format!("{name}: {e}")))?;
        }
        drop(params);
        Ok(())
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
