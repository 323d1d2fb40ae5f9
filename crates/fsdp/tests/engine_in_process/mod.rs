//! The engine on the in-process communicator (threads as ranks): sharded training equals
//! single-process training, gradients and state are readable by parameter name and row
//! range, and parameters plus Adam state moved by name from a run on `a` ranks into an
//! engine on `b` ranks continue exactly like the uninterrupted run.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use fsdp::config::{
    AllGatherDtype, FsdpPlugin, Key, Layer, ReduceDtype, ShardingStrategy, Source, Value,
};
use fsdp::engine::Fsdp;
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Model, Module};
use fsdp::optim::{AdamW, AdamWConfig, Optimizer, ParamState};
use fsdp_comm::{Communicator, LocalGroup, Mesh};

mod quantized;
mod two_hops;

use crate::common::tiny::{GLOBAL_BATCH, batch, on_threads};

/// The tiny BERT classifier of `common::tiny`, without dropout.
fn model() -> BertForSequenceClassification {
    crate::common::tiny::model(0.0)
}

fn adamw() -> AdamW {
    AdamW::new(AdamWConfig {
        lr: 3e-3,
        ..Default::default()
    })
    .unwrap()
}

/// What one rank ends with: its loss per step, its rows of every parameter and of every
/// Adam buffer (by name, with the row range), and the full weights on rank 0.
struct RankResult {
    losses: Vec<f64>,
    params: BTreeMap<String, (Range<usize>, Vec<f32>)>,
    state: BTreeMap<String, (Range<usize>, ParamState)>,
    full: Option<BTreeMap<String, Tensor>>,
    /// Bytes sent inside the mesh's secondary group (hpZ's backward gathers).
    secondary_bytes: u64,
    /// Bytes sent in two-hop collectives (inside machines, across them).
    two_hop_bytes: (u64, u64),
    /// Bytes sent on the shard group itself.
    shard_bytes: u64,
}

/// Rows of every parameter, by name, as `(rows, values)` parts from several ranks.
type Parts = BTreeMap<String, Vec<(Range<usize>, Vec<f32>)>>;

/// Full parameter values and optimizer state by name, to start a run from.
type Resume = (BTreeMap<String, Vec<f32>>, BTreeMap<String, ParamState>);

/// Trains `steps` steps from `start` on `world` threads; `resume` gives the parameters and
/// Adam state to load first (full values by name, cut to each rank's rows).
fn run(world: usize, start: usize, steps: usize, resume: Option<Resume>) -> Vec<RankResult> {
    run_with(
        world,
        start,
        steps,
        resume,
        ShardingStrategy::FullShard,
        None,
        Compute::cpu(),
    )
}

/// Where a run computes, whether in debug mode (released parameters poisoned with NaN),
/// what parameters are gathered in, what gradients are reduced in, and the secondary
/// partition's size.
#[derive(Clone)]
struct Compute {
    device: Device,
    debug: bool,
    gather: AllGatherDtype,
    reduce: ReduceDtype,
    /// `fsdp_hpz_partition_size` (0: none).
    hpz: u64,
    /// Machines of this many consecutive ranks, with two-hop collectives across them.
    machines: Option<usize>,
}

impl Compute {
    fn cpu() -> Compute {
        Compute {
            device: Device::Cpu,
            debug: true,
            gather: AllGatherDtype::Auto,
            reduce: ReduceDtype::Fp32,
            hpz: 0,
            machines: None,
        }
    }
}

/// [`run`] under `strategy`; with `hybrid`, on a 2-D mesh of shard groups of that size;
/// computing as `compute` says (weights and batches moved there, shards in host memory).
fn run_with(
    world: usize,
    start: usize,
    steps: usize,
    resume: Option<Resume>,
    strategy: ShardingStrategy,
    hybrid: Option<usize>,
    compute: Compute,
) -> Vec<RankResult> {
    let resume = Arc::new(resume);
    let handles: Vec<_> = LocalGroup::create(world)
        .into_iter()
        .map(|group| {
            let (resume, compute) = (resume.clone(), compute.clone());
            std::thread::spawn(move || {
                let group: Arc<dyn Communicator> = Arc::new(group);
                let m = model();
                let init = LocalParams::init(&m.info(), 7, DType::F32, &Device::Cpu).unwrap();
                let on_device = |t: Tensor| t.to_device(&compute.device).unwrap();
                let initial: BTreeMap<String, Tensor> = init
                    .tensors()
                    .into_iter()
                    .map(|(name, t)| (name, on_device(t)))
                    .collect();
                // The launch layout hybrid sharding needs: machines of `hybrid` processes.
                let mut layout = Layer::new();
                if let Some(shard) = hybrid {
                    let n = |v: usize| Value::UInt(v as u64);
                    layout.set(Key::NumMachines, n(world / shard), Source::Code);
                    layout.set(Key::NumProcesses, n(world), Source::Code);
                    let ip = Value::Text("127.0.0.1".into());
                    layout.set(Key::MainProcessIp, ip, Source::Code);
                }
                let plugin = FsdpPlugin::builder()
                    .sharding_strategy(strategy)
                    .debug(compute.debug)
                    .all_gather_dtype(compute.gather)
                    .reduce_dtype(compute.reduce)
                    .hpz_partition_size(compute.hpz)
                    .resolve(&layout, None)
                    .unwrap()
                    .fsdp;
                let mesh = match (hybrid, compute.machines) {
                    (Some(shard), _) => Some(Mesh::hybrid(group.as_ref(), shard).unwrap()),
                    (None, Some(per_machine)) => Some(
                        Mesh::sharded(group.clone())
                            .with_machines(per_machine)
                            .unwrap(),
                    ),
                    (None, None) => None,
                };
                let mut engine = match mesh {
                    None => Fsdp::wrap(&m, &initial, &plugin, group.clone()).unwrap(),
                    Some(mesh) => {
                        Fsdp::with_mesh(&m.info(), &initial, &plugin, m.no_split_modules(), mesh)
                            .unwrap()
                    }
                };
                let mut opt = adamw();
                if let Some((params, state)) = resume.as_ref() {
                    for (name, full) in params {
                        let rows = engine.owned_rows(name).unwrap();
                        let width = full.len() / row_count(&init.tensors()[name]);
                        engine
                            .load_local_shard(name, &full[rows.start * width..rows.end * width])
                            .unwrap();
                        if let Some(s) = state.get(name) {
                            let cut = ParamState {
                                step: s.step,
                                buffers: s
                                    .buffers
                                    .iter()
                                    .map(|(k, v)| {
                                        (
                                            k.clone(),
                                            v[rows.start * width..rows.end * width].to_vec(),
                                        )
                                    })
                                    .collect(),
                            };
                            opt.set_state(name, cut).unwrap();
                        }
                    }
                }
                let (rank, n) = (group.rank(), group.size());
                let per_rank = GLOBAL_BATCH / n;
                let mut losses = Vec::new();
                for step in start..start + steps {
                    let (ids, labels) = batch(step);
                    let ids = on_device(ids.narrow(0, rank * per_rank, per_rank).unwrap());
                    let labels = on_device(labels.narrow(0, rank * per_rank, per_rank).unwrap());
                    let params = engine.begin_step().unwrap();
                    let logits = m.forward(&params, &ids, None, None).unwrap();
                    let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
                    losses.push(loss.to_scalar::<f32>().unwrap() as f64);
                    engine.backward(params, loss, true).unwrap();
                    let grads = engine.gradients().unwrap();
                    // Gradients by name: this rank's rows, as many as it owns.
                    for name in grads.names() {
                        let rows = engine.owned_rows(name).unwrap();
                        let width =
                            init.tensors()[name].elem_count() / row_count(&init.tensors()[name]);
                        assert_eq!(grads.get(name).unwrap().len(), rows.len() * width, "{name}");
                    }
                    engine.step(&mut opt).unwrap();
                }
                let params = engine
                    .local_shards()
                    .unwrap()
                    .into_iter()
                    .map(|s| (s.name.to_string(), (s.rows.clone(), s.values.to_vec())))
                    .collect::<BTreeMap<_, _>>();
                let state = params
                    .iter()
                    .filter_map(|(name, (rows, _))| {
                        opt.state(name)
                            .map(|s| (name.clone(), (rows.clone(), s.clone())))
                    })
                    .collect();
                let full = engine.full_state_dict().unwrap();
                RankResult {
                    losses,
                    params,
                    state,
                    full,
                    secondary_bytes: engine.mesh().secondary_bytes_sent(),
                    two_hop_bytes: engine.mesh().two_hop_bytes_sent(),
                    shard_bytes: engine.mesh().bytes_sent().0,
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn row_count(t: &Tensor) -> usize {
    t.dims().first().copied().unwrap_or(1)
}

/// Full values by name, put together from every rank's rows.
fn assemble(parts: Parts, shapes: &BTreeMap<String, Vec<usize>>) -> BTreeMap<String, Vec<f32>> {
    parts
        .into_iter()
        .map(|(name, pieces)| {
            let shape = &shapes[&name];
            let width: usize = shape.iter().skip(1).product();
            let mut full = vec![f32::NAN; shape.iter().product()];
            for (rows, values) in pieces {
                full[rows.start * width..rows.end * width].copy_from_slice(&values);
            }
            assert!(full.iter().all(|x| !x.is_nan()), "{name}: rows missing");
            (name, full)
        })
        .collect()
}

fn shapes() -> BTreeMap<String, Vec<usize>> {
    model()
        .info()
        .all_params()
        .into_iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect()
}

/// Mean loss over ranks per step.
fn losses(results: &[RankResult]) -> Vec<f64> {
    let n = results.len() as f64;
    (0..results[0].losses.len())
        .map(|s| results.iter().map(|r| r.losses[s]).sum::<f64>() / n)
        .collect()
}

/// Weights compared: all but the attention key bias, whose true gradient is zero (softmax
/// is invariant to it), so Adam turns rounding noise of either sign into full steps there
/// (see `fsdp_matrix.rs`); it is bounded separately.
fn close(name: &str, got: &[f32], want: &[f32], steps: usize) -> bool {
    if name.ends_with("attention.self.key.bias") {
        let bound = 3.2 * 3e-3 * steps as f32;
        return got.iter().zip(want).all(|(a, b)| (a - b).abs() <= bound);
    }
    max_rel(got, want) < 1e-5
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs() as f64)).max(1e-12);
    a.iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64 / scale))
}

#[test]
fn threads_as_ranks_match_one_rank_and_state_moves_between_world_sizes() {
    let shapes = shapes();
    let one = run(1, 0, 6, None);
    for world in [2, 3, 4] {
        let many = run(world, 0, 6, None);
        for (a, b) in losses(&many).iter().zip(losses(&one)) {
            assert!((a - b).abs() / b < 1e-5, "{world} ranks: loss {a} vs {b}");
        }
        // Rows by name put together equal the full state gathered to rank 0.
        let mut parts: Parts = BTreeMap::new();
        for r in &many {
            for (name, (rows, v)) in &r.params {
                parts
                    .entry(name.clone())
                    .or_default()
                    .push((rows.clone(), v.clone()));
            }
        }
        let assembled = assemble(parts, &shapes);
        let full = many[0].full.as_ref().unwrap();
        assert!(many[1..].iter().all(|r| r.full.is_none()));
        for (name, values) in &assembled {
            let got: Vec<f32> = full[name].flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(&got, values, "{name}");
            let single: Vec<f32> = one[0].full.as_ref().unwrap()[name]
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(close(name, values, &single, 6), "{world} ranks: {name}");
        }
    }

    // 3 steps on `a` ranks, state moved by name and rows to `b` ranks, 3 more steps: equals
    // 6 steps on `a` ranks.
    for (a, b) in [(2, 3), (3, 1), (4, 2)] {
        let straight = run(a, 0, 6, None);
        let first = run(a, 0, 3, None);
        let mut param_parts: Parts = BTreeMap::new();
        let mut state_parts: BTreeMap<String, Vec<(Range<usize>, ParamState)>> = BTreeMap::new();
        for r in &first {
            for (name, (rows, v)) in &r.params {
                param_parts
                    .entry(name.clone())
                    .or_default()
                    .push((rows.clone(), v.clone()));
            }
            for (name, (rows, s)) in &r.state {
                state_parts
                    .entry(name.clone())
                    .or_default()
                    .push((rows.clone(), s.clone()));
            }
        }
        let params = assemble(param_parts, &shapes);
        let mut state = BTreeMap::new();
        for (name, pieces) in state_parts {
            let step = pieces[0].1.step;
            let mut buffers = BTreeMap::new();
            for key in ["exp_avg", "exp_avg_sq"] {
                let mut parts: Parts = BTreeMap::new();
                for (rows, s) in &pieces {
                    parts
                        .entry(name.clone())
                        .or_default()
                        .push((rows.clone(), s.buffers[key].clone()));
                }
                buffers.insert(
                    key.to_string(),
                    assemble(parts, &shapes).remove(&name).unwrap(),
                );
            }
            state.insert(name, ParamState { step, buffers });
        }
        let resumed = run(b, 3, 3, Some((params, state)));
        let want = losses(&straight);
        for (i, got) in losses(&resumed).iter().enumerate() {
            let w = want[3 + i];
            assert!(
                (got - w).abs() / w < 1e-5,
                "{a} -> {b} ranks, step {}: {got} vs {w}",
                4 + i
            );
        }
        let (got, want) = (
            resumed[0].full.as_ref().unwrap(),
            straight[0].full.as_ref().unwrap(),
        );
        for (name, t) in want {
            let w: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let g: Vec<f32> = got[name].flatten_all().unwrap().to_vec1().unwrap();
            assert!(close(name, &g, &w, 6), "{a} -> {b} ranks: {name}");
        }
    }
}

/// The engine computing on a GPU through the host-staged plane (collectives in host memory;
/// 1 and 2 threads sharing one GPU; debug mode's NaN-poisoned releases and plain ones)
/// trains as on the CPU: losses, every rank's rows and rank 0's full weights within 1e-5
/// over 6 steps, f32. Skips without a usable GPU, fails under `FSDP_REQUIRE_GPU=1`.
#[test]
fn training_on_a_gpu_matches_the_cpu() {
    let gpu = match fsdp::nn::device::cuda(0) {
        Ok(gpu) => gpu,
        Err(e) => return skipped_gpu!("{e}"),
    };
    let fsdp = ShardingStrategy::FullShard;
    for (world, debug) in [(1, true), (2, false), (2, true)] {
        let want = run(world, 0, 6, None);
        let on_gpu = Compute {
            device: gpu.clone(),
            debug,
            ..Compute::cpu()
        };
        let got = run_with(world, 0, 6, None, fsdp, None, on_gpu);
        let what = format!("{world} rank(s) on a GPU, debug {debug}");
        for (g, w) in losses(&got).iter().zip(losses(&want)) {
            assert!((g - w).abs() / w < 1e-5, "{what}: loss {g} vs {w}");
        }
        for (g, w) in got.iter().zip(&want) {
            for (name, (rows, values)) in &g.params {
                assert_eq!(rows, &w.params[name].0, "{what}: {name}");
                assert!(close(name, values, &w.params[name].1, 6), "{what}: {name}");
            }
        }
        let full = got[0].full.as_ref().unwrap();
        for (name, w) in want[0].full.as_ref().unwrap() {
            assert!(full[name].device().is_cuda(), "{what}: {name} left the GPU");
            let g: Vec<f32> = full[name].flatten_all().unwrap().to_vec1().unwrap();
            let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
            assert!(close(name, &g, &w, 6), "{what}: full {name}");
        }
    }
}

#[test]
fn hybrid_sharding_on_threads_matches_one_rank() {
    const STEPS: usize = 8;
    let one = run(1, 0, STEPS, None);
    let want = one[0].full.as_ref().unwrap();
    for strategy in [
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        // 2 machines of 2, 2 of 1 and 4 of 1 (replication only).
        for (world, shard) in [(4, 2), (2, 1), (4, 1)] {
            let got = run_with(world, 0, STEPS, None, strategy, Some(shard), Compute::cpu());
            let what = format!("{strategy} on {world} ranks in shard groups of {shard}");
            for (g, w) in losses(&got).iter().zip(&losses(&one)) {
                assert!((g - w).abs() / w.abs() < 1e-5, "{what}: loss {g} vs {w}");
            }
            let full = got[0].full.as_ref().unwrap();
            for (name, w) in want {
                let g: Vec<f32> = full[name].flatten_all().unwrap().to_vec1().unwrap();
                let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
                assert!(close(name, &g, &w, STEPS), "{what}: {name} differs");
            }
            // Replicas hold the same rows.
            for (i, r) in got.iter().enumerate().skip(shard) {
                let twin = &got[i % shard];
                for (name, (rows, values)) in &r.params {
                    assert_eq!(&twin.params[name].0, rows, "{what}: {name}");
                    assert!(
                        max_rel(values, &twin.params[name].1) == 0.0,
                        "{what}: {name} drifted"
                    );
                }
            }
        }
    }
}

/// Losses and rank 0's final weights of `steps` FULL_SHARD steps on 2 threads, BERT with
/// dropout (masks from a seed per step and rank), with or without activation checkpointing.
fn dropout_run(checkpointing: bool, steps: usize) -> (Vec<f64>, BTreeMap<String, Tensor>) {
    let handles: Vec<_> = LocalGroup::create(2)
        .into_iter()
        .map(|group| {
            std::thread::spawn(move || {
                let group: Arc<dyn Communicator> = Arc::new(group);
                let mut m = BertForSequenceClassification::new(BertConfig {
                    hidden_dropout_prob: 0.2,
                    attention_probs_dropout_prob: 0.2,
                    ..model().bert.config.clone()
                })
                .unwrap();
                let init = LocalParams::init(&m.info(), 7, DType::F32, &Device::Cpu).unwrap();
                let plugin = FsdpPlugin::builder()
                    .activation_checkpointing(checkpointing)
                    .debug(true)
                    .resolve(&Layer::new(), None)
                    .unwrap()
                    .fsdp;
                let mut engine = Fsdp::wrap(&m, &init.tensors(), &plugin, group.clone()).unwrap();
                let mut opt = adamw();
                let (rank, per_rank) = (group.rank(), GLOBAL_BATCH / 2);
                let mut losses = Vec::new();
                for step in 0..steps {
                    m.bert.dropout_seed = Some(1000 * step as u64 + rank as u64);
                    let (ids, labels) = batch(step);
                    let ids = ids.narrow(0, rank * per_rank, per_rank).unwrap();
                    let labels = labels.narrow(0, rank * per_rank, per_rank).unwrap();
                    let params = engine.begin_step().unwrap();
                    let logits = m.forward(&params, &ids, None, None).unwrap();
                    let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
                    losses.push(loss.to_scalar::<f32>().unwrap() as f64);
                    engine.backward(params, loss, true).unwrap();
                    engine.step(&mut opt).unwrap();
                }
                // Both BERT layers recomputed once per step with checkpointing, none without.
                let recomputed = if checkpointing { 2 * steps as u64 } else { 0 };
                assert_eq!(engine.recomputed_units(), recomputed);
                (losses, engine.full_state_dict().unwrap())
            })
        })
        .collect();
    let mut out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (losses, full) = out.remove(0);
    (losses, full.unwrap())
}

#[test]
fn activation_checkpointing_recomputes_with_the_same_dropout_masks() {
    let steps = 4;
    let (plain_losses, plain) = dropout_run(false, steps);
    let (ckpt_losses, ckpt) = dropout_run(true, steps);
    // Dropout is on: a different mask in the recomputation would change the gradients.
    for (g, w) in ckpt_losses.iter().zip(&plain_losses) {
        assert!((g - w).abs() <= 1e-6 * w.abs(), "loss {g} vs {w}");
    }
    for (name, w) in &plain {
        let g: Vec<f32> = ckpt[name].flatten_all().unwrap().to_vec1().unwrap();
        let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let d = max_rel(&g, &w);
        assert!(d < 1e-6, "{name} differs with checkpointing by {d:e}");
    }
}

/// An optimizer step without `max_grad_norm` runs no collective of its own but the one
/// number that agrees the gradients are finite (it used to all-reduce the gradient norm
/// every step and drop it), and none at all after the caller's own clip (a finite norm
/// proved them finite), besides the next forward's first gather, which it issues early; clipping multiplies by `min(1, max_norm / (norm + 1e-6))` in f32 as PyTorch's
/// `clip_grad_norm_` does: a norm exactly at the limit is still scaled.
#[test]
fn a_step_runs_no_collective_of_its_own_and_clips_as_pytorch_does() {
    let handles: Vec<_> = LocalGroup::create(2)
        .into_iter()
        .map(|group| {
            std::thread::spawn(move || {
                let group: Arc<dyn Communicator> = Arc::new(group);
                let m = model();
                let init = LocalParams::init(&m.info(), 7, DType::F32, &Device::Cpu).unwrap();
                let plugin = FsdpPlugin::builder()
                    .resolve(&Layer::new(), None)
                    .unwrap()
                    .fsdp;
                let mut engine = Fsdp::wrap(&m, &init.tensors(), &plugin, group.clone()).unwrap();
                let mut opt = adamw();
                let per_rank = GLOBAL_BATCH / 2;
                let grads_of = |engine: &mut Fsdp, step: usize| {
                    let (ids, labels) = batch(step);
                    let ids = ids.narrow(0, group.rank() * per_rank, per_rank).unwrap();
                    let labels = labels.narrow(0, group.rank() * per_rank, per_rank).unwrap();
                    let params = engine.begin_step().unwrap();
                    let logits = m.forward(&params, &ids, None, None).unwrap();
                    let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
                    engine.backward(params, loss, true).unwrap()
                };
                // A step's bytes, forward and backward (every unit gathered and reduced).
                let before = group.bytes_sent();
                grads_of(&mut engine, 0);
                let forward_backward = group.bytes_sent() - before;
                // The optimizer step issues the next forward's first gather, which that
                // forward then does not: together the same bytes and, of the step's own, one
                // f64 to the other rank: whether any rank's gradients hold a NaN or inf.
                let before = group.bytes_sent();
                engine.step(&mut opt).unwrap();
                grads_of(&mut engine, 2);
                assert_eq!(
                    group.bytes_sent() - before,
                    forward_backward + 8,
                    "the step sent bytes of its own"
                );
                engine.clip_grad_norm(None).unwrap();
                let before = group.bytes_sent();
                engine.step(&mut opt).unwrap();
                grads_of(&mut engine, 1);
                assert_eq!(
                    group.bytes_sent() - before,
                    forward_backward,
                    "a step after a clip sent bytes"
                );

                let (norm, clipped) = engine.clip_grad_norm(None).unwrap();
                assert!(norm > 0.0 && !clipped);
                let grads = engine.gradients().unwrap();
                let name = grads.names()[0].to_string();
                let unscaled = grads.get(&name).unwrap().to_vec();
                let (again, clipped) = engine.clip_grad_norm(Some(norm)).unwrap();
                assert_eq!(again, norm);
                assert!(clipped, "a norm at the limit is scaled, as in PyTorch");
                let coef = (norm as f32 / (norm as f32 + 1e-6)).min(1.0);
                let want: Vec<f32> = unscaled.iter().map(|g| g * coef).collect();
                let grads = engine.gradients().unwrap();
                assert_eq!(grads.get(&name).unwrap(), want.as_slice());
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn a_row_sparse_table_under_hybrid_sharding_is_refused_naming_it() {
    let errors: Vec<String> = on_threads(4, |group| {
        let mut m = model();
        let words = &mut m.bert.embeddings.word_embeddings;
        *words = words.clone().sparse(true);
        let init = LocalParams::init(&m.info(), 7, DType::F32, &Device::Cpu).unwrap();
        let mesh = Mesh::hybrid(group.as_ref(), 2).unwrap();
        let plugin = FsdpPlugin::builder()
            .resolve(&Layer::new(), None)
            .unwrap()
            .fsdp;
        let info = m.info();
        let made = Fsdp::with_mesh(&info, &init.tensors(), &plugin, m.no_split_modules(), mesh);
        made.err().map(|e| e.to_string()).unwrap_or_default()
    });
    for e in errors {
        assert!(
            e.contains("bert.embeddings.word_embeddings.weight") && e.contains("hybrid"),
            "{e}"
        );
    }
}

/// Ranks whose settings would issue different collectives (here rank 2 reduces gradients in
/// int8, the others in f32; then rank 1 alone gathers in two hops) are refused when the
/// engine is made, on every rank, naming the key, the rank's value and the ranks that differ
/// — not left to fail in a mismatch mid-step.
#[test]
fn ranks_with_different_collective_settings_are_refused_naming_the_key() {
    let make = |differs: fn(usize) -> (ReduceDtype, bool)| -> Vec<String> {
        on_threads(3, move |group| {
            let (reduce, hops) = differs(group.rank());
            let m = model();
            let init = LocalParams::init(&m.info(), 7, DType::F32, &Device::Cpu).unwrap();
            let plugin = FsdpPlugin::builder()
                .reduce_dtype(reduce)
                .hierarchical_collectives(hops)
                .resolve(&Layer::new(), None)
                .unwrap()
                .fsdp;
            let made = Fsdp::wrap(&m, &init.tensors(), &plugin, group);
            made.err().map(|e| e.to_string()).unwrap_or_default()
        })
    };
    let errors = make(|r| {
        (
            if r == 2 {
                ReduceDtype::Int8
            } else {
                ReduceDtype::Fp32
            },
            true,
        )
    });
    assert!(
        errors[0].contains("`fsdp_reduce_dtype: fp32` on rank 0 differs from rank(s) [2]"),
        "{errors:?}"
    );
    assert!(
        errors[2].contains("`fsdp_reduce_dtype: int8` on rank 2 differs from rank(s) [0, 1]"),
        "{errors:?}"
    );
    let errors = make(|r| (ReduceDtype::Fp32, r != 1));
    assert!(
        errors[1].contains(
            "`fsdp_hierarchical_collectives: false` on rank 1 differs from rank(s) [0, 2]"
        ),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .all(|e| e.contains("every process must run with the same FSDP settings")),
        "{errors:?}"
    );
    // The same settings everywhere make an engine.
    assert!(
        make(|_| (ReduceDtype::Int8, true))
            .iter()
            .all(String::is_empty)
    );
}
