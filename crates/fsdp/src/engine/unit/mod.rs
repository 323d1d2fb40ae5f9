//! A unit's lifecycle in one step, as FSDP2's parameter group: a training state (idle,
//! forward, pre-backward, post-backward) times a sharded state (sharded, unsharded, released
//! after forward), moved only by `unshard` / `wait_for_unshard` / `post_forward` /
//! `pre_backward` / `post_backward`, with prefetch decided in one place ([`Prefetch`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use candle_core::{Device, Shape, Tensor, TensorId, Var};
use fsdp_comm::{Buffer, Mesh, Work};

use super::collectives::{self, CommDtypes, PendingReduce};
use super::data_plane::DataPlane;
use super::error::EngineError;
use super::fsdp_unit::FsdpUnit;
use super::hooks::{PreBackward, StepHooks, Unshard};
use super::quantized_blocks::Codec;
use super::sparse_rows::RowSparsePlan;
use super::unit_grads::{Completed, GradTarget, UnitGrads};
use crate::trace::Tracer;

mod prefetch;
mod tables;

pub(crate) use prefetch::{Moment, Prefetch};

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

/// One unit in one step.
pub(crate) struct UnitRun {
    pub unit: Arc<FsdpUnit>,
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
    pub full: Vec<Tensor>,
    /// Outputs passed through the pre-backward hook.
    pub outputs: Vec<Tensor>,
    /// Whether forward reported the unit's output at all.
    pub hooked: bool,
    /// The unit's gradients of this step (and those carried in without sync).
    pub grads: UnitGrads,
    /// Under activation checkpointing: the unit's checkpoint node and which parameters its
    /// forward read (their gradients come from the recomputation).
    pub checkpoint: Option<(candle_core::TensorId, Vec<bool>)>,
    /// Per table looked up by rows: which of its rows its full tensor holds (the same on
    /// every rank of the shard group; empty until the first lookup, cleared on release).
    rows_held: Vec<Vec<bool>>,
    /// Per table looked up by rows: read whole this step (a weight tied to it), so backward
    /// may read it too and a refill gathers it whole again.
    read_whole: Vec<bool>,
}

impl UnitRun {
    pub fn new(unit: Arc<FsdpUnit>) -> UnitRun {
        let n = unit.params.len();
        UnitRun {
            unit,
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
            grads: UnitGrads::new(n),
            checkpoint: None,
            rows_held: vec![Vec::new(); n],
            read_whole: vec![false; n],
        }
    }

    /// Records the unit's `what` (`forward`, `backward`) from `began` until now.
    fn trace_span(&self, cx: &RunContext, what: &'static str, began: Option<Instant>) {
        if let (Some(t), Some(began)) = (cx.trace, began) {
            let unit = self.unit.trace_label();
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
        self.anchor.clone()
    }

    /// Backward is about to run: with `sync`, the unit's gradients are reduced (together
    /// with `carried`, kept by earlier backwards without sync, whose parameters that had a
    /// gradient are `carried_has_grad`); without, they are kept whole for the next one.
    pub fn begin_backward(&mut self, sync: bool, carried: Option<(Buffer, Vec<bool>)>) {
        self.grads.begin_backward(sync, carried);
    }

    /// The unit's gradients of this backward are all in: adds the carried ones, then issues
    /// the reduction, or keeps the sum whole without sync.
    fn complete(&mut self, cx: &RunContext) -> Result<Option<PendingReduce>, EngineError> {
        let collective_failed = |source| EngineError::Collective {
            op: "gradient reduction".into(),
            unit: self.unit.name(),
            source,
        };
        let began = self.backward_began.take();
        self.trace_span(cx, "backward", began);
        let pending = match self.grads.complete(&self.unit)? {
            Completed::Nothing => return Ok(None),
            Completed::Rows(rows) => collectives::reduce_compact(cx.mesh, rows),
            Completed::Packed(g) => {
                let sparse = row_sparse_plan(&self.unit, cx);
                let quantized = cx.dtypes.reduce_codec.map(|codec| collectives::Quantized {
                    codec,
                    runs: self.unit.grad_runs.clone(),
                });
                collectives::reduce(cx.mesh, g, sparse, self.unit.kind, quantized)
            }
        };
        pending.map(Some).map_err(collective_failed)
    }

    /// The state in words, for messages.
    pub fn describe(&self) -> &'static str {
        match (self.training, self.sharded) {
            (TrainingState::PostBackward, _) => "reduced (its backward is over)",
            (_, ShardedState::ReleasedAfterForward) => "released after its forward",
            (TrainingState::PreBackward, _) => "re-gathered for its backward",
            (_, ShardedState::Unsharded) => "gathered",
            (_, ShardedState::Sharded) => "sharded",
        }
    }

    pub fn sharded_state(&self) -> ShardedState {
        self.sharded
    }

    /// Gathered in this forward, to be released after it, but its output never reached
    /// [`crate::nn::Params::module_output`] (the module ran with `forward`, not `call`): it
    /// stays gathered until its backward. The root is exempt (it is never released early).
    pub fn unhooked(&self) -> bool {
        self.sharded != ShardedState::Sharded
            && !self.unit.path.is_empty()
            && self.unit.reshard_after_forward
            && !self.hooked
    }

    /// Whether a parameter of the unit may be read now (gathering it first if needed).
    pub fn readable(&self) -> bool {
        self.training != TrainingState::PostBackward
            && self.sharded != ShardedState::ReleasedAfterForward
    }

    /// Issues the unit's all-gather unless one is in flight (also the prefetch entry).
    pub fn unshard(&mut self, cx: &RunContext) -> Result<(), EngineError> {
        let gathers = self.unit.ranks(cx.mesh.shard_size()) > 1 && self.unit.gather_block > 0;
        if self.gather.is_none() && gathers {
            // Backward's gather of a unit released after forward, from the secondary group.
            let released = self.sharded == ShardedState::ReleasedAfterForward;
            let work = match (self.secondary.take(), &cx.mesh.secondary) {
                (Some(share), Some(group)) if released => group.all_gather(share),
                _ => {
                    let block = self.unit.gathered_block()?;
                    collectives::all_gather(cx.mesh, block, &self.unit.gather_runs, cx.dtypes)?
                }
            };
            self.gather = Some((work, Instant::now()));
        }
        Ok(())
    }

    /// Starts reading the unit's shards from the disk tier when its gather is still to
    /// come (forward and backward order make the next unit known).
    pub fn read_ahead(&self) -> Result<(), EngineError> {
        let waiting = matches!(
            self.sharded,
            ShardedState::Sharded | ShardedState::ReleasedAfterForward
        );
        if self.gather.is_none() && waiting && self.training != TrainingState::PostBackward {
            self.unit.read_ahead()?;
        }
        Ok(())
    }

    /// Prefetch: issues the gather only if the unit is in the state it will be gathered
    /// from next (`Sharded` ahead of forward, `ReleasedAfterForward` ahead of backward).
    pub fn prefetch(&mut self, cx: &RunContext, waiting: ShardedState) -> Result<(), EngineError> {
        if self.sharded == waiting && self.training != TrainingState::PostBackward {
            self.unshard(cx)?;
        }
        Ok(())
    }

    /// The gathered block (waits for the gather in flight, issuing it first if needed);
    /// `None` when the shard dimension is this rank alone. With `keep`, this rank's share of
    /// it stays for backward's gather from the secondary group.
    fn gathered(
        &mut self,
        cx: &RunContext,
        when: &str,
        keep: bool,
    ) -> Result<Option<Buffer>, EngineError> {
        self.unshard(cx)?;
        let Some((work, issued)) = self.gather.take() else {
            return Ok(None);
        };
        let waited = Instant::now();
        let (gathered, ran) = work
            .wait_timed()
            .map_err(|source| EngineError::Collective {
                op: format!("all-gather {when}"),
                unit: self.unit.name(),
                source,
            })?;
        if let Some(t) = cx.trace {
            let bytes = gathered.len() * gathered.dtype().size();
            let args = serde_json::json!({ "bytes": bytes, "when": when });
            let unit = self.unit.trace_label();
            let ran = ran.unwrap_or((issued, Instant::now()));
            t.collective("all-gather", "all_gather", unit, ran, waited, args);
        }
        if let (true, Some(group)) = (keep, &cx.mesh.secondary) {
            self.secondary = super::secondary::share(&gathered, group.as_ref());
        }
        self.decoded(cx, gathered, &self.unit.gather_runs, when)
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
        let ranks = self.unit.ranks(cx.mesh.shard_size());
        let decoded = Codec::INT8.decode_gathered(&gathered, runs, ranks, cx.dtypes.param);
        decoded.map_err(|problem| EngineError::State {
            name: format!("the int8 all-gather {when} of {}", self.unit.name()),
            problem,
        })
    }

    /// Forward reached the unit: its full parameters become graph nodes (outputs of
    /// [`Unshard`] on a per-unit anchor variable).
    pub fn wait_for_unshard(
        &mut self,
        cx: &RunContext,
        step: Weak<dyn StepHooks>,
        index: usize,
    ) -> Result<(), EngineError> {
        let keep = cx.train && self.unit.reshard_after_forward && cx.mesh.secondary.is_some();
        let gathered = self.gathered(cx, "before its forward", keep)?;
        let (ranks, block) = (
            self.unit.ranks(cx.mesh.shard_size()),
            self.unit.gather_block,
        );
        let anchor = Var::zeros(1, candle_core::DType::F32, cx.device)?;
        let whole = match ranks {
            1 => self.unit.master_block()?,
            _ => Vec::new(),
        };
        let mut full = Vec::with_capacity(self.unit.params.len());
        for (i, p) in self.unit.params.iter().enumerate() {
            let data = match &gathered {
                // Its rows arrive as forward looks them up.
                _ if self.unit.looked_up[i] => cx.plane.zeros(p.layout.numel(), cx.dtypes.param)?,
                Some(g) => cx
                    .plane
                    .unpack(g, &self.unit.gather_layouts[i], block, ranks)?,
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
        self.anchor = Some(anchor);
        self.full = full;
        self.training = TrainingState::Forward;
        self.sharded = ShardedState::Unsharded;
        self.forward_began = Some(Instant::now());
        Ok(())
    }

    /// The unit's forward returned `output`: hooked for the pre-backward refill when the unit
    /// reshards after forward (then released, the first time). Returns what forward goes on
    /// with.
    pub fn post_forward(
        &mut self,
        cx: &RunContext,
        output: Tensor,
        step: Weak<dyn StepHooks>,
        index: usize,
    ) -> Result<Tensor, EngineError> {
        self.hooked = true;
        let began = self.forward_began.take();
        self.trace_span(cx, "forward", began);
        if !cx.train {
            // Evaluation: no backward will need the parameters again.
            let release = self.unit.reshard_after_forward && !cx.hold;
            if release && self.sharded == ShardedState::Unsharded {
                self.reshard(cx)?;
                self.sharded = ShardedState::ReleasedAfterForward;
            }
            self.training = TrainingState::Idle;
            return Ok(output);
        }
        let releasing = self.unit.reshard_after_forward
            && matches!(
                self.sharded,
                ShardedState::Unsharded | ShardedState::ReleasedAfterForward
            );
        if !releasing {
            if self.training == TrainingState::Forward {
                self.training = TrainingState::Idle;
            }
            return Ok(output);
        }
        let hooked = output.hooked_view(PreBackward { step, unit: index });
        self.outputs.push(hooked.clone());
        if self.sharded == ShardedState::Unsharded {
            self.reshard(cx)?;
            self.sharded = ShardedState::ReleasedAfterForward;
        }
        self.training = TrainingState::Idle;
        Ok(hooked)
    }

    /// Releases the full parameters' memory (their graph nodes stay).
    fn reshard(&mut self, cx: &RunContext) -> Result<(), EngineError> {
        let params: Vec<&Tensor> = self.full.iter().collect();
        cx.plane.release(&params, cx.poison)?;
        self.rows_held.iter_mut().for_each(Vec::clear);
        Ok(())
    }

    /// Whether the unit reshards once its gradients are reduced: sharded strategies do,
    /// except for units with frozen parameters, whose backward nodes may read them to the end
    /// of the step.
    fn reshards_after_backward(&self) -> bool {
        self.unit.reshard_after_backward && self.unit.params.iter().all(|p| p.layout.requires_grad)
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
        let releasing = self.sharded == ShardedState::Unsharded
            && self.training != TrainingState::PostBackward
            && self.checkpoint.is_none()
            && self.reshards_after_backward();
        if releasing {
            let unread = self.full.iter();
            let unread: Vec<&Tensor> = unread.filter(|t| !read.contains(&t.id())).collect();
            cx.plane.release(&unread, cx.poison)?;
        }
        Ok(())
    }

    /// The full parameters' tensor ids, for [`UnitRun::release_unread`]'s `read`.
    pub fn full_ids(&self) -> impl Iterator<Item = TensorId> + '_ {
        self.full.iter().map(Tensor::id)
    }

    /// Backward reached the unit's output: refills the parameters released after forward.
    /// Returns whether it refilled (a prefetch may follow).
    pub fn pre_backward(&mut self, cx: &RunContext) -> Result<bool, EngineError> {
        self.backward_began.get_or_insert_with(Instant::now);
        if self.sharded != ShardedState::ReleasedAfterForward {
            return Ok(false);
        }
        let (ranks, block) = (
            self.unit.ranks(cx.mesh.shard_size()),
            self.unit.gather_block,
        );
        if block > 0 {
            let gathered = self
                .gathered(cx, "before its backward", false)?
                .ok_or_else(|| EngineError::ReadOutsideUnit {
                    param: self
                        .unit
                        .params
                        .first()
                        .map_or(String::new(), |p| p.layout.name.clone()),
                    unit: self.unit.name(),
                    state: "released while whole on this rank",
                })?;
            let layouts = self.unit.gather_layouts.iter().zip(&self.unit.looked_up);
            for (f, (layout, looked_up)) in self.full.iter().zip(layouts) {
                if !looked_up {
                    cx.plane.refill(f, layout, &gathered, block, ranks)?;
                }
            }
        }
        // Backward reads a table looked up by rows only where a weight tied to it read it
        // whole (an embedding's backward reads no weight).
        for i in 0..self.full.len() {
            if self.read_whole[i] {
                self.fill_table(cx, i, "before its backward")?;
            }
        }
        self.training = TrainingState::PreBackward;
        self.sharded = ShardedState::Unsharded;
        Ok(true)
    }

    /// The complete gradient of parameter `i` arrived. Once the unit's last one is in, its
    /// reduction is issued and returned, and the unit reshards (units with frozen parameters
    /// when backward no longer reads them: [`UnitRun::reshard_frozen`]).
    pub fn post_backward(
        &mut self,
        cx: &RunContext,
        i: usize,
        grad: &Tensor,
    ) -> Result<Option<PendingReduce>, EngineError> {
        self.backward_began.get_or_insert_with(Instant::now);
        let p = &self.unit.params[i];
        if !self.readable() || self.sharded != ShardedState::Unsharded {
            return Err(EngineError::GradientOutsideUnit {
                param: p.layout.name.clone(),
                unit: self.unit.name(),
                state: self.describe(),
            });
        }
        let to = GradTarget {
            unit: &self.unit,
            param: i,
            ranks: self.unit.ranks(cx.mesh.shard_size()),
            dtype: cx.dtypes.reduce,
        };
        let sparse = || row_sparse_plan(&self.unit, cx);
        let all_in = self.grads.add(cx.plane, to, grad, sparse)?;
        if !all_in {
            return Ok(None);
        }
        let pending = self.complete(cx)?;
        self.training = TrainingState::PostBackward;
        if self.reshards_after_backward() {
            self.reshard(cx)?;
            self.sharded = ShardedState::Sharded;
        }
        Ok(pending)
    }

    /// Backward reads none of this unit's frozen parameters any more: once its gradients
    /// are all in, it reshards (not when it recomputes its forward in backward).
    pub fn reshard_frozen(&mut self, cx: &RunContext) -> Result<(), EngineError> {
        let done = self.training == TrainingState::PostBackward && self.checkpoint.is_none();
        if done && self.sharded == ShardedState::Unsharded && self.unit.reshard_after_backward {
            self.reshard(cx)?;
            self.sharded = ShardedState::Sharded;
        }
        Ok(())
    }

    /// The step is over: reduces (or, without sync, keeps) gradients that did not all
    /// arrive (backward run outside the engine) and carried ones of a unit that received none
    /// this time, completes an unused prefetch so every rank stays in step, and drops the
    /// unit's tensors.
    pub fn finish(&mut self, cx: &RunContext) -> Result<Option<PendingReduce>, EngineError> {
        let pending = if self.grads.pending() {
            self.complete(cx)?
        } else {
            None
        };
        if let Some((w, _)) = self.gather.take() {
            w.wait().map_err(|source| EngineError::Collective {
                op: "unused prefetch".into(),
                unit: self.unit.name(),
                source,
            })?;
        }
        self.secondary = None;
        self.rows_held.iter_mut().for_each(Vec::clear);
        self.read_whole.iter_mut().for_each(|w| *w = false);
        self.full.clear();
        self.outputs.clear();
        self.anchor = None;
        self.checkpoint = None;
        self.training = TrainingState::Idle;
        self.sharded = ShardedState::Sharded;
        Ok(pending)
    }
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
