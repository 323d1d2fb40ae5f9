//! The unit plan as text, for `fsdp estimate-memory` and the engine's log: the memory
//! estimate in one line, a headline, and the units one per line (their parameters' rows
//! under them on request).

use std::fmt::Write;

use super::plan::UnitPlan;

impl UnitPlan {
    /// The memory estimate in one line: memory per rank by kind, and the bytes kept on disk.
    pub fn memory_summary(&self) -> String {
        let m = self.memory_estimate();
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let mut out = format!(
            "per rank: params {:.1} MiB, grads {:.1} MiB, optimizer {:.1} MiB, gathered at peak {:.1} MiB, backward's gradients {:.1} MiB",
            mib(m.params),
            mib(m.grads),
            mib(m.optimizer),
            mib(m.gathered_peak),
            mib(m.reducing),
        );
        let kept = self.kept_gathered() * self.gathered_bytes;
        if kept > 0 && self.group_size > 1 {
            let _ = write!(
                out,
                " (of which {:.1} MiB kept gathered from forward to backward by fsdp_no_reshard_after_forward)",
                mib(kept)
            );
        }
        if m.secondary > 0 {
            let _ = write!(
                out,
                ", secondary partition {:.1} MiB (fsdp_hpz_partition_size)",
                mib(m.secondary)
            );
        }
        if m.disk > 0 {
            let _ = write!(
                out,
                ", buffers streaming from disk {:.1} MiB",
                mib(m.streaming)
            );
        }
        let _ = write!(out, ", peak {:.1} MiB", mib(m.total()));
        if m.disk > 0 {
            let _ = write!(out, "; on disk {:.1} MiB", mib(m.disk));
        }
        out
    }

    /// A table of units, their parameters and sizes per rank, and the memory estimate.
    pub fn render(&self) -> String {
        let mut out = self.headline();
        out.push('\n');
        out.push_str(&self.render_units(true));
        let _ = writeln!(out, "{}", self.memory_summary());
        out
    }

    /// `N unit(s), sharded over R rank(s), Strategy`.
    pub fn headline(&self) -> String {
        format!(
            "{} unit(s), sharded over {} rank(s), {:?}",
            self.units.len(),
            self.group_size,
            self.strategy
        )
    }

    /// One line per unit (path, type, parameters, per rank), with each parameter's rows per
    /// rank under it when `params`, then the ignored (replicated) parameters.
    pub fn render_units(&self, params: bool) -> String {
        let mut out = String::new();
        for (i, u) in self.units.iter().enumerate() {
            let path = if u.path.is_empty() { "<root>" } else { &u.path };
            let _ = writeln!(
                out,
                "unit {i}: {path} ({}), {} params, {} per rank",
                u.type_name,
                u.numel(),
                u.shard_numel()
            );
            for p in u.params.iter().filter(|_| params) {
                let _ = writeln!(
                    out,
                    "    {} {:?}: {} rows per rank",
                    p.name, p.shape, p.rows_per_rank
                );
            }
        }
        for p in &self.ignored {
            let _ = writeln!(out, "ignored (replicated): {} {:?}", p.name, p.shape);
        }
        out
    }
}
