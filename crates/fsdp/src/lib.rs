//! fsdp-rs: fully sharded data-parallel training on candle, configured like Hugging Face
//! Accelerate's FSDP plugin.
//!
//! A training program uses the [`accelerator::Accelerator`] (what Accelerate's `Accelerator`
//! is to a Python program) over a model written with [`nn`]'s module system: the shipped
//! [`models`] (BERT, GPT-2, and the Llama family — Llama, Mistral, Qwen2 — from transformers
//! folders or GGUF files) or one of your own ([`guide`]: train your own model). The
//! [`engine`] shards parameters, gradients and optimizer state ([`optim`]) by the
//! configuration ([`config`]), and [`checkpoint`] saves and loads them at any world size;
//! the accelerator logs to JSON lines and TensorBoard ([`accelerator::Tracker`]). LoRA and
//! QLoRA are [`peft`]; every seeded draw (initial weights, dropout, the epoch's order) comes
//! from [`rng`].

/// The workspace's skip registry for this crate's unit tests (`skipped!`,
/// `skipped_optional!`), shared with the test crates.
#[cfg(test)]
#[macro_use]
#[path = "../../fsdp/tests/common/skip.rs"]
mod skip;
/// The unit tests allocate through the workspace's poisoning allocator: code that returns
/// memory it never wrote shows garbage instead of fresh pages' zeros.
#[cfg(test)]
#[path = "../tests/common/poisoned.rs"]
mod poisoned;
/// Where the registry's macros look for it, as in the test crates.
#[cfg(test)]
mod common {
    pub(crate) use super::skip;
}

pub mod accelerator;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod engine;
#[doc = include_str!("guide.md")]
pub mod guide {}
pub mod memory;
pub mod models;
/// The module system, layers and fused kernels (the `fsdp-nn` crate).
pub use fsdp_nn as nn;
/// Implements `Module` for a struct of child modules (`fsdp-nn`'s macro, where it was).
pub use fsdp_nn::composite_module;
pub mod optim;
pub mod peft;
#[doc(hidden)] // `fsdp env` and `fsdp bench`; programs report MFU through `Accelerator::mfu_line`
pub mod perf;
/// Seeded random streams (`fsdp-nn`'s).
pub use fsdp_nn::rng;
pub mod trace;

/// The README's Rust code, compiled (and run, where it is not marked `no_run`) as doc-tests,
/// so the README cannot drift from the API; likewise the guides in docs/ that hold Rust code.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeExamples;

#[cfg(doctest)]
#[doc = include_str!("../../../docs/CHECKPOINTS.md")]
struct CheckpointsGuideExamples;

#[cfg(doctest)]
#[doc = include_str!("../../../docs/LLAMA.md")]
struct LlamaGuideExamples;

#[cfg(doctest)]
#[doc = include_str!("../../../docs/TRAINING.md")]
struct TrainingGuideExamples;
