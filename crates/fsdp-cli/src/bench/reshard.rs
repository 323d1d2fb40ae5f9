//! `fsdp bench reshard`: a SHARDED_STATE_DICT checkpoint saved by one number of processes
//! and loaded by others on this machine (16 → 8 and 32 by default): per world size, the load's
//! wall time, each rank's heap above what it held before, and the bytes each rank read
//! (`rchar` of `/proc/self/io`) against its share of the checkpoint — flat as the world
//! grows when every rank reads only the rows it owns.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp::checkpoint::RunState;
use fsdp::memory;

/// Options of `fsdp bench reshard`.
#[derive(Args, Clone)]
pub struct ReshardArgs {
    /// Processes that save.
    #[arg(long, default_value_t = 16)]
    save: usize,
    /// Numbers of processes that load, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 32])]
    load: Vec<usize>,
    /// The BERT.
    #[command(flatten)]
    shape: super::BertShape,
    /// Write the JSON results to this file too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Internal: run as a worker that saves (`save`) or loads (`load`) in this folder.
    #[arg(long, hide = true, num_args = 2, value_names = ["PHASE", "DIR"])]
    worker: Option<Vec<String>>,
}

/// Runs `fsdp bench reshard`.
pub fn run(a: ReshardArgs) -> Result<()> {
    match &a.worker {
        Some(w) => worker(&a, &w[0], std::path::Path::new(&w[1])),
        None => launch(&a),
    }
}

fn launch(a: &ReshardArgs) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("checkpoint");
    let dir_arg = dir.to_str().context("a folder path that is UTF-8")?;
    let args = |phase: &str| -> Vec<String> {
        let mut v: Vec<String> = vec!["bench".into(), "reshard".into()];
        v.extend(a.shape.flags());
        v.extend(["--worker".into(), phase.into(), dir_arg.into()]);
        v
    };
    super::workers::spawn_workers(&args("save"), a.save, 1, &[])?;
    let checkpoint_bytes = super::checkpoint::walk_bytes(&dir);
    println!(
        "{}: checkpoint of {:.1} MiB saved by {} processes",
        a.shape,
        checkpoint_bytes as f64 / (1u64 << 20) as f64,
        a.save
    );
    println!(
        "{:>9} {:>9} {:>14} {:>14} {:>13} {:>14}",
        "processes", "load s", "read/rank MiB", "share/rank MiB", "read / share", "heap/rank MiB"
    );
    let mut results = Vec::new();
    for &n in &a.load {
        let out = super::workers::spawn_workers(&args("load"), n, 1, &[])?;
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .with_context(|| format!("no result from the {n} loading workers:\n{out}"))?;
        let mut r: serde_json::Value = serde_json::from_str(line)?;
        let share = checkpoint_bytes as f64 / n as f64;
        let mib = |v: f64| v / (1u64 << 20) as f64;
        let read = r["read_bytes_max"].as_f64().unwrap_or(f64::NAN);
        r["processes"] = n.into();
        r["share_bytes"] = share.into();
        r["read_vs_share_max"] = (read / share).into();
        println!(
            "{n:>9} {:>9.3} {:>14.2} {:>14.2} {:>13.2} {:>14.2}",
            r["load_s_max"].as_f64().unwrap_or(f64::NAN),
            mib(read),
            mib(share),
            read / share,
            mib(r["heap_above_bytes_max"].as_f64().unwrap_or(f64::NAN)),
        );
        results.push(r);
    }
    let all = serde_json::json!({
        "saved_by": a.save,
        "checkpoint_bytes": checkpoint_bytes,
        "loads": results,
    });
    println!("{all}");
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&all)?)?;
    }
    Ok(())
}

/// Bytes this process has read through system calls so far (`rchar`).
fn bytes_read() -> Result<u64> {
    let io = std::fs::read_to_string("/proc/self/io").context("reading /proc/self/io")?;
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|v| v.trim().parse().ok())
        .context("no rchar in /proc/self/io")
}

fn worker(a: &ReshardArgs, phase: &str, dir: &std::path::Path) -> Result<()> {
    memory::CountingAllocator::mark_installed();
    match phase {
        "save" => {
            let (fsdp, adamw) = super::checkpoint::bert_engine(a.shape, true)?;
            fsdp::checkpoint::save_state(
                dir,
                &[&fsdp],
                &[&adamw],
                &RunState::default(),
                &Default::default(),
            )?;
        }
        "load" => {
            let (mut fsdp, mut adamw) = super::checkpoint::bert_engine(a.shape, false)?;
            let (heap, read) = (memory::resident_bytes(), bytes_read()?);
            memory::reset_peak();
            let started = Instant::now();
            fsdp::checkpoint::load_state(
                dir,
                &mut [&mut fsdp],
                &mut [&mut adamw],
                &Default::default(),
            )?;
            let seconds = started.elapsed().as_secs_f64();
            let mine = vec![
                seconds,
                (bytes_read()? - read) as f64,
                memory::peak_bytes().saturating_sub(heap) as f64,
            ];
            let all = fsdp.mesh().all_gather_vec(mine)?;
            if fsdp.mesh().rank() == 0 {
                let col = |k: usize| all.chunks(3).map(move |c| c[k]);
                let n = all.len() as f64 / 3.0;
                println!(
                    "RESULT {}",
                    serde_json::json!({
                        "load_s_max": col(0).fold(0f64, f64::max),
                        "read_bytes_max": col(1).fold(0f64, f64::max),
                        "read_bytes_mean": col(1).sum::<f64>() / n,
                        "heap_above_bytes_max": col(2).fold(0f64, f64::max),
                    })
                );
            }
        }
        other => bail!("unknown phase {other}"),
    }
    Ok(())
}
