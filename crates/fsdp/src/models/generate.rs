//! Generation as transformers' `generate` does it for a causal LM: greedy, or sampling with a
//! temperature, top-k and top-p from a seeded generator, stopping at a stop token. The model
//! step is the caller's: under FSDP every rank runs the same steps (one `evaluate` per token,
//! the units gathered for it) with the same seed, so every rank draws the same tokens.

use candle_core::{DType, Result, Tensor};

use crate::rng::NormalRng;

/// How tokens are chosen (transformers' `GenerationConfig` fields of the same names).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// Tokens generated at most.
    pub max_new_tokens: usize,
    /// 0: greedy (`do_sample=False`); otherwise logits are divided by it and sampled.
    pub temperature: f64,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Sample among the fewest most likely tokens whose probabilities sum to `p` or more.
    pub top_p: Option<f64>,
    /// The sampler's seed (the same on every rank).
    pub seed: u64,
    /// Generation ends after one of these (the end-of-text token).
    pub stop_tokens: Vec<u32>,
}

impl GenerationConfig {
    /// Greedy decoding of up to `max_new_tokens`, stopping at `stop_tokens`.
    pub fn greedy(max_new_tokens: usize, stop_tokens: Vec<u32>) -> GenerationConfig {
        GenerationConfig {
            max_new_tokens,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            stop_tokens,
        }
    }

    fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            candle_core::bail!("generation: temperature {} must be ≥ 0", self.temperature);
        }
        if self.top_k == Some(0) {
            candle_core::bail!("generation: top_k 0 keeps no token (at least 1)");
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            candle_core::bail!("generation: top_p {p} must be in (0, 1]");
        }
        Ok(())
    }
}

/// Up to `config.max_new_tokens` tokens after `prompt`. `next_logits(ids)` runs the model on
/// `ids` `[1, n]` — the prompt first, then each chosen token alone — and returns the next
/// token's logits `[1, vocab]`, keeping what it needs between calls (a
/// [`super::llama::KvCache`]: `LlamaForCausalLM::next_token_logits`). `ids` are made on the
/// CPU: a model computing elsewhere takes them to its device there
/// (`ids.to_device(acc.device())`).
pub fn generate(
    prompt: &[u32],
    config: &GenerationConfig,
    mut next_logits: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Vec<u32>> {
    config.check()?;
    if prompt.is_empty() {
        candle_core::bail!("generation: the prompt has no token");
    }
    let mut rng = NormalRng::new(config.seed);
    let mut input = prompt.to_vec();
    let mut new = Vec::new();
    while new.len() < config.max_new_tokens {
        let ids = Tensor::from_slice(&input, (1, input.len()), &candle_core::Device::Cpu)?;
        let logits: Vec<f32> = next_logits(&ids)?.get(0)?.to_dtype(DType::F32)?.to_vec1()?;
        let next = choose(&logits, config, &mut rng)?;
        new.push(next);
        if config.stop_tokens.contains(&next) {
            break;
        }
        input = vec![next];
    }
    Ok(new)
}

/// The next token from `logits`: the most likely (lowest id on a tie) when greedy, else a
/// draw from the tempered, top-k and top-p filtered distribution. Tokens at `+inf` share
/// all the probability (the limit of growing logits); weights are taken relative to the
/// largest logit, so a temperature so small that every other weight underflows draws the
/// most likely token, as greedy decoding does, instead of overflowing. NaN logits, no logits
/// and only `-inf` logits are errors: no token can be chosen from them.
fn choose(logits: &[f32], config: &GenerationConfig, rng: &mut NormalRng) -> Result<u32> {
    if logits.is_empty() {
        candle_core::bail!("generation: the model returned no logits (an empty vocabulary)");
    }
    if let Some(i) = logits.iter().position(|l| l.is_nan()) {
        candle_core::bail!(
            "generation: the logit of token {i} is NaN (of {}): the model's output is not a distribution",
            logits.len()
        );
    }
    if logits.iter().all(|&l| l == f32::NEG_INFINITY) {
        candle_core::bail!(
            "generation: every one of the {} logits is -inf: no token can be chosen",
            logits.len()
        );
    }
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 { (i, v) } else { best }
            })
            .0 as u32
    };
    if config.temperature == 0.0 {
        return Ok(argmax());
    }
    // Most likely first (ids ascending on ties): tempering keeps the order.
    let mut order: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l as f64))
        .collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    order.truncate(config.top_k.unwrap_or(order.len()).max(1));
    let top = order[0].1;
    let mut probs: Vec<f64> = if top == f64::INFINITY {
        order.iter().map(|&(_, l)| f64::from(l == top)).collect()
    } else {
        order
            .iter()
            .map(|&(_, l)| ((l - top) / config.temperature).exp())
            .collect()
    };
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(top_p) = config.top_p {
        let mut sum = 0.0;
        let keep = probs
            .iter()
            .position(|&p| {
                sum += p;
                sum >= top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        let kept: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= kept);
    }
    let mut r = rng.uniform();
    for (i, p) in probs.iter().enumerate() {
        if r < *p {
            return Ok(order[i].0);
        }
        r -= p;
    }
    // Rounding left `r` above the last sum: the last token with any probability.
    let last = probs.iter().rposition(|&p| p > 0.0).unwrap_or(0);
    Ok(order[last].0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_filters_as_transformers_and_repeats_with_its_seed() {
        let logits = [0.0f32, 3.0, 1.0, 2.9, -1.0];
        let sampled = |k, p, seed| {
            let c = GenerationConfig {
                temperature: 1.0,
                top_k: k,
                top_p: p,
                seed,
                ..GenerationConfig::greedy(1, vec![])
            };
            let mut rng = NormalRng::new(seed);
            (0..200)
                .map(|_| choose(&logits, &c, &mut rng).unwrap())
                .collect::<Vec<u32>>()
        };
        // Greedy: the largest logit.
        let greedy = GenerationConfig::greedy(1, vec![]);
        assert_eq!(choose(&logits, &greedy, &mut NormalRng::new(0)).unwrap(), 1);
        // top_k 1 is greedy; top_k 2 draws only ids 1 and 3, both.
        assert!(sampled(Some(1), None, 5).iter().all(|&t| t == 1));
        let two = sampled(Some(2), None, 5);
        assert!(two.iter().all(|&t| t == 1 || t == 3) && two.contains(&1) && two.contains(&3));
        // top_p 0.5: id 1 alone holds about 0.47, so ids 1 and 3 are kept.
        let p = sampled(None, Some(0.5), 6);
        assert!(p.iter().all(|&t| t == 1 || t == 3) && p.contains(&3));
        // The same seed draws the same tokens; no filter reaches the unlikely ones too.
        assert_eq!(sampled(None, None, 9), sampled(None, None, 9));
        assert!(sampled(None, None, 9).contains(&2));
        let bad = GenerationConfig {
            top_p: Some(0.0),
            ..greedy.clone()
        };
        assert!(bad.check().unwrap_err().to_string().contains("top_p"));
    }

    #[test]
    fn overflowing_infinite_nan_and_empty_logits_never_pick_an_unlikely_token() {
        let sample = |logits: &[f32], temperature: f64, seed| {
            let c = GenerationConfig {
                temperature,
                ..GenerationConfig::greedy(1, vec![])
            };
            choose(logits, &c, &mut NormalRng::new(seed))
        };
        let logits = [0.5f32, 9.0, -3.0, 8.5, 1.0];
        // A temperature whose tempered logits overflow: the most likely token, every draw
        // (it used to be the last, least likely one).
        for t in [1e-310, 1e-300, 1e-30, f64::MIN_POSITIVE] {
            for seed in 0..20 {
                assert_eq!(sample(&logits, t, seed).unwrap(), 1, "temperature {t}");
            }
        }
        // +inf logits take all the probability, shared; -inf ones none.
        let inf = [1.0f32, f32::INFINITY, f32::NEG_INFINITY, f32::INFINITY, 2.0];
        let drawn: Vec<u32> = (0..200).map(|s| sample(&inf, 1.0, s).unwrap()).collect();
        assert!(drawn.iter().all(|&t| t == 1 || t == 3), "{drawn:?}");
        assert!(drawn.contains(&1) && drawn.contains(&3));
        assert_eq!(sample(&inf, 0.0, 0).unwrap(), 1);
        let minus = [f32::NEG_INFINITY, -1.0, f32::NEG_INFINITY];
        assert!((0..50).all(|s| sample(&minus, 2.0, s).unwrap() == 1));
        // NaN, nothing, or nothing possible: errors naming what is wrong.
        for t in [0.0, 1.0] {
            let e = sample(&[0.0, f32::NAN, 1.0], t, 0).unwrap_err().to_string();
            assert!(e.contains("token 1 is NaN"), "{e}");
            let e = sample(&[], t, 0).unwrap_err().to_string();
            assert!(e.contains("no logits"), "{e}");
            let e = sample(&[f32::NEG_INFINITY; 3], t, 0)
                .unwrap_err()
                .to_string();
            assert!(e.contains("-inf"), "{e}");
        }
    }
}
