//! fp16 loss scaling over real processes: with a scale large enough to overflow, every rank
//! skips the same steps (weights and optimizer untouched), the scale backs off until the
//! gradients fit, grows again after clean steps, and training then proceeds; an overflow in
//! one rank's rows only makes every rank skip; the scale is saved in checkpoints and resumed.

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp::accelerator::{Accelerator, ModelHandle};
use fsdp::config::{FsdpPlugin, MixedPrecision};
use fsdp::data::LoaderPosition;
use fsdp::engine::{GradScaler, GradScalerConfig};
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{AdamW, AdamWConfig};

use crate::common;

const ROLE: &str = "FSDP_GRAD_SCALER_WORKER";
const STEPS: usize = 14;
/// Where the worker saves its checkpoint.
const CHECKPOINT_DIR: &str = "TEST_GRAD_SCALER_CHECKPOINT";

fn model() -> BertForSequenceClassification {
    BertForSequenceClassification::new(BertConfig {
        vocab_size: 37,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 24,
        max_position_embeddings: 8,
        num_labels: 3,
        ..BertConfig::default()
    })
    .unwrap()
}

fn batch(step: usize, rank: usize) -> (Tensor, Tensor) {
    let mut s = fsdp::rng::XorShift64::new(
        0x2545_F491_4F6C_DD1Du64 ^ ((step * 2 + rank) as u64 + 1).wrapping_mul(0x9E37_79B9),
    );
    let mut next = || s.next_u64();
    let ids: Vec<u32> = (0..4 * 6).map(|_| (next() % 37) as u32).collect();
    let labels: Vec<u32> = (0..4).map(|_| (next() % 3) as u32).collect();
    (
        Tensor::from_vec(ids, (4, 6), &Device::Cpu).unwrap(),
        Tensor::from_vec(labels, 4, &Device::Cpu).unwrap(),
    )
}

/// Sum of this rank's parameter rows: changes exactly when a step updates them.
fn checksum(engine: &fsdp::engine::Fsdp) -> f64 {
    engine
        .local_shards()
        .unwrap()
        .iter()
        .flat_map(|s| s.values.iter())
        .map(|x| *x as f64)
        .sum()
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn scaler_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    // 2^24 overflows fp16 gradients at once (65504 is fp16's largest value).
    let mut acc = Accelerator::builder()
        .fsdp_plugin(FsdpPlugin::builder().mixed_precision(MixedPrecision::Fp16))
        .grad_scaler(GradScalerConfig {
            init_scale: 16_777_216.0,
            growth_interval: 3,
            ..Default::default()
        })
        .build()
        .unwrap();
    let rank = acc.process_index();
    let m = model();
    let init = LocalParams::init(&m.info(), 3, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    let mut model = acc.prepare_model(m, &init).unwrap();
    let mut optimizer = acc
        .prepare_optimizer(
            AdamW::new(AdamWConfig {
                lr: 1e-2,
                ..Default::default()
            })
            .unwrap(),
        )
        .unwrap();
    let (mut skipped, mut scales, mut unchanged, mut losses) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (ids, labels) = batch(step, rank);
        let before = checksum(model.engine());
        let logits = model
            .forward(|m, p| m.forward(p, &ids, None, None))
            .unwrap();
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap() as f64);
        acc.backward(&mut model, loss).unwrap();
        acc.clip_grad_norm(&mut model, 1.0).unwrap();
        acc.optimizer_step(&mut model, &mut optimizer).unwrap();
        skipped.push(acc.optimizer_step_was_skipped());
        scales.push(model.grad_scaler().unwrap().scale());
        unchanged.push(checksum(model.engine()) == before);
    }
    // An overflow in rank 1's rows only: every rank finds it.
    // Straight through the engine, to reach the reduced gradients.
    let params = model.engine().begin_step().unwrap();
    let (ids, labels) = batch(99, rank);
    let m = model.module();
    let logits = m.forward(&params, &ids, None, None).unwrap();
    let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
    drop(logits);
    model.engine_mut().backward(params, loss, true).unwrap();
    if rank == 1 {
        let engine_grads = model.engine_mut().gradients_mut().unwrap();
        let name = engine_grads.names()[0].to_string();
        engine_grads.get_mut(&name).unwrap()[0] = f32::NAN;
    }
    let scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let injected = scaler.unscale(model.engine_mut()).unwrap();
    model.engine_mut().zero_grad();
    // The scale is part of the checkpoint: after the scaler is put back to where it
    // started, load_state brings the saved scale back.
    let dir = std::path::PathBuf::from(std::env::var(CHECKPOINT_DIR).unwrap());
    acc.save_state(
        Some(&dir),
        &[&model],
        &[&optimizer],
        LoaderPosition::default(),
    )
    .unwrap();
    let saved = model.grad_scaler().unwrap().state();
    model
        .grad_scaler_mut()
        .unwrap()
        .load_state((16_777_216.0, 0));
    acc.load_state(&dir, &mut [&mut model], &mut [&mut optimizer])
        .unwrap();
    let resumed = model.grad_scaler().unwrap().state();
    println!(
        "RESULT {}",
        serde_json::json!({
            "skipped": skipped, "scales": scales, "unchanged": unchanged,
            "losses": losses, "injected_overflow_found": injected,
            "saved_scale": saved.0,
            "resumed_scale": resumed.0,
        })
    );
}

#[test]
fn overflow_skips_the_step_on_every_rank_and_the_scale_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let outputs = common::run_workers(
        "scaler_worker",
        ROLE,
        2,
        &[(CHECKPOINT_DIR, ckpt.to_str().unwrap())],
        Duration::from_secs(120),
    );
    let results: Vec<serde_json::Value> = outputs.iter().map(|o| common::result_of(o)).collect();
    eprintln!("{}", results[0]);
    // The same decisions on both ranks.
    assert_eq!(results[0]["skipped"], results[1]["skipped"]);
    assert_eq!(results[0]["scales"], results[1]["scales"]);
    for r in &results {
        let skipped: Vec<bool> = serde_json::from_value(r["skipped"].clone()).unwrap();
        let scales: Vec<f64> = serde_json::from_value(r["scales"].clone()).unwrap();
        let unchanged: Vec<bool> = serde_json::from_value(r["unchanged"].clone()).unwrap();
        assert!(skipped[0], "2^24 must overflow: {r}");
        let first_taken = skipped.iter().position(|s| !s).expect("no step taken");
        // Skipped steps leave the weights alone and halve the scale; taken steps update.
        assert_eq!(skipped, unchanged, "{r}");
        assert_eq!(scales[0], 16_777_216.0 / 2.0);
        for i in 1..first_taken {
            assert_eq!(scales[i], scales[i - 1] / 2.0, "{r}");
        }
        // Three clean steps in a row, then the scale doubles.
        if !skipped[first_taken + 1] && !skipped[first_taken + 2] {
            assert_eq!(
                scales[first_taken + 2],
                2.0 * scales[first_taken + 1],
                "{r}"
            );
        }
        assert!(skipped.iter().filter(|s| !**s).count() >= 3, "{r}");
        let losses: Vec<f64> = serde_json::from_value(r["losses"].clone()).unwrap();
        assert!(losses.iter().all(|l| l.is_finite()), "{r}");
        assert_eq!(r["injected_overflow_found"], true, "{r}");
        assert_eq!(r["resumed_scale"], r["saved_scale"], "{r}");
        assert_ne!(r["resumed_scale"], 16_777_216.0, "{r}");
    }
}
