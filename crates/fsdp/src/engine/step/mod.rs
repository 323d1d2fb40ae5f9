//! One training step: the units' runs, driven by forward (a unit is gathered when forward
//! first reads one of its parameters, released when it reports its output) and by backward
//! (the graph ops call [`StepHooks`]); the backward order planned from the graph before any
//! kernel runs; the reductions issued as units finish.

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
use super::fsdp_unit::FsdpUnit;
use super::grads::UnreducedUnits;
use super::hooks::{Checkpoint, StepHooks};
use super::offload::{GradBlock, ShardStore};
use super::unit::{Moment, Prefetch, RunContext, ShardedState, UnitRun};
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
    runs: Vec<UnitRun>,
    /// Units in the order forward first read them.
    forward_order: Vec<usize>,
    backward_order: Vec<usize>,
    /// Reductions issued, in issue order.
    pending: Vec<(usize, PendingReduce)>,
    /// Reductions already waited for (with offloaded gradients, each is written out as
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
    runs: &[UnitRun],
    u: usize,
    work: PendingReduce,
) -> Result<GradBlock, EngineError> {
    let values = work
        .wait(trace, runs[u].unit.trace_label())
        .map_err(|source| EngineError::Collective {
            op: "reduce-scatter of the gradients".into(),
            unit: runs[u].unit.name(),
            source,
        })?;
    Ok(store.keep_reduced(u, values)?)
}

pub(crate) struct StepShared {
    me: Weak<StepShared>,
    mesh: Mesh,
    plane: Arc<dyn DataPlane>,
    index: HashMap<String, (usize, usize)>,
    by_path: HashMap<String, usize>,
    /// Units activation checkpointing applies to: non-root units with no unit inside.
    checkpointable: Vec<bool>,
    prefetch: Prefetch,
    opts: StepOptions,
    /// Where the units' shards and reduced gradients are kept (the disk tier with
    /// `fsdp_offload_params`).
    store: ShardStore,
    inner: Mutex<Inner>,
}

impl StepShared {
    pub fn new(
        mesh: Mesh,
        plane: Arc<dyn DataPlane>,
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
            index,
            by_path,
            checkpointable,
            prefetch,
            opts,
            store,
            inner: Mutex::new(Inner {
                runs: units.into_iter().map(UnitRun::new).collect(),
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
            inner.runs[n].prefetch(&self.cx(), waiting)?;
        }
        Ok(())
    }

    /// Starts reading the unit after `u` in `order` from its store (on disk; in memory there
    /// is nothing to read).
    fn read_ahead_after(
        &self,
        inner: &Inner,
        u: usize,
        order: &[usize],
    ) -> Result<(), EngineError> {
        let at = order.iter().position(|&x| x == u);
        match at.and_then(|at| order.get(at + 1)) {
            Some(&next) => inner.runs[next].read_ahead(),
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
                &inner.runs,
                u,
                work,
            )?);
        }
        Ok(())
    }

    fn read(&self, inner: &mut Inner, u: usize, i: usize) -> Result<Tensor, EngineError> {
        self.unsharded(inner, u, i)?;
        match inner.runs[u].unit.looked_up[i] {
            true => inner.runs[u].read_table_whole(&self.cx(), i),
            false => Ok(inner.runs[u].full[i].clone()),
        }
    }

    /// Rows `ids` of parameter `i` of unit `u` (a table): the table, holding at least them.
    fn look_up(
        &self,
        inner: &mut Inner,
        (u, i): (usize, usize),
        ids: &Tensor,
    ) -> Result<Tensor, EngineError> {
        self.unsharded(inner, u, i)?;
        if !inner.runs[u].unit.looked_up[i] {
            return Ok(inner.runs[u].full[i].clone());
        }
        let ids = ids.flatten_all()?.to_dtype(candle_core::DType::I64)?;
        inner.runs[u].look_up(&self.cx(), i, &ids.to_vec1::<i64>()?)
    }

    /// Unit `u` gathered for a read of its parameter `i` (forward reaching it).
    fn unsharded(&self, inner: &mut Inner, u: usize, i: usize) -> Result<(), EngineError> {
        let run = &inner.runs[u];
        if !run.readable() {
            return Err(EngineError::ReadOutsideUnit {
                param: run.unit.params[i].layout.name.clone(),
                unit: run.unit.name(),
                state: run.describe(),
            });
        }
        if run.sharded_state() == ShardedState::Sharded {
            inner.runs[u].wait_for_unshard(&self.cx(), self.hooks(), u)?;
            inner.forward_order.push(u);
            self.prefetch_after(inner, Moment::Gathered, u)?;
            self.read_ahead_after(inner, u, &self.prefetch.forward_order)?;
        }
        Ok(())
    }

    fn output(&self, inner: &mut Inner, u: usize, t: Tensor) -> Result<Tensor, EngineError> {
        inner.runs[u].post_forward(&self.cx(), t, self.hooks(), u)
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
        for (u, run) in inner.runs.iter().enumerate() {
            for o in &run.outputs {
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
        for run in inner.runs.iter_mut() {
            // A checkpointed unit's parameters are not in the graph: its checkpoint node is,
            // and they reach the gradient through the recomputation.
            let recomputed = |i: usize| {
                run.checkpoint
                    .as_ref()
                    .is_some_and(|(id, used)| in_graph.contains(id) && used[i])
            };
            let expected = run
                .unit
                .params
                .iter()
                .zip(&run.full)
                .enumerate()
                .filter(|(i, (p, f))| {
                    p.layout.requires_grad && (in_graph.contains(&f.id()) || recomputed(*i))
                })
                .count();
            run.grads.expected = Some(expected);
        }
        if self.opts.debug {
            debug::check_graph(&inner.runs, &in_graph)?;
        }
        let full: HashSet<TensorId> = inner.runs.iter().flat_map(UnitRun::full_ids).collect();
        let read = backward_reads::read_in_backward(&sorted, &full);
        let cx = self.cx();
        for run in &inner.runs {
            run.release_unread(&cx, &read)?;
        }
        debug::report_unhooked(&inner.runs, &self.opts.unhooked_reported, self.mesh.rank());
        inner.backward_order = order;
        inner.frozen = FrozenReleases::plan(&sorted, &inner.runs);
        Ok(())
    }

    /// Sets how the coming backward treats gradients: reduced (`sync`, with `carried`, what
    /// earlier backwards without sync kept) or kept whole per unit for the next backward.
    pub fn begin_backward(&self, sync: bool, carried: UnreducedUnits) {
        let mut inner = self.lock();
        let carried = carried.into_iter().chain(std::iter::repeat_with(|| None));
        for (run, c) in inner.runs.iter_mut().zip(carried) {
            run.begin_backward(sync, c);
        }
    }

    /// After [`StepShared::finish`] of a backward without sync: what each unit kept.
    pub fn take_unreduced(&self) -> UnreducedUnits {
        self.lock()
            .runs
            .iter_mut()
            .map(|r| {
                r.grads
                    .unreduced
                    .take()
                    .map(|g| (g, r.grads.has_grad.clone()))
            })
            .collect()
    }

    /// Debug mode: why a loss is not finite, when released parameters are the cause.
    pub fn diagnose_non_finite(&self, loss: &Tensor) -> Option<EngineError> {
        debug::diagnose_non_finite(&self.lock().runs, loss)
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
        for (u, run) in inner.runs.iter_mut().enumerate() {
            if let Some(p) = run.finish(&cx)? {
                pending.push((u, p));
            }
        }
        self.store.discard_reads_ahead();
        let mut reduced = std::mem::take(&mut inner.reduced);
        for (u, work) in pending {
            reduced[u] = Some(reduced_block(
                &self.store,
                self.opts.trace.as_deref(),
                &inner.runs,
                u,
                work,
            )?);
        }
        let has_grad = inner
            .runs
            .iter()
            .map(|r| r.grads.has_grad.clone())
            .collect();
        Ok((reduced, has_grad))
    }

    /// Units in the order this step's forward first used them.
    pub fn forward_order(&self) -> Vec<usize> {
        self.lock().forward_order.clone()
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
        let (anchor, used) = {
            let inner = self.lock();
            let run = &inner.runs[u];
            let used: Vec<bool> = run
                .full
                .iter()
                .map(|f| used_ids.contains(&f.id()))
                .collect();
            (run.anchor(), used)
        };
        drop(used_ids);
        let Some(anchor) = anchor else {
            return Err(EngineError::CheckpointWithoutParameters {
                unit: self.unit_label(u),
            });
        };
        let data = self
            .plane
            .copy(&out, &format!("the output of {}", self.unit_label(u)))?;
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
        self.lock().runs[u].checkpoint = Some((y.id(), used));
        Ok(y)
    }

    /// Unit `u` in words (takes the lock).
    fn unit_label(&self, u: usize) -> String {
        self.lock().runs[u].unit.name()
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
        let result = inner.runs[u].pre_backward(&self.cx()).and_then(|refilled| {
            if refilled {
                self.prefetch_after(&mut inner, Moment::Refilled, u)?;
                let order = inner.backward_order.clone();
                self.read_ahead_after(&inner, u, &order)
            } else {
                Ok(())
            }
        });
        let result = result.and_then(|()| {
            let Inner { frozen, runs, .. } = &mut *inner;
            frozen.at_outputs(runs, u, &self.cx())
        });
        result.map_err(|e| self.fail(&mut inner, e))
    }

    fn post_backward(&self, u: usize, i: usize, grad: &Tensor) -> candle_core::Result<()> {
        let mut inner = self.lock();
        let result = inner.runs[u]
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
        let result = result.and_then(|()| {
            let Inner { frozen, runs, .. } = &mut *inner;
            frozen.at_param(runs, (u, i), &self.cx())
        });
        result.map_err(|e| self.fail(&mut inner, e))
    }
}
