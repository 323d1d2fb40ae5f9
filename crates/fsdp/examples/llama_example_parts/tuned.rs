//! llama_example's two kinds of fine-tuning: every weight of the Llama, or LoRA adapters on
//! it (`--lora_r`), and how each saves what it trained.

use std::path::{Path, PathBuf};

use anyhow::Result;
use fsdp::accelerator::{Accelerator, PreparedModel};
use fsdp::models::LlamaForCausalLM;
use fsdp::models::llama::{TokenizerExtras, write_tokenizer_and_generation_files};
use fsdp::peft::LoraModel;

/// The model fine-tuned: the Llama itself, or LoRA adapters on it.
pub trait Tuned: fsdp::nn::Model + Sized {
    /// The Llama that forward and the loss run.
    fn llama(&self) -> &LlamaForCausalLM;

    /// Sets the adapters' dropout seed for a training step (`None`: evaluation).
    fn set_step_seed(&self, _seed: Option<u64>) {}

    /// Saves what was trained into `out`; returns the folder a transformers user loads.
    fn save(acc: &Accelerator, model: &PreparedModel<Self>, out: &Saved) -> Result<PathBuf>;

    /// For `--dump_batches`: what the trained weights start from that the pretrained file
    /// lacks (LoRA's initial adapters, in `dir/initial_adapter`), so the PyTorch anchor
    /// starts from the same.
    fn save_initial(_acc: &Accelerator, _model: &PreparedModel<Self>, _dir: &Path) -> Result<()> {
        Ok(())
    }
}

/// What a saved folder carries besides the weights.
pub struct Saved<'a> {
    pub dir: &'a Path,
    pub hf_config: &'a serde_json::Value,
    pub tokenizer: &'a tokenizers::Tokenizer,
    pub extras: &'a TokenizerExtras,
    pub base: &'a Path,
    pub merge: bool,
}

impl Saved<'_> {
    /// The tokenizer and generation files beside the weights in `dir` (rank 0).
    fn add_tokenizer(&self, acc: &Accelerator, dir: &Path) -> Result<()> {
        if acc.is_main_process() {
            write_tokenizer_and_generation_files(dir, self.hf_config, self.tokenizer, self.extras)?;
        }
        Ok(())
    }
}

impl Tuned for LlamaForCausalLM {
    fn llama(&self) -> &LlamaForCausalLM {
        self
    }

    fn save(acc: &Accelerator, model: &PreparedModel<Self>, out: &Saved) -> Result<PathBuf> {
        let dir = acc.save_model(model, &out.dir.join("model"), out.hf_config)?;
        out.add_tokenizer(acc, &dir)?;
        Ok(dir)
    }
}

impl Tuned for LoraModel<LlamaForCausalLM> {
    fn llama(&self) -> &LlamaForCausalLM {
        self.base()
    }

    fn set_step_seed(&self, seed: Option<u64>) {
        self.set_dropout_seed(seed);
    }

    fn save_initial(acc: &Accelerator, model: &PreparedModel<Self>, dir: &Path) -> Result<()> {
        acc.save_adapter(model, &dir.join("initial_adapter"), "CAUSAL_LM", None)?;
        Ok(())
    }

    /// The adapters in PEFT's format (and with `--merge_lora` the merged model).
    fn save(acc: &Accelerator, model: &PreparedModel<Self>, out: &Saved) -> Result<PathBuf> {
        let base = out.base.display().to_string();
        let dir = out.dir.join("adapter");
        acc.save_adapter(model, &dir, "CAUSAL_LM", Some(&base))?;
        out.add_tokenizer(acc, &dir)?;
        if out.merge {
            let merged = acc.save_merged(model, &out.dir.join("model"), out.hf_config)?;
            out.add_tokenizer(acc, &merged)?;
            acc.print(format!("adapters merged into {}", merged.display()));
        }
        Ok(dir)
    }
}

/// PEFT's `print_trainable_parameters`: the adapted projections and the trained share.
pub fn describe(lora: &LoraModel<LlamaForCausalLM>) -> String {
    let info = fsdp::nn::Module::info(lora);
    let trainable: usize = info
        .all_params()
        .iter()
        .filter(|p| p.requires_grad)
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    format!(
        "LoRA r {} on {} projections ({}): {trainable} trainable of {} parameters ({:.2}%)",
        lora.config().r,
        lora.adapted().len(),
        lora.target_leaf_names().join(", "),
        info.num_params(),
        100.0 * trainable as f64 / info.num_params() as f64
    )
}
