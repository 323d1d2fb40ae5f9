//! Train a model of your own under FSDP: a byte-level MLP language model (the next byte from
//! the `context` bytes before it) written from scratch with fsdp's module system, not taken
//! from Hugging Face. README ("Train your own model") walks through it.
//!
//! ```sh
//! fsdp launch --num_processes 2 --example custom_model_example
//! fsdp merge-weights target/custom_model_example/checkpoint target/custom_model_example/merged
//! ```
//!
//! By default it learns its own source text (any file with `--data`); it prints the held-out
//! loss before and after, saves a checkpoint that resumes at any number of processes
//! (`--resume_from_checkpoint`) and the model for sharing (`model/model.safetensors`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use clap::Parser;
use fsdp::accelerator::{Accelerator, ReduceOp};
use fsdp::composite_module;
use fsdp::data::{CollateError, DataLoader, Dataset};
use fsdp::nn::candle::{self, DType, Device, Tensor};
use fsdp::nn::layers::{Dropout, Embedding, LayerNorm, Linear};
use fsdp::nn::ops::{CrossEntropy, GeluApprox, cross_entropy};
use fsdp::nn::{
    Forward, Model, Module, Params, Recompute, SeededWeights, call_checkpointable, join,
};
use fsdp::optim::{
    AdamW, AdamWConfig, LrSchedule, NORM_MODULES, no_decay_by_module, split_no_decay,
};

/// `x + dropout(down(gelu(up(ln(x)))))`: the model's repeated block, and its FSDP unit.
#[derive(Clone)]
struct ResidualBlock {
    path: String,
    ln: LayerNorm,
    up: Linear,
    down: Linear,
    dropout: Dropout,
}
// The children in registration order; `dropout` has no parameters and is not listed.
composite_module!(ResidualBlock, "ResidualBlock", [ln, up, down]);

impl ResidualBlock {
    fn new(path: String, width: usize, dropout: f64) -> ResidualBlock {
        ResidualBlock {
            ln: LayerNorm::new(join(&path, "ln"), width, 1e-5),
            up: Linear::new(join(&path, "up"), width, 4 * width, 0.02).with_gelu(GeluApprox::Tanh),
            down: Linear::new(join(&path, "down"), 4 * width, width, 0.02),
            dropout: Dropout::new(join(&path, "dropout"), dropout),
            path,
        }
    }
}

impl Forward<(&Tensor, Option<u64>)> for ResidualBlock {
    type Output = Tensor;

    /// `(x, dropout seed)`: the seed is `None` in evaluation, so dropout is off.
    fn forward(&self, p: &dyn Params, (x, seed): (&Tensor, Option<u64>)) -> candle::Result<Tensor> {
        // Children run with `call`, never `forward`: `call` reports a module's output to the
        // engine, which is how a unit is released after its forward and refilled for backward.
        let h = self.down.call(p, &self.up.call(p, &self.ln.call(p, x)?)?)?;
        x + self.dropout.apply(&h, seed)?
    }
}

/// The whole model. Its path is empty: it is the root, whose parameters (embedding, input
/// projection, final norm, head) form the root unit; the blocks are units of their own.
struct ByteMlp {
    path: String,
    embed: Embedding,
    proj: Linear,
    blocks: Vec<ResidualBlock>,
    ln_f: LayerNorm,
    head: Linear,
    context: usize,
    width: usize,
    /// Set before each training forward; `None` turns dropout off.
    dropout_seed: Option<u64>,
}
// A `Vec` child adds each element (`blocks.0`, `blocks.1`, ...), like PyTorch's ModuleList.
composite_module!(ByteMlp, "ByteMlp", [embed, proj, blocks, ln_f, head]);

impl Model for ByteMlp {
    /// What TRANSFORMER_BASED_WRAP wraps unless `fsdp_transformer_layer_cls_to_wrap` says.
    fn no_split_modules(&self) -> &'static [&'static str] {
        &["ResidualBlock"]
    }
}

impl ByteMlp {
    fn new(context: usize, width: usize, blocks: usize, dropout: f64) -> ByteMlp {
        ByteMlp {
            path: String::new(),
            embed: Embedding::new("embed".into(), 256, 16, 0.02),
            proj: Linear::new("proj".into(), context * 16, width, 0.02),
            blocks: (0..blocks)
                .map(|i| ResidualBlock::new(join("blocks", &i.to_string()), width, dropout))
                .collect(),
            ln_f: LayerNorm::new("ln_f".into(), width, 1e-5),
            head: Linear::new("head".into(), width, 256, 0.02),
            context,
            width,
            dropout_seed: None,
        }
    }

    /// Logits `[batch, 256]` of the byte after each context `[batch, context]`.
    fn logits(&self, p: &dyn Params, context: &Tensor) -> candle::Result<Tensor> {
        let batch = context.dim(0)?;
        let embedded = self
            .embed
            .call(p, context)?
            .reshape((batch, self.context * 16))?;
        let mut h = self.proj.call(p, &embedded)?;
        for block in &self.blocks {
            // Under `fsdp_activation_checkpointing` the engine keeps only the block's input
            // and reruns `recompute` in backward (same dropout masks: same seed and site).
            let seed = self.dropout_seed;
            let recompute = || -> Recompute {
                let block = block.clone();
                Arc::new(move |p: &dyn Params, x: &Tensor| block.forward(p, (x, seed)))
            };
            h = call_checkpointable(p, block.path(), &h, recompute, || block.call(p, (&h, seed)))?;
        }
        self.head.call(p, &self.ln_f.call(p, &h)?)
    }
}

/// Every position of a text: its `context` bytes and the byte after them.
struct Windows {
    bytes: Arc<Vec<u8>>,
    context: usize,
}

impl Dataset for Windows {
    type Item = Vec<u8>;
    fn len(&self) -> usize {
        self.bytes.len().saturating_sub(self.context)
    }
    fn get(&self, i: usize) -> Vec<u8> {
        self.bytes[i..=i + self.context].to_vec()
    }
}

/// A batch: contexts `[n, context]` (u32) and next bytes `[n]` (i64).
fn collate(windows: &[Vec<u8>]) -> Result<(Tensor, Tensor), CollateError> {
    let context = windows[0].len() - 1;
    let ids: Vec<u32> = windows
        .iter()
        .flat_map(|w| w[..context].iter().map(|&b| u32::from(b)))
        .collect();
    let next: Vec<i64> = windows.iter().map(|w| i64::from(w[context])).collect();
    let n = windows.len();
    Ok((
        Tensor::from_vec(ids, (n, context), &Device::Cpu)?,
        Tensor::from_vec(next, n, &Device::Cpu)?,
    ))
}

#[derive(Parser)]
#[command(rename_all = "snake_case")]
struct Args {
    /// Text to learn [default: this example's source].
    #[arg(long)]
    data: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    context: usize,
    #[arg(long, default_value_t = 128)]
    width: usize,
    #[arg(long, default_value_t = 3)]
    blocks: usize,
    #[arg(long, default_value_t = 0.1)]
    dropout: f64,
    /// Examples per process per step.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    #[arg(long, default_value_t = 600)]
    max_train_steps: u64,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value = "target/custom_model_example")]
    output_dir: PathBuf,
    /// Replace an earlier run's saved model and checkpoints in OUTPUT_DIR (without it a run
    /// into a folder holding them is refused, as transformers' Trainer refuses).
    #[arg(long)]
    overwrite_output_dir: bool,
    /// Also save a checkpoint every this many steps (OUTPUT_DIR/step_N).
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// A checkpoint this example saved (at any number of processes); `latest`: the newest in
    /// OUTPUT_DIR, if any, so a job restarted by `fsdp launch --max_restarts` resumes there.
    #[arg(long)]
    resume_from_checkpoint: Option<PathBuf>,
    /// Fail at this step on the job's first attempt (to watch `--max_restarts` resume it).
    #[arg(long)]
    fail_at_step: Option<u64>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let text = match &args.data {
        Some(path) => std::fs::read(path)?,
        None => include_str!("custom_model_example.rs").as_bytes().to_vec(),
    };
    let split = text.len() * 9 / 10;
    let (train, held_out) = (text[..split].to_vec(), text[split..].to_vec());

    let mut acc = Accelerator::builder().seed(args.seed).build()?;
    let model = ByteMlp::new(args.context, args.width, args.blocks, args.dropout);
    let info = model.info();
    let names: Vec<String> = info.all_params().iter().map(|p| p.name.clone()).collect();
    // Weight decay on weights only: biases and every parameter of a LayerNorm, found by type.
    let groups = split_no_decay(
        names,
        AdamWConfig {
            lr: args.lr,
            ..Default::default()
        },
        no_decay_by_module(&info, NORM_MODULES),
    );
    let mut model = acc.prepare_model(model, &SeededWeights(args.seed))?;
    let mut optimizer = acc.prepare_optimizer(AdamW::with_groups(groups)?)?;
    acc.prepare_scheduler(
        &mut optimizer,
        LrSchedule::Cosine {
            warmup: args.max_train_steps / 10,
            total: args.max_train_steps,
        },
    )?;
    let windows = |bytes: Vec<u8>| Windows {
        bytes: Arc::new(bytes),
        context: args.context,
    };
    let mut train_loader = acc.prepare_data_loader(
        DataLoader::new(windows(train), args.batch_size, collate)
            .shuffle(args.seed)
            .drop_last(true),
    );
    let mut eval_loader =
        acc.prepare_data_loader(DataLoader::new(windows(held_out), args.batch_size, collate));
    acc.print(format!(
        "ByteMlp ({} parameters) in {} units, {} processes; held-out loss {:.4} before training",
        info.num_params(),
        model.engine().plan().units.len(),
        acc.num_processes(),
        evaluate(&acc, &mut model, &mut eval_loader)?
    ));
    // One run at a time writes into the output folder (a second is refused, naming this one).
    acc.lock_output_dir(&args.output_dir)?;
    let resume = match &args.resume_from_checkpoint {
        Some(dir) if dir.as_os_str() == "latest" => {
            acc.latest_checkpoint(Some(&args.output_dir))?
        }
        other => other.clone(),
    };
    // A new run (not a resumed one) does not go over an earlier run's model or checkpoints
    // unless asked to.
    if resume.is_none() {
        acc.claim_output_dir(&args.output_dir, args.overwrite_output_dir)?;
    }
    if let Some(dir) = &resume {
        let position = acc.load_state(dir, &mut [&mut model], &mut [&mut optimizer])?;
        train_loader.set_position(position);
        acc.print(format!(
            "resumed from {} at step {}",
            dir.display(),
            acc.step()
        ));
    }

    let (trained_from, started) = (acc.step(), std::time::Instant::now());
    while acc.step() < args.max_train_steps {
        if args.fail_at_step == Some(acc.step()) && acc.restart_count() == 0 {
            anyhow::bail!(
                "failing at step {} as --fail_at_step asks (first attempt only)",
                acc.step()
            );
        }
        let Some(batch) = train_loader.next_batch() else {
            train_loader.set_epoch(train_loader.position().epoch + 1);
            continue;
        };
        // On the device the model computes on (`use_cpu`, the local rank's GPU).
        let (context, next) = batch?.batch;
        let (context, next) = (
            context.to_device(acc.device())?,
            next.to_device(acc.device())?,
        );
        model.module_mut().dropout_seed =
            Some(args.seed ^ acc.step() << 8 ^ acc.process_index() as u64);
        let logits = model.forward(|m, p| m.logits(p, &context))?;
        let loss = cross_entropy(&logits, &next, CrossEntropy::default())?;
        let local = loss.to_scalar::<f32>()?;
        acc.backward(&mut model, loss)?;
        acc.clip_grad_norm(&mut model, 1.0)?;
        acc.optimizer_step(&mut model, &mut optimizer)?;
        if let Some(n) = args.checkpoint_every
            && acc.step() % n == 0
        {
            let dir = args.output_dir.join(format!("step_{}", acc.step()));
            acc.save_state(
                Some(&dir),
                &[&model],
                &[&optimizer],
                train_loader.position(),
            )?;
        }
        if acc.step() % 50 == 0 {
            let mean = acc.reduce(vec![local], ReduceOp::Avg)?[0];
            acc.print(format!("step {}: training loss {mean:.4}", acc.step()));
        }
    }
    // Model FLOPs: 6 per weight of a matrix product per example (one output per example).
    let weights: usize = info
        .all_params()
        .iter()
        .filter(|p| p.shape.len() == 2 && p.name != "embed.weight")
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let examples = (acc.step() - trained_from) as usize * train_loader.global_batch_size();
    let flops = 6.0 * weights as f64 * examples as f64;
    acc.print(acc.mfu_line(flops, None, started.elapsed().as_secs_f64()));
    model.module_mut().dropout_seed = None;
    acc.print(format!(
        "held-out loss {:.4} after {} steps",
        evaluate(&acc, &mut model, &mut eval_loader)?,
        acc.step()
    ));
    let checkpoint = args.output_dir.join("checkpoint");
    acc.save_state(
        Some(&checkpoint),
        &[&model],
        &[&optimizer],
        train_loader.position(),
    )?;
    let config = serde_json::json!({ "model_type": "byte_mlp", "context": args.context, "width": model.module().width, "blocks": args.blocks });
    let saved = acc.save_model(&model, &args.output_dir.join("model"), &config)?;
    acc.print(format!(
        "checkpoint in {}, model in {}",
        checkpoint.display(),
        saved.display()
    ));
    Ok(())
}

/// Mean held-out loss, every example counted once (per-example losses gathered from all ranks).
fn evaluate<D: Dataset>(
    acc: &Accelerator,
    model: &mut fsdp::accelerator::PreparedModel<ByteMlp>,
    loader: &mut DataLoader<D, (Tensor, Tensor)>,
) -> Result<f64> {
    let (mut sum, mut count) = (0.0, 0usize);
    loader.set_epoch(0);
    while let Some(batch) = loader.next_batch() {
        let batch = batch?;
        let (context, next) = &batch.batch;
        let (context, next) = (
            &context.to_device(acc.device())?,
            next.to_device(acc.device())?,
        );
        let losses = model.evaluate(|m, p| {
            // Per example: logsumexp(logits) - logit of the true byte.
            let logits = m.logits(p, context)?;
            let max = logits.max_keepdim(1)?;
            let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()? + &max)?;
            let picked = logits.gather(&next.unsqueeze(1)?, 1)?;
            (lse - picked)?.squeeze(1)?.to_dtype(DType::F32)
        })?;
        let all: Vec<f32> = acc.gather_tensor_for_metrics(&losses, &batch)?.to_vec1()?;
        sum += all.iter().map(|&l| f64::from(l)).sum::<f64>();
        count += all.len();
    }
    Ok(sum / count.max(1) as f64)
}
