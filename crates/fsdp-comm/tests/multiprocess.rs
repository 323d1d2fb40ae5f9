//! Collectives across real processes over real sockets. The test binary re-runs itself as
//! the workers: `worker_entry` does the work when `FSDP_TEST_SCENARIO` is set. Every job is
//! bounded in time and its processes are killed on the way out.

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use fsdp_comm::{GroupOptions, LocalJob, ProcessGroup, ReduceOp, WorkerOutput, WorldInfo};
use half::{bf16, f16};

use crate::common::{
    TestElement, check_collectives, check_hybrid_mesh, check_two_hops, data, expect_eq, value,
};

const SCENARIO: &str = "FSDP_TEST_SCENARIO";

struct Outcome {
    code: Option<i32>,
    output: String,
}

/// Starts `ranks` (each `(rank, extra env)`, in order; a rank may appear twice) of a
/// `world`-rank job running `scenario`.
fn spawn(scenario: &str, world: usize, ranks: &[(usize, Vec<(&str, String)>)]) -> LocalJob {
    let mut extras = ranks.iter().map(|(_, e)| e.clone());
    LocalJob::start(world, ranks.iter().map(|(r, _)| *r), None, |_| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "multiprocess::worker_entry",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCENARIO, scenario)
        .env("FSDP_JOB_SECRET", "test-secret")
        .env("FSDP_RENDEZVOUS_TIMEOUT_SECS", "30")
        .env("RUST_BACKTRACE", "0");
        for (k, v) in extras.next().unwrap_or_default() {
            cmd.env(k, v);
        }
        cmd
    })
    .unwrap()
}

/// Waits for the processes of `ranks` (killing every process after `limit`, and the others
/// once `ranks` are done) and returns each one's outcome.
fn finish_ranks(job: LocalJob, ranks: &[usize], limit: Duration) -> Vec<Outcome> {
    outcomes(job.wait_for(ranks, limit), limit)
}

/// Waits for every process (killing all after `limit`) and returns each one's outcome.
fn finish(job: LocalJob, limit: Duration) -> Vec<Outcome> {
    outcomes(job.wait(limit), limit)
}

fn outcomes((outputs, timed_out): (Vec<WorkerOutput>, bool), limit: Duration) -> Vec<Outcome> {
    let outcomes: Vec<Outcome> = outputs
        .iter()
        .map(|o| Outcome {
            code: o.status.and_then(|s| s.code()),
            output: o.combined(),
        })
        .collect();
    assert!(
        !timed_out,
        "job did not finish within {limit:?}:\n{}",
        dump(&outcomes)
    );
    outcomes
}

fn dump(outcomes: &[Outcome]) -> String {
    outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| format!("--- process {i} (exit {:?}):\n{}", o.code, o.output))
        .collect()
}

fn run_all(
    scenario: &str,
    world: usize,
    extra: Vec<(&str, String)>,
    limit: Duration,
) -> Vec<Outcome> {
    let ranks: Vec<_> = (0..world).map(|r| (r, extra.clone())).collect();
    finish(spawn(scenario, world, &ranks), limit)
}

fn assert_all_ok(outcomes: &[Outcome]) {
    for o in outcomes {
        assert!(
            o.code == Some(0) && o.output.contains("WORKER OK"),
            "{}",
            dump(outcomes)
        );
    }
}

// ---------------------------------------------------------------- worker side

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn worker_entry() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let result = std::panic::catch_unwind(|| run_scenario(&scenario));
    match result {
        Ok(Ok(())) => {
            println!("WORKER OK");
            std::process::exit(0)
        }
        Ok(Err(msg)) => {
            println!("WORKER FAILED: {msg}");
            std::process::exit(1)
        }
        Err(_) => std::process::exit(2),
    }
}

fn group() -> Result<ProcessGroup, String> {
    ProcessGroup::from_env().map_err(|e| format!("init: {e}"))
}

fn run_scenario(scenario: &str) -> Result<(), String> {
    match scenario {
        "collectives" => collectives(),
        "large" => large(),
        "subgroups" => subgroups(),
        "communicator" => communicator(),
        "mismatch" => expect_error(|pg| {
            if pg.rank() == 0 {
                pg.all_gather(vec![1.0f32; 8]).wait().map(|_| ())
            } else {
                pg.reduce_scatter(vec![1.0f32; 8 * pg.size()], ReduceOp::Sum)
                    .wait()
                    .map(|_| ())
            }
        }),
        "size_mismatch" => expect_error(|pg| {
            let n = if pg.rank() == 0 { 10 } else { 12 };
            pg.all_reduce(vec![1.0f32; n], ReduceOp::Sum)
                .wait()
                .map(|_| ())
        }),
        "all_to_all_mismatch" => expect_error(|pg| {
            let n = if pg.rank() == 0 { 2 } else { 4 } * pg.size();
            pg.all_to_all(vec![1u8; n]).wait().map(|_| ())
        }),
        "bad_argument" => expect_error(|pg| {
            let n = if pg.rank() == 0 {
                2 * pg.size() + 1
            } else {
                2 * pg.size()
            };
            pg.reduce_scatter(vec![1.0f32; n], ReduceOp::Sum)
                .wait()
                .map(|_| ())
        }),
        "peer_dies" => {
            let pg = group()?;
            if pg.rank() == 1 {
                std::process::exit(17);
            }
            expect_error_on(&pg, |pg| {
                pg.all_reduce(vec![1.0f32; 1 << 20], ReduceOp::Sum)
                    .wait()
                    .map(|_| ())?;
                pg.barrier().wait()
            })
        }
        "peer_hangs" => {
            let pg = group()?;
            if pg.rank() == 1 {
                std::thread::sleep(Duration::from_secs(20));
                return Ok(());
            }
            expect_error_on(&pg, |pg| pg.barrier().wait())
        }
        "peer_stops" => {
            let pg = group()?;
            if pg.rank() == 1 {
                // Stopped, not dead: its connections stay open and nothing reads them.
                // SAFETY: raising a signal at this process.
                unsafe { libc::raise(libc::SIGSTOP) };
                return Ok(());
            }
            expect_error_on(&pg, |pg| {
                pg.broadcast(vec![1.0f32; 16 << 20], 0).wait().map(|_| ())
            })
        }
        "join" => {
            let pg = group()?;
            if pg.rank() == 1 {
                // Never joins: waits for the others' verdict instead.
                std::thread::sleep(Duration::from_secs(20));
                return Ok(());
            }
            match pg.join("save_state", Duration::from_secs(1)) {
                Ok(()) => Err("join passed without rank 1".into()),
                Err(e) => {
                    println!("ERROR: {e}");
                    Ok(())
                }
            }
        }
        "shared_blocks" => shared_blocks(),
        "shared_blocks_mismatch" => {
            let pg = group()?;
            let bytes = if pg.rank() == 0 { 4096 } else { 8192 };
            match pg.shared_blocks(bytes, 2) {
                Ok(_) => Err("blocks of different sizes were accepted".into()),
                Err(e) => {
                    println!("ERROR: {e}");
                    Ok(())
                }
            }
        }
        "shared_blocks_peer_dies" | "shared_blocks_peer_hangs" => {
            let pg = group()?;
            let mut blocks = pg
                .shared_blocks(1 << 20, 2)
                .map_err(|e| e.to_string())?
                .ok_or("no shared blocks over shared memory")?;
            if pg.rank() == 1 {
                if scenario.ends_with("dies") {
                    std::process::exit(17);
                }
                std::thread::sleep(Duration::from_secs(20));
                return Ok(());
            }
            let started = Instant::now();
            let mut out = vec![0f32; (1 << 20) / 4 * pg.size()];
            match blocks.all_gather_into(&mut out) {
                Ok(_) => Err("an all-gather without its peer passed".into()),
                Err(e) => {
                    println!("ERROR after {:?}: {e}", started.elapsed());
                    // The group stops with it: its next collective fails at once.
                    match pg.barrier().wait() {
                        Ok(()) => Err("the group still worked after the failure".into()),
                        Err(_) => Ok(()),
                    }
                }
            }
        }
        "init_only" => group().map(|_| ()),
        "init_error" => match group() {
            Ok(_) => Err("expected initialisation to fail".into()),
            Err(e) => {
                println!("ERROR: {e}");
                Ok(())
            }
        },
        #[cfg(feature = "nccl")]
        "nccl" => nccl_collectives(),
        other => Err(format!("unknown scenario {other}")),
    }
}

/// The shared blocks' all-gather and reduce-scatter over many rounds, with one slot and with
/// three, while rank 0 now and then reads late (an owner that rewrote a block before every
/// peer read it would show here as another round's values), against their definitions bit
/// for bit; over TCP there are none; nothing of this process is left in /dev/shm.
fn shared_blocks() -> Result<(), String> {
    let pg = group()?;
    let (n, me) = (pg.size(), pg.rank());
    let over_tcp = std::env::var("FSDP_COMM_TRANSPORT").is_ok_and(|t| t == "tcp");
    // An odd size: blocks are not whole pages.
    let elems = 1000 * n + 12 * n;
    let made = |slots| {
        pg.shared_blocks(elems * 4, slots)
            .map_err(|e| e.to_string())
    };
    let (Some(one), Some(three)) = (made(1)?, made(3)?) else {
        return match over_tcp || n == 1 {
            true => Ok(()),
            false => Err("no shared blocks over shared memory".into()),
        };
    };
    if over_tcp {
        return Err("shared blocks over TCP".into());
    }
    let prefix = format!("fsdp-{}-", std::process::id());
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(&prefix))
        .collect();
    if !left.is_empty() {
        return Err(format!("left in /dev/shm: {left:?}"));
    }
    let at = |r: usize, round: usize, i: usize| value(r * 1000 + round, i) as f32;
    out_of_order_rounds(&pg, elems, at)?;
    // Gathers of 4 MiB or more are written past the cache: blocks that large too (an odd
    // number of elements, so peers' places in the output are not vector-aligned).
    let large_elems = 300_007 * n;
    let large = pg
        .shared_blocks(large_elems * 4, 2)
        .map_err(|e| e.to_string())?
        .ok_or("no large blocks")?;
    for (mut blocks, elems, rounds) in [
        (one, elems, 30),
        (three, elems, 30),
        (large, large_elems, 3),
    ] {
        for round in 0..rounds {
            let mine: Vec<f32> = (0..elems).map(|i| at(me, round, i)).collect();
            blocks.write_block(&mine).map_err(|e| e.to_string())?;
            if me == 0 && round % 5 == 2 {
                std::thread::sleep(Duration::from_millis(30));
            }
            let mut out = vec![f32::NAN; elems * n];
            blocks
                .all_gather_into(&mut out)
                .map_err(|e| e.to_string())?;
            for r in 0..n {
                let got = &out[r * elems..(r + 1) * elems];
                if r == me {
                    if !got.iter().all(|v| v.is_nan()) {
                        return Err(format!("round {round}: this rank's own place was written"));
                    }
                    continue;
                }
                let want: Vec<f32> = (0..elems).map(|i| at(r, round, i)).collect();
                expect_eq(&format!("round {round}: block of rank {r}"), got, &want)?;
            }
            let op = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max][round % 3];
            let inputs: Vec<f32> = (0..elems).map(|i| at(me, round + 100, i)).collect();
            blocks.write_block(&inputs).map_err(|e| e.to_string())?;
            let k = elems / n;
            let mut part = vec![0f32; k];
            blocks
                .reduce_scatter_into(&mut part, op)
                .map_err(|e| e.to_string())?;
            let want: Vec<f32> = (0..k)
                .map(|i| {
                    let mut acc = at(0, round + 100, me * k + i);
                    for r in 1..n {
                        let v = at(r, round + 100, me * k + i);
                        acc = if op == ReduceOp::Max {
                            acc.max(v)
                        } else {
                            acc + v
                        };
                    }
                    if op == ReduceOp::Avg {
                        acc / n as f32
                    } else {
                        acc
                    }
                })
                .collect();
            expect_eq(
                &format!("round {round}: reduce-scatter ({op:?})"),
                &part,
                &want,
            )?;
        }
    }
    Ok(())
}

/// Rounds read in another order than published, a round released unread, a slot refused
/// while this rank still holds its round, and the bytes the group counts as sent.
fn out_of_order_rounds(
    pg: &ProcessGroup,
    elems: usize,
    at: impl Fn(usize, usize, usize) -> f32,
) -> Result<(), String> {
    let (n, me) = (pg.size(), pg.rank());
    let mut blocks = pg
        .shared_blocks(elems * 4, 2)
        .map_err(|e| e.to_string())?
        .ok_or("no blocks")?;
    let sent_before = pg.bytes_sent();
    let mut rounds = Vec::new();
    for round in 0..2 {
        let mine: Vec<f32> = (0..elems).map(|i| at(me, 500 + round, i)).collect();
        blocks.write_block(&mine).map_err(|e| e.to_string())?;
        rounds.push(blocks.publish((n - 1) * elems * 4));
    }
    let sent = pg.bytes_sent() - sent_before;
    if sent != ((n - 1) * elems * 4 * 2) as u64 {
        return Err(format!("{sent} bytes counted as sent for two rounds"));
    }
    if blocks.can_publish() || blocks.next_block().is_ok() {
        return Err("a third round was let overwrite the first, still unread".into());
    }
    // The second round first, then the first: each reads its own values.
    for (k, &round) in rounds.iter().enumerate().rev() {
        let got = blocks
            .read_all(round, |all| {
                all.iter()
                    .map(|b| f32::from_le_bytes([b[4], b[5], b[6], b[7]]))
                    .collect::<Vec<f32>>()
            })
            .map_err(|e| e.to_string())?;
        let want: Vec<f32> = (0..n).map(|r| at(r, 500 + k, 1)).collect();
        expect_eq(&format!("round {round} read out of order"), &got, &want)?;
    }
    // A round published and released without being read frees its slot just the same.
    let mine: Vec<f32> = (0..elems).map(|i| at(me, 600, i)).collect();
    blocks.write_block(&mine).map_err(|e| e.to_string())?;
    let skipped = blocks.publish(0);
    blocks.release(skipped);
    blocks.write_block(&mine).map_err(|e| e.to_string())?;
    let next = blocks.publish(0);
    blocks.write_block(&mine).map_err(|e| e.to_string())?;
    let last = blocks.publish(0);
    blocks.release(next);
    blocks.read(last, |_, _| ()).map_err(|e| e.to_string())
}

fn expect_error(f: impl Fn(&ProcessGroup) -> fsdp_comm::Result<()>) -> Result<(), String> {
    let pg = group()?;
    expect_error_on(&pg, f)
}

fn expect_error_on(
    pg: &ProcessGroup,
    f: impl Fn(&ProcessGroup) -> fsdp_comm::Result<()>,
) -> Result<(), String> {
    let started = Instant::now();
    match f(pg) {
        Ok(()) => Err("expected an error".into()),
        Err(e) => {
            println!("ERROR after {:?}: {e}", started.elapsed());
            // The group stays broken: later calls fail at once.
            let again = pg.barrier().wait();
            if again.is_ok() {
                return Err("group still worked after a failure".into());
            }
            Ok(())
        }
    }
}

/// Every collective of the trait (the checks every backend meets), then what only a
/// `ProcessGroup` has: all-gather of unequal parts and send/recv.
fn check_dtype<T: TestElement>(
    pg: &ProcessGroup,
    name: &str,
    sizes: &[usize],
) -> Result<(), String> {
    check_collectives::<T>(pg, name, sizes)?;
    let (rank, n) = (pg.rank(), pg.size());
    let err = |e: fsdp_comm::CommError| e.to_string();
    for &len in sizes {
        let ctx = |op: &str| format!("{op} {name} x {len}");
        let all: Vec<Vec<T>> = (0..n).map(|r| data::<T>(r, len)).collect();
        let counts: Vec<usize> = (0..n).map(|r| len + r).collect();
        let got = pg
            .all_gather_v(data::<T>(rank, len + rank), counts.clone())
            .wait()
            .map_err(err)?;
        let want: Vec<T> = (0..n).flat_map(|r| data::<T>(r, counts[r])).collect();
        expect_eq(&ctx("all_gather_v"), &got, &want)?;

        if n > 1 {
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            let sent = pg.send(data::<T>(rank, len), next);
            let got = pg.recv::<T>(len, prev).wait().map_err(err)?;
            sent.wait().map_err(err)?;
            expect_eq(&ctx("send/recv"), &got, &all[prev])?;
        }
        pg.barrier().wait().map_err(err)?;
    }
    Ok(())
}

fn collectives() -> Result<(), String> {
    let pg = group()?;
    let sizes = [0, 1, 7, 1024, (1 << 18) + 3];
    check_dtype::<f32>(&pg, "f32", &sizes)?;
    check_dtype::<f64>(&pg, "f64", &sizes)?;
    check_dtype::<f16>(&pg, "f16", &sizes)?;
    check_dtype::<bf16>(&pg, "bf16", &sizes)?;
    check_dtype::<i32>(&pg, "i32", &sizes)?;
    check_dtype::<i64>(&pg, "i64", &sizes)?;
    check_dtype::<u8>(&pg, "u8", &sizes)?;
    Ok(())
}

/// 16 MiB messages: four times a shared-memory ring's capacity (4 MiB), so every
/// collective wraps its rings and TCP sends many chunks; and bytes of a length that a
/// shared-memory all-to-all's rounds (256 KiB of each part) do not divide. Both are large
/// enough for receives written past the cache (4 MiB), the bytes' at odd offsets.
fn large() -> Result<(), String> {
    let pg = group()?;
    check_dtype::<f32>(&pg, "f32", &[4 << 20])?;
    check_dtype::<u8>(&pg, "u8", &[(4 << 20) + 7])
}

fn subgroups() -> Result<(), String> {
    let pg = group()?;
    let err = |e: fsdp_comm::CommError| e.to_string();
    let (rank, n) = (pg.rank(), pg.size());
    // Evens and odds as two concurrent groups.
    let evens: Vec<usize> = (0..n).step_by(2).collect();
    let odds: Vec<usize> = (1..n).step_by(2).collect();
    let g_even = pg.new_group(&evens).map_err(err)?;
    let g_odd = pg.new_group(&odds).map_err(err)?;
    let mine = g_even
        .as_ref()
        .or(g_odd.as_ref())
        .ok_or("rank in no group")?;
    let members = if rank % 2 == 0 { &evens } else { &odds };
    let got = mine
        .all_reduce(vec![rank as i64], ReduceOp::Sum)
        .wait()
        .map_err(err)?;
    let want: i64 = members.iter().map(|&r| r as i64).sum();
    expect_eq("subgroup all_reduce", &got, &[want])?;
    if mine.global_ranks() != members.as_slice() {
        return Err(format!(
            "global ranks {:?} != {members:?}",
            mine.global_ranks()
        ));
    }

    // 2-D mesh: shard groups of 2, replicate groups across them.
    let (shard, replicate) = pg.mesh_2d(2).map_err(err)?;
    // Async handles on different groups, waited in reverse order of issue.
    let w1 = shard.all_gather(vec![rank as i32]);
    let w2 = replicate.all_reduce(vec![rank as i32], ReduceOp::Sum);
    let w3 = pg.all_reduce(vec![1i32], ReduceOp::Sum);
    let total = w3.wait().map_err(err)?;
    let rep = w2.wait().map_err(err)?;
    let gathered = w1.wait().map_err(err)?;
    expect_eq("world all_reduce", &total, &[n as i32])?;
    let base = rank / 2 * 2;
    expect_eq(
        "shard all_gather",
        &gathered,
        &[base as i32, base as i32 + 1],
    )?;
    let want: i32 = (0..n / 2).map(|r| (r * 2 + rank % 2) as i32).sum();
    expect_eq("replicate all_reduce", &rep, &[want])?;
    Ok(())
}

/// The same collectives through `dyn Communicator` (typed buffers), a hybrid mesh and two-hop
/// collectives.
fn communicator() -> Result<(), String> {
    use fsdp_comm::{Buffer, Communicator, CommunicatorExt};
    let pg = std::sync::Arc::new(group()?);
    let err = |e: fsdp_comm::CommError| e.to_string();
    let (rank, n) = (pg.rank(), pg.size());
    let c: std::sync::Arc<dyn Communicator> = pg.clone();
    let mine: Vec<bf16> = data::<bf16>(rank, 5);
    let all: Vec<Vec<bf16>> = (0..n).map(|r| data::<bf16>(r, 5)).collect();
    let (_, gathered) = c
        .all_gather_into(Buffer::from(mine.clone()), Buffer::BF16(Vec::new()))
        .wait()
        .map_err(err)?;
    expect_eq(
        "dyn all_gather",
        gathered.as_slice::<bf16>().ok_or("dtype")?,
        &all.concat(),
    )?;
    // Into a reused output longer than the result and full of stale values: the gather
    // writes every element without zero-filling first, so none of them may survive.
    let stale = Buffer::F32(vec![f32::NAN; 7 * n + 3]);
    let (_, gathered) = c
        .all_gather_into(Buffer::from(data::<f32>(rank, 7)), stale)
        .wait()
        .map_err(err)?;
    let want: Vec<f32> = (0..n).flat_map(|r| data::<f32>(r, 7)).collect();
    expect_eq(
        "dyn all_gather into a stale output",
        gathered.as_slice::<f32>().ok_or("dtype")?,
        &want,
    )?;
    // In place: this rank's block already in the output, the others' slots stale; even
    // ranks gather in place, odd ones out of place, in one collective.
    let gathered = if rank % 2 == 0 {
        let mut output = vec![f32::NAN; 7 * n];
        output[rank * 7..(rank + 1) * 7].copy_from_slice(&data::<f32>(rank, 7));
        c.all_gather_in_place(Buffer::from(output))
    } else {
        c.all_gather(Buffer::from(data::<f32>(rank, 7)))
    }
    .wait()
    .map_err(err)?;
    expect_eq(
        "dyn all_gather in place",
        gathered.as_slice::<f32>().ok_or("dtype")?,
        &want,
    )?;
    // The room made for it, the block written into uninitialised memory.
    let room = unsafe {
        Buffer::for_gather_in_place::<bf16>(n, rank, 5, |slot| {
            for (d, v) in slot.iter_mut().zip(&mine) {
                d.write(*v);
            }
        })
    };
    let gathered = c.all_gather_in_place(room).wait().map_err(err)?;
    expect_eq(
        "dyn all_gather in place, bf16",
        gathered.as_slice::<bf16>().ok_or("dtype")?,
        &all.concat(),
    )?;
    let full: Vec<f32> = data::<f32>(rank, 4 * n);
    let (_, part) = c
        .reduce_scatter_into(Buffer::from(full), Buffer::F32(Vec::new()), ReduceOp::Sum)
        .wait()
        .map_err(err)?;
    let want: Vec<f32> = (rank * 4..(rank + 1) * 4)
        .map(|i| (0..n).map(|r| value(r, i) as f32).sum())
        .collect();
    expect_eq(
        "dyn reduce_scatter",
        part.as_slice::<f32>().ok_or("dtype")?,
        &want,
    )?;
    let stale = Buffer::F32(vec![f32::NAN; 9]);
    let (_, part) = c
        .reduce_scatter_into(Buffer::from(data::<f32>(rank, 4 * n)), stale, ReduceOp::Sum)
        .wait()
        .map_err(err)?;
    expect_eq(
        "dyn reduce_scatter into a stale output",
        part.as_slice::<f32>().ok_or("dtype")?,
        &want,
    )?;
    let got = c
        .all_reduce_vec(vec![rank as i64], ReduceOp::Sum)
        .wait()
        .map_err(err)?;
    expect_eq("dyn all_reduce", &got, &[(0..n as i64).sum()])?;
    let got = c.gather_vec(vec![rank as u8], n - 1).wait().map_err(err)?;
    if rank == n - 1 {
        let want: Vec<u8> = (0..n as u8).collect();
        expect_eq("dyn gather", &got.ok_or("root got nothing")?, &want)?;
    }
    // Hybrid mesh, 2 replicas of 2 shards: world all-reduce over both dimensions.
    check_hybrid_mesh(pg.as_ref())?;
    // Two machines of 2 processes, and 4 machines of one, in two hops.
    check_two_hops(pg.as_ref(), 2)?;
    check_two_hops(pg.as_ref(), 1)?;
    c.barrier().wait().map_err(err)
}

// ---------------------------------------------------------------- tests

fn transport(name: &str) -> Vec<(&'static str, String)> {
    vec![("FSDP_COMM_TRANSPORT", name.to_string())]
}

#[test]
fn every_collective_dtype_and_size_for_world_sizes_1_to_8_over_shared_memory() {
    for world in [1, 2, 3, 4, 5, 8] {
        let outcomes = run_all(
            "collectives",
            world,
            transport("shm"),
            Duration::from_secs(240),
        );
        assert_all_ok(&outcomes);
    }
}

#[test]
fn every_collective_dtype_and_size_for_world_sizes_1_to_8_over_tcp() {
    for world in [1, 2, 3, 4, 5, 8] {
        let outcomes = run_all(
            "collectives",
            world,
            transport("tcp"),
            Duration::from_secs(240),
        );
        assert_all_ok(&outcomes);
    }
}

#[test]
fn sixteen_mib_collectives_over_both_transports() {
    for world in [2, 3] {
        for t in ["shm", "tcp"] {
            assert_all_ok(&run_all(
                "large",
                world,
                transport(t),
                Duration::from_secs(240),
            ));
        }
    }
}

#[test]
fn shared_blocks_gather_and_reduce_each_round_as_defined_over_shared_memory_only() {
    for world in [1, 2, 3, 4] {
        assert_all_ok(&run_all(
            "shared_blocks",
            world,
            transport("shm"),
            Duration::from_secs(120),
        ));
    }
    assert_all_ok(&run_all(
        "shared_blocks",
        2,
        transport("tcp"),
        Duration::from_secs(60),
    ));
}

#[test]
fn shared_blocks_of_different_sizes_are_refused_naming_both() {
    let outcomes = run_all(
        "shared_blocks_mismatch",
        2,
        transport("shm"),
        Duration::from_secs(60),
    );
    assert_all_ok(&outcomes);
    let errors = errors_of(&outcomes);
    assert!(
        errors.iter().any(|e| e.contains(
            "this rank called shared_blocks(4096 bytes, 2 slots, 2 ranks), rank 1 called shared_blocks(8192 bytes, 2 slots, 2 ranks)"
        )),
        "{errors:#?}"
    );
}

#[test]
fn a_shared_blocks_peer_that_dies_or_hangs_is_named_within_seconds() {
    let started = Instant::now();
    let outcomes = run_all(
        "shared_blocks_peer_dies",
        2,
        transport("shm"),
        Duration::from_secs(30),
    );
    assert_eq!(outcomes[1].code, Some(17), "{}", dump(&outcomes));
    assert_eq!(outcomes[0].code, Some(0), "{}", dump(&outcomes));
    let e = &errors_of(&outcomes)[0];
    assert!(
        e.contains("connection to rank 1 lost during reading a peer's shared block (round 1)"),
        "{e}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
    rank_0_times_out(
        "shared_blocks_peer_hangs",
        transport("shm"),
        "rank 0: reading a peer's shared block (round 1), waiting for ranks [1] timed out after 1s",
    );
}

#[test]
fn subgroups_mesh_and_out_of_order_waits() {
    assert_all_ok(&run_all("subgroups", 4, vec![], Duration::from_secs(60)));
}

#[test]
fn typed_buffers_through_the_communicator_trait_a_hybrid_mesh_and_two_hops() {
    for t in ["shm", "tcp"] {
        assert_all_ok(&run_all(
            "communicator",
            4,
            transport(t),
            Duration::from_secs(60),
        ));
    }
}

fn errors_of(outcomes: &[Outcome]) -> Vec<String> {
    outcomes
        .iter()
        .map(|o| {
            let line = o
                .output
                .lines()
                .find(|l| l.contains("ERROR"))
                .unwrap_or_default();
            line[line.find("ERROR").unwrap_or(0)..].to_string()
        })
        .collect()
}

#[test]
fn mismatched_collectives_fail_on_every_rank() {
    for world in [2, 3] {
        let outcomes = run_all("mismatch", world, vec![], Duration::from_secs(30));
        assert_all_ok(&outcomes);
        let errors = errors_of(&outcomes);
        assert!(
            errors.iter().any(|e| e.contains("collective mismatch")
                && e.contains("all_gather(f32 x")
                && e.contains("reduce_scatter(f32 x")),
            "{errors:#?}"
        );
        assert!(
            errors
                .iter()
                .all(|e| e.contains("mismatch") || e.contains("aborted because rank")),
            "{errors:#?}"
        );
    }
    let outcomes = run_all("size_mismatch", 2, vec![], Duration::from_secs(30));
    assert_all_ok(&outcomes);
    let errors = errors_of(&outcomes);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("all_reduce(f32 x 10, sum)")
                && e.contains("all_reduce(f32 x 12, sum)")),
        "{errors:#?}"
    );
    // An all-to-all of unequal inputs: every rank fails, naming both calls.
    let outcomes = run_all("all_to_all_mismatch", 2, vec![], Duration::from_secs(30));
    assert_all_ok(&outcomes);
    let errors = errors_of(&outcomes);
    assert!(errors.iter().all(|e| !e.is_empty()), "{errors:#?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("all_to_all(u8 x 4)") && e.contains("all_to_all(u8 x 8)")),
        "{errors:#?}"
    );
}

#[test]
fn a_bad_argument_on_one_rank_stops_the_others_at_once() {
    let outcomes = run_all("bad_argument", 2, vec![], Duration::from_secs(30));
    assert_all_ok(&outcomes);
    let errors = errors_of(&outcomes);
    assert!(
        errors[0].contains(
            "invalid reduce_scatter call: input length 5 is not a multiple of the group size 2"
        ),
        "{errors:#?}"
    );
    assert!(
        errors[1].contains("aborted because rank 0 failed"),
        "{errors:#?}"
    );
}

#[test]
fn a_dead_peer_fails_the_others_within_seconds() {
    let started = Instant::now();
    let outcomes = run_all("peer_dies", 3, vec![], Duration::from_secs(30));
    assert_eq!(outcomes[1].code, Some(17));
    for r in [0, 2] {
        assert_eq!(outcomes[r].code, Some(0), "{}", dump(&outcomes));
    }
    let errors = errors_of(&outcomes);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("connection to rank 1 lost")),
        "{errors:#?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
}

/// Runs `scenario` on 2 ranks with a 1 s timeout (and `extra` settings): rank 0 must fail
/// with `expected` within 15 s while rank 1 is still held up.
fn rank_0_times_out(scenario: &str, extra: Vec<(&str, String)>, expected: &str) {
    let started = Instant::now();
    let mut extra = extra;
    extra.push(("FSDP_COMM_TIMEOUT_SECS", "1".to_string()));
    let job = spawn(scenario, 2, &[(0, extra.clone()), (1, extra)]);
    let outcomes = finish_ranks(job, &[0], Duration::from_secs(40));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(outcomes[0].code, Some(0), "{}", dump(&outcomes));
    let e = &errors_of(&outcomes)[0];
    assert!(e.contains(expected), "{e}");
}

#[test]
fn a_hung_peer_times_out_naming_it() {
    // Rank 1 sleeps 20 s; the job ends as soon as rank 0 has reported its timeout.
    rank_0_times_out(
        "peer_hangs",
        vec![],
        "rank 0: barrier(u8 x 0) as collective #1 waiting for rank 1 timed out after 1s",
    );
}

#[test]
fn a_send_to_a_stopped_peer_times_out_naming_it_instead_of_reporting_success() {
    // Rank 1 stops itself; rank 0's 64 MiB broadcast over TCP fills the sockets' buffers and
    // then must fail within its timeout (the writer sends from the caller's buffer, so the
    // broadcast cannot return before its bytes are out), and the group stays broken.
    rank_0_times_out(
        "peer_stops",
        transport("tcp"),
        "rank 0: broadcast(f32 x 16777216) as collective #1 waiting for rank 1 timed out after 1s",
    );
}

#[test]
fn a_join_names_the_ranks_that_did_not_come() {
    let started = Instant::now();
    let job = spawn(
        "join",
        3,
        &[(0, Vec::new()), (1, Vec::new()), (2, Vec::new())],
    );
    let outcomes = finish_ranks(job, &[0, 2], Duration::from_secs(30));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    for r in [0, 2] {
        let e = &errors_of(&outcomes)[r];
        assert!(
            e.contains("save_state: ranks [1] did not join within 1s"),
            "{}",
            dump(&outcomes)
        );
    }
}

#[test]
fn rendezvous_timeout_names_missing_ranks() {
    let extra = vec![("FSDP_RENDEZVOUS_TIMEOUT_SECS", "2".to_string())];
    let job = spawn("init_error", 3, &[(0, extra.clone()), (1, extra)]);
    let outcomes = finish(job, Duration::from_secs(30));
    assert_all_ok(&outcomes);
    for e in errors_of(&outcomes) {
        assert!(
            e.contains("rendezvous timed out after 2s; ranks that never arrived: [2]"),
            "{e}"
        );
    }
}

#[test]
fn wrong_secret_and_duplicate_rank_are_refused() {
    let long = vec![("FSDP_RENDEZVOUS_TIMEOUT_SECS", "3".to_string())];
    let mut bad = long.clone();
    bad.push(("FSDP_JOB_SECRET", "intruder".to_string()));
    let job = spawn("init_error", 2, &[(0, long.clone()), (1, bad)]);
    let outcomes = finish(job, Duration::from_secs(30));
    assert_eq!(outcomes[1].code, Some(0), "{}", dump(&outcomes));
    assert!(
        errors_of(&outcomes)[1].contains("wrong or missing job secret"),
        "{}",
        dump(&outcomes)
    );

    // Two processes claim rank 1: one of them is refused.
    let job = spawn(
        "init_error",
        3,
        &[(0, long.clone()), (1, long.clone()), (1, long)],
    );
    let outcomes = finish(job, Duration::from_secs(30));
    let errors = errors_of(&outcomes);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("rank 1 of group `world` is already claimed")),
        "{}",
        dump(&outcomes)
    );
}

#[test]
fn single_process_group_needs_no_store() {
    let world = WorldInfo::from_vars(&HashMap::new()).unwrap();
    let pg = ProcessGroup::init(&world, GroupOptions::default()).unwrap();
    assert_eq!(
        pg.all_reduce(vec![2.0f32, 4.0], ReduceOp::Avg)
            .wait()
            .unwrap(),
        vec![2.0, 4.0]
    );
    assert_eq!(pg.all_gather(vec![1u8]).wait().unwrap(), vec![1]);
    assert!(pg.send(vec![1u8], 0).wait().is_err());
}

/// CUDA devices usable here, or `None` when the CUDA driver library cannot be loaded.
#[cfg(feature = "nccl")]
fn cuda_devices() -> Option<usize> {
    let count =
        std::panic::catch_unwind(fsdp_comm::nccl::cudarc::driver::CudaContext::device_count)
            .ok()?
            .ok()?;
    Some(count.max(0) as usize)
}

#[cfg(feature = "nccl")]
fn nccl_collectives() -> Result<(), String> {
    use fsdp_comm::nccl::NcclGroup;
    let pg = group()?;
    let (rank, n) = (pg.rank(), pg.size());
    let e = |e: fsdp_comm::CommError| e.to_string();
    let ctx =
        fsdp_comm::nccl::cudarc::driver::CudaContext::new(rank).map_err(|e| format!("{e:?}"))?;
    let stream = ctx.default_stream();
    let nccl = NcclGroup::new(&pg, stream.clone()).map_err(e)?;
    let len = 1 << 20;
    let host: Vec<f32> = (0..len).map(|i| (rank * 3 + i % 7) as f32).collect();
    let mut buf = stream.clone_htod(&host).map_err(|e| format!("{e:?}"))?;
    nccl.all_reduce(&mut buf, ReduceOp::Sum).map_err(e)?;
    let got = stream.clone_dtoh(&buf).map_err(|e| format!("{e:?}"))?;
    let want: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|r| (r * 3 + i % 7) as f32).sum())
        .collect();
    expect_eq("nccl all_reduce", &got, &want)?;
    let mut gathered = stream
        .alloc_zeros::<f32>(len * n)
        .map_err(|e| format!("{e:?}"))?;
    let input = stream.clone_htod(&host).map_err(|e| format!("{e:?}"))?;
    nccl.all_gather(&input, &mut gathered).map_err(e)?;
    let got = stream.clone_dtoh(&gathered).map_err(|e| format!("{e:?}"))?;
    let want: Vec<f32> = (0..n)
        .flat_map(|r| (0..len).map(move |i| (r * 3 + i % 7) as f32))
        .collect();
    expect_eq("nccl all_gather", &got, &want)?;
    let full: Vec<f32> = (0..len * n).map(|i| (rank + i % 5) as f32).collect();
    let input = stream.clone_htod(&full).map_err(|e| format!("{e:?}"))?;
    let mut part = stream
        .alloc_zeros::<f32>(len)
        .map_err(|e| format!("{e:?}"))?;
    nccl.reduce_scatter(&input, &mut part, ReduceOp::Sum)
        .map_err(e)?;
    let got = stream.clone_dtoh(&part).map_err(|e| format!("{e:?}"))?;
    let want: Vec<f32> = (rank * len..(rank + 1) * len)
        .map(|i| (0..n).map(|r| (r + i % 5) as f32).sum())
        .collect();
    expect_eq("nccl reduce_scatter", &got, &want)?;
    // The same group through the communicator trait, on typed device buffers.
    use fsdp_comm::nccl::CudaBuffer;
    use fsdp_comm::{Buffer, Communicator};
    let c: &dyn Communicator = &nccl;
    let slice = stream.clone_htod(&host).map_err(|e| format!("{e:?}"))?;
    let summed = c
        .all_reduce(
            Buffer::Cuda(CudaBuffer::F32(std::sync::Arc::new(slice))),
            ReduceOp::Sum,
        )
        .wait()
        .map_err(e)?;
    let Buffer::Cuda(CudaBuffer::F32(out)) = summed else {
        return Err("all_reduce gave another buffer type".into());
    };
    let got = stream.clone_dtoh(&*out).map_err(|e| format!("{e:?}"))?;
    let want: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|r| (r * 3 + i % 7) as f32).sum())
        .collect();
    expect_eq("nccl dyn all_reduce", &got, &want)?;
    let host_buffer = c
        .all_reduce(Buffer::from(vec![1.0f32]), ReduceOp::Sum)
        .wait();
    if host_buffer.is_ok() {
        return Err("an NCCL group took a host buffer".into());
    }
    // Not offered on NCCL yet: an error that names the op, not a wrong result.
    let slice = stream.clone_htod(&host).map_err(|e| format!("{e:?}"))?;
    match c
        .all_to_all(Buffer::Cuda(CudaBuffer::F32(std::sync::Arc::new(slice))))
        .wait()
    {
        Err(err) if err.to_string().contains("all_to_all") => {}
        other => return Err(format!("NCCL all_to_all: {:?}", other.map(|b| b.len()))),
    }
    Ok(())
}

/// NCCL needs one GPU per rank: runs on min(GPUs, 2) ranks; says so and passes without CUDA.
#[cfg(feature = "nccl")]
#[test]
fn nccl_collectives_on_gpus() {
    match cuda_devices() {
        None | Some(0) => skipped_gpu!("no CUDA driver or device on this machine"),
        Some(count) => assert_all_ok(&run_all(
            "nccl",
            count.min(2),
            vec![],
            Duration::from_secs(120),
        )),
    }
}
