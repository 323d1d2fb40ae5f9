//! A timeline of training that users can open. With `fsdp_trace_dir` (`FSDP_TRACE=DIR`, or
//! `FsdpPlugin::builder().trace_dir(..)`), each rank's engine records what it does — each
//! step, forward and backward of every unit, every all-gather and gradient reduction with
//! its bytes, the time compute waited for one, the optimizer step, checkpoint saves — and
//! writes it as Chrome trace JSON (`trace_rank{N}.json`, the Trace Event Format), which
//! Perfetto (ui.perfetto.dev) and `chrome://tracing` open. Ranks share the host's clock
//! (timestamps are microseconds since the Unix epoch), so the files of one job line up.
//! `fsdp trace plot DIR` draws one step of every rank.
//!
//! Compute events are on thread 0 of a rank's process, communication on thread 1. A
//! collective's span is the time its communication thread ran it, when the transport reports
//! that, else from its issue until the engine took its result.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Which lane of a rank an event is drawn in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Forward, backward, the optimizer, waits: the training thread.
    Compute,
    /// Collectives.
    Communication,
}

impl Lane {
    fn tid(self) -> u32 {
        match self {
            Lane::Compute => 0,
            Lane::Communication => 1,
        }
    }
}

/// One recorded span.
struct Event {
    name: String,
    category: &'static str,
    lane: Lane,
    start: Instant,
    end: Instant,
    args: serde_json::Map<String, serde_json::Value>,
}

/// Events are written out every this many steps (and when the tracer is dropped).
const WRITE_EVERY: u64 = 10;

/// Engines traced in this process so far (a second model's file gets its number).
static ENGINES: AtomicUsize = AtomicUsize::new(0);

/// A rank's recorder (see the module docs).
pub struct Tracer {
    rank: usize,
    path: PathBuf,
    /// The tracer's start, on both clocks: Instants are written as Unix time.
    started: Instant,
    started_unix_us: u64,
    events: Mutex<Vec<Event>>,
    step: Mutex<StepMark>,
}

#[derive(Default)]
struct StepMark {
    /// Steps ended so far.
    done: u64,
    /// When the step under way began.
    began: Option<Instant>,
}

impl Tracer {
    /// A tracer writing `dir/trace_rank{rank}.json` (`_model{i}` added for a process's
    /// second and later engines); the folder is made, and the file written once empty, so
    /// a folder that cannot take it fails here, named.
    pub fn create(dir: &Path, rank: usize) -> std::io::Result<Tracer> {
        std::fs::create_dir_all(dir)?;
        let name = match ENGINES.fetch_add(1, Ordering::SeqCst) {
            0 => format!("trace_rank{rank}.json"),
            i => format!("trace_rank{rank}_model{i}.json"),
        };
        let started_unix_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let tracer = Tracer {
            rank,
            path: dir.join(name),
            started: Instant::now(),
            started_unix_us,
            events: Mutex::new(Vec::new()),
            step: Mutex::new(StepMark::default()),
        };
        tracer.write()?;
        Ok(tracer)
    }

    /// The file this tracer writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records `name` from `start` to `end` in `lane`, with `args` (bytes, unit, ...).
    pub fn record(
        &self,
        name: impl Into<String>,
        category: &'static str,
        lane: Lane,
        start: Instant,
        end: Instant,
        args: serde_json::Value,
    ) {
        let args = match args {
            serde_json::Value::Object(m) => m,
            _ => serde_json::Map::new(),
        };
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        events.push(Event {
            name: name.into(),
            category,
            lane,
            start,
            end,
            args,
        });
    }

    /// [`Tracer::record`] of a span on the compute lane from `began` until now.
    pub fn since(
        &self,
        name: impl Into<String>,
        category: &'static str,
        began: Instant,
        args: serde_json::Value,
    ) {
        self.record(name, category, Lane::Compute, began, Instant::now(), args);
    }

    /// A collective of `unit` (`op`: `all-gather`, `reduce-scatter`, `all-reduce`; `category`
    /// its kind) that ran from `ran.0` to `ran.1`, and the compute lane's wait for it from
    /// `waited` until now; `args` (its bytes) gain the unit.
    pub fn collective(
        &self,
        op: &str,
        category: &'static str,
        unit: &str,
        ran: (Instant, Instant),
        waited: Instant,
        mut args: serde_json::Value,
    ) {
        args["unit"] = unit.into();
        let name = format!("{op} {unit}");
        let lane = Lane::Communication;
        self.record(name.clone(), category, lane, ran.0, ran.1, args.clone());
        self.since(format!("wait {name}"), "wait", waited, args);
    }

    /// A training step begins (its forward is about to run); ignored while one is under way
    /// (an evaluation forward, a micro-batch of accumulation).
    pub fn begin_step(&self) {
        let mut mark = self.step.lock().unwrap_or_else(|e| e.into_inner());
        mark.began.get_or_insert_with(Instant::now);
    }

    /// The step under way ended with its optimizer update: recorded as `step` (numbered
    /// from 0), and every `WRITE_EVERY` (10) steps the file is rewritten.
    pub fn end_step(&self) {
        let (n, began) = {
            let mut mark = self.step.lock().unwrap_or_else(|e| e.into_inner());
            let Some(began) = mark.began.take() else {
                return;
            };
            mark.done += 1;
            (mark.done - 1, began)
        };
        self.record(
            "step",
            "step",
            Lane::Compute,
            began,
            Instant::now(),
            serde_json::json!({ "step": n }),
        );
        if (n + 1) % WRITE_EVERY == 0
            && let Err(e) = self.write()
        {
            tracing::warn!("writing the trace {}: {e}", self.path.display());
        }
    }

    /// Microseconds since the Unix epoch at `t`.
    pub fn unix_us(&self, t: Instant) -> u64 {
        let offset = t.saturating_duration_since(self.started).as_micros() as u64;
        self.started_unix_us + offset
    }

    /// Writes every event so far (a synced temporary file renamed over the last one, so a
    /// reader never sees half a file).
    pub fn write(&self) -> std::io::Result<()> {
        let pid = self.rank as u64;
        let mut out = vec![
            serde_json::json!({"name": "process_name", "ph": "M", "pid": pid,
                "args": {"name": format!("rank {}", self.rank)}}),
            serde_json::json!({"name": "process_sort_index", "ph": "M", "pid": pid,
                "args": {"sort_index": pid}}),
        ];
        for lane in [Lane::Compute, Lane::Communication] {
            let name = match lane {
                Lane::Compute => "compute",
                Lane::Communication => "communication",
            };
            out.push(
                serde_json::json!({"name": "thread_name", "ph": "M", "pid": pid,
                "tid": lane.tid(), "args": {"name": name}}),
            );
        }
        {
            let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
            for e in events.iter() {
                let ts = self.unix_us(e.start);
                let dur = self.unix_us(e.end).saturating_sub(ts);
                out.push(serde_json::json!({
                    "name": e.name, "cat": e.category, "ph": "X", "ts": ts, "dur": dur,
                    "pid": pid, "tid": e.lane.tid(), "args": e.args,
                }));
            }
        }
        let doc = serde_json::json!({ "traceEvents": out, "displayTimeUnit": "ms" });
        let bytes = serde_json::to_vec(&doc).map_err(std::io::Error::other)?;
        let mut partial = self.path.clone().into_os_string();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&partial)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&partial, &self.path)
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        if let Err(e) = self.write() {
            tracing::warn!("writing the trace {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_that_cannot_take_the_trace_fails_at_creation() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("a_file");
        std::fs::write(&file, b"x").unwrap();
        assert!(Tracer::create(&file.join("trace"), 0).is_err());
        assert!(Tracer::create(&file, 0).is_err());
    }

    #[test]
    fn spans_are_written_as_chrome_trace_events_in_unix_microseconds() {
        let tmp = tempfile::tempdir().unwrap();
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros() as f64;
        let t = Tracer::create(tmp.path(), 3).unwrap();
        let start = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let end = Instant::now();
        t.record(
            "all-gather x",
            "all_gather",
            Lane::Communication,
            start,
            end,
            serde_json::json!({"bytes": 8}),
        );
        t.begin_step();
        t.end_step();
        t.write().unwrap();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(t.path()).unwrap()).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        let gather = events.iter().find(|e| e["cat"] == "all_gather").unwrap();
        assert_eq!(
            (
                gather["ph"].as_str(),
                gather["pid"].as_u64(),
                gather["tid"].as_u64()
            ),
            (Some("X"), Some(3), Some(1))
        );
        assert_eq!(gather["args"]["bytes"], 8);
        let ts = gather["ts"].as_f64().unwrap();
        assert!(ts >= before && ts < before + 60e6, "{ts} vs {before}");
        assert!(gather["dur"].as_f64().unwrap() >= 2000.0);
        let step = events.iter().find(|e| e["cat"] == "step").unwrap();
        assert_eq!(step["args"]["step"], 0);
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "M" && e["args"]["name"] == "communication")
        );
        assert!(!tmp.path().join("trace_rank3.json.partial").exists());
    }
}
