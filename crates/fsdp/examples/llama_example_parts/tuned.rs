//! llama_example's two kinds of fine-tuning: every weight of the Llama, or LoRA adapters on
//! it (`--lora_r`), and how each saves what it trained.

use std::path::Path;

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

    /// Saves what was trained into `out`; returns what was saved where, for the run's last
    /// line.
    fn save(acc: &Accelerator, model: &PreparedModel<Self>, out: &Saved) -> Result<String>;

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

    fn save(acc: &Accelerator, model: &PreparedModel<Self>, out: &Saved) -> Result<String> {
        let dir = acc.save_model(model, &out.dir.join("model"), out.hf_config)?;
        out.add_tokenizer(acc, &dir)?;
        Ok(format!("model saved to {}", dir.display()))
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

    /// The adapters in PEFT's format (and with `--merge_lora` the merged model). Their
    /// `base_model_name_or_path` is a folder transformers loads: the `--model_dir` the base
    /// came from, or, for a GGUF file, the base written once as `OUTPUT_DIR/base` (the
    /// dequantized weights the adapters were trained on), so
    /// `AutoPeftModelForCausalLM.from_pretrained(adapter)` finds it.
    fn save(acc: &Accelerator, model: &PreparedModel<Self>, out: &Saved) -> Result<String> {
        let from_folder = out.base.is_dir();
        let base = if from_folder {
            out.base.to_path_buf()
        } else {
            let base = acc.save_base(model, &out.dir.join("base"), out.hf_config)?;
            out.add_tokenizer(acc, &base)?;
            base
        };
        // Absolute: Python resolves a relative one against wherever it runs.
        let base = std::path::absolute(&base)?;
        let dir = out.dir.join("adapter");
        acc.save_adapter(model, &dir, "CAUSAL_LM", Some(&base.display().to_string()))?;
        out.add_tokenizer(acc, &dir)?;
        let mut saved = format!(
            "LoRA adapters saved to {} (PEFT's format, base_model_name_or_path {}{})",
            dir.display(),
            base.display(),
            if from_folder {
                String::new()
            } else {
                format!(": {} as a transformers folder", out.base.display())
            }
        );
        if out.merge {
            let merged = acc.save_merged(model, &out.dir.join("model"), out.hf_config)?;
            out.add_tokenizer(acc, &merged)?;
            saved += &format!("; merged into {}", merged.display());
        }
        Ok(saved)
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
