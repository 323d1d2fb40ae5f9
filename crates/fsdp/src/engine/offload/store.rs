//! Where a unit's master shards live between steps, and where its reduced gradients wait
//! for the optimizer step: in memory (the parameters' own buffers), or in the disk tier
//! (`fsdp_offload_params`: the block the all-gather sends, one file per unit, read ahead of
//! its use; each reduced block written out as the next reduction is issued). The engine asks
//! the store, never the tier.

use std::borrow::Cow;
use std::sync::Arc;

use super::grad_block::GradBlock;
use super::{DiskTier, OffloadError, Region};
use crate::engine::error::EngineError;
use crate::engine::param::FsdpParam;

/// A unit's (or a step's) storage of shards and reduced gradients.
#[derive(Debug, Clone, Default)]
pub(crate) enum ShardStore {
    /// In the parameters' own buffers; reduced gradients kept in memory.
    #[default]
    Memory,
    /// In the disk tier: the parameters' own buffers are empty.
    Disk(Arc<DiskTier>),
}

impl ShardStore {
    /// The store a step keeps reduced gradients in: the disk tier when any of `stores` (the
    /// units') is on it.
    pub fn of_units<'a>(stores: impl IntoIterator<Item = &'a ShardStore>) -> ShardStore {
        let mut stores = stores.into_iter();
        stores.find(|s| s.on_disk()).cloned().unwrap_or_default()
    }

    /// Of the reductions in flight (`pending`, oldest first), those to be waited for and
    /// written out now: on disk all but the newest `keep` (taken out of `pending`), so a
    /// rank holds few reduced blocks in memory; in memory none (all are kept until the step
    /// ends).
    pub fn due_reductions<T>(&self, pending: &mut Vec<T>, keep: usize) -> Vec<T> {
        match self {
            ShardStore::Memory => Vec::new(),
            ShardStore::Disk(_) => {
                let keep = keep.min(pending.len());
                pending.drain(..pending.len() - keep).collect()
            }
        }
    }

    /// Shards in the disk tier (whose I/O the step overlaps with compute).
    pub fn on_disk(&self) -> bool {
        matches!(self, ShardStore::Disk(_))
    }

    /// Unit `unit`'s block on this rank (`block` elements: every parameter's padded rows at
    /// its offset): read from the tier, or packed from `params`.
    pub fn master_block(
        &self,
        unit: usize,
        params: &[FsdpParam],
        block: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.block_of(unit, params, block, |_| true)
    }

    /// The padded rows of the parameters `keep` keeps (by index), one after another: unit
    /// `unit`'s block (`block` elements) without the others. In memory only the kept ones
    /// are copied; from the tier the block is read whole (as read ahead) and cut.
    pub fn block_of(
        &self,
        unit: usize,
        params: &[FsdpParam],
        block: usize,
        keep: impl Fn(usize) -> bool,
    ) -> Result<Vec<f32>, EngineError> {
        let kept = || params.iter().enumerate().filter(|(i, _)| keep(*i));
        match self {
            ShardStore::Disk(tier) => {
                let whole = tier.read(&(unit, Region::Params), block)?;
                if kept().count() == params.len() {
                    return Ok(whole);
                }
                let runs = kept().map(|(_, p)| &whole[p.layout.shard_range()]);
                Ok(runs.flatten().copied().collect())
            }
            ShardStore::Memory => packed(kept().map(|(_, p)| p)),
        }
    }

    /// In memory: the padded rows of the parameters `keep` keeps, in order, as they are
    /// (for a send block made straight from them); `None` from disk.
    pub fn rows_in_memory<'a>(
        &self,
        params: &'a [FsdpParam],
        keep: impl Fn(usize) -> bool,
    ) -> Result<Option<Vec<&'a [f32]>>, EngineError> {
        if let ShardStore::Disk(_) = self {
            return Ok(None);
        }
        let kept = params.iter().enumerate().filter(|(i, _)| keep(*i));
        let rows = kept.map(|(_, p)| p.shard.values());
        Ok(Some(rows.collect::<Result<_, _>>()?))
    }

    /// Takes unit `unit`'s freshly made shards in: into the tier as one block, leaving the
    /// parameters' buffers empty (in memory: they stay where they are).
    pub fn take_shards(&self, unit: usize, params: &mut [FsdpParam]) -> Result<(), EngineError> {
        let ShardStore::Disk(tier) = self else {
            return Ok(());
        };
        tier.write(&(unit, Region::Params), packed(params.iter())?)?;
        for p in params {
            p.shard = p.shard.emptied();
        }
        Ok(())
    }

    /// Starts reading unit `unit`'s block from the tier ahead of its use (in memory:
    /// nothing to do).
    pub fn read_ahead(&self, unit: usize, block: usize) -> Result<(), EngineError> {
        if let ShardStore::Disk(tier) = self {
            tier.read_ahead(&(unit, Region::Params), block)?;
        }
        Ok(())
    }

    /// Forgets blocks read ahead that the step did not take (it ended).
    pub fn discard_reads_ahead(&self) {
        if let ShardStore::Disk(tier) = self {
            tier.discard_reads_ahead();
        }
    }

    /// This rank's owned values of `p`, a parameter of unit `unit` (unpadded).
    pub fn local_values<'a>(
        &self,
        unit: usize,
        p: &'a FsdpParam,
    ) -> Result<Cow<'a, [f32]>, EngineError> {
        match self {
            ShardStore::Disk(tier) => {
                let n = p.owned_rows().len() * p.layout.row_elems;
                let key = (unit, Region::Params);
                Ok(Cow::Owned(tier.read_at(&key, p.layout.offset, n)?))
            }
            ShardStore::Memory => Ok(Cow::Borrowed(p.local_values()?)),
        }
    }

    /// Replaces the owned values of `p`, a parameter of unit `unit` whose block has `block`
    /// elements (exactly its owned elements).
    pub fn set_local_values(
        &self,
        unit: usize,
        p: &mut FsdpParam,
        values: &[f32],
        block: usize,
    ) -> Result<(), EngineError> {
        let ShardStore::Disk(tier) = self else {
            return p.set_local_values(values);
        };
        let n = p.owned_rows().len() * p.layout.row_elems;
        if values.len() != n {
            return Err(EngineError::State {
                name: p.layout.name.clone(),
                problem: format!("{} values given for {n} owned elements", values.len()),
            });
        }
        let key = (unit, Region::Params);
        Ok(tier.write_at(&key, p.layout.offset, values, block)?)
    }

    /// Unit `unit`'s reduced gradient block: kept in memory, or written to the tier.
    pub fn keep_reduced(&self, unit: usize, values: Vec<f32>) -> Result<GradBlock, OffloadError> {
        match self {
            ShardStore::Memory => Ok(GradBlock::Memory(values)),
            ShardStore::Disk(tier) => GradBlock::on_disk(tier, unit, values),
        }
    }
}

/// The parameters' shards (padded rows) one after another.
fn packed<'a>(
    params: impl Iterator<Item = &'a FsdpParam> + Clone,
) -> Result<Vec<f32>, EngineError> {
    let mut block = Vec::with_capacity(params.clone().map(|p| p.shard.len()).sum());
    for p in params {
        block.extend_from_slice(p.shard.values()?);
    }
    Ok(block)
}
