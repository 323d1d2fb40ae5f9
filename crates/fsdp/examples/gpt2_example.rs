//! Train a small GPT-2 language model from scratch with FSDP: byte-level (vocabulary 256),
//! the output projection tied to the token embedding, units cut by parameter count
//! (`SIZE_BASED_WRAP`), perplexity on held-out text.
//!
//! ```sh
//! tools/fetch-test-assets.sh    # the text: VADER's rated sentences, from PyPI
//! fsdp launch --config_file examples/fsdp_config.yaml --example gpt2_example
//! ```
//!
//! The text is the ~31,000 sentences VADER's authors had rated (movie and Amazon reviews, New
//! York Times editorials, tweets; 2.6 MB), every 20th sentence held out.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;

use fsdp::accelerator::{Accelerator, ProjectConfiguration, ReduceOp};
use fsdp::config::{AutoWrapPolicy, FsdpPlugin};
use fsdp::data::{DataLoader, Dataset, TokenWindows, vader_lm_sentences};
use fsdp::models::{Gpt2Config, Gpt2LmHeadModel};
use fsdp::nn::candle::{DType, Device};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{AdamW, AdamWConfig, LrSchedule, is_bias_or_norm, split_no_decay};

/// Trains a byte-level GPT-2 from scratch under FSDP.
#[derive(Debug, Parser)]
#[command(rename_all = "snake_case")]
struct Args {
    /// Folder with VADER's `*_GroundTruth.txt` files [default: the ones fetched by
    /// tools/fetch-test-assets.sh]
    #[arg(long)]
    data: Option<PathBuf>,
    /// Context length in bytes.
    #[arg(long, default_value_t = 128)]
    block_size: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 128)]
    n_embd: usize,
    /// Blocks.
    #[arg(long, default_value_t = 4)]
    n_layer: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    n_head: usize,
    /// Dropout (embeddings, attention, residual).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Sequences per process per step.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    max_train_steps: u64,
    /// Peak learning rate (AdamW, cosine decay after a warmup of a tenth of the steps).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Evaluate every this many steps (and at the end).
    #[arg(long, default_value_t = 50)]
    eval_every: u64,
    /// Held-out sequences per evaluation.
    #[arg(long, default_value_t = 256)]
    eval_samples: usize,
    /// SIZE_BASED_WRAP's threshold: a subtree of at least this many parameters is a unit.
    #[arg(long, default_value_t = 150_000)]
    min_num_params: u64,
    /// Seed of the initialisation, shuffling and dropout.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where the model and metrics go.
    #[arg(long, default_value = "target/gpt2_example")]
    output_dir: PathBuf,
    /// Replace an earlier run's saved model and checkpoints in OUTPUT_DIR (without it a run
    /// into a folder holding them is refused, as transformers' Trainer refuses).
    #[arg(long)]
    overwrite_output_dir: bool,
    /// Write metrics as JSON lines to OUTPUT_DIR/metrics.jsonl.
    #[arg(long)]
    with_tracking: bool,
}

/// Bytes as token ids (the vocabulary is the 256 byte values).
fn bytes_as_tokens(bytes: &[u8]) -> Vec<u32> {
    bytes.iter().map(|&b| u32::from(b)).collect()
}

/// The training and held-out text (every 20th sentence held out), one sentence per line.
fn texts(dir: &Path) -> Result<(Vec<u8>, Vec<u8>)> {
    let (train, held_out) = vader_lm_sentences(dir).with_context(|| {
        "run tools/fetch-test-assets.sh (it fetches VADER's rated sentences from the vaderSentiment package on PyPI)"
    })?;
    let lines = |sentences: Vec<String>| {
        sentences
            .into_iter()
            .flat_map(|s| s.into_bytes().into_iter().chain([b'\n']))
            .collect()
    };
    Ok((lines(train), lines(held_out)))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let mut acc = Accelerator::builder()
        .fsdp_plugin(
            FsdpPlugin::builder()
                .auto_wrap_policy(AutoWrapPolicy::SizeBasedWrap)
                .min_num_params(args.min_num_params),
        )
        .project_config(ProjectConfiguration {
            project_dir: args.output_dir.clone(),
            ..Default::default()
        })
        .log_metrics(args.with_tracking)
        .seed(args.seed)
        .build()?;
    // Not over an earlier run's model or checkpoints unless asked to.
    acc.claim_output_dir(&args.output_dir, args.overwrite_output_dir)?;

    let dir = args.data.clone().unwrap_or_else(|| {
        let here = PathBuf::from("target/assets/vader");
        if here.is_dir() {
            here
        } else {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/assets/vader")
        }
    });
    let (train, held_out) = texts(&dir)?;

    let config = Gpt2Config {
        vocab_size: 256,
        n_positions: args.block_size,
        n_embd: args.n_embd,
        n_layer: args.n_layer,
        n_head: args.n_head,
        n_inner: None,
        layer_norm_epsilon: 1e-5,
        initializer_range: 0.02,
        embd_pdrop: args.dropout,
        attn_pdrop: args.dropout,
        resid_pdrop: args.dropout,
    };
    let model = Gpt2LmHeadModel::new(config.clone())?;
    let info = model.info();
    let weights = LocalParams::init(&info, args.seed, DType::F32, &Device::Cpu)?.tensors();
    let names: Vec<String> = weights.keys().cloned().collect();
    let mut model = acc.prepare_model(model, &weights)?;
    drop(weights);
    let plan = model.engine().plan();
    acc.print(format!("computing on {:?}", acc.device().location()));
    acc.print(format!(
        "GPT-2 ({} parameters; {}) in {} units by SIZE_BASED_WRAP (min_num_params {}): {}",
        info.num_params(),
        info.tied()
            .iter()
            .map(|(user, owner)| format!("{user} tied to {owner}"))
            .collect::<Vec<_>>()
            .join(", "),
        plan.units.len(),
        args.min_num_params,
        plan.units
            .iter()
            .map(|u| format!(
                "{} ({})",
                if u.path.is_empty() { "<root>" } else { &u.path },
                u.numel()
            ))
            .collect::<Vec<_>>()
            .join(", ")
    ));

    let adamw = AdamW::with_groups(split_no_decay(
        names,
        AdamWConfig {
            lr: args.lr,
            betas: (0.9, 0.95),
            weight_decay: 0.1,
            ..Default::default()
        },
        is_bias_or_norm,
    ))?;
    let mut optimizer = acc.prepare_optimizer(adamw)?;
    acc.prepare_scheduler(
        &mut optimizer,
        LrSchedule::Cosine {
            warmup: args.max_train_steps / 10,
            total: args.max_train_steps,
        },
    )?;

    let block = args.block_size;
    let mut train_loader = acc.prepare_data_loader(
        DataLoader::new(
            TokenWindows::new(bytes_as_tokens(&train), block),
            args.batch_size,
            TokenWindows::stack,
        )
        .shuffle(args.seed)
        .drop_last(true),
    );
    let held_out = TokenWindows::new(bytes_as_tokens(&held_out), block);
    acc.print(format!(
        "{} training / {} held-out sequences of {block} bytes; {} per step, {} steps",
        train_loader.dataset().len(),
        held_out.len(),
        train_loader.global_batch_size(),
        args.max_train_steps
    ));
    let eval_windows: Vec<Vec<u32>> = (0..held_out.len().min(args.eval_samples))
        .map(|i| held_out.get(i))
        .collect();
    let mut eval_loader = acc.prepare_data_loader(DataLoader::new(
        eval_windows,
        args.batch_size,
        TokenWindows::stack,
    ));

    let mut progress = acc.progress(args.max_train_steps, "train");
    let train_started = Instant::now();
    let mut epoch = 0;
    train_loader.set_epoch(epoch);
    while acc.step() < args.max_train_steps {
        let Some(batch) = train_loader.next_batch() else {
            epoch += 1;
            train_loader.set_epoch(epoch);
            continue;
        };
        // On the device the model computes on (`use_cpu`, the local rank's GPU).
        let ids = batch?.batch.to_device(acc.device())?;
        model.module_mut().dropout_seed = (args.dropout > 0.0).then(|| {
            args.seed ^ acc.step().wrapping_mul(0x9E37_79B9) ^ ((acc.process_index() as u64) << 48)
        });
        let loss = model.forward(|m, p| {
            let logits = m.forward(p, &ids)?;
            m.loss(&logits, &ids)
        })?;
        let local = loss.to_scalar::<f32>()?;
        acc.backward(&mut model, loss)?;
        acc.clip_grad_norm(&mut model, 1.0)?;
        acc.optimizer_step(&mut model, &mut optimizer)?;
        let loss = acc.reduce(vec![local], ReduceOp::Avg)?[0] as f64;
        progress.step(train_loader.global_batch_size() as u64, loss);
        let step = acc.step();
        if step % 10 == 0 {
            acc.log(serde_json::json!({ "loss": loss, "lr": optimizer.lr(0) }))?;
        }
        if step % args.eval_every == 0 || step == args.max_train_steps {
            model.module_mut().dropout_seed = None;
            let mut sum = 0.0;
            let mut count = 0.0;
            eval_loader.set_epoch(0);
            while let Some(batch) = eval_loader.next_batch() {
                let batch = batch?;
                let ids = &batch.batch.to_device(acc.device())?;
                // Each sequence's loss, every held-out sequence counted once (the repeats
                // that fill up the last step drop out).
                let per_sequence = model.evaluate(|m, p| {
                    let logits = m.forward(p, ids)?;
                    (0..ids.dim(0)?)
                        .map(|i| {
                            m.loss(&logits.narrow(0, i, 1)?, &ids.narrow(0, i, 1)?)?
                                .to_scalar::<f32>()
                        })
                        .collect::<fsdp::nn::candle::Result<Vec<f32>>>()
                })?;
                let losses = acc.gather_for_metrics(per_sequence, &batch)?;
                sum += losses.iter().map(|&l| l as f64).sum::<f64>();
                count += losses.len() as f64;
            }
            let eval_loss = sum / count.max(1.0);
            acc.print(format!(
                "step {step}: train loss {loss:.4}, held-out loss {eval_loss:.4}, perplexity {:.2} ({:.3} bits per byte)",
                eval_loss.exp(),
                eval_loss / std::f64::consts::LN_2
            ));
            acc.log(serde_json::json!({ "eval_loss": eval_loss, "perplexity": eval_loss.exp() }))?;
        }
    }
    progress.finish();
    let secs = train_started.elapsed().as_secs_f64();
    let hf_config = serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "embd_pdrop": config.embd_pdrop,
        "attn_pdrop": config.attn_pdrop,
        "resid_pdrop": config.resid_pdrop,
        "activation_function": "gelu_new",
        "tie_word_embeddings": true,
    });
    let out = acc.save_model(&model, &args.output_dir.join("model"), &hf_config)?;
    acc.print(format!(
        "{} steps in {secs:.1} s ({:.0} tokens/s); wall time {:.1} s; model saved to {}",
        acc.step(),
        (acc.step() as usize * train_loader.global_batch_size() * block) as f64 / secs,
        started.elapsed().as_secs_f64(),
        out.display()
    ));
    // Every sequence is a full block (no padding); the tied head is a per-token product.
    let sequences = acc.step() as usize * train_loader.global_batch_size();
    let flops = (config.transformer_shape()).training_flops(std::iter::repeat_n(block, sequences));
    acc.print(acc.mfu_line(flops, None, secs));
    Ok(())
}
