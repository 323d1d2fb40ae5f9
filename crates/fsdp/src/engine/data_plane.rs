//! The engine's data plane: what touches a unit's full parameters and gradients in the
//! compute device's memory — unpacking a gathered block into parameters (cast on the way when
//! the shard group is one rank), releasing and refilling them in place, packing gradients for
//! the reduction, copying a checkpointed unit's output. The control plane (units' states,
//! prefetch, the collectives' order, state by name) calls it through [`DataPlane`] and knows
//! no device; the graph ops move whichever `Storage` the plane made. The CPU's is
//! [`super::cpu_plane::CpuPlane`]; a CUDA plane over NCCL buffers is another implementation.

use candle_core::{Storage, Tensor};
use fsdp_comm::{Buffer, DType};

use super::buffers::GradPack;
use super::error::EngineError;
use super::plan::ShardLayout;
use super::shared_gather::Gathered;

/// The device-specific moves of a step (see the module doc).
pub(crate) trait DataPlane: Send + Sync {
    /// Parameter `layout` out of a gathered unit (every rank's `block` elements in rank
    /// order), as storage of the block's element type.
    fn unpack(
        &self,
        gathered: &Gathered<'_>,
        layout: &ShardLayout,
        block: usize,
        ranks: usize,
    ) -> Result<Storage, EngineError>;

    /// A whole parameter's f32 `values` (the shard group is this rank alone) as storage of
    /// `dtype`.
    fn whole(&self, values: &[f32], dtype: DType) -> Result<Storage, EngineError>;

    /// A table of `numel` zeros of `dtype` for rows to be written into
    /// ([`DataPlane::write_rows`]); on the CPU, zeroed pages the kernel maps only as rows are
    /// written to them.
    fn zeros(&self, numel: usize, dtype: DType) -> Result<Storage, EngineError>;

    /// Writes rows of `values` (each `row_elems` elements) into `param`: for each
    /// `(to, from)` in `placed`, row `from` of `values` becomes row `to` of `param`.
    fn write_rows(
        &self,
        param: &Tensor,
        placed: &[(usize, usize)],
        values: &Buffer,
        row_elems: usize,
    ) -> Result<(), EngineError>;

    /// Frees the memory of one unit's full parameters `params` while the graph still
    /// references them; with `poison` (debug mode) their values become NaN instead. Reads
    /// stay memory-safe.
    fn release(&self, params: &[&Tensor], poison: bool) -> Result<(), EngineError>;

    /// Writes a released parameter's values back from a gathered unit.
    fn refill(
        &self,
        param: &Tensor,
        layout: &ShardLayout,
        gathered: &Gathered<'_>,
        block: usize,
        ranks: usize,
    ) -> Result<(), EngineError>;

    /// Writes parameter `layout`'s full gradient into its rows of every rank's block of
    /// `packed` (cast to the pack's element type). The packed blocks are host memory, so
    /// every plane reads the gradient there (`buffers::visit_gradient` copies one off a
    /// device); a plane reducing on its device would pack there instead.
    fn pack_gradient(
        &self,
        layout: &ShardLayout,
        grad: &Tensor,
        packed: &mut GradPack,
    ) -> Result<(), EngineError> {
        packed.add(layout, grad)
    }

    /// A contiguous copy of `t`'s values (a checkpointed unit's output, kept while its
    /// forward's graph is dropped); `what` names it in errors.
    fn copy(&self, t: &Tensor, what: &str) -> Result<Storage, EngineError>;
}
