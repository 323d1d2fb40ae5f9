//! The engine's state by parameter name and row range — what checkpoints read and write:
//! this rank's rows of every parameter, loading them back, and full parameters gathered to
//! one rank unit by unit (never the whole model on every rank).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::Tensor;
use fsdp_comm::Buffer;

use super::error::{EngineError, unit_name};
use super::fsdp::Fsdp;
use crate::optim::Optimizer;

/// This rank's rows of a parameter, given its name and its number of owned elements; `None`
/// when it has none (see [`Fsdp::gather_rows_to_first`]).
pub(crate) type LocalRows<'a> = dyn Fn(&str, usize) -> Result<Option<Vec<f32>>, EngineError> + 'a;

/// Receives a parameter's full values as consecutive chunks (rank 0 only).
pub(crate) type RowsSink<'a> = dyn FnMut(&str, &[&[f32]]) -> Result<(), EngineError> + 'a;

/// This rank's part of one parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalShard<'a> {
    /// Fully qualified name.
    pub name: &'a str,
    /// The full parameter's shape.
    pub shape: &'a [usize],
    /// The rows of dim 0 this rank holds (empty for a rank holding only padding).
    pub rows: Range<usize>,
    /// Their values, row-major.
    pub values: Cow<'a, [f32]>,
    /// Trainable.
    pub requires_grad: bool,
    /// Every rank holds these same rows (NO_SHARD, ignored modules, replicas of a hybrid
    /// mesh): one copy is enough in a checkpoint.
    pub replicated: bool,
}

impl Fsdp {
    /// Bytes of model state this rank holds between steps: parameter shards (and replicated
    /// parameters) and `optimizer`'s state of them.
    pub fn model_state_bytes(&self, optimizer: &dyn Optimizer) -> usize {
        let params: usize = self
            .units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| p.shard.bytes())
            .sum::<usize>();
        let names = self
            .units
            .iter()
            .flat_map(|u| u.params.iter().map(|p| p.layout.name.as_str()));
        let state: usize = names
            .filter_map(|n| optimizer.state(n))
            .map(|s| s.bytes())
            .sum();
        params + state
    }

    /// This rank's rows of every parameter, in plan order (units, then ignored modules).
    pub fn local_shards(&self) -> Result<Vec<LocalShard<'_>>, EngineError> {
        let whole = self.mesh.shard_size() == 1;
        let mut out = Vec::new();
        for unit in &self.units {
            for (i, p) in unit.params.iter().enumerate() {
                out.push(LocalShard {
                    name: &p.layout.name,
                    shape: &p.layout.shape,
                    rows: p.owned_rows(),
                    values: unit.local_values(i)?,
                    requires_grad: p.layout.requires_grad,
                    replicated: whole || unit.kind.is_replicated() || self.mesh.replicas() > 1,
                });
            }
        }
        Ok(out)
    }

    /// The rows of parameter `name` this rank holds.
    pub fn owned_rows(&self, name: &str) -> Result<Range<usize>, EngineError> {
        self.units
            .iter()
            .flat_map(|u| &u.params)
            .find(|p| p.layout.name == name)
            .map(|p| p.owned_rows())
            .ok_or_else(|| EngineError::UnknownParameter { name: name.into() })
    }

    /// Replaces this rank's rows of parameter `name` (exactly [`Fsdp::owned_rows`], row-major);
    /// refused ([`EngineError::StepOpen`]) while a step's parameters are held.
    pub fn load_local_shard(&mut self, name: &str, values: &[f32]) -> Result<(), EngineError> {
        for unit in &mut self.units {
            let Some(i) = unit.params.iter().position(|p| p.layout.name == name) else {
                continue;
            };
            let unit = super::unit::exclusive(unit, "loading a parameter's rows")?;
            return unit.set_local_values(i, values);
        }
        Err(EngineError::UnknownParameter { name: name.into() })
    }

    /// Calls `f(name, full parameter)` on rank 0 of the mesh for every parameter, gathering one
    /// unit at a time onto that rank (collective: every rank must call it; other ranks only
    /// send). No rank ever holds more than its shards and one unit.
    /// A quantized weight is given as the f32 weight it stands for, dequantized.
    pub(crate) fn for_each_full_param(
        &self,
        mut f: impl FnMut(&str, Tensor) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let shapes: std::collections::HashMap<&str, Vec<usize>> =
            self.exported_parameters().into_iter().collect();
        self.gather_rows_to_first(
            &|name, _| Ok(Some(self.local_values_of(name)?)),
            &mut |name, chunks| {
                let shape = shapes.get(name).map_or(&[][..], Vec::as_slice);
                let values = self.exported_values(name, chunks)?;
                f(
                    name,
                    Tensor::from_vec(values.into_owned(), shape, &self.placement.compute)?,
                )
            },
        )
    }

    /// How parameter `name` is kept quantized, if it is.
    pub(crate) fn packing(&self, name: &str) -> Option<crate::nn::quant::Packing> {
        self.units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| &p.layout)
            .find(|l| l.name == name)
            .and_then(|l| l.packing)
    }

    /// [`Fsdp::parameters`] as exported weights: a quantized weight with the shape of the
    /// f32 weight it stands for.
    pub(crate) fn exported_parameters(&self) -> Vec<(&str, Vec<usize>)> {
        self.parameters()
            .into_iter()
            .map(|(name, shape)| {
                let shape = match self.packing(name) {
                    Some(p) => vec![shape.first().copied().unwrap_or(0), p.cols],
                    None => shape.to_vec(),
                };
                (name, shape)
            })
            .collect()
    }

    /// A gathered parameter's values as exported: a quantized weight's words dequantized.
    pub(crate) fn exported_values<'c>(
        &self,
        name: &str,
        chunks: &[&'c [f32]],
    ) -> Result<Cow<'c, [f32]>, EngineError> {
        let Some(packing) = self.packing(name) else {
            return Ok(match chunks {
                [one] => Cow::Borrowed(*one),
                _ => Cow::Owned(chunks.concat()),
            });
        };
        let values = packing
            .dequantize(&chunks.concat())
            .map_err(|e| EngineError::State {
                name: name.to_string(),
                problem: e.to_string(),
            })?;
        Ok(Cow::Owned(values))
    }

    /// Every parameter's name and full shape, in plan order (units, then ignored modules).
    pub fn parameters(&self) -> Vec<(&str, &[usize])> {
        self.units
            .iter()
            .flat_map(|u| &u.params)
            .map(|p| (p.layout.name.as_str(), p.layout.shape.as_slice()))
            .collect()
    }

    /// This rank's rows of parameter `name`, when they are in memory (not on disk).
    pub(crate) fn local_values_in_memory(&self, name: &str) -> Option<&[f32]> {
        self.units
            .iter()
            .filter(|u| !u.store.on_disk())
            .flat_map(|u| &u.params)
            .find(|p| p.layout.name == name)
            .and_then(|p| p.local_values().ok())
    }

    /// This rank's rows of parameter `name` (copied).
    pub(crate) fn local_values_of(&self, name: &str) -> Result<Vec<f32>, EngineError> {
        for unit in &self.units {
            if let Some(i) = unit.params.iter().position(|p| p.layout.name == name) {
                return Ok(unit.local_values(i)?.into_owned());
            }
        }
        Err(EngineError::UnknownParameter { name: name.into() })
    }

    /// Gathers per-parameter row data onto rank 0 of the mesh one unit at a time and calls
    /// `f(name, full values)` there: `local(name, owned elements)` gives this rank's rows of
    /// each parameter (the parameter itself, or optimizer state laid out like it), `None`
    /// when the parameter has none (then `f` is not called for it; every rank must agree).
    /// Collective; no rank holds more than its rows and one unit.
    pub(crate) fn gather_rows_to_first(
        &self,
        local: &LocalRows<'_>,
        f: &mut RowsSink<'_>,
    ) -> Result<(), EngineError> {
        let first = self.mesh.rank() == 0;
        for unit in &self.units {
            let ranks = unit.ranks(self.mesh.shard_size());
            let block = unit.block();
            let mut packed = Vec::with_capacity(block);
            let mut present = Vec::with_capacity(unit.params.len());
            for p in &unit.params {
                let owned = p.owned_rows().len() * p.layout.row_elems;
                let values = local(&p.layout.name, owned)?;
                present.push(values.is_some());
                let mut values = values.unwrap_or_default();
                if values.len() != owned && !values.is_empty() {
                    return Err(EngineError::State {
                        name: p.layout.name.clone(),
                        problem: format!("{} values for {owned} owned elements", values.len()),
                    });
                }
                values.resize(p.layout.shard_numel(), 0.0);
                packed.extend_from_slice(&values);
            }
            let gathered = if ranks == 1 {
                Some(Buffer::F32(packed))
            } else {
                self.mesh
                    .shard
                    .gather(Buffer::F32(packed), 0)
                    .wait()
                    .map_err(|source| EngineError::Collective {
                        op: "gather onto rank 0".into(),
                        unit: unit_name(&unit.path),
                        source,
                    })?
            };
            let Some(gathered) = gathered.filter(|_| first) else {
                continue;
            };
            let Some(gathered) = gathered.as_slice::<f32>() else {
                continue;
            };
            for (p, &has) in unit.params.iter().zip(&present) {
                if !has {
                    continue;
                }
                // The full value is each rank's rows in rank order: slices of the block,
                // handed over without assembling a copy.
                let chunks: Vec<&[f32]> = (0..ranks)
                    .map(|r| {
                        let (start, end) = p.layout.rows_of(r);
                        let base = r * block + p.layout.offset;
                        &gathered[base..base + (end - start) * p.layout.row_elems]
                    })
                    .collect();
                f(&p.layout.name, &chunks)?;
            }
        }
        Ok(())
    }

    /// Every parameter's full value on rank 0 of the mesh (`None` on the other ranks),
    /// gathered unit by unit (collective).
    pub fn full_state_dict(&self) -> Result<Option<BTreeMap<String, Tensor>>, EngineError> {
        let mut out = BTreeMap::new();
        self.for_each_full_param(|name, t| {
            out.insert(name.to_string(), t);
            Ok(())
        })?;
        Ok((self.mesh.rank() == 0).then_some(out))
    }
}

/// The engine's optimizer state, wherever it is kept (on disk or in the optimizer), as
/// checkpoints read and write it: by parameter name, one buffer at a time.
impl Fsdp {
    /// A checkpoint's optimizer state is about to be loaded: with state kept on disk, what
    /// the disk and `optimizer` held for the sharded parameters is forgotten.
    pub(crate) fn begin_optimizer_load(&mut self, optimizer: &mut dyn Optimizer) {
        if let Some(state) = &mut self.state_on_disk {
            state.begin_load(&self.units, optimizer);
        }
    }

    /// With state kept on disk: writes this rank's rows of `param`'s optimizer buffer `key`
    /// from a checkpoint straight to disk (so loading never holds the state in
    /// memory) and returns true; false when `param`'s state is kept by the optimizer.
    pub(crate) fn load_state_buffer_on_disk(
        &mut self,
        param: &str,
        key: &str,
        values: &[f32],
    ) -> Result<bool, EngineError> {
        let (Some(state), Some(place)) = (&mut self.state_on_disk, self.grad_index.get(param))
        else {
            return Ok(false);
        };
        state.load_buffer(&self.units, place, (param, key), values)?;
        Ok(true)
    }

    /// With state kept on disk: sets `param`'s step count there and returns true;
    /// false when its state is kept by the optimizer.
    pub(crate) fn load_state_step_on_disk(&mut self, param: &str, step: u64) -> bool {
        match &mut self.state_on_disk {
            Some(state) if self.grad_index.contains_key(param) => {
                state.load_step(param, step);
                true
            }
            _ => false,
        }
    }

    /// The step count and buffer names of parameter `name`'s optimizer state, wherever it
    /// lives (nothing is read).
    pub(crate) fn optimizer_state_info(
        &self,
        optimizer: &dyn Optimizer,
        name: &str,
    ) -> Option<(u64, Vec<String>)> {
        match optimizer.state(name) {
            Some(s) => Some((s.step, s.buffers.keys().cloned().collect())),
            None => self.state_on_disk.as_ref()?.info(name),
        }
    }

    /// Buffer `key` (`exp_avg`, ...) of parameter `name`'s optimizer state: a copy of
    /// `optimizer`'s own, or this rank's rows read back from disk when the state is kept
    /// there (what checkpoints save, one buffer at a time).
    pub(crate) fn optimizer_state_buffer(
        &self,
        optimizer: &dyn Optimizer,
        name: &str,
        key: &str,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        if let Some(state) = optimizer.state(name) {
            return Ok(state.buffers.get(key).cloned());
        }
        let Some(state) = &self.state_on_disk else {
            return Ok(None);
        };
        match self.grad_index.get(name) {
            Some(place) => state.buffer(&self.units, place, (name, key)),
            None if state.has(name, key) => {
                Err(EngineError::UnknownParameter { name: name.into() })
            }
            None => Ok(None),
        }
    }
}
