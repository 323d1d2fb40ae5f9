//! Input pipelines: distributed data loading (every rank its share of each step, the same
//! permutation everywhere, a position to resume from), text classification data and
//! tokenization, and the scores of generated text against references (`metrics`).

pub mod loader;
pub mod metrics;
pub mod order;
pub mod text;
pub mod tokenizer;

pub use loader::{
    BatchError, CollateError, DataLoader, Dataset, LengthsMismatch, LoadedBatch, LoaderPosition,
    balanced_shares, group_by_length, permutation,
};
pub use text::{
    ClassificationBatch, DataError, TextExample, TokenWindows, collate, mrpc_tsv, train_test_split,
    vader_lm_sentences, vader_movie_reviews, vader_rated_sentences,
};
pub use tokenizer::{TextBatch, TextTokenizer, TokenizerError};
