//! Checkpoints across real processes over the real transport: a job that saved, and a new job
//! (of the same or another size) that loads and continues, equal the job that never stopped;
//! processes killed at any moment of a save leave the previous checkpoint loadable.

use std::process::Command;
use std::time::Duration;

use fsdp::config::{ShardingStrategy, StateDictType};
use fsdp_comm::{LocalJob, ProcessGroup};

use crate::common;

use crate::common::tiny::{OptimizerKind, Setup, Trainer, on_threads, pytorch_fixture_adamw};

const ROLE: &str = "FSDP_CHECKPOINT_WORKER";

fn setup(dropout: f64) -> Setup {
    Setup {
        strategy: ShardingStrategy::FullShard,
        state_dict_type: StateDictType::ShardedStateDict,
        optimizer: OptimizerKind::AdamW,
        dropout,
    }
}

fn run_state(step: u64) -> fsdp::checkpoint::RunState {
    fsdp::checkpoint::RunState {
        step,
        ..Default::default()
    }
}

/// The worker: `FSDP_CKPT_MODE` is `straight` (6 steps), `save` (3 steps, then save),
/// `save-async` (3 steps, an asynchronous save, 3 more steps while it is written, then wait),
/// `resume` (load, then to step 6), `save-loop` / `save-async-loop` (save again and again
/// until killed) or `async-disk-full` (see `an_async_save_on_a_full_disk_fails_on_every_rank_..`).
#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn checkpoint_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let mode = std::env::var("FSDP_CKPT_MODE").unwrap();
    let dir = std::path::PathBuf::from(std::env::var("FSDP_CKPT_DIR").unwrap());
    let dropout: f64 = std::env::var("FSDP_CKPT_DROPOUT").unwrap().parse().unwrap();
    let pg = std::sync::Arc::new(ProcessGroup::from_env().unwrap());
    let mut t = Trainer::new(pg.clone(), setup(dropout));
    let losses = match mode.as_str() {
        "straight" => t.train(0..6),
        "save" => {
            let l = t.train(0..3);
            t.save_state(&dir, &run_state(3)).unwrap();
            l
        }
        "save-async" => {
            let mut l = t.train(0..3);
            let pending = t.save_state_async(&dir, &run_state(3)).unwrap();
            assert!(pending.staged_bytes() > 0);
            l.extend(t.train(3..6));
            assert_eq!(pending.wait().unwrap(), dir);
            l
        }
        "resume" => {
            let run = t.load_state(&dir).unwrap();
            t.train(run.step as usize..6)
        }
        "save-async-loop" => {
            t.train(0..1);
            for n in 1.. {
                let pending = t.save_state_async(&dir, &run_state(n)).unwrap();
                t.train(n as usize..n as usize + 1);
                pending.wait().unwrap();
                println!("SAVED {n}");
            }
            unreachable!()
        }
        "async-disk-full" => return disk_full_worker(&pg, &mut t, &dir),
        "resume-accelerate" => {
            // The run's optimizer as the PyTorch script built it (rates and decays come
            // back from the checkpoint).
            t.optimizer = pytorch_fixture_adamw(&t.engine);
            let run = t.load_state(&dir).unwrap();
            assert_eq!(run.step, 3, "the optimizer's step count");
            t.train(3..6)
        }
        "save-loop" => {
            t.train(0..1);
            for n in 1.. {
                t.save_state(&dir, &run_state(n)).unwrap();
                println!("SAVED {n}");
            }
            unreachable!()
        }
        other => panic!("unknown mode {other}"),
    };
    t.print_result(pg.as_ref(), losses);
}

/// `async-disk-full`: a checkpoint at step 1, the disk filled, an asynchronous save at step 2
/// while a step trains; then the previous checkpoint loaded, the disk freed and a save again.
fn disk_full_worker(pg: &std::sync::Arc<ProcessGroup>, t: &mut Trainer, dir: &std::path::Path) {
    use std::io::Write;
    t.train(0..1);
    t.save_state(dir, &run_state(1)).unwrap();
    let filler = dir.parent().unwrap().join("filler");
    if pg.rank() == 0 {
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = vec![0u8; 1 << 16];
        while f.write_all(&block).and_then(|()| f.sync_all()).is_ok() {}
    }
    pg.barrier().wait().unwrap();
    let pending = t
        .save_state_async(dir, &run_state(2))
        .expect("the save begins: only its files need room");
    t.train(1..2);
    let error = pending
        .wait()
        .expect_err("nothing fits on a full disk")
        .to_string();
    let loaded = t.load_state(dir).unwrap().step;
    if pg.rank() == 0 {
        std::fs::remove_file(&filler).unwrap();
    }
    pg.barrier().wait().unwrap();
    let again = t.save_state_async(dir, &run_state(3)).unwrap().wait();
    let reloaded = t.load_state(dir).unwrap().step;
    println!(
        "RESULT {}",
        serde_json::json!({"error": error, "loaded": loaded, "again": again.is_ok(), "reloaded": reloaded})
    );
}

fn run(world: usize, mode: &str, dir: &std::path::Path, dropout: f64) -> serde_json::Value {
    let dropout = dropout.to_string();
    let outputs = common::run_workers(
        "checkpoint_worker",
        ROLE,
        world,
        &[
            ("FSDP_CKPT_MODE", mode),
            ("FSDP_CKPT_DIR", dir.to_str().unwrap()),
            ("FSDP_CKPT_DROPOUT", &dropout),
        ],
        Duration::from_secs(120),
    );
    common::result_of(&outputs[0])
}

#[test]
fn a_new_job_continues_from_the_checkpoint_at_the_same_or_another_size() {
    let tmp = tempfile::tempdir().unwrap();
    // Same size, dropout on: bitwise.
    let straight = run(2, "straight", tmp.path(), 0.1);
    let dir = tmp.path().join("same");
    run(2, "save", &dir, 0.1);
    let resumed = run(2, "resume", &dir, 0.1);
    assert_eq!(
        resumed["losses"].as_array().unwrap()[..],
        straight["losses"].as_array().unwrap()[3..]
    );
    assert_eq!(resumed["weights"], straight["weights"]);

    // 2 ranks saved, 3 continue (no dropout: masks depend on the rank).
    let straight = run(2, "straight", tmp.path(), 0.0);
    let dir = tmp.path().join("other");
    run(2, "save", &dir, 0.0);
    let resumed = run(3, "resume", &dir, 0.0);
    let losses = |v: &serde_json::Value| -> Vec<f64> {
        v["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    for (got, want) in losses(&resumed).iter().zip(&losses(&straight)[3..]) {
        assert!((got - want).abs() / want < 1e-5, "{got} vs {want}");
    }
}

#[test]
fn a_save_killed_at_any_moment_leaves_a_loadable_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    for mode in ["save-loop", "save-async-loop"] {
        killed_saves_leave_a_loadable_checkpoint(&tmp.path().join(mode), mode);
    }
}

/// Kills a job of `mode` at eight moments of its saves to `dir`; each time the checkpoint
/// there must load.
fn killed_saves_leave_a_loadable_checkpoint(dir: &std::path::Path, mode: &str) {
    let dir = dir.to_path_buf();
    let mut saved_before = Vec::new();
    for trial in 0..8u64 {
        let job = LocalJob::start(2, 0..2, Some(1), |_| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args([
                "--exact",
                "checkpoint_processes::checkpoint_worker",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, "1")
            .env("FSDP_CKPT_MODE", mode)
            .env("FSDP_CKPT_DIR", &dir)
            .env("FSDP_CKPT_DROPOUT", "0");
            cmd
        })
        .unwrap();
        // Let it save for a while, then kill every process wherever it is.
        std::thread::sleep(Duration::from_millis(150 + trial * 37));
        drop(job);
        let loaded = {
            let dir = dir.clone();
            on_threads(2, move |g| {
                let mut t = Trainer::new(g, setup(0.0));
                if !dir.exists() {
                    return None;
                }
                Some(
                    t.load_state(&dir)
                        .map(|r| r.step)
                        .map_err(|e| e.to_string()),
                )
            })
        };
        match &loaded[0] {
            None => assert!(
                saved_before.is_empty(),
                "trial {trial}: the checkpoint vanished"
            ),
            Some(Err(e)) => {
                panic!("trial {trial}: the checkpoint left by a killed save does not load: {e}")
            }
            Some(Ok(step)) => saved_before.push(*step),
        }
    }
    eprintln!("{mode}: steps found after each kill: {saved_before:?}");
    assert!(
        !saved_before.is_empty(),
        "{mode}: no save completed in any trial"
    );
}

/// Every file under `dir` (relative path → bytes).
fn tree(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                todo.push(e.path());
            } else {
                let name = e.path().strip_prefix(dir).unwrap().display().to_string();
                files.insert(name, std::fs::read(e.path()).unwrap());
            }
        }
    }
    files
}

#[test]
fn an_async_save_lets_training_go_on_and_writes_what_a_synchronous_one_does() {
    let tmp = tempfile::tempdir().unwrap();
    let straight = run(2, "straight", tmp.path(), 0.1);
    let sync_dir = tmp.path().join("sync");
    run(2, "save", &sync_dir, 0.1);
    let async_dir = tmp.path().join("async");
    let trained = run(2, "save-async", &async_dir, 0.1);
    // Training while the files were written changed nothing.
    assert_eq!(trained["losses"], straight["losses"]);
    assert_eq!(trained["weights"], straight["weights"]);
    // The state as it was at the save, byte for byte what a synchronous save writes (and
    // nothing else: no report or staging file left).
    let (sync, written) = (tree(&sync_dir), tree(&async_dir));
    assert_eq!(
        sync.keys().collect::<Vec<_>>(),
        written.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &sync {
        assert!(written[name] == *bytes, "{name} differs");
    }
    let siblings: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(siblings.is_empty(), "staging left: {siblings:?}");
    let resumed = run(2, "resume", &async_dir, 0.1);
    assert_eq!(
        resumed["losses"].as_array().unwrap()[..],
        straight["losses"].as_array().unwrap()[3..]
    );
    assert_eq!(resumed["weights"], straight["weights"]);
}

#[test]
fn an_async_save_on_a_full_disk_fails_on_every_rank_and_keeps_the_previous_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(disk) = common::SmallDisk::mount(&tmp.path().join("disk"), "2m") else {
        skipped!("mounting a small tmpfs needs root");
        return;
    };
    let dir = disk.0.join("ckpt");
    let outputs = common::run_workers(
        "checkpoint_worker",
        ROLE,
        2,
        &[
            ("FSDP_CKPT_MODE", "async-disk-full"),
            ("FSDP_CKPT_DIR", dir.to_str().unwrap()),
            ("FSDP_CKPT_DROPOUT", "0"),
        ],
        Duration::from_secs(120),
    );
    for (rank, out) in outputs.iter().enumerate() {
        let r = common::result_of(out);
        let error = r["error"].as_str().unwrap();
        // The file that did not fit, in the save's staging folder, and why.
        assert!(
            error.contains(".ckpt.partial-") && error.contains("No space left on device"),
            "rank {rank}: {error}"
        );
        assert_eq!(r["loaded"], 1, "rank {rank}: the previous checkpoint");
        assert_eq!(r["again"], true, "rank {rank}: a save once there is room");
        assert_eq!(r["reloaded"], 3, "rank {rank}");
    }
}

/// What `tools/make_accelerate_resume_fixture.py` wrote: Accelerate's checkpoint after 3
/// steps, and PyTorch's losses and weights of the run that went on.
fn accelerate_fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/accelerate_resume")
}

#[test]
fn a_pytorch_accelerate_run_continues_here_from_its_checkpoint_at_any_world_size() {
    for version in ["fsdp1", "fsdp2"] {
        let fixture = accelerate_fixture().join(version);
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture.join("expected.json")).unwrap())
                .unwrap();
        let final_weights = candle_core::safetensors::load(
            fixture.join("final.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        for world in [2, 3] {
            let r = run(world, "resume-accelerate", &fixture.join("checkpoint"), 0.0);
            let got = r["losses"].as_array().unwrap();
            let want = &expected["losses"].as_array().unwrap()[3..];
            for (step, (g, w)) in got.iter().zip(want).enumerate() {
                let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
                assert!(
                    (g - w).abs() < 1e-6,
                    "{version}, {world} ranks, step {}: loss {g} here, {w} in PyTorch",
                    step + 4
                );
            }
            let mut worst = 0f32;
            for (name, values) in r["weights"].as_object().unwrap() {
                let want = final_weights[name]
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                for (g, w) in values.as_array().unwrap().iter().zip(&want) {
                    let d = (g.as_f64().unwrap() as f32 - w).abs();
                    worst = worst.max(d / w.abs().max(1.0));
                }
            }
            eprintln!("{version}, {world} ranks: final weights within {worst:e} of PyTorch's");
            assert!(
                worst < 1e-5,
                "{version}, {world} ranks: final weights differ by {worst}"
            );
        }
    }
}
