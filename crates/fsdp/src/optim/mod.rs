//! Optimizers.

pub mod adamw;
pub mod schedule;

pub use adamw::{AdamWConfig, AdamWState};
pub use schedule::LrSchedule;
