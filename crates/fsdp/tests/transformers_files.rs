//! The files beside a saved Llama-family model that transformers 4.x and 5.x must read alike
//! (`fsdp::models::llama::transformers_files`): the RoPE settings both ways in `config.json`
//! (and read back by our own config parser as the same model), the special tokens of
//! `tokenizer_config.json` / `special_tokens_map.json` by name, the generation ids, and
//! errors for ids outside the vocabulary. Loading by transformers itself (two versions) is
//! `llama_example_fine_tunes_smollm2_from_gguf_and_saves_it` with
//! `FSDP_TORCH_PYTHON` set.

use std::collections::HashMap;

use fsdp::models::LlamaConfig;
use fsdp::models::llama::{
    TokenizerExtras, generation_config, portable_config, tokenizer_files,
    write_tokenizer_and_generation_files,
};
use serde_json::{Value, json};
use tokenizers::Tokenizer;
use tokenizers::models::wordlevel::WordLevel;

fn base() -> Value {
    json!({
        "model_type": "llama", "vocab_size": 4, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 2,
    })
}

fn with(mut v: Value, key: &str, value: Value) -> Value {
    v[key] = value;
    v
}

fn tokenizer() -> Tokenizer {
    let vocab: HashMap<String, u32> = ["<unk>", "<s>", "</s>", "<eot>"]
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    Tokenizer::new(
        WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("<unk>".into())
            .build()
            .unwrap(),
    )
}

#[test]
fn rope_settings_are_written_both_ways_and_mean_the_same_model() {
    let five = with(
        base(),
        "rope_parameters",
        json!({"rope_type": "default", "rope_theta": 100000.0}),
    );
    let out = portable_config(&five);
    assert_eq!(out["rope_theta"], 100000.0);
    assert!(out.get("rope_scaling").is_none(), "{out}");
    assert_eq!(out["rope_parameters"], five["rope_parameters"]);

    let scaled = with(
        base(),
        "rope_parameters",
        json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}),
    );
    let out = portable_config(&scaled);
    assert_eq!(out["rope_theta"], 5e5);
    assert_eq!(
        out["rope_scaling"],
        json!({"rope_type": "linear", "factor": 2.0})
    );

    let four = with(
        with(base(), "rope_theta", json!(5e5)),
        "rope_scaling",
        json!({"rope_type": "linear", "factor": 2.0}),
    );
    let out = portable_config(&four);
    assert_eq!(out["rope_parameters"], scaled["rope_parameters"]);

    let neither = portable_config(&base());
    assert_eq!(neither["rope_theta"], 10000.0);
    assert_eq!(neither["rope_parameters"]["rope_theta"], 10000.0);

    // Our reader sees the same model in every input and its portable form.
    for v in [five, scaled, four, base()] {
        let (a, b) = (
            LlamaConfig::from_value(&v).unwrap(),
            LlamaConfig::from_value(&portable_config(&v)).unwrap(),
        );
        assert_eq!(a, b, "{v}");
    }
}

#[test]
fn special_tokens_are_named_and_generation_ids_kept() {
    let extras = TokenizerExtras {
        unk_token_id: Some(0),
        chat_template: Some("{{ messages }}".into()),
    };
    let (config, special) = tokenizer_files(&base(), &tokenizer(), &extras).unwrap();
    assert_eq!(
        special,
        json!({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>", "unk_token": "<unk>"})
    );
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(config["chat_template"], "{{ messages }}");
    assert_eq!(config["model_max_length"], 64);
    assert_eq!(
        config["model_input_names"],
        json!(["input_ids", "attention_mask"])
    );
    assert_eq!(
        generation_config(&base()),
        json!({"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 2})
    );

    let dir = tempfile::tempdir().unwrap();
    write_tokenizer_and_generation_files(dir.path(), &base(), &tokenizer(), &extras).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "generation_config.json",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(f)).unwrap()).unwrap()
    };
    assert_eq!(read("tokenizer_config.json"), config);
    assert_eq!(read("special_tokens_map.json"), special);
    let back = Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(back.token_to_id("</s>"), Some(2));
    // A transformers folder's tokenizer_config.json gives the extras back.
    let again =
        TokenizerExtras::from_tokenizer_config(&dir.path().join("tokenizer_config.json"), &back)
            .unwrap();
    assert_eq!(again, extras);
}

#[test]
fn an_id_outside_the_vocabulary_is_an_error_naming_the_field() {
    let e = tokenizer_files(
        &with(base(), "pad_token_id", json!(7)),
        &tokenizer(),
        &TokenizerExtras::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`pad_token_id` 7 is outside the tokenizer's vocabulary of 4"),
        "{e}"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{ not json").unwrap();
    let e = TokenizerExtras::from_tokenizer_config(
        &dir.path().join("tokenizer_config.json"),
        &tokenizer(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("tokenizer_config.json: not JSON"), "{e}");
}
