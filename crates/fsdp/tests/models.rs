//! Model structure and behaviour: Hugging Face names, tied weights, causality, training, and
//! loading by name with and without the task prefix.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use fsdp::models::{
    BertConfig, BertForSequenceClassification, BertModel, Gpt2Config, Gpt2LmHeadModel,
};
use fsdp::nn::Module;
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Params};
use fsdp::optim::{AdamW, AdamWConfig, Optimizer};

fn tiny_gpt2() -> Gpt2LmHeadModel {
    Gpt2LmHeadModel::new(
        Gpt2Config::from_json(
            r#"{"vocab_size": 50, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4}"#,
        )
        .unwrap(),
    )
    .unwrap()
}

fn tiny_bert() -> BertConfig {
    BertConfig::from_json(r#"{"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 16, "num_labels": 3}"#).unwrap()
}

#[test]
fn gpt2_names_types_and_tied_embedding() {
    let model = tiny_gpt2();
    let info = model.info();
    let shapes: HashMap<String, Vec<usize>> = info
        .all_params()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    assert_eq!(shapes["transformer.h.1.attn.c_attn.weight"], [32, 96]);
    assert_eq!(shapes["transformer.h.0.mlp.c_proj.weight"], [128, 32]);
    assert_eq!(shapes["transformer.wte.weight"], [50, 32]);
    assert!(
        !shapes.contains_key("lm_head.weight"),
        "the head has no weight of its own"
    );
    assert_eq!(info.tied(), [("lm_head", "transformer.wte.weight")]);
    let blocks = info
        .modules()
        .into_iter()
        .filter(|m| m.type_name == "GPT2Block")
        .count();
    assert_eq!(blocks, 2);
}

fn step(model: &Gpt2LmHeadModel, params: &LocalParams, ids: &Tensor, adamw: &mut AdamW) -> f32 {
    let loss = model
        .loss(&model.forward(params, ids).unwrap(), ids)
        .unwrap();
    let grads = loss.backward().unwrap();
    for (name, var) in params.vars() {
        let g: Vec<f32> = grads
            .get(var)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut p: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        adamw.update(name, &mut p, &g).unwrap();
        var.set(&Tensor::from_vec(p, var.dims(), &Device::Cpu).unwrap())
            .unwrap();
    }
    loss.to_scalar::<f32>().unwrap()
}

#[test]
fn gpt2_is_causal_ties_gradients_and_learns() {
    let model = tiny_gpt2();
    let params = LocalParams::init(&model.info(), 7, DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(
        &[
            [1u32, 5, 9, 13, 17, 21, 25, 29],
            [2, 6, 10, 14, 18, 22, 26, 30],
        ],
        &Device::Cpu,
    )
    .unwrap();
    // Changing the last token leaves every earlier position's logits unchanged.
    let a = model.forward(&params, &ids).unwrap();
    let changed = Tensor::new(
        &[
            [1u32, 5, 9, 13, 17, 21, 25, 40],
            [2, 6, 10, 14, 18, 22, 26, 30],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let b = model.forward(&params, &changed).unwrap();
    let max_abs = |t: candle_core::Result<Tensor>| -> f32 {
        t.and_then(|t| t.abs()?.max_all()?.to_scalar::<f32>())
            .unwrap()
    };
    let diff = max_abs(a.narrow(1, 0, 7).unwrap() - b.narrow(1, 0, 7).unwrap());
    assert_eq!(diff, 0.0);
    let last = max_abs(a.narrow(1, 7, 1).unwrap() - b.narrow(1, 7, 1).unwrap());
    assert!(last > 0.0);
    // The tied embedding receives gradient through the head for tokens never in the input.
    let loss = model.loss(&a, &ids).unwrap();
    let grads = loss.backward().unwrap();
    let g = grads.get(&params.vars()["transformer.wte.weight"]).unwrap();
    let unseen = g
        .get(45)
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(unseen > 0.0, "no gradient through lm_head");
    // With the head fused into the loss: the same loss and gradients.
    let fused = model.forward_loss(&params, &ids, &ids).unwrap();
    let (l0, l1) = (
        loss.to_scalar::<f32>().unwrap(),
        fused.to_scalar::<f32>().unwrap(),
    );
    assert!((l0 - l1).abs() <= 1e-6 * l0.abs(), "{l0} vs {l1}");
    let fused_grads = fused.backward().unwrap();
    for (name, var) in params.vars() {
        let (a, b) = (grads.get(var).unwrap(), fused_grads.get(var).unwrap());
        let (scale, d) = (max_abs(Ok(a.clone())), max_abs(a - b));
        assert!(
            d <= 1e-5 * scale.max(1e-12),
            "{name}: gradients differ by {d}"
        );
    }
    // A few steps of AdamW memorise the two sequences.
    let mut adamw = AdamW::new(AdamWConfig {
        lr: 3e-3,
        ..Default::default()
    })
    .unwrap();
    let first = step(&model, &params, &ids, &mut adamw);
    let mut last_loss = first;
    for _ in 2..=40 {
        last_loss = step(&model, &params, &ids, &mut adamw);
    }
    assert!(last_loss < first * 0.2, "loss {first} -> {last_loss}");
}

#[test]
fn bert_loads_with_and_without_task_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let task = BertForSequenceClassification::new(tiny_bert()).unwrap();
    let params = LocalParams::init(&task.info(), 3, DType::F32, &Device::Cpu).unwrap();
    let path = dir.path().join("task.safetensors");
    candle_core::safetensors::save(
        &params.tensors().into_iter().collect::<HashMap<_, _>>(),
        &path,
    )
    .unwrap();
    // A bare BertModel reads a task checkpoint: `bert.` is dropped, the classifier unexpected.
    let base = BertModel::new(tiny_bert(), "").unwrap();
    let (base_params, report) = LocalParams::load(&base.info(), &path, &Device::Cpu).unwrap();
    assert_eq!(report.unexpected, ["classifier.bias", "classifier.weight"]);
    let a = base_params
        .get("embeddings.word_embeddings.weight")
        .unwrap();
    let b = params
        .get("bert.embeddings.word_embeddings.weight")
        .unwrap();
    assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
    // A task model reads a base checkpoint only if the head is there: the error names it.
    let base_path = dir.path().join("base.safetensors");
    candle_core::safetensors::save(
        &base_params.tensors().into_iter().collect::<HashMap<_, _>>(),
        &base_path,
    )
    .unwrap();
    let err = LocalParams::load(&task.info(), &base_path, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("missing parameters [\"classifier.weight\", \"classifier.bias\"]"),
        "{err}"
    );
    // Wrong shapes are errors naming the parameter.
    let mut tensors: HashMap<String, Tensor> = params.tensors().into_iter().collect();
    tensors.insert(
        "classifier.bias".into(),
        Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let err = LocalParams::load(&task.info(), &path, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("parameter classifier.bias has shape [5], the model expects [3]"),
        "{err}"
    );
    // Module types for wrap policies.
    let types: Vec<&str> = task.info().modules().iter().map(|m| m.type_name).collect();
    assert_eq!(types.iter().filter(|t| **t == "BertLayer").count(), 2);
    assert!(types.contains(&"BertEmbeddings") && types.contains(&"BertPooler"));
}

#[test]
fn bert_attention_mask_hides_padding() {
    let model = BertModel::new(tiny_bert(), "").unwrap();
    let params = LocalParams::init(&model.info(), 5, DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[2u32, 7, 9, 0, 0]], &Device::Cpu).unwrap();
    let other = Tensor::new(&[[2u32, 7, 9, 33, 11]], &Device::Cpu).unwrap();
    let mask = Tensor::new(&[[1u32, 1, 1, 0, 0]], &Device::Cpu).unwrap();
    let (a, _) = model.forward(&params, &ids, Some(&mask), None).unwrap();
    let (b, _) = model.forward(&params, &other, Some(&mask), None).unwrap();
    let d = (a.narrow(1, 0, 3).unwrap() - b.narrow(1, 0, 3).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(d < 1e-6, "masked tokens changed attended outputs by {d}");
    let types = Tensor::new(&[[0u32, 0, 1, 1, 1]], &Device::Cpu).unwrap();
    let (c, _) = model
        .forward(&params, &ids, Some(&mask), Some(&types))
        .unwrap();
    let d = (a - c)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(d > 0.0, "token_type_ids had no effect");
}

#[test]
fn bert_dropout_only_in_training_mode_and_reproducible() {
    let mut config = tiny_bert();
    config.hidden_dropout_prob = 0.1;
    config.attention_probs_dropout_prob = 0.1;
    let mut model = BertModel::new(config, "").unwrap();
    let params = LocalParams::init(&model.info(), 5, DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[2u32, 7, 9, 4, 1]], &Device::Cpu).unwrap();
    let eval = |m: &BertModel| {
        m.forward(&params, &ids, None, None)
            .unwrap()
            .0
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let a = eval(&model);
    model.dropout_seed = Some(11);
    let b = eval(&model);
    let c = eval(&model);
    model.dropout_seed = Some(12);
    let d = eval(&model);
    assert_ne!(a, b, "training mode drops");
    assert_eq!(b, c, "same step seed, same masks");
    assert_ne!(b, d);
}

#[test]
fn gpt2_dropout_only_in_training_mode_reproducible_and_differentiable() {
    let mut model = tiny_gpt2();
    assert_eq!(
        (
            model.config.embd_pdrop,
            model.config.attn_pdrop,
            model.config.resid_pdrop
        ),
        (0.1, 0.1, 0.1),
        "transformers' defaults"
    );
    let params = LocalParams::init(&model.info(), 5, DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[2u32, 7, 9, 4, 1, 3]], &Device::Cpu).unwrap();
    let logits = |m: &Gpt2LmHeadModel| {
        m.forward(&params, &ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let eval = logits(&model);
    model.dropout_seed = Some(11);
    let train = logits(&model);
    assert_ne!(eval, train, "training mode drops");
    assert_eq!(train, logits(&model), "same step seed, same masks");
    model.dropout_seed = Some(12);
    assert_ne!(train, logits(&model));
    // Gradients flow through every dropout site and stay finite.
    let loss = model
        .loss(&model.forward(&params, &ids).unwrap(), &ids)
        .unwrap();
    let grads = loss.backward().unwrap();
    for (name, var) in params.vars() {
        let g = grads
            .get(var)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let v: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{name}");
    }
    // Probability zero is evaluation mode (modules read the configuration when built).
    let mut zero = Gpt2LmHeadModel::new(Gpt2Config {
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        resid_pdrop: 0.0,
        ..model.config.clone()
    })
    .unwrap();
    zero.dropout_seed = Some(12);
    assert_eq!(logits(&zero), eval);
}

/// Asserts `got` within 1e-5 of `want`'s largest element, naming the element `what[i]` and
/// the two computations compared.
fn within_1e5(got: &[f32], want: &[f32], what: &str, (a, b): (&str, &str)) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in got.iter().zip(want).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * scale + 1e-7,
            "{what}[{i}]: {a} {x}, {b} {y} (largest {scale})"
        );
    }
}

/// Tiny BERT's right-padded batch of 3 sequences of 6, 2 and 4 tokens on the CPU: ids,
/// attention mask, token types and labels.
fn padded_bert_batch() -> [Tensor; 4] {
    let lengths = [6usize, 2, 4];
    let cpu = &Device::Cpu;
    let ids: Vec<u32> = (0..18)
        .map(|i| {
            if i % 6 < lengths[i / 6] {
                1 + (i as u32 * 7) % 39
            } else {
                0
            }
        })
        .collect();
    let ids = Tensor::from_vec(ids, (3, 6), cpu).unwrap();
    let mask: Vec<u32> = (0..18).map(|i| (i % 6 < lengths[i / 6]) as u32).collect();
    let mask = Tensor::from_vec(mask, (3, 6), cpu).unwrap();
    let types = Tensor::from_vec((0..18u32).map(|i| (i / 3) % 2).collect(), (3, 6), cpu).unwrap();
    let labels = Tensor::new(&[2u32, 0, 1], cpu).unwrap();
    [ids, mask, types, labels]
}

/// `model`'s logits and every parameter's gradient of its loss on `batch` (ids, mask, token
/// types, labels), computed where `params` live, read back as f32.
fn bert_logits_and_grads(
    model: &BertForSequenceClassification,
    params: &LocalParams,
    [ids, mask, types, labels]: &[Tensor; 4],
) -> (Vec<f32>, HashMap<String, Vec<f32>>) {
    let device = params.vars().values().next().unwrap().device().clone();
    let on = |t: &Tensor| t.to_device(&device).unwrap();
    let logits = model
        .forward(params, &on(ids), Some(&on(mask)), Some(&on(types)))
        .unwrap();
    let loss = cross_entropy(&logits, &on(labels), CrossEntropy::default()).unwrap();
    let grads = loss.backward().unwrap();
    let grads: HashMap<String, Vec<f32>> = params
        .vars()
        .iter()
        .map(|(name, var)| {
            let g = grads
                .get(var)
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            (name.clone(), g.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect();
    (
        logits.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        grads,
    )
}

/// A right-padded batch computed packed (its real tokens end to end) gives the logits, the
/// sequence output on real tokens and every gradient the padded, masked computation gives,
/// dropout on (its masks are the padded batch's); padding comes back as zeros; a mask that
/// is not right padding is computed padded, bit for bit as with packing off.
#[test]
fn bert_packed_batches_compute_what_padded_batches_compute() {
    let mut config = tiny_bert();
    config.hidden_dropout_prob = 0.1;
    config.attention_probs_dropout_prob = 0.1;
    let mut model = BertForSequenceClassification::new(config).unwrap();
    model.bert.dropout_seed = Some(7);
    let params = LocalParams::init(&model.info(), 5, DType::F32, &Device::Cpu).unwrap();
    let lengths = [6usize, 2, 4];
    let cpu = &Device::Cpu;
    let batch = padded_bert_batch();
    let [ids, mask, types, _] = &batch;
    let run = |m: &BertForSequenceClassification, mask: &Tensor| {
        let mut batch = batch.clone();
        batch[1] = mask.clone();
        bert_logits_and_grads(m, &params, &batch)
    };
    let (packed_logits, packed_grads) = run(&model, mask);
    model.bert.pack_sequences = false;
    let (padded_logits, padded_grads) = run(&model, mask);
    let close = |a: &[f32], b: &[f32], what: &str| within_1e5(a, b, what, ("packed", "padded"));
    close(&packed_logits, &padded_logits, "logits");
    assert_ne!(
        packed_logits,
        {
            model.bert.dropout_seed = Some(8);
            run(&model, mask).0
        },
        "dropout is on"
    );
    for (name, g) in &padded_grads {
        if name.ends_with("attention.self.key.bias") {
            // Its true gradient is zero (a key bias adds the same to every score of a row):
            // both are rounding noise.
            continue;
        }
        close(&packed_grads[name], g, name);
    }
    // The sequence output: the padded one on real tokens, zeros past each sequence's end.
    let mut bert = model.bert.clone();
    bert.dropout_seed = Some(7);
    let seq = |b: &BertModel| {
        let (h, _) = b.forward(&params, ids, Some(mask), Some(types)).unwrap();
        h.to_vec3::<f32>().unwrap()
    };
    let padded = seq(&bert);
    bert.pack_sequences = true;
    let packed = seq(&bert);
    for (b, &n) in lengths.iter().enumerate() {
        for l in 0..6 {
            if l < n {
                close(&packed[b][l], &padded[b][l], &format!("hidden[{b}][{l}]"));
            } else {
                assert!(
                    packed[b][l].iter().all(|&v| v == 0.0),
                    "padding at [{b}][{l}]"
                );
            }
        }
    }
    // Left padding is not packed: bit for bit the padded computation.
    let left = Tensor::new(
        &[
            [0u32, 0, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1],
            [0, 1, 1, 1, 1, 1],
        ],
        cpu,
    )
    .unwrap();
    model.bert.dropout_seed = Some(7);
    model.bert.pack_sequences = true;
    let on = run(&model, &left);
    model.bert.pack_sequences = false;
    let off = run(&model, &left);
    assert_eq!(on.0, off.0);
    assert_eq!(on.1, off.1);
}

/// The same on a GPU in f32: tiny BERT computing the right-padded batch packed there (fsdp-nn's
/// kernels for packed attention and packed dropout, dropout on) gives the logits and every
/// gradient the CPU gives computing it padded and masked, within 1e-5. Skips without a usable
/// GPU; fails under `FSDP_REQUIRE_GPU=1` (tools/gpu-check.sh).
#[test]
fn bert_packed_batches_on_a_gpu_compute_what_the_cpu_computes_padded() {
    let gpu = match fsdp::nn::device::cuda(0) {
        Ok(gpu) => gpu,
        Err(e) => return skipped_gpu!("{e}"),
    };
    let mut config = tiny_bert();
    config.hidden_dropout_prob = 0.1;
    config.attention_probs_dropout_prob = 0.1;
    let mut model = BertForSequenceClassification::new(config).unwrap();
    model.bert.dropout_seed = Some(7);
    let info = model.info();
    let params = LocalParams::init(&info, 5, DType::F32, &Device::Cpu).unwrap();
    let moved = params
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, t.to_device(&gpu).unwrap()))
        .collect();
    let on_gpu = LocalParams::from_tensors(&info, moved).unwrap();
    let batch = padded_bert_batch();
    let (logits, grads) = bert_logits_and_grads(&model, &on_gpu, &batch);
    model.bert.pack_sequences = false;
    let (want_logits, want_grads) = bert_logits_and_grads(&model, &params, &batch);
    let close = |a: &[f32], b: &[f32], what: &str| {
        within_1e5(a, b, what, ("packed on the GPU", "padded on the CPU"))
    };
    close(&logits, &want_logits, "logits");
    for (name, g) in &want_grads {
        // The key biases' true gradient is zero: both are rounding noise.
        if !name.ends_with("attention.self.key.bias") {
            close(&grads[name], g, name);
        }
    }
}
