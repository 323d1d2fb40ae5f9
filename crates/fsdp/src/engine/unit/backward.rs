//! A unit's backward side within a step: refilled before its backward, its gradients
//! added as they arrive and reduced once all are in, resharded when backward no longer reads
//! it, and its tensors dropped when the step finishes.

use std::collections::HashSet;
use std::time::Instant;

use candle_core::{Tensor, TensorId};

use super::grads::{Completed, GradTarget};
use super::{
    FsdpUnit, GatheredUnit, InFlight, InStep, RunContext, ShardedState, TrainingState, reshard,
};
use crate::engine::collectives::{self, PendingReduce};
use crate::engine::error::EngineError;
use crate::engine::plan::ShardLayout;
use crate::engine::shared_gather::Gathered;
use crate::engine::sparse_rows::RowSparsePlan;

impl FsdpUnit {
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
        self.trace_span(cx, "backward", began, &[]);
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

    /// Whether the unit reshards once its gradients are reduced: sharded strategies do,
    /// except for units with frozen parameters, whose backward nodes may read them to the end
    /// of the step.
    fn reshards_after_backward(&self) -> bool {
        self.reshard_after_backward && self.params.iter().all(|p| p.layout.requires_grad)
    }

    /// Backward is planned and `read` holds the full parameters it will read: the unit's
    /// others are released now instead of after its backward, when it holds them (gathered
    /// since its forward: the root, units kept by SHARD_GRAD_OP or
    /// `fsdp_no_reshard_after_forward`) and reshards after backward anyway, or not refilled
    /// before its backward when it released them after forward (FULL_SHARD: an embeddings
    /// unit's tables, of which backward reads only the ids). The root of a model with a tied
    /// word embedding and its head fused into the loss holds the largest tensor of all that
    /// way, which no backward formula reads. Units that recompute their forward in backward,
    /// keep frozen parameters or never reshard keep or refill everything.
    pub fn release_unread(
        &self,
        cx: &RunContext,
        read: &HashSet<TensorId>,
    ) -> Result<(), EngineError> {
        let s = &mut *self.in_step();
        // A table holding only its looked-up rows (in a unit whose output forward never
        // reported, so it was not released) is filled before backward reads it.
        for i in 0..s.full.len() {
            if read.contains(&s.full[i].id()) {
                self.fill_by_rows(s, cx, i)?;
            }
        }
        if s.training == TrainingState::PostBackward
            || s.checkpoint.is_some()
            || !self.reshards_after_backward()
        {
            return Ok(());
        }
        match s.sharded {
            ShardedState::Unsharded => {
                let unread = s.full.iter();
                let unread: Vec<&Tensor> = unread.filter(|t| !read.contains(&t.id())).collect();
                cx.plane.release(&unread, cx.poison)?;
            }
            ShardedState::ReleasedAfterForward => {
                for (unread, f) in s.unread_in_backward.iter_mut().zip(&s.full) {
                    *unread = !read.contains(&f.id());
                }
            }
            ShardedState::Sharded => {}
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
            let refilling = Instant::now();
            let this = &*s;
            let refill_all = |g: &Gathered<'_>| -> Result<(), EngineError> {
                for (i, f) in this.full.iter().enumerate() {
                    if refilled(self, this, i) {
                        cx.plane
                            .refill(f, &self.gather_layouts[i], g, block, ranks)?;
                    }
                }
                Ok(())
            };
            match gathered {
                GatheredUnit::Joined(b) => refill_all(&Gathered::Joined(&b))?,
                GatheredUnit::Shared(round) => {
                    self.read_shared(cx, round, "before its backward", refill_all)?
                }
            }
            self.trace_refill(cx, refilling, s);
        }
        s.unread_in_backward.fill(false);
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

    /// Records the refill before backward from `began` until now, naming the parameters
    /// refilled and their bytes (the trace shows what backward re-gathered into parameter
    /// storage).
    fn trace_refill(&self, cx: &RunContext, began: Instant, s: &InStep) {
        let Some(t) = cx.trace else { return };
        let unit = self.trace_label();
        let params = (0..self.params.len()).filter(|&i| refilled(self, s, i));
        let params: Vec<&ShardLayout> = params.map(|i| &self.params[i].layout).collect();
        let elements: usize = params.iter().map(|l| l.numel()).sum();
        let args = serde_json::json!({
            "unit": unit,
            "params": params.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
            "bytes": elements * cx.dtypes.param.size(),
        });
        t.since(format!("refill {unit}"), "refill", began, args);
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
        // (A round of the shared blocks is released as it drops.)
        if let Some((InFlight::Ring(w), _)) = s.gather.take() {
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

/// Whether `unit`'s pre-backward refills its parameter `i`: gathered whole, and read by some
/// backward formula of the step (or backward was not planned).
fn refilled(unit: &FsdpUnit, s: &InStep, i: usize) -> bool {
    !unit.looked_up[i] && !s.unread_in_backward[i]
}
