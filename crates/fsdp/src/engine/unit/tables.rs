//! A unit's tables looked up by rows ([`super::super::table_rows`]) within a step: rows
//! exchanged as forward looks them up, and the whole table gathered where a weight tied to it
//! reads it whole.

use std::time::Instant;

use candle_core::Tensor;

use super::{RunContext, UnitRun};
use crate::engine::collectives;
use crate::engine::error::EngineError;
use crate::engine::plan::ShardLayout;
use crate::engine::table_rows;

impl UnitRun {
    /// Table `i` holding at least rows `ids` (exchanged with the shard group for those no rank
    /// holds yet: every rank of the group calls it at the same point of its forward).
    pub fn look_up(
        &mut self,
        cx: &RunContext,
        i: usize,
        ids: &[i64],
    ) -> Result<Tensor, EngineError> {
        let layout = &self.unit.params[i].layout;
        let rows = layout.shape.first().copied().unwrap_or(0);
        let held = &mut self.rows_held[i];
        if held.is_empty() {
            held.resize(rows, false);
        }
        let owned = self.unit.local_values(i)?;
        let began = Instant::now();
        let op = || format!("the row lookup of `{}`", layout.name);
        let exchanged = table_rows::exchange(
            cx.mesh.shard.as_ref(),
            layout,
            (ids, held),
            &owned,
            cx.dtypes.param,
        )
        .map_err(|source| EngineError::Collective {
            op: op(),
            unit: self.unit.name(),
            source,
        })?;
        if let Some(rows) = exchanged {
            if let Some(t) = cx.trace {
                let bytes = rows.values.len() * rows.values.dtype().size();
                let args = serde_json::json!({ "bytes": bytes, "rows": rows.placed.len() });
                let unit = self.unit.trace_label();
                t.collective(
                    "all-gather rows",
                    "all_gather",
                    unit,
                    (began, Instant::now()),
                    began,
                    args,
                );
            }
            cx.plane
                .write_rows(&self.full[i], &rows.placed, &rows.values, layout.row_elems)?;
            for &(row, _) in &rows.placed {
                held[row] = true;
            }
        }
        Ok(self.full[i].clone())
    }

    /// Table `i` read whole (a weight tied to it): gathered whole once this step (again by a
    /// refill before backward, which may read it).
    pub fn read_table_whole(&mut self, cx: &RunContext, i: usize) -> Result<Tensor, EngineError> {
        if !self.read_whole[i] {
            self.read_whole[i] = true;
            self.fill_table(cx, i, "read whole")?;
        }
        Ok(self.full[i].clone())
    }

    /// Gathers table `i` whole into its full tensor.
    pub(super) fn fill_table(
        &mut self,
        cx: &RunContext,
        i: usize,
        when: &str,
    ) -> Result<(), EngineError> {
        let p = &self.unit.params[i];
        let block = self.unit.param_block(i)?;
        let runs = [p.layout.shard_numel()];
        let what = format!("all-gather of `{}` {when}", p.layout.name);
        let failed = |source| EngineError::Collective {
            op: what.clone(),
            unit: self.unit.name(),
            source,
        };
        let gathered = collectives::all_gather(cx.mesh, block, &runs, cx.dtypes)?
            .wait()
            .map_err(failed)?;
        let gathered = self.decoded(cx, gathered, &runs, when)?;
        let alone = ShardLayout {
            offset: 0,
            ..p.layout.clone()
        };
        let ranks = self.unit.ranks(cx.mesh.shard_size());
        cx.plane
            .refill(&self.full[i], &alone, &gathered, runs[0], ranks)?;
        let held = &mut self.rows_held[i];
        held.clear();
        held.resize(p.layout.shape.first().copied().unwrap_or(0), true);
        Ok(())
    }
}
