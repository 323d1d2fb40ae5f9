//! Models with Hugging Face tensor names.

pub mod bert;
pub mod gpt2;

pub use bert::{BertConfig, BertForSequenceClassification, BertModel};
pub use gpt2::{Gpt2Config, Gpt2LmHeadModel};
