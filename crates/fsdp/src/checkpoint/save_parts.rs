//! What a rank writes in a sharded or local save: its parts (tensor rows with their values,
//! borrowed from the engine, read from the disk tier when written, or copied for an
//! asynchronous save), chosen so that rows several ranks hold are written once.

use std::borrow::Cow;
use std::collections::BTreeMap;

use super::RunState;
use super::error::CheckpointError;
use crate::engine::Fsdp;
use crate::optim::Optimizer;

/// One tensor this rank writes: name, full shape, its rows and their values (`V`: borrowed
/// or read later by a synchronous save, owned by an asynchronous one).
pub(super) struct Part<V> {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) rows: [usize; 2],
    pub(super) values: V,
}

/// Where a part's values come from when it is written.
pub(super) trait PartSource {
    /// The values.
    fn get(&self) -> Result<Cow<'_, [f32]>, CheckpointError>;
}

/// A part's values: borrowed from the engine and the optimizer (not copied), or read from
/// the disk tier when the part is written (offloaded state is never all in memory).
pub(super) enum PartValues<'a> {
    Ready(Cow<'a, [f32]>),
    Later(Box<dyn Fn() -> Result<Vec<f32>, crate::engine::EngineError> + 'a>),
}

impl PartSource for PartValues<'_> {
    fn get(&self) -> Result<Cow<'_, [f32]>, CheckpointError> {
        Ok(match self {
            PartValues::Ready(v) => Cow::Borrowed(v.as_ref()),
            PartValues::Later(read) => Cow::Owned(read()?),
        })
    }
}

impl PartSource for Vec<f32> {
    fn get(&self) -> Result<Cow<'_, [f32]>, CheckpointError> {
        Ok(Cow::Borrowed(self))
    }
}

/// An optimizer's parts on this rank, with each parameter's step.
pub(super) type OptimizerParts<V> = (Vec<Part<V>>, BTreeMap<String, u64>);

/// One model's parts on this rank, and its optimizer's when it has one.
pub(super) struct ModelParts<V> {
    pub(super) params: Vec<Part<V>>,
    pub(super) optimizer: Option<OptimizerParts<V>>,
}

/// Everything this rank writes for a sharded or local save.
pub(super) struct RankParts<V> {
    pub(super) rank: usize,
    /// `random_states_{rank}.json`'s bytes.
    pub(super) random: Vec<u8>,
    pub(super) models: Vec<ModelParts<V>>,
}

impl<V: PartSource> Part<V> {
    /// The same part with its values copied out of the engine (what an asynchronous save
    /// holds while it writes).
    fn to_owned_part(&self) -> Result<Part<Vec<f32>>, CheckpointError> {
        Ok(Part {
            name: self.name.clone(),
            shape: self.shape.clone(),
            rows: self.rows,
            values: staging_copy(&self.values.get()?),
        })
    }
}

/// A copy of `values` for the staging of an asynchronous save. Its pages are fresh, and
/// faulting them in is most of the copy's time: large copies ask for transparent huge pages
/// (one fault per 2 MiB instead of per 4 KiB), which the kernel may or may not grant.
fn staging_copy(values: &[f32]) -> Vec<f32> {
    const HUGE: usize = 2 << 20;
    let mut copy = Vec::with_capacity(values.len());
    let bytes = values.len() * 4;
    if bytes >= 2 * HUGE {
        let start = copy.as_mut_ptr() as usize;
        let (from, to) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
        if to > from {
            // SAFETY: advice on whole pages inside this Vec's own allocation, not yet
            // touched; madvise changes no contents and failure is harmless.
            unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE) };
        }
    }
    copy.extend_from_slice(values);
    copy
}

impl<V: PartSource> RankParts<V> {
    /// The same parts with every value copied (the staging copy of an asynchronous save).
    pub(super) fn to_owned_parts(&self) -> Result<RankParts<Vec<f32>>, CheckpointError> {
        let copy = |parts: &[Part<V>]| -> Result<Vec<_>, CheckpointError> {
            parts.iter().map(Part::to_owned_part).collect()
        };
        Ok(RankParts {
            rank: self.rank,
            random: self.random.clone(),
            models: self
                .models
                .iter()
                .map(|m| {
                    Ok(ModelParts {
                        params: copy(&m.params)?,
                        optimizer: match &m.optimizer {
                            Some((states, steps)) => Some((copy(states)?, steps.clone())),
                            None => None,
                        },
                    })
                })
                .collect::<Result<_, CheckpointError>>()?,
        })
    }
}

impl RankParts<Vec<f32>> {
    /// Bytes of tensor values held.
    pub(super) fn value_bytes(&self) -> u64 {
        let values =
            |parts: &[Part<Vec<f32>>]| parts.iter().map(|p| p.values.len() as u64 * 4).sum::<u64>();
        self.models
            .iter()
            .map(|m| values(&m.params) + m.optimizer.as_ref().map_or(0, |(s, _)| values(s)))
            .sum()
    }
}

/// Whether this rank writes rows that several ranks hold: parameter `index` of the model is
/// written by one of them, chosen round-robin so the work is spread.
fn writes(model: &Fsdp, shard_rows: usize, full_rows: usize, index: usize) -> bool {
    let mesh = model.mesh();
    if shard_rows == full_rows && mesh.shard_size() > 1 {
        // Whole on every rank (an ignored module).
        return index % mesh.world_size() == mesh.rank();
    }
    if mesh.shard_size() == 1 {
        return index % mesh.world_size() == mesh.rank();
    }
    let replica = mesh.replicate.as_ref().map_or(0, |r| r.rank());
    index % mesh.replicas() == replica
}

/// This rank's parts of model `m` (and of its optimizer `opt`): rows it owns and writes.
fn sharded_parts<'a>(
    m: &'a Fsdp,
    opt: Option<&'a dyn Optimizer>,
    local: bool,
) -> Result<ModelParts<PartValues<'a>>, CheckpointError> {
    let (mut params, mut states, mut steps) = (Vec::new(), Vec::new(), BTreeMap::new());
    for (index, (name, shape)) in m.parameters().into_iter().enumerate() {
        let owned = m.owned_rows(name)?;
        let full_rows = shape.first().copied().unwrap_or(1);
        if owned.is_empty() || !(local || writes(m, owned.len(), full_rows, index)) {
            continue;
        }
        let rows = [owned.start, owned.end];
        let part = |name: String, values| Part {
            name,
            shape: shape.to_vec(),
            rows,
            values,
        };
        if let Some(o) = opt
            && let Some((step, keys)) = m.optimizer_state_info(o, name)
        {
            steps.insert(name.to_string(), step);
            for key in keys {
                let values = match o.state(name).and_then(|st| st.buffers.get(&key)) {
                    Some(b) => PartValues::Ready(Cow::Borrowed(b.as_slice())),
                    None => {
                        let key = key.clone();
                        PartValues::Later(Box::new(move || {
                            Ok(m.optimizer_state_buffer(o, name, &key)?.unwrap_or_default())
                        }))
                    }
                };
                states.push(part(format!("{name}.{key}"), values));
            }
        }
        let values = match m.local_values_in_memory(name) {
            Some(v) => PartValues::Ready(Cow::Borrowed(v)),
            None => PartValues::Later(Box::new(move || m.local_values_of(name))),
        };
        params.push(part(name.to_string(), values));
    }
    Ok(ModelParts {
        params,
        optimizer: opt.map(|_| (states, steps)),
    })
}

/// This rank's parts of every model and optimizer for a sharded (or, with `local`, a local)
/// save, borrowed where they are in memory.
pub(super) fn rank_parts<'a>(
    models: &[&'a Fsdp],
    optimizers: &[&'a dyn Optimizer],
    run: &RunState,
    local: bool,
) -> Result<RankParts<PartValues<'a>>, CheckpointError> {
    Ok(RankParts {
        rank: models[0].mesh().rank(),
        random: random_bytes(run)?,
        models: models
            .iter()
            .enumerate()
            .map(|(i, m)| sharded_parts(m, optimizers.get(i).copied(), local))
            .collect::<Result<_, _>>()?,
    })
}

/// `random_states_{rank}.json`'s bytes.
pub(super) fn random_bytes(run: &RunState) -> Result<Vec<u8>, CheckpointError> {
    serde_json::to_vec_pretty(&run.random).map_err(|e| CheckpointError::json("random state", e))
}
