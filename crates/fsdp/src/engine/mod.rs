//! The FSDP engine: the unit plan (wrap policies, ignored modules, tied-parameter checks,
//! dim-0 shard layout, memory estimate), one step's unit lifecycle (gather, release, refill,
//! reduce, prefetch), and the sharded engine that owns shards and optimizer state.

pub mod plan;
pub mod sharded;
mod step;

pub use sharded::{EngineError, Fsdp, Gradients, StepParams, StepReport};

pub use plan::{MemoryEstimate, PlanError, ShardLayout, Unit, UnitPlan};
