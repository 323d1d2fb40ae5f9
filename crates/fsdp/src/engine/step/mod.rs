//! One training step over the engine's units, driven by forward (a unit is gathered when
//! forward first reads one of its parameters, released when it reports its output) and by
//! backward (the graph ops call [`StepHooks`]); the backward order planned from the graph
//! before any kernel runs; the reductions issued as units finish.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use candle_core::{Device, Tensor, TensorId, Var};
use fsdp_comm::Mesh;

use super::backward_reads;
use super::collectives::{CommDtypes, PendingReduce};
use super::data_plane::DataPlane;
use super::debug;
use super::error::EngineError;
use super::frozen_release::FrozenReleases;
use super::grads::UnreducedUnits;
use super::hooks::{Checkpoint, StepHooks};
use super::shared_gather::GatherBlocks;
use super::unit::{FsdpUnit, Moment, Prefetch, RunContext};
use super::{GradBlock, ShardStore};
use crate::nn::Recompute;
use crate::trace::Tracer;

mod params;

pub use params::StepParams;

/// Step-wide settings.
pub(crate) struct StepOptions {
    /// Poison released parameters with NaN and check the graph before backward.
    pub debug: bool,
    /// What parameters are gathered in and gradients reduced in.
    pub dtypes: CommDtypes,
    /// Where forward runs.
    pub device: Device,
    /// Training (see [`RunContext::train`]).
    pub train: bool,
    /// Evaluation holding units gathered (see [`RunContext::hold`]).
    pub hold: bool,
    /// `fsdp_activation_checkpointing`: units that models run through
    /// [`crate::nn::call_checkpointable`] free their activations after forward and recompute
    /// them in backward.
    pub checkpointing: bool,
    /// Counts units recomputed in backward (the engine's running total).
    pub recomputed: Arc<AtomicU64>,
    /// Per unit: whether running it unhooked was reported already (once per engine).
    pub unhooked_reported: Arc<[AtomicBool]>,
    /// Where the step's timeline is recorded (`fsdp_trace_dir`).
    pub trace: Option<Arc<Tracer>>,
}

struct Inner {
    /// Units in the order forward first read them.
    forward_order: Vec<usize>,
    backward_order: Vec<usize>,
    /// Reductions issued, in issue order.
    pending: Vec<(usize, PendingReduce)>,
    /// Reductions already waited for (where the store is on disk, each is written out as
    /// soon as the next one is issued).
    reduced: Vec<Option<GradBlock>>,
    /// The first error a graph op hit (graph ops can only return candle's error).
    error: Option<EngineError>,
    /// When backward is done reading each unit's frozen parameters.
    frozen: FrozenReleases,
}

/// Each unit's reduced gradient block (None: no gradient this step) and which of its
/// parameters received one.
pub(crate) type ReducedGrads = (Vec<Option<GradBlock>>, Vec<Vec<bool>>);

/// Unit `u`'s reduced gradients once `work` is done, kept in `store`.
fn reduced_block(
    store: &ShardStore,
    trace: Option<&Tracer>,
    units: &[Arc<FsdpUnit>],
    u: usize,
    work: PendingReduce,
) -> Result<GradBlock, EngineError> {
    let values =
        work.wait(trace, units[u].trace_label())
            .map_err(|source| EngineError::Collective {
                op: "reduce-scatter of the gradients".into(),
                unit: units[u].name(),
                source,
            })?;
    Ok(store.keep_reduced(u, values)?)
}

/// One step over the engine's units: shared by the step's parameters (forward) and, through
/// a weak reference, its graph ops (backward). The units' own state in the step is theirs;
/// this keeps what the step knows across units.
pub(crate) struct StepShared {
    me: Weak<StepShared>,
    /// The engine's units, shared for the step's duration (so their shards stay as they are
    /// until it ends).
    units: Vec<Arc<FsdpUnit>>,
    mesh: Mesh,
    plane: Arc<dyn DataPlane>,
    /// The shard group's shared blocks that gathers go through where they can.
    gather_blocks: Option<Arc<GatherBlocks>>,
    index: HashMap<String, (usize, usize)>,
    by_path: HashMap<String, usize>,
    /// Units activation checkpointing applies to: non-root units with no unit inside.
    checkpointable: Vec<bool>,
    prefetch: Prefetch,
    opts: StepOptions,
    /// Where the units' shards and reduced gradients are kept (memory, or disk).
    store: ShardStore,
    inner: Mutex<Inner>,
}

impl StepShared {
    pub fn new(
        mesh: Mesh,
        (plane, gather_blocks): (Arc<dyn DataPlane>, Option<Arc<GatherBlocks>>),
        units: Vec<Arc<FsdpUnit>>,
        prefetch: Prefetch,
        opts: StepOptions,
    ) -> Arc<StepShared> {
        let mut index = HashMap::new();
        let mut by_path = HashMap::new();
        for (u, unit) in units.iter().enumerate() {
            for (i, p) in unit.params.iter().enumerate() {
                index.insert(p.layout.name.clone(), (u, i));
            }
            by_path.insert(unit.path.clone(), u);
        }
        let checkpointable = units
            .iter()
            .map(|u| {
                let inner = format!("{}.", u.path);
                opts.checkpointing
                    && opts.train
                    && !u.path.is_empty()
                    && !units.iter().any(|o| o.path.starts_with(&inner))
            })
            .collect();
        let store = ShardStore::of_units(units.iter().map(|u| &u.store));
        let n_units = units.len();
        let mut prefetch = prefetch;
        if prefetch.forward_order.is_empty() {
            prefetch.forward_order = (0..units.len()).collect();
        }
        Arc::new_cyclic(|me| StepShared {
            me: me.clone(),
            mesh,
            plane,
            gather_blocks,
            index,
            by_path,
            checkpointable,
            prefetch,
            opts,
            store,
            units,
            inner: Mutex::new(Inner {
                forward_order: Vec::new(),
                backward_order: Vec::new(),
                pending: Vec::new(),
                reduced: (0..n_units).map(|_| None).collect(),
                error: None,
                frozen: FrozenReleases::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cx(&self) -> RunContext<'_> {
        RunContext {
            mesh: &self.mesh,
            plane: self.plane.as_ref(),
            dtypes: self.opts.dtypes,
            device: &self.opts.device,
            poison: self.opts.debug,
            train: self.opts.train,
            hold: self.opts.hold,
            trace: self.opts.trace.as_deref(),
            shared: self.gather_blocks.as_ref(),
        }
    }

    fn hooks(&self) -> Weak<dyn StepHooks> {
        self.me.clone()
    }

    /// Records the first error (for the engine to return it structured) and gives candle's
    /// error for the graph op or forward that hit it.
    fn fail(&self, inner: &mut Inner, err: EngineError) -> candle_core::Error {
        let text = err.to_string();
        inner.error.get_or_insert(err);
        candle_core::Error::Msg(text)
    }

    /// The first error a graph op or parameter read hit in this step.
    pub fn take_error(&self) -> Option<EngineError> {
        self.lock().error.take()
    }

    /// Gathers `u` ahead when the prefetch policy says so after `moment` of unit `after`.
    fn prefetch_after(
        &self,
        inner: &mut Inner,
        moment: Moment,
        after: usize,
    ) -> Result<(), EngineError> {
        let next = self.prefetch.after(moment, after, &inner.backward_order);
        if let Some((n, waiting)) = next {
            self.units[n].prefetch(&self.cx(), waiting)?;
        }
        Ok(())
    }

    /// Starts reading the unit after `u` in `order` from its store (on disk; in memory there
    /// is nothing to read).
    fn read_ahead_after(&self, u: usize, order: &[usize]) -> Result<(), EngineError> {
        let at = order.iter().position(|&x| x == u);
        match at.and_then(|at| order.get(at + 1)) {
            Some(&next) => self.units[next].read_ahead_if_waiting(),
            None => Ok(()),
        }
    }

    /// Waits for and stores the reductions the store wants written out before the step
    /// ends ([`ShardStore::due_reductions`]: on disk, all but the newest `keep`, so a rank
    /// holds at most two units' reduced blocks).
    fn store_reduced(&self, inner: &mut Inner, keep: usize) -> Result<(), EngineError> {
        for (u, work) in self.store.due_reductions(&mut inner.pending, keep) {
            inner.reduced[u] = Some(reduced_block(
                &self.store,
                self.opts.trace.as_deref(),
                &self.units,
                u,
                work,
            )?);
        }
        Ok(())
    }

    fn read(&self, inner: &mut Inner, u: usize, i: usize) -> Result<Tensor, EngineError> {
        self.unsharded(inner, u, i)?;
        self.units[u].read(&self.cx(), i)
    }

    /// Rows `ids` of parameter `i` of unit `u` (a table): the table, holding at least them.
    fn look_up(
        &self,
        inner: &mut Inner,
        (u, i): (usize, usize),
        ids: &Tensor,
    ) -> Result<Tensor, EngineError> {
        self.unsharded(inner, u, i)?;
        self.units[u].look_up(&self.cx(), i, ids)
    }

    /// Unit `u` gathered for a read of its parameter `i` (forward reaching it).
    fn unsharded(&self, inner: &mut Inner, u: usize, i: usize) -> Result<(), EngineError> {
        if self.units[u].gather_for_read(&self.cx(), (self.hooks(), u), i)? {
            inner.forward_order.push(u);
            self.prefetch_after(inner, Moment::Gathered, u)?;
            self.read_ahead_after(u, &self.prefetch.forward_order)?;
        }
        Ok(())
    }

    fn output(&self, u: usize, t: Tensor) -> Result<Tensor, EngineError> {
        self.units[u].post_forward(&self.cx(), t, self.hooks(), u)
    }

    /// Plans the backward from the graph of `loss` before any kernel runs: the units'
    /// backward order (for prefetch) and the gradients each unit will receive, and releases
    /// the gathered parameters no backward formula reads; in debug mode also checks that
    /// released units were hooked and parameters used inside their units.
    pub fn plan_backward(&self, loss: &Tensor) -> Result<(), EngineError> {
        let sorted = loss.sorted_nodes();
        let in_graph: std::collections::HashSet<TensorId> = sorted.iter().map(|t| t.id()).collect();
        let mut inner = self.lock();
        let mut hook_unit: HashMap<TensorId, usize> = HashMap::new();
        for (u, unit) in self.units.iter().enumerate() {
            for o in unit.outputs() {
                hook_unit.insert(o.id(), u);
            }
        }
        let mut order = Vec::new();
        for node in &sorted {
            if let Some(&u) = hook_unit.get(&node.id())
                && !order.contains(&u)
            {
                order.push(u);
            }
        }
        for unit in &self.units {
            unit.expect_gradients(&in_graph);
        }
        if self.opts.debug {
            debug::check_graph(&self.units, &in_graph)?;
        }
        let full: HashSet<TensorId> = self
            .units
            .iter()
            .flat_map(|u| u.full())
            .map(|t| t.id())
            .collect();
        let read = backward_reads::read_in_backward(&sorted, &full);
        let cx = self.cx();
        for unit in &self.units {
            unit.release_unread(&cx, &read)?;
        }
        debug::report_unhooked(&self.units, &self.opts.unhooked_reported, self.mesh.rank());
        inner.backward_order = order;
        inner.frozen = FrozenReleases::plan(&sorted, &self.units);
        Ok(())
    }

    /// Sets how the coming backward treats gradients: reduced (`sync`, with `carried`, what
    /// earlier backwards without sync kept) or kept whole per unit for the next backward.
    pub fn begin_backward(&self, sync: bool, carried: UnreducedUnits) {
        let carried = carried.into_iter().chain(std::iter::repeat_with(|| None));
        for (unit, c) in self.units.iter().zip(carried) {
            unit.begin_backward(sync, c);
        }
    }

    /// After [`StepShared::finish`] of a backward without sync: what each unit kept.
    pub fn take_unreduced(&self) -> UnreducedUnits {
        self.units.iter().map(|u| u.take_unreduced()).collect()
    }

    /// Debug mode: why a loss is not finite, when released parameters are the cause.
    pub fn diagnose_non_finite(&self, loss: &Tensor) -> Option<EngineError> {
        debug::diagnose_non_finite(&self.units, loss)
    }

    /// After backward: waits for every reduction; returns each unit's reduced gradient
    /// block and which parameters had a gradient. Drops the step's tensors.
    pub fn finish(&self) -> Result<ReducedGrads, EngineError> {
        let mut inner = self.lock();
        if let Some(err) = inner.error.take() {
            return Err(err);
        }
        let cx = self.cx();
        let mut pending = std::mem::take(&mut inner.pending);
        for (u, unit) in self.units.iter().enumerate() {
            if let Some(p) = unit.finish(&cx)? {
                pending.push((u, p));
            }
        }
        self.store.discard_reads_ahead();
        let mut reduced = std::mem::take(&mut inner.reduced);
        for (u, work) in pending {
            reduced[u] = Some(reduced_block(
                &self.store,
                self.opts.trace.as_deref(),
                &self.units,
                u,
                work,
            )?);
        }
        let has_grad = self.units.iter().map(|u| u.has_grad()).collect();
        Ok((reduced, has_grad))
    }

    /// Units in the order this step's forward first used them.
    pub fn forward_order(&self) -> Vec<usize> {
        self.lock().forward_order.clone()
    }
}

impl Drop for StepShared {
    /// The step ends when its parameters drop: the units forget its state (their gathered
    /// parameters, gathers in flight and gradients), so its memory goes with it.
    fn drop(&mut self) {
        for unit in &self.units {
            unit.try_reset_step();
        }
    }
}

impl StepShared {
    /// Runs unit `u`'s `forward` on `x` under activation checkpointing (see
    /// [`crate::nn::Params::checkpointed`]): without keeping its graph, then as one
    /// [`Checkpoint`] node on `x` and the unit's anchor.
    fn checkpointed(
        &self,
        params: &StepParams,
        u: usize,
        x: &Tensor,
        forward: Recompute,
    ) -> Result<Tensor, EngineError> {
        let out = forward(params, &x.detach())?;
        let used_ids: HashSet<TensorId> = out.sorted_nodes().iter().map(|t| t.id()).collect();
        let unit = &self.units[u];
        let used: Vec<bool> = unit
            .full()
            .iter()
            .map(|f| used_ids.contains(&f.id()))
            .collect();
        let anchor = unit.anchor();
        drop(used_ids);
        let Some(anchor) = anchor else {
            return Err(EngineError::CheckpointWithoutParameters { unit: unit.name() });
        };
        let data = self
            .plane
            .copy(&out, &format!("the output of {}", unit.name()))?;
        let shape = out.shape().clone();
        // The forward's graph (its activations) goes here; only the output's values remain.
        drop(out);
        let op = Checkpoint {
            data: Mutex::new(Some(data)),
            shape,
            step: self.hooks(),
            forward,
        };
        let y = x.apply_op2(anchor.as_tensor(), op)?;
        unit.set_checkpoint(y.id(), used);
        Ok(y)
    }
}

impl StepHooks for StepShared {
    fn recompute(
        &self,
        x: &Tensor,
        forward: &Recompute,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let shared = super::hooks::live(&self.me)?;
        let params = StepParams { shared };
        let input = if x.track_op() {
            Some(Var::from_tensor(&x.detach())?)
        } else {
            None
        };
        let x = input
            .as_ref()
            .map_or_else(|| x.detach(), |v| v.as_tensor().clone());
        let out = forward(&params, &x)?;
        // d(sum(out * grad))/d(out) = grad: back-propagates `grad` through the recomputation
        // (the parameters' gradients, also those of ignored modules read inside the unit,
        // reach their units through their own graph ops).
        let grads = out.mul(grad)?.sum_all()?.backward()?;
        self.opts.recomputed.fetch_add(1, Ordering::Relaxed);
        Ok(input.and_then(|v| grads.get(v.as_tensor()).cloned()))
    }

    fn pre_backward(&self, u: usize) -> candle_core::Result<()> {
        let mut inner = self.lock();
        let result = self.units[u].pre_backward(&self.cx()).and_then(|refilled| {
            if refilled {
                self.prefetch_after(&mut inner, Moment::Refilled, u)?;
                self.read_ahead_after(u, &inner.backward_order)
            } else {
                Ok(())
            }
        });
        let result = result.and_then(|()| inner.frozen.at_outputs(&self.units, u, &self.cx()));
        result.map_err(|e| self.fail(&mut inner, e))
    }

    fn post_backward(&self, u: usize, i: usize, grad: &Tensor) -> candle_core::Result<()> {
        let mut inner = self.lock();
        let result = self.units[u]
            .post_backward(&self.cx(), i, grad)
            .and_then(|pending| match pending {
                Some(p) => {
                    inner.pending.push((u, p));
                    // Replicas' means of the reductions done so far, in issue order.
                    for (_, p) in inner.pending.iter_mut() {
                        if !p.advance() {
                            break;
                        }
                    }
                    self.prefetch_after(&mut inner, Moment::Reduced, u)?;
                    self.store_reduced(&mut inner, 1)
                }
                None => Ok(()),
            });
        let result = result.and_then(|()| inner.frozen.at_param(&self.units, (u, i), &self.cx()));
        result.map_err(|e| self.fail(&mut inner, e))
    }
}
