//! A unit's shards between steps: how they are laid out for its gathers and reductions, and
//! this rank's rows of them from its store (memory or disk), as the all-gather
//! sends them and as checkpoints and the optimizer read and write them.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use fsdp_comm::{Buffer, DType};

use super::{FsdpUnit, InStep};
use crate::engine::ShardStore;
use crate::engine::collectives::{self, CommDtypes};
use crate::engine::error::{EngineError, unit_name};
use crate::engine::param::FsdpParam;
use crate::engine::plan::{ShardLayout, UnitKind};
use crate::engine::shared_gather::{BlockSlot, GatherBlocks, SharedRound};
use crate::optim::Optimizer;

/// The path the unit of ignored modules' parameters goes by (no module has it).
pub(crate) const IGNORED_MODULES: &str = "(ignored modules)";

impl FsdpUnit {
    /// A unit of `params`; its gradient layouts follow from which of them train, its
    /// gathered block from which are looked up by rows (row-sparse tables of a sharded unit
    /// split over `shard_ranks` > 1).
    pub fn new(
        path: String,
        index: usize,
        store: ShardStore,
        params: Vec<FsdpParam>,
        (reshard_after_forward, reshard_after_backward): (bool, bool),
        (kind, shard_ranks): (UnitKind, usize),
    ) -> FsdpUnit {
        let (grad_layouts, grad_block) = layouts_over(&params, |l| l.requires_grad);
        let by_rows = kind.ranks(shard_ranks) > 1;
        let gathered_whole = |l: &ShardLayout| !(by_rows && l.sparse_grad);
        let looked_up = params.iter().map(|p| !gathered_whole(&p.layout)).collect();
        let (gather_layouts, gather_block) = layouts_over(&params, gathered_whole);
        let gather_runs = crate::engine::plan::runs(&gather_layouts, gathered_whole).into();
        let grad_runs = crate::engine::plan::runs(&grad_layouts, |l| l.requires_grad).into();
        let in_step = Mutex::new(InStep::new(params.len()));
        let read_by_rows = Mutex::new(vec![false; params.len()]);
        FsdpUnit {
            path,
            index,
            store,
            params,
            looked_up,
            gather_layouts,
            gather_block,
            gather_runs,
            grad_runs,
            reshard_after_forward,
            reshard_after_backward,
            kind,
            grad_layouts,
            grad_block,
            in_step,
            ahead: Mutex::new(None),
            read_by_rows,
        }
    }

    /// Updates this rank's rows of each trained parameter that had a gradient (`has_grad`)
    /// with `optimizer`, from the unit's reduced gradient block.
    pub fn update(
        &mut self,
        reduced: &[f32],
        has_grad: &[bool],
        optimizer: &mut dyn Optimizer,
    ) -> Result<(), EngineError> {
        let layouts = self.params.iter_mut().zip(&self.grad_layouts);
        for ((p, g), &has) in layouts.zip(has_grad) {
            if !(p.layout.requires_grad && has) {
                continue;
            }
            let at = grad_elements(p, g);
            let n = at.len();
            optimizer.update(
                &p.layout.name,
                &mut p.shard.values_mut()?[..n],
                &reduced[at],
            )?;
        }
        Ok(())
    }

    /// The layouts of the parameters that train, in the gradient block.
    pub fn trained_grad_layouts(&self) -> Vec<&ShardLayout> {
        self.grad_layouts
            .iter()
            .filter(|l| l.requires_grad)
            .collect()
    }

    /// This rank's elements of parameter `i` in the unit's gradient block (empty for a
    /// frozen one).
    pub fn grad_elements(&self, i: usize) -> std::ops::Range<usize> {
        grad_elements(&self.params[i], &self.grad_layouts[i])
    }

    /// Ranks the unit's parameters are split over ([`UnitKind::ranks`]).
    pub fn ranks(&self, shard_size: usize) -> usize {
        self.kind.ranks(shard_size)
    }

    /// Elements of one rank's block of the unit: every parameter's padded rows, as its store
    /// holds them (the all-gather sends [`FsdpUnit::gather_block`] of them).
    pub fn block(&self) -> usize {
        self.params.iter().map(|p| p.layout.shard_numel()).sum()
    }

    /// Its name in the timeline: its path, `root` for the root.
    pub fn trace_label(&self) -> &str {
        if self.path.is_empty() {
            "root"
        } else {
            &self.path
        }
    }

    /// `the root unit` or ``unit `path` ``.
    pub fn name(&self) -> String {
        unit_name(&self.path)
    }

    /// This rank's block of the unit: every parameter's padded rows at its offset (from its
    /// store).
    pub fn master_block(&self) -> Result<Vec<f32>, EngineError> {
        self.store
            .master_block(self.index, &self.params, self.block())
    }

    /// This rank's block as the unit's all-gather sends it in `dtypes`: the master block
    /// without the tables looked up by rows.
    pub fn gathered_send(&self, dtypes: CommDtypes) -> Result<Buffer, EngineError> {
        self.send_of(dtypes, &self.gather_runs, |i| !self.looked_up[i])
    }

    /// The unit's gathered buffer with this rank's block written in place from its shards
    /// in memory (in f32, or rounded to bf16), for an in-place all-gather over `size` ranks:
    /// the block is not made first and then copied there. `None` where the block is made
    /// otherwise (read from disk, quantized to int8, gathered in another dtype).
    pub fn gathered_room(
        &self,
        dtypes: CommDtypes,
        size: usize,
        rank: usize,
    ) -> Result<Option<Buffer>, EngineError> {
        let Some(rows) = self.rows_for_block(dtypes)? else {
            return Ok(None);
        };
        let k = self.gather_block;
        // SAFETY: each writer below writes its whole slot: the rows are the block's `k`
        // elements (checked by `rows_for_block`), one after another; the buffer goes
        // straight to the gather.
        Ok(Some(match dtypes.param {
            DType::BF16 => unsafe {
                Buffer::for_gather_in_place(size, rank, k, |slot| {
                    for_each_run(slot, &rows, fsdp_nn::ops::f32_to_bf16_into)
                })
            },
            _ => unsafe {
                Buffer::for_gather_in_place(size, rank, k, |slot| {
                    for_each_run(slot, &rows, crate::engine::buffers::write_copy)
                })
            },
        }))
    }

    /// Publishes this rank's block through the shard group's shared blocks, written there
    /// from its shards as [`FsdpUnit::gathered_room`] writes it; `None` where the block is
    /// made otherwise or the blocks cannot take it now (the ring gathers it).
    pub fn shared_gather(
        &self,
        blocks: &Arc<GatherBlocks>,
        dtypes: CommDtypes,
    ) -> Result<Option<SharedRound>, EngineError> {
        let Some(rows) = self.rows_for_block(dtypes)? else {
            return Ok(None);
        };
        let issued = blocks.issue(self.gather_block, |slot| match slot {
            BlockSlot::F32(slot) => for_each_run(slot, &rows, crate::engine::buffers::write_copy),
            BlockSlot::BF16(slot) => for_each_run(slot, &rows, fsdp_nn::ops::f32_to_bf16_into),
        });
        issued.map_err(|source| EngineError::Collective {
            op: "all-gather through shared memory".into(),
            unit: self.name(),
            source,
        })
    }

    /// The rows this rank's block of a gather in `dtypes` is written from in place (the
    /// shards in memory of the parameters gathered whole, `gather_block` elements in all);
    /// `None` where the block is made otherwise (read from disk, quantized to int8, gathered
    /// in a dtype other than f32 and bf16).
    fn rows_for_block(&self, dtypes: CommDtypes) -> Result<Option<Vec<&[f32]>>, EngineError> {
        let keep = |i: usize| !self.looked_up[i];
        if dtypes.gather_int8 || !matches!(dtypes.param, DType::F32 | DType::BF16) {
            return Ok(None);
        }
        let Some(rows) = self.store.rows_in_memory(&self.params, keep)? else {
            return Ok(None);
        };
        if rows.iter().map(|r| r.len()).sum::<usize>() != self.gather_block {
            // Not the block the gather expects: the send path reports it.
            return Ok(None);
        }
        Ok(Some(rows))
    }

    /// This rank's padded rows of parameter `i` alone, as an all-gather of it sends them in
    /// `dtypes`.
    pub fn param_send(&self, i: usize, dtypes: CommDtypes) -> Result<Buffer, EngineError> {
        let runs = [self.params[i].layout.shard_numel()];
        self.send_of(dtypes, &runs, |j| j == i)
    }

    /// The padded rows of the parameters `keep` keeps (`runs` long each), as an all-gather
    /// in `dtypes` sends them: in bf16 rounded straight from shards in memory (no f32 copy
    /// of the block first), else from the store's f32 block ([`collectives::send_block`]).
    fn send_of(
        &self,
        dtypes: CommDtypes,
        runs: &[usize],
        keep: impl Fn(usize) -> bool,
    ) -> Result<Buffer, EngineError> {
        if dtypes.param == DType::BF16
            && !dtypes.gather_int8
            && let Some(rows) = self.store.rows_in_memory(&self.params, &keep)?
        {
            return Ok(Buffer::BF16(fsdp_nn::ops::bf16_from_f32_parts(&rows)));
        }
        let block = (self.store).block_of(self.index, &self.params, self.block(), keep)?;
        collectives::send_block(block, runs, dtypes)
    }

    /// Starts reading the block from its store ahead of its use.
    pub fn read_ahead(&self) -> Result<(), EngineError> {
        self.store.read_ahead(self.index, self.block())
    }

    /// This rank's owned values of parameter `i` (unpadded).
    pub fn local_values(&self, i: usize) -> Result<Cow<'_, [f32]>, EngineError> {
        self.store.local_values(self.index, &self.params[i])
    }

    /// Replaces the owned values of parameter `i` (exactly its owned elements).
    pub fn set_local_values(&mut self, i: usize, values: &[f32]) -> Result<(), EngineError> {
        let block = self.block();
        self.store
            .set_local_values(self.index, &mut self.params[i], values, block)
    }
}

/// The `params`' layouts with offsets over the ones `keep` keeps, packed in order (one left
/// out starts where the next kept one does, with no elements), and the kept elements' total.
fn layouts_over(
    params: &[FsdpParam],
    keep: impl Fn(&ShardLayout) -> bool,
) -> (Vec<ShardLayout>, usize) {
    let mut block = 0;
    let layouts = params
        .iter()
        .map(|p| {
            let layout = ShardLayout {
                offset: block,
                ..p.layout.clone()
            };
            if keep(&p.layout) {
                block += layout.shard_numel();
            }
            layout
        })
        .collect();
    (layouts, block)
}

/// This rank's elements of parameter `p` in its unit's gradient block, where its gradient
/// layout `g` puts it (empty for a frozen one): for loops that hold the unit's parameters
/// mutably beside its `grad_layouts`.
pub(crate) fn grad_elements(p: &FsdpParam, g: &ShardLayout) -> std::ops::Range<usize> {
    let owned = if p.layout.requires_grad {
        p.owned_rows().len() * p.layout.row_elems
    } else {
        0
    };
    g.offset..g.offset + owned
}

/// Writes each of `rows` into the next stretch of `slot` with `write` (the rows fill it).
fn for_each_run<T>(
    slot: &mut [std::mem::MaybeUninit<T>],
    rows: &[&[f32]],
    write: impl Fn(&[f32], &mut [std::mem::MaybeUninit<T>]),
) {
    let mut rest = slot;
    for row in rows {
        let (dst, tail) = rest.split_at_mut(row.len());
        write(row, dst);
        rest = tail;
    }
}
