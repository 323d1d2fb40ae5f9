//! Learning-rate schedules (transformers' `get_*_schedule_with_warmup` shapes): the learning
//! rate for a 1-based step, given the base rate.

use super::{OptimError, Optimizer};

/// A schedule of learning-rate multipliers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    /// The base rate at every step.
    Constant,
    /// Linear warmup from 0 over `warmup` steps, then linear decay to 0 at `total`.
    Linear {
        /// Warmup steps.
        warmup: u64,
        /// Total training steps.
        total: u64,
    },
    /// Linear warmup, then half a cosine down to 0 at `total`.
    Cosine {
        /// Warmup steps.
        warmup: u64,
        /// Total training steps.
        total: u64,
    },
}

impl LrSchedule {
    /// The rate for 1-based `step` (the optimizer's step count after the update).
    pub fn lr(&self, base: f64, step: u64) -> f64 {
        // transformers evaluates the schedule at the number of updates already done.
        let done = step.saturating_sub(1);
        let factor = match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::Linear { warmup, total } => {
                if done < warmup {
                    done as f64 / warmup.max(1) as f64
                } else {
                    (total.saturating_sub(done)) as f64
                        / (total.saturating_sub(warmup)).max(1) as f64
                }
            }
            LrSchedule::Cosine { warmup, total } => {
                if done < warmup {
                    done as f64 / warmup.max(1) as f64
                } else {
                    let progress =
                        (done - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
                    0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
                }
            }
        };
        base * factor.max(0.0)
    }

    /// Sets each parameter group's learning rate to its initial rate scaled for 1-based
    /// `step` (call once per optimizer step, before it).
    pub fn apply(&self, optimizer: &mut dyn Optimizer, step: u64) -> Result<(), OptimError> {
        for g in 0..optimizer.num_groups() {
            let lr = self.lr(optimizer.initial_lr(g), step);
            optimizer.set_lr(g, lr)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let base = 1e-3;
        assert_eq!(LrSchedule::Constant.lr(base, 7), base);
        let lin = LrSchedule::Linear {
            warmup: 10,
            total: 110,
        };
        assert_eq!(lin.lr(base, 1), 0.0);
        assert!((lin.lr(base, 6) - 0.5e-3).abs() < 1e-15);
        assert!((lin.lr(base, 11) - base).abs() < 1e-15);
        assert!((lin.lr(base, 61) - 0.5e-3).abs() < 1e-15);
        assert_eq!(lin.lr(base, 111), 0.0);
        assert_eq!(lin.lr(base, 500), 0.0);
        let cos = LrSchedule::Cosine {
            warmup: 0,
            total: 100,
        };
        assert!((cos.lr(base, 1) - base).abs() < 1e-15);
        assert!((cos.lr(base, 51) - 0.5e-3).abs() < 1e-12);
        assert!(cos.lr(base, 101).abs() < 1e-15);
    }
}
