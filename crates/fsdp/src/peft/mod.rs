//! Parameter-efficient fine-tuning as Hugging Face PEFT does it: LoRA adapters on the linear
//! layers a `target_modules` pattern picks ([`LoraConfig`]), the base model frozen (no
//! gradient, no optimizer state: only the adapters are reduced and updated under FSDP), and
//! adapters in PEFT's files (`adapter_config.json`, `adapter_model.safetensors` with PEFT's
//! tensor names), which Python `peft` loads onto transformers' model, and merged into the
//! base weights for a plain `save_pretrained` folder ([`merge_adapter`]).

mod files;
mod merge;
mod targets;

pub use files::{AdapterFile, AdapterWeights, LoraOverrides, PEFT_PREFIX};
pub use merge::{BaseEmit, MergingEmit, merge_adapter};
pub use targets::TargetModules;

use std::ops::Deref;
use std::sync::{Arc, Mutex};

use candle_core::Result as CandleResult;

use crate::nn::lora::LoraAdapter;
pub use crate::nn::lora::LoraInit;
use crate::nn::{Forward, Model, Module, ModuleInfo, Params};

/// Why adapters could not be made, saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum PeftError {
    /// A setting is out of range (`r` 0, dropout outside [0, 1), ...).
    #[error("LoRA setting `{key}` = {value}: {why}")]
    Setting {
        /// The setting's name as PEFT spells it.
        key: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        why: &'static str,
    },
    /// `target_modules` picked no linear layer of the model.
    #[error(
        "LoRA target_modules {targets} matches no linear layer of the model (its linear layers: {examples})"
    )]
    NoTarget {
        /// The pattern.
        targets: String,
        /// Some of the model's linear layers, to pick from.
        examples: String,
    },
    /// `target_modules` is a regular expression that does not compile.
    #[error("LoRA target_modules regex `{pattern}`: {why}")]
    BadRegex {
        /// The pattern.
        pattern: String,
        /// The regex crate's message.
        why: String,
    },
    /// A module the pattern matched cannot take an adapter (its parent does not list its
    /// children mutably: [`Module::children_mut`]).
    #[error(
        "LoRA: module `{path}` matches target_modules but cannot be reached to add an adapter ({why})"
    )]
    Unreachable {
        /// The module.
        path: String,
        /// Why.
        why: &'static str,
    },
    /// An adapter folder is unreadable or not a LoRA adapter we can use.
    #[error("{path}: {why}")]
    AdapterFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A setting given explicitly contradicts the one the adapter was saved with.
    #[error(
        "{path}: `{key}` is {saved} in the adapter, but {explicit} was asked for: continuing an adapter with another setting would start from a different model; drop the setting or match the adapter"
    )]
    Contradiction {
        /// The adapter's `adapter_config.json`.
        path: std::path::PathBuf,
        /// The setting (PEFT's name).
        key: &'static str,
        /// The adapter's value.
        saved: String,
        /// The value asked for.
        explicit: String,
    },
    /// An adapter made for another base model: a tensor's module or shape does not fit.
    #[error(
        "{path}: adapter tensor `{name}` does not fit this model ({why}): the adapter was made for another base model"
    )]
    OtherBase {
        /// The adapter file.
        path: std::path::PathBuf,
        /// The tensor (PEFT's name).
        name: String,
        /// What does not fit.
        why: String,
    },
}

/// PEFT's `LoraConfig`: which linear layers get an adapter and its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank r of `B·A` (≥ 1).
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (`alpha / √r` with rsLoRA).
    pub lora_alpha: f64,
    /// Dropout on an adapter's input while training, in [0, 1).
    pub lora_dropout: f64,
    /// The layers that get one.
    pub target_modules: TargetModules,
    /// rsLoRA's scaling, `alpha / √r` (Kalajdzievski 2023).
    pub use_rslora: bool,
    /// How fresh adapters start (PEFT's `init_lora_weights`: `true`, `"gaussian"`, `false`);
    /// adapters continued from a file keep the file's value.
    pub init_lora_weights: LoraInit,
}

impl LoraConfig {
    /// PEFT's defaults (r 8, alpha 8, no dropout) on `target_modules`.
    pub fn new(target_modules: TargetModules) -> LoraConfig {
        LoraConfig {
            r: 8,
            lora_alpha: 8.0,
            lora_dropout: 0.0,
            target_modules,
            use_rslora: false,
            init_lora_weights: LoraInit::Default,
        }
    }

    /// The factor on `B·A`.
    pub fn scaling(&self) -> f64 {
        let r = self.r as f64;
        if self.use_rslora {
            self.lora_alpha / r.sqrt()
        } else {
            self.lora_alpha / r
        }
    }

    /// Checks the settings' ranges.
    pub fn check(&self) -> Result<(), PeftError> {
        if self.r == 0 {
            return Err(PeftError::Setting {
                key: "r",
                value: "0".into(),
                why: "the rank must be at least 1",
            });
        }
        if self.r > MAX_RANK {
            return Err(PeftError::Setting {
                key: "r",
                value: self.r.to_string(),
                why: "more than any adapter has (at most 2^20)",
            });
        }
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            return Err(PeftError::Setting {
                key: "lora_alpha",
                value: self.lora_alpha.to_string(),
                why: "must be a positive number",
            });
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(PeftError::Setting {
                key: "lora_dropout",
                value: self.lora_dropout.to_string(),
                why: "must be in [0, 1)",
            });
        }
        self.target_modules.check()
    }
}

/// The largest rank accepted (a rank beyond a layer's width adds nothing).
pub const MAX_RANK: usize = 1 << 20;

/// Whether `name` is an adapter's parameter (`….lora_A.weight`, `….lora_B.weight`).
pub fn is_adapter_param(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// A model with LoRA adapters on the linear layers its config targets and every other
/// parameter frozen (PEFT's `get_peft_model`). It is the base model for everything else
/// (dereferences to it), so its forward and loss methods are the base's; prepare it like any
/// model, with [`LoraModel::weights`] as its initial weights.
pub struct LoraModel<M> {
    base: M,
    config: LoraConfig,
    adapted: Vec<String>,
    seed: Arc<Mutex<Option<u64>>>,
}

impl<M: Model> LoraModel<M> {
    /// Adds an adapter to every linear layer of `base` that `config.target_modules` matches.
    /// An error when the settings are out of range or the pattern matches nothing.
    pub fn new(mut base: M, config: LoraConfig) -> Result<LoraModel<M>, PeftError> {
        config.check()?;
        let info = base.info();
        let linears: Vec<&ModuleInfo> = info
            .modules()
            .into_iter()
            .filter(|m| targets::is_linear(m))
            .collect();
        let matcher = config.target_modules.matcher()?;
        let wanted: Vec<String> = linears
            .iter()
            .filter(|m| matcher.matches(&m.path))
            .map(|m| m.path.clone())
            .collect();
        if wanted.is_empty() {
            let mut examples: Vec<&str> = linears.iter().map(|m| m.path.as_str()).collect();
            examples.truncate(8);
            return Err(PeftError::NoTarget {
                targets: config.target_modules.to_string(),
                examples: if examples.is_empty() {
                    "none".into()
                } else {
                    examples.join(", ")
                },
            });
        }
        let seed = Arc::new(Mutex::new(None));
        let adapter = LoraAdapter::new(
            config.r,
            config.scaling(),
            config.lora_dropout,
            seed.clone(),
        )
        .with_init(config.init_lora_weights);
        let mut reached = Vec::new();
        crate::nn::layers::visit_linears(&mut base, &mut |linear| {
            let path = crate::nn::Module::path(linear).to_string();
            if wanted.contains(&path) {
                linear.set_lora(adapter.clone());
                reached.push(path);
            }
        });
        if let Some(missed) = wanted.iter().find(|w| !reached.contains(w)) {
            return Err(PeftError::Unreachable {
                path: missed.clone(),
                why: "a module above it does not implement Module::children_mut",
            });
        }
        Ok(LoraModel {
            base,
            config,
            adapted: wanted,
            seed,
        })
    }
}

impl<M> LoraModel<M> {
    /// The configuration the adapters were made with.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The paths of the linear layers that have an adapter, in module order.
    pub fn adapted(&self) -> &[String] {
        &self.adapted
    }

    /// The base model (with its adapters inside its linear layers).
    pub fn base(&self) -> &M {
        &self.base
    }

    /// The base model, mutably (its dropout seed, ...).
    pub fn base_mut(&mut self) -> &mut M {
        &mut self.base
    }

    /// Training mode: adapter dropout draws its masks from `seed` (a new one each step);
    /// `None` is evaluation mode. The base model's own dropout is set on the base.
    pub fn set_dropout_seed(&self, seed: Option<u64>) {
        *self.seed.lock().unwrap_or_else(|e| e.into_inner()) = seed;
    }

    /// The leaf names of the adapted layers (`q_proj`, `v_proj`), sorted: what
    /// `adapter_config.json` lists as `target_modules`.
    pub fn target_leaf_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .adapted
            .iter()
            .map(|p| p.rsplit('.').next().unwrap_or(p).to_string())
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

impl<M> Deref for LoraModel<M> {
    type Target = M;

    fn deref(&self) -> &M {
        &self.base
    }
}

impl<M: Module> Module for LoraModel<M> {
    fn path(&self) -> &str {
        self.base.path()
    }

    /// The base's tree with every parameter frozen but the adapters'.
    fn info(&self) -> ModuleInfo {
        freeze_all_but_adapters(self.base.info())
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        self.base.children_mut()
    }
}

impl<M: Model> Model for LoraModel<M> {
    fn no_split_modules(&self) -> &'static [&'static str] {
        self.base.no_split_modules()
    }
}

impl<I, M: Forward<I>> Forward<I> for LoraModel<M> {
    type Output = M::Output;

    fn forward(&self, p: &dyn Params, input: I) -> CandleResult<M::Output> {
        self.base.forward(p, input)
    }
}

fn freeze_all_but_adapters(mut info: ModuleInfo) -> ModuleInfo {
    for p in &mut info.params {
        if !is_adapter_param(&p.name) {
            p.requires_grad = false;
        }
    }
    info.children = info
        .children
        .into_iter()
        .map(freeze_all_but_adapters)
        .collect();
    info
}
