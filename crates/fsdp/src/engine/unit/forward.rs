//! A unit's forward side within a step: gathered when forward first reads one of its
//! parameters (or ahead, by a prefetch), its full parameters made graph nodes, and released
//! after its forward when it reshards.

use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use candle_core::{Shape, Tensor, Var};
use fsdp_comm::{Buffer, Mesh};

use super::{
    FsdpUnit, GatheredUnit, InFlight, InStep, RunContext, ShardedState, TrainingState, reshard,
};
use crate::engine::collectives::{self, CommDtypes};
use crate::engine::error::EngineError;
use crate::engine::hooks::{PreBackward, StepHooks, Unshard};
use crate::engine::quantized_blocks::Codec;
use crate::engine::shared_gather::{GatherBlocks, Gathered, SharedRound, joined};

impl FsdpUnit {
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
        s.access[i] = super::Access::Whole;
        self.fill_by_rows(s, cx, i)?;
        self.full_param(s, i)
    }

    /// Full parameter `i` of the gathered unit.
    pub(super) fn full_param(&self, s: &InStep, i: usize) -> Result<Tensor, EngineError> {
        let missing = || EngineError::ReadOutsideUnit {
            param: self.params[i].layout.name.clone(),
            unit: self.name(),
            state: s.describe(),
        };
        s.full.get(i).cloned().ok_or_else(missing)
    }

    /// Issues the unit's all-gather unless one is in flight (also the prefetch entry).
    fn unshard(&self, s: &mut InStep, cx: &RunContext) -> Result<(), EngineError> {
        if s.gather.is_some() {
            return Ok(());
        }
        // Backward's gather of a unit released after forward, from the secondary group.
        let released = s.sharded == ShardedState::ReleasedAfterForward;
        let work = match (s.secondary.take(), &cx.mesh.secondary) {
            (Some(share), Some(group)) if released => Some(InFlight::Ring(group.all_gather(share))),
            _ => self.gather_shards(cx.mesh, cx.dtypes, cx.shared)?,
        };
        s.gather = work.map(|work| (work, Instant::now()));
        Ok(())
    }

    /// Issues the all-gather of the unit's shards over the mesh's shard group (through
    /// `shared`, the group's shared blocks, where they take it); `None` where the unit is not
    /// gathered (one rank holds it whole, or only tables looked up by rows).
    pub(super) fn gather_shards(
        &self,
        mesh: &Mesh,
        dtypes: CommDtypes,
        shared: Option<&Arc<GatherBlocks>>,
    ) -> Result<Option<InFlight>, EngineError> {
        if self.ranks(mesh.shard_size()) < 2 || self.gather_block == 0 {
            return Ok(None);
        }
        if let Some(blocks) = shared
            && let Some(round) = self.shared_gather(blocks, dtypes)?
        {
            return Ok(Some(InFlight::Shared(round)));
        }
        if let Some(group) = collectives::in_place_group(mesh)
            && let Some(room) = self.gathered_room(dtypes, group.size(), group.rank())?
        {
            return Ok(Some(InFlight::Ring(group.all_gather_in_place(room))));
        }
        let send = self.gathered_send(dtypes)?;
        Ok(Some(InFlight::Ring(collectives::all_gather(mesh, send))))
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

    /// The gathered blocks (waits for a ring's gather in flight, issuing it first if
    /// needed; a shared round is waited for as it is read); `None` when the shard dimension is
    /// this rank alone. With `keep`, this rank's share of them stays for backward's gather
    /// from the secondary group.
    pub(super) fn gathered(
        &self,
        s: &mut InStep,
        cx: &RunContext,
        when: &str,
        keep: bool,
    ) -> Result<Option<GatheredUnit>, EngineError> {
        self.unshard(s, cx)?;
        let Some((work, issued)) = s.gather.take() else {
            return Ok(None);
        };
        let work = match work {
            InFlight::Ring(work) => work,
            InFlight::Shared(round) if !keep => return Ok(Some(GatheredUnit::Shared(round))),
            InFlight::Shared(round) => {
                let joined = self.read_shared(cx, round, when, |g| Ok(joined(g)))?;
                let share = &cx.mesh.secondary;
                if let Some(group) = share {
                    s.secondary = crate::engine::secondary::share(&joined, group.as_ref());
                }
                return Ok(Some(GatheredUnit::Joined(joined)));
            }
        };
        let waited = Instant::now();
        let (gathered, ran) = work.wait_timed().map_err(self.gather_failed(when))?;
        let bytes = gathered.len() * gathered.dtype().size();
        let ran = ran.unwrap_or((issued, Instant::now()));
        self.trace_gather(cx, (when, None), (issued, ran), waited, bytes);
        if let (true, Some(group)) = (keep, &cx.mesh.secondary) {
            s.secondary = crate::engine::secondary::share(&gathered, group.as_ref());
        }
        self.decoded(cx, gathered, &self.gather_runs, when)
            .map(|g| Some(GatheredUnit::Joined(g)))
    }

    /// Reads a round of the shared blocks with `read` (waiting for every rank's block),
    /// recording the wait as the unit's all-gather `when` in the trace.
    pub(super) fn read_shared<R>(
        &self,
        cx: &RunContext,
        round: SharedRound,
        when: &str,
        read: impl FnOnce(&Gathered<'_>) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let (issued, asked) = (round.issued, Instant::now());
        let mut bytes = 0;
        let read = |g: &Gathered<'_>| {
            bytes = g.bytes();
            read(g)
        };
        let (waited, result) = round.read(read).map_err(self.gather_failed(when))?;
        let through = Some("shared memory");
        self.trace_gather(
            cx,
            (when, through),
            (issued, (issued, waited)),
            asked,
            bytes,
        );
        result
    }

    /// The error of the unit's all-gather `when`.
    fn gather_failed(&self, when: &str) -> impl Fn(fsdp_comm::CommError) -> EngineError {
        let (op, unit) = (format!("all-gather {when}"), self.name());
        move |source| EngineError::Collective {
            op: op.clone(),
            unit: unit.clone(),
            source,
        }
    }

    /// Records the unit's all-gather `when` (through shared memory or the ring) in the
    /// trace: issued at `issued`, it ran over `ran`, the compute thread waited from `waited`.
    fn trace_gather(
        &self,
        cx: &RunContext,
        (when, through): (&str, Option<&str>),
        (issued, ran): (Instant, (Instant, Instant)),
        waited: Instant,
        bytes: usize,
    ) {
        if let Some(t) = cx.trace {
            let at = t.unix_us(issued);
            let mut args = serde_json::json!({ "bytes": bytes, "when": when, "issued": at });
            if let Some(through) = through {
                args["through"] = through.into();
            }
            t.collective(
                "all-gather",
                "all_gather",
                self.trace_label(),
                ran,
                waited,
                args,
            );
        }
    }

    /// A gathered block (of parameters in `runs`) in the compute dtype: decoded when the
    /// gather was int8.
    pub(super) fn decoded(
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
        // A table the last step only looked up is written row by row from the block as
        // forward looks its rows up, where the block goes when the unit is released.
        let by_rows = match gathered.is_some() && cx.train && self.reshard_after_forward {
            true => super::lock(&self.read_by_rows).clone(),
            false => vec![false; self.params.len()],
        };
        // Every parameter's storage: unpacked from the gathered blocks (straight out of the
        // shared blocks, where the gather went through them), or whole on this rank.
        let storages = |g: Option<&Gathered<'_>>| -> Result<Vec<_>, EngineError> {
            let each = self.params.iter().enumerate().map(|(i, p)| match g {
                // Its rows arrive as forward looks them up.
                _ if self.looked_up[i] || by_rows[i] => {
                    cx.plane.zeros(p.layout.numel(), cx.dtypes.param)
                }
                Some(g) => cx.plane.unpack(g, &self.gather_layouts[i], block, ranks),
                None => {
                    let values = &whole[p.layout.offset..p.layout.offset + p.layout.numel()];
                    cx.plane.whole(values, cx.dtypes.param)
                }
            });
            each.collect()
        };
        let gathered = match gathered {
            // Kept for the rows written later: joined into one buffer.
            Some(GatheredUnit::Shared(round)) if by_rows.contains(&true) => {
                let joined =
                    self.read_shared(cx, round, "before its forward", |g| Ok(joined(g)))?;
                Some(GatheredUnit::Joined(joined))
            }
            other => other,
        };
        let (datas, gathered) = match gathered {
            None => (storages(None)?, None),
            Some(GatheredUnit::Joined(b)) => (storages(Some(&Gathered::Joined(&b)))?, Some(b)),
            Some(GatheredUnit::Shared(round)) => {
                let read = |g: &Gathered<'_>| storages(Some(g));
                (
                    self.read_shared(cx, round, "before its forward", read)?,
                    None,
                )
            }
        };
        let mut full = Vec::with_capacity(self.params.len());
        for (p, data) in self.params.iter().zip(datas) {
            let i = full.len();
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
        if by_rows.contains(&true) {
            if cx.poison {
                // Rows never looked up read as NaN, so a whole read that missed them shows.
                let tables: Vec<&Tensor> = full
                    .iter()
                    .zip(&by_rows)
                    .filter(|t| *t.1)
                    .map(|t| t.0)
                    .collect();
                cx.plane.release(&tables, true)?;
            }
            s.block = gathered;
        }
        s.by_rows = by_rows;
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
        self.trace_span(cx, "forward", began, &s.by_rows);
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
}
