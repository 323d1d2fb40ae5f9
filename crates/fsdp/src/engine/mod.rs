//! The FSDP engine, in FSDP2's layers: the unit plan (`plan`: wrap policies, ignored
//! modules, tied-parameter checks, dim-0 shard layout, memory estimate); one sharded
//! parameter (`param`); the unit, owning its shards and its lifecycle in a step as a state
//! machine, with prefetch decided in one place (`unit`); the unit's collectives in the
//! dtypes given (`collectives`), gathers through shared memory's blocks (`shared_gather`);
//! the graph ops that hook autograd (`hooks`); float element
//! access both share (`cpu_floats`); initial weights into shards (`intake`); one step
//! driving the units (`step`); debug checks (`debug`); reduced gradients by name (`grads`);
//! fp16 loss scaling agreed over ranks (`grad_scaler`); storage and compute devices
//! (`placement`); the disk tier of offloaded state and the optimizer step streaming it
//! (`offload`); the engine that owns shards (`fsdp`); and its state by parameter name
//! (`state_by_name`).

mod agreement;
mod backward_reads;
mod buffers;
mod collectives;
mod cpu_floats;
mod cpu_plane;
mod data_plane;
mod debug;
mod error;
mod frozen_release;
mod fsdp;
mod grad_scaler;
mod grads;
mod hooks;
mod intake;
mod mesh_layout;
mod offload;
mod param;
mod plan;
mod plan_memory;
mod plan_text;
mod plan_traffic;
mod quantized_blocks;
mod secondary;
mod shared_gather;
mod sparse_rows;
mod staged_plane;
mod state_by_name;
mod step;
mod table_rows;
mod two_hops;
mod unit;

pub use collectives::CommDtypes;
// The stores the units, the step and the engine keep state in (memory or disk).
pub use error::EngineError;
pub use fsdp::{Fsdp, StepReport};
pub use grad_scaler::{GradScaler, GradScalerConfig};
pub use grads::Gradients;
#[doc(hidden)] // `fsdp env`
pub use offload::OFFLOAD_ON_CPU;
pub use offload::Placement;
#[doc(hidden)] // `fsdp env`
pub use offload::free_bytes;
pub use offload::from_plan::DiskOffload;
use offload::{GradBlock, ShardStore, StateOnDisk};
pub use offload::{OffloadError, OffloadStats};
pub use plan::{PlanError, ShardLayout, Unit, UnitPlan};
pub use plan_memory::MemoryEstimate;
pub use plan_traffic::{StepShape, StepTraffic};
pub(crate) use state_by_name::LocalRows;
pub use state_by_name::LocalShard;
pub use step::StepParams;
