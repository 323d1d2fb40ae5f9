//! fsdp-rs: fully sharded data-parallel training on candle, configured like Hugging Face
//! Accelerate's FSDP plugin.
//!
//! A training program uses the [`accelerator::Accelerator`] (what Accelerate's `Accelerator`
//! is to a Python program) over a model written with [`nn`]'s module system: the shipped
//! [`models`] (BERT, GPT-2, and the Llama family — Llama, Mistral, Qwen2 — from transformers
//! folders or GGUF files) or one of your own ([`guide`]: train your own model). The
//! [`engine`] shards parameters, gradients and optimizer state ([`optim`]) by the
//! configuration ([`config`]), and [`checkpoint`] saves and loads them at any world size;
//! the accelerator logs to JSON lines and TensorBoard ([`accelerator::Tracker`]).

// First: its macro serves the modules below.
#[macro_use]
mod multiversion;

pub mod accelerator;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod engine;
pub mod metrics;
#[doc = include_str!("guide.md")]
pub mod guide {}
pub mod memory;
pub mod models;
pub mod nn;
pub mod optim;
pub mod peft;
pub mod perf;
pub mod rng;
pub mod trace;

/// The README's Rust code, compiled (and run, where it is not marked `no_run`) as doc-tests,
/// so the README cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeExamples;

#[cfg(test)]
mod tests {
    /// The README's "Train your own model" section is [`crate::guide`] verbatim (the README
    /// cannot include a file), so the guide users read on either side is the tested one.
    #[test]
    fn the_readme_carries_the_guide_verbatim() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let readme = std::fs::read_to_string(root.join("../../README.md")).unwrap();
        let guide = std::fs::read_to_string(root.join("src/guide.md")).unwrap();
        let heading = "## Train your own model\n\n";
        let start = readme
            .find(heading)
            .expect("the README has the guide's section")
            + heading.len();
        // The section ends with a blank line before the next heading.
        let len = readme[start..]
            .find("\n## ")
            .unwrap_or(readme.len() - start);
        assert!(
            readme[start..start + len] == guide,
            "README.md's section `Train your own model` differs from crates/fsdp/src/guide.md: copy the file into it"
        );
    }
}
