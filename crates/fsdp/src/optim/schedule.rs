//! Learning-rate schedules (transformers' `get_*_schedule_with_warmup` shapes, and any
//! function of the step as PyTorch's `LambdaLR`): the learning rate for a 1-based step, given
//! the base rate; and [`LrScheduler`], which applies one to an optimizer once per optimizer
//! step and can be checkpointed.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A schedule given as code (PyTorch's `LambdaLR`): the multiplier of the base rate after
/// `done` optimizer steps, under a name. A checkpoint keeps the name and the step, not the
/// function (PyTorch keeps none of it either): the run that resumes attaches the same
/// schedule, and loading checks the name.
#[derive(Clone)]
pub struct LambdaSchedule {
    /// What the function is called (checked when a checkpoint is loaded).
    pub name: String,
    /// The function; `None` only in a schedule read back from a checkpoint.
    f: Option<Arc<dyn Fn(u64) -> f64 + Send + Sync>>,
}

impl LambdaSchedule {
    /// `f(done)`, the multiplier after `done` steps, called `name`.
    pub fn new(name: &str, f: impl Fn(u64) -> f64 + Send + Sync + 'static) -> LambdaSchedule {
        LambdaSchedule {
            name: name.to_string(),
            f: Some(Arc::new(f)),
        }
    }

    /// Whether it has its function (not only a checkpoint's name of it).
    pub fn is_attached(&self) -> bool {
        self.f.is_some()
    }

    fn multiplier(&self, done: u64) -> f64 {
        // A schedule read from a checkpoint is replaced by the attached one before use
        // (`LrScheduler::resume_from`); without a function the rate stays the base.
        self.f.as_ref().map_or(1.0, |f| f(done))
    }
}

impl std::fmt::Debug for LambdaSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LambdaSchedule({:?})", self.name)
    }
}

/// Two lambda schedules are the same schedule when their names are.
impl PartialEq for LambdaSchedule {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Serialize for LambdaSchedule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.name.serialize(s)
    }
}

impl<'de> Deserialize<'de> for LambdaSchedule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(LambdaSchedule {
            name: String::deserialize(d)?,
            f: None,
        })
    }
}

use super::{OptimError, Optimizer};

/// A schedule of learning-rate multipliers, attached to an optimizer by
/// [`crate::accelerator::Accelerator::prepare_scheduler`] (moved once per optimizer step).
///
/// ```
/// use fsdp::optim::LrSchedule;
///
/// // transformers' get_linear_schedule_with_warmup(optimizer, 10, 100).
/// let linear = LrSchedule::Linear { warmup: 10, total: 100 };
/// // `lr` of the 1-based step, evaluated as transformers does at the updates already done.
/// assert_eq!(linear.lr(1e-3, 6), 0.5e-3);   // 5 updates done: half way through the warmup
/// assert_eq!(linear.lr(1e-3, 56), 0.5e-3);  // 55 done: half way down
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// `base · f(done)`, `done` the optimizer steps already taken (PyTorch's `LambdaLR`).
    Lambda(LambdaSchedule),
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
            LrSchedule::Lambda(ref l) => base * l.multiplier(done),
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

    /// This scheduler continued from `saved` (a checkpoint's): its step, and the schedule
    /// it says — except a [`LrSchedule::Lambda`], whose function the checkpoint cannot hold:
    /// this scheduler's own is kept, if it has the saved name (an error naming both if not,
    /// or if this scheduler is not that lambda).
    pub fn resume_from(&self, saved: LrScheduler) -> Result<LrScheduler, String> {
        match (&saved.schedule, &self.schedule) {
            (LrSchedule::Lambda(s), LrSchedule::Lambda(ours)) if s.name == ours.name => {
                Ok(LrScheduler {
                    schedule: self.schedule.clone(),
                    steps: saved.steps,
                })
            }
            (LrSchedule::Lambda(s), ours) => Err(format!(
                "the checkpoint's schedule is the lambda {:?}, whose function it cannot hold: attach the same with `LrSchedule::Lambda(LambdaSchedule::new({:?}, ..))` before loading (this run's is {ours:?})",
                s.name, s.name
            )),
            _ => Ok(saved),
        }
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
    fn a_lambda_is_a_function_of_the_steps_done_kept_by_name() {
        let l = LrSchedule::Lambda(LambdaSchedule::new("tenth", |done| 1.0 / (1 + done) as f64));
        assert_eq!(l.lr(2.0, 1), 2.0);
        assert_eq!(l.lr(2.0, 4), 0.5);
        let text = serde_json::to_string(&LrScheduler {
            schedule: l.clone(),
            steps: 3,
        })
        .unwrap();
        assert_eq!(text, r#"{"schedule":{"Lambda":"tenth"},"steps":3}"#);
        let back: LrScheduler = serde_json::from_str(&text).unwrap();
        assert_eq!(back.schedule, l, "the same name");
        let LrSchedule::Lambda(read) = &back.schedule else {
            panic!()
        };
        assert!(!read.is_attached());
        let ours = LrScheduler::new(l.clone());
        let resumed = ours.resume_from(back).unwrap();
        assert_eq!(
            (resumed.steps, resumed.schedule.lr(2.0, resumed.steps + 1)),
            (3, 0.5)
        );
        assert!(matches!(&resumed.schedule, LrSchedule::Lambda(l) if l.is_attached()));
    }

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
