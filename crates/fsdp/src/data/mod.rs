//! Input pipelines: text to model inputs.

pub mod tokenizer;

pub use tokenizer::{TextBatch, TextTokenizer, TokenizerError};
