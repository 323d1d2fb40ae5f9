//! LoRA's low-rank update on a linear layer (Hu et al. 2021, PEFT's `lora.Linear`):
//! `y = base(x) + scaling · dropout(x) · Aᵀ · Bᵀ`, with `A` [r, in] uniform in `±1/√in`
//! (PEFT's `kaiming_uniform_(a=√5)`) and `B` [out, r] zero, so training starts from the base
//! model exactly. Which layers get one, and the adapters' files, are `fsdp::peft`'s.

use std::sync::{Arc, Mutex};

use candle_core::{Result, Tensor};

use super::module::{Init, ModuleInfo, Params, join};
use super::ops;
use crate::rng::site_seed;

/// How fresh adapters start (PEFT's `init_lora_weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraInit {
    /// `true`: A uniform in `±1/√in`, B zero, so training starts from the base exactly.
    #[default]
    Default,
    /// `"gaussian"`: A normal with standard deviation `1/r`, B zero.
    Gaussian,
    /// `false`: A and B both uniform in `±1/√fan_in` (not a no-op at the start; for tests).
    Random,
}

/// One linear layer's adapter: its rank, scaling and dropout; the weights are the layer's
/// parameters `lora_A.weight` and `lora_B.weight`.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    rank: usize,
    scaling: f64,
    dropout: f64,
    init: LoraInit,
    /// The step's dropout seed, shared by every adapter of a model (`None`: evaluation).
    seed: Arc<Mutex<Option<u64>>>,
}

impl LoraAdapter {
    /// An adapter of rank `rank` whose update is multiplied by `scaling`, with dropout `dropout`
    /// on its input while `seed` holds a step's seed.
    pub fn new(rank: usize, scaling: f64, dropout: f64, seed: Arc<Mutex<Option<u64>>>) -> Self {
        LoraAdapter {
            rank,
            scaling,
            dropout,
            init: LoraInit::Default,
            seed,
        }
    }

    /// This adapter with its weights initialised as `init` says.
    pub fn with_init(mut self, init: LoraInit) -> Self {
        self.init = init;
        self
    }

    /// The rank r.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The factor on `B·A` (`alpha / r`, or `alpha / √r` with rsLoRA).
    pub fn scaling(&self) -> f64 {
        self.scaling
    }

    /// `info` (a linear layer of `d_in` → `d_out`) with the adapter's parameters.
    pub(crate) fn add_params(&self, info: ModuleInfo, d_in: usize, d_out: usize) -> ModuleInfo {
        let bound = |fan_in: usize| 1.0 / (fan_in.max(1) as f64).sqrt();
        let (a, b) = match self.init {
            LoraInit::Default => (Init::Uniform { bound: bound(d_in) }, Init::Zeros),
            LoraInit::Gaussian => (
                Init::Normal {
                    std: 1.0 / self.rank.max(1) as f64,
                },
                Init::Zeros,
            ),
            LoraInit::Random => (
                Init::Uniform { bound: bound(d_in) },
                Init::Uniform {
                    bound: bound(self.rank),
                },
            ),
        };
        info.param("lora_A.weight", &[self.rank, d_in], a).param(
            "lora_B.weight",
            &[d_out, self.rank],
            b,
        )
    }

    /// `scaling · dropout(x) · Aᵀ · Bᵀ` for the layer at `path`.
    pub(crate) fn update(&self, p: &dyn Params, path: &str, x: &Tensor) -> Result<Tensor> {
        let a = p.get(&join(path, "lora_A.weight"))?;
        let b = p.get(&join(path, "lora_B.weight"))?;
        let seed = *self.seed.lock().unwrap_or_else(|e| e.into_inner());
        let x = match seed {
            Some(seed) if self.dropout > 0.0 => ops::dropout(
                x,
                self.dropout,
                site_seed(seed, &join(path, "lora_dropout")),
            )?,
            _ => x.clone(),
        };
        ops::lora_update(&x, &a, &b, self.scaling)
    }
}
