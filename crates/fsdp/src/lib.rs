//! fsdp-rs: fully sharded data-parallel training on candle, configured like Hugging Face
//! Accelerate's FSDP plugin.

// First: its macro serves the modules below.
#[macro_use]
mod multiversion;

pub mod accelerator;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod engine;
pub mod memory;
pub mod models;
pub mod nn;
pub mod optim;
