//! The FSDP engine. Today: the unit plan (wrap policies, ignored modules, tied-parameter
//! checks, dim-0 shard layout, memory estimate).

pub mod plan;

pub use plan::{MemoryEstimate, PlanError, ShardLayout, Unit, UnitPlan};
