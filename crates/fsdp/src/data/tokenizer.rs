//! A Hugging Face `tokenizer.json` turned into model inputs the way Accelerate's
//! `nlp_example` asks for them: padded to the longest text of the batch (not to a fixed
//! length baked into the file), truncated to an optional maximum, with the attention mask and
//! token types.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use tokenizers::{EncodeInput, PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The file could not be read or parsed.
    #[error("tokenizer {path}: {message}")]
    Load {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// Encoding failed.
    #[error("tokenizer {path}: encoding failed: {message}")]
    Encode {
        /// The file the tokenizer came from.
        path: PathBuf,
        /// The tokenizer's message.
        message: String,
    },
    /// Building the tensors failed.
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

/// Model inputs for a batch of texts, each `[batch, longest]` (u32).
#[derive(Debug, Clone)]
pub struct TextBatch {
    /// Token ids, padded with the tokenizer's pad id.
    pub input_ids: Tensor,
    /// 1 for real tokens, 0 for padding.
    pub attention_mask: Tensor,
    /// Segment ids (0 for single texts).
    pub token_type_ids: Tensor,
}

/// A loaded `tokenizer.json` with batch-longest padding and optional truncation.
pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
}

impl TextTokenizer {
    /// Loads `path`. Whatever truncation and padding the file switches on (a fixed padding to
    /// 128, say) are replaced: texts are truncated to `max_length` tokens when given, and each
    /// batch is padded to its longest text.
    pub fn from_file(path: &Path, max_length: Option<usize>) -> Result<Self, TokenizerError> {
        let load = |message: String| TokenizerError::Load {
            path: path.to_path_buf(),
            message,
        };
        let mut inner = Tokenizer::from_file(path).map_err(|e| load(e.to_string()))?;
        let (pad_id, pad_token) = match inner.get_padding() {
            Some(p) => (p.pad_id, p.pad_token.clone()),
            None => match inner.token_to_id("[PAD]") {
                Some(id) => (id, "[PAD]".to_string()),
                None => (0, String::new()),
            },
        };
        inner.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            pad_id,
            pad_token,
            ..Default::default()
        }));
        let truncation = max_length.map(|max_length| TruncationParams {
            max_length,
            ..Default::default()
        });
        inner
            .with_truncation(truncation)
            .map_err(|e| load(e.to_string()))?;
        Ok(TextTokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// Encodes `texts` (with the model's special tokens) into one padded batch on `device`.
    pub fn encode_batch(
        &self,
        texts: &[&str],
        device: &Device,
    ) -> Result<TextBatch, TokenizerError> {
        let inputs = texts.iter().map(|t| EncodeInput::Single((*t).into()));
        self.encode(inputs.collect(), device)
    }

    /// Encodes sentences or sentence pairs (`[CLS] a [SEP] b [SEP]`, token types 0 then 1)
    /// into one padded batch; truncation shortens the longer text of a pair first.
    pub fn encode_pairs(
        &self,
        texts: &[(&str, Option<&str>)],
        device: &Device,
    ) -> Result<TextBatch, TokenizerError> {
        let inputs = texts.iter().map(|(a, b)| match b {
            Some(b) => EncodeInput::Dual((*a).into(), (*b).into()),
            None => EncodeInput::Single((*a).into()),
        });
        self.encode(inputs.collect(), device)
    }

    /// Each sentence's or pair's token count as [`TextTokenizer::encode_pairs`] encodes it
    /// (special tokens and truncation included, padding not): the lengths
    /// [`crate::data::DataLoader::group_by_length`] and `balance_lengths` take.
    pub fn token_counts(
        &self,
        texts: &[(&str, Option<&str>)],
    ) -> Result<Vec<usize>, TokenizerError> {
        let inputs = texts.iter().map(|(a, b)| match b {
            Some(b) => EncodeInput::Dual((*a).into(), (*b).into()),
            None => EncodeInput::Single((*a).into()),
        });
        let encodings = self
            .inner
            .encode_batch(inputs.collect(), true)
            .map_err(|e| TokenizerError::Encode {
                path: self.path.clone(),
                message: e.to_string(),
            })?;
        let real =
            |e: &tokenizers::Encoding| e.get_attention_mask().iter().filter(|&&m| m == 1).count();
        Ok(encodings.iter().map(real).collect())
    }

    fn encode(
        &self,
        inputs: Vec<EncodeInput<'_>>,
        device: &Device,
    ) -> Result<TextBatch, TokenizerError> {
        let encodings =
            self.inner
                .encode_batch(inputs, true)
                .map_err(|e| TokenizerError::Encode {
                    path: self.path.clone(),
                    message: e.to_string(),
                })?;
        let longest = encodings
            .iter()
            .map(|e| e.get_ids().len())
            .max()
            .unwrap_or(0);
        let rows = encodings.len();
        let flat = |f: &dyn Fn(&tokenizers::Encoding) -> &[u32]| -> Vec<u32> {
            encodings
                .iter()
                .flat_map(|e| f(e).iter().copied())
                .collect()
        };
        let tensor = |v: Vec<u32>| Tensor::from_vec(v, (rows, longest), device);
        Ok(TextBatch {
            input_ids: tensor(flat(&|e| e.get_ids()))?,
            attention_mask: tensor(flat(&|e| e.get_attention_mask()))?,
            token_type_ids: tensor(flat(&|e| e.get_type_ids()))?,
        })
    }

    /// The id of `token` in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}
