//! The memory a plan needs per rank ([`MemoryEstimate`]): model state by kind, what is
//! gathered and reduced at backward's peak, what state kept on disk streams through memory,
//! for `fsdp estimate-memory`, the engine's log and the memory benchmark's formula.

use super::collectives::CommDtypes;
use super::plan::{ShardLayout, Unit, UnitPlan};
use super::shared_gather;
use crate::config::FsdpPlugin;
use crate::config::ShardingStrategy;

/// Per-rank bytes of model state, for f32 master weights and AdamW (and, gathered, in the
/// mixed-precision parameter dtype).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryEstimate {
    /// Parameters stored between steps.
    pub params: usize,
    /// Gradients at the optimizer step.
    pub grads: usize,
    /// Optimizer state (two moments).
    pub optimizer: usize,
    /// Full parameters gathered at the peak of forward/backward, beyond the stored shards.
    pub gathered_peak: usize,
    /// Backward's transient gradients at its peak: the largest unit's full gradient and its
    /// packed copy for the reduction; with gradients kept on disk, also three of its blocks
    /// (the reduced block being written, the one waiting for the next reduction, the next
    /// unit's shards read ahead).
    pub reducing: usize,
    /// The secondary partition (ZeRO++'s hpZ): each resharded unit's share of its gathered
    /// block, kept from its forward to its backward.
    pub secondary: usize,
    /// Memory the optimizer step streams state kept on disk through: two units' blocks (the
    /// one in use and the one read ahead, the two largest) of each kind kept there.
    pub streaming: usize,
    /// Bytes kept in files on disk (not in memory).
    pub disk: usize,
}

impl MemoryEstimate {
    /// Peak memory: the state kept in memory plus the larger of backward's peak (gathered
    /// parameters and transient gradients) and the optimizer step's streaming buffers.
    pub fn total(&self) -> usize {
        let backward = self.gathered_peak + self.reducing + self.secondary;
        self.params + self.grads + self.optimizer + backward.max(self.streaming)
    }
}

impl UnitPlan {
    /// About how many bytes of shared memory each rank keeps for gathers through it
    /// ([`crate::engine::Fsdp::shared_gather_bytes`]) under `plugin` where every rank of the
    /// shard group shares one host; 0 for a shard group of one rank, or gathers that cannot go
    /// through it. (A unit's block here includes tables gathered by rows, which the engine
    /// leaves out, and any `fsdp_offload_dir` counts as shards on disk.)
    pub fn shared_gather_bytes(&self, plugin: &FsdpPlugin) -> usize {
        let dtypes = CommDtypes::for_plugin(plugin);
        let secondary = plugin.hpz_partition_size > 1;
        let on_disk = plugin.offload_dir.is_some();
        if self.group_size < 2 || !shared_gather::through_blocks(dtypes, secondary, on_disk) {
            return 0;
        }
        let blocks: Vec<usize> = self.units.iter().map(Unit::shard_numel).collect();
        shared_gather::shared_bytes(&blocks, dtypes.param.size())
    }

    /// Bytes per rank for f32 master weights, f32 gradients and AdamW's two f32 moments.
    pub fn memory_estimate(&self) -> MemoryEstimate {
        let f = 4usize;
        let shard: usize = self.units.iter().map(Unit::shard_numel).sum();
        let full: usize = self.units.iter().map(Unit::numel).sum();
        let trainable_shard: usize = self
            .units
            .iter()
            .flat_map(|u| &u.params)
            .filter(|p| p.requires_grad)
            .map(ShardLayout::shard_numel)
            .sum();
        let ignored: usize = self.ignored.iter().map(ShardLayout::numel).sum();
        let ignored_trainable: usize = self
            .ignored
            .iter()
            .filter(|p| p.requires_grad)
            .map(ShardLayout::numel)
            .sum();
        let mut largest: Vec<usize> = self.units.iter().map(Unit::numel).collect();
        largest.sort_unstable_by(|a, b| b.cmp(a));
        let two_largest: usize = largest.iter().take(2).sum();
        let gathered_peak = match self.strategy {
            // The unit in use and the one being prefetched, and the units kept gathered
            // from their forward to their backward (`fsdp_no_reshard_after_forward`).
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard => {
                two_largest + self.kept_gathered()
            }
            // Everything stays gathered from forward through backward.
            ShardingStrategy::ShardGradOp | ShardingStrategy::HybridShardZero2 => full,
            ShardingStrategy::NoShard => 0,
        };
        // Disk holds whole units' blocks; memory streams one unit's while the next
        // one's are read ahead: at most the two largest blocks of each kind.
        let mut blocks: Vec<usize> = self.units.iter().map(Unit::shard_numel).collect();
        blocks.sort_unstable_by(|a, b| b.cmp(a));
        let two_blocks: usize = blocks.iter().take(2).sum();
        let largest_unit = self.units.iter().map(Unit::numel).max().unwrap_or(0);
        let (on_disk_params, on_disk_state) = (self.disk.params, self.disk.optimizer);
        let grads_on_disk = if on_disk_params {
            3 * blocks.first().copied().unwrap_or(0) * f
        } else {
            0
        };
        let kinds = 2 * usize::from(on_disk_params) + 2 * usize::from(on_disk_state);
        let in_memory = |on_disk: bool, units: usize| if on_disk { 0 } else { units };
        MemoryEstimate {
            // Ignored modules' parameters stay in memory; their gradients and optimizer state
            // go where every unit's go.
            params: (in_memory(on_disk_params, shard) + ignored) * f,
            grads: in_memory(on_disk_params, trainable_shard + ignored_trainable) * f,
            optimizer: 2 * in_memory(on_disk_state, trainable_shard + ignored_trainable) * f,
            // With one rank per group the stored parameters are already whole.
            gathered_peak: if self.group_size == 1 {
                0
            } else {
                gathered_peak * self.gathered_bytes
            },
            // The full gradient, its packed blocks, and with int8 their encoding.
            reducing: largest_unit * (f + self.reduce_bytes)
                + super::quantized_blocks::Codec::for_reduce(self.reduce_dtype)
                    .map_or(0, |c| c.encoded_len(&[largest_unit]))
                + grads_on_disk,
            secondary: self.secondary_bytes(),
            streaming: kinds * two_blocks * f,
            disk: (usize::from(on_disk_params) * (shard + trainable_shard + ignored_trainable)
                + usize::from(on_disk_state) * 2 * (trainable_shard + ignored_trainable))
                * f,
        }
    }

    /// Bytes of the secondary partition: every unit released after forward keeps
    /// 1/`secondary_partition` of its gathered block (as it crossed the wire).
    pub fn secondary_bytes(&self) -> usize {
        if self.secondary_partition < 2 || self.group_size < 2 {
            return 0;
        }
        let resharded = self.units.iter().filter(|u| u.reshard_after_forward);
        resharded
            .map(|u| self.gather_wire_bytes(u) * self.group_size / self.secondary_partition)
            .sum()
    }

    /// Elements of the (non-root) units kept gathered from forward to backward.
    pub fn kept_gathered(&self) -> usize {
        self.units
            .iter()
            .filter(|u| !u.path.is_empty() && !u.reshard_after_forward)
            .filter(|_| self.strategy.reshards_after_forward())
            .map(Unit::numel)
            .sum::<usize>()
    }
}
