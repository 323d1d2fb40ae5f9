//! A unit's tables looked up by rows ([`super::super::table_rows`]) within a step: rows
//! exchanged as forward looks them up, and the whole table gathered where a weight tied to it
//! reads it whole.

use std::time::Instant;

use candle_core::Tensor;

use super::{FsdpUnit, InStep, RunContext};
use crate::engine::collectives;
use crate::engine::error::EngineError;
use crate::engine::plan::ShardLayout;
use crate::engine::table_rows;

impl FsdpUnit {
    /// Parameter `i` read by rows `ids` (an embedding's lookup). A table looked up by rows
    /// holds at least them afterwards (exchanged with the shard group for those no rank
    /// holds yet: every rank of the group calls it at the same point of its forward); any
    /// other parameter is gathered whole already.
    pub fn look_up(&self, cx: &RunContext, i: usize, ids: &Tensor) -> Result<Tensor, EngineError> {
        let s = &mut *self.in_step();
        if !self.looked_up[i] {
            return self.full_param(s, i);
        }
        let ids = ids.flatten_all()?.to_dtype(candle_core::DType::I64)?;
        let ids = ids.to_vec1::<i64>()?;
        let layout = &self.params[i].layout;
        let rows = layout.shape.first().copied().unwrap_or(0);
        let held = &mut s.rows_held[i];
        if held.is_empty() {
            held.resize(rows, false);
        }
        let owned = self.local_values(i)?;
        let began = Instant::now();
        let op = || format!("the row lookup of `{}`", layout.name);
        let exchanged = table_rows::exchange(
            cx.mesh.shard.as_ref(),
            layout,
            (&ids, held),
            &owned,
            cx.dtypes.param,
        )
        .map_err(|source| EngineError::Collective {
            op: op(),
            unit: self.name(),
            source,
        })?;
        if let Some(rows) = exchanged {
            if let Some(t) = cx.trace {
                let bytes = rows.values.len() * rows.values.dtype().size();
                let args = serde_json::json!({ "bytes": bytes, "rows": rows.placed.len() });
                let unit = self.trace_label();
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
                .write_rows(&s.full[i], &rows.placed, &rows.values, layout.row_elems)?;
            for &(row, _) in &rows.placed {
                held[row] = true;
            }
        }
        self.full_param(s, i)
    }

    /// Table `i` read whole (a weight tied to it): gathered whole once this step (again by a
    /// refill before backward, which may read it).
    pub(super) fn read_table_whole(
        &self,
        s: &mut InStep,
        cx: &RunContext,
        i: usize,
    ) -> Result<Tensor, EngineError> {
        if !s.read_whole[i] {
            s.read_whole[i] = true;
            self.fill_table(s, cx, i, "read whole")?;
        }
        self.full_param(s, i)
    }

    /// Gathers table `i` whole into its full tensor.
    pub(super) fn fill_table(
        &self,
        s: &mut InStep,
        cx: &RunContext,
        i: usize,
        when: &str,
    ) -> Result<(), EngineError> {
        let p = &self.params[i];
        let send = self.param_send(i, cx.dtypes)?;
        let runs = [p.layout.shard_numel()];
        let what = format!("all-gather of `{}` {when}", p.layout.name);
        let failed = |source| EngineError::Collective {
            op: what.clone(),
            unit: self.name(),
            source,
        };
        let gathered = collectives::all_gather(cx.mesh, send)
            .wait()
            .map_err(failed)?;
        let gathered = self.decoded(cx, gathered, &runs, when)?;
        let alone = ShardLayout {
            offset: 0,
            ..p.layout.clone()
        };
        let ranks = self.ranks(cx.mesh.shard_size());
        cx.plane
            .refill(&s.full[i], &alone, &gathered, runs[0], ranks)?;
        let held = &mut s.rows_held[i];
        held.clear();
        held.resize(p.layout.shape.first().copied().unwrap_or(0), true);
        Ok(())
    }
}
