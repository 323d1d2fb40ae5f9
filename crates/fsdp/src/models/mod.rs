//! Models with Hugging Face tensor names.

pub mod bert;

pub use bert::{BertConfig, BertForSequenceClassification, BertModel};
