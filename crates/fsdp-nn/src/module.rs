//! A module system built for FSDP: a model describes its tree of modules (Hugging Face paths
//! and type names such as `BertLayer`) and their parameters up front, so wrap policies can
//! choose units and checkpoints can load by name; forward reads parameters through [`Params`],
//! which a single process backs with plain variables and the FSDP engine with gathered shards.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var};

use super::quant::format::Packing;
use crate::rng::{NormalRng, fnv1a};

/// How a parameter is initialised (Hugging Face's `_init_weights`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation (`initializer_range`).
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// All zeros (biases, LayerNorm bias).
    Zeros,
    /// All ones (LayerNorm weight).
    Ones,
    /// Uniform on `[-bound, bound]` (`kaiming_uniform_(a=√5)` gives `1/√fan_in`: LoRA's A).
    Uniform {
        /// Half the interval's width.
        bound: f64,
    },
}

/// A parameter a module owns.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Fully qualified Hugging Face name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Initialisation.
    pub init: Init,
    /// False for frozen parameters (no gradient, not updated).
    pub requires_grad: bool,
    /// The gradient is row-sparse (an embedding table's: only the rows a batch looks up are
    /// non-zero), so FSDP reduces the touched rows instead of the whole table
    /// (`nn.Embedding(sparse=True)`'s meaning; see [`crate::layers::Embedding::sparse`]).
    pub sparse_grad: bool,
    /// Kept quantized: `shape` is `[rows, words]`, the 32-bit words of each row's blocks,
    /// standing for a `[rows, packing.cols]` weight (frozen; see [`crate::quant`]).
    pub packing: Option<Packing>,
}

impl ParamSpec {
    /// The weight a quantized parameter stands for, as a plain f32 parameter (`[rows, cols]`,
    /// the same name and initialisation); a plain parameter itself.
    pub fn unpacked(&self) -> ParamSpec {
        let Some(p) = self.packing else {
            return self.clone();
        };
        ParamSpec {
            shape: vec![self.shape.first().copied().unwrap_or(0), p.cols],
            packing: None,
            ..self.clone()
        }
    }

    /// Elements of the weight it is (a quantized one's unquantized count, not its words).
    pub fn numel(&self) -> usize {
        match self.packing {
            Some(p) => self.shape.first().copied().unwrap_or(0) * p.cols,
            None => self.shape.iter().product(),
        }
    }

    /// The parameter's seeded initial values as f32 elements: for a quantized one, its
    /// words (the seeded weight it stands for, quantized).
    pub fn initial_f32(&self, seed: u64) -> Vec<f32> {
        let values = self.unpacked().initial_values(seed);
        let values: Vec<f32> = values.into_iter().map(|v| v as f32).collect();
        match self.packing {
            Some(p) => p.quantize(&values),
            None => values,
        }
    }

    /// The parameter's seeded initial values (a stream per parameter, keyed by its name, so
    /// one parameter is initialised without the others).
    pub fn initial_values(&self, seed: u64) -> Vec<f64> {
        let n: usize = self.shape.iter().product();
        match self.init {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Normal { std } => {
                let mut rng = NormalRng::new(seed ^ fnv1a(&self.name));
                (0..n).map(|_| rng.normal() * std).collect()
            }
            Init::Uniform { bound } => {
                let mut rng = NormalRng::new(seed ^ fnv1a(&self.name));
                (0..n)
                    .map(|_| (2.0 * rng.uniform() - 1.0) * bound)
                    .collect()
            }
        }
    }
}

/// A node of a model's module tree.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleInfo {
    /// Dotted path (`bert.encoder.layer.3`); empty for the root.
    pub path: String,
    /// The module's type name (`BertLayer`), as wrap policies name them.
    pub type_name: &'static str,
    /// Parameters owned directly by this module.
    pub params: Vec<ParamSpec>,
    /// Child modules in registration order.
    pub children: Vec<ModuleInfo>,
    /// Parameters owned by another module that this one also uses (tied weights, such as
    /// GPT-2's output projection reusing the token embedding): FSDP must keep both users in
    /// one unit.
    pub uses: Vec<String>,
}

impl ModuleInfo {
    /// A module with no parameters yet.
    pub fn new(path: impl Into<String>, type_name: &'static str) -> ModuleInfo {
        ModuleInfo {
            path: path.into(),
            type_name,
            params: Vec::new(),
            children: Vec::new(),
            uses: Vec::new(),
        }
    }

    /// Records that this module also uses `name`, owned elsewhere.
    pub fn uses(mut self, name: &str) -> ModuleInfo {
        self.uses.push(name.to_string());
        self
    }

    /// Every (user module path, parameter name) pair of tied parameters.
    pub fn tied(&self) -> Vec<(&str, &str)> {
        self.modules()
            .into_iter()
            .flat_map(|m| m.uses.iter().map(move |u| (m.path.as_str(), u.as_str())))
            .collect()
    }

    /// `path.leaf`, or `leaf` at the root.
    pub fn join(&self, leaf: &str) -> String {
        join(&self.path, leaf)
    }

    /// Adds a trainable parameter named `path.leaf`.
    pub fn param(mut self, leaf: &str, shape: &[usize], init: Init) -> ModuleInfo {
        let name = self.join(leaf);
        self.params.push(ParamSpec {
            name,
            shape: shape.to_vec(),
            init,
            requires_grad: true,
            sparse_grad: false,
            packing: None,
        });
        self
    }

    /// Adds a frozen parameter named `path.leaf` standing for a `[rows, packing.cols]` weight
    /// kept quantized as `packing` says (initialised as `init`, then quantized).
    pub fn packed_param(
        mut self,
        leaf: &str,
        rows: usize,
        packing: Packing,
        init: Init,
    ) -> ModuleInfo {
        let name = self.join(leaf);
        self.params.push(ParamSpec {
            name,
            shape: vec![rows, packing.row_words()],
            init,
            requires_grad: false,
            sparse_grad: false,
            packing: Some(packing),
        });
        self
    }

    /// Freezes every parameter whose name starts with `prefix` (no gradient, not updated).
    pub fn freeze(mut self, prefix: &str) -> ModuleInfo {
        for p in &mut self.params {
            if p.name.starts_with(prefix) {
                p.requires_grad = false;
            }
        }
        self.children = self
            .children
            .into_iter()
            .map(|c| c.freeze(prefix))
            .collect();
        self
    }

    /// Adds a child module.
    pub fn child(mut self, child: ModuleInfo) -> ModuleInfo {
        self.children.push(child);
        self
    }

    /// Every module, parents before children.
    pub fn modules(&self) -> Vec<&ModuleInfo> {
        let mut out = vec![self];
        for c in &self.children {
            out.extend(c.modules());
        }
        out
    }

    /// Every parameter in registration order.
    pub fn all_params(&self) -> Vec<&ParamSpec> {
        self.modules()
            .into_iter()
            .flat_map(|m| m.params.iter())
            .collect()
    }

    /// Total number of parameter elements.
    pub fn num_params(&self) -> usize {
        self.all_params().iter().map(|p| p.numel()).sum()
    }
}

/// Where a forward pass reads parameter values and reports module outputs.
pub trait Params {
    /// The current value of a parameter (by fully qualified name).
    fn get(&self, name: &str) -> Result<Tensor>;

    /// Rows `ids` of table `name` (an embedding lookup; output `ids.shape + [dim]`), the
    /// `padding_idx` row getting no gradient. The FSDP engine gathers only the rows some rank
    /// looks up for a table with a row-sparse gradient, never the whole table; the default
    /// reads the whole table.
    fn lookup(&self, name: &str, ids: &Tensor, padding_idx: Option<usize>) -> Result<Tensor> {
        crate::ops::embedding(&self.get(name)?, ids, padding_idx)
    }

    /// Called with each module's output as forward leaves it (by [`Forward::call`], never by
    /// model code); the FSDP engine hooks it (to refill the module's parameters before its
    /// backward). The default passes it through.
    fn module_output(&self, _path: &str, output: Tensor) -> Result<Tensor> {
        Ok(output)
    }

    /// Whether module `path`'s forward runs under activation checkpointing (the FSDP engine
    /// with `fsdp_activation_checkpointing`, when the module is a unit). Plain parameters
    /// never checkpoint.
    fn checkpoints(&self, _path: &str) -> bool {
        false
    }

    /// Runs `forward` on `x` as module `path`'s forward under activation checkpointing: its
    /// activations are freed when it returns and recomputed in backward. Only called when
    /// [`Params::checkpoints`] said yes.
    fn checkpointed(&self, path: &str, _x: &Tensor, _forward: Recompute) -> Result<Tensor> {
        Err(candle_core::Error::Msg(format!(
            "module `{path}`: activation checkpointing needs the FSDP engine's parameters"
        )))
    }
}

/// A module's forward as a function of its one differentiable input, with everything else it
/// reads (masks, the dropout seed, the module itself) captured: what activation checkpointing
/// runs again in backward. Dropout masks derive from the step seed and the call site, so the
/// recomputation draws the same ones.
pub type Recompute = Arc<dyn Fn(&dyn Params, &Tensor) -> Result<Tensor> + Send + Sync>;

/// Runs module `path` on `x` under activation checkpointing when `p` asks for it (the forward
/// that `recompute` builds), otherwise as `plain` (the module's [`Forward::call`]). Models call
/// it where they run their repeated blocks (the units activation checkpointing applies to).
pub fn call_checkpointable(
    p: &dyn Params,
    path: &str,
    x: &Tensor,
    recompute: impl FnOnce() -> Recompute,
    plain: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    if p.checkpoints(path) {
        p.checkpointed(path, x, recompute())
    } else {
        plain()
    }
}

/// A module of a model: a struct built once with its path and its parameters' names (as
/// candle-nn's `VarBuilder::pp` builds them), describing its subtree for wrap policies and
/// checkpoints from the same fields its forward uses.
pub trait Module {
    /// Dotted Hugging Face path (`bert.encoder.layer.3`); empty for the root.
    fn path(&self) -> &str;

    /// This module's node of the module tree: type name, own parameters, children.
    fn info(&self) -> ModuleInfo;

    /// Its child modules, mutably, in the order [`Module::info`] lists them: what a change to
    /// a whole model (LoRA adapters on its linear layers) walks. Leaves have none.
    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        Vec::new()
    }

    /// This module as the layer it is, when it is a leaf layer that a change to a whole model
    /// looks for by type (LoRA adapters and quantization find each [`crate::layers::Linear`] by
    /// downcasting); a wrapper returns the layer it holds. `None` by default.
    fn as_layer_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// What a module's forward returns: tensors reported to [`Params::module_output`].
pub trait ModuleOutput: Sized {
    /// Reports every tensor of the output as module `path`'s output.
    fn report(self, p: &dyn Params, path: &str) -> Result<Self>;
}

impl ModuleOutput for Tensor {
    fn report(self, p: &dyn Params, path: &str) -> Result<Self> {
        p.module_output(path, self)
    }
}

impl ModuleOutput for (Tensor, Tensor) {
    /// Both are computed before either is reported (one unit output may feed the other).
    fn report(self, p: &dyn Params, path: &str) -> Result<Self> {
        Ok((
            p.module_output(path, self.0)?,
            p.module_output(path, self.1)?,
        ))
    }
}

/// A module's forward pass on input `I`. Parents run children with [`Forward::call`], which
/// reports the child's output, so every module a wrap policy can pick is hooked without a
/// line of model code, and a unit's forward can be run again (activation checkpointing).
pub trait Forward<I>: Module {
    /// What forward returns.
    type Output: ModuleOutput;

    /// The computation: parameters from `p`, submodules through [`Forward::call`]. Running a
    /// submodule with `forward` skips the report: when it is an FSDP unit, the unit stays
    /// gathered until its backward (training is still correct, the memory saving is gone),
    /// which the engine warns about once per unit (debug mode makes it an error).
    fn forward(&self, p: &dyn Params, input: I) -> Result<Self::Output>;

    /// Runs [`Forward::forward`] and reports the output under this module's path.
    fn call(&self, p: &dyn Params, input: I) -> Result<Self::Output> {
        self.forward(p, input)?.report(p, self.path())
    }
}

/// A whole model: its module tree and the module types that make good FSDP units
/// (transformers' `_no_split_modules`, what TRANSFORMER_BASED_WRAP wraps by default).
pub trait Model: Module {
    /// Module type names to wrap by default.
    fn no_split_modules(&self) -> &'static [&'static str];
}

/// `prefix.leaf`, or `leaf` when the prefix is empty: how module paths are built.
pub fn join(prefix: &str, leaf: &str) -> String {
    if prefix.is_empty() {
        leaf.to_string()
    } else {
        format!("{prefix}.{leaf}")
    }
}

/// Single-process parameters: one variable per parameter.
pub struct LocalParams {
    vars: BTreeMap<String, Var>,
    frozen: BTreeMap<String, Tensor>,
}

impl LocalParams {
    /// Initialises every parameter of `model` from `seed` (each parameter drawn from its own
    /// stream keyed by name, so adding a parameter does not shift the others).
    pub fn init(
        model: &ModuleInfo,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<LocalParams> {
        let mut tensors = BTreeMap::new();
        for spec in model.all_params() {
            if spec.packing.is_some() {
                // Words, not values: never cast.
                let words = spec.initial_f32(seed);
                let t = Tensor::from_vec(words, spec.shape.as_slice(), device)?;
                tensors.insert(spec.name.clone(), t);
                continue;
            }
            let data = spec.initial_values(seed);
            tensors.insert(
                spec.name.clone(),
                Tensor::from_vec(data, spec.shape.as_slice(), device)?.to_dtype(dtype)?,
            );
        }
        LocalParams::from_tensors(model, tensors)
    }

    /// Wraps given tensors; every parameter of `model` must be present with its shape.
    pub fn from_tensors(
        model: &ModuleInfo,
        mut tensors: BTreeMap<String, Tensor>,
    ) -> Result<LocalParams> {
        let mut vars = BTreeMap::new();
        let mut frozen = BTreeMap::new();
        for spec in model.all_params() {
            let t = tensors.remove(&spec.name).ok_or_else(|| {
                candle_core::Error::Msg(format!("missing parameter {}", spec.name))
            })?;
            if t.dims() != spec.shape.as_slice() {
                return Err(candle_core::Error::Msg(format!(
                    "parameter {} has shape {:?}, the model expects {:?}",
                    spec.name,
                    t.dims(),
                    spec.shape
                )));
            }
            if spec.requires_grad {
                vars.insert(spec.name.clone(), Var::from_tensor(&t)?);
            } else {
                frozen.insert(spec.name.clone(), t);
            }
        }
        Ok(LocalParams { vars, frozen })
    }

    /// Loads `model`'s parameters from a safetensors file by name (see [`load_by_name`]).
    pub fn load(
        model: &ModuleInfo,
        path: &Path,
        device: &Device,
    ) -> Result<(LocalParams, LoadReport)> {
        let tensors = candle_core::safetensors::load(path, device)?;
        let (matched, report) = load_by_name(model, tensors);
        if !report.missing.is_empty() {
            return Err(candle_core::Error::Msg(format!(
                "{}: missing parameters {:?}",
                path.display(),
                report.missing
            )));
        }
        Ok((LocalParams::from_tensors(model, matched)?, report))
    }

    /// The trainable variables by name.
    pub fn vars(&self) -> &BTreeMap<String, Var> {
        &self.vars
    }

    /// Every parameter's current value by name.
    pub fn tensors(&self) -> BTreeMap<String, Tensor> {
        let mut out: BTreeMap<String, Tensor> = self
            .vars
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        out.extend(self.frozen.iter().map(|(k, t)| (k.clone(), t.clone())));
        out
    }
}

impl Params for LocalParams {
    fn get(&self, name: &str) -> Result<Tensor> {
        self.vars
            .get(name)
            .map(|v| v.as_tensor().clone())
            .or_else(|| self.frozen.get(name).cloned())
            .ok_or_else(|| candle_core::Error::Msg(format!("unknown parameter {name}")))
    }
}

/// What loading by name found, as transformers reports it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    /// Model parameters the file lacks.
    pub missing: Vec<String>,
    /// File tensors the model has no parameter for.
    pub unexpected: Vec<String>,
}

/// Matches a file's tensors to `model`'s parameter names, accepting files saved from the base
/// model (`embeddings.…` for `bert.embeddings.…`) and from the task model (`bert.…` for a
/// base model's `embeddings.…`).
pub fn load_by_name(
    model: &ModuleInfo,
    mut tensors: std::collections::HashMap<String, Tensor>,
) -> (BTreeMap<String, Tensor>, LoadReport) {
    let (names, report) = match_names(model, tensors.keys().cloned().collect());
    let matched = names
        .into_iter()
        .filter_map(|(ours, theirs)| tensors.remove(&theirs).map(|t| (ours, t)))
        .collect();
    (matched, report)
}

/// [`load_by_name`]'s matching on names alone: each parameter of `model` and the file name it
/// is read from, and what did not match.
pub fn match_names(
    model: &ModuleInfo,
    mut available: std::collections::HashSet<String>,
) -> (BTreeMap<String, String>, LoadReport) {
    let mut matched = BTreeMap::new();
    let mut report = LoadReport::default();
    for spec in model.all_params() {
        let name = &spec.name;
        let found = available.take(name).or_else(|| {
            let (prefix, rest) = name.split_once('.')?;
            // The file has the base model's names; ours carry a task prefix.
            available.take(rest).filter(|_| !prefix.is_empty())
        });
        let found = found.or_else(|| {
            // The file has a task model's names; ours are the base model's.
            let key = available
                .iter()
                .find(|k| k.split_once('.').is_some_and(|(_, rest)| rest == name))?
                .clone();
            available.take(&key)
        });
        match found {
            Some(theirs) => {
                matched.insert(name.clone(), theirs);
            }
            None => report.missing.push(name.clone()),
        }
    }
    report.unexpected = available.into_iter().collect();
    report.unexpected.sort();
    (matched, report)
}
