//! Generation with a key/value cache (`LlamaForCausalLM::next_token_logits`,
//! `fsdp::models::generate`): greedy tokens equal running the whole sequence each step
//! (`generate_greedy`), with the same logits; under FSDP on 2 and 3 real processes every rank
//! generates the one process's tokens, greedy and sampled with a seed, with units gathered
//! per token (`evaluate`) or once for the whole call (`evaluate_gathered`); a multi-token
//! continuation of a cache is refused.

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp::accelerator::Accelerator;
use fsdp::models::llama::KvCache;
use fsdp::models::{GenerationConfig, LlamaConfig, LlamaForCausalLM, generate, generate_greedy};
use fsdp::nn::{LocalParams, Module};
use serde_json::json;

use crate::common;

const ROLE: &str = "FSDP_GENERATION_WORKER";
const PROMPT: [u32; 5] = [3, 17, 8, 29, 4];

fn model() -> LlamaForCausalLM {
    let config = LlamaConfig::from_value(&json!({
        "model_type": "llama", "vocab_size": 48, "hidden_size": 24, "intermediate_size": 40,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
    }))
    .unwrap();
    LlamaForCausalLM::new(config).unwrap()
}

/// Seeded weights with a larger spread than the default init, so greedy tokens vary.
fn weights(model: &LlamaForCausalLM) -> std::collections::BTreeMap<String, Tensor> {
    LocalParams::init(&model.info(), 5, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(k, t)| {
            let t = if k.ends_with("norm.weight") {
                t
            } else {
                (t * 8.0).unwrap()
            };
            (k, t)
        })
        .collect()
}

fn sampled() -> GenerationConfig {
    GenerationConfig {
        temperature: 0.8,
        top_k: Some(20),
        top_p: Some(0.9),
        seed: 11,
        ..GenerationConfig::greedy(16, vec![])
    }
}

#[test]
fn cached_generation_gives_the_tokens_and_logits_of_running_the_whole_sequence() {
    let model = model();
    let params = LocalParams::from_tensors(&model.info(), weights(&model)).unwrap();
    let plain =
        generate_greedy(&PROMPT, 16, None, |ids| model.forward(&params, ids, None)).unwrap();
    let cache = Arc::new(KvCache::new());
    let mut steps = Vec::new();
    let cached = generate(&PROMPT, &GenerationConfig::greedy(16, vec![]), |ids| {
        let logits = model.next_token_logits(&params, ids, &cache)?;
        steps.push(logits.clone());
        Ok(logits)
    })
    .unwrap();
    assert_eq!(cached, plain);
    assert_eq!(cache.len(), PROMPT.len() + 15);
    assert!(
        plain.iter().collect::<std::collections::HashSet<_>>().len() > 3,
        "{plain:?}"
    );
    // Step 8's logits against the full sequence's last position.
    let mut seq = PROMPT.to_vec();
    seq.extend(&plain[..8]);
    let ids = Tensor::from_slice(&seq, (1, seq.len()), &Device::Cpu).unwrap();
    let full = model.forward(&params, &ids, None).unwrap();
    let want: Vec<f32> = full
        .get(0)
        .unwrap()
        .get(seq.len() - 1)
        .unwrap()
        .to_vec1()
        .unwrap();
    let got: Vec<f32> = steps[8].get(0).unwrap().to_vec1().unwrap();
    let d = common::max_rel_diff(&got, &want);
    assert!(d < 1e-5, "cached logits off by {d:e}");
    // A stop token ends it; more than one new position after a cached one is refused.
    let stop = GenerationConfig::greedy(16, vec![plain[3]]);
    let cache = Arc::new(KvCache::new());
    let short = generate(&PROMPT, &stop, |ids| {
        model.next_token_logits(&params, ids, &cache)
    })
    .unwrap();
    assert_eq!(
        short,
        plain[..=plain.iter().position(|t| *t == plain[3]).unwrap()]
    );
    let two = Tensor::from_slice(&[1u32, 2], (1, 2), &Device::Cpu).unwrap();
    let e = model.next_token_logits(&params, &two, &cache).unwrap_err();
    assert!(e.to_string().contains("one token at a time"), "{e}");
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn generation_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let mut acc = Accelerator::builder().build().unwrap();
    let model = model();
    let init = weights(&model);
    let model = acc.prepare_model(model, &init).unwrap();
    // Units gathered per token (one evaluate each).
    let per_token = |config: &GenerationConfig| {
        let cache = Arc::new(KvCache::new());
        generate(&PROMPT, config, |ids| {
            model
                .evaluate(|m, p| m.next_token_logits(p, ids, &cache))
                .map_err(|e| candle_core::Error::Msg(e.to_string()))
        })
        .unwrap()
    };
    // Units gathered once and held for the whole generation.
    let held = |config: &GenerationConfig| {
        model
            .evaluate_gathered(|m, p| {
                let cache = Arc::new(KvCache::new());
                generate(&PROMPT, config, |ids| m.next_token_logits(p, ids, &cache))
            })
            .unwrap()
    };
    let greedy = per_token(&GenerationConfig::greedy(16, vec![]));
    assert_eq!(held(&GenerationConfig::greedy(16, vec![])), greedy);
    let drawn = held(&sampled());
    assert_eq!(per_token(&sampled()), drawn);
    println!(
        "RESULT {}",
        json!({ "rank": acc.process_index(), "greedy": greedy, "sampled": drawn })
    );
}

#[test]
fn every_rank_generates_what_one_process_does() {
    let model = model();
    let params = LocalParams::from_tensors(&model.info(), weights(&model)).unwrap();
    let one = |config: &GenerationConfig| {
        let cache = Arc::new(KvCache::new());
        generate(&PROMPT, config, |ids| {
            model.next_token_logits(&params, ids, &cache)
        })
        .unwrap()
    };
    let (greedy, sampled) = (one(&GenerationConfig::greedy(16, vec![])), one(&sampled()));
    assert_ne!(greedy, sampled);
    for world in [2, 3] {
        let outputs = common::run_workers(
            "generation_worker",
            ROLE,
            world,
            &[],
            Duration::from_secs(120),
        );
        for out in &outputs {
            let r = common::result_of(out);
            let got: Vec<u32> = serde_json::from_value(r["greedy"].clone()).unwrap();
            assert_eq!(got, greedy, "{world} ranks, rank {}", r["rank"]);
            let got: Vec<u32> = serde_json::from_value(r["sampled"].clone()).unwrap();
            assert_eq!(got, sampled, "{world} ranks, rank {}", r["rank"]);
        }
    }
}
