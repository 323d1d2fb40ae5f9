//! A unit's tables looked up by rows within a step: a row-sparse table's rows exchanged as
//! forward looks them up ([`super::super::table_rows`]), and the whole table gathered where a
//! weight tied to it reads it whole; a table gathered whole that the last step only looked up
//! gets its looked-up rows out of the gathered block, and the rest only if read whole.

use std::time::Instant;

use candle_core::Tensor;

use super::{Access, FsdpUnit, InStep, RunContext};
use crate::engine::collectives;
use crate::engine::error::EngineError;
use crate::engine::plan::ShardLayout;
use crate::engine::shared_gather::Gathered;
use crate::engine::table_rows;

impl FsdpUnit {
    /// Parameter `i` read by rows `ids` (an embedding's lookup). A table looked up by rows
    /// holds at least them afterwards (exchanged with the shard group for those no rank
    /// holds yet: every rank of the group calls it at the same point of its forward); any
    /// other parameter is gathered whole already.
    pub fn look_up(&self, cx: &RunContext, i: usize, ids: &Tensor) -> Result<Tensor, EngineError> {
        let s = &mut *self.in_step();
        if !self.looked_up[i] {
            if s.access[i] == Access::None {
                s.access[i] = Access::Rows;
            }
            if s.by_rows[i] {
                self.write_block_rows(s, cx, i, ids)?;
            }
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

    /// Writes the rows `ids` of table `i` that it does not hold yet out of the gathered block
    /// kept for it ([`InStep::by_rows`]).
    fn write_block_rows(
        &self,
        s: &mut InStep,
        cx: &RunContext,
        i: usize,
        ids: &Tensor,
    ) -> Result<(), EngineError> {
        let layout = &self.gather_layouts[i];
        let ids = ids.flatten_all()?.to_dtype(candle_core::DType::I64)?;
        let held = &mut s.rows_held[i];
        if held.is_empty() {
            held.resize(layout.shape.first().copied().unwrap_or(0), false);
        }
        // An id outside the table is left to the lookup, which names it.
        let Ok(wanted) = table_rows::wanted(&ids.to_vec1::<i64>()?, held) else {
            return Ok(());
        };
        if wanted.is_empty() {
            return Ok(());
        }
        for &row in &wanted {
            held[row] = true;
        }
        let ranges = wanted
            .iter()
            .map(|&row| layout.gathered_row(self.gather_block, row));
        let values = s
            .block
            .as_ref()
            .and_then(|b| b.copy_ranges(ranges.collect::<Option<Vec<_>>>()?))
            .ok_or_else(|| EngineError::State {
                name: format!("the gathered block of {}", self.name()),
                problem: format!("it does not hold the looked-up rows of `{}`", layout.name),
            })?;
        let placed: Vec<(usize, usize)> = wanted.into_iter().zip(0..).collect();
        cx.plane
            .write_rows(&s.full[i], &placed, &values, layout.row_elems)
    }

    /// Writes the rows table `i` does not hold yet when it holds only those looked up
    /// ([`InStep::by_rows`]): all of them, out of the gathered block kept for it.
    pub(super) fn fill_by_rows(
        &self,
        s: &mut InStep,
        cx: &RunContext,
        i: usize,
    ) -> Result<(), EngineError> {
        if !s.by_rows[i] {
            return Ok(());
        }
        let block = s.block.as_ref().ok_or_else(|| EngineError::State {
            name: format!("the gathered block of {}", self.name()),
            problem: format!(
                "it is gone before `{}` was read whole",
                self.params[i].layout.name
            ),
        })?;
        let ranks = self.ranks(cx.mesh.shard_size());
        cx.plane.refill(
            &s.full[i],
            &self.gather_layouts[i],
            &Gathered::Joined(block),
            self.gather_block,
            ranks,
        )?;
        s.by_rows[i] = false;
        s.rows_held[i].clear();
        Ok(())
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
        cx.plane.refill(
            &s.full[i],
            &alone,
            &Gathered::Joined(&gathered),
            runs[0],
            ranks,
        )?;
        let held = &mut s.rows_held[i];
        held.clear();
        held.resize(p.layout.shape.first().copied().unwrap_or(0), true);
        Ok(())
    }
}
