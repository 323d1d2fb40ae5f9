//! [`GradScaler`]: dynamic loss scaling for fp16 mixed precision, sharded (PyTorch's
//! `ShardedGradScaler`). fp16 gradients of small magnitude flush to zero, so the loss is
//! multiplied by a large scale before backward and the reduced gradients divided by it
//! before the step. Each rank holds different rows, so an overflow (inf or NaN) found in any
//! rank's rows is agreed over the whole mesh: every rank skips the same step, and the scale
//! backs off; after a run of clean steps it grows again.

use candle_core::Tensor;
use fsdp_comm::{Buffer, ReduceOp};

use super::error::EngineError;
use super::fsdp::Fsdp;

/// Loss-scaling settings (PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale.
    pub init_scale: f64,
    /// Factor applied after `growth_interval` steps without overflow.
    pub growth_factor: f64,
    /// Factor applied on an overflow.
    pub backoff_factor: f64,
    /// Clean steps before the scale grows.
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// Dynamic loss scale shared by every rank (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct GradScaler {
    config: GradScalerConfig,
    scale: f64,
    /// Clean steps since the scale last changed.
    growth_tracker: u32,
}

impl GradScaler {
    /// A scaler starting at `config.init_scale`; the factors must grow and back off.
    pub fn new(config: GradScalerConfig) -> Result<GradScaler, EngineError> {
        if !(config.init_scale > 0.0
            && config.growth_factor > 1.0
            && config.backoff_factor > 0.0
            && config.backoff_factor < 1.0
            && config.growth_interval > 0)
        {
            return Err(EngineError::Unsupported {
                setting: format!("grad scaler {config:?}"),
                hint: "init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1",
            });
        }
        Ok(GradScaler {
            config,
            scale: config.init_scale,
            growth_tracker: 0,
        })
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// `loss` times the scale: what backward runs on.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor, EngineError> {
        Ok((loss * self.scale)?)
    }

    /// Divides `fsdp`'s held gradients by the scale; returns whether any rank of its mesh
    /// found an inf or NaN in its rows (then every rank must skip the step). Collective.
    pub fn unscale(&self, fsdp: &mut Fsdp) -> Result<bool, EngineError> {
        fsdp.with_gradients("unscale", |fsdp, grads| {
            grads.scale((1.0 / self.scale) as f32)?;
            let mine = f32::from(u8::from(!grads.all_finite()?));
            let any = fsdp
                .mesh()
                .all_reduce(Buffer::F32(vec![mine]), ReduceOp::Max)?;
            let found = any.as_slice::<f32>().is_some_and(|v| v[0] > 0.0);
            // Every rank found them finite: the step's own check need not look again.
            grads.known_finite = !found;
            Ok(found)
        })
    }

    /// After a step: the scale backs off when `found_inf`, and grows after
    /// `growth_interval` clean steps in a row.
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
            return;
        }
        self.growth_tracker += 1;
        if self.growth_tracker == self.config.growth_interval {
            self.scale *= self.config.growth_factor;
            self.growth_tracker = 0;
        }
    }

    /// (scale, clean steps since it last changed), for checkpoints.
    pub fn state(&self) -> (f64, u32) {
        (self.scale, self.growth_tracker)
    }

    /// Restores [`GradScaler::state`].
    pub fn load_state(&mut self, (scale, growth_tracker): (f64, u32)) {
        self.scale = scale;
        self.growth_tracker = growth_tracker;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_on_overflow_and_grows_after_clean_steps() {
        let mut s = GradScaler::new(GradScalerConfig {
            init_scale: 1024.0,
            growth_interval: 3,
            ..Default::default()
        })
        .unwrap();
        s.update(true);
        assert_eq!(s.scale(), 512.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale(), 512.0);
        s.update(false);
        assert_eq!(s.scale(), 1024.0);
        s.update(false);
        s.update(true);
        assert_eq!(s.state(), (512.0, 0));
        assert!(
            GradScaler::new(GradScalerConfig {
                backoff_factor: 1.5,
                ..Default::default()
            })
            .is_err()
        );
    }
}
