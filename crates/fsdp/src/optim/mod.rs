//! Optimizers.

pub mod adamw;

pub use adamw::{AdamWConfig, AdamWState};
