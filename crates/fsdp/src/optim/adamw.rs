//! Adam and AdamW with PyTorch's exact single-tensor update rules, on flat slices, so the same
//! code updates a whole parameter or one rank's shard of it.

use super::kernels::{self, AdamScalars};
use super::{ParamState, UpdateRule, check_lr_betas_eps, config_from, settings_of};

/// AdamW hyper-parameters (PyTorch's defaults except the learning rate).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// (beta1, beta2).
    pub betas: (f64, f64),
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// The [`UpdateRule`] of an Adam-family config: `$decay` says how weight decay applies.
macro_rules! adam_rule {
    ($ty:ident, $name:literal, $decay:path) => {
        impl UpdateRule for $ty {
            const NAME: &'static str = $name;

            fn lr(&self) -> f64 {
                self.lr
            }

            fn set_lr(&mut self, lr: f64) {
                self.lr = lr;
            }

            fn with_weight_decay(&self, wd: f64) -> Self {
                $ty {
                    weight_decay: wd,
                    ..*self
                }
            }

            fn validate(&self) -> Result<(), String> {
                check_lr_betas_eps(self.lr, Some(self.betas), Some(self.eps))?;
                check_weight_decay(self.weight_decay)
            }

            fn update(&self, param: &mut [f32], grad: &[f32], state: &mut ParamState) {
                let decay = $decay(self.weight_decay);
                adam_update(self.lr, self.betas, self.eps, decay, param, grad, state);
            }

            fn settings(&self) -> serde_json::Value {
                settings_of(self)
            }

            fn with_settings(&self, settings: &serde_json::Value) -> Result<Self, String> {
                config_from(settings)
            }
        }
    };
}

// `torch.optim.AdamW` (single-tensor path, f32): `p *= 1 - lr wd`; `m = lerp(m, g, 1 - b1)`;
// `v = b2 v + (1 - b2) g g`; `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
adam_rule!(AdamWConfig, "AdamW", Decay::Decoupled);

/// Adam (`torch.optim.Adam`): like AdamW, but weight decay is L2 added to the gradient.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// (beta1, beta2).
    pub betas: (f64, f64),
    /// Denominator epsilon.
    pub eps: f64,
    /// L2 penalty added to the gradient (`g += wd * p`).
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

// `torch.optim.Adam` (single-tensor path, f32): the same with `g += wd p` instead.
adam_rule!(AdamConfig, "Adam", Decay::L2);

pub(crate) fn check_weight_decay(wd: f64) -> Result<(), String> {
    if wd.is_nan() || wd < 0.0 {
        return Err(format!("weight_decay {wd} is not >= 0"));
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Decay {
    /// AdamW: parameters shrink by `1 - lr wd` before the update.
    Decoupled(f64),
    /// Adam: `wd p` is added to the gradient.
    L2(f64),
}

/// The shared Adam update. Scalars are formed in double precision and rounded to f32 once,
/// as PyTorch forms them in Python floats (`1 - 0.999` rounded from f32 betas would be
/// 1.4e-5 relative off and drift the moments).
fn adam_update(
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    decay: Decay,
    param: &mut [f32],
    grad: &[f32],
    state: &mut ParamState,
) {
    let n = param.len();
    let mut m = state.take("exp_avg", n);
    let mut v = state.take("exp_avg_sq", n);
    let step = state.step.max(1) as i32;
    let (shrink, l2) = match decay {
        Decay::Decoupled(wd) => ((1.0 - lr * wd) as f32, 0.0f32),
        Decay::L2(wd) => (1.0, wd as f32),
    };
    let scalars = AdamScalars {
        w1: (1.0 - betas.0) as f32,
        b2: betas.1 as f32,
        w2: (1.0 - betas.1) as f32,
        shrink,
        l2,
        step_size: (lr / (1.0 - betas.0.powi(step))) as f32,
        bc2_sqrt: (1.0 - betas.1.powi(step)).sqrt() as f32,
        eps: eps as f32,
    };
    kernels::adam(param, grad, &mut m, &mut v, scalars);
    state.put("exp_avg", m);
    state.put("exp_avg_sq", v);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_minus_beta_is_rounded_once_from_double() {
        // f32(1 - 0.999) differs from 1 - f32(0.999): the first is what PyTorch multiplies by.
        let once = (1.0f64 - 0.999) as f32;
        let twice = 1.0f32 - 0.999f64 as f32;
        assert_ne!(once, twice);
        let mut state = ParamState {
            step: 1,
            ..Default::default()
        };
        let c = AdamWConfig {
            weight_decay: 0.0,
            ..Default::default()
        };
        let mut p = [0.0f32];
        c.update(&mut p, &[1.0], &mut state);
        assert_eq!(state.buffers["exp_avg_sq"][0], once);
    }
}
