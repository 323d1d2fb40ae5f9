//! SGD with momentum, dampening, Nesterov and L2 weight decay, exactly as `torch.optim.SGD`.

/// SGD hyper-parameters (PyTorch's names and defaults except the learning rate).
#[derive(Debug, Clone, Copy, PartialEq)]
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

impl SgdConfig {
    /// One update of `param` with `grad`; `momentum_buffer` is empty before the first step.
    pub fn update(&self, param: &mut [f32], grad: &[f32], momentum_buffer: &mut Vec<f32>) {
        let (lr, wd) = (self.lr as f32, self.weight_decay as f32);
        let (mu, damp) = (self.momentum as f32, self.dampening as f32);
        let first = momentum_buffer.len() != param.len();
        if mu != 0.0 && first {
            momentum_buffer.clear();
            momentum_buffer.resize(param.len(), 0.0);
        }
        for (i, (p, &g)) in param.iter_mut().zip(grad).enumerate() {
            let mut d = if wd != 0.0 { g + wd * *p } else { g };
            if mu != 0.0 {
                let b = &mut momentum_buffer[i];
                *b = if first { d } else { *b * mu + (1.0 - damp) * d };
                d = if self.nesterov { d + mu * *b } else { *b };
            }
            *p -= lr * d;
        }
    }
}
