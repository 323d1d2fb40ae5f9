//! Optimizers on flat f32 slices (a whole parameter or one rank's shard), learning-rate
//! schedules, and [`Optimizer`], the choice the engine applies to every shard.

pub mod adamw;
pub mod schedule;
pub mod sgd;

pub use adamw::{AdamConfig, AdamWConfig, AdamWState};
pub use schedule::LrSchedule;
pub use sgd::SgdConfig;

/// The optimizer the engine runs on each rank's shards.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// `torch.optim.AdamW`.
    AdamW(AdamWConfig),
    /// `torch.optim.Adam`.
    Adam(AdamConfig),
    /// `torch.optim.SGD`.
    Sgd(SgdConfig),
}

/// One parameter's (or shard's) optimizer state, under PyTorch's state names.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParamState {
    /// Adam moments (empty for SGD).
    pub adam: AdamWState,
    /// SGD momentum buffer (empty without momentum).
    pub momentum_buffer: Vec<f32>,
}

impl ParamState {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        (self.adam.exp_avg.len() + self.adam.exp_avg_sq.len() + self.momentum_buffer.len()) * 4
    }
}

impl Optimizer {
    /// Updates `param` in place with `grad` at (1-based) `step`.
    pub fn update(&self, param: &mut [f32], grad: &[f32], state: &mut ParamState, step: u64) {
        match self {
            Optimizer::AdamW(c) => c.update(param, grad, &mut state.adam, step),
            Optimizer::Adam(c) => c.update(param, grad, &mut state.adam, step),
            Optimizer::Sgd(c) => c.update(param, grad, &mut state.momentum_buffer),
        }
    }

    /// Checks the settings as PyTorch's constructors do.
    pub fn validate(&self) -> Result<(), String> {
        let (lr, betas, eps) = match self {
            Optimizer::AdamW(c) => (c.lr, Some(c.betas), Some(c.eps)),
            Optimizer::Adam(c) => (c.lr, Some(c.betas), Some(c.eps)),
            Optimizer::Sgd(c) => {
                if c.momentum < 0.0 {
                    return Err(format!("SGD momentum {} is negative", c.momentum));
                }
                if c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0) {
                    return Err(
                        "SGD with nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)"
                            .into(),
                    );
                }
                (c.lr, None, None)
            }
        };
        if lr.is_nan() || lr < 0.0 {
            return Err(format!("learning rate {lr} is not >= 0"));
        }
        if let Some((b1, b2)) = betas {
            if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
                return Err(format!("betas ({b1}, {b2}) must lie in [0, 1)"));
            }
        }
        if let Some(eps) = eps {
            if eps.is_nan() || eps < 0.0 {
                return Err(format!("eps {eps} is not >= 0"));
            }
        }
        Ok(())
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Optimizer::AdamW(c) => c.lr,
            Optimizer::Adam(c) => c.lr,
            Optimizer::Sgd(c) => c.lr,
        }
    }
}

impl From<AdamWConfig> for Optimizer {
    fn from(c: AdamWConfig) -> Optimizer {
        Optimizer::AdamW(c)
    }
}
