//! Offloading to disk (`fsdp_offload_dir`): training with parameter shards, gradients and
//! optimizer state in the disk tier (or only the optimizer state) equals training in memory
//! bit for bit — FULL_SHARD and SHARD_GRAD_OP on 1-3 ranks (threads as ranks), with
//! gradient accumulation and clipping — including a checkpoint saved, loaded into a fresh
//! offloaded engine and continued; the scratch folder is private and gone afterwards; a
//! folder that cannot be made is an error naming it.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use fsdp::checkpoint::RunState;
use fsdp::config::{FsdpPlugin, Layer, ShardingStrategy};
use fsdp::engine::{EngineError, Fsdp};
use fsdp::models::BertForSequenceClassification;
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Model, Module};
use fsdp::optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use fsdp_comm::{Communicator, LocalGroup};

use crate::common;

use crate::common::tiny::{GLOBAL_BATCH, batch};

fn model() -> BertForSequenceClassification {
    common::tiny::model(0.0)
}

/// Where state lives in a run.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Offload {
    None,
    /// Shards, gradients and optimizer state on disk.
    Params,
    /// Only the optimizer state on disk.
    Optimizer,
}

#[derive(Debug, Clone, Copy)]
struct Recipe {
    world: usize,
    strategy: ShardingStrategy,
    /// Micro-batches per optimizer step (each reduced, summed, scaled by 1/n).
    accumulation: usize,
    max_grad_norm: Option<f64>,
    sgd: bool,
    /// `fsdp_activation_checkpointing`.
    checkpointing: bool,
    /// The first layer's query projection frozen: the first parameter of its unit, so the
    /// unit's gradient block (trainable rows only) and its parameter block disagree on
    /// every later parameter's offset.
    frozen: bool,
}

/// Bits of every loss and of the final full weights.
type Outcome = (Vec<u32>, BTreeMap<String, Vec<u32>>);

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn plugin(r: Recipe, offload: Offload, dir: &Path) -> FsdpPlugin {
    let b = FsdpPlugin::builder()
        .sharding_strategy(r.strategy)
        .activation_checkpointing(r.checkpointing);
    let b = match offload {
        Offload::None => b,
        Offload::Params => b.offload_params(true).offload_dir(dir.to_str().unwrap()),
        Offload::Optimizer => b.offload_optimizer(true).offload_dir(dir.to_str().unwrap()),
    };
    b.resolve(&Layer::new(), None).unwrap().fsdp
}

fn optimizer(sgd: bool) -> Box<dyn Optimizer> {
    if sgd {
        Box::new(
            Sgd::new(SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 0.01,
                ..SgdConfig::default()
            })
            .unwrap(),
        )
    } else {
        Box::new(
            AdamW::new(AdamWConfig {
                lr: 3e-3,
                ..Default::default()
            })
            .unwrap(),
        )
    }
}

/// One optimizer step of `engine` on `rank`'s part of step `step`'s batches.
fn train_step(
    engine: &mut Fsdp,
    opt: &mut dyn Optimizer,
    m: &BertForSequenceClassification,
    r: Recipe,
    rank: usize,
    step: usize,
    losses: &mut Vec<u32>,
) {
    let per_rank = GLOBAL_BATCH / r.world;
    for micro in 0..r.accumulation {
        let (ids, labels) = batch(step * r.accumulation + micro);
        let ids = ids.narrow(0, rank * per_rank, per_rank).unwrap();
        let labels = labels.narrow(0, rank * per_rank, per_rank).unwrap();
        let params = engine.begin_step().unwrap();
        let logits = m.forward(&params, &ids, None, None).unwrap();
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap().to_bits());
        engine.backward(params, loss, true).unwrap();
    }
    if r.accumulation > 1 {
        let grads = engine.gradients_mut().unwrap();
        grads.scale(1.0 / r.accumulation as f32).unwrap();
    }
    if r.max_grad_norm.is_some() {
        engine.clip_grad_norm(r.max_grad_norm).unwrap();
    }
    engine.step(opt).unwrap();
}

/// Trains `steps` optimizer steps on threads as ranks; with `checkpoint`, saves after
/// `save_at` steps, builds a fresh engine and optimizer, loads and continues.
fn train(
    r: Recipe,
    offload: Offload,
    steps: usize,
    checkpoint: Option<(usize, PathBuf)>,
) -> Outcome {
    let scratch = tempdir("scratch");
    let handles: Vec<_> = LocalGroup::create(r.world)
        .into_iter()
        .map(|group| {
            let (scratch, checkpoint) = (scratch.clone(), checkpoint.clone());
            std::thread::spawn(move || {
                let group: Arc<dyn Communicator> = Arc::new(group);
                let rank = group.rank();
                let m = model();
                let init = LocalParams::init(&m.info(), 7, DType::F32, &Device::Cpu).unwrap();
                let plugin = plugin(r, offload, &scratch);
                let info = match r.frozen {
                    true => m
                        .info()
                        .freeze("bert.encoder.layer.0.attention.self.query."),
                    false => m.info(),
                };
                let new_engine = || {
                    let split = m.no_split_modules();
                    Fsdp::new(&info, &init.tensors(), &plugin, split, group.clone()).unwrap()
                };
                let mut engine = new_engine();
                let mut opt = optimizer(r.sgd);
                if offload != Offload::None {
                    let (dir, _) = engine.offload().expect("state is offloaded");
                    let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
                    assert_eq!(mode, 0o700, "{}", dir.display());
                }
                let mut losses = Vec::new();
                for step in 0..steps {
                    if let Some((at, dir)) = &checkpoint
                        && step == *at
                    {
                        fsdp::checkpoint::save_state(
                            dir,
                            &[&engine],
                            &[opt.as_ref()],
                            &RunState::default(),
                            &Default::default(),
                        )
                        .unwrap();
                        drop(engine);
                        engine = new_engine();
                        opt = optimizer(r.sgd);
                        fsdp::checkpoint::load_state(
                            dir,
                            &mut [&mut engine],
                            &mut [opt.as_mut()],
                            &Default::default(),
                        )
                        .unwrap();
                    }
                    train_step(&mut engine, opt.as_mut(), &m, r, rank, step, &mut losses);
                }
                if offload != Offload::None {
                    let (dir, stats) = engine.offload().unwrap();
                    assert!(stats.bytes_read > 0 && stats.bytes_written > 0, "{stats:?}");
                    for f in std::fs::read_dir(dir).unwrap() {
                        let mode = f.unwrap().metadata().unwrap().permissions().mode() & 0o777;
                        assert_eq!(mode, 0o600);
                    }
                }
                let full = engine.full_state_dict().unwrap();
                drop(engine);
                let weights = full
                    .map(|f| f.iter().map(|(k, t)| (k.clone(), bits(t))).collect())
                    .unwrap_or_default();
                (losses, weights)
            })
        })
        .collect();
    let results: Vec<Outcome> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let leftover: Vec<PathBuf> = std::fs::read_dir(&scratch)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(
        leftover.is_empty(),
        "scratch folders left behind: {leftover:?}"
    );
    let _ = std::fs::remove_dir_all(&scratch);
    // Every rank's losses in rank order, and rank 0's full weights.
    let losses = results.iter().flat_map(|(l, _)| l.clone()).collect();
    let weights = results
        .into_iter()
        .next()
        .map(|(_, w)| w)
        .unwrap_or_default();
    (losses, weights)
}

fn tempdir(what: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!(
        "fsdp-offload-test-{}-{what}-{n}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn recipe(world: usize, strategy: ShardingStrategy) -> Recipe {
    Recipe {
        world,
        strategy,
        accumulation: 1,
        max_grad_norm: None,
        sgd: false,
        checkpointing: false,
        frozen: false,
    }
}

fn assert_same(what: &str, got: &Outcome, want: &Outcome) {
    assert_eq!(got.0, want.0, "{what}: losses differ");
    assert_eq!(got.1.len(), want.1.len(), "{what}: parameter count");
    assert!(!want.1.is_empty(), "{what}: no weights");
    for (name, w) in &want.1 {
        assert!(got.1[name] == *w, "{what}: `{name}` differs");
    }
}

#[test]
fn offloaded_training_equals_training_in_memory_bit_for_bit() {
    for world in 1..=3 {
        for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
            let r = recipe(world, strategy);
            let memory = train(r, Offload::None, 3, None);
            let disk = train(r, Offload::Params, 3, None);
            assert_same(
                &format!("{world} ranks {strategy:?} offloaded"),
                &disk,
                &memory,
            );
        }
    }
    // NO_SHARD: whole parameters on disk, gradients all-reduced.
    let r = recipe(2, ShardingStrategy::NoShard);
    assert_same(
        "NO_SHARD",
        &train(r, Offload::Params, 3, None),
        &train(r, Offload::None, 3, None),
    );
    // Accumulation (sums of reduced blocks on disk), clipping (scaled on disk), and only the
    // optimizer state offloaded; SGD's momentum buffer as the state.
    let mut r = recipe(2, ShardingStrategy::FullShard);
    r.accumulation = 2;
    r.max_grad_norm = Some(0.05);
    let memory = train(r, Offload::None, 3, None);
    assert_same(
        "accumulation + clipping",
        &train(r, Offload::Params, 3, None),
        &memory,
    );
    assert_same(
        "optimizer offload",
        &train(r, Offload::Optimizer, 3, None),
        &memory,
    );
    r.sgd = true;
    let memory = train(r, Offload::None, 3, None);
    assert_same("SGD", &train(r, Offload::Params, 3, None), &memory);
    // Activation checkpointing: units recompute their forward from shards read again.
    let mut r = recipe(3, ShardingStrategy::FullShard);
    r.checkpointing = true;
    let memory = train(r, Offload::None, 3, None);
    assert_same(
        "checkpointing",
        &train(r, Offload::Params, 3, None),
        &memory,
    );
}

/// Trains `r` 4 steps with each kind of offload, saving at step 2 and resuming from the
/// checkpoint in a fresh engine: losses and weights equal the run kept in memory, bit for bit.
fn resumes_as_in_memory(r: Recipe, what: &str) {
    let memory = train(r, Offload::None, 4, None);
    for offload in [Offload::Params, Offload::Optimizer] {
        let dir = tempdir("checkpoint");
        let resumed = train(r, offload, 4, Some((2, dir.clone())));
        assert_same(&format!("{what} {offload:?}, resumed"), &resumed, &memory);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn offloaded_state_saves_loads_and_continues_bit_for_bit() {
    for (world, strategy) in [
        (2, ShardingStrategy::FullShard),
        (3, ShardingStrategy::ShardGradOp),
    ] {
        resumes_as_in_memory(recipe(world, strategy), &format!("{world} ranks"));
    }
}

/// Optimizer state on disk is laid out like the unit's parameter block, gradients like its
/// trainable rows: with a frozen weight first in a unit the two differ, and a checkpoint
/// must read each parameter's state from where the step wrote it.
#[test]
fn offloaded_state_of_a_unit_with_a_frozen_weight_saves_and_resumes_bit_for_bit() {
    let mut r = recipe(2, ShardingStrategy::FullShard);
    r.frozen = true;
    resumes_as_in_memory(r, "with a frozen weight,");
}

#[test]
fn an_offload_folder_that_cannot_be_made_is_an_error_naming_it() {
    let file = tempdir("file");
    std::fs::write(&file, b"not a folder").unwrap();
    let bad = file.join("scratch");
    let m = model();
    let init = LocalParams::init(&m.info(), 7, DType::F32, &Device::Cpu).unwrap();
    let plugin = plugin(
        recipe(1, ShardingStrategy::FullShard),
        Offload::Params,
        &bad,
    );
    let group: Arc<dyn Communicator> = Arc::new(LocalGroup::create(1).pop().unwrap());
    let err = match Fsdp::wrap(&m, &init.tensors(), &plugin, group) {
        Ok(_) => panic!("an offload folder inside a file was accepted"),
        Err(e) => e,
    };
    assert!(matches!(err, EngineError::Offload(_)), "{err:?}");
    assert!(
        err.to_string().contains(&bad.display().to_string()),
        "{err}"
    );
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn the_accelerator_reduces_every_micro_batch_when_parameters_are_on_disk() {
    // Without sync, the micro-batches before the last keep whole local gradients: what an
    // offloaded model cannot hold. Offloaded, each micro-batch is reduced to this rank's rows
    // (on disk) instead; in memory, Accelerate's default stays.
    let scratch = tempdir("accelerator");
    for offload in [Offload::None, Offload::Params] {
        let plugin = {
            let b = FsdpPlugin::builder();
            match offload {
                Offload::Params => b
                    .offload_params(true)
                    .offload_dir(scratch.to_str().unwrap()),
                _ => b,
            }
        };
        let mut acc = fsdp::accelerator::Accelerator::builder()
            .fsdp_plugin(plugin)
            .gradient_accumulation_steps(2)
            .build()
            .unwrap();
        let m = model();
        let w = LocalParams::init(&m.info(), 1, DType::F32, &Device::Cpu)
            .unwrap()
            .tensors();
        let mut model = acc.prepare_model(m, &w).unwrap();
        let adamw = AdamW::new(AdamWConfig::default()).unwrap();
        let mut opt = acc.prepare_optimizer(adamw).unwrap();
        for step in 0..2 {
            let (ids, labels) = batch(step);
            let logits = model
                .forward(|m, p| m.forward(p, &ids, None, None))
                .unwrap();
            let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
            acc.backward(&mut model, loss).unwrap();
            if step == 0 {
                let kept = model.engine().unreduced_bytes();
                match offload {
                    Offload::None => assert!(kept > 0, "no_sync keeps whole gradients"),
                    _ => assert_eq!(kept, 0, "offloaded: nothing kept whole"),
                }
            }
        }
        acc.optimizer_step(&mut model, &mut opt).unwrap();
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
