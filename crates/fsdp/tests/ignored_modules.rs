//! Ignored modules (`fsdp_ignored_modules`): their parameters stay whole on every rank and
//! their gradients are averaged over every rank — also for a parameter read inside two
//! checkpointed units (whose gradients come from the recomputations) and outside them, and
//! on a hybrid mesh — equal to the same model's gradients in plain candle on one process.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use fsdp::config::Layer;
use fsdp::engine::Fsdp;
use fsdp::nn::{Init, LocalParams, ModuleInfo, ParamSpec, Params, Recompute};
use fsdp_comm::Mesh;

use crate::common;

const BLOCKS: [&str; 2] = ["b0", "b1"];
const WIDTH: usize = 6;

fn square(name: &str) -> ParamSpec {
    ParamSpec {
        name: name.into(),
        shape: vec![WIDTH, WIDTH],
        init: Init::Normal { std: 0.3 },
        requires_grad: true,
        sparse_grad: false,
        packing: None,
    }
}

/// Two blocks (the units) and a module `shared` that both blocks and the loss read.
fn info() -> ModuleInfo {
    let mut root = ModuleInfo::new("", "Toy");
    for b in BLOCKS {
        let mut block = ModuleInfo::new(b, "Block");
        block.params.push(square(&format!("{b}.weight")));
        root = root.child(block);
    }
    let mut shared = ModuleInfo::new("shared", "Shared");
    shared.params.push(square("shared.weight"));
    root.child(shared)
}

/// `h = tanh(h·W_b + h·S)` per block (checkpointed when the parameters ask for it), then
/// the mean square of `h·S`.
fn loss(p: &dyn Params, x: &Tensor) -> candle_core::Result<Tensor> {
    let mut h = x.clone();
    for b in BLOCKS {
        let block: Recompute = Arc::new(move |p: &dyn Params, x: &Tensor| {
            let w = p.get(&format!("{b}.weight"))?;
            let s = p.get("shared.weight")?;
            (x.matmul(&w)? + x.matmul(&s)?)?.tanh()
        });
        h = if p.checkpoints(b) {
            p.checkpointed(b, &h, block)?
        } else {
            p.module_output(b, block(p, &h)?)?
        };
    }
    h.matmul(&p.get("shared.weight")?)?.sqr()?.mean_all()
}

/// Rank `rank`'s batch (each rank's differs, so a missing mean over ranks shows).
fn input(rank: usize) -> Tensor {
    let v: Vec<f32> = (0..4 * WIDTH)
        .map(|i| (((i + 3 * rank) * 7 % 11) as f32 - 5.0) / 6.0)
        .collect();
    Tensor::from_vec(v, (4, WIDTH), &Device::Cpu).unwrap()
}

fn init() -> LocalParams {
    LocalParams::init(&info(), 5, DType::F32, &Device::Cpu).unwrap()
}

/// Every parameter's gradient from plain candle on one process: the mean over the
/// batches of `world` ranks.
fn plain_gradients(world: usize) -> BTreeMap<String, Vec<f32>> {
    let params = init();
    let mut mean: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for rank in 0..world {
        let grads = loss(&params, &input(rank)).unwrap().backward().unwrap();
        for (name, v) in params.vars() {
            let g: Vec<f32> = grads
                .get(v.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let sum = mean
                .entry(name.clone())
                .or_insert_with(|| vec![0.0; g.len()]);
            sum.iter_mut()
                .zip(&g)
                .for_each(|(s, g)| *s += g / world as f32);
        }
    }
    mean
}

/// A rank's rows of a parameter and their gradient.
type RowsAndGradient = (std::ops::Range<usize>, Vec<f32>);

/// Each rank's (owned rows, gradient rows) of every parameter after one backward of the
/// same batch on every rank, `shard` ranks per shard group (all of them when `None`).
fn engine_gradients(
    world: usize,
    shard: Option<usize>,
    checkpointing: bool,
) -> Vec<BTreeMap<String, RowsAndGradient>> {
    common::tiny::on_threads(world, move |group| {
        let plugin = common::tiny::block_units()
            .ignored_modules("^shared$")
            .activation_checkpointing(checkpointing)
            .resolve(&Layer::new(), None)
            .unwrap()
            .fsdp;
        let mesh = match shard {
            Some(s) => Mesh::hybrid(group.as_ref(), s).unwrap(),
            None => Mesh::sharded(group),
        };
        let weights = init().tensors();
        let mut engine = Fsdp::with_mesh(&info(), &weights, &plugin, &[], mesh).unwrap();
        engine.set_debug(true);
        let params = engine.begin_step().unwrap();
        let l = loss(&params, &input(engine.mesh().rank())).unwrap();
        engine.backward(params, l, true).unwrap();
        let grads = engine.gradients().unwrap();
        if checkpointing {
            assert_eq!(engine.recomputed_units(), 2, "both blocks recomputed");
        }
        ["b0.weight", "b1.weight", "shared.weight"]
            .into_iter()
            .map(|name| {
                let rows = engine.owned_rows(name).unwrap();
                let g = grads.get(name).map(<[f32]>::to_vec).unwrap_or_default();
                (name.to_string(), (rows, g))
            })
            .collect()
    })
}

#[test]
fn ignored_parameters_read_in_and_out_of_checkpointed_units_get_their_whole_gradient() {
    for (world, shard, checkpointing) in [
        (1, None, false),
        (2, None, false),
        (2, None, true),
        (3, None, true),
        (4, Some(2), true),
        (4, Some(2), false),
    ] {
        let want = plain_gradients(world);
        let what = format!("{world} ranks, shard groups {shard:?}, checkpointing {checkpointing}");
        for (rank, got) in engine_gradients(world, shard, checkpointing)
            .iter()
            .enumerate()
        {
            for (name, (rows, g)) in got {
                let w = &want[name][rows.start * WIDTH..rows.end * WIDTH];
                if name == "shared.weight" {
                    assert_eq!(rows.len(), WIDTH, "{what}: rank {rank} holds all of {name}");
                }
                assert_eq!(g.len(), w.len(), "{what}: rank {rank} {name}");
                for (a, b) in g.iter().zip(w) {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                        "{what}: rank {rank} {name}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// Rank 0's full weights after `steps` AdamW steps on 2 ranks, with everything in memory or
/// with shards, gradients and optimizer state in a disk tier (`offload`).
fn trained(offload: Option<&'static str>, steps: usize) -> BTreeMap<String, Vec<f32>> {
    let dir = offload.map(|kind| {
        let d = tempfile::tempdir().unwrap();
        (d, kind)
    });
    let dir = Arc::new(dir);
    let mut out = common::tiny::on_threads(2, move |group| {
        let mut b = common::tiny::block_units().ignored_modules("^shared$");
        if let Some((d, kind)) = dir.as_ref() {
            b = b.offload_dir(d.path().to_str().unwrap());
            b = match *kind {
                "params" => b.offload_params(true),
                _ => b.offload_optimizer(true),
            };
        }
        let plugin = b.resolve(&Layer::new(), None).unwrap().fsdp;
        let weights = init().tensors();
        let mut engine = Fsdp::new(&info(), &weights, &plugin, &[], group).unwrap();
        let mut adam = fsdp::optim::AdamW::new(fsdp::optim::AdamWConfig {
            lr: 0.05,
            ..Default::default()
        })
        .unwrap();
        for _ in 0..steps {
            let params = engine.begin_step().unwrap();
            let l = loss(&params, &input(engine.mesh().rank())).unwrap();
            engine.backward(params, l, true).unwrap();
            engine.clip_grad_norm(Some(1.0)).unwrap();
            engine.step(&mut adam).unwrap();
        }
        engine.full_state_dict().unwrap().map(|full| {
            full.into_iter()
                .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap()))
                .collect()
        })
    });
    out.remove(0).unwrap()
}

#[test]
fn ignored_modules_train_the_same_with_state_offloaded_to_disk() {
    let want = trained(None, 4);
    assert_ne!(
        want["shared.weight"],
        init().tensors()["shared.weight"]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        "the ignored module trained"
    );
    for kind in ["params", "optimizer"] {
        let got = trained(Some(kind), 4);
        for (name, w) in &want {
            assert_eq!(&got[name], w, "{name} with the {kind} offloaded");
        }
    }
}
