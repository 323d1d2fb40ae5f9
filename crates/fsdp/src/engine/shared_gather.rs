//! Units gathered through shared memory ([`fsdp_comm::SharedBlocks`]): where every rank of
//! the shard group runs on this host, a rank writes its block of a unit's gather straight
//! into its shared block (cast as the in-place gather writes it) and the unit's parameters
//! are unpacked straight out of every rank's block. Each byte is copied once, where the ring
//! copies it into a ring and out into a gathered buffer, and no gathered buffer is faulted in.
//! Units whose block exceeds the blocks, and gathers issued while every slot is still held,
//! take the ring instead; every rank decides alike, since every rank issues and reads the same
//! gathers in the same order.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use fsdp_comm::{Buffer, CommError, Communicator, DType, Mesh, SharedBlocks, Work};

use super::collectives::{CommDtypes, in_place_group};
use super::error::EngineError;

/// How many gathers may be published and not yet read on this rank: the one being read and
/// the one prefetched or issued ahead of the next step (a third would keep one more block
/// resident on every rank, and in every process's RSS once per rank).
const SLOTS: usize = 2;

/// The shard group's shared blocks for gathers, sized for the units that use them.
pub(crate) struct GatherBlocks {
    blocks: Mutex<SharedBlocks>,
    /// The shard group, whose queue a round keeps its place in.
    group: Arc<dyn Communicator>,
    /// What every unit's block is gathered in.
    dtype: DType,
    /// Elements of the largest block that fits.
    capacity: usize,
}

/// A slot of this rank's block, to write a unit's block into (uninitialised memory of the
/// gather's element type).
pub(crate) enum BlockSlot<'a> {
    F32(&'a mut [MaybeUninit<f32>]),
    BF16(&'a mut [MaybeUninit<half::bf16>]),
}

/// Every rank's block of a gathered unit, in rank order, as the data plane reads it.
pub(crate) enum Gathered<'a> {
    /// One after another in one buffer (what a ring's all-gather returns).
    Joined(&'a Buffer),
    /// Each rank's apart, where its owner wrote it (shared memory), in this element type.
    Apart(&'a [&'a [u8]], DType),
}

/// A unit's gather published through the shared blocks: read (or dropped, which releases
/// it) once.
pub(crate) struct SharedRound {
    blocks: Arc<GatherBlocks>,
    round: u64,
    /// Elements of the unit's block.
    elems: usize,
    /// Done once the collectives issued on the shard group before the round have run: the
    /// round is read after them, as the ring's gather would have run after them (so backward
    /// does not run ahead of its reductions, holding more gradients at once than the ring).
    fence: Work<()>,
    /// When it was published.
    pub issued: Instant,
}

impl GatherBlocks {
    /// The blocks for gathers of `blocks` elements (each unit's), made by every rank of the
    /// shard group alike: `None` where its ranks share no memory, the gathers are not
    /// written in place (int8, dtypes other than f32 and bf16, a secondary partition, two
    /// hops across machines), or the shards live on disk (`on_disk`). Sized for the units
    /// up to twice the median block, so one outsized unit (a vocabulary's embeddings) takes
    /// the ring instead of keeping its size resident.
    pub fn for_units(
        mesh: &Mesh,
        dtypes: CommDtypes,
        blocks: &[usize],
        on_disk: bool,
    ) -> Result<Option<Arc<GatherBlocks>>, EngineError> {
        let Some(group) = in_place_group(mesh) else {
            return Ok(None);
        };
        if group.size() < 2 || !through_blocks(dtypes, mesh.secondary.is_some(), on_disk) {
            return Ok(None);
        }
        let Some(capacity) = block_capacity(blocks) else {
            return Ok(None);
        };
        let bytes = capacity * dtypes.param.size();
        let made = group
            .shared_blocks(bytes, SLOTS)
            .map_err(|source| EngineError::Collective {
                op: format!("making the shared blocks of the gathers ({bytes} bytes x {SLOTS})"),
                unit: "every unit".into(),
                source,
            })?;
        Ok(made.map(|blocks| {
            Arc::new(GatherBlocks {
                blocks: Mutex::new(blocks),
                group: group.clone(),
                dtype: dtypes.param,
                capacity,
            })
        }))
    }

    /// This rank's bytes of shared memory for gathers (every slot of its block); resident
    /// from the engine's start, outside the heap the counting allocator sees. A process's RSS
    /// counts every rank's blocks it maps (`ranks` times this).
    pub fn bytes(&self) -> usize {
        shared_bytes(&[self.capacity], self.dtype.size())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SharedBlocks> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes this rank's block of `elems` elements, written by `write` into the slot it
    /// is given (every element of it); `None` (nothing written) where the block does not fit
    /// or every slot is still held: the unit takes the ring.
    pub fn issue(
        self: &Arc<Self>,
        elems: usize,
        write: impl FnOnce(BlockSlot<'_>),
    ) -> Result<Option<SharedRound>, CommError> {
        let mut blocks = self.lock();
        if elems > self.capacity || !blocks.can_publish() {
            return Ok(None);
        }
        let bytes = elems * self.dtype.size();
        let slot = &mut blocks.next_block()?[..bytes];
        // SAFETY: the slot is page-aligned and `bytes` long; any bytes are valid
        // `MaybeUninit`s, and `write` writes every element before it is published.
        unsafe {
            match self.dtype {
                DType::BF16 => write(BlockSlot::BF16(std::slice::from_raw_parts_mut(
                    slot.as_mut_ptr().cast(),
                    elems,
                ))),
                _ => write(BlockSlot::F32(std::slice::from_raw_parts_mut(
                    slot.as_mut_ptr().cast(),
                    elems,
                ))),
            }
        }
        let sent = (blocks.ranks() - 1) * bytes;
        let round = blocks.publish(sent);
        Ok(Some(SharedRound {
            blocks: self.clone(),
            round,
            elems,
            fence: self.group.fence(),
            issued: Instant::now(),
        }))
    }
}

impl SharedRound {
    /// Waits until every rank has published its block of this round and calls `read` with
    /// them (the unit's elements of each), then releases the round. Returns when the wait
    /// ended, and what `read` returned.
    pub fn read<R>(
        mut self,
        read: impl FnOnce(&Gathered<'_>) -> R,
    ) -> Result<(Instant, R), CommError> {
        std::mem::replace(&mut self.fence, Work::ready(Ok(()))).wait()?;
        let dtype = self.blocks.dtype;
        let bytes = self.elems * dtype.size();
        // The round is released by `read_all`, and again (a no-op) when `self` drops.
        let blocks = self.blocks.lock();
        blocks.read_all(self.round, |all| {
            let waited = Instant::now();
            let units: Vec<&[u8]> = all.iter().map(|b| &b[..bytes]).collect();
            (waited, read(&Gathered::Apart(&units, dtype)))
        })
    }
}

impl Drop for SharedRound {
    /// A round dropped unread (a step ended with a prefetch unused, the shards changed under
    /// a gather issued ahead) is released, so its slot comes free on every rank.
    fn drop(&mut self) {
        self.blocks.lock().release(self.round);
    }
}

/// Whether gathers in `dtypes` can go through shared memory's blocks: written in place (f32
/// or bf16, not int8 blocks) from shards in memory (not `on_disk`), without a secondary
/// partition (whose share is kept from a joined buffer).
pub(crate) fn through_blocks(dtypes: CommDtypes, secondary: bool, on_disk: bool) -> bool {
    !dtypes.gather_int8
        && matches!(dtypes.param, DType::F32 | DType::BF16)
        && !secondary
        && !on_disk
}

/// The elements each slot holds for units of `blocks` elements per rank: the largest block
/// up to twice the median (`None` where no unit is gathered).
pub(crate) fn block_capacity(blocks: &[usize]) -> Option<usize> {
    let mut sizes: Vec<usize> = blocks.iter().copied().filter(|&b| b > 0).collect();
    sizes.sort_unstable();
    let median = *sizes.get(sizes.len() / 2)?;
    sizes.iter().rev().find(|&&b| b <= 2 * median).copied()
}

/// Bytes of shared memory each rank keeps for gathers through it, for units of `blocks`
/// elements per rank gathered in elements of `element_bytes`.
pub(crate) fn shared_bytes(blocks: &[usize], element_bytes: usize) -> usize {
    block_capacity(blocks).map_or(0, |c| SLOTS * c * element_bytes)
}

/// Every rank's block of a gathered unit joined into one buffer (for a consumer that keeps
/// it).
pub(crate) fn joined(gathered: &Gathered<'_>) -> Buffer {
    fn join<T: bytemuck::Pod>(blocks: &[&[u8]]) -> Vec<T> {
        let each = blocks.iter().map(|b| bytemuck::cast_slice::<u8, T>(b));
        each.flat_map(|b| b.iter().copied()).collect()
    }
    match gathered {
        Gathered::Joined(b) => (*b).clone(),
        Gathered::Apart(blocks, DType::BF16) => Buffer::BF16(join(blocks)),
        Gathered::Apart(blocks, _) => Buffer::F32(join(blocks)),
    }
}

impl<'a> Gathered<'a> {
    /// Bytes of every rank's blocks together.
    pub fn bytes(&self) -> usize {
        match self {
            Gathered::Joined(b) => b.len() * b.dtype().size(),
            Gathered::Apart(blocks, _) => blocks.iter().map(|b| b.len()).sum(),
        }
    }

    /// Rank by rank, each rank's block as elements of `T` (`None` where the blocks are
    /// another type).
    pub fn blocks_of<T: fsdp_comm::BufferElement + bytemuck::Pod>(
        &self,
        block: usize,
        ranks: usize,
    ) -> Option<Vec<&'a [T]>> {
        match self {
            Gathered::Joined(buffer) => {
                let v = buffer.as_slice::<T>()?;
                (0..ranks)
                    .map(|r| v.get(r * block..(r + 1) * block))
                    .collect()
            }
            Gathered::Apart(blocks, dtype) if *dtype == T::DTYPE => blocks
                .iter()
                .map(|b| bytemuck::try_cast_slice::<u8, T>(b).ok())
                .collect(),
            Gathered::Apart(..) => None,
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Gathered::Joined(buffer) => buffer.dtype(),
            Gathered::Apart(_, dtype) => *dtype,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_blocks_hold_the_largest_unit_up_to_twice_the_median() {
        // A vocabulary-sized unit keeps the ring; the layers fit.
        assert_eq!(block_capacity(&[10, 10, 10, 100]), Some(10));
        assert_eq!(block_capacity(&[10, 12, 20]), Some(20));
        assert_eq!(block_capacity(&[10, 12, 25]), Some(12));
        // Units with nothing to gather do not count.
        assert_eq!(block_capacity(&[0, 0, 5]), Some(5));
        assert_eq!(block_capacity(&[0, 0]), None);
        assert_eq!(shared_bytes(&[10, 12, 20], 4), 2 * 20 * 4);
        assert_eq!(shared_bytes(&[], 4), 0);
    }
}
