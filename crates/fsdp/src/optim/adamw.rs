//! Adam and AdamW with PyTorch's exact update rules, on flat slices, so the same code updates
//! a whole parameter or one rank's shard of it.

/// AdamW hyper-parameters (PyTorch's defaults except the learning rate).
#[derive(Debug, Clone, Copy, PartialEq)]
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

/// Moment estimates of one parameter (or shard).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdamWState {
    /// First moment.
    pub exp_avg: Vec<f32>,
    /// Second moment.
    pub exp_avg_sq: Vec<f32>,
}

impl AdamWConfig {
    /// One update of `param` with `grad` at (1-based) `step`, exactly as `torch.optim.AdamW`
    /// (single-tensor path): `p *= 1 - lr wd`; `m = b1 m + (1 - b1) g`;
    /// `v = b2 v + (1 - b2) g^2`; `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`,
    /// computed in f32 like PyTorch's f32 path.
    pub fn update(&self, param: &mut [f32], grad: &[f32], state: &mut AdamWState, step: u64) {
        adam_update(self, true, param, grad, state, step);
    }
}

/// Adam (`torch.optim.Adam`): like AdamW, but weight decay is L2 added to the gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
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

impl AdamConfig {
    /// One update, exactly as `torch.optim.Adam` (single-tensor path, f32).
    pub fn update(&self, param: &mut [f32], grad: &[f32], state: &mut AdamWState, step: u64) {
        let as_adamw = AdamWConfig {
            lr: self.lr,
            betas: self.betas,
            eps: self.eps,
            weight_decay: self.weight_decay,
        };
        adam_update(&as_adamw, false, param, grad, state, step);
    }
}

fn adam_update(
    c: &AdamWConfig,
    decoupled: bool,
    param: &mut [f32],
    grad: &[f32],
    state: &mut AdamWState,
    step: u64,
) {
    if state.exp_avg.len() != param.len() {
        state.exp_avg = vec![0.0; param.len()];
        state.exp_avg_sq = vec![0.0; param.len()];
    }
    let (b1, b2) = (c.betas.0 as f32, c.betas.1 as f32);
    let decay = if decoupled {
        1.0 - (c.lr * c.weight_decay) as f32
    } else {
        1.0
    };
    let l2 = if decoupled {
        0.0
    } else {
        c.weight_decay as f32
    };
    let bc1 = 1.0 - c.betas.0.powi(step as i32);
    let bc2 = 1.0 - c.betas.1.powi(step as i32);
    let step_size = (c.lr / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let eps = c.eps as f32;
    for (((p, &g), m), v) in param
        .iter_mut()
        .zip(grad)
        .zip(state.exp_avg.iter_mut())
        .zip(state.exp_avg_sq.iter_mut())
    {
        let g = if l2 != 0.0 { g + l2 * *p } else { g };
        *p *= decay;
        *m += (g - *m) * (1.0 - b1);
        *v = *v * b2 + g * g * (1.0 - b2);
        let denom = v.sqrt() / bc2_sqrt + eps;
        *p -= step_size * *m / denom;
    }
}
