//! `fsdp trace plot DIR -o step.svg`: one training step of every rank, read from the
//! timelines `fsdp_trace_dir` (`FSDP_TRACE`) wrote, drawn as a picture — per rank a compute
//! lane (forward and backward of each unit, the optimizer, time spent waiting for a
//! collective) above a communication lane (all-gathers, reductions) on one time axis, so
//! where a step's time goes and how much communication hides behind compute shows at a
//! glance. Also prints, per rank, the step's time, compute, communication and wait, as JSON.

mod draw;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};

/// `fsdp trace`.
#[derive(Args)]
pub struct TraceArgs {
    #[command(subcommand)]
    command: TraceCommand,
}

#[derive(Subcommand)]
enum TraceCommand {
    /// Draw one step of every rank (SVG with labels, or PNG) from a trace folder.
    Plot(PlotArgs),
}

/// `fsdp trace plot`.
#[derive(Args)]
pub struct PlotArgs {
    /// The folder `fsdp_trace_dir` named (its `trace_rank<N>.json` files).
    dir: PathBuf,
    /// The picture to write: `.svg` (labelled) or `.png`.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: PathBuf,
    /// The step to draw (numbered from 0) [default: the last one every rank finished].
    #[arg(long)]
    step: Option<u64>,
}

/// One span of a rank's timeline.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub name: String,
    pub category: String,
    /// 0: compute, 1: communication.
    pub lane: u64,
    pub start_us: f64,
    pub end_us: f64,
}

/// A rank's timeline as read.
pub(crate) struct RankTrace {
    pub rank: u64,
    pub spans: Vec<Span>,
    /// (step number, start, end).
    pub steps: Vec<(u64, f64, f64)>,
}

/// Runs `fsdp trace`.
pub fn run(args: TraceArgs) -> Result<()> {
    match args.command {
        TraceCommand::Plot(a) => plot(&a),
    }
}

/// Reads one `trace_rank<N>.json`.
fn read_rank(path: &Path) -> Result<RankTrace> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let events = doc["traceEvents"]
        .as_array()
        .with_context(|| format!("{}: no traceEvents", path.display()))?;
    let mut trace = RankTrace {
        rank: 0,
        spans: Vec::new(),
        steps: Vec::new(),
    };
    for e in events {
        if e["ph"] != "X" {
            continue;
        }
        let (Some(ts), Some(dur), Some(pid), Some(tid)) = (
            e["ts"].as_f64(),
            e["dur"].as_f64(),
            e["pid"].as_u64(),
            e["tid"].as_u64(),
        ) else {
            bail!(
                "{}: an event without ts, dur, pid or tid: {e}",
                path.display()
            );
        };
        trace.rank = pid;
        let name = e["name"].as_str().unwrap_or("").to_string();
        let category = e["cat"].as_str().unwrap_or("").to_string();
        if category == "step" {
            let n = e["args"]["step"]
                .as_u64()
                .with_context(|| format!("{}: a step without its number", path.display()))?;
            trace.steps.push((n, ts, ts + dur));
            continue;
        }
        trace.spans.push(Span {
            name,
            category,
            lane: tid,
            start_us: ts,
            end_us: ts + dur,
        });
    }
    Ok(trace)
}

/// Every rank's timeline in `dir`, in rank order.
fn read_dir(dir: &Path) -> Result<Vec<RankTrace>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("trace_rank") && n.ends_with(".json") && !n.contains("_model")
            })
        })
        .collect();
    paths.sort();
    if paths.is_empty() {
        bail!(
            "{} holds no trace_rank<N>.json: run the job with fsdp_trace_dir (FSDP_TRACE) set to it",
            dir.display()
        );
    }
    let mut ranks = paths
        .iter()
        .map(|p| read_rank(p))
        .collect::<Result<Vec<_>>>()?;
    ranks.sort_by_key(|r| r.rank);
    Ok(ranks)
}

/// Per rank, microseconds of the step's window covered by spans of `lane` in `categories`
/// (overlapping spans counted once).
fn covered(trace: &RankTrace, window: (f64, f64), lane: u64, categories: &[&str]) -> f64 {
    let mut spans: Vec<(f64, f64)> = trace
        .spans
        .iter()
        .filter(|s| s.lane == lane && categories.contains(&s.category.as_str()))
        .map(|s| (s.start_us.max(window.0), s.end_us.min(window.1)))
        .filter(|(a, b)| b > a)
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut total, mut reach) = (0.0, f64::MIN);
    for (a, b) in spans {
        let a = a.max(reach);
        if b > a {
            total += b - a;
            reach = b;
        }
    }
    total
}

fn plot(a: &PlotArgs) -> Result<()> {
    let ranks = read_dir(&a.dir)?;
    let common: Vec<u64> = ranks[0]
        .steps
        .iter()
        .map(|s| s.0)
        .filter(|n| ranks.iter().all(|r| r.steps.iter().any(|s| s.0 == *n)))
        .collect();
    let step = match a.step {
        Some(n) if common.contains(&n) => n,
        Some(n) => {
            bail!("step {n} is not in every rank's trace (steps every rank finished: {common:?})")
        }
        None => *common
            .last()
            .context("no step that every rank finished is in the traces")?,
    };
    let bounds: Vec<(f64, f64)> = ranks
        .iter()
        .map(|r| {
            let s = r.steps.iter().find(|s| s.0 == step).expect("checked above");
            (s.1, s.2)
        })
        .collect();
    let window = (
        bounds.iter().map(|b| b.0).fold(f64::MAX, f64::min),
        bounds.iter().map(|b| b.1).fold(f64::MIN, f64::max),
    );
    let summary: Vec<serde_json::Value> = ranks
        .iter()
        .zip(&bounds)
        .map(|(r, b)| {
            // Milliseconds, to the microsecond.
            let ms = |us: f64| us.round() / 1000.0;
            let communication = covered(r, *b, 1, &["all_gather", "reduce"]);
            let waited = covered(r, *b, 0, &["wait"]);
            serde_json::json!({
                "rank": r.rank,
                "step_ms": ms(b.1 - b.0),
                "compute_ms": ms(covered(r, *b, 0, &["forward", "backward", "optimizer"])),
                "communication_ms": ms(communication),
                "waiting_for_communication_ms": ms(waited),
                "communication_hidden": if communication > 0.0 {
                    ((1.0 - waited / communication).max(0.0) * 1000.0).round() / 1000.0
                } else {
                    1.0
                },
            })
        })
        .collect();
    let title = format!(
        "step {step} of {} rank(s): {:.1} ms",
        ranks.len(),
        (window.1 - window.0) / 1000.0
    );
    let ext = a.output.extension().and_then(|e| e.to_str()).unwrap_or("");
    let bytes = match ext {
        "svg" => draw::svg(&ranks, window, &title).into_bytes(),
        "png" => draw::png(&ranks, window, &title)
            .with_context(|| format!("encoding {}", a.output.display()))?,
        other => bail!(
            "{}: write a .svg (labelled) or a .png picture, not `.{other}`",
            a.output.display()
        ),
    };
    std::fs::write(&a.output, bytes).with_context(|| format!("writing {}", a.output.display()))?;
    println!("{title}; written to {}", a.output.display());
    println!("{}", serde_json::json!({ "step": step, "ranks": summary }));
    Ok(())
}
