//! Checkpoints across real processes over the real transport: a job that saved, and a new job
//! (of the same or another size) that loads and continues, equal the job that never stopped;
//! processes killed at any moment of a save leave the previous checkpoint loadable.

use std::process::Command;
use std::time::Duration;

use fsdp::config::{ShardingStrategy, StateDictType};
use fsdp_comm::{CommunicatorExt, LocalJob, ProcessGroup, ReduceOp};

mod common;

use common::tiny::{OptimizerKind, Setup, Trainer, on_threads};

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
/// `resume` (load, then to step 6) or `save-loop` (save again and again until killed).
#[test]
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
            t.engine
                .save_state(&dir, t.optimizer.as_ref(), &run_state(3))
                .unwrap();
            l
        }
        "resume" => {
            let run = t.engine.load_state(&dir, t.optimizer.as_mut()).unwrap();
            t.train(run.step as usize..6)
        }
        "save-loop" => {
            t.train(0..1);
            for n in 1.. {
                t.engine
                    .save_state(&dir, t.optimizer.as_ref(), &run_state(n))
                    .unwrap();
                println!("SAVED {n}");
            }
            unreachable!()
        }
        other => panic!("unknown mode {other}"),
    };
    let mean: Vec<f32> = losses
        .into_iter()
        .map(|l| pg.all_reduce_vec(vec![l], ReduceOp::Avg).wait().unwrap()[0])
        .collect();
    if let Some(w) = t.weights() {
        println!(
            "RESULT {}",
            serde_json::json!({"losses": mean, "weights": w})
        );
    }
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
    let dir = tmp.path().join("ckpt");
    let mut saved_before = Vec::new();
    for trial in 0..8u64 {
        let job = LocalJob::start(2, 0..2, Some(1), |_| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args([
                "--exact",
                "checkpoint_worker",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, "1")
            .env("FSDP_CKPT_MODE", "save-loop")
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
                    t.engine
                        .load_state(&dir, t.optimizer.as_mut())
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
    eprintln!("steps found after each kill: {saved_before:?}");
    assert!(!saved_before.is_empty(), "no save completed in any trial");
}
