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

/// The base weights alone while a save streams them: the adapters are left out, every other
/// tensor written as it arrives. The folder a saved adapter's `base_model_name_or_path`
/// names when the base came from somewhere Python cannot load (a GGUF file).
pub struct BaseEmit;

impl crate::checkpoint::Emit for BaseEmit {
    fn plan(&mut self, names: Vec<(String, Vec<usize>)>) -> Vec<(String, Vec<usize>)> {
        names
            .into_iter()
            .filter(|(n, _)| !super::is_adapter_param(n))
            .collect()
    }

    fn emit(
        &mut self,
        name: &str,
        values: &[&[f32]],
        write: &mut crate::checkpoint::WriteTensor,
    ) -> Result<(), crate::checkpoint::CheckpointError> {
        if super::is_adapter_param(name) {
            return Ok(());
        }
        write(values)
    }
}

/// Merges adapters while a save streams the weights ([`crate::checkpoint::save_pretrained_as`]):
/// each adapted layer's weight is held until its `lora_A` and `lora_B` arrive (in the same
/// unit), then written as `W + scaling · B·A`; the adapters themselves are not written, and
/// every other tensor goes out in the plan's order (held while an earlier one waits). At most
/// one unit's tensors are held: the merged model is never whole in memory.
pub struct MergingEmit {
    scaling: f32,
    /// Weights stored [in, out] (GPT-2's Conv1D).
    fan_in_fan_out: bool,
    /// Weights with an adapter, by layer path.
    adapted: std::collections::HashSet<String>,
    /// The tensors to write, in order, and the next one's index.
    order: Vec<String>,
    next: usize,
    /// Arrived tensors waiting for their turn, and adapters waiting for their weight.
    held: std::collections::HashMap<String, Vec<f32>>,
    /// (rows, columns) of each adapted weight as stored.
    dims: std::collections::HashMap<String, (usize, usize)>,
}

impl MergingEmit {
    /// A merge of the adapters of `config`; `fan_in_fan_out`: the weights are stored
    /// [in, out] (GPT-2's `Conv1D`), as [`merge_adapter`] takes it.
    pub fn new(config: &LoraConfig, fan_in_fan_out: bool) -> MergingEmit {
        MergingEmit {
            scaling: config.scaling() as f32,
            fan_in_fan_out,
            adapted: Default::default(),
            order: Vec::new(),
            next: 0,
            held: Default::default(),
            dims: Default::default(),
        }
    }

    /// The merged weight of `layer` once its weight and both adapters are held.
    fn try_merge(&mut self, layer: &str) -> Option<Vec<f32>> {
        let (a_name, b_name) = (
            format!("{layer}.lora_A.weight"),
            format!("{layer}.lora_B.weight"),
        );
        let weight = format!("{layer}.weight");
        if !(self.held.contains_key(&a_name)
            && self.held.contains_key(&b_name)
            && self.held.contains_key(&weight))
        {
            return None;
        }
        let (a, b) = (self.held.remove(&a_name)?, self.held.remove(&b_name)?);
        let mut w = self.held.remove(&weight)?;
        let (rows, cols) = self.dims[layer];
        let (out, inp) = if self.fan_in_fan_out {
            (cols, rows)
        } else {
            (rows, cols)
        };
        let r = a.len() / inp.max(1);
        // W[o, i] (or W[i, o]) += scaling · Σ_k B[o, k] A[k, i]: rank r is small, plain loops.
        for o in 0..out {
            for k in 0..r {
                let s = self.scaling * b[o * r + k];
                let a = &a[k * inp..(k + 1) * inp];
                if self.fan_in_fan_out {
                    for (i, a) in a.iter().enumerate() {
                        w[i * out + o] += s * a;
                    }
                } else {
                    for (x, a) in w[o * inp..(o + 1) * inp].iter_mut().zip(a) {
                        *x += s * a;
                    }
                }
            }
        }
        Some(w)
    }
}

impl crate::checkpoint::Emit for MergingEmit {
    fn plan(&mut self, names: Vec<(String, Vec<usize>)>) -> Vec<(String, Vec<usize>)> {
        let shapes: std::collections::HashMap<&str, &[usize]> = names
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        for (name, _) in &names {
            let Some(layer) = name.strip_suffix(".lora_A.weight") else {
                continue;
            };
            if let Some(&[out, inp]) = shapes.get(format!("{layer}.weight").as_str()) {
                self.adapted.insert(layer.to_string());
                self.dims.insert(layer.to_string(), (*out, *inp));
            }
        }
        let kept = BaseEmit.plan(names);
        self.order = kept.iter().map(|(n, _)| n.clone()).collect();
        kept
    }

    fn emit(
        &mut self,
        name: &str,
        values: &[&[f32]],
        write: &mut crate::checkpoint::WriteTensor,
    ) -> Result<(), crate::checkpoint::CheckpointError> {
        if let Some(layer) = name
            .strip_suffix(".lora_A.weight")
            .or_else(|| name.strip_suffix(".lora_B.weight"))
            && !self.dims.contains_key(layer)
        {
            return Err(crate::checkpoint::CheckpointError::AdapterWithoutBase {
                name: name.to_string(),
                layer: layer.to_string(),
            });
        }
        self.held.insert(name.to_string(), values.concat());
        let layer = name
            .strip_suffix(".lora_A.weight")
            .or_else(|| name.strip_suffix(".lora_B.weight"))
            .or_else(|| {
                name.strip_suffix(".weight")
                    .filter(|l| self.adapted.contains(*l))
            })
            .map(str::to_string);
        if let Some(layer) = layer
            && let Some(merged) = self.try_merge(&layer)
        {
            self.held.insert(format!("{layer}.weight"), merged);
            self.adapted.remove(&layer);
        }
        while let Some(next) = self.order.get(self.next) {
            let waiting = next
                .strip_suffix(".weight")
                .is_some_and(|l| self.adapted.contains(l));
            let Some(values) = (!waiting).then(|| self.held.remove(next)).flatten() else {
                break;
            };
            write(&[&values])?;
            self.next += 1;
        }
        Ok(())
    }
}
