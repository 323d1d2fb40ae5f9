//! The FSDP engine: the unit plan (wrap policies, ignored modules, tied-parameter checks,
//! dim-0 shard layout, memory estimate) and the sharded training step.

pub mod plan;
pub mod sharded;

pub use sharded::{EngineError, Fsdp, StepParams, StepReport};

pub use plan::{MemoryEstimate, PlanError, ShardLayout, Unit, UnitPlan};
