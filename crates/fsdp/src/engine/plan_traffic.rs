//! What a training step sends: the bytes one rank puts on the wire per step by the
//! algorithms' theory, for a plan on a mesh — what `bench memory` checks its byte counters
//! against and `estimate-memory` reports before a job starts.

use super::plan::UnitPlan;

/// What a step's traffic depends on besides the plan.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    /// Ranks a parameter is sharded over.
    pub shard_size: usize,
    /// Copies of each shard (hybrid sharding's machines, NO_SHARD's ranks).
    pub replicas: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// The micro-batches before the last run without sync (gradients reduced once a step).
    pub no_sync: bool,
    /// Processes per machine when two-hop collectives carry the shard group's gathers and
    /// reductions (`fsdp_hierarchical_collectives` over several machines); 1 for none.
    pub machine_size: usize,
}

/// Bytes one rank sends per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepTraffic {
    /// Inside its shard group (all-gathers and gradient reduce-scatters).
    pub inside: usize,
    /// Across replicas (the means of reduced gradients).
    pub across: usize,
    /// Inside its secondary group (ZeRO++'s hpZ: backward's gathers of resharded units).
    pub secondary: usize,
    /// In two-hop collectives' first or second hop inside its machine (what `inside` would
    /// count otherwise, with `across_machines`).
    pub within_machine: usize,
    /// In two-hop collectives' hop between machines.
    pub across_machines: usize,
}

impl UnitPlan {
    /// Bytes each rank sends per step inside its shard group, across replicas and inside its
    /// secondary group. Inside:
    /// per unit and micro-batch an all-gather in forward, another before backward when the
    /// unit was resharded after forward (from the secondary group of H ranks when there is
    /// one: H-1 shares of the gathered block's 1/H), and a reduction ((S-1) shard blocks
    /// each for a group of S: a ring reduce-scatter's, or with int8 gradients an all-to-all
    /// of as many encoded blocks). Across R replicas: each unit's reduced block averaged per
    /// reduction (a ring all-reduce's 2(R-1)/R of it, or with int8 gradients an all-gather
    /// of its encoding, R-1 times it); for NO_SHARD the block is the whole unit. Reductions:
    /// one per micro-batch, or one per step when the earlier micro-batches run without sync.
    /// Gradients are reduced for the trainable parameters only. In two hops over M machines
    /// of L processes, what a rank sends inside its shard group is split: (L-1)·M blocks
    /// inside its machine (the second hop of a gather, the first of a reduction) and M-1
    /// across machines, per gather and reduction.
    pub fn traffic_per_step(&self, shape: StepShape) -> StepTraffic {
        let (s, r, micro) = (shape.shard_size, shape.replicas, shape.micro_batches);
        let reductions = if shape.no_sync { 1 } else { micro };
        let mut traffic = StepTraffic {
            inside: 0,
            across: 0,
            secondary: 0,
            within_machine: 0,
            across_machines: 0,
        };
        let h = self.secondary_partition;
        let l = shape.machine_size.max(1);
        for u in &self.units {
            let block = self.reduce_wire_bytes(u);
            if s > 1 {
                let regather = self.strategy.reshards_after_forward() && !u.path.is_empty();
                let wire = self.gather_wire_bytes(u);
                let mut gathers = micro;
                if regather && h > 1 {
                    // Each rank sends its share (the gathered block's 1/h) to h - 1 peers.
                    traffic.secondary += micro * (h - 1) * (s * wire / h);
                } else if regather {
                    gathers += micro;
                }
                let blocks = wire * gathers + block * reductions;
                if l > 1 && s > l && s.is_multiple_of(l) {
                    let m = s / l;
                    traffic.within_machine += (l - 1) * m * blocks;
                    traffic.across_machines += (m - 1) * blocks;
                } else {
                    traffic.inside += (s - 1) * blocks;
                }
            }
            if r > 1 {
                traffic.across += reductions
                    * if self.reduce_dtype.is_quantized() {
                        (r - 1) * block
                    } else {
                        2 * (r - 1) * block / r
                    };
            }
        }
        traffic
    }
}
