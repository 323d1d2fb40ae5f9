//! Taking a model's initial weights into this rank's shards, unit by unit: every rank reads
//! every parameter and keeps its rows; with `fsdp_sync_module_states` rank 0's values are
//! broadcast; with `fsdp_cpu_ram_efficient_loading` only the first rank reads, one unit at a
//! time, and each rank receives just its rows (a scatter over the shard group, then a
//! broadcast across replicas), so no rank holds more than one unit above its shards. A rank
//! that cannot read a weight makes every rank fail on that parameter instead of leaving the
//! others waiting in a collective.

use std::collections::HashMap;

use fsdp_comm::{Buffer, DType, Mesh, ReduceOp};

use super::error::{EngineError, unit_name};
use super::plan::{ShardLayout, Unit};
use crate::nn::{ParamSpec, WeightSource};

/// How this rank takes its initial weights (see the module docs).
pub(crate) struct WeightIntake<'a> {
    pub source: &'a dyn WeightSource,
    pub specs: HashMap<&'a str, &'a ParamSpec>,
    pub mesh: &'a Mesh,
    /// `fsdp_sync_module_states`: every rank starts from rank 0's values.
    pub sync: bool,
    /// `fsdp_cpu_ram_efficient_loading`: only rank 0 reads; the others receive their rows.
    pub rank0_only: bool,
}

impl WeightIntake<'_> {
    /// The first rank of the mesh (shard rank 0 of replica 0): the one that reads.
    fn is_first(&self) -> bool {
        self.mesh.shard.rank() == 0 && self.mesh.replicate.as_ref().is_none_or(|r| r.rank() == 0)
    }

    /// The model's description of parameter `layout`.
    fn spec(&self, layout: &ShardLayout) -> Result<&ParamSpec, EngineError> {
        self.specs
            .get(layout.name.as_str())
            .copied()
            .ok_or_else(|| problem(layout, "not a parameter of the model".into()))
    }

    /// Parameter `layout`'s full values from the source.
    fn read(&self, layout: &ShardLayout) -> Result<Vec<f32>, EngineError> {
        let problem = |p: String| problem(layout, p);
        let spec = self.spec(layout)?;
        let values =
            crate::nn::read_param(self.source, spec).map_err(|e| problem(e.to_string()))?;
        if values.len() != layout.numel() {
            return Err(problem(format!(
                "{} values for {} elements",
                values.len(),
                layout.numel()
            )));
        }
        Ok(values)
    }

    /// Parameter `layout`'s values from the source, a piece of rows at a time, packed into
    /// every rank's block of `packed` (so the whole tensor is never held as well).
    fn read_into(
        &self,
        layout: &ShardLayout,
        block: usize,
        shards: usize,
        packed: &mut [f32],
    ) -> Result<(), EngineError> {
        let problem = |p: String| problem(layout, p);
        let spec = self.spec(layout)?;
        let mut elements = 0;
        crate::nn::read_param_rows(self.source, spec, &mut |first, piece| {
            let end = first * layout.row_elems + piece.len();
            if piece.len() % layout.row_elems.max(1) != 0 || end > layout.numel() {
                return Err(candle_core::Error::Msg(format!(
                    "rows from {first} ({} values) do not fit a {:?} tensor",
                    piece.len(),
                    layout.shape
                )));
            }
            layout.pack_rows(first, piece, block, shards, packed);
            elements += piece.len();
            Ok(())
        })
        .map_err(|e| problem(e.to_string()))?;
        if elements != layout.numel() {
            return Err(problem(format!(
                "{elements} values for {} elements",
                layout.numel()
            )));
        }
        Ok(())
    }

    /// `result` if every rank's read of `what` succeeded; otherwise an error on every rank
    /// (the failing one keeps its own).
    fn agree<T>(&self, what: &str, result: Result<T, EngineError>) -> Result<T, EngineError> {
        let ok = vec![f32::from(u8::from(result.is_ok()))];
        let all = self.mesh.all_reduce(Buffer::F32(ok), ReduceOp::Min)?;
        let all_ok = all.as_slice::<f32>().is_some_and(|v| v[0] == 1.0);
        match result {
            Err(e) => Err(e),
            Ok(_) if !all_ok => Err(EngineError::InitialWeight {
                name: what.to_string(),
                problem: "another rank could not read it (its error names the cause)".into(),
            }),
            Ok(v) => Ok(v),
        }
    }

    /// A whole parameter (of an ignored module, or to cut rows from).
    pub fn whole(&self, layout: &ShardLayout) -> Result<Vec<f32>, EngineError> {
        if !(self.sync || self.rank0_only) {
            return self.read(layout);
        }
        let mine = if self.is_first() || !self.rank0_only {
            self.read(layout)
        } else {
            Ok(vec![0.0; layout.numel()])
        };
        let mine = self.agree(&layout.name, mine)?;
        let synced = self.mesh.broadcast_from_first(Buffer::F32(mine))?;
        super::buffers::f32_values(synced, "broadcast of initial weights")
    }

    /// This rank's rows of each parameter of `unit`, padded to its shard size.
    pub fn unit_rows(&self, unit: &Unit) -> Result<Vec<Vec<f32>>, EngineError> {
        let rank = self.mesh.shard.rank();
        if !self.rank0_only {
            return unit
                .params
                .iter()
                .map(|l| {
                    let full = self.whole(l)?;
                    let (start, end) = l.rows_of(rank);
                    let mut rows = full[start * l.row_elems..end * l.row_elems].to_vec();
                    rows.resize(l.shard_numel(), 0.0);
                    Ok(rows)
                })
                .collect();
        }
        let (shards, block) = (self.mesh.shard_size(), unit.shard_numel());
        // What the others name when the first rank cannot read one of the unit's weights.
        let what = format!("a parameter of {}", unit_name(&unit.path));
        let first_replica = self.mesh.replicate.as_ref().is_none_or(|r| r.rank() == 0);
        let mut mine = if first_replica {
            let packed = if self.is_first() {
                let mut packed = vec![0f32; block * shards];
                let read = unit
                    .params
                    .iter()
                    .try_for_each(|l| self.read_into(l, block, shards, &mut packed));
                self.agree(&what, read)?;
                Buffer::F32(packed)
            } else {
                self.agree(&what, Ok(()))?;
                Buffer::empty(DType::F32)
            };
            if shards > 1 {
                self.mesh.shard.scatter(packed, block, 0).wait()?
            } else {
                packed
            }
        } else {
            self.agree(&what, Ok(()))?;
            Buffer::F32(vec![0.0; block])
        };
        if let Some(r) = &self.mesh.replicate {
            mine = r.broadcast(mine, 0).wait()?;
        }
        let mine = super::buffers::f32_values(mine, "broadcast of initial rows")?;
        Ok(unit
            .params
            .iter()
            .map(|l| mine[l.offset..l.offset + l.shard_numel()].to_vec())
            .collect())
    }
}

/// An [`EngineError::InitialWeight`] for parameter `layout`.
fn problem(layout: &ShardLayout, problem: String) -> EngineError {
    EngineError::InitialWeight {
        name: layout.name.clone(),
        problem,
    }
}
