//! LoRA under FSDP (`fsdp::peft`): a tiny Llama with adapters on chosen projections trains
//! the same adapters on 1-4 real processes and under each sharding strategy as in one
//! process (SGD with momentum, 4 steps, f32), the frozen base never moves and gets no optimizer state,
//! the adapters save in PEFT's folder layout and read back, merging them into the base gives
//! the adapted model's logits, the frozen weight's gradient is never formed while the
//! adapter's and the input's equal those of composed candle ops, and bad settings or an
//! adapter for another base are errors naming what is wrong.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use fsdp::accelerator::{Accelerator, PreparedModel, PreparedOptimizer};
use fsdp::models::{LlamaConfig, LlamaForCausalLM};
use fsdp::nn::layers::Linear;
use fsdp::nn::{Forward, LocalParams, Module, Params, WeightSource};
use fsdp::optim::{Sgd, SgdConfig};
use fsdp::peft::{AdapterFile, LoraConfig, LoraModel, PeftError, TargetModules, merge_adapter};
use fsdp_comm::ReduceOp;
use serde_json::json;

use crate::common;

const ROLE: &str = "FSDP_LORA_WORKER";
const STEPS: usize = 4;

/// transformers' `config.json` of the tiny Llama.
fn hf_config() -> serde_json::Value {
    json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 40,
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "hidden_act": "silu",
        "rope_theta": 10000.0, "torch_dtype": "float32",
    })
}

fn config() -> LlamaConfig {
    LlamaConfig::from_value(&hf_config()).unwrap()
}

fn lora_config() -> LoraConfig {
    LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        lora_dropout: 0.0,
        target_modules: TargetModules::parse("q_proj,v_proj,down_proj"),
        use_rslora: false,
        init_lora_weights: Default::default(),
    }
}

/// The base model's seeded weights (what a pretrained file would give).
fn base_weights() -> BTreeMap<String, Tensor> {
    let model = LlamaForCausalLM::new(config()).unwrap();
    LocalParams::init(&model.info(), 11, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors()
}

/// Step `step`'s 12 sequences of 10 tokens (12: every world size 1-4 divides it) of a
/// 40-token vocabulary.
pub(crate) fn batch(step: usize) -> Tensor {
    let ids: Vec<u32> = (0..120)
        .map(|i| ((7 * i + 5 * step + i * i / 3) % 39 + 1) as u32)
        .collect();
    Tensor::from_vec(ids, (12, 10), &Device::Cpu).unwrap()
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn lora_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let mut acc = Accelerator::builder().build().unwrap();
    let model = LoraModel::new(LlamaForCausalLM::new(config()).unwrap(), lora_config()).unwrap();
    let base = base_weights();
    let weights = model.weights(&base, None, 3).unwrap();
    let mut model = acc.prepare_model(model, &weights).unwrap();
    let (losses, optimizer) = train_adapters(&mut acc, &mut model, STEPS);
    let opt = optimizer.optimizer();
    let names = opt.state_names();
    assert!(
        names.iter().all(|n| fsdp::peft::is_adapter_param(n)),
        "{names:?}"
    );
    let state_elems: usize = names
        .iter()
        .map(|n| opt.state(n).unwrap().bytes() / 4)
        .sum();
    let dir = std::env::var("TEST_ADAPTER_DIR").ok();
    if let Some(dir) = &dir {
        acc.save_adapter(&model, Path::new(dir), "CAUSAL_LM", Some("tiny-llama"))
            .unwrap();
        // The merged model streamed (what --merge_lora writes).
        let merged = Path::new(dir).with_file_name("merged");
        acc.save_merged(&model, &merged, &hf_config()).unwrap();
    }
    let weights = common::full_weights(&acc, &model);
    acc.wait_for_everyone().unwrap();
    if acc.is_main_process() {
        println!(
            "RESULT {}",
            json!({ "weights": weights, "losses": losses, "state_elems": state_elems })
        );
    }
}

/// Trains `model`'s adapters `steps` steps on [`batch`], each rank its share: SGD with
/// momentum, whose step is proportional to the gradients (AdamW's normalised step would turn
/// the sums' rounding in near-zero gradients into visible differences) and which keeps one
/// buffer per trained parameter. Returns the losses averaged over the ranks, and the
/// optimizer.
pub(crate) fn train_adapters(
    acc: &mut Accelerator,
    model: &mut PreparedModel<LoraModel<LlamaForCausalLM>>,
    steps: usize,
) -> (Vec<f64>, PreparedOptimizer) {
    let (world, rank) = (acc.num_processes(), acc.process_index());
    let sgd = Sgd::new(SgdConfig {
        lr: 0.5,
        momentum: 0.9,
        ..Default::default()
    })
    .unwrap();
    let mut optimizer = acc.prepare_optimizer(sgd).unwrap();
    let mut losses = Vec::new();
    for step in 0..steps {
        let ids = batch(step);
        let per = 12 / world;
        let mine = ids.narrow(0, rank * per, per).unwrap();
        let loss = model
            .forward(|m, p| m.forward_loss(p, &mine, None, &mine))
            .unwrap();
        let sum = acc
            .reduce(vec![loss.to_scalar::<f32>().unwrap() as f64], ReduceOp::Sum)
            .unwrap();
        losses.push(sum[0] / world as f64);
        acc.backward(model, loss).unwrap();
        assert!(acc.optimizer_step(model, &mut optimizer).unwrap());
    }
    (losses, optimizer)
}

struct Run {
    weights: BTreeMap<String, Vec<f32>>,
    losses: Vec<f64>,
    state_elems: usize,
}

fn run(world: usize, env: &[(&str, &str)]) -> Run {
    let outputs = common::run_workers("lora_worker", ROLE, world, env, Duration::from_secs(120));
    let r = common::result_of(&outputs[0]);
    Run {
        weights: serde_json::from_value(r["weights"].clone()).unwrap(),
        losses: serde_json::from_value(r["losses"].clone()).unwrap(),
        state_elems: serde_json::from_value(r["state_elems"].clone()).unwrap(),
    }
}

use common::max_rel_diff as rel;

#[test]
fn lora_trains_the_same_adapters_on_one_to_four_processes_and_every_strategy() {
    let reference = run(1, &[]);
    let base = base_weights();
    let adapters: Vec<&String> = reference
        .weights
        .keys()
        .filter(|k| fsdp::peft::is_adapter_param(k))
        .collect();
    // 3 layers × 3 projections × (A, B).
    assert_eq!(adapters.len(), 18, "{adapters:?}");
    for (name, values) in &reference.weights {
        if fsdp::peft::is_adapter_param(name) {
            continue;
        }
        let before: Vec<f32> = base[name].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(values, &before, "frozen `{name}` moved");
    }
    let b = &reference.weights["model.layers.1.self_attn.q_proj.lora_B.weight"];
    assert!(b.iter().any(|v| *v != 0.0), "lora_B never trained");
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0],
        "{:?}",
        reference.losses
    );
    // One momentum buffer per adapter weight, none for the frozen base.
    let adapter_elems: usize = adapters.iter().map(|k| reference.weights[*k].len()).sum();
    assert_eq!(reference.state_elems, adapter_elems);
    for (world, strategy) in [
        (2, "FULL_SHARD"),
        (3, "FULL_SHARD"),
        (4, "FULL_SHARD"),
        (2, "SHARD_GRAD_OP"),
        (2, "NO_SHARD"),
        // Debug mode poisons released memory (NaN): a frozen weight released while backward
        // still reads it would show.
        (2, "DEBUG"),
    ] {
        let env: &[(&str, &str)] = match strategy {
            "DEBUG" => &[("ACCELERATE_DEBUG_MODE", "true")],
            s => &[("FSDP_SHARDING_STRATEGY", s)],
        };
        let run = run(world, env);
        for (i, (a, b)) in run.losses.iter().zip(&reference.losses).enumerate() {
            assert!(
                ((a - b) / b).abs() < 1e-5,
                "{world} ranks {strategy}, step {i}: loss {a} vs {b}"
            );
        }
        for (name, values) in &reference.weights {
            let d = rel(&run.weights[name], values);
            assert!(d < 1e-5, "{world} ranks {strategy}: `{name}` off by {d:e}");
        }
        // Every rank keeps state for its shard of the adapters only (rank 0's here).
        assert!(run.state_elems <= reference.state_elems, "{strategy}");
    }
}

#[test]
fn adapters_save_as_peft_read_back_and_merge_into_the_adapted_models_logits() {
    let dir = tempfile::tempdir().unwrap();
    let adapter_dir = dir.path().join("adapter");
    let trained = run(2, &[("TEST_ADAPTER_DIR", adapter_dir.to_str().unwrap())]);
    let file = AdapterFile::read(&adapter_dir).unwrap();
    assert_eq!(
        file.config,
        LoraConfig {
            target_modules: TargetModules::Names(vec![
                "down_proj".into(),
                "q_proj".into(),
                "v_proj".into()
            ]),
            ..lora_config()
        }
    );
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(adapter_dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["peft_type"], "LORA");
    assert_eq!(saved["task_type"], "CAUSAL_LM");
    assert_eq!(saved["base_model_name_or_path"], "tiny-llama");
    // PEFT's names, and only the adapters.
    let bytes = std::fs::read(adapter_dir.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(names.len(), 18);
    assert_eq!(
        names[0],
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    );
    for (name, (_, values)) in &file.tensors {
        assert_eq!(values, &trained.weights[name], "{name}");
    }

    // The adapted model (base + adapters read back) and the merged plain model agree.
    let model = LoraModel::new(LlamaForCausalLM::new(config()).unwrap(), lora_config()).unwrap();
    let base = base_weights();
    let source = model.weights(&base, Some(&file), 0).unwrap();
    let info = model.info();
    let tensors = info
        .all_params()
        .into_iter()
        .map(|spec| {
            let v = source.values(spec).unwrap();
            let t = Tensor::from_vec(v, spec.shape.as_slice(), &Device::Cpu).unwrap();
            (spec.name.clone(), t)
        })
        .collect();
    let adapted = LocalParams::from_tensors(&info, tensors).unwrap();
    let ids = batch(9);
    let want = model.forward(&adapted, &ids).unwrap();
    let mut state = base.clone();
    for (name, (shape, values)) in &file.tensors {
        state.insert(
            name.clone(),
            Tensor::from_vec(values.clone(), shape.as_slice(), &Device::Cpu).unwrap(),
        );
    }
    let merged = merge_adapter(&mut state, &file.config, file.fan_in_fan_out).unwrap();
    assert_eq!(merged.len(), 9);
    assert!(state.keys().all(|k| !fsdp::peft::is_adapter_param(k)));
    // Accelerator::save_merged streamed the same merged weights (its sums in another
    // order), in a plain folder.
    let streamed = dir.path().join("merged");
    let file_tensors =
        candle_core::safetensors::load(streamed.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = file_tensors.keys().collect();
    names.sort();
    assert_eq!(names, state.keys().collect::<Vec<_>>());
    for (name, t) in &state {
        let (a, b): (Vec<f32>, Vec<f32>) = (
            file_tensors[name].flatten_all().unwrap().to_vec1().unwrap(),
            t.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert!(rel(&a, &b) < 1e-6, "streamed merge of `{name}`");
    }
    assert!(streamed.join("config.json").is_file());
    let plain = LlamaForCausalLM::new(config()).unwrap();
    let got = plain.forward(&state_params(&state), &ids, None).unwrap();
    let (w, g): (Vec<f32>, Vec<f32>) = (
        want.flatten_all().unwrap().to_vec1().unwrap(),
        got.flatten_all().unwrap().to_vec1().unwrap(),
    );
    let d = rel(&g, &w);
    assert!(d < 1e-5, "merged logits off by {d:e}");
    let unadapted = plain.forward(&state_params(&base), &ids, None).unwrap();
    let u: Vec<f32> = unadapted.flatten_all().unwrap().to_vec1().unwrap();
    assert!(rel(&u, &w) > 1e-4, "the adapters changed nothing");
    peft_loads_it_alike(dir.path(), &adapter_dir, &base, &ids, &w);

    // An adapter for another base: a tensor whose shape does not fit.
    let other = LoraConfig {
        r: 2,
        ..lora_config()
    };
    let model = LoraModel::new(LlamaForCausalLM::new(config()).unwrap(), other).unwrap();
    let e = model.weights(&base, Some(&file), 0).err().unwrap();
    assert!(matches!(e, PeftError::OtherBase { .. }), "{e}");
    assert!(e.to_string().contains("another base model"), "{e}");
    assert!(e.to_string().contains("lora_A.weight"), "{e}");

    // Not a LoRA adapter.
    std::fs::write(
        adapter_dir.join("adapter_config.json"),
        r#"{"peft_type": "IA3"}"#,
    )
    .unwrap();
    let e = AdapterFile::read(&adapter_dir).unwrap_err();
    assert!(e.to_string().contains("adapter_config.json"), "{e}");
    assert!(e.to_string().contains("IA3"), "{e}");
}

/// With `FSDP_TORCH_PYTHON` (a python with torch and transformers), Python peft loads the
/// adapter onto transformers' model of the base weights and gives our logits, before and
/// after its `merge_and_unload` (`tools/check-peft-adapter.sh`); without it, says so.
fn peft_loads_it_alike(
    scratch: &Path,
    adapter: &Path,
    base: &BTreeMap<String, Tensor>,
    ids: &Tensor,
    logits: &[f32],
) {
    if std::env::var_os("FSDP_TORCH_PYTHON").is_none() {
        skipped_optional!(
            "(part) loading the adapter with Python peft needs FSDP_TORCH_PYTHON, a python with torch and transformers"
        );
        return;
    }
    let base_dir = scratch.join("base");
    std::fs::create_dir_all(&base_dir).unwrap();
    let base: std::collections::HashMap<_, _> = base.clone().into_iter().collect();
    candle_core::safetensors::save(&base, base_dir.join("model.safetensors")).unwrap();
    std::fs::write(base_dir.join("config.json"), hf_config().to_string()).unwrap();
    let ids: Vec<Vec<u32>> = ids.to_vec2().unwrap();
    let expected = scratch.join("expected.json");
    std::fs::write(
        &expected,
        json!({ "ids": ids, "logits": logits }).to_string(),
    )
    .unwrap();
    let out = std::process::Command::new(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/check-peft-adapter.sh"),
    )
    .args([&base_dir, adapter, &expected])
    .output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("\"adapted_layers\": 9"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("peft: {text}");
}

/// Plain parameters holding `state`.
fn state_params(state: &BTreeMap<String, Tensor>) -> impl Params + use<> {
    struct Plain(BTreeMap<String, Tensor>);
    impl Params for Plain {
        fn get(&self, name: &str) -> candle_core::Result<Tensor> {
            self.0
                .get(name)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("no {name}")))
        }
    }
    Plain(state.clone())
}

#[test]
fn bad_lora_settings_are_errors_naming_them() {
    let base = || LlamaForCausalLM::new(config()).unwrap();
    let e = LoraModel::new(
        base(),
        LoraConfig {
            r: 0,
            ..lora_config()
        },
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("`r`"), "{e}");
    let e = LoraModel::new(
        base(),
        LoraConfig {
            lora_dropout: 1.0,
            ..lora_config()
        },
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("lora_dropout"), "{e}");
    let e = LoraModel::new(base(), LoraConfig::new(TargetModules::parse("query,value")))
        .err()
        .unwrap();
    let text = e.to_string();
    assert!(text.contains("query"), "{text}");
    assert!(text.contains("model.layers.0.self_attn.q_proj"), "{text}");
    let e = LoraModel::new(base(), LoraConfig::new(TargetModules::Regex("(".into())))
        .err()
        .unwrap();
    assert!(matches!(e, PeftError::BadRegex { .. }), "{e}");
    // all-linear: every projection but the output layer.
    let m = LoraModel::new(base(), LoraConfig::new(TargetModules::AllLinear)).unwrap();
    assert_eq!(m.adapted().len(), 3 * 7);
    assert!(!m.adapted().iter().any(|p| p == "lm_head"));
    // Only adapters train.
    let info = m.info();
    let trainable: Vec<&str> = info
        .all_params()
        .into_iter()
        .filter(|p| p.requires_grad)
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(trainable.len(), 2 * 21);
    assert!(trainable.iter().all(|n| fsdp::peft::is_adapter_param(n)));
}

#[test]
fn a_lora_layer_has_the_gradients_of_composed_ops_and_none_for_its_frozen_weight() {
    let dev = Device::Cpu;
    let (d_in, d_out, r) = (12, 10, 3);
    let mut layer = Linear::new("proj".into(), d_in, d_out, 0.2).without_bias();
    let seed = std::sync::Arc::new(std::sync::Mutex::new(None));
    layer.set_lora(fsdp::nn::lora::LoraAdapter::new(r, 2.5, 0.0, seed));
    let rand = |shape: (usize, usize), s: f64| Tensor::randn(0f32, s as f32, shape, &dev).unwrap();
    let w = rand((d_out, d_in), 0.3);
    let a = Var::from_tensor(&rand((r, d_in), 0.3)).unwrap();
    let b = Var::from_tensor(&rand((d_out, r), 0.3)).unwrap();
    let x = Var::from_tensor(&rand((5, d_in), 1.0)).unwrap();
    struct P(BTreeMap<String, Tensor>);
    impl Params for P {
        fn get(&self, name: &str) -> candle_core::Result<Tensor> {
            Ok(self.0[name].clone())
        }
    }
    let p = P(BTreeMap::from([
        ("proj.weight".to_string(), w.clone()),
        ("proj.lora_A.weight".to_string(), a.as_tensor().clone()),
        ("proj.lora_B.weight".to_string(), b.as_tensor().clone()),
    ]));
    let target = rand((5, d_out), 1.0);
    let loss = |y: &Tensor| (y * &target).unwrap().sum_all().unwrap();
    let y = layer.forward(&p, x.as_tensor()).unwrap();
    let grads = loss(&y).backward().unwrap();
    let composed = (x.as_tensor().matmul(&w.t().unwrap()).unwrap()
        + (x.as_tensor()
            .matmul(&a.as_tensor().t().unwrap())
            .unwrap()
            .matmul(&b.as_tensor().t().unwrap())
            .unwrap()
            * 2.5)
            .unwrap())
    .unwrap();
    let want = loss(&composed).backward().unwrap();
    let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
    assert!(rel(&flat(&y), &flat(&composed)) < 1e-6);
    for (what, t) in [
        ("x", x.as_tensor()),
        ("A", a.as_tensor()),
        ("B", b.as_tensor()),
    ] {
        let d = rel(&flat(grads.get(t).unwrap()), &flat(want.get(t).unwrap()));
        assert!(d < 1e-5, "gradient of {what} off by {d:e}");
    }
    assert!(grads.get(&w).is_none(), "the frozen weight got a gradient");
}

/// Writes an adapter folder as PEFT would for `model` (its config) with tensors from
/// `values(name, len)`, then applies `edit` to the config; returns the folder.
fn crafted_adapter(
    dir: &Path,
    model: &LoraModel<LlamaForCausalLM>,
    values: &dyn Fn(&str, usize) -> Vec<f32>,
    edit: &dyn Fn(&mut serde_json::Value),
) -> std::path::PathBuf {
    let info = model.info();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = info
        .all_params()
        .into_iter()
        .filter(|p| fsdp::peft::is_adapter_param(&p.name))
        .map(|p| {
            let n = p.shape.iter().product();
            let bytes = values(&p.name, n)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            (
                format!("{}{}", fsdp::peft::PEFT_PREFIX, p.name),
                p.shape.clone(),
                bytes,
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (n.clone(), view.unwrap())
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    safetensors::serialize_to_file(views, None, &dir.join("adapter_model.safetensors")).unwrap();
    let mut config = model.adapter_config("CAUSAL_LM", None);
    edit(&mut config);
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    dir.to_path_buf()
}

#[test]
fn a_continued_adapter_is_the_one_that_was_saved_and_crafted_ones_are_refused() {
    use fsdp::peft::{LoraInit, LoraOverrides};
    let tmp = tempfile::tempdir().unwrap();
    let base = || LlamaForCausalLM::new(config()).unwrap();
    let saved_config = LoraConfig {
        lora_alpha: 64.0,
        use_rslora: true,
        lora_dropout: 0.1,
        init_lora_weights: LoraInit::Gaussian,
        ..lora_config()
    };
    let saved = LoraModel::new(base(), saved_config.clone()).unwrap();
    let small = |_: &str, n: usize| (0..n).map(|i| (i as f32 * 0.37).sin() * 0.01).collect();
    let keep = |_: &mut serde_json::Value| {};
    let dir = crafted_adapter(&tmp.path().join("ok"), &saved, &small, &keep);
    let file = AdapterFile::read(&dir).unwrap();
    // Continued with no setting given: everything as saved (alpha 64, rsLoRA, dropout,
    // the targets it names, its init), and saved again as it was.
    let continued = file.config_with(&LoraOverrides::default()).unwrap();
    assert_eq!(
        continued,
        LoraConfig {
            target_modules: TargetModules::Names(vec![
                "down_proj".into(),
                "q_proj".into(),
                "v_proj".into()
            ]),
            ..saved_config.clone()
        }
    );
    let model = LoraModel::new(base(), continued).unwrap();
    assert_eq!(model.adapter_config("CAUSAL_LM", None)["lora_alpha"], 64.0);
    assert_eq!(
        model.adapter_config("CAUSAL_LM", None)["init_lora_weights"],
        "gaussian"
    );
    model.weights(&base_weights(), Some(&file), 0).unwrap();
    // A setting given that contradicts the adapter: refused naming both values.
    for (overrides, needle) in [
        (
            LoraOverrides {
                lora_alpha: Some(16.0),
                ..Default::default()
            },
            "`lora_alpha` is 64 in the adapter, but 16 was asked for",
        ),
        (
            LoraOverrides {
                r: Some(8),
                ..Default::default()
            },
            "`r` is 4 in the adapter, but 8",
        ),
        (
            LoraOverrides {
                use_rslora: Some(false),
                ..Default::default()
            },
            "`use_rslora` is true",
        ),
        (
            LoraOverrides {
                lora_dropout: Some(0.0),
                ..Default::default()
            },
            "`lora_dropout` is 0.1",
        ),
    ] {
        let e = file.config_with(&overrides).unwrap_err().to_string();
        assert!(
            e.contains(needle) && e.contains("adapter_config.json"),
            "{e}"
        );
    }
    // Targets given that adapt other layers than the file's: refused naming the tensor.
    let other = file
        .config_with(&LoraOverrides {
            target_modules: Some(TargetModules::parse("q_proj,v_proj")),
            ..Default::default()
        })
        .unwrap();
    let e = LoraModel::new(base(), other)
        .unwrap()
        .weights(&base_weights(), Some(&file), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("down_proj.lora_A.weight"), "{e}");

    // Crafted configs and tensors: each refused naming the key or the tensor.
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "r 1e30",
            Box::new(|c| c["r"] = json!(1e30)),
            "r = 1000000000000000000000000000000",
        ),
        (
            "r 8 on rank-4 tensors",
            Box::new(|c| c["r"] = json!(8)),
            "not a rank-8 adapter weight",
        ),
        (
            "pissa",
            Box::new(|c| c["init_lora_weights"] = json!("pissa")),
            "init_lora_weights = \"pissa\"",
        ),
    ];
    for (what, edit, needle) in cases {
        let dir = crafted_adapter(
            &tmp.path().join(what.replace(' ', "_")),
            &saved,
            &small,
            &edit,
        );
        let e = AdapterFile::read(&dir).unwrap_err().to_string();
        assert!(e.contains(needle), "{what}: {e}");
    }
    let fan = crafted_adapter(&tmp.path().join("fan"), &saved, &small, &|c| {
        c["fan_in_fan_out"] = json!(true)
    });
    let fan = AdapterFile::read(&fan).unwrap();
    let e = saved
        .weights(&base_weights(), Some(&fan), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("`fan_in_fan_out` is true in the adapter"), "{e}");
    for bad in [f32::NAN, f32::INFINITY] {
        let poisoned = move |name: &str, n: usize| {
            let mut v = small(name, n);
            if name.contains("layers.1.mlp.down_proj.lora_B") {
                v[3] = bad;
            }
            v
        };
        let dir = crafted_adapter(
            &tmp.path().join(format!("bad{bad}")),
            &saved,
            &poisoned,
            &keep,
        );
        let e = AdapterFile::read(&dir).unwrap_err().to_string();
        assert!(
            e.contains("model.layers.1.mlp.down_proj.lora_B.weight") && e.contains("not finite"),
            "{e}"
        );
    }
}

#[test]
fn fresh_adapters_start_as_init_lora_weights_says() {
    use fsdp::nn::SeededWeights;
    use fsdp::peft::LoraInit;
    for (init, written) in [
        (LoraInit::Default, json!(true)),
        (LoraInit::Gaussian, json!("gaussian")),
        (LoraInit::Random, json!(false)),
    ] {
        let model = LoraModel::new(
            LlamaForCausalLM::new(config()).unwrap(),
            LoraConfig {
                init_lora_weights: init,
                ..lora_config()
            },
        )
        .unwrap();
        assert_eq!(
            model.adapter_config("CAUSAL_LM", None)["init_lora_weights"],
            written
        );
        let info = model.info();
        let spec = |suffix: &str| {
            info.all_params()
                .into_iter()
                .find(|p| p.name == format!("model.layers.0.mlp.down_proj.{suffix}"))
                .cloned()
                .unwrap()
        };
        let (a, b) = (spec("lora_A.weight"), spec("lora_B.weight"));
        let a = SeededWeights(3).values(&a).unwrap();
        let b = SeededWeights(3).values(&b).unwrap();
        let rms = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        // A is [4, 32] (down_proj's input is the intermediate size).
        match init {
            // Uniform in ±1/√32: RMS 1/√96.
            LoraInit::Default => {
                assert!((rms(&a) - 0.102).abs() < 0.02 && b.iter().all(|x| *x == 0.0));
            }
            // Normal with std 1/r = 0.25.
            LoraInit::Gaussian => {
                assert!((rms(&a) - 0.25).abs() < 0.05 && b.iter().all(|x| *x == 0.0));
            }
            // B uniform in ±1/√4 too.
            LoraInit::Random => assert!(rms(&b) > 0.1, "{b:?}"),
        }
    }
}
