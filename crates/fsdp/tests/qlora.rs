//! QLoRA under FSDP (`fsdp::nn::quant` + `fsdp::peft`): a tiny Llama whose linear layers are
//! kept quantized (NF4, GGML Q4_0) with LoRA adapters trains the same adapters on 1-3 real
//! processes and under each sharding strategy as in one process, and as LoRA on the f32 base
//! those blocks dequantize to (SGD with momentum, 4 steps); each rank stores (and all-gathers)
//! the blocks' bytes, not f32; the base exports as its dequantized weights; a format the
//! layers cannot be kept in, a Conv1D layer and mixed precision are errors naming them.

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp::accelerator::Accelerator;
use fsdp::config::{AllGatherDtype, FsdpPlugin, Layer, MixedPrecision};
use fsdp::engine::{PlanError, UnitPlan};
use fsdp::models::{Gpt2Config, Gpt2LmHeadModel, LlamaConfig, LlamaForCausalLM};
use fsdp::nn::layers::quantize_linears;
use fsdp::nn::quant::{Packing, QuantError, QuantFormat};
use fsdp::nn::{LocalParams, Model, Module};
use fsdp::peft::{LoraConfig, LoraModel, TargetModules};
use serde_json::json;

use crate::common;
use common::max_rel_diff as rel;

const ROLE: &str = "FSDP_QLORA_WORKER";
const STEPS: usize = 4;

/// A tiny Llama whose projections' inputs (64, 128) are whole NF4 and Q4_0 blocks.
fn config() -> LlamaConfig {
    LlamaConfig::from_value(&json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 40,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "hidden_act": "silu",
        "rope_theta": 10000.0, "torch_dtype": "float32",
    }))
    .unwrap()
}

fn lora_config() -> LoraConfig {
    LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        lora_dropout: 0.0,
        target_modules: TargetModules::AllLinear,
        use_rslora: false,
        init_lora_weights: Default::default(),
    }
}

/// The f32 base's seeded weights (what a pretrained file would give).
fn base_weights() -> BTreeMap<String, Tensor> {
    let model = LlamaForCausalLM::new(config()).unwrap();
    LocalParams::init(&model.info(), 11, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors()
}

/// The quantizable projections' names and packings in `format` (every linear but lm_head).
fn packings(format: QuantFormat) -> BTreeMap<String, Packing> {
    let mut model = LlamaForCausalLM::new(config()).unwrap();
    quantize_linears(&mut model, format).unwrap();
    model
        .info()
        .all_params()
        .into_iter()
        .filter_map(|p| Some((p.name.clone(), p.packing?)))
        .collect()
}

/// `base` with each quantized weight replaced by what its blocks dequantize to.
fn dequantized_base(format: QuantFormat) -> BTreeMap<String, Tensor> {
    let mut base = base_weights();
    for (name, packing) in packings(format) {
        let t = &base[&name];
        let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let back = packing.dequantize(&packing.quantize(&values)).unwrap();
        base.insert(
            name,
            Tensor::from_vec(back, t.dims(), &Device::Cpu).unwrap(),
        );
    }
    base
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn qlora_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let format = QuantFormat::parse(&std::env::var("QLORA_FORMAT").unwrap()).unwrap();
    let on_dequantized = std::env::var("QLORA_BASE").is_ok_and(|b| b == "dequantized");
    let mut acc = Accelerator::builder().build().unwrap();
    let mut base_model = LlamaForCausalLM::new(config()).unwrap();
    let base = if on_dequantized {
        dequantized_base(format)
    } else {
        let q = quantize_linears(&mut base_model, format).unwrap();
        assert_eq!(q.len(), 14, "{q:?}");
        base_weights()
    };
    let model = LoraModel::new(base_model, lora_config()).unwrap();
    let weights = model.weights(&base, None, 3).unwrap();
    let mut model = acc.prepare_model(model, &weights).unwrap();
    let stored: usize = model
        .engine()
        .plan()
        .units
        .iter()
        .map(|u| u.shard_numel())
        .sum();
    // The LoRA test's batches and training (the same vocabulary of 40).
    let (losses, optimizer) = crate::lora::train_adapters(&mut acc, &mut model, STEPS);
    let opt = optimizer.optimizer();
    let state_names = opt.state_names();
    let weights = common::full_weights(&acc, &model);
    acc.wait_for_everyone().unwrap();
    if acc.is_main_process() {
        println!(
            "RESULT {}",
            json!({ "weights": weights, "losses": losses, "stored": stored,
                    "state_names": state_names })
        );
    }
}

struct Run {
    weights: BTreeMap<String, Vec<f32>>,
    losses: Vec<f64>,
    stored: usize,
    state_names: Vec<String>,
}

fn run(world: usize, env: &[(&str, &str)]) -> Run {
    let outputs = common::run_workers("qlora_worker", ROLE, world, env, Duration::from_secs(120));
    let r = common::result_of(&outputs[0]);
    Run {
        weights: serde_json::from_value(r["weights"].clone()).unwrap(),
        losses: serde_json::from_value(r["losses"].clone()).unwrap(),
        stored: serde_json::from_value(r["stored"].clone()).unwrap(),
        state_names: serde_json::from_value(r["state_names"].clone()).unwrap(),
    }
}

fn assert_same(run: &Run, reference: &Run, what: &str) {
    for (i, (a, b)) in run.losses.iter().zip(&reference.losses).enumerate() {
        assert!(
            ((a - b) / b).abs() < 1e-5,
            "{what}, step {i}: loss {a} vs {b}"
        );
    }
    assert_eq!(
        run.weights.keys().collect::<Vec<_>>(),
        reference.weights.keys().collect::<Vec<_>>()
    );
    for (name, values) in &reference.weights {
        let d = rel(&run.weights[name], values);
        assert!(d < 1e-5, "{what}: `{name}` off by {d:e}");
    }
}

#[test]
fn qlora_trains_as_lora_on_the_dequantized_base_on_one_to_three_processes() {
    let nf4 = [("QLORA_FORMAT", "nf4")];
    let reference = run(1, &nf4);
    let packings = packings(QuantFormat::Nf4);
    // The exported base is what its blocks dequantize to, unmoved by training.
    let dequantized = dequantized_base(QuantFormat::Nf4);
    for name in packings.keys() {
        let want: Vec<f32> = dequantized[name].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(reference.weights[name], want, "`{name}` exported or moved");
    }
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0],
        "{:?}",
        reference.losses
    );
    assert!(
        reference
            .state_names
            .iter()
            .all(|n| fsdp::peft::is_adapter_param(n)),
        "{:?}",
        reference.state_names
    );
    // LoRA on the f32 weights the blocks stand for: the same training.
    let plain = run(1, &[("QLORA_FORMAT", "nf4"), ("QLORA_BASE", "dequantized")]);
    assert_same(&reference, &plain, "NF4 base vs its dequantized f32 base");
    // Stored (and all-gathered) elements: each projection's f32 weight [rows, cols] becomes
    // rows x 9 words per 64 columns (36 bytes), the rest unchanged.
    let f32_elems: usize = packings
        .values()
        .map(|p| p.cols)
        .zip(rows(&packings))
        .map(|(c, r)| c * r)
        .sum();
    let words: usize = packings
        .values()
        .zip(rows(&packings))
        .map(|(p, r)| p.row_words() * r)
        .sum();
    assert_eq!(words * 64, f32_elems * 9);
    assert_eq!(reference.stored, plain.stored - f32_elems + words);
    for (world, strategy) in [
        (2, "FULL_SHARD"),
        (3, "FULL_SHARD"),
        (2, "SHARD_GRAD_OP"),
        (2, "NO_SHARD"),
        // Debug mode poisons released memory: a quantized weight released while backward
        // still reads it would show.
        (2, "DEBUG"),
    ] {
        let setting = match strategy {
            "DEBUG" => ("ACCELERATE_DEBUG_MODE", "true"),
            s => ("FSDP_SHARDING_STRATEGY", s),
        };
        let run = run(world, &[nf4[0], setting]);
        assert_same(&run, &reference, &format!("{world} ranks {strategy}"));
    }
    // GGML's Q4_0 blocks, on 2 ranks, against their own dequantized base in one process.
    let q4 = run(2, &[("QLORA_FORMAT", "q4_0")]);
    let q4_plain = run(
        1,
        &[("QLORA_FORMAT", "q4_0"), ("QLORA_BASE", "dequantized")],
    );
    assert_same(&q4, &q4_plain, "Q4_0 on 2 ranks vs its dequantized base");
}

/// Each packed weight's rows, in `packings`' order.
fn rows(packings: &BTreeMap<String, Packing>) -> Vec<usize> {
    let base = base_weights();
    packings.keys().map(|n| base[n].dims()[0]).collect()
}

#[test]
fn formats_layers_and_settings_a_quantized_base_cannot_take_are_named() {
    // Q4_K's blocks are 256 wide; the projections take 64 and 128 inputs.
    let mut model = LlamaForCausalLM::new(config()).unwrap();
    let e = quantize_linears(&mut model, QuantFormat::parse("Q4_K").unwrap()).unwrap_err();
    assert!(matches!(e, QuantError::PartialBlock { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("model.layers.0.self_attn.q_proj.weight"),
        "{e}"
    );
    assert!(e.to_string().contains("256"), "{e}");
    let e = QuantFormat::parse("fp4").unwrap_err().to_string();
    assert!(e.contains("`fp4`") && e.contains("nf4"), "{e}");
    // GPT-2's Conv1D weights are [in, out].
    let mut gpt = Gpt2LmHeadModel::new(Gpt2Config {
        vocab_size: 50,
        n_positions: 16,
        n_embd: 64,
        n_layer: 1,
        n_head: 2,
        n_inner: None,
        layer_norm_epsilon: 1e-5,
        initializer_range: 0.02,
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        resid_pdrop: 0.0,
    })
    .unwrap();
    let e = quantize_linears(&mut gpt, QuantFormat::Nf4).unwrap_err();
    assert!(matches!(e, QuantError::Layout { .. }), "{e}");
    assert!(e.to_string().contains("transformer.h.0"), "{e}");
    // Mixed precision would cast the blocks' words.
    let mut model = LlamaForCausalLM::new(config()).unwrap();
    quantize_linears(&mut model, QuantFormat::Nf4).unwrap();
    let plugin: FsdpPlugin = FsdpPlugin::builder()
        .mixed_precision(MixedPrecision::Bf16)
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp;
    let e = UnitPlan::build(&model.info(), &plugin, model.no_split_modules(), 2).unwrap_err();
    assert!(matches!(e, PlanError::CastQuantized { .. }), "{e}");
    assert!(e.to_string().contains("mixed_precision: bf16"), "{e}");
    assert!(e.to_string().contains("q_proj"), "{e}");
    // So would an int8 gather round them.
    let plugin: FsdpPlugin = FsdpPlugin::builder()
        .all_gather_dtype(AllGatherDtype::Int8)
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp;
    let e = UnitPlan::build(&model.info(), &plugin, model.no_split_modules(), 2).unwrap_err();
    assert!(e.to_string().contains("fsdp_all_gather_dtype: int8"), "{e}");
    assert!(e.to_string().contains("q_proj"), "{e}");
}

/// The Fsdp of the QLoRA model in `format` (`None`: LoRA on the f32 base) on `group`.
fn engine(
    format: Option<QuantFormat>,
    group: std::sync::Arc<dyn fsdp_comm::Communicator>,
) -> fsdp::engine::Fsdp {
    let mut base = LlamaForCausalLM::new(config()).unwrap();
    if let Some(f) = format {
        quantize_linears(&mut base, f).unwrap();
    }
    let model = LoraModel::new(base, lora_config()).unwrap();
    let base = base_weights();
    let weights = model.weights(&base, None, 3).unwrap();
    let plugin = FsdpPlugin::builder()
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp;
    fsdp::engine::Fsdp::wrap(&model, &weights, &plugin, group).unwrap()
}

/// A sharded checkpoint of a QLoRA model keeps its blocks (and says their format): it loads
/// at another world size with the same weights, `merge-weights` writes the weights they
/// dequantize to, and a model keeping them in another format, or not quantized, is refused
/// naming the tensor and both formats.
#[test]
fn qlora_checkpoints_keep_the_blocks_reshard_merge_dequantized_and_refuse_another_format() {
    use crate::common::tiny::on_threads;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let nf4 = Some(QuantFormat::Nf4);
    let (d, dcp) = (dir.clone(), tmp.path().join("dcp"));
    let saved = on_threads(2, move |g| {
        let e = engine(nf4, g);
        let sgd = fsdp::optim::Sgd::new(Default::default()).unwrap();
        fsdp::checkpoint::save_state(&d, &[&e], &[&sgd], &Default::default(), &Default::default())
            .unwrap();
        // PyTorch's format would hand the words to PyTorch as floats: refused, nothing written.
        let options = fsdp::checkpoint::CheckpointOptions {
            format: Some(fsdp::config::CheckpointFormat::TorchDcp),
            ..Default::default()
        };
        let run = Default::default();
        let e2 = fsdp::checkpoint::save_state(&dcp, &[&e], &[&sgd], &run, &options).unwrap_err();
        assert!(
            e2.to_string()
                .contains("torch-dcp checkpoint format cannot hold")
                && e2.to_string().contains("kept quantized in NF4"),
            "{e2}"
        );
        assert!(!dcp.exists());
        e.full_state_dict().unwrap()
    });
    let saved = saved.into_iter().flatten().next().unwrap();
    let name = "model.layers.1.mlp.down_proj.weight";
    let want: Vec<f32> = dequantized_base(QuantFormat::Nf4)[name]
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(saved[name].dims(), [64, 128]);
    assert_eq!(
        saved[name].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want
    );
    // Three ranks read the two ranks' blocks: the same model.
    let d = dir.clone();
    let loaded = on_threads(3, move |g| {
        let mut e = engine(nf4, g);
        let mut sgd = fsdp::optim::Sgd::new(Default::default()).unwrap();
        fsdp::checkpoint::load_state(&d, &mut [&mut e], &mut [&mut sgd], &Default::default())
            .unwrap();
        e.full_state_dict().unwrap()
    });
    let loaded = loaded.into_iter().flatten().next().unwrap();
    for (n, t) in &saved {
        let (a, b): (Vec<f32>, Vec<f32>) = (
            t.flatten_all().unwrap().to_vec1().unwrap(),
            loaded[n].flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert_eq!(a, b, "`{n}` after resharding 2 -> 3");
    }
    // merge-weights: the dequantized weights, as save_pretrained writes them.
    let merged = tmp.path().join("merged");
    fsdp::checkpoint::merge_weights(&dir.join("pytorch_model_fsdp_0"), &merged).unwrap();
    let file =
        candle_core::safetensors::load(merged.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(file[name].dims(), [64, 128]);
    assert_eq!(
        file[name].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want
    );
    // Q4_0's words of a row have the same shape as NF4's: refused by format.
    for (format, said) in [
        (
            Some(QuantFormat::parse("q4_0").unwrap()),
            "checkpoint and kept in Q4_0 (rows of ",
        ),
        (None, "checkpoint and not quantized in the model"),
    ] {
        let d = dir.clone();
        let errors = on_threads(2, move |g| {
            let mut e = engine(format, g);
            let mut sgd = fsdp::optim::Sgd::new(Default::default()).unwrap();
            fsdp::checkpoint::load_state(&d, &mut [&mut e], &mut [&mut sgd], &Default::default())
                .unwrap_err()
                .to_string()
        });
        for e in errors {
            assert!(e.contains("weight` is kept in NF4 (rows of "), "{e}");
            assert!(e.contains(said) && e.contains("model.layers.0."), "{e}");
        }
    }
}
