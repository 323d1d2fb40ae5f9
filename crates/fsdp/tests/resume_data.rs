//! A job resumed from a checkpoint on another number of processes continues the data exactly
//! (issue 20, item 10): 96 examples, 8 per process, 2 epochs; a job of 2 processes saves at
//! step 8 (2 steps into epoch 1), and jobs of 3 and of 1 process resume from it and take
//! each of epoch 1's remaining 64 samples once, in the permutation's order, with the step
//! total counted in their own global batch. Real processes through the `Accelerator`; the
//! test binary re-runs itself as the workers. Their logs, written to pipes, carry no colour
//! codes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp::accelerator::Accelerator;
use fsdp::data::{CollateError, DataLoader, permutation};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{AdamW, AdamWConfig};
use serde_json::{Value, json};

use crate::common;

const ROLE: &str = "FSDP_RESUME_DATA_WORKER";
const DIR: &str = "TEST_RESUME_DIR";
const PHASE: &str = "TEST_RESUME_PHASE";
const EXAMPLES: usize = 96;
const PER_RANK: usize = 8;
const EPOCHS: u64 = 2;
const SEED: u64 = 42;
const SAVE_AT: u64 = 8;

type Batch = (Tensor, Tensor);

fn collate(indices: &[usize]) -> Result<Batch, CollateError> {
    let ids: Vec<u32> = indices
        .iter()
        .flat_map(|&i| (0..5).map(move |j| ((i * 7 + j * 3) % 37) as u32))
        .collect();
    let labels: Vec<u32> = indices.iter().map(|&i| (i % 3) as u32).collect();
    Ok((
        Tensor::from_vec(ids, (indices.len(), 5), &Device::Cpu)?,
        Tensor::from_vec(labels, indices.len(), &Device::Cpu)?,
    ))
}

/// Trains (phase `save`: until step SAVE_AT, then saves; `resume`: from the checkpoint to
/// the end) and reports every step's epoch, this rank's indices and the real count.
fn train(acc: &mut Accelerator, dir: &Path, resume: bool) -> Value {
    let model = common::tiny::model(0.0);
    let init = LocalParams::init(&model.info(), 7, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    let mut model = acc.prepare_model(model, &init).unwrap();
    let mut opt = acc
        .prepare_optimizer(AdamW::new(AdamWConfig::default()).unwrap())
        .unwrap();
    let data: Vec<usize> = (0..EXAMPLES).collect();
    let mut loader =
        acc.prepare_data_loader(DataLoader::new(data, PER_RANK, collate).shuffle(SEED));
    let per_epoch = loader.steps_per_epoch() as u64;
    let mut total = per_epoch * EPOCHS;
    if resume {
        let position = acc
            .load_state(dir, &mut [&mut model], &mut [&mut opt])
            .unwrap();
        loader.set_position(position);
        total = acc.step()
            + loader.steps_left_in_epoch() as u64
            + (EPOCHS - position.epoch - 1) * per_epoch;
    }
    let mut steps = Vec::new();
    let first = loader.position().epoch;
    'epochs: for epoch in first..EPOCHS {
        if loader.position().epoch != epoch {
            loader.set_epoch(epoch);
        }
        while let Some(batch) = loader.next_batch() {
            let batch = batch.unwrap();
            let (ids, labels) = &batch.batch;
            let logits = model.forward(|m, p| m.forward(p, ids, None, None)).unwrap();
            let loss = cross_entropy(&logits, labels, CrossEntropy::default()).unwrap();
            acc.backward(&mut model, loss).unwrap();
            acc.optimizer_step(&mut model, &mut opt).unwrap();
            steps.push(json!([epoch, batch.indices, batch.real]));
            if !resume && acc.step() == SAVE_AT {
                acc.save_state(Some(dir), &[&model], &[&opt], loader.position())
                    .unwrap();
                break 'epochs;
            }
            if acc.step() >= total {
                break 'epochs;
            }
        }
    }
    json!({ "rank": acc.process_index(), "steps": steps, "total": total })
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn resume_data_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let resume = std::env::var(PHASE).unwrap() == "resume";
    let mut acc = Accelerator::builder().build().unwrap();
    let result = train(&mut acc, &dir, resume);
    acc.wait_for_everyone().unwrap();
    println!("RESULT {result}");
}

/// The samples of `epoch` the job took, in order, without the repeats that fill up the
/// last step: every rank's indices of a step in rank order, cut to the step's real count.
fn taken(outputs: &[String], epoch: u64) -> (Vec<usize>, u64) {
    let results: Vec<Value> = outputs.iter().map(|o| common::result_of(o)).collect();
    let steps = results[0]["steps"].as_array().unwrap().len();
    let mut out = Vec::new();
    for s in 0..steps {
        let at = |r: &Value| r["steps"][s].clone();
        if at(&results[0])[0] != epoch {
            continue;
        }
        let mut all: Vec<usize> = Vec::new();
        for r in &results {
            let step = at(r);
            all.extend(
                step[1]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|i| i.as_u64().unwrap() as usize),
            );
        }
        let real = at(&results[0])[2].as_u64().unwrap() as usize;
        out.extend(&all[..real]);
    }
    (out, results[0]["total"].as_u64().unwrap())
}

#[test]
fn a_resume_on_another_number_of_processes_continues_at_the_next_unseen_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("step_8");
    let d = dir.to_str().unwrap();
    let run = |world: usize, phase: &str| {
        common::run_workers(
            "resume_data_worker",
            ROLE,
            world,
            &[(DIR, d), (PHASE, phase)],
            Duration::from_secs(120),
        )
    };
    let saved = run(2, "save");
    // Logs through pipes carry no colour codes (issue 20, item 16).
    assert!(
        saved[0].contains("saved the training state"),
        "{}",
        saved[0]
    );
    assert!(
        !saved.concat().contains('\x1b'),
        "colour codes in a pipe: {saved:?}"
    );
    let (before, _) = taken(&saved, 1);
    let order = permutation(EXAMPLES, SEED, 1);
    assert_eq!(before, order[..32], "2 steps of 16 into epoch 1");
    for world in [3, 1] {
        let resumed = run(world, "resume");
        let (after, total) = taken(&resumed, 1);
        assert_eq!(
            after,
            order[32..],
            "{world} process(es): epoch 1's remaining samples, each once"
        );
        let g = PER_RANK * world;
        assert_eq!(
            total,
            SAVE_AT + (EXAMPLES - 32).div_ceil(g) as u64,
            "{world}"
        );
    }
}
