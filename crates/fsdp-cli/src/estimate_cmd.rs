//! `fsdp estimate-memory`: the per-rank memory of a model under a configuration, before any
//! process starts (like `accelerate estimate-memory`, but for the sharded layout fsdp-rs will
//! use): a summary first (the model's state per rank, an estimate of a batch's activations),
//! then the units, with every parameter's rows under `--params`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp::engine::{StepShape, UnitPlan};
use fsdp::models::{
    BertConfig, BertForSequenceClassification, BertModel, Gpt2Config, Gpt2LmHeadModel, LlamaConfig,
    LlamaForCausalLM,
};
use fsdp::nn::{Model, Module};

use crate::ConfigFileArg;

/// Print the FSDP units of a model and the memory each rank needs.
#[derive(Args)]
pub struct EstimateArgs {
    /// A Hugging Face `config.json` (model_type `bert`, `gpt2`, `llama`, `mistral` or
    /// `qwen2`).
    #[arg(
        long = "model_config",
        visible_alias = "model-config",
        value_name = "PATH"
    )]
    model_config: PathBuf,
    #[command(flatten)]
    file: ConfigFileArg,
    /// Number of processes (overrides the config file).
    #[arg(long = "num_processes", visible_alias = "num-processes")]
    num_processes: Option<usize>,
    /// Sequences per rank per micro-batch, for the activations' estimate.
    #[arg(long = "batch_size", visible_alias = "batch-size", default_value_t = 1)]
    batch_size: usize,
    /// Tokens per sequence, for the activations' estimate [default: the model's position
    /// limit, at most 2048].
    #[arg(long = "seq_len", visible_alias = "seq-len")]
    seq_len: Option<usize>,
    /// List every parameter's rows per rank under its unit.
    #[arg(long)]
    params: bool,
}

/// Runs `fsdp estimate-memory`.
pub fn run(args: EstimateArgs) -> Result<()> {
    let config = args.file.resolve(&[])?;
    let n = args.num_processes.unwrap_or(config.launch.num_processes);
    let text = std::fs::read_to_string(&args.model_config)
        .with_context(|| format!("reading {}", args.model_config.display()))?;
    let model_type: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", args.model_config.display()))?;
    let (info, default_wrap, name) = match model_type["model_type"].as_str().unwrap_or("bert") {
        "bert" => {
            let model = BertForSequenceClassification::new(BertConfig::from_json(&text)?)?;
            (
                model.info(),
                BertModel::no_split_modules(),
                "BertForSequenceClassification",
            )
        }
        "gpt2" => (
            Gpt2LmHeadModel::new(Gpt2Config::from_json(&text)?)?.info(),
            Gpt2LmHeadModel::no_split_modules(),
            "GPT2LMHeadModel",
        ),
        "llama" | "mistral" | "qwen2" => {
            let model = LlamaForCausalLM::new(LlamaConfig::from_json(&text)?)?;
            let info = model.info();
            let name = info.type_name;
            (info, model.no_split_modules(), name)
        }
        other => bail!("model_type {other:?} is not supported (bert, gpt2, llama, mistral, qwen2)"),
    };
    let plan = UnitPlan::build(&info, &config.fsdp, default_wrap, n)?;
    println!(
        "{name}: {} parameters; {}",
        info.num_params(),
        plan.headline()
    );
    println!("{}", plan.memory_summary());
    let shape = activation_shape(&model_type, &args, &config.fsdp)?;
    let checkpointing = config.fsdp.activation_checkpointing;
    let activations = shape.total_bytes(checkpointing);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    // The sequence the estimate assumes comes first: a default length the user did not
    // choose read as the model's own need.
    let tokens = match args.seq_len {
        Some(_) => format!("{} tokens (--seq_len)", shape.seq),
        None => format!(
            "{} tokens, assumed: the model's position limit{}, at most 2048; --seq_len sets it",
            shape.seq,
            model_positions(&model_type).map_or(String::new(), |p| format!(" {p}"))
        ),
    };
    println!(
        "activations, for {} sequence(s) per rank (--batch_size) of {tokens}: about {:.1} MiB per rank at {} bytes a value{} (Korthikanti et al.'s count for the layers, an upper estimate: the fused attention and LM head keep less; embeddings, head and allocator slack not counted); with them about {:.1} MiB",
        shape.batch,
        mib(activations),
        shape.value_bytes,
        if checkpointing {
            ", checkpointed per layer"
        } else {
            ""
        },
        mib(plan.memory_estimate().total() as u64 + activations)
    );
    println!("{}", traffic_line(&plan, &config, n));
    // Gathers through shared memory where every rank is on one host.
    let shared = plan.shared_gather_bytes(&config.fsdp);
    if config.launch.num_machines <= 1 && shared > 0 {
        println!(
            "shared memory for gathers on one host: about {:.1} MiB per rank (two slots of the largest unit block up to twice the median; each process's RSS counts every rank's, {:.1} MiB)",
            mib(shared as u64),
            mib((shared * n) as u64)
        );
    }
    println!(
        "units{}:",
        if args.params {
            ""
        } else {
            " (--params lists every parameter's rows)"
        }
    );
    print!("{}", plan.render_units(args.params));
    Ok(())
}

/// What a rank sends per step of one micro-batch on `n` processes, by the algorithms' theory
/// (int8 blocks where the config quantizes gathers or reductions).
fn traffic_line(plan: &UnitPlan, config: &fsdp::config::ResolvedConfig, n: usize) -> String {
    let launch = fsdp::config::LaunchSettings {
        num_processes: n,
        ..config.launch.clone()
    };
    let strategy = config.fsdp.sharding_strategy;
    let (shard_size, replicas) = launch.mesh_shape(strategy);
    let machine_size = match config.fsdp.hierarchical_collectives {
        true => launch.two_hop_machine_size(strategy),
        false => 1,
    };
    let t = plan.traffic_per_step(StepShape {
        shard_size,
        replicas,
        micro_batches: 1,
        no_sync: false,
        machine_size,
    });
    let mut quantized = Vec::new();
    if plan.gather_int8 {
        quantized.push("parameters gathered as int8 blocks".to_string());
    }
    if plan.reduce_dtype.is_quantized() {
        quantized.push(format!("gradients reduced as {} blocks", plan.reduce_dtype));
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let secondary = match plan.secondary_partition {
        h if h > 1 && shard_size > 1 => {
            format!(
                ", {:.1} MiB inside its secondary group of {h}",
                mib(t.secondary)
            )
        }
        _ => String::new(),
    };
    let shard_group = match machine_size {
        1 => format!(
            "{:.1} MiB inside its shard group of {shard_size}",
            mib(t.inside)
        ),
        l => format!(
            "in two hops over its shard group of {shard_size}, {:.1} MiB inside its machine of {l} and {:.1} MiB across the {} machines",
            mib(t.within_machine),
            mib(t.across_machines),
            shard_size / l
        ),
    };
    format!(
        "communication per step (one micro-batch), sent by each rank: {shard_group}{secondary}, {:.1} MiB across {replicas} replica(s){}",
        mib(t.across),
        if quantized.is_empty() {
            String::new()
        } else {
            format!(" ({})", quantized.join(", "))
        }
    )
}

/// The sizes the activations' estimate needs, from a transformers `config.json` (BERT's and
/// Llama's names, or GPT-2's `n_*`).
/// The model's position limit from its `config.json`, if it names one.
fn model_positions(v: &serde_json::Value) -> Option<usize> {
    ["max_position_embeddings", "n_positions"]
        .iter()
        .find_map(|k| v[*k].as_u64())
        .map(|x| x as usize)
}

fn activation_shape(
    v: &serde_json::Value,
    args: &EstimateArgs,
    fsdp: &fsdp::config::FsdpPlugin,
) -> Result<fsdp::memory::ActivationShape> {
    let num = |keys: &[&str]| -> Option<usize> {
        keys.iter().find_map(|k| v[*k].as_u64()).map(|x| x as usize)
    };
    let need = |keys: &[&str]| {
        num(keys).with_context(|| {
            format!(
                "{}: no {} (needed for the activations' estimate)",
                args.model_config.display(),
                keys.join(" or ")
            )
        })
    };
    let hidden = need(&["hidden_size", "n_embd"])?;
    let gated = matches!(
        v["model_type"].as_str(),
        Some("llama" | "mistral" | "qwen2")
    );
    let positions = model_positions(v).unwrap_or(2048);
    let dropout = ["hidden_dropout_prob", "resid_pdrop", "attention_dropout"]
        .iter()
        .any(|k| v[*k].as_f64().is_some_and(|p| p > 0.0));
    Ok(fsdp::memory::ActivationShape {
        layers: need(&["num_hidden_layers", "n_layer"])?,
        hidden,
        heads: need(&["num_attention_heads", "n_head"])?,
        intermediate: num(&["intermediate_size", "n_inner"]).unwrap_or(4 * hidden),
        gated_mlp: gated,
        dropout,
        batch: args.batch_size.max(1),
        seq: args.seq_len.unwrap_or(positions.min(2048)).max(1),
        value_bytes: match fsdp.mixed_precision {
            fsdp::config::MixedPrecision::No => 4,
            _ => 2,
        },
    })
}
