//! Models with Hugging Face tensor names, built from [`crate::nn::Module`]s.

pub mod bert;
pub mod gpt2;

pub use bert::{BertConfig, BertForSequenceClassification, BertInput, BertLayer, BertModel};
pub use gpt2::{Gpt2Config, Gpt2LmHeadModel};
