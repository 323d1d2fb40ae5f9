//! Models with Hugging Face tensor names.

pub mod bert;
pub mod gpt2;

pub use bert::{BertConfig, BertForSequenceClassification, BertModel};
pub use gpt2::{Gpt2Config, Gpt2LmHeadModel};

/// A seed per (step seed, call site), so every dropout site draws its own mask.
pub(crate) fn site_seed(seed: u64, site: &str) -> u64 {
    site.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}
