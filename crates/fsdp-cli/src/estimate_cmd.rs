//! `fsdp estimate-memory`: the unit plan and per-rank memory of a model under a
//! configuration, before any process starts (like `accelerate estimate-memory`, but for the
//! sharded layout fsdp-rs will use).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use fsdp::engine::UnitPlan;
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
    println!("{name}: {} parameters", info.num_params());
    print!("{}", plan.render());
    Ok(())
}
