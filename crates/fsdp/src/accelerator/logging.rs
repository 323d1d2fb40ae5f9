//! Progress and logs for a training job: `tracing` logs with the rank in every line (level
//! from `RUST_LOG`-style `FSDP_LOG`, default `info`), a progress bar on the main process only,
//! and metrics as JSON lines.

use std::fmt;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// `[rank N] LEVEL message fields`, or without the rank when the launcher already starts
/// every line with it (`None`).
struct RankFormat {
    rank: Option<usize>,
}

impl<S, N> FormatEvent<S, N> for RankFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        if let Some(rank) = self.rank {
            write!(writer, "[rank {rank}] ")?;
        }
        write!(writer, "{} ", event.metadata().level())?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Installs the job's log format (once per process; later calls do nothing): `tracing`
/// events go to standard error with `rank` in every line (`None`: the launcher prefixes
/// the lines already, as `fsdp launch` does with `[rankN]: `).
pub fn init_logging(rank: Option<usize>) {
    let level = match std::env::var("FSDP_LOG")
        .unwrap_or_default()
        .to_ascii_lowercase()
        .as_str()
    {
        "trace" => Level::TRACE,
        "debug" => Level::DEBUG,
        "warn" => Level::WARN,
        "error" => Level::ERROR,
        _ => Level::INFO,
    };
    // Colours only on a terminal (not into the launcher's pipes and log files), and never
    // with NO_COLOR set.
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .event_format(RankFormat { rank })
        .finish();
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// A progress bar with the loss and throughput, drawn on the main process only. When
/// standard error is not a terminal (under `fsdp launch`, or redirected to a file), it prints
/// a plain line at every tenth of the way instead.
pub struct Progress {
    bar: ProgressBar,
    /// Plain lines instead of a bar: (what, total).
    plain: Option<(String, u64)>,
    started: Instant,
    samples: u64,
    /// Steps already done when it started (a resumed run's).
    first: u64,
}

impl Progress {
    pub(super) fn new(visible: bool, total: u64, what: &str) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        let bar = if visible && terminal {
            ProgressBar::new(total)
        } else {
            ProgressBar::hidden()
        };
        let plain = (visible && !terminal).then(|| (what.to_string(), total));
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} {msg} (ETA {eta})",
        ) {
            bar.set_style(style);
        }
        bar.set_prefix(what.to_string());
        Progress {
            bar,
            plain,
            started: Instant::now(),
            samples: 0,
            first: 0,
        }
    }

    /// Counts from `done` of the total (a resumed run's steps so far), so lines read
    /// `epoch 0 3/265` rather than starting again from 1; rate and ETA from this run's steps.
    pub fn starting_at(mut self, done: u64) -> Progress {
        self.first = done.min(self.bar.length().unwrap_or(done));
        self.bar.set_position(self.first);
        self.bar.reset_eta();
        self
    }

    /// One more step of `samples` examples (over all ranks), with its loss.
    pub fn step(&mut self, samples: u64, loss: f64) {
        self.samples += samples;
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = self.samples as f64 / elapsed;
        self.bar
            .set_message(format!("loss {loss:.4}, {rate:.1} samples/s"));
        self.bar.inc(1);
        if let Some((what, total)) = &self.plain {
            let done = self.bar.position();
            let tenth = |n: u64| n * 10 / (*total).max(1);
            if done == *total || tenth(done) != tenth(done - 1) {
                let ran = done.saturating_sub(self.first).max(1);
                let eta = elapsed / ran as f64 * total.saturating_sub(done) as f64;
                eprintln!(
                    "{what} {done}/{total}: loss {loss:.4}, {rate:.1} samples/s, elapsed {elapsed:.0} s, ETA {eta:.0} s"
                );
            }
        }
    }

    /// Examples per second so far.
    pub fn samples_per_second(&self) -> f64 {
        self.samples as f64 / self.started.elapsed().as_secs_f64().max(1e-9)
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Appends `{"step": step, ...metrics}` as one line to `path`: whole or not at all (a
/// write cut short, by a full disk say, is taken back, so every line of the file parses).
pub(super) fn append_json_line(
    path: &Path,
    step: u64,
    metrics: serde_json::Value,
) -> std::io::Result<()> {
    let mut line = serde_json::Map::new();
    line.insert("step".into(), step.into());
    if let serde_json::Value::Object(m) = metrics {
        line.extend(m);
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let mut text = serde_json::Value::Object(line).to_string().into_bytes();
    text.push(b'\n');
    let before = f.metadata()?.len();
    f.write_all(&text).inspect_err(|_| {
        let _ = f.set_len(before);
    })
}
