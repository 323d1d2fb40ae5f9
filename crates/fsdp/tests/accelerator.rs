//! The `Accelerator` API over real processes: a fine-tuning recipe (two models, each with its
//! optimizer and scheduler, parameter groups, gradient accumulation without sync or with a
//! reduction per micro-batch, clipping) on 2 and 3 processes reproduces a single-process
//! PyTorch run (tools/make_param_groups_fixture.py) and a single process of our own; schedulers step once per optimizer step whatever the number
//! of processes; `gather_for_metrics` counts every evaluation example once; misuse is
//! reported. The test binary re-runs itself as the workers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp::accelerator::{Accelerator, PreparedModel, ReduceOp};
use fsdp::data::{CollateError, DataLoader};
use fsdp::models::BertForSequenceClassification;
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{
    AdamW, AdamWConfig, LambdaSchedule, LrSchedule, Sgd, SgdConfig, is_bias_or_norm, split_no_decay,
};
use serde_json::{Value, json};

use crate::common;

const ROLE: &str = "FSDP_ACCELERATOR_WORKER";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/param_groups")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap())
        .unwrap()
}

type Example = (Vec<u32>, u32);
type Batch = (Tensor, Tensor);

/// The fixture's examples, in order.
fn examples() -> Vec<Example> {
    let data =
        candle_core::safetensors::load(fixture().join("data.safetensors"), &Device::Cpu).unwrap();
    let ids: Vec<Vec<i64>> = data["input_ids"].to_vec2().unwrap();
    let labels: Vec<i64> = data["labels"].to_vec1().unwrap();
    ids.into_iter()
        .zip(labels)
        .map(|(row, l)| (row.into_iter().map(|x| x as u32).collect(), l as u32))
        .collect()
}

fn collate(examples: &[Example]) -> Result<Batch, CollateError> {
    let seq = examples[0].0.len();
    let ids: Vec<u32> = examples.iter().flat_map(|e| e.0.iter().copied()).collect();
    let labels: Vec<u32> = examples.iter().map(|e| e.1).collect();
    Ok((
        Tensor::from_vec(ids, (examples.len(), seq), &Device::Cpu)?,
        Tensor::from_vec(labels, examples.len(), &Device::Cpu)?,
    ))
}

/// The recipe: model 0 from the fixture's initial weights with AdamW in two groups (no
/// decay on biases and LayerNorm weights) and a linear warmup schedule; model 1 from a seed
/// with Nesterov SGD and a cosine schedule; both on the same micro-batches, 2 per optimizer
/// step, clipped to norm 1. Returns what every rank agrees on, and the weights on rank 0.
fn recipe(acc: &mut Accelerator) -> Value {
    let e = expected();
    let micro = e["micro_batch"].as_u64().unwrap() as usize;
    let steps = e["steps"].as_u64().unwrap();
    let world = acc.num_processes();

    let tiny = common::tiny::model(0.0);
    let (init, _) = LocalParams::load(
        &tiny.info(),
        &fixture().join("init.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let init = init.tensors();
    let names: Vec<String> = init.keys().cloned().collect();
    let mut first = acc.prepare_model(tiny, &init).unwrap();
    let adamw = AdamW::with_groups(split_no_decay(
        names,
        AdamWConfig {
            lr: e["lr"].as_f64().unwrap(),
            weight_decay: e["weight_decay"].as_f64().unwrap(),
            ..Default::default()
        },
        is_bias_or_norm,
    ))
    .unwrap();
    let mut first_opt = acc.prepare_optimizer(adamw).unwrap();
    acc.prepare_scheduler(
        &mut first_opt,
        LrSchedule::Linear {
            warmup: e["warmup"].as_u64().unwrap(),
            total: steps,
        },
    )
    .unwrap();

    let other: BertForSequenceClassification = common::tiny::model(0.0);
    let init = LocalParams::init(&other.info(), 3, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    let mut second = acc.prepare_model(other, &init).unwrap();
    let sgd = Sgd::new(SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        nesterov: true,
        ..Default::default()
    })
    .unwrap();
    let mut second_opt = acc.prepare_optimizer(sgd).unwrap();
    acc.prepare_scheduler(
        &mut second_opt,
        LrSchedule::Cosine {
            warmup: 1,
            total: steps,
        },
    )
    .unwrap();

    let mut loader = acc.prepare_data_loader(DataLoader::new(examples(), micro / world, collate));
    let (mut losses, mut second_losses, mut lrs, mut second_lrs, mut norms) =
        (vec![], vec![], vec![], vec![], vec![]);
    while let Some(batch) = loader.next_batch() {
        let (ids, labels) = batch.unwrap().batch;
        let micro_step = |model: &mut PreparedModel<BertForSequenceClassification>,
                          acc: &mut Accelerator| {
            let logits = model
                .forward(|m, p| m.forward(p, &ids, None, None))
                .unwrap();
            let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
            let local = loss.to_scalar::<f32>().unwrap();
            acc.backward(model, loss).unwrap();
            acc.reduce(vec![local], ReduceOp::Avg).unwrap()[0]
        };
        losses.push(micro_step(&mut first, acc));
        second_losses.push(micro_step(&mut second, acc));
        if acc.sync_gradients() {
            norms.push(acc.clip_grad_norm(&mut first, 1.0).unwrap());
            acc.clip_grad_norm(&mut second, 1.0).unwrap();
            lrs.push(vec![first_opt.lr(0), first_opt.lr(1)]);
            second_lrs.push(second_opt.lr(0));
        }
        let stepped = acc.optimizer_step(&mut first, &mut first_opt).unwrap();
        assert_eq!(stepped, acc.sync_gradients());
        acc.optimizer_step(&mut second, &mut second_opt).unwrap();
    }
    json!({
        "losses": losses,
        "second_losses": second_losses,
        "lrs": lrs,
        "second_lrs": second_lrs,
        "grad_norms": norms,
        "steps": acc.step(),
        "scheduler_steps": [
            first_opt.scheduler().unwrap().steps,
            second_opt.scheduler().unwrap().steps,
        ],
        "weights": common::full_weights(acc, &first),
        "second_weights": common::full_weights(acc, &second),
    })
}

/// Evaluation over 10 examples, 3 per rank per step: every example's index, gathered
/// without the repeats that fill up the last step, as vectors and tensors of several element
/// types (each must agree with the i64 indices), and a gather of mismatched shapes.
fn evaluation_indices(acc: &Accelerator) -> Value {
    let data: Vec<i64> = (0..10).collect();
    let mut loader = acc.prepare_data_loader(DataLoader::new(data, 3, |x: &[i64]| {
        Ok::<_, CollateError>(x.to_vec())
    }));
    let (mut seen, mut even, mut big, mut wide) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut rows: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    while let Some(batch) = loader.next_batch() {
        let batch = batch.unwrap();
        let ids = &batch.batch;
        seen.extend(acc.gather_for_metrics(ids.clone(), &batch).unwrap());
        let flags: Vec<bool> = ids.iter().map(|i| i % 2 == 0).collect();
        even.extend(acc.gather_for_metrics(flags, &batch).unwrap());
        let u32s: Vec<u32> = ids.iter().map(|&i| 4_000_000_000 + i as u32).collect();
        big.extend(acc.gather_for_metrics(u32s, &batch).unwrap());
        let u64s: Vec<u64> = ids.iter().map(|&i| u64::MAX - i as u64).collect();
        wide.extend(acc.gather_for_metrics(u64s, &batch).unwrap());
        // Rows (i, 2i) of every dtype the engine computes in.
        let pairs: Vec<f32> = ids
            .iter()
            .flat_map(|&i| [i as f32, 2.0 * i as f32])
            .collect();
        let t = Tensor::from_vec(pairs, (ids.len(), 2), &Device::Cpu).unwrap();
        for dtype in [
            DType::F32,
            DType::BF16,
            DType::F16,
            DType::F64,
            DType::U8,
            DType::U32,
            DType::I64,
        ] {
            let g = acc
                .gather_tensor_for_metrics(&t.to_dtype(dtype).unwrap(), &batch)
                .unwrap();
            assert_eq!(g.dtype(), dtype);
            let values: Vec<f64> = g
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            rows.entry(format!("{dtype:?}")).or_default().extend(values);
        }
    }
    let mismatch = acc
        .gather_tensor(&Tensor::zeros(acc.process_index() + 1, DType::F32, &Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    json!({
        "indices": seen,
        "even": even,
        "u32": big,
        "u64": wide.iter().map(|w| w.to_string()).collect::<Vec<_>>(),
        "rows": rows,
        "mismatch": mismatch,
    })
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn accelerator_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(expected()["accumulation"].as_u64().unwrap() as usize)
        .sync_each_batch(std::env::var(SYNC_EACH_BATCH).is_ok())
        .build()
        .unwrap();
    let mut result = recipe(&mut acc);
    result["evaluated"] = json!(evaluation_indices(&acc));
    acc.wait_for_everyone().unwrap();
    if acc.is_main_process() {
        println!("RESULT {result}");
    }
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|x| match x.as_array() {
            Some(inner) => inner.iter().map(|y| y.as_f64().unwrap()).collect(),
            None => vec![x.as_f64().unwrap()],
        })
        .collect()
}

fn assert_close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs().max(1e-12),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

fn assert_weights_close(got: &Value, want: &BTreeMap<String, Vec<f32>>, abs: f64, what: &str) {
    let got = got.as_object().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    for (name, w) in want {
        let g = floats(&got[name]);
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            assert!(
                (g - *w as f64).abs() <= abs,
                "{what} {name}[{i}]: {g} vs {w}"
            );
        }
    }
}

/// Set for workers that reduce every micro-batch instead of accumulating without sync.
const SYNC_EACH_BATCH: &str = "TEST_SYNC_EACH_BATCH";

fn run(world: usize, env: &[(&str, &str)]) -> Value {
    let outputs = common::run_workers(
        "accelerator_worker",
        ROLE,
        world,
        env,
        Duration::from_secs(120),
    );
    common::result_of(&outputs[0])
}

#[test]
fn a_recipe_on_several_processes_matches_pytorch_and_one_process() {
    let e = expected();
    let pytorch_final: BTreeMap<String, Vec<f32>> =
        candle_core::safetensors::load(fixture().join("final.safetensors"), &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
    let single = {
        let mut acc = Accelerator::builder()
            .gradient_accumulation_steps(2)
            .build()
            .unwrap();
        assert_eq!(acc.num_processes(), 1);
        recipe(&mut acc)
    };
    for (label, got) in [
        ("1 process", single.clone()),
        ("2 processes", run(2, &[])),
        ("3 processes", run(3, &[])),
        (
            "3 processes, sync each batch",
            run(3, &[(SYNC_EACH_BATCH, "1")]),
        ),
    ] {
        // Against PyTorch: losses, gradient norms, each group's rate, final weights.
        assert_close(
            &floats(&got["losses"]),
            &floats(&e["losses"]),
            1e-5,
            &format!("{label} losses"),
        );
        assert_close(
            &floats(&got["grad_norms"]),
            &floats(&e["grad_norms"]),
            1e-5,
            &format!("{label} grad norms"),
        );
        assert_close(
            &floats(&got["lrs"]),
            &floats(&e["lrs"]),
            1e-12,
            &format!("{label} lrs"),
        );
        assert_weights_close(
            &got["weights"],
            &pytorch_final,
            3e-6,
            &format!("{label} vs PyTorch"),
        );
        // Schedulers count optimizer steps, not processes or micro-batches.
        assert_eq!(got["steps"], json!(6), "{label}");
        assert_eq!(got["scheduler_steps"], json!([6, 6]), "{label}");
        // The second model and optimizer: the same as on one process.
        assert_close(
            &floats(&got["second_losses"]),
            &floats(&single["second_losses"]),
            1e-5,
            &format!("{label} second model"),
        );
        // (1e-12: JSON's float parsing is not exact to the last bit.)
        assert_close(
            &floats(&got["second_lrs"]),
            &floats(&single["second_lrs"]),
            1e-12,
            &format!("{label} second lrs"),
        );
        let second: BTreeMap<String, Vec<f32>> = single["second_weights"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), floats(v).into_iter().map(|x| x as f32).collect()))
            .collect();
        assert_weights_close(
            &got["second_weights"],
            &second,
            1e-6,
            &format!("{label} second model"),
        );
        if label != "1 process" {
            let eval = &got["evaluated"];
            let order: Vec<i64> = eval["indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect();
            let mut seen = order.clone();
            seen.sort();
            assert_eq!(
                seen,
                (0..10).collect::<Vec<_>>(),
                "{label}: every example once"
            );
            // Every element type in the same order: bools, u32 above i32's range, u64 bits.
            let even: Vec<bool> = order.iter().map(|i| i % 2 == 0).collect();
            assert_eq!(eval["even"], json!(even), "{label}");
            let big: Vec<u64> = order.iter().map(|&i| 4_000_000_000 + i as u64).collect();
            assert_eq!(eval["u32"], json!(big), "{label}");
            let wide: Vec<String> = order
                .iter()
                .map(|&i| (u64::MAX - i as u64).to_string())
                .collect();
            assert_eq!(eval["u64"], json!(wide), "{label}");
            let pairs: Vec<f64> = order
                .iter()
                .flat_map(|&i| [i as f64, 2.0 * i as f64])
                .collect();
            let rows = eval["rows"].as_object().unwrap();
            assert_eq!(rows.len(), 7, "{label}: {rows:?}");
            for (dtype, got) in rows {
                assert_eq!(floats(got), pairs, "{label}: {dtype} rows");
            }
            let e = eval["mismatch"].as_str().unwrap();
            assert!(
                e.contains("rank 0 has a tensor of shape [1]") && e.contains("of another shape"),
                "{label}: {e}"
            );
        }
    }
    // Cosine with one warmup step: 0 first, then the full rate, then decaying.
    let second_lrs = floats(&single["second_lrs"]);
    assert_eq!(second_lrs[0], 0.0);
    assert!((second_lrs[1] - 0.1).abs() < 1e-12);
    assert!(second_lrs[2] < second_lrs[1]);
}

#[test]
fn models_and_optimizers_pair_by_preparation_order() {
    let mut acc = Accelerator::new().unwrap();
    let lonely = acc.prepare_optimizer(Sgd::new(SgdConfig::default()).unwrap());
    let err = lonely
        .err()
        .expect("an optimizer without a model is refused")
        .to_string();
    assert!(err.contains("optimizer 0 has no model"), "{err}");

    let model = |acc: &mut Accelerator| {
        let m = common::tiny::model(0.0);
        let w = LocalParams::init(&m.info(), 1, DType::F32, &Device::Cpu)
            .unwrap()
            .tensors();
        acc.prepare_model(m, &w).unwrap()
    };
    let mut a = model(&mut acc);
    let mut b = model(&mut acc);
    let mut opt_a = acc
        .prepare_optimizer(Sgd::new(SgdConfig::default()).unwrap())
        .unwrap();
    let opt_b = acc
        .prepare_optimizer(Sgd::new(SgdConfig::default()).unwrap())
        .unwrap();
    let (ids, labels) = common::tiny::batch(0);
    let logits = b.forward(|m, p| m.forward(p, &ids, None, None)).unwrap();
    let err = b
        .forward(|m, p| m.forward(p, &ids, None, None))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("a second forward before backward"), "{err}");
    // Nor an evaluation: the units are in the training forward's step until its backward.
    for gathered in [false, true] {
        let run = |m: &BertForSequenceClassification, p: &dyn fsdp::nn::Params| {
            m.forward(p, &ids, None, None)
        };
        let err = match gathered {
            false => b.evaluate(run),
            true => b.evaluate_gathered(run),
        };
        let err = err.err().unwrap().to_string();
        assert!(
            err.contains("an evaluation while a training forward waits"),
            "{err}"
        );
    }
    // A typed error a program can match on.
    let err = b.forward(|m, p| m.forward(p, &ids, None, None)).err();
    assert!(
        matches!(
            err,
            Some(fsdp::accelerator::AcceleratorError::CallOrder { model: 1, .. })
        ),
        "{err:?}"
    );
    acc.backward(
        &mut b,
        cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap(),
    )
    .unwrap();
    let err = acc
        .optimizer_step(&mut b, &mut opt_a)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("optimizer 0 was prepared for model 0") && err.contains("stepping model 1"),
        "{err}"
    );
    let err = acc
        .optimizer_step(&mut a, &mut opt_a)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model 0: an optimizer step without gradients"),
        "{err}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let err = acc
        .save_state(
            Some(tmp.path()),
            &[&a, &b],
            &[&opt_b, &opt_a],
            Default::default(),
        )
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("optimizer 1 given in position 0"), "{err}");
    assert!(
        std::fs::read_dir(tmp.path()).unwrap().next().is_none(),
        "nothing written"
    );
}

#[test]
fn an_async_save_state_is_waited_for_by_the_next_load_and_holds_the_state_it_was_given() {
    let mut acc = fsdp::accelerator::Accelerator::new().unwrap();
    let (mut model, mut opt) = common::tiny::prepare_with_sgd(&mut acc);
    common::tiny::accelerator_step(&mut acc, &mut model, &mut opt, 0);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let saved = acc.get_state_dict(&model).unwrap().unwrap();
    let written = acc
        .save_state_async(Some(&dir), &[&model], &[&opt], Default::default())
        .unwrap();
    assert_eq!(written, dir);
    // Training goes on while it is written.
    common::tiny::accelerator_step(&mut acc, &mut model, &mut opt, 1);
    let trained = acc.get_state_dict(&model).unwrap().unwrap();
    assert!(common::max_abs_diff(&trained["classifier.weight"], &saved["classifier.weight"]) > 0.0);
    // load_state waits for the save, then loads what it was given.
    acc.load_state(&dir, &mut [&mut model], &mut [&mut opt])
        .unwrap();
    let loaded = acc.get_state_dict(&model).unwrap().unwrap();
    for (name, t) in &saved {
        assert_eq!(common::max_abs_diff(t, &loaded[name]), 0.0, "{name}");
    }
    assert_eq!(
        acc.wait_for_checkpoint().unwrap(),
        None,
        "nothing left to wait for"
    );
    // FULL_STATE_DICT is refused before anything is written.
    let full = fsdp::checkpoint::save_state_async(
        &tmp.path().join("full"),
        &[model.engine()],
        &[],
        &Default::default(),
        &fsdp::checkpoint::CheckpointOptions {
            state_dict_type: Some(fsdp::config::StateDictType::FullStateDict),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(full.contains("FULL_STATE_DICT"), "{full}");
    assert!(!tmp.path().join("full").exists());
}

#[test]
fn a_lambda_schedule_resumes_from_a_checkpoint_under_its_name() {
    // PyTorch's LambdaLR: base * f(steps done). A checkpoint keeps the name and the step;
    // the resumed run attaches the same function and goes on at the saved step.
    let halving = || {
        LrSchedule::Lambda(LambdaSchedule::new("halve every 2", |done| {
            0.5f64.powi((done / 2) as i32)
        }))
    };
    let dir = tempfile::tempdir().unwrap();
    let setup = |schedule: LrSchedule| {
        let mut acc = Accelerator::new().unwrap();
        let m = common::tiny::model(0.0);
        let w = LocalParams::init(&m.info(), 1, DType::F32, &Device::Cpu)
            .unwrap()
            .tensors();
        let model = acc.prepare_model(m, &w).unwrap();
        let sgd = Sgd::new(SgdConfig {
            lr: 0.8,
            ..Default::default()
        })
        .unwrap();
        let mut opt = acc.prepare_optimizer(sgd).unwrap();
        acc.prepare_scheduler(&mut opt, schedule).unwrap();
        (acc, model, opt)
    };
    let (mut acc, mut model, mut opt) = setup(halving());
    let mut rates = vec![opt.lr(0)];
    for step in 0..5 {
        let (ids, labels) = common::tiny::batch(step);
        let logits = model
            .forward(|m, p| m.forward(p, &ids, None, None))
            .unwrap();
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
        acc.backward(&mut model, loss).unwrap();
        acc.optimizer_step(&mut model, &mut opt).unwrap();
        rates.push(opt.lr(0));
    }
    assert_eq!(rates, [0.8, 0.8, 0.4, 0.4, 0.2, 0.2]);
    let saved = acc
        .save_state(
            Some(&dir.path().join("ckpt")),
            &[&model],
            &[&opt],
            fsdp::data::LoaderPosition::start_of(0),
        )
        .unwrap();
    drop((acc, model, opt));

    let (mut acc, mut model, mut opt) = setup(halving());
    acc.load_state(&saved, &mut [&mut model], &mut [&mut opt])
        .unwrap();
    assert_eq!(opt.scheduler().unwrap().steps, 5);
    assert_eq!(opt.lr(0), 0.2, "the sixth step's rate: f(5) = 1/4");

    // Another schedule attached, or a lambda of another name: refused, naming the saved one.
    for other in [
        LrSchedule::Constant,
        LrSchedule::Lambda(LambdaSchedule::new("other", |_| 1.0)),
    ] {
        let (mut acc, mut model, mut opt) = setup(other);
        let e = acc
            .load_state(&saved, &mut [&mut model], &mut [&mut opt])
            .unwrap_err()
            .to_string();
        assert!(e.contains("the lambda \"halve every 2\""), "{e}");
    }
}

#[test]
fn metrics_on_a_full_disk_never_leave_half_a_line() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(_disk) = common::SmallDisk::mount(&tmp.path().join("disk"), "4k") else {
        skipped!("mounting a small tmpfs needs root");
        return;
    };
    let project = tmp.path().join("disk");
    let acc = Accelerator::builder()
        .project_config(fsdp::accelerator::ProjectConfiguration {
            project_dir: project.clone(),
            ..Default::default()
        })
        .log_metrics(true)
        .build()
        .unwrap();
    let mut refused = None;
    for i in 0..10_000 {
        let metrics = json!({ "loss": 0.123456789 * i as f64, "note": "x".repeat(i % 37) });
        if let Err(e) = acc.log(metrics) {
            refused = Some(e.to_string());
            break;
        }
    }
    let refused = refused.expect("a 4 KiB disk fills");
    assert!(refused.contains("metrics.jsonl"), "{refused}");
    let text = std::fs::read_to_string(project.join("metrics.jsonl")).unwrap();
    assert!(
        text.ends_with('\n'),
        "a partial last line: {:?}",
        text.lines().last()
    );
    for line in text.lines() {
        serde_json::from_str::<Value>(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    }
}
