//! SGD with momentum, dampening, Nesterov and L2 weight decay, exactly as `torch.optim.SGD`.

use super::kernels::{self, SgdScalars};
use super::{
    ParamState, UpdateRule, adamw::check_weight_decay, check_lr_betas_eps, config_from, settings_of,
};

/// SGD hyper-parameters (PyTorch's names and defaults except the learning rate).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the buffer).
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0, as in PyTorch).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl UpdateRule for SgdConfig {
    const NAME: &'static str = "SGD";

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn with_weight_decay(&self, wd: f64) -> Self {
        SgdConfig {
            weight_decay: wd,
            ..*self
        }
    }

    fn validate(&self) -> Result<(), String> {
        check_lr_betas_eps(self.lr, None, None)?;
        check_weight_decay(self.weight_decay)?;
        if self.momentum.is_nan() || self.momentum < 0.0 {
            return Err(format!("momentum {} is not >= 0", self.momentum));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err("nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)".into());
        }
        Ok(())
    }

    fn settings(&self) -> serde_json::Value {
        settings_of(self)
    }

    fn with_settings(&self, settings: &serde_json::Value) -> Result<Self, String> {
        config_from(settings)
    }

    /// One update; the momentum buffer starts as the first (decayed) gradient.
    fn update(&self, param: &mut [f32], grad: &[f32], state: &mut ParamState) {
        let first = !state.buffers.contains_key("momentum_buffer");
        let k = SgdScalars {
            lr: self.lr as f32,
            weight_decay: self.weight_decay as f32,
            momentum: self.momentum as f32,
            damp: (1.0 - self.dampening) as f32,
            nesterov: self.nesterov,
            first,
        };
        let mu = k.momentum;
        let mut buf = if mu != 0.0 {
            state.take("momentum_buffer", param.len())
        } else {
            Vec::new()
        };
        kernels::sgd(param, grad, &mut buf, k);
        if mu != 0.0 {
            state.put("momentum_buffer", buf);
        }
    }
}
