//! llama_example's generation metric: held-out sentences continued from their first tokens by
//! the sharded model, scored against the sentences' own continuations with ROUGE-L and exact
//! match (as `evaluate.load("rouge")` and `"exact_match"` score them).

use anyhow::Result;
use fsdp::data::metrics::{exact_match, rouge_l};

/// Tokens of a held-out sentence given as the prompt.
pub const PROMPT_TOKENS: usize = 4;

/// Held-out continuation tasks: each a prompt (a sentence's first [`PROMPT_TOKENS`] tokens)
/// and the reference (the text of its next tokens, as many as are generated).
pub struct GenerationTasks {
    pub prompts: Vec<Vec<u32>>,
    references: Vec<String>,
}

/// The mean scores of a set of generations.
pub struct GenerationScores {
    pub rouge_l: f64,
    pub exact: usize,
    pub count: usize,
}

impl GenerationTasks {
    /// Up to `count` tasks from `sentences` (those with at least two tokens past the prompt),
    /// references of `new_tokens` tokens.
    pub fn new(
        sentences: &[String],
        tokenizer: &tokenizers::Tokenizer,
        count: usize,
        new_tokens: usize,
    ) -> Result<GenerationTasks> {
        let (mut prompts, mut references) = (Vec::new(), Vec::new());
        for s in sentences {
            if prompts.len() == count {
                break;
            }
            let ids = tokenizer
                .encode(s.as_str(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing a held-out sentence: {e}"))?
                .get_ids()
                .to_vec();
            if ids.len() < PROMPT_TOKENS + 2 {
                continue;
            }
            let end = ids.len().min(PROMPT_TOKENS + new_tokens);
            let reference = tokenizer
                .decode(&ids[PROMPT_TOKENS..end], true)
                .map_err(|e| anyhow::anyhow!("decoding: {e}"))?;
            prompts.push(ids[..PROMPT_TOKENS].to_vec());
            references.push(reference);
        }
        Ok(GenerationTasks {
            prompts,
            references,
        })
    }

    /// Scores `generated` (one token list per prompt, in order).
    pub fn score(
        &self,
        generated: &[Vec<u32>],
        tokenizer: &tokenizers::Tokenizer,
    ) -> Result<GenerationScores> {
        let (mut rouge, mut exact) = (0.0, 0);
        for (tokens, reference) in generated.iter().zip(&self.references) {
            let text = tokenizer
                .decode(tokens, true)
                .map_err(|e| anyhow::anyhow!("decoding: {e}"))?;
            rouge += rouge_l(&text, reference).fmeasure;
            exact += usize::from(exact_match(&text, reference));
        }
        let count = self.references.len();
        Ok(GenerationScores {
            rouge_l: rouge / count.max(1) as f64,
            exact,
            count,
        })
    }
}
