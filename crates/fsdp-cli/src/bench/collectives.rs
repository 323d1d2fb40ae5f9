//! `fsdp bench collectives`: collective bandwidth between processes (on this machine, or
//! across machines when tools/bench-machines.sh starts its workers), with NCCL-tests
//! conventions (algorithm bandwidth = bytes / time; bus bandwidth scaled by
//! 2(n-1)/n for all-reduce and (n-1)/n for all-gather, reduce-scatter and all-to-all), next to
//! memcpy baselines measured in the same run (one rank copying alone, and every rank at once,
//! as a collective's ranks copy). Transports: our shared memory and TCP ring (workers
//! started like `fsdp launch` starts them), and MPI (feature `mpi`; workers started by
//! `mpirun`, Open MPI's own shared-memory path the anchor for ours).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp_comm::{Buffer, Communicator, CommunicatorExt, ReduceOp};

fn sizes(max_mib: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = 4usize << 10;
    while s <= max_mib << 20 {
        out.push(s);
        s *= 4;
    }
    out
}

/// Options of `fsdp bench collectives`.
#[derive(Args, Clone)]
pub struct CollectiveArgs {
    /// Number of processes.
    #[arg(
        long = "num_processes",
        visible_alias = "num-processes",
        default_value_t = 2
    )]
    num_processes: usize,
    /// Repetitions per op and size, back to back (after one warm-up).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Largest message in MiB.
    #[arg(long = "max_mib", default_value_t = 64)]
    max_mib: usize,
    /// Transports to measure, comma-separated, side by side with ratios: shm, tcp, mpi
    /// (`mpi` needs a build with the `mpi` feature and Open MPI's mpirun); `both` is shm,tcp.
    #[arg(long, default_value = "both")]
    transport: String,
    /// What the all-reduce and the reduce-scatter compute: sum, or avg (the mean, as the
    /// engine reduces gradients).
    #[arg(long = "reduce_op", value_enum, default_value_t = Reduction::Sum)]
    reduce_op: Reduction,
    /// Write the JSON results to this file too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Internal: run as one of the benchmark's workers.
    #[arg(long, hide = true)]
    worker: bool,
}

/// The reductions `--reduce_op` offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Reduction {
    /// The sum over ranks.
    Sum,
    /// The mean over ranks.
    Avg,
}

impl Reduction {
    fn op(self) -> ReduceOp {
        match self {
            Reduction::Sum => ReduceOp::Sum,
            Reduction::Avg => ReduceOp::Avg,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Reduction::Sum => "sum",
            Reduction::Avg => "avg",
        }
    }
}

/// Runs `fsdp bench collectives`: the workers, or the measurement inside one.
pub fn run(a: CollectiveArgs) -> Result<()> {
    if a.worker { worker(&a) } else { launch(&a) }
}

/// Runs the workers once per transport and prints each table, then one JSON document with
/// every result and the shared-memory / TCP bus-bandwidth ratios.
fn launch(a: &CollectiveArgs) -> Result<()> {
    if a.num_processes < 2 {
        bail!("--num_processes must be at least 2 to measure communication");
    }
    let transports: Vec<&str> = match a.transport.as_str() {
        "both" => vec!["shm", "tcp"],
        list => list.split(',').map(str::trim).collect(),
    };
    if let Some(bad) = transports
        .iter()
        .find(|t| !["shm", "tcp", "mpi"].contains(t))
    {
        bail!("--transport: `{bad}` is not one of shm, tcp, mpi (comma-separated) or both");
    }
    if transports.contains(&"mpi") && !fsdp_comm::MPI_BUILT {
        bail!("--transport mpi: this fsdp was built without MPI (build with `--features mpi`)");
    }
    let mut docs = Vec::new();
    for t in &transports {
        let report = run_workers(a, t)?;
        let (table, json) = report.trim_end().rsplit_once('\n').unwrap_or(("", &report));
        println!("{table}");
        docs.push(
            serde_json::from_str::<serde_json::Value>(json)
                .context("reading a worker's JSON report")?,
        );
    }
    // The first transport's bus bandwidth over each other's, op by op and size by size.
    let mut ratios = Vec::new();
    if let Some((first, others)) = docs.split_first() {
        for other in others {
            let (a_name, b_name) = (
                first["transport"].as_str().unwrap_or("?"),
                other["transport"].as_str().unwrap_or("?"),
            );
            println!("\n{a_name} / {b_name} bus bandwidth:");
            let (x, y) = (first["results"].as_array(), other["results"].as_array());
            // Rows of the same op and size (shared blocks' rows are the shared memory's own).
            let pairs = x.into_iter().flatten().filter_map(|rx| {
                let same =
                    |ry: &&serde_json::Value| ry["op"] == rx["op"] && ry["bytes"] == rx["bytes"];
                y.into_iter().flatten().find(same).map(|ry| (rx, ry))
            });
            for (rx, ry) in pairs {
                let ratio = rx["busbw_gbps"].as_f64().unwrap_or(0.0)
                    / ry["busbw_gbps"].as_f64().unwrap_or(f64::NAN);
                println!(
                    "{:>15} {:>10} {ratio:>8.2}x",
                    rx["op"].as_str().unwrap_or("?"),
                    rx["bytes"]
                );
                ratios.push(serde_json::json!({
                    "op": rx["op"], "bytes": rx["bytes"], "of": a_name, "over": b_name,
                    "ratio": ratio,
                }));
            }
        }
    }
    let doc = serde_json::json!({ "benchmark": "collectives", "runs": docs, "ratios": ratios });
    println!("{doc}");
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

/// Starts the workers (this binary with `--worker`) over one transport and returns rank 0's
/// report.
fn run_workers(a: &CollectiveArgs, transport: &str) -> Result<String> {
    let args = [
        "bench",
        "collectives",
        "--worker",
        "--iters",
        &a.iters.to_string(),
        "--max_mib",
        &a.max_mib.to_string(),
        "--num_processes",
        &a.num_processes.to_string(),
        "--reduce_op",
        a.reduce_op.name(),
    ]
    .map(String::from);
    let env = [("FSDP_COMM_BACKEND", transport)];
    if transport == "mpi" {
        super::workers::spawn_mpi_workers(&args, a.num_processes, &env)
    } else {
        super::workers::spawn_workers(&args, a.num_processes, 1, &env)
    }
    .with_context(|| format!("over {transport}"))
}

struct Row {
    op: &'static str,
    bytes: usize,
    time: Duration,
    algbw: f64,
    busbw: f64,
}

fn worker(a: &CollectiveArgs) -> Result<()> {
    let pg = fsdp_comm::join_job()?.group;
    let n = pg.size();
    let mut rows = Vec::new();
    for bytes in sizes(a.max_mib) {
        let elems = bytes / 4;
        let nf = n as f64;
        // Buffers live across repetitions, as in a training loop (NCCL-tests does the same):
        // one full-size buffer and one shard-size buffer, each op's pair passed through.
        let shard = elems / n;
        let cell = |len: usize, v: f32| std::cell::RefCell::new(Buffer::F32(vec![v; len]));
        let (full, part) = (cell(elems, 1.0), cell(shard, 1.0));
        let (gathered, scattered) = (cell(shard * n, 0.0), cell(shard, 0.0));
        let take = |c: &std::cell::RefCell<Buffer>| {
            std::mem::replace(&mut *c.borrow_mut(), Buffer::F32(Vec::new()))
        };
        // Over shared memory, blocks every rank maps: the collectives that copy once (made
        // by every rank, outside the timing).
        let blocks = |bytes| {
            pg.shared_blocks(bytes, 2)
                .map(|b| b.map(std::cell::RefCell::new))
        };
        let (gather_blocks, reduce_blocks) = (blocks(shard * 4)?, blocks(shard * n * 4)?);
        type Case<'a> = (&'static str, f64, Box<dyn Fn() -> Result<()> + 'a>);
        let mut cases: Vec<Case> = vec![
            (
                "all_reduce",
                2.0 * (nf - 1.0) / nf,
                Box::new(|| {
                    *full.borrow_mut() = pg.all_reduce(take(&full), a.reduce_op.op()).wait()?;
                    Ok(())
                }),
            ),
            (
                "all_gather",
                (nf - 1.0) / nf,
                Box::new(|| {
                    let (i, o) = pg.all_gather_into(take(&part), take(&gathered)).wait()?;
                    (*part.borrow_mut(), *gathered.borrow_mut()) = (i, o);
                    Ok(())
                }),
            ),
            (
                // This rank's block already in the output, as the engine gathers a unit.
                "all_gather_in_place",
                (nf - 1.0) / nf,
                Box::new(|| {
                    *gathered.borrow_mut() = pg.all_gather_in_place(take(&gathered)).wait()?;
                    Ok(())
                }),
            ),
            (
                "reduce_scatter",
                (nf - 1.0) / nf,
                Box::new(|| {
                    let (i, o) = pg
                        .reduce_scatter_into(take(&gathered), take(&scattered), a.reduce_op.op())
                        .wait()?;
                    (*gathered.borrow_mut(), *scattered.borrow_mut()) = (i, o);
                    Ok(())
                }),
            ),
            (
                // What a quantized reduction exchanges (its int8 or int4 parts are bytes: the
                // transport moves f32 and bytes alike).
                "all_to_all",
                (nf - 1.0) / nf,
                Box::new(|| {
                    *gathered.borrow_mut() = pg.all_to_all(take(&gathered)).wait()?;
                    Ok(())
                }),
            ),
            (
                "broadcast",
                1.0,
                Box::new(|| {
                    *full.borrow_mut() = pg.broadcast(take(&full), 0).wait()?;
                    Ok(())
                }),
            ),
        ];
        if let (Some(gb), Some(rb)) = (&gather_blocks, &reduce_blocks) {
            cases.push((
                // This rank's block written in its shared block; each peer's copied out of
                // the owner's once.
                "all_gather_shared",
                (nf - 1.0) / nf,
                Box::new(|| {
                    let Buffer::F32(out) = &mut *gathered.borrow_mut() else {
                        bail!("the gathered buffer is f32");
                    };
                    gb.borrow_mut().all_gather_into(out)?;
                    Ok(())
                }),
            ));
            cases.push((
                // This rank's input in its shared block; its part of every rank's summed
                // straight out of theirs.
                "reduce_scatter_shared",
                (nf - 1.0) / nf,
                Box::new(|| {
                    let Buffer::F32(out) = &mut *scattered.borrow_mut() else {
                        bail!("the scattered buffer is f32");
                    };
                    rb.borrow_mut().reduce_scatter_into(out, a.reduce_op.op())?;
                    Ok(())
                }),
            ));
        }
        for (op, bus_factor, f) in cases {
            let time = time_op(pg.as_ref(), a.iters, &*f)?;
            let algbw = bytes as f64 / time.as_secs_f64() / 1e9;
            rows.push(Row {
                op,
                bytes,
                time,
                algbw,
                busbw: algbw * bus_factor,
            });
        }
    }
    // Memory speed as collectives meet it: every rank copying at once (where the ranks
    // share a memory, they share its bandwidth), then one copying alone.
    pg.barrier().wait()?;
    let together = pg
        .all_reduce_vec(vec![memcpy_gbps(64 << 20) / n as f64], ReduceOp::Sum)
        .wait()?[0];
    pg.barrier().wait()?;
    if pg.rank() == 0 {
        let memcpy = Memcpy {
            alone: memcpy_gbps(64 << 20),
            together,
        };
        report(&rows, memcpy, n, a, pg.backend())?;
    }
    pg.barrier().wait()?;
    Ok(())
}

/// Single-thread copy bandwidth of 64 MiB (GB/s): one rank copying while the others wait,
/// and a rank's mean while every rank copies at once.
struct Memcpy {
    alone: f64,
    together: f64,
}

/// Time per op as NCCL-tests measures it: `iters` repetitions back to back after one
/// warm-up, between two barriers, the total divided by `iters` on the slowest rank. (Timing
/// each repetition alone after a barrier let a rank whose part returns at once — a
/// broadcast's root over TCP — send before a late peer started its clock, so that peer's
/// time could read faster than the transfer; back to back, such skew is paid once.)
fn time_op(pg: &dyn Communicator, iters: usize, f: &dyn Fn() -> Result<()>) -> Result<Duration> {
    f()?;
    pg.barrier().wait()?;
    let t = Instant::now();
    for _ in 0..iters.max(1) {
        f()?;
    }
    let mine = t.elapsed().as_secs_f64() / iters.max(1) as f64;
    let slowest = pg.all_reduce_vec(vec![mine], ReduceOp::Max).wait()?[0];
    Ok(Duration::from_secs_f64(slowest))
}

/// Single-thread copy bandwidth (GB/s) of a buffer of `bytes`, median of 10.
fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut times: Vec<f64> = (0..10)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    bytes as f64 / times[5] / 1e9
}

fn report(
    rows: &[Row],
    memcpy: Memcpy,
    n: usize,
    a: &CollectiveArgs,
    transport: &str,
) -> Result<()> {
    println!("fsdp-comm collectives, f32, {n} processes, transport: {transport}");
    println!(
        "{:>15} {:>10} {:>12} {:>12} {:>12}",
        "op", "bytes", "time_us", "algbw_GB/s", "busbw_GB/s"
    );
    for r in rows {
        println!(
            "{:>15} {:>10} {:>12.1} {:>12.3} {:>12.3}",
            r.op,
            r.bytes,
            r.time.as_secs_f64() * 1e6,
            r.algbw,
            r.busbw
        );
    }
    println!(
        "memcpy (1 thread, 64 MiB): {:.2} GB/s alone, {:.2} GB/s a rank with all {n} copying at once",
        memcpy.alone, memcpy.together
    );
    let largest = rows.iter().map(|r| r.bytes).max().unwrap_or(0);
    println!("bus bandwidth at {largest} bytes as a share of memcpy alone / all copying at once:");
    for r in rows.iter().filter(|r| r.bytes == largest) {
        println!(
            "{:>15} {:>9.0}% {:>9.0}%",
            r.op,
            100.0 * r.busbw / memcpy.alone,
            100.0 * r.busbw / memcpy.together
        );
    }
    let json = serde_json::json!({
        "benchmark": "collectives",
        "transport": transport,
        "dtype": "f32",
        "num_processes": n,
        "iters": a.iters,
        "reduce_op": a.reduce_op.name(),
        "memcpy_gbps": memcpy.alone,
        "memcpy_together_gbps": memcpy.together,
        "results": rows.iter().map(|r| serde_json::json!({
            "op": r.op, "bytes": r.bytes, "time_us": r.time.as_secs_f64() * 1e6,
            "algbw_gbps": r.algbw, "busbw_gbps": r.busbw,
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
