//! Scores of generated text against references, as Hugging Face `evaluate` computes them:
//! ROUGE-L (`rouge_score`'s default tokenizer: lowercase, runs of ASCII letters and digits as
//! tokens, no stemming; the F-measure of the longest common subsequence) and exact match
//! (after the same normalisation). Every rank computes them on the same generated text, so
//! no collective is needed.

/// ROUGE-L of one prediction against one reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RougeScore {
    /// Longest common subsequence over the prediction's tokens.
    pub precision: f64,
    /// Longest common subsequence over the reference's tokens.
    pub recall: f64,
    /// Their harmonic mean (0 when both are 0).
    pub fmeasure: f64,
}

/// `rouge_score`'s tokens: lowercase, every run of ASCII letters and digits.
pub fn rouge_tokens(text: &str) -> Vec<String> {
    text.to_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect()
}

/// ROUGE-L of `prediction` against `reference` (`rouge_score.RougeScorer(["rougeL"])`).
pub fn rouge_l(prediction: &str, reference: &str) -> RougeScore {
    let (p, r) = (rouge_tokens(prediction), rouge_tokens(reference));
    if p.is_empty() || r.is_empty() {
        return RougeScore {
            precision: 0.0,
            recall: 0.0,
            fmeasure: 0.0,
        };
    }
    let lcs = lcs_len(&p, &r) as f64;
    let (precision, recall) = (lcs / p.len() as f64, lcs / r.len() as f64);
    let fmeasure = if precision + recall > 0.0 {
        2.0 * precision * recall / (precision + recall)
    } else {
        0.0
    };
    RougeScore {
        precision,
        recall,
        fmeasure,
    }
}

/// Whether `prediction` and `reference` have the same tokens ([`rouge_tokens`]).
pub fn exact_match(prediction: &str, reference: &str) -> bool {
    rouge_tokens(prediction) == rouge_tokens(reference)
}

/// The length of the longest common subsequence of `a` and `b` (one row of the table).
fn lcs_len(a: &[String], b: &[String]) -> usize {
    let mut row = vec![0usize; b.len() + 1];
    for x in a {
        let mut diagonal = 0;
        for (j, y) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = if x == y {
                diagonal + 1
            } else {
                above.max(row[j])
            };
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rouge_l_is_the_lcs_f_measure_over_normalised_tokens() {
        // LCS "the quick brown jumps the" (5 of 9 and of 8 tokens).
        let s = rouge_l(
            "The quick brown fox jumps over the lazy dog",
            "The quick brown dog jumps on the log.",
        );
        assert_eq!((s.precision, s.recall), (5.0 / 9.0, 5.0 / 8.0));
        assert!(
            (s.fmeasure - 2.0 * (5.0 / 9.0) * (5.0 / 8.0) / (5.0 / 9.0 + 5.0 / 8.0)).abs() < 1e-15
        );
        assert_eq!(rouge_l("A-B c", "a b C").fmeasure, 1.0);
        assert_eq!(rouge_l("", "a").fmeasure, 0.0);
        assert_eq!(rouge_l("x y", "a b").fmeasure, 0.0);
        assert_eq!(
            rouge_tokens("It's 2 o'clock!"),
            ["it", "s", "2", "o", "clock"]
        );
        assert!(exact_match(" Great movie.", "great MOVIE"));
        assert!(!exact_match("great", "great movie"));
    }
}
