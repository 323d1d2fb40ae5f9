//! Learning-rate schedules (transformers' `get_*_schedule_with_warmup` shapes): the learning
//! rate for a 1-based step, given the base rate; and [`LrScheduler`], which applies one to an
//! optimizer once per optimizer step and can be checkpointed.

use serde::{Deserialize, Serialize};

use super::{OptimError, Optimizer};

/// A schedule of learning-rate multipliers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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
    /// Linear warmup, then a polynomial decay of degree `power` to `lr_end` at `total`
    /// (transformers' `get_polynomial_decay_schedule_with_warmup`).
    Polynomial {
        /// Warmup steps.
        warmup: u64,
        /// Total training steps.
        total: u64,
        /// The degree.
        power: f64,
        /// The rate at and after `total`.
        lr_end: f64,
    },
}

impl LrSchedule {
    /// The rate for 1-based `step` (the optimizer's step count after the update).
    pub fn lr(&self, base: f64, step: u64) -> f64 {
        // transformers evaluates the schedule at the number of updates already done.
        let done = step.saturating_sub(1);
        let warming = |warmup: u64| (done < warmup).then(|| done as f64 / warmup.max(1) as f64);
        // Progress through the decay, 0 at its start and 1 at `total`.
        let decayed = |warmup: u64, total: u64| {
            (done - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64
        };
        match *self {
            LrSchedule::Constant => base,
            LrSchedule::Linear { warmup, total } => {
                // (total - done) / (total - warmup), as transformers computes it.
                base * warming(warmup).unwrap_or_else(|| {
                    total.saturating_sub(done) as f64 / (total.saturating_sub(warmup)).max(1) as f64
                })
            }
            LrSchedule::Cosine { warmup, total } => {
                base * warming(warmup).unwrap_or_else(|| {
                    0.5 * (1.0 + (std::f64::consts::PI * decayed(warmup, total).min(1.0)).cos())
                })
            }
            LrSchedule::Polynomial {
                warmup,
                total,
                power,
                lr_end,
            } => match warming(warmup) {
                Some(f) => base * f,
                None if done > total => lr_end,
                None => (base - lr_end) * (1.0 - decayed(warmup, total)).powf(power) + lr_end,
            },
        }
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

/// A schedule applied to an optimizer once per optimizer step — not once per process or per
/// micro-batch, so warmup and decay take the steps they say whatever the number of
/// processes and accumulation steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LrScheduler {
    /// The schedule.
    pub schedule: LrSchedule,
    /// Optimizer steps taken so far.
    pub steps: u64,
}

impl LrScheduler {
    /// A scheduler at step 0; call [`LrScheduler::start`] before the first step.
    pub fn new(schedule: LrSchedule) -> LrScheduler {
        LrScheduler { schedule, steps: 0 }
    }

    /// Sets each parameter group's rate for the next optimizer step (the first one when
    /// no step has been taken): call it once before training and after loading.
    pub fn start(&self, optimizer: &mut dyn Optimizer) -> Result<(), OptimError> {
        self.schedule.apply(optimizer, self.steps + 1)
    }

    /// Counts one optimizer step and sets the rates for the next one.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<(), OptimError> {
        self.steps += 1;
        self.start(optimizer)
    }

    /// The rate group `group` gets at the next step.
    pub fn next_lr(&self, optimizer: &dyn Optimizer, group: usize) -> f64 {
        self.schedule
            .lr(optimizer.initial_lr(group), self.steps + 1)
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
        let poly = LrSchedule::Polynomial {
            warmup: 10,
            total: 110,
            power: 2.0,
            lr_end: 1e-7,
        };
        assert_eq!(poly.lr(base, 1), 0.0);
        assert!((poly.lr(base, 11) - base).abs() < 1e-15);
        // Half-way through the decay: (base - end) * 0.5^2 + end.
        assert!((poly.lr(base, 61) - ((base - 1e-7) * 0.25 + 1e-7)).abs() < 1e-15);
        assert_eq!(poly.lr(base, 200), 1e-7);
    }
}
