//! Text classification data: examples (a text or a sentence pair, and a label), readers for
//! the VADER movie-review snippets (a sentiment task: the sign of the mean human rating) and
//! the GLUE MRPC TSV layout (paraphrase pairs), a seeded train/test split, and the collation
//! into model inputs.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::loader::{CollateError, permutation};
use super::tokenizer::{TextBatch, TextTokenizer};

/// One example: a text (or a pair) and its class.
#[derive(Debug, Clone, PartialEq)]
pub struct TextExample {
    /// The text (the first of a pair).
    pub text: String,
    /// The second text of a pair.
    pub pair: Option<String>,
    /// The class index.
    pub label: u32,
}

/// Why a data file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A line is not in the expected layout.
    #[error("{}:{line}: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

fn read(path: &Path) -> Result<String, DataError> {
    std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The sentences of a VADER ground-truth file (`id \t mean rating \t text`, as the movie
/// reviews, Amazon reviews, NYT editorials and tweets files are), with their mean human
/// rating.
pub fn vader_rated_sentences(path: &Path) -> Result<Vec<(f64, String)>, DataError> {
    let text = read(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let mut fields = line.splitn(3, '\t');
        let (_, score, sentence) = (fields.next(), fields.next(), fields.next());
        let format = |reason: &str| DataError::Format {
            path: path.to_path_buf(),
            line: i + 1,
            reason: reason.into(),
        };
        let score: f64 = score
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| format("expected `id <tab> rating <tab> text` with a numeric rating"))?;
        let sentence = sentence.ok_or_else(|| format("no text"))?.trim();
        if !sentence.is_empty() {
            out.push((score, sentence.to_string()));
        }
    }
    Ok(out)
}

/// VADER's four rated-sentence files in `dir` (movie and Amazon reviews, New York Times
/// editorials, tweets, in that order) as a language model's text: (training, held-out)
/// sentences, every 20th held out. The language-model examples train on it.
pub fn vader_lm_sentences(dir: &Path) -> Result<(Vec<String>, Vec<String>), DataError> {
    let (mut train, mut held_out) = (Vec::new(), Vec::new());
    let files = [
        "movieReviewSnippets",
        "amazonReviewSnippets",
        "nytEditorialSnippets",
        "tweets",
    ];
    for name in files {
        for (_, sentence) in vader_rated_sentences(&dir.join(format!("{name}_GroundTruth.txt")))? {
            let n = train.len() + held_out.len();
            if n % 20 == 19 {
                &mut held_out
            } else {
                &mut train
            }
            .push(sentence);
        }
    }
    Ok((train, held_out))
}

/// The VADER movie-review snippets (`movieReviewSnippets_GroundTruth.txt`): label 1 for a
/// positive rating, 0 for a negative one; the few rated exactly 0 are left out.
pub fn vader_movie_reviews(path: &Path) -> Result<Vec<TextExample>, DataError> {
    Ok(vader_rated_sentences(path)?
        .into_iter()
        .filter(|(score, _)| *score != 0.0)
        .map(|(score, text)| TextExample {
            text,
            pair: None,
            label: u32::from(score > 0.0),
        })
        .collect())
}

/// A GLUE MRPC file (`Quality \t #1 ID \t #2 ID \t #1 String \t #2 String`, with a header
/// line): sentence pairs, label 1 for paraphrases.
pub fn mrpc_tsv(path: &Path) -> Result<Vec<TextExample>, DataError> {
    let text = read(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').collect();
        let format = |reason: String| DataError::Format {
            path: path.to_path_buf(),
            line: i + 1,
            reason,
        };
        if fields.len() < 5 {
            return Err(format(format!(
                "{} tab-separated fields, MRPC has 5",
                fields.len()
            )));
        }
        let label = match fields[0].trim() {
            "0" => 0,
            "1" => 1,
            other => return Err(format(format!("quality `{other}`, expected 0 or 1"))),
        };
        out.push(TextExample {
            text: fields[3].to_string(),
            pair: Some(fields[4].to_string()),
            label,
        });
    }
    Ok(out)
}

/// A seeded split: `test_fraction` of the examples (shuffled with `seed`) held out.
pub fn train_test_split<T: Clone>(
    examples: &[T],
    test_fraction: f64,
    seed: u64,
) -> (Vec<T>, Vec<T>) {
    let order = permutation(examples.len(), seed, u64::MAX);
    let test = ((examples.len() as f64) * test_fraction.clamp(0.0, 1.0)).round() as usize;
    let pick = |idx: &[usize]| idx.iter().map(|&i| examples[i].clone()).collect();
    (pick(&order[test..]), pick(&order[..test]))
}

/// A tokenized batch with its labels.
#[derive(Debug, Clone)]
pub struct ClassificationBatch {
    /// Model inputs, padded to the batch's longest text.
    pub inputs: TextBatch,
    /// Labels `[batch]` (u32).
    pub labels: Tensor,
}

/// Tokenizes examples (pairs included) into one batch on `device`: the collate function of
/// a text classification loader.
///
/// ```no_run
/// use fsdp::data::{DataLoader, TextExample, TextTokenizer, collate};
/// use fsdp::nn::candle::Device;
///
/// // A Hugging Face tokenizer.json, sequences cut at 128 tokens.
/// let tokenizer = TextTokenizer::from_file("model/tokenizer.json".as_ref(), Some(128))?;
/// let examples = vec![TextExample { text: "a fine film".into(), pair: None, label: 1 }];
/// let mut loader = DataLoader::new(examples, 16, move |ex: &[TextExample]| collate(&tokenizer, ex, &Device::Cpu));
/// let batch = loader.next_batch().expect("one step")?.batch;
/// let (ids, mask) = (&batch.inputs.input_ids, &batch.inputs.attention_mask); // [batch, longest]
/// # let _ = (ids, mask);
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
pub fn collate(
    tokenizer: &TextTokenizer,
    examples: &[TextExample],
    device: &Device,
) -> Result<ClassificationBatch, CollateError> {
    let texts: Vec<(&str, Option<&str>)> = examples
        .iter()
        .map(|e| (e.text.as_str(), e.pair.as_deref()))
        .collect();
    let inputs = tokenizer.encode_pairs(&texts, device)?;
    let labels: Vec<u32> = examples.iter().map(|e| e.label).collect();
    let labels = Tensor::from_vec(labels, examples.len(), device)?;
    Ok(ClassificationBatch { inputs, labels })
}

/// A language model's training text as consecutive windows of `len` tokens (the remainder
/// that fills no window is left out), each window a sequence that is its own labels (what
/// the causal-LM loss shifts).
#[derive(Debug, Clone)]
pub struct TokenWindows {
    ids: std::sync::Arc<Vec<u32>>,
    len: usize,
}

impl TokenWindows {
    /// Windows of `len` (at least 1) tokens over `ids`.
    pub fn new(ids: Vec<u32>, len: usize) -> TokenWindows {
        TokenWindows {
            ids: std::sync::Arc::new(ids),
            len: len.max(1),
        }
    }

    /// A batch of windows as ids `[windows, len]` (u32): the collate function of a loader
    /// over these windows.
    pub fn stack(windows: &[Vec<u32>]) -> Result<Tensor, CollateError> {
        let len = windows.first().map_or(0, Vec::len);
        Ok(Tensor::from_vec(
            windows.concat(),
            (windows.len(), len),
            &Device::Cpu,
        )?)
    }
}

impl super::loader::Dataset for TokenWindows {
    type Item = Vec<u32>;

    fn len(&self) -> usize {
        self.ids.len() / self.len
    }

    fn get(&self, index: usize) -> Vec<u32> {
        self.ids[index * self.len..(index + 1) * self.len].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Dataset;

    #[test]
    fn token_windows_are_consecutive_and_stack_into_a_batch() {
        let windows = TokenWindows::new((0..10).collect(), 3);
        assert_eq!(windows.len(), 3, "the last token fills no window");
        assert_eq!(windows.get(1), [3, 4, 5]);
        let batch = TokenWindows::stack(&[windows.get(0), windows.get(2)]).unwrap();
        assert_eq!(batch.dims(), [2, 3]);
        assert_eq!(batch.to_vec2::<u32>().unwrap(), [[0, 1, 2], [6, 7, 8]]);
    }
}
