//! transformers' `num_items_in_batch` under FSDP: a causal LM's loss summed over its label
//! tokens (`LlamaForCausalLM::forward_loss_sum`), the step's count summed over micro-batches
//! and ranks (`Accelerator::num_items_in_batch`) and `Accelerator::backward_sum` give the
//! weights of one process training on the whole global batch with the mean over its tokens —
//! on 2 processes, with 2 micro-batches, and both, when every sequence has its own padding —
//! while the per-micro-batch mean (`forward_loss` + `backward`) drifts away from it; and on 3
//! processes sharing each global batch of 8 unevenly (`DataLoader::split_batches`: 3, 3, 2),
//! and on 2 and 3 processes dealt each global batch by token count
//! (`DataLoader::balance_lengths`: shares of any size).
//! Real processes; SGD, whose step is proportional to the gradient.

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp::accelerator::Accelerator;
use fsdp::models::{LlamaConfig, LlamaForCausalLM, causal_lm_label_count};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{Sgd, SgdConfig};
use serde_json::json;

use crate::common;

const ROLE: &str = "FSDP_TOKEN_LOSS_WORKER";
const SEQUENCES: usize = 8;
const SEQ: usize = 12;
const VOCAB: u32 = 50;

fn config() -> LlamaConfig {
    LlamaConfig::from_value(&json!({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
    }))
    .unwrap()
}

/// Sequence `i` of step `step`: its ids, attention mask and labels (right padding with id 0,
/// labels -100 there); sequence `i` has 2 + (5 i + 3 step) mod 11 real tokens.
fn sequence(step: usize, i: usize) -> (Vec<u32>, Vec<u32>, Vec<i64>) {
    let real = 2 + (5 * i + 3 * step) % 11;
    let ids: Vec<u32> = (0..SEQ)
        .map(|t| match t < real {
            true => 1 + ((7 * i + 13 * t + 31 * step) as u32 % (VOCAB - 1)),
            false => 0,
        })
        .collect();
    let mask = (0..SEQ).map(|t| u32::from(t < real)).collect();
    let labels = (0..SEQ)
        .map(|t| if t < real { ids[t] as i64 } else { -100 })
        .collect();
    (ids, mask, labels)
}

/// Sequences `range` of step `step` as a batch: (ids, mask, labels).
fn batch(step: usize, range: std::ops::Range<usize>) -> (Tensor, Tensor, Tensor) {
    collate(&range.map(|i| (step, i)).collect::<Vec<_>>())
}

/// Sequences (step, index) as a batch: (ids, mask, labels).
fn collate(which: &[(usize, usize)]) -> (Tensor, Tensor, Tensor) {
    let n = which.len();
    let (mut ids, mut mask, mut labels) = (vec![], vec![], vec![]);
    for &(step, i) in which {
        let (a, b, c) = sequence(step, i);
        ids.extend(a);
        mask.extend(b);
        labels.extend(c);
    }
    let t = |v: Vec<u32>| Tensor::from_vec(v, (n, SEQ), &Device::Cpu).unwrap();
    (
        t(ids),
        t(mask),
        Tensor::from_vec(labels, (n, SEQ), &Device::Cpu).unwrap(),
    )
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn token_loss_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let accumulation: usize = std::env::var("TEST_ACCUMULATION").unwrap().parse().unwrap();
    let summed = std::env::var("TEST_LOSS").unwrap() == "sum";
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(accumulation)
        .build()
        .unwrap();
    let (world, rank) = (acc.num_processes(), acc.process_index());
    let model = LlamaForCausalLM::new(config()).unwrap();
    let init = LocalParams::init(&model.info(), 7, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    let mut model = acc.prepare_model(model, &init).unwrap();
    let sgd = Sgd::new(SgdConfig {
        lr: 0.5,
        ..Default::default()
    })
    .unwrap();
    let mut optimizer = acc.prepare_optimizer(sgd).unwrap();
    let micro = SEQUENCES / world / accumulation;
    // With TEST_SPLIT, every step's 8 sequences from a data loader splitting the global
    // batch over the ranks (in shares that may differ).
    let split = std::env::var("TEST_SPLIT").is_ok();
    let all: Vec<(usize, usize)> = (0..3)
        .flat_map(|step| (0..SEQUENCES).map(move |i| (step, i)))
        .collect();
    // With TEST_BALANCE, dealt by each sequence's real tokens.
    let lengths: Vec<usize> = all
        .iter()
        .map(|&(s, i)| sequence(s, i).1.iter().filter(|&&m| m == 1).count())
        .collect();
    let mut loader =
        fsdp::data::DataLoader::new(all, SEQUENCES, |x: &[(usize, usize)]| Ok(collate(x)))
            .split_batches(true);
    if std::env::var("TEST_BALANCE").is_ok() {
        loader = loader.balance_lengths(lengths).unwrap();
    }
    let mut loader = acc.prepare_data_loader(loader);
    let mut shares = Vec::new();
    for step in 0..3 {
        // Micro-batch m of rank r: sequences [(m world + r) micro, +micro).
        let batches: Vec<_> = match split {
            true => vec![loader.next_batch().unwrap().unwrap().batch],
            false => (0..accumulation)
                .map(|m| {
                    let first = (m * world + rank) * micro;
                    batch(step, first..first + micro)
                })
                .collect(),
        };
        shares.push(
            batches
                .iter()
                .map(|(ids, _, _)| ids.dim(0).unwrap())
                .sum::<usize>(),
        );
        let local: u64 = batches
            .iter()
            .map(|(_, _, labels)| causal_lm_label_count(labels).unwrap())
            .sum();
        let items = acc.num_items_in_batch(local).unwrap();
        for (ids, mask, labels) in &batches {
            if summed {
                let loss = model
                    .forward(|m, p| m.forward_loss_sum(p, ids, Some(mask), labels))
                    .unwrap();
                acc.backward_sum(&mut model, loss, items).unwrap();
            } else {
                let loss = model
                    .forward(|m, p| m.forward_loss(p, ids, Some(mask), labels))
                    .unwrap();
                acc.backward(&mut model, loss).unwrap();
            }
        }
        assert!(acc.optimizer_step(&mut model, &mut optimizer).unwrap());
    }
    let weights = common::full_weights(&acc, &model);
    acc.wait_for_everyone().unwrap();
    if acc.is_main_process() {
        println!("RESULT {}", json!({ "weights": weights, "shares": shares }));
    }
}

fn run(world: usize, accumulation: usize, loss: &str) -> BTreeMap<String, Vec<f32>> {
    run_with(world, accumulation, loss, &[])
}

fn run_with(
    world: usize,
    accumulation: usize,
    loss: &str,
    env: &[(&str, &str)],
) -> BTreeMap<String, Vec<f32>> {
    serde_json::from_value(run_result(world, accumulation, loss, env)["weights"].clone()).unwrap()
}

/// The worker's result: the weights, and rank 0's examples per step.
fn run_result(
    world: usize,
    accumulation: usize,
    loss: &str,
    env: &[(&str, &str)],
) -> serde_json::Value {
    let acc = accumulation.to_string();
    let mut env = env.to_vec();
    env.extend([("TEST_ACCUMULATION", acc.as_str()), ("TEST_LOSS", loss)]);
    let outputs = common::run_workers(
        "token_loss_worker",
        ROLE,
        world,
        &env,
        Duration::from_secs(120),
    );
    common::result_of(&outputs[0])
}

/// Largest |a - b| over the largest |b| of each tensor, over all tensors.
fn worst(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(name, x)| common::max_rel_diff(x, &b[name]))
        .fold(0.0, f64::max)
}

#[test]
fn the_token_count_of_the_whole_step_normalises_like_one_process() {
    // One process, the whole global batch at once: its mean is the mean over every token.
    let reference = run(1, 1, "mean");
    let initial = {
        let model = LlamaForCausalLM::new(config()).unwrap();
        LocalParams::init(&model.info(), 7, DType::F32, &Device::Cpu)
            .unwrap()
            .tensors()
            .into_iter()
            .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect::<BTreeMap<String, Vec<f32>>>()
    };
    let moved = worst(&reference, &initial);
    assert!(moved > 1e-2, "training moved the weights by only {moved}");
    for (world, accumulation) in [(2, 1), (1, 2), (2, 2)] {
        let got = run(world, accumulation, "sum");
        let d = worst(&got, &reference);
        eprintln!("{world} process(es) x {accumulation} micro-batch(es): max rel diff {d:.2e}");
        assert!(
            d < 1e-5,
            "{world} process(es) x {accumulation} micro-batch(es): {d}"
        );
    }
    // 3 processes, each global batch of 8 split 3, 3, 2 by the data loader.
    let d = worst(&run_with(3, 1, "sum", &[("TEST_SPLIT", "1")]), &reference);
    eprintln!("3 processes, split batches 3/3/2: max rel diff {d:.2e}");
    assert!(d < 1e-5, "3 processes with split batches: {d}");
    // 2 and 3 processes, each global batch dealt by token count: rank 0 takes other than its
    // equal share in some step, and the weights are the same.
    for world in [2, 3] {
        let r = run_result(
            world,
            1,
            "sum",
            &[("TEST_SPLIT", "1"), ("TEST_BALANCE", "1")],
        );
        let shares: Vec<usize> = serde_json::from_value(r["shares"].clone()).unwrap();
        assert!(
            shares.iter().any(|&s| s != SEQUENCES.div_ceil(world)),
            "{shares:?}"
        );
        let got: BTreeMap<String, Vec<f32>> = serde_json::from_value(r["weights"].clone()).unwrap();
        let d = worst(&got, &reference);
        eprintln!("{world} processes, batches dealt by length {shares:?}: max rel diff {d:.2e}");
        assert!(d < 1e-5, "{world} processes dealt by length: {d}");
    }
    // The mean per micro-batch weighs a short sequence's tokens more: another model.
    let per_batch = worst(&run(2, 2, "mean"), &reference);
    eprintln!(
        "per-micro-batch means: max rel diff {per_batch:.2e}; training moved the weights by {moved:.2e}"
    );
    assert!(
        per_batch > 1e-3,
        "per-micro-batch means differ by only {per_batch}"
    );
}
