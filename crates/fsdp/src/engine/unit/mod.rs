//! A unit, as FSDP2's parameter group: its parameters' shards, kept between steps
//! (`shards`), and its lifecycle in a step: a training state (idle, forward, pre-backward,
//! post-backward) times a sharded state (sharded, unsharded, released after forward), moved
//! only by `unshard` / `wait_for_unshard` / `post_forward` (`forward`) and `pre_backward` /
//! `post_backward` / `finish` (`backward`), with prefetch decided in one place
//! ([`Prefetch`]). This file holds the type, its state within a step and what the step
//! reads of it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use candle_core::{Device, Tensor, TensorId, Var};
use fsdp_comm::{Buffer, Mesh, Work};

use super::ShardStore;
use super::collectives::CommDtypes;
use super::data_plane::DataPlane;
use super::error::EngineError;
use super::param::FsdpParam;
use super::plan::{ShardLayout, UnitKind};
use super::shared_gather::{GatherBlocks, SharedRound};
use crate::trace::Tracer;

mod backward;
mod forward;
mod grads;
mod prefetch;
mod shards;
mod tables;

use grads::UnitGrads;
pub(crate) use prefetch::{Moment, Prefetch};
pub(crate) use shards::{IGNORED_MODULES, grad_elements};

/// What the unit is doing in the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TrainingState {
    /// Not in forward or backward (before, between, after).
    Idle,
    /// Its forward is running.
    Forward,
    /// Its backward is running (refilled).
    PreBackward,
    /// Its gradients are reduced: its backward is over.
    PostBackward,
}

/// Whether the unit's full parameters exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShardedState {
    /// Only shards (not gathered yet, or resharded after backward).
    Sharded,
    /// Full parameters present.
    Unsharded,
    /// Full parameters released after the forward; their graph nodes remain.
    ReleasedAfterForward,
}

/// Settings every unit of a step shares.
pub(crate) struct RunContext<'a> {
    pub mesh: &'a Mesh,
    /// What moves parameters and gradients in the compute device's memory.
    pub plane: &'a dyn DataPlane,
    pub dtypes: CommDtypes,
    pub device: &'a Device,
    /// Poison released parameters with NaN instead of returning their pages.
    pub poison: bool,
    /// Training (parameters are graph nodes, outputs hooked); false for evaluation, where
    /// no graph is recorded and nothing is refilled.
    pub train: bool,
    /// Evaluation keeps each unit gathered from its first forward to the step's end.
    pub hold: bool,
    /// Where the step's timeline is recorded.
    pub trace: Option<&'a Tracer>,
    /// The shard group's shared blocks that gathers go through where they can.
    pub shared: Option<&'a Arc<GatherBlocks>>,
}

/// A unit as the engine keeps it: its parameters' shards between steps (in its store: memory,
/// or files on disk), how they are laid out for its gathers and
/// reductions, and its state within the step in flight. The engine owns it; a step shares
/// it with its graph hooks for the step's duration, so its shards change only between steps
/// and its step state sits behind a lock.
pub(crate) struct FsdpUnit {
    /// Path of the wrapped module (empty for the root unit).
    pub path: String,
    /// The unit's index in the plan (what its store names its blocks by).
    pub index: usize,
    /// Where the shards live between steps (memory, or disk: the params' own buffers then
    /// empty).
    pub store: ShardStore,
    /// Parameters in packing order.
    pub params: Vec<FsdpParam>,
    /// Free the full parameters after the unit's forward (FULL_SHARD, non-root units).
    pub reshard_after_forward: bool,
    /// Free them once the unit's gradients are reduced (sharded strategies).
    pub reshard_after_backward: bool,
    /// How the unit is spread over the mesh, which decides how it gathers and reduces.
    pub kind: UnitKind,
    /// Per parameter, where its gradient rows sit in the unit's gradient block: the
    /// parameters' layouts with offsets over the trainable ones only, so frozen weights
    /// (LoRA's base) are neither packed, reduced nor scaled (a frozen one's offset is where
    /// the next trainable one starts, and it has no rows there).
    pub grad_layouts: Vec<ShardLayout>,
    /// Elements of one rank's gradient block (its trainable parameters' rows).
    pub grad_block: usize,
    /// Per parameter: an embedding table with a row-sparse gradient that forward gathers by
    /// the rows it looks up ([`super::table_rows`]) instead of with the unit's block (sharded
    /// units over more than one rank only).
    pub looked_up: Vec<bool>,
    /// Per parameter, where its rows sit in the block the unit's all-gather sends: the
    /// parameters' layouts with offsets over those gathered whole only (a looked-up table's
    /// offset is where the next one starts, and it has no rows there).
    pub gather_layouts: Vec<ShardLayout>,
    /// Elements of one rank's gathered block.
    pub gather_block: usize,
    /// The gathered parameters' runs in a rank's gathered block: what int8 blocks are
    /// quantized apart by in a gather.
    pub gather_runs: Arc<[usize]>,
    /// The trainable parameters' runs in a rank's gradient block, for int8 reductions.
    pub grad_runs: Arc<[usize]>,
    /// Its state within the step in flight (fresh between steps).
    in_step: Mutex<InStep>,
    /// The next step's all-gather, issued by the optimizer step once it updated the unit
    /// (the first unit forward gathers), so the step opens with it under way: the next
    /// step's gather in flight when it begins, dropped when the shards change.
    ahead: Mutex<Option<Gather>>,
    /// Per parameter gathered whole: the last training step read it only by rows (an
    /// embedding's lookup), so the next one, where the unit reshards after forward, writes
    /// only the rows it looks up out of the gathered block instead of unpacking the table.
    read_by_rows: Mutex<Vec<bool>>,
}

/// How a step's forward read a parameter gathered whole.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Access {
    /// Not at all.
    #[default]
    None,
    /// Only by rows (an embedding's lookup).
    Rows,
    /// Whole (any other op).
    Whole,
}

/// A gather in flight: over the ring, or published through the shared blocks.
pub(crate) enum InFlight {
    Ring(Work<Buffer>),
    Shared(SharedRound),
}

/// A unit's gathered blocks, waited for: one buffer of every rank's, or a round of the shared
/// blocks still to be read.
pub(crate) enum GatheredUnit {
    Joined(Buffer),
    Shared(SharedRound),
}

/// A gather in flight and when it was issued.
type Gather = (InFlight, Instant);

/// A unit's state within one step: fresh when the step begins, dropped when it ends.
struct InStep {
    training: TrainingState,
    sharded: ShardedState,
    /// A gather in flight (issued by the unit itself, by a prefetch, or ahead of the step).
    gather: Option<Gather>,
    /// With a secondary partition (hpZ): this rank's share of forward's gathered block, which
    /// backward gathers from the mesh's secondary group instead of the shard group.
    secondary: Option<Buffer>,
    /// When the unit's forward and backward began (for the trace).
    forward_began: Option<Instant>,
    backward_began: Option<Instant>,
    anchor: Option<Var>,
    /// The full parameters (graph nodes: outputs of the unit's unshard op), in the unit's
    /// order; the data plane releases their storage after the unit's forward (FULL_SHARD)
    /// and refills it before its backward.
    full: Vec<Tensor>,
    /// Outputs passed through the pre-backward hook.
    outputs: Vec<Tensor>,
    /// Whether forward reported the unit's output at all.
    hooked: bool,
    /// The unit's gradients of this step (and those carried in without sync).
    grads: UnitGrads,
    /// Under activation checkpointing: the unit's checkpoint node and which parameters its
    /// forward read (their gradients come from the recomputation).
    checkpoint: Option<(TensorId, Vec<bool>)>,
    /// Per table looked up by rows: which of its rows its full tensor holds (the same on
    /// every rank of the shard group; empty until the first lookup, cleared on release).
    rows_held: Vec<Vec<bool>>,
    /// Per table looked up by rows: read whole this step (a weight tied to it), so backward
    /// may read it too and a refill gathers it whole again.
    read_whole: Vec<bool>,
    /// Per parameter: released after forward and read by no backward formula of this step
    /// (an embedding table), so it is not refilled before the unit's backward.
    unread_in_backward: Vec<bool>,
    /// Per parameter gathered whole: how forward read it this step.
    access: Vec<Access>,
    /// Per parameter gathered whole: left unpacked, holding only the rows looked up so far
    /// (in `rows_held`), written from `block` ([`FsdpUnit::read_by_rows`]).
    by_rows: Vec<bool>,
    /// The gathered block, kept while a parameter is `by_rows` (until the unit's release).
    block: Option<Buffer>,
}

impl InStep {
    /// Before any step: sharded, idle, holding nothing, for a unit of `params` parameters.
    fn new(params: usize) -> InStep {
        InStep {
            training: TrainingState::Idle,
            sharded: ShardedState::Sharded,
            gather: None,
            secondary: None,
            forward_began: None,
            backward_began: None,
            anchor: None,
            full: Vec::new(),
            outputs: Vec::new(),
            hooked: false,
            grads: UnitGrads::new(params),
            checkpoint: None,
            rows_held: vec![Vec::new(); params],
            read_whole: vec![false; params],
            unread_in_backward: vec![false; params],
            access: vec![Access::None; params],
            by_rows: vec![false; params],
            block: None,
        }
    }

    /// Gathered in this forward, to be released after it, but its output never reached
    /// [`crate::nn::Params::module_output`].
    fn unhooked(&self, unit: &FsdpUnit) -> bool {
        self.sharded != ShardedState::Sharded
            && !unit.path.is_empty()
            && unit.reshard_after_forward
            && !self.hooked
    }

    /// Whether a parameter of the unit may be read now (gathering it first if needed).
    fn readable(&self) -> bool {
        self.training != TrainingState::PostBackward
            && self.sharded != ShardedState::ReleasedAfterForward
    }

    /// The state in words, for messages.
    fn describe(&self) -> &'static str {
        match (self.training, self.sharded) {
            (TrainingState::PostBackward, _) => "reduced (its backward is over)",
            (_, ShardedState::ReleasedAfterForward) => "released after its forward",
            (TrainingState::PreBackward, _) => "re-gathered for its backward",
            (_, ShardedState::Unsharded) => "gathered",
            (_, ShardedState::Sharded) => "sharded",
        }
    }
}

impl FsdpUnit {
    /// Its state in the step in flight. Taken by one method at a time, which never calls
    /// another that takes it; the step's own lock orders the units' callers.
    fn in_step(&self) -> MutexGuard<'_, InStep> {
        lock(&self.in_step)
    }

    /// Forgets the last step's state (its tensors, gathers in flight and gradients), so the
    /// next step starts sharded and idle, with the gather issued ahead of it (if any) in
    /// flight.
    pub fn reset_step(&self) {
        let mut fresh = InStep::new(self.params.len());
        fresh.gather = lock(&self.ahead).take();
        let last = std::mem::replace(&mut *self.in_step(), fresh);
        self.remember_access(&last);
    }

    /// Keeps how the step `last` read the unit's parameters for the next one's forward
    /// ([`FsdpUnit::read_by_rows`]), unless it read none.
    fn remember_access(&self, last: &InStep) {
        if last.access.iter().any(|&a| a != Access::None) {
            let rows = last.access.iter().map(|&a| a == Access::Rows);
            *lock(&self.read_by_rows) = rows.collect();
        }
    }

    /// Issues the all-gather of the next step's forward now (the shards being final until
    /// then), unless the unit is not gathered at all.
    pub fn gather_ahead(
        &self,
        mesh: &Mesh,
        dtypes: CommDtypes,
        shared: Option<&Arc<GatherBlocks>>,
    ) -> Result<(), EngineError> {
        let gather = self.gather_shards(mesh, dtypes, shared)?;
        *lock(&self.ahead) = gather.map(|work| (work, Instant::now()));
        Ok(())
    }

    /// [`FsdpUnit::reset_step`] unless the state is in use on this thread right now (a step
    /// dropped from inside one of its own hooks): then it is reset when the next step
    /// begins.
    pub fn try_reset_step(&self) {
        match self.in_step.try_lock() {
            Ok(mut s) => {
                let last = std::mem::replace(&mut *s, InStep::new(self.params.len()));
                self.remember_access(&last);
            }
            Err(std::sync::TryLockError::Poisoned(e)) => {
                *e.into_inner() = InStep::new(self.params.len());
            }
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
    }

    /// Records the unit's `what` (`forward`, `backward`) from `began` until now; a forward
    /// names the tables it wrote only the looked-up rows of (`by_rows`).
    fn trace_span(
        &self,
        cx: &RunContext,
        what: &'static str,
        began: Option<Instant>,
        by_rows: &[bool],
    ) {
        if let (Some(t), Some(began)) = (cx.trace, began) {
            let unit = self.trace_label();
            let mut args = serde_json::json!({ "unit": unit });
            let tables = by_rows.iter().zip(&self.params).filter(|&(&b, _)| b);
            let tables: Vec<&str> = tables.map(|(_, p)| p.layout.name.as_str()).collect();
            if !tables.is_empty() {
                args["by_rows"] = serde_json::json!(tables);
            }
            t.since(format!("{what} {unit}"), what, began, args);
        }
    }

    /// The unit's anchor variable, once forward gathered it.
    pub fn anchor(&self) -> Option<Var> {
        self.in_step().anchor.clone()
    }

    /// The full parameters of this step, in the unit's order (empty before its forward).
    pub fn full(&self) -> Vec<Tensor> {
        self.in_step().full.clone()
    }

    /// The id of full parameter `i` of this step (none before its forward).
    pub fn full_id(&self, i: usize) -> Option<TensorId> {
        self.in_step().full.get(i).map(Tensor::id)
    }

    /// The outputs passed through the pre-backward hook this step.
    pub fn outputs(&self) -> Vec<Tensor> {
        self.in_step().outputs.clone()
    }

    /// Under activation checkpointing: the unit's forward became the graph node `node`, and
    /// of its parameters it read those marked in `used`.
    pub fn set_checkpoint(&self, node: TensorId, used: Vec<bool>) {
        self.in_step().checkpoint = Some((node, used));
    }

    /// Backward's graph holds the nodes `in_graph`: the unit expects a gradient for each
    /// trained parameter among them (or read by its recomputed forward).
    pub fn expect_gradients(&self, in_graph: &HashSet<TensorId>) {
        let s = &mut *self.in_step();
        // A checkpointed unit's parameters are not in the graph: its checkpoint node is, and
        // they reach the gradient through the recomputation.
        let recomputed = |i: usize| {
            s.checkpoint
                .as_ref()
                .is_some_and(|(id, used)| in_graph.contains(id) && used[i])
        };
        let expected = self
            .params
            .iter()
            .zip(&s.full)
            .enumerate()
            .filter(|(i, (p, f))| {
                p.layout.requires_grad && (in_graph.contains(&f.id()) || recomputed(*i))
            })
            .count();
        s.grads.expected = Some(expected);
    }

    /// Backward is about to run: with `sync`, the unit's gradients are reduced (together
    /// with `carried`: the gradients earlier backwards without sync kept, and which
    /// parameters had one); without, they are kept whole for the next one.
    pub fn begin_backward(&self, sync: bool, carried: Option<(Buffer, Vec<bool>)>) {
        self.in_step().grads.begin_backward(sync, carried);
    }

    /// After a backward without sync: the gradients kept whole, and which parameters had
    /// one.
    pub fn take_unreduced(&self) -> Option<(Buffer, Vec<bool>)> {
        let s = &mut *self.in_step();
        s.grads
            .unreduced
            .take()
            .map(|g| (g, s.grads.has_grad.clone()))
    }

    /// Which parameters received a gradient this step (or carried in).
    pub fn has_grad(&self) -> Vec<bool> {
        self.in_step().grads.has_grad.clone()
    }

    /// Its sharded state in this step.
    pub fn sharded_state(&self) -> ShardedState {
        self.in_step().sharded
    }

    /// Gathered in this forward, to be released after it, but its output never reached
    /// [`crate::nn::Params::module_output`] (the module ran with `forward`, not `call`): it
    /// stays gathered until its backward. The root is exempt (it is never released early).
    pub fn unhooked(&self) -> bool {
        self.in_step().unhooked(self)
    }
}

/// Releases the full parameters' memory (their graph nodes stay).
fn reshard(s: &mut InStep, cx: &RunContext) -> Result<(), EngineError> {
    let params: Vec<&Tensor> = s.full.iter().collect();
    cx.plane.release(&params, cx.poison)?;
    s.rows_held.iter_mut().for_each(Vec::clear);
    s.by_rows.fill(false);
    s.block = None;
    Ok(())
}

/// A lock that outlives a panic of its holder (the state is reset, not trusted, after one).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// `unit` to change its shards (the optimizer step, a checkpoint's load): refused while a
/// step that shares it is open (`op` says what was refused). A gather issued ahead of the
/// next step carries the shards as they were, so it is dropped.
pub(crate) fn exclusive<'a>(
    unit: &'a mut Arc<FsdpUnit>,
    op: &'static str,
) -> Result<&'a mut FsdpUnit, EngineError> {
    let unit = Arc::get_mut(unit).ok_or(EngineError::StepOpen { op })?;
    unit.ahead
        .get_mut()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    Ok(unit)
}

/// Whether a step shares `units` (it holds them from its beginning until its parameters
/// are dropped).
pub(crate) fn in_step(units: &[Arc<FsdpUnit>]) -> bool {
    units.iter().any(|u| Arc::strong_count(u) > 1)
}
