//! What a plan keeps on disk ([`DiskOffload`], from the settings), and the disk tier made for
//! it after checking the disk has room.

use std::sync::Arc;

use fsdp_comm::Mesh;

use super::DiskTier;
use crate::config::FsdpPlugin;
use crate::engine::error::EngineError;
use crate::engine::plan::UnitPlan;

/// What a plan keeps in the disk tier between uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskOffload {
    /// Parameter shards, reduced gradients and optimizer state (`fsdp_offload_params`).
    pub params: bool,
    /// Optimizer state (`fsdp_offload_optimizer`, or with `params`).
    pub optimizer: bool,
}

impl DiskOffload {
    /// What `plugin` puts on disk: nothing without `fsdp_offload_dir`; the optimizer state
    /// with `fsdp_offload_optimizer`; everything with `fsdp_offload_params`.
    pub fn for_plugin(plugin: &FsdpPlugin) -> DiskOffload {
        DiskOffload {
            params: plugin.offload_dir.is_some() && plugin.offload_params,
            optimizer: plugin.offload_dir.is_some()
                && (plugin.offload_params || plugin.offload_optimizer),
        }
    }
}

/// The disk tier `plugin` asks for (`fsdp_offload_dir` with `fsdp_offload_params` or
/// `fsdp_offload_optimizer`), after checking the disk has room for this rank's share of the
/// plan (its estimate counts Adam's two buffers per element).
pub(crate) fn offload_tier(
    plugin: &FsdpPlugin,
    plan: &UnitPlan,
    mesh: &Mesh,
) -> Result<Option<Arc<DiskTier>>, EngineError> {
    let Some(dir) = &plugin.offload_dir else {
        return Ok(None);
    };
    if !plan.disk.optimizer {
        return Ok(None);
    }
    let what = if plan.disk.params {
        "parameter shards, gradients and optimizer state"
    } else {
        "optimizer state"
    };
    let needed = plan.memory_estimate().disk as u64;
    let tier = DiskTier::create(dir, mesh.rank(), plan.disk.params, needed, what)?;
    // Writes waiting for the disk: at most one unit's blocks of every offloaded kind.
    let largest = plan
        .units
        .iter()
        .map(|u| u.shard_numel())
        .max()
        .unwrap_or(0) as u64;
    let kinds = if plan.disk.params { 4 } else { 2 };
    tier.set_write_cap(kinds * largest * 4);
    tracing::info!(
        "offloading {what} to {}; {}",
        tier.path().display(),
        plan.memory_summary()
    );
    Ok(Some(Arc::new(tier)))
}
