//! PEFT's adapter folder: `adapter_config.json` (a `LoraConfig`) and
//! `adapter_model.safetensors`, whose tensors are the model's adapter parameters named
//! `base_model.model.<name>` (PEFT saves without the adapter's name, `default`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Result as CandleResult;
use serde_json::{Value, json};

use super::{LoraConfig, LoraInit, LoraModel, PeftError, TargetModules, is_adapter_param};
use crate::nn::{Module, ParamSpec, SeededWeights, WeightSource};

/// What PEFT puts before a model's parameter names in an adapter file.
pub const PEFT_PREFIX: &str = "base_model.model.";

impl<M: Module> LoraModel<M> {
    /// `adapter_config.json` for these adapters (`task_type` such as `CAUSAL_LM`, the base
    /// model's name or folder), in the fields PEFT's `LoraConfig` reads.
    pub fn adapter_config(&self, task_type: &str, base_model: Option<&str>) -> Value {
        let c = &self.config;
        let targets = match &c.target_modules {
            TargetModules::Regex(pattern) => json!(pattern),
            // PEFT too saves the names "all-linear" resolved to.
            _ => json!(self.target_leaf_names()),
        };
        json!({
            "peft_type": "LORA",
            "task_type": task_type,
            "base_model_name_or_path": base_model,
            "r": c.r,
            "lora_alpha": c.lora_alpha,
            "lora_dropout": c.lora_dropout,
            "target_modules": targets,
            "use_rslora": c.use_rslora,
            "bias": "none",
            "fan_in_fan_out": self.fan_in_fan_out(),
            "init_lora_weights": init_value(c.init_lora_weights),
            "inference_mode": true,
            "modules_to_save": null,
            "use_dora": false,
            "revision": null,
        })
    }

    /// Whether the adapted layers store weights [in, out] (GPT-2's `Conv1D`).
    pub fn fan_in_fan_out(&self) -> bool {
        self.base
            .info()
            .modules()
            .iter()
            .any(|m| m.type_name == "Conv1D" && self.adapted.contains(&m.path))
    }

    /// The model's initial weights: the adapters' from `adapter` when given (continuing from
    /// saved adapters; checked to fit), else seeded as PEFT initialises them (A uniform, B
    /// zero, so training starts from the base exactly); everything else from `base`.
    pub fn weights<'a>(
        &self,
        base: &'a dyn WeightSource,
        adapter: Option<&'a AdapterFile>,
        seed: u64,
    ) -> Result<AdapterWeights<'a>, PeftError> {
        if let Some(file) = adapter {
            if file.fan_in_fan_out != self.fan_in_fan_out() {
                return Err(PeftError::Contradiction {
                    path: file.dir.join("adapter_config.json"),
                    key: "fan_in_fan_out",
                    saved: file.fan_in_fan_out.to_string(),
                    explicit: format!(
                        "{} (this model's adapted layers store weights {})",
                        self.fan_in_fan_out(),
                        if self.fan_in_fan_out() {
                            "[in, out]"
                        } else {
                            "[out, in]"
                        }
                    ),
                });
            }
            file.check_fits(&self.info())?;
        }
        Ok(AdapterWeights {
            base,
            adapter,
            seed: SeededWeights(seed),
        })
    }
}

/// PEFT's `init_lora_weights` value for `init`.
fn init_value(init: LoraInit) -> Value {
    match init {
        LoraInit::Default => json!(true),
        LoraInit::Gaussian => json!("gaussian"),
        LoraInit::Random => json!(false),
    }
}

/// The `init_lora_weights` of an adapter's config; the schemes that change the base weights
/// or need data (PiSSA, OLoRA, CorDA, LoftQ, EVA) are refused: their adapters belong to a
/// base PEFT modified, which loading them on the original base would silently not be.
fn init_of(v: Option<&Value>) -> Result<LoraInit, String> {
    match v {
        None | Some(Value::Bool(true)) => Ok(LoraInit::Default),
        Some(Value::Bool(false)) => Ok(LoraInit::Random),
        Some(Value::String(s)) if s == "gaussian" => Ok(LoraInit::Gaussian),
        Some(other) => Err(format!(
            "init_lora_weights = {other}: not supported (true, false or \"gaussian\"; PiSSA, OLoRA, CorDA, LoftQ and EVA adapters expect a base PEFT changed)"
        )),
    }
}

/// LoRA settings a program or command line gave explicitly, for continuing from an adapter
/// ([`AdapterFile::config_with`]): `None` takes the adapter's own.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraOverrides {
    /// The rank.
    pub r: Option<usize>,
    /// `lora_alpha`.
    pub lora_alpha: Option<f64>,
    /// `lora_dropout`.
    pub lora_dropout: Option<f64>,
    /// `target_modules` (the adapter's tensors must still be exactly the adapted layers).
    pub target_modules: Option<TargetModules>,
    /// rsLoRA's scaling.
    pub use_rslora: Option<bool>,
}

/// A saved LoRA adapter: its configuration and tensors by the model's parameter names.
#[derive(Debug, Clone)]
pub struct AdapterFile {
    /// The folder it was read from.
    pub dir: PathBuf,
    /// Its configuration.
    pub config: LoraConfig,
    /// Whether its layers store weights [in, out] (`fan_in_fan_out`).
    pub fan_in_fan_out: bool,
    /// Tensors by parameter name (`model.layers.0.self_attn.q_proj.lora_A.weight`): shape and
    /// values.
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

impl AdapterFile {
    /// Reads the PEFT adapter folder `dir`.
    pub fn read(dir: &Path) -> Result<AdapterFile, PeftError> {
        let config_path = dir.join("adapter_config.json");
        let bad = |path: &Path, why: String| PeftError::AdapterFile {
            path: path.to_path_buf(),
            why,
        };
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| bad(&config_path, format!("cannot read: {e}")))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| bad(&config_path, format!("not JSON: {e}")))?;
        let field = |k: &str| v.get(k).filter(|x| !x.is_null());
        let peft_type = field("peft_type").and_then(Value::as_str).unwrap_or("");
        if peft_type != "LORA" {
            return Err(bad(
                &config_path,
                format!("peft_type {peft_type:?}: only LORA adapters are read"),
            ));
        }
        for (key, off) in [("use_dora", json!(false)), ("bias", json!("none"))] {
            if let Some(x) = field(key)
                && *x != off
            {
                return Err(bad(
                    &config_path,
                    format!("{key} = {x}: not supported (only {off})"),
                ));
            }
        }
        let number = |k: &str| -> Result<f64, PeftError> {
            field(k)
                .and_then(Value::as_f64)
                .ok_or_else(|| bad(&config_path, format!("`{k}` missing or not a number")))
        };
        let targets = match field("target_modules") {
            Some(Value::String(s)) if s == "all-linear" => TargetModules::AllLinear,
            Some(Value::String(s)) => TargetModules::Regex(s.clone()),
            Some(Value::Array(items)) => TargetModules::Names(
                items
                    .iter()
                    .map(|x| x.as_str().map(String::from))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad(&config_path, "target_modules: not strings".into()))?,
            ),
            _ => return Err(bad(&config_path, "`target_modules` missing".into())),
        };
        let r = number("r")?;
        if r.fract() != 0.0 || r < 0.0 {
            return Err(bad(&config_path, format!("r = {r}: not a whole number")));
        }
        if r > super::MAX_RANK as f64 {
            return Err(bad(
                &config_path,
                format!(
                    "r = {r}: more than any adapter has (at most {})",
                    super::MAX_RANK
                ),
            ));
        }
        let config = LoraConfig {
            r: r as usize,
            lora_alpha: number("lora_alpha")?,
            lora_dropout: field("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0),
            target_modules: targets,
            use_rslora: field("use_rslora")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            init_lora_weights: init_of(v.get("init_lora_weights"))
                .map_err(|why| bad(&config_path, why))?,
        };
        config
            .check()
            .map_err(|e| bad(&config_path, e.to_string()))?;
        let weights_path = dir.join("adapter_model.safetensors");
        let bytes = std::fs::read(&weights_path)
            .map_err(|e| bad(&weights_path, format!("cannot read: {e}")))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(&weights_path, format!("not a safetensors file: {e}")))?;
        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            let ours = name
                .strip_prefix(PEFT_PREFIX)
                .filter(|n| is_adapter_param(n))
                .ok_or_else(|| {
                    bad(
                        &weights_path,
                        format!(
                            "tensor `{name}` is not a LoRA weight named as PEFT names them ({PEFT_PREFIX}….lora_A.weight)"
                        ),
                    )
                })?;
            let values = super::merge::f32_values(&view)
                .map_err(|why| bad(&weights_path, format!("tensor `{name}`: {why}")))?;
            if let Some(i) = values.iter().position(|x| !x.is_finite()) {
                return Err(bad(
                    &weights_path,
                    format!("tensor `{name}`: value {i} is {}: not finite", values[i]),
                ));
            }
            // lora_A is [r, in], lora_B [out, r]: the rank the config says.
            let shape = view.shape().to_vec();
            let rank = match (shape.as_slice(), name.ends_with(".lora_A.weight")) {
                ([r, _], true) => Some(*r),
                ([_, r], false) => Some(*r),
                _ => None,
            };
            if rank != Some(config.r) {
                return Err(bad(
                    &weights_path,
                    format!(
                        "tensor `{name}` has shape {shape:?}, which is not a rank-{} adapter weight (`r` in adapter_config.json)",
                        config.r
                    ),
                ));
            }
            tensors.insert(ours.to_string(), (shape, values));
        }
        Ok(AdapterFile {
            dir: dir.to_path_buf(),
            config,
            fan_in_fan_out: field("fan_in_fan_out")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            tensors,
        })
    }

    /// The configuration to continue this adapter with: its own, where `explicit` sets
    /// nothing; an error naming both values where `explicit` contradicts it (continuing with
    /// another rank, alpha, rsLoRA or dropout would start from a different model).
    pub fn config_with(&self, explicit: &LoraOverrides) -> Result<LoraConfig, PeftError> {
        let mut config = self.config.clone();
        let path = self.dir.join("adapter_config.json");
        let clash = |key: &'static str, saved: String, asked: String| PeftError::Contradiction {
            path: path.clone(),
            key,
            saved,
            explicit: asked,
        };
        if let Some(r) = explicit.r.filter(|&r| r != config.r) {
            return Err(clash("r", config.r.to_string(), r.to_string()));
        }
        if let Some(a) = explicit.lora_alpha.filter(|&a| a != config.lora_alpha) {
            return Err(clash(
                "lora_alpha",
                config.lora_alpha.to_string(),
                a.to_string(),
            ));
        }
        if let Some(d) = explicit.lora_dropout.filter(|&d| d != config.lora_dropout) {
            return Err(clash(
                "lora_dropout",
                config.lora_dropout.to_string(),
                d.to_string(),
            ));
        }
        if let Some(u) = explicit.use_rslora.filter(|&u| u != config.use_rslora) {
            return Err(clash(
                "use_rslora",
                config.use_rslora.to_string(),
                u.to_string(),
            ));
        }
        if let Some(t) = &explicit.target_modules {
            config.target_modules = t.clone();
        }
        Ok(config)
    }

    /// Checks that every tensor is an adapter parameter of `model` with its shape, and that
    /// the model has no adapter the file lacks.
    pub fn check_fits(&self, model: &crate::nn::ModuleInfo) -> Result<(), PeftError> {
        let path = self.dir.join("adapter_model.safetensors");
        let specs: BTreeMap<&str, &ParamSpec> = model
            .all_params()
            .into_iter()
            .filter(|p| is_adapter_param(&p.name))
            .map(|p| (p.name.as_str(), p))
            .collect();
        let other = |name: &str, why: String| PeftError::OtherBase {
            path: path.clone(),
            name: format!("{PEFT_PREFIX}{name}"),
            why,
        };
        for (name, (shape, _)) in &self.tensors {
            let spec = specs
                .get(name.as_str())
                .ok_or_else(|| other(name, "the model has no such adapter".into()))?;
            if spec.shape != *shape {
                return Err(other(
                    name,
                    format!("shape {shape:?}, the model's {:?}", spec.shape),
                ));
            }
        }
        if let Some(missing) = specs.keys().find(|n| !self.tensors.contains_key(**n)) {
            return Err(other(
                missing,
                format!(
                    "missing from the file: the adapter's target_modules ({}) are not the layers adapted here",
                    self.config.target_modules
                ),
            ));
        }
        Ok(())
    }
}

/// A [`LoraModel`]'s initial weights ([`LoraModel::weights`]).
pub struct AdapterWeights<'a> {
    base: &'a dyn WeightSource,
    adapter: Option<&'a AdapterFile>,
    seed: SeededWeights,
}

impl WeightSource for AdapterWeights<'_> {
    fn values(&self, spec: &ParamSpec) -> CandleResult<Vec<f32>> {
        if !is_adapter_param(&spec.name) {
            return self.base.values(spec);
        }
        match self.adapter {
            Some(file) => file
                .tensors
                .get(&spec.name)
                .map(|(_, v)| v.clone())
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "{}: no adapter tensor {}",
                        file.dir.display(),
                        spec.name
                    ))
                }),
            None => self.seed.values(spec),
        }
    }

    fn read_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> CandleResult<()>,
    ) -> CandleResult<()> {
        if is_adapter_param(&spec.name) {
            take(0, &self.values(spec)?)
        } else {
            self.base.read_rows(spec, take)
        }
    }

    fn packed_rows(
        &self,
        spec: &ParamSpec,
        take: &mut dyn FnMut(usize, &[f32]) -> CandleResult<()>,
    ) -> CandleResult<()> {
        self.base.packed_rows(spec, take)
    }

    fn device(&self) -> candle_core::Device {
        self.base.device()
    }
}
