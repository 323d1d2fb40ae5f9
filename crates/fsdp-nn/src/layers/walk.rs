//! Walks over a model's layers: every `Linear` visited, and QLoRA's base made by keeping
//! them quantized.

use super::Linear;
use crate::module::Module;
use crate::quant::format::{QuantError, QuantFormat};

/// Calls `f` on every linear layer under `m`.
pub fn visit_linears(m: &mut dyn Module, f: &mut dyn FnMut(&mut Linear)) {
    if let Some(linear) = m.as_layer_mut().and_then(|l| l.downcast_mut::<Linear>()) {
        f(linear);
        return;
    }
    for child in m.children_mut() {
        visit_linears(child, f);
    }
}

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
