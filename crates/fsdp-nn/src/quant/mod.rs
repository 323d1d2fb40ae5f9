//! Quantized weights for QLoRA: a frozen base weight kept as blocks of a quantized format
//! (llama.cpp's GGML block types, as GGUF files store them, or bitsandbytes' NF4), row by row,
//! and dequantized only where a product uses it.
//!
//! A quantized weight `[rows, cols]` is held as a parameter `[rows, words]` of 32-bit words:
//! each row's blocks, padded to whole words ([`Packing::row_words`]). The engine shards,
//! gathers, releases and checkpoints those words bit for bit like any parameter's elements
//! (an all-gather moves the quantized bytes, ~1/7 of f32's for 4-bit formats); only the
//! quantized ops read them, as bytes. They are never values: no optimizer, cast or gradient
//! touches them (a quantized weight is frozen, and mixed precision is refused with one).

pub(crate) mod format;

pub use format::{Packing, QuantError, QuantFormat};

use super::Module;
use super::layers::visit_linears;

/// Keeps every linear layer of `model` but the output head (`lm_head`, as bitsandbytes and
/// transformers keep it) frozen and quantized in `format`: QLoRA's base, to which
/// `fsdp::peft::LoraModel` then adds adapters. Returns the layers' paths; an error names a
/// layer whose input size is not whole blocks of `format`.
pub fn quantize_linears(
    model: &mut dyn Module,
    format: QuantFormat,
) -> Result<Vec<String>, QuantError> {
    let wanted: Vec<String> = model
        .info()
        .modules()
        .into_iter()
        .filter(|m| matches!(m.type_name, "Linear" | "Conv1D") && !is_head(&m.path))
        .map(|m| m.path.clone())
        .collect();
    if wanted.is_empty() {
        return Err(QuantError::NoLinear);
    }
    let mut done = Vec::new();
    let mut failed = None;
    visit_linears(model, &mut |linear| {
        let path = linear.path().to_string();
        if failed.is_some() || !wanted.contains(&path) {
            return;
        }
        match linear.set_quantized(format) {
            Ok(()) => done.push(path),
            Err(e) => failed = Some(e),
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if let Some(missed) = wanted.iter().find(|w| !done.contains(w)) {
        return Err(QuantError::Unreachable {
            path: missed.clone(),
        });
    }
    Ok(done)
}

/// Whether `path` is a model's output head, which stays in full precision.
fn is_head(path: &str) -> bool {
    path.rsplit('.').next() == Some("lm_head")
}
