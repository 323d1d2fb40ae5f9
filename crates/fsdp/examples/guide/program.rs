use std::path::PathBuf;
use std::sync::Arc;

use fsdp::accelerator::Accelerator;
use fsdp::composite_module;
use fsdp::data::LoaderPosition;
use fsdp::nn::candle::{self, DType, Tensor};
use fsdp::nn::layers::{Dropout, Embedding, LayerNorm, Linear};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{Forward, Model, Module, Params, Recompute, SeededWeights, call_checkpointable, join};
use fsdp::optim::{AdamW, AdamWConfig, NORM_MODULES, no_decay_by_module, split_no_decay};

/// `x + dropout(relu(fc(ln(x))))`: the repeated block, one FSDP unit each.
#[derive(Clone)]
struct Block { path: String, ln: LayerNorm, fc: Linear, dropout: Dropout }
composite_module!(Block, "Block", [ln, fc]); // children in order; dropout has no parameters

impl Block {
    fn new(path: String, width: usize) -> Block {
        Block {
            ln: LayerNorm::new(join(&path, "ln"), width, 1e-5), // parameters blocks.N.ln.weight, .bias
            fc: Linear::new(join(&path, "fc"), width, width, 0.02),
            dropout: Dropout::new(join(&path, "dropout"), 0.1),
            path,
        }
    }
}

impl Forward<(&Tensor, Option<u64>)> for Block {
    type Output = Tensor;
    fn forward(&self, p: &dyn Params, (x, seed): (&Tensor, Option<u64>)) -> candle::Result<Tensor> {
        let h = self.fc.call(p, &self.ln.call(p, x)?)?.relu()?; // children run with `call`
        x + self.dropout.apply(&h, seed)? // no seed, no dropout
    }
}

/// The root (path ""): its own parameters, embed and head, form the root unit.
struct Net { path: String, embed: Embedding, blocks: Vec<Block>, head: Linear, seed: Option<u64> }
composite_module!(Net, "Net", [embed, blocks, head]); // a Vec adds blocks.0, blocks.1, ...

impl Model for Net {
    fn no_split_modules(&self) -> &'static [&'static str] {
        &["Block"] // what TRANSFORMER_BASED_WRAP wraps by default
    }
}

impl Net {
    fn logits(&self, p: &dyn Params, ids: &Tensor) -> candle::Result<Tensor> {
        let mut h = self.embed.call(p, ids)?;
        for block in &self.blocks {
            let seed = self.seed;
            // What activation checkpointing reruns in backward: the block's `forward`.
            let recompute = || -> Recompute {
                let block = block.clone();
                Arc::new(move |p: &dyn Params, x: &Tensor| block.forward(p, (x, seed)))
            };
            h = call_checkpointable(p, block.path(), &h, recompute, || block.call(p, (&h, seed)))?;
        }
        self.head.call(p, &h)
    }
}

fn main() -> anyhow::Result<()> {
    let net = Net {
        path: String::new(),
        embed: Embedding::new("embed".into(), 64, 32, 0.02),
        blocks: (0..2).map(|i| Block::new(join("blocks", &i.to_string()), 32)).collect(),
        head: Linear::new("head".into(), 32, 64, 0.02),
        seed: None,
    };
    let info = net.info();
    let names: Vec<String> = info.all_params().iter().map(|p| p.name.clone()).collect();
    assert_eq!(names[..3], ["embed.weight", "blocks.0.ln.weight", "blocks.0.ln.bias"]);
    // No weight decay on biases and on every parameter of a LayerNorm, found by type.
    let groups = split_no_decay(names, AdamWConfig::default(), no_decay_by_module(&info, NORM_MODULES));

    let mut acc = Accelerator::new()?; // the job `fsdp launch` started, or one process
    let mut model = acc.prepare_model(net, &SeededWeights(42))?;
    let mut opt = acc.prepare_optimizer(AdamW::with_groups(groups)?)?;
    let ids = Tensor::arange(0u32, 16, acc.device())?.reshape((2, 8))?; // where the model computes
    let next = (&ids + 1.0)?.to_dtype(DType::I64)?.flatten_all()?; // each id's successor
    for step in 0..3 {
        model.module_mut().seed = Some(acc.seed() ^ step); // dropout on, a mask per step
        let loss = model.forward(|m, p| {
            let logits = m.logits(p, &ids)?.flatten_to(1)?;
            cross_entropy(&logits, &next, CrossEntropy::default())
        })?;
        acc.print(format!("step {step}: loss {:.4}", loss.to_scalar::<f32>()?));
        acc.backward(&mut model, loss)?;
        acc.optimizer_step(&mut model, &mut opt)?;
    }
    model.module_mut().seed = None; // evaluation: no dropout, no graph
    let logits = model.evaluate(|m, p| m.logits(p, &ids))?;
    assert_eq!(logits.dims(), [2, 8, 64]);
    // Every rank saves its shards (and optimizer state) into one checkpoint folder.
    let default = || std::env::temp_dir().join(format!("fsdp-guide-{}", std::process::id()));
    let out = std::env::args().nth(1).map_or_else(default, PathBuf::from);
    let saved = acc.save_state(Some(&out.join("checkpoint")), &[&model], &[&opt], LoaderPosition::start_of(1))?;
    acc.print(format!("saved {}", saved.display()));
    Ok(())
}
