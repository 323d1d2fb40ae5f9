//! A row-sparse embedding table in a unit released after its forward, whose forward also
//! reads the table whole (a weight tied to it): the lookup gathers rows, the whole read
//! gathers the table, and before backward — which reads it through the tied product — the
//! released table is gathered whole again while its unit's all-gather sends nothing (the
//! table is the unit's only parameter). Ranks on threads train as one process does.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use fsdp::config::Layer;
use fsdp::engine::Fsdp;
use fsdp::nn::layers::{Embedding, Linear};
use fsdp::nn::{Forward, LocalParams, Module, ModuleInfo, Params};
use fsdp::optim::{Optimizer, Sgd, SgdConfig};

use crate::common::tiny::{block_units, on_threads};

const VOCAB: usize = 40;
const DIM: usize = 6;

/// A `Block` (a unit under `block_units`): a row-sparse table looked up, then its output
/// projected onto the table itself (logits over the vocabulary, as a tied LM head).
struct TiedBlock {
    table: Embedding,
}

impl Module for TiedBlock {
    fn path(&self) -> &str {
        "blk"
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new("blk", "Block").child(self.table.info())
    }
}

impl Forward<&Tensor> for TiedBlock {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, ids: &Tensor) -> candle_core::Result<Tensor> {
        let rows = self.table.call(p, ids)?;
        let whole = p.get(self.table.weight_name())?;
        rows.broadcast_matmul(&whole.t()?)
    }
}

struct Model {
    blk: TiedBlock,
    out: Linear,
}

impl Model {
    fn new() -> Model {
        let table = Embedding::new("blk.table".into(), VOCAB, DIM, 0.3).sparse(true);
        Model {
            blk: TiedBlock { table },
            out: Linear::new("out".into(), VOCAB, 2, 0.2),
        }
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new("", "Model")
            .child(self.blk.info())
            .child(self.out.info())
    }

    fn loss(&self, p: &dyn Params, ids: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.blk.call(p, ids)?;
        self.out.call(p, &h)?.sqr()?.mean_all()
    }
}

/// Step `step`'s ids: 4 rows of 5, rank `r` of `world` taking its rows.
fn ids(step: usize, rank: usize, world: usize) -> Tensor {
    let all: Vec<u32> = (0..20)
        .map(|i| ((i * 7 + step * 11) % VOCAB) as u32)
        .collect();
    let t = Tensor::from_vec(all, (4, 5), &Device::Cpu).unwrap();
    t.narrow(0, rank * 4 / world, 4 / world).unwrap()
}

const STEPS: usize = 3;

/// The weights after `STEPS` steps of SGD on `world` ranks, from rank 0.
fn train(world: usize) -> BTreeMap<String, Vec<f32>> {
    let got = on_threads(world, move |group| {
        let model = Model::new();
        let info = model.info();
        let init = LocalParams::init(&info, 5, DType::F32, &Device::Cpu).unwrap();
        let plugin = block_units().resolve(&Layer::new(), None).unwrap().fsdp;
        let rank = group.rank();
        let mut engine = Fsdp::new(&info, &init.tensors(), &plugin, &[], group).unwrap();
        engine.set_debug(true);
        let mut sgd = Sgd::new(SgdConfig {
            lr: 0.5,
            ..Default::default()
        })
        .unwrap();
        for step in 0..STEPS {
            let params = engine.begin_step().unwrap();
            let loss = model.loss(&params, &ids(step, rank, world)).unwrap();
            engine.backward(params, loss, true).unwrap();
            engine.step(&mut sgd as &mut dyn Optimizer).unwrap();
        }
        engine.full_state_dict().unwrap().map(|w| {
            w.into_iter()
                .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap()))
                .collect::<BTreeMap<String, Vec<f32>>>()
        })
    });
    got.into_iter().next().flatten().unwrap()
}

#[test]
fn a_tied_table_released_after_forward_trains_as_one_process() {
    let one = train(1);
    let two = train(2);
    let init = LocalParams::init(&Model::new().info(), 5, DType::F32, &Device::Cpu).unwrap();
    let start = &init.tensors()["blk.table.weight"];
    let start: Vec<f32> = start.flatten_all().unwrap().to_vec1().unwrap();
    assert_ne!(start, one["blk.table.weight"], "the table trained");
    for (name, want) in &one {
        let got = &two[name];
        let worst = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{name}: 2 ranks differ from 1 by {worst:e}");
    }
}
