//! Merging adapters into the base weights (PEFT's `merge_and_unload`): `W += scaling · B·A`
//! (transposed for [in, out] weights), so a plain model folder needs no adapter code.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use super::{LoraConfig, PeftError};

/// Merges every adapter in `state` (a state dict with `X.lora_A.weight` and
/// `X.lora_B.weight` beside `X.weight`, as [`crate::accelerator::Accelerator::get_state_dict`]
/// gives for a [`super::LoraModel`], or base weights with [`super::AdapterFile::tensors`]
/// added) into its layer's weight and removes the adapter tensors. `fan_in_fan_out`: the
/// weights are stored [in, out] (GPT-2's `Conv1D`). Returns the merged layers' paths.
pub fn merge_adapter(
    state: &mut BTreeMap<String, Tensor>,
    config: &LoraConfig,
    fan_in_fan_out: bool,
) -> Result<Vec<String>, PeftError> {
    let layers: Vec<String> = state
        .keys()
        .filter_map(|k| k.strip_suffix(".lora_A.weight").map(String::from))
        .collect();
    let scaling = config.scaling();
    let bad = |layer: &str, why: String| PeftError::OtherBase {
        path: "state dict".into(),
        name: format!("{layer}.lora_A.weight"),
        why,
    };
    for layer in &layers {
        let a = state.remove(&format!("{layer}.lora_A.weight"));
        let b = state.remove(&format!("{layer}.lora_B.weight"));
        let (Some(a), Some(b)) = (a, b) else {
            return Err(bad(layer, "lora_B.weight missing".into()));
        };
        let weight = format!("{layer}.weight");
        let w = state
            .get(&weight)
            .ok_or_else(|| bad(layer, format!("no base weight `{weight}`")))?;
        let update = || -> candle_core::Result<Tensor> {
            let ba = b.to_dtype(DType::F32)?.matmul(&a.to_dtype(DType::F32)?)?;
            let ba = if fan_in_fan_out { ba.t()? } else { ba };
            let ba = (ba * scaling)?;
            if ba.dims() != w.dims() {
                candle_core::bail!("B·A is {:?}, the weight {:?}", ba.dims(), w.dims());
            }
            (w.to_dtype(DType::F32)? + ba)?.to_dtype(w.dtype())
        };
        let merged = update().map_err(|e| bad(layer, e.to_string()))?;
        state.insert(weight, merged);
    }
    if let Some(stray) = state.keys().find(|k| k.ends_with(".lora_B.weight")) {
        return Err(bad(stray, "lora_A.weight missing".into()));
    }
    Ok(layers)
}

/// A safetensors tensor's values as f32 (f32, bf16 and f16 files).
pub(super) fn f32_values(view: &safetensors::tensor::TensorView<'_>) -> Result<Vec<f32>, String> {
    let data = view.data();
    Ok(match view.dtype() {
        safetensors::Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        safetensors::Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        safetensors::Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "dtype {other:?}: adapters are read in f32, bf16 or f16"
            ));
        }
    })
}
