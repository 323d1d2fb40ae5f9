//! A unit, as FSDP2's parameter group: its parameters' shards, kept between steps
//! (`shards`), and its lifecycle in a step: a training state (idle, forward, pre-backward,
//! post-backward) times a sharded state (sharded, unsharded, released after forward), moved
//! only by `unshard` / `wait_for_unshard` / `post_forward` / `pre_backward` /
//! `post_backward`, with prefetch decided in one place ([`Prefetch`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use candle_core::{Device, Shape, Tensor, TensorId, Var};
use fsdp_comm::{Buffer, Mesh, Work};

use super::ShardStore;
use super::collectives::{self, CommDtypes, PendingReduce};
use super::data_plane::DataPlane;
use super::error::EngineError;
use super::hooks::{PreBackward, StepHooks, Unshard};
use super::param::FsdpParam;
use super::plan::{ShardLayout, UnitKind};
use super::quantized_blocks::Codec;
use super::sparse_rows::RowSparsePlan;
use crate::trace::Tracer;

mod grads;
mod prefetch;
mod shards;
mod tables;

use grads::{Completed, GradTarget, UnitGrads};
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
}

/// A unit's state within one step: fresh when the step begins, dropped when it ends.
struct InStep {
    training: TrainingState,
    sharded: ShardedState,
    /// A gather in flight (issued by the unit itself or by a prefetch), and when it was.
    gather: Option<(Work<Buffer>, Instant)>,
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
        self.in_step.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets the last step's state (its tensors, gathers in flight and gradients), so the
    /// next step starts sharded and idle.
    pub fn reset_step(&self) {
        *self.in_step() = InStep::new(self.params.len());
    }

    /// [`FsdpUnit::reset_step`] unless the state is in use on this thread right now (a step
    /// dropped from inside one of its own hooks): then it is reset when the next step
    /// begins.
    pub fn try_reset_step(&self) {
        match self.in_step.try_lock() {
            Ok(mut s) => *s = InStep::new(self.params.len()),
            Err(std::sync::TryLockError::Poisoned(e)) => {
                *e.into_inner() = InStep::new(self.params.len());
            }
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
    }

    /// Records the unit's `what` (`forward`, `backward`) from `began` until now.
    fn trace_span(&self, cx: &RunContext, what: &'static str, began: Option<Instant>) {
        if let (Some(t), Some(began)) = (cx.trace, began) {
            let unit = self.trace_label();
            t.since(
                format!("{what} {unit}"),
                what,
                began,
                serde_json::json!({ "unit": unit }),
            );
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
    /// with `carried`, kept by earlier backwards without sync, whose parameters that had a
    /// gradient are `carried_has_grad`); without, they are kept whole for the next one.
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

    /// The unit's gradients of this backward are all in: adds the carried ones, then issues
    /// the reduction, or keeps the sum whole without sync.
    fn complete(
        &self,
        s: &mut InStep,
        cx: &RunContext,
    ) -> Result<Option<PendingReduce>, EngineError> {
        let collective_failed = |source| EngineError::Collective {
            op: "gradient reduction".into(),
            unit: self.name(),
            source,
        };
        let began = s.backward_began.take();
        self.trace_span(cx, "backward", began);
        let pending = match s.grads.complete(self)? {
            Completed::Nothing => return Ok(None),
            Completed::Rows(rows) => collectives::reduce_compact(cx.mesh, rows),
            Completed::Packed(g) => {
                let sparse = row_sparse_plan(self, cx);
                let quantized = cx.dtypes.reduce_codec.map(|codec| collectives::Quantized {
                    codec,
                    runs: self.grad_runs.clone(),
                });
                collectives::reduce(cx.mesh, g, sparse, self.kind, quantized)
            }
        };
        pending.map(Some).map_err(collective_failed)
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

    /// Forward reads parameter `i`: refused where the unit may not be read (released after
    /// its forward, or its backward over); gathered first when it is still sharded. Returns
    /// whether it was gathered now (forward reached the unit).
    pub fn gather_for_read(
        &self,
        cx: &RunContext,
        (step, index): (Weak<dyn StepHooks>, usize),
        i: usize,
    ) -> Result<bool, EngineError> {
        let s = &mut *self.in_step();
        if !s.readable() {
            return Err(EngineError::ReadOutsideUnit {
                param: self.params[i].layout.name.clone(),
                unit: self.name(),
                state: s.describe(),
            });
        }
        if s.sharded != ShardedState::Sharded {
            return Ok(false);
        }
        self.wait_for_unshard(s, cx, step, index)?;
        Ok(true)
    }

    /// Full parameter `i`, gathered: a table looked up by rows is gathered whole first (a
    /// weight tied to it reads it whole).
    pub fn read(&self, cx: &RunContext, i: usize) -> Result<Tensor, EngineError> {
        let s = &mut *self.in_step();
        if self.looked_up[i] {
            return self.read_table_whole(s, cx, i);
        }
        self.full_param(s, i)
    }

    /// Full parameter `i` of the gathered unit.
    fn full_param(&self, s: &InStep, i: usize) -> Result<Tensor, EngineError> {
        let missing = || EngineError::ReadOutsideUnit {
            param: self.params[i].layout.name.clone(),
            unit: self.name(),
            state: s.describe(),
        };
        s.full.get(i).cloned().ok_or_else(missing)
    }

    /// Issues the unit's all-gather unless one is in flight (also the prefetch entry).
    fn unshard(&self, s: &mut InStep, cx: &RunContext) -> Result<(), EngineError> {
        let gathers = self.ranks(cx.mesh.shard_size()) > 1 && self.gather_block > 0;
        if s.gather.is_none() && gathers {
            // Backward's gather of a unit released after forward, from the secondary group.
            let released = s.sharded == ShardedState::ReleasedAfterForward;
            let work = match (s.secondary.take(), &cx.mesh.secondary) {
                (Some(share), Some(group)) if released => group.all_gather(share),
                _ => collectives::all_gather(cx.mesh, self.gathered_send(cx.dtypes)?),
            };
            s.gather = Some((work, Instant::now()));
        }
        Ok(())
    }

    /// Starts reading the unit's shards from its store when its gather is still to come
    /// (forward and backward order make the next unit known; in memory nothing is read).
    pub fn read_ahead_if_waiting(&self) -> Result<(), EngineError> {
        let s = self.in_step();
        let waiting = matches!(
            s.sharded,
            ShardedState::Sharded | ShardedState::ReleasedAfterForward
        );
        if s.gather.is_none() && waiting && s.training != TrainingState::PostBackward {
            self.read_ahead()?;
        }
        Ok(())
    }

    /// Prefetch: issues the gather only if the unit is in the state it will be gathered
    /// from next (`Sharded` ahead of forward, `ReleasedAfterForward` ahead of backward).
    pub fn prefetch(&self, cx: &RunContext, waiting: ShardedState) -> Result<(), EngineError> {
        let s = &mut *self.in_step();
        if s.sharded == waiting && s.training != TrainingState::PostBackward {
            self.unshard(s, cx)?;
        }
        Ok(())
    }

    /// The gathered block (waits for the gather in flight, issuing it first if needed);
    /// `None` when the shard dimension is this rank alone. With `keep`, this rank's share of
    /// it stays for backward's gather from the secondary group.
    fn gathered(
        &self,
        s: &mut InStep,
        cx: &RunContext,
        when: &str,
        keep: bool,
    ) -> Result<Option<Buffer>, EngineError> {
        self.unshard(s, cx)?;
        let Some((work, issued)) = s.gather.take() else {
            return Ok(None);
        };
        let waited = Instant::now();
        let (gathered, ran) = work
            .wait_timed()
            .map_err(|source| EngineError::Collective {
                op: format!("all-gather {when}"),
                unit: self.name(),
                source,
            })?;
        if let Some(t) = cx.trace {
            let bytes = gathered.len() * gathered.dtype().size();
            let args = serde_json::json!({ "bytes": bytes, "when": when });
            let unit = self.trace_label();
            let ran = ran.unwrap_or((issued, Instant::now()));
            t.collective("all-gather", "all_gather", unit, ran, waited, args);
        }
        if let (true, Some(group)) = (keep, &cx.mesh.secondary) {
            s.secondary = super::secondary::share(&gathered, group.as_ref());
        }
        self.decoded(cx, gathered, &self.gather_runs, when)
            .map(Some)
    }

    /// A gathered block (of parameters in `runs`) in the compute dtype: decoded when the
    /// gather was int8.
    fn decoded(
        &self,
        cx: &RunContext,
        gathered: Buffer,
        runs: &[usize],
        when: &str,
    ) -> Result<Buffer, EngineError> {
        if !cx.dtypes.gather_int8 {
            return Ok(gathered);
        }
        let ranks = self.ranks(cx.mesh.shard_size());
        let decoded = Codec::INT8.decode_gathered(&gathered, runs, ranks, cx.dtypes.param);
        decoded.map_err(|problem| EngineError::State {
            name: format!("the int8 all-gather {when} of {}", self.name()),
            problem,
        })
    }

    /// Forward reached the unit: its full parameters become graph nodes (outputs of
    /// [`Unshard`] on a per-unit anchor variable).
    fn wait_for_unshard(
        &self,
        s: &mut InStep,
        cx: &RunContext,
        step: Weak<dyn StepHooks>,
        index: usize,
    ) -> Result<(), EngineError> {
        let keep = cx.train && self.reshard_after_forward && cx.mesh.secondary.is_some();
        let gathered = self.gathered(s, cx, "before its forward", keep)?;
        let (ranks, block) = (self.ranks(cx.mesh.shard_size()), self.gather_block);
        let anchor = Var::zeros(1, candle_core::DType::F32, cx.device)?;
        let whole = match ranks {
            1 => self.master_block()?,
            _ => Vec::new(),
        };
        let mut full = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let data = match &gathered {
                // Its rows arrive as forward looks them up.
                _ if self.looked_up[i] => cx.plane.zeros(p.layout.numel(), cx.dtypes.param)?,
                Some(g) => cx.plane.unpack(g, &self.gather_layouts[i], block, ranks)?,
                None => {
                    let values = &whole[p.layout.offset..p.layout.offset + p.layout.numel()];
                    cx.plane.whole(values, cx.dtypes.param)?
                }
            };
            let op = Unshard {
                data: Mutex::new(Some(data)),
                shape: Shape::from(p.layout.shape.clone()),
                step: step.clone(),
                unit: index,
                param: i,
            };
            let tensor = if p.layout.requires_grad && cx.train {
                anchor.as_tensor().apply_op1(op)?
            } else {
                anchor.as_tensor().detach().apply_op1_no_bwd(&op)?
            };
            full.push(tensor);
        }
        s.anchor = Some(anchor);
        s.full = full;
        s.training = TrainingState::Forward;
        s.sharded = ShardedState::Unsharded;
        s.forward_began = Some(Instant::now());
        Ok(())
    }

    /// The unit's forward returned `output`: hooked for the pre-backward refill when the unit
    /// reshards after forward (then released, the first time). Returns what forward goes on
    /// with.
    pub fn post_forward(
        &self,
        cx: &RunContext,
        output: Tensor,
        step: Weak<dyn StepHooks>,
        index: usize,
    ) -> Result<Tensor, EngineError> {
        let s = &mut *self.in_step();
        s.hooked = true;
        let began = s.forward_began.take();
        self.trace_span(cx, "forward", began);
        if !cx.train {
            // Evaluation: no backward will need the parameters again.
            let release = self.reshard_after_forward && !cx.hold;
            if release && s.sharded == ShardedState::Unsharded {
                reshard(s, cx)?;
                s.sharded = ShardedState::ReleasedAfterForward;
            }
            s.training = TrainingState::Idle;
            return Ok(output);
        }
        let releasing = self.reshard_after_forward
            && matches!(
                s.sharded,
                ShardedState::Unsharded | ShardedState::ReleasedAfterForward
            );
        if !releasing {
            if s.training == TrainingState::Forward {
                s.training = TrainingState::Idle;
            }
            return Ok(output);
        }
        let hooked = output.hooked_view(PreBackward { step, unit: index });
        s.outputs.push(hooked.clone());
        if s.sharded == ShardedState::Unsharded {
            reshard(s, cx)?;
            s.sharded = ShardedState::ReleasedAfterForward;
        }
        s.training = TrainingState::Idle;
        Ok(hooked)
    }

    /// Whether the unit reshards once its gradients are reduced: sharded strategies do,
    /// except for units with frozen parameters, whose backward nodes may read them to the end
    /// of the step.
    fn reshards_after_backward(&self) -> bool {
        self.reshard_after_backward && self.params.iter().all(|p| p.layout.requires_grad)
    }

    /// Backward is planned and `read` holds the full parameters it will read: the unit's
    /// others are released now instead of after its backward, when it holds them (gathered
    /// since its forward: the root, units kept by SHARD_GRAD_OP or
    /// `fsdp_no_reshard_after_forward`) and reshards after backward anyway. The root of a
    /// model with a tied word embedding and its head fused into the loss holds the largest
    /// tensor of all that way, which no backward formula reads. Units that recompute their
    /// forward in backward, keep frozen parameters or never reshard keep everything.
    pub fn release_unread(
        &self,
        cx: &RunContext,
        read: &HashSet<TensorId>,
    ) -> Result<(), EngineError> {
        let s = self.in_step();
        let releasing = s.sharded == ShardedState::Unsharded
            && s.training != TrainingState::PostBackward
            && s.checkpoint.is_none()
            && self.reshards_after_backward();
        if releasing {
            let unread = s.full.iter();
            let unread: Vec<&Tensor> = unread.filter(|t| !read.contains(&t.id())).collect();
            cx.plane.release(&unread, cx.poison)?;
        }
        Ok(())
    }

    /// Backward reached the unit's output: refills the parameters released after forward.
    /// Returns whether it refilled (a prefetch may follow).
    pub fn pre_backward(&self, cx: &RunContext) -> Result<bool, EngineError> {
        let s = &mut *self.in_step();
        s.backward_began.get_or_insert_with(Instant::now);
        if s.sharded != ShardedState::ReleasedAfterForward {
            return Ok(false);
        }
        let (ranks, block) = (self.ranks(cx.mesh.shard_size()), self.gather_block);
        if block > 0 {
            let gathered = self
                .gathered(s, cx, "before its backward", false)?
                .ok_or_else(|| EngineError::ReadOutsideUnit {
                    param: self
                        .params
                        .first()
                        .map_or(String::new(), |p| p.layout.name.clone()),
                    unit: self.name(),
                    state: "released while whole on this rank",
                })?;
            let layouts = self.gather_layouts.iter().zip(&self.looked_up);
            for (f, (layout, looked_up)) in s.full.iter().zip(layouts) {
                if !looked_up {
                    cx.plane.refill(f, layout, &gathered, block, ranks)?;
                }
            }
        }
        // Backward reads a table looked up by rows only where a weight tied to it read it
        // whole (an embedding's backward reads no weight).
        for i in 0..s.full.len() {
            if s.read_whole[i] {
                self.fill_table(s, cx, i, "before its backward")?;
            }
        }
        s.training = TrainingState::PreBackward;
        s.sharded = ShardedState::Unsharded;
        Ok(true)
    }

    /// The complete gradient of parameter `i` arrived. Once the unit's last one is in, its
    /// reduction is issued and returned, and the unit reshards (units with frozen parameters
    /// when backward no longer reads them: [`FsdpUnit::reshard_frozen`]).
    pub fn post_backward(
        &self,
        cx: &RunContext,
        i: usize,
        grad: &Tensor,
    ) -> Result<Option<PendingReduce>, EngineError> {
        let s = &mut *self.in_step();
        s.backward_began.get_or_insert_with(Instant::now);
        let p = &self.params[i];
        if !s.readable() || s.sharded != ShardedState::Unsharded {
            return Err(EngineError::GradientOutsideUnit {
                param: p.layout.name.clone(),
                unit: self.name(),
                state: s.describe(),
            });
        }
        let to = GradTarget {
            unit: self,
            param: i,
            ranks: self.ranks(cx.mesh.shard_size()),
            dtype: cx.dtypes.reduce,
        };
        let sparse = || row_sparse_plan(self, cx);
        let all_in = s.grads.add(cx.plane, to, grad, sparse)?;
        if !all_in {
            return Ok(None);
        }
        let pending = self.complete(s, cx)?;
        s.training = TrainingState::PostBackward;
        if self.reshards_after_backward() {
            reshard(s, cx)?;
            s.sharded = ShardedState::Sharded;
        }
        Ok(pending)
    }

    /// Backward reads none of this unit's frozen parameters any more: once its gradients
    /// are all in, it reshards (not when it recomputes its forward in backward).
    pub fn reshard_frozen(&self, cx: &RunContext) -> Result<(), EngineError> {
        let s = &mut *self.in_step();
        let done = s.training == TrainingState::PostBackward && s.checkpoint.is_none();
        if done && s.sharded == ShardedState::Unsharded && self.reshard_after_backward {
            reshard(s, cx)?;
            s.sharded = ShardedState::Sharded;
        }
        Ok(())
    }

    /// The step is over: reduces (or, without sync, keeps) gradients that did not all
    /// arrive (backward run outside the engine) and carried ones of a unit that received none
    /// this time, completes an unused prefetch so every rank stays in step, and drops the
    /// unit's tensors.
    pub fn finish(&self, cx: &RunContext) -> Result<Option<PendingReduce>, EngineError> {
        let s = &mut *self.in_step();
        let pending = if s.grads.pending() {
            self.complete(s, cx)?
        } else {
            None
        };
        if let Some((w, _)) = s.gather.take() {
            w.wait().map_err(|source| EngineError::Collective {
                op: "unused prefetch".into(),
                unit: self.name(),
                source,
            })?;
        }
        s.secondary = None;
        s.rows_held.iter_mut().for_each(Vec::clear);
        s.read_whole.iter_mut().for_each(|w| *w = false);
        s.full.clear();
        s.outputs.clear();
        s.anchor = None;
        s.checkpoint = None;
        s.training = TrainingState::Idle;
        s.sharded = ShardedState::Sharded;
        Ok(pending)
    }
}

/// Releases the full parameters' memory (their graph nodes stay).
fn reshard(s: &mut InStep, cx: &RunContext) -> Result<(), EngineError> {
    let params: Vec<&Tensor> = s.full.iter().collect();
    cx.plane.release(&params, cx.poison)?;
    s.rows_held.iter_mut().for_each(Vec::clear);
    Ok(())
}

/// `unit` to change its shards (the optimizer step, a checkpoint's load): refused while a
/// step that shares it is open (`op` says what was refused).
pub(crate) fn exclusive<'a>(
    unit: &'a mut Arc<FsdpUnit>,
    op: &'static str,
) -> Result<&'a mut FsdpUnit, EngineError> {
    Arc::get_mut(unit).ok_or(EngineError::StepOpen { op })
}

/// Whether a step shares `units` (it holds them from its beginning until its parameters
/// are dropped).
pub(crate) fn in_step(units: &[Arc<FsdpUnit>]) -> bool {
    units.iter().any(|u| Arc::strong_count(u) > 1)
}

/// Where `unit`'s row-sparse parameters lie in its packed gradient, if it has any and its
/// gradients leave this rank (alone, a rank has nothing to send).
fn row_sparse_plan(unit: &FsdpUnit, cx: &RunContext) -> Option<RowSparsePlan> {
    if cx.mesh.world_size() == 1 || unit.kind.is_replicated() {
        return None;
    }
    RowSparsePlan::new(
        &unit.trained_grad_layouts(),
        unit.grad_block,
        cx.mesh.shard_size(),
    )
}
