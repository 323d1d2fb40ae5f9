//! The Llama family against transformers (fixtures from `tools/make_llama_fixture.py`):
//! logits, loss and every parameter's gradient within 1e-5 relative in f32 for grouped-query
//! and multi-head attention, tied and untied heads, Llama's and Qwen2's biases, linear and
//! llama3 rope scaling and an explicit head_dim, on a right-padded batch (the loss from the
//! logits and the loss with the head fused into it alike); plus names, types,
//! causality, and configs that ask for what is not implemented.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use fsdp::models::{LlamaConfig, LlamaForCausalLM};
use fsdp::nn::{LocalParams, Model, Module};

/// A fixture's folder: in the source tree the binary was built from, or (a test binary
/// carried to another machine, as tools/gpu-check.sh does) under the working directory's
/// checkout.
fn fixture(case: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/llama");
    let here = Path::new("crates/fsdp/tests/data/llama");
    match built.is_dir() || !here.is_dir() {
        true => built.join(case),
        false => here.join(case),
    }
}

/// Largest |a - b| over max(|b|) (relative to the reference's scale).
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let flat = |t: &Tensor| -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

fn model_and_params(case: &str) -> (LlamaForCausalLM, LocalParams) {
    let dir = fixture(case);
    let model =
        LlamaForCausalLM::new(LlamaConfig::from_file(&dir.join("config.json")).unwrap()).unwrap();
    let (params, report) = LocalParams::load(
        &model.info(),
        &dir.join("weights.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    assert!(
        report.unexpected.is_empty(),
        "{case}: unexpected {:?}",
        report.unexpected
    );
    (model, params)
}

/// The four fixture models: grouped-query with a tied head, multi-head with biases and linear
/// rope scaling, Qwen2, and llama3 rope scaling with an explicit head_dim.
const CASES: [&str; 4] = [
    "gqa_tied",
    "mha_biases_linear_rope",
    "qwen2",
    "llama3_rope_head_dim",
];

/// `case`'s model with `params` on `device` against transformers' `expected` outputs (keys
/// under `prefix`): logits on the real tokens, the loss from the logits and with the head
/// fused into it, and every parameter's gradient of each, within `tol`.
fn check_case(
    case: &str,
    (model, params): (&LlamaForCausalLM, &LocalParams),
    expected: &std::collections::HashMap<String, Tensor>,
    (prefix, tol): (&str, f64),
    device: &Device,
) {
    let dtype = params.vars().values().next().unwrap().dtype();
    let want = |key: &str| &expected[&format!("{prefix}{key}")];
    let on = |t: &Tensor| t.to_device(device).unwrap();
    let ids = on(&expected["input_ids"].to_dtype(DType::U32).unwrap());
    let (mask, labels) = (on(&expected["attention_mask"]), on(&expected["labels"]));
    let logits = model.forward(params, &ids, Some(&mask)).unwrap();
    assert!(
        logits.device().same_device(device),
        "{case}: logits left {device:?}"
    );
    let loss = model.loss(&logits, &labels).unwrap();
    let logits = logits.to_device(&Device::Cpu).unwrap();
    // Logits at padded positions are not compared: transformers attends there too, but
    // nothing reads them (their labels are -100).
    let real = |t: &Tensor| {
        Tensor::cat(
            &[
                t.get(0).unwrap(),
                t.get(1).unwrap().narrow(0, 0, 6).unwrap(),
            ],
            0,
        )
        .unwrap()
    };
    let d = rel_diff(&real(&logits), &real(want("logits")));
    assert!(
        d < tol,
        "{case} {dtype:?} on {device:?}: logits differ by {d:e}"
    );
    // The loss of the logits, and the loss with the head fused into it (no logits).
    let fused = model
        .forward_loss(params, &ids, Some(&mask), &labels)
        .unwrap();
    for (how, loss) in [("from logits", loss), ("fused", fused)] {
        let d = rel_diff(
            &loss.reshape(1).unwrap().to_device(&Device::Cpu).unwrap(),
            want("loss"),
        );
        assert!(
            d < tol,
            "{case} {dtype:?} on {device:?}: loss {how} differs by {d:e}"
        );
        let grads = loss.backward().unwrap();
        for (name, var) in params.vars() {
            let grad = grads.get(var).unwrap().to_device(&Device::Cpu).unwrap();
            let d = rel_diff(&grad, want(&format!("grad.{name}")));
            assert!(
                d < tol,
                "{case} {dtype:?} on {device:?}: gradient of {name} ({how}) differs by {d:e}"
            );
        }
    }
    let reference = expected
        .keys()
        .filter(|k| k.starts_with(&format!("{prefix}grad.")))
        .count();
    assert_eq!(
        params.vars().len(),
        reference,
        "{case}: every parameter transformers has"
    );
}

fn expected(case: &str) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(case).join("expected.safetensors"), &Device::Cpu)
        .unwrap()
}

/// `params` as `dtype` on `device`.
fn moved(
    model: &LlamaForCausalLM,
    params: &LocalParams,
    dtype: DType,
    device: &Device,
) -> LocalParams {
    let tensors = params
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, v.to_dtype(dtype).unwrap().to_device(device).unwrap()))
        .collect();
    LocalParams::from_tensors(&model.info(), tensors).unwrap()
}

#[test]
fn logits_loss_and_gradients_match_transformers() {
    for case in CASES {
        let (model, f32_params) = model_and_params(case);
        let expected = expected(case);
        // f32 against transformers' f32; f64 against its f64 with RMSNorm, softmax and loss in
        // f64 too and the same f32 rotary cos/sin (see the fixture script): there only the
        // formulas could differ.
        for (dtype, prefix, tol) in [(DType::F32, "", 1e-5), (DType::F64, "f64.", 1e-10)] {
            let params = moved(&model, &f32_params, dtype, &Device::Cpu);
            check_case(
                case,
                (&model, &params),
                &expected,
                (prefix, tol),
                &Device::Cpu,
            );
        }
    }
}

/// The same on a GPU, in f32 within 1e-5: fsdp-nn's CUDA kernels (RMSNorm, rope, SwiGLU,
/// grouped-query causal attention under a padding mask, cross-entropy and the head fused with
/// it) against transformers. Skips without a usable GPU; fails under `FSDP_REQUIRE_GPU=1`
/// (tools/gpu-check.sh).
#[test]
fn logits_loss_and_gradients_on_a_gpu_match_transformers() {
    let gpu = match fsdp::nn::device::cuda(0) {
        Ok(gpu) => gpu,
        Err(e) => return skipped_gpu!("{e}"),
    };
    for case in CASES {
        let (model, f32_params) = model_and_params(case);
        let params = moved(&model, &f32_params, DType::F32, &gpu);
        check_case(case, (&model, &params), &expected(case), ("", 1e-5), &gpu);
    }
}

#[test]
fn names_types_wrap_class_and_tied_head() {
    let (tied, _) = model_and_params("gqa_tied");
    let info = tied.info();
    assert_eq!(info.type_name, "LlamaForCausalLM");
    assert_eq!(tied.no_split_modules(), ["LlamaDecoderLayer"]);
    assert_eq!(info.tied(), [("lm_head", "model.embed_tokens.weight")]);
    let names: Vec<String> = info.all_params().iter().map(|p| p.name.clone()).collect();
    assert!(names.contains(&"model.layers.1.self_attn.k_proj.weight".to_string()));
    assert!(
        !names
            .iter()
            .any(|n| n.ends_with(".bias") || n == "lm_head.weight"),
        "{names:?}"
    );
    let shapes: std::collections::HashMap<_, _> = info
        .all_params()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    assert_eq!(
        shapes["model.layers.0.self_attn.k_proj.weight"],
        [4, 16],
        "one K/V head of 4"
    );
    let (qwen, _) = model_and_params("qwen2");
    let info = qwen.info();
    assert_eq!(qwen.no_split_modules(), ["Qwen2DecoderLayer"]);
    let types: Vec<&str> = info.modules().iter().map(|m| m.type_name).collect();
    assert!(
        types.contains(&"Qwen2Attention") && types.contains(&"Qwen2MLP"),
        "{types:?}"
    );
    let names: Vec<String> = info.all_params().iter().map(|p| p.name.clone()).collect();
    for biased in ["q_proj", "k_proj", "v_proj"] {
        assert!(names.contains(&format!("model.layers.0.self_attn.{biased}.bias")));
    }
    assert!(!names.contains(&"model.layers.0.self_attn.o_proj.bias".to_string()));
    assert!(names.contains(&"lm_head.weight".to_string()));
    assert_eq!(info.num_params(), qwen.config.num_parameters());
    assert_eq!(tied.info().num_params(), tied.config.num_parameters());
}

#[test]
fn a_later_token_never_changes_an_earlier_logit() {
    let (model, params) = model_and_params("mha_biases_linear_rope");
    let a = Tensor::new(&[[5u32, 9, 13, 7, 21]], &Device::Cpu).unwrap();
    let b = Tensor::new(&[[5u32, 9, 13, 30, 3]], &Device::Cpu).unwrap();
    let la = model
        .forward(&params, &a, None)
        .unwrap()
        .narrow(1, 0, 3)
        .unwrap();
    let lb = model
        .forward(&params, &b, None)
        .unwrap()
        .narrow(1, 0, 3)
        .unwrap();
    assert_eq!(rel_diff(&la, &lb), 0.0);
}

fn config_error(edit: &dyn Fn(&mut serde_json::Value)) -> String {
    let text = std::fs::read_to_string(fixture("gqa_tied").join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut v);
    LlamaConfig::from_value(&v).unwrap_err().to_string()
}

#[test]
fn configs_asking_for_what_is_not_implemented_are_errors_naming_the_field() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "rope_parameters",
            Box::new(|v| {
                v["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})
            }),
        ),
        (
            "rope_scaling",
            Box::new(|v| {
                v.as_object_mut().unwrap().remove("rope_parameters");
                v["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
            }),
        ),
        (
            "use_sliding_window",
            Box::new(|v| v["use_sliding_window"] = true.into()),
        ),
        (
            "layer_types",
            Box::new(|v| {
                v["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"])
            }),
        ),
        (
            "num_local_experts",
            Box::new(|v| v["num_local_experts"] = 8.into()),
        ),
        ("hidden_act", Box::new(|v| v["hidden_act"] = "gelu".into())),
        ("model_type", Box::new(|v| v["model_type"] = "gemma".into())),
        (
            "num_key_value_heads",
            Box::new(|v| v["num_key_value_heads"] = 3.into()),
        ),
        ("vocab_size", Box::new(|v| v["vocab_size"] = "big".into())),
    ];
    for (field, edit) in cases {
        let e = config_error(&*edit);
        assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
    }
    // The older spelling of the rope fields is read too.
    let text = std::fs::read_to_string(fixture("gqa_tied").join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_object_mut().unwrap().remove("rope_parameters");
    v["rope_theta"] = 5000.0.into();
    v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0});
    let c = LlamaConfig::from_value(&v).unwrap();
    assert_eq!(c.rope_theta, 5000.0);
    assert!(c.rope_scaling.is_some());
    // Mistral's sliding window: accepted, and a longer sequence is refused naming it.
    v["model_type"] = "mistral".into();
    v["sliding_window"] = 4.into();
    let model = LlamaForCausalLM::new(LlamaConfig::from_value(&v).unwrap()).unwrap();
    let params = LocalParams::init(&model.info(), 1, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.no_split_modules(), ["MistralDecoderLayer"]);
    let ids = Tensor::new(&[[3u32, 4, 5, 6, 7]], &Device::Cpu).unwrap();
    let e = model.forward(&params, &ids, None).unwrap_err().to_string();
    assert!(e.contains("`sliding_window` 4"), "{e}");
    assert!(
        model
            .forward(&params, &ids.narrow(1, 0, 4).unwrap(), None)
            .is_ok()
    );
}
