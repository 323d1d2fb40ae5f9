//! A crate outside the fsdp-rs workspace that depends on `fsdp` alone (no candle-core, no
//! `[patch]`): its own model, one process, two optimizer steps. Built and run by
//! `crates/fsdp-cli/tests/downstream.rs`; prints the two losses as `loss <step> <value>`.

use fsdp::accelerator::Accelerator;
use fsdp::composite_module;
use fsdp::nn::candle::{DType, Device, Result, Tensor};
use fsdp::nn::layers::{Embedding, LayerNorm, Linear};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{Forward, Model, Params, SeededWeights, join};
use fsdp::optim::{AdamW, AdamWConfig};

struct Block {
    path: String,
    ln: LayerNorm,
    fc: Linear,
}
composite_module!(Block, "Block", [ln, fc]);

impl Forward<&Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, p: &dyn Params, x: &Tensor) -> Result<Tensor> {
        x + self.fc.call(p, &self.ln.call(p, x)?)?.relu()?
    }
}

struct Net {
    path: String,
    embed: Embedding,
    blocks: Vec<Block>,
    head: Linear,
}
composite_module!(Net, "Net", [embed, blocks, head]);

impl Model for Net {
    fn no_split_modules(&self) -> &'static [&'static str] {
        &["Block"]
    }
}

fn main() -> anyhow::Result<()> {
    let block = |i: usize| {
        let path = join("blocks", &i.to_string());
        Block {
            ln: LayerNorm::new(join(&path, "ln"), 16, 1e-5),
            fc: Linear::new(join(&path, "fc"), 16, 16, 0.02),
            path,
        }
    };
    let net = Net {
        path: String::new(),
        embed: Embedding::new("embed".into(), 32, 16, 0.02),
        blocks: (0..2).map(block).collect(),
        head: Linear::new("head".into(), 16, 32, 0.02),
    };
    let mut acc = Accelerator::new()?;
    let mut model = acc.prepare_model(net, &SeededWeights(7))?;
    let mut opt = acc.prepare_optimizer(AdamW::new(AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    })?)?;
    let ids = Tensor::arange(0u32, 8, &Device::Cpu)?.reshape((2, 4))?;
    let targets = ((&ids + 1.0)?.to_dtype(DType::I64)?).flatten_all()?;
    for step in 0..2 {
        let loss = model.forward(|m, p| {
            let mut h = m.embed.call(p, &ids)?;
            for b in &m.blocks {
                h = b.call(p, &h)?;
            }
            let logits = m.head.call(p, &h)?.flatten_to(1)?;
            cross_entropy(&logits, &targets, CrossEntropy::default())
        })?;
        println!("loss {step} {}", loss.to_scalar::<f32>()?);
        acc.backward(&mut model, loss)?;
        acc.optimizer_step(&mut model, &mut opt)?;
    }
    Ok(())
}
