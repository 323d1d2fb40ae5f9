//! Checkpoints on threads as ranks: resuming is bitwise the run that never stopped (each
//! state dict type and strategy, dropout on); state moves between world sizes 1–4 and
//! strategies; corrupt, truncated and missing files, foreign tensors and absent ranks are
//! errors naming them; saves replace checkpoints atomically and rotate; merging gives the
//! live weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fsdp::checkpoint::{self, CheckpointOptions, RunState};
use fsdp::config::{ShardingStrategy, StateDictType};

use crate::common;

use crate::common::tiny::{OptimizerKind, Setup, Trainer, on_threads};

fn setup(strategy: ShardingStrategy, kind: StateDictType, optimizer: OptimizerKind) -> Setup {
    Setup {
        strategy,
        state_dict_type: kind,
        optimizer,
        dropout: 0.1,
    }
}

/// One rank's losses, and the final weights on rank 0.
type RankRun = (Vec<f32>, Option<BTreeMap<String, Vec<f32>>>);

fn run_state(step: u64, rank: usize) -> RunState {
    RunState {
        step,
        schedulers: vec![serde_json::json!({"last_step": step})],
        random: serde_json::json!({"rank": rank, "dropout_base": 1000}),
        data: serde_json::json!({"epoch": 0, "batch": step}),
        grad_scalers: vec![serde_json::json!({"scale": 1024.0, "growth_tracker": step})],
    }
}

/// Per rank: losses and (rank 0) weights of `steps` steps straight.
fn straight(world: usize, s: Setup, steps: usize) -> Vec<RankRun> {
    on_threads(world, move |g| {
        let mut t = Trainer::new(g, s);
        let losses = t.train(0..steps);
        (losses, t.weights())
    })
}

/// `first` steps on `a` ranks, saved to `dir`, then loaded on `b` ranks (setup `s_b`) and
/// trained to `total`: per rank the losses after the load and (rank 0) final weights.
fn resumed(
    dir: &Path,
    a: usize,
    s_a: Setup,
    b: usize,
    s_b: Setup,
    first: usize,
    total: usize,
) -> Vec<RankRun> {
    let save_dir = dir.to_path_buf();
    on_threads(a, move |g| {
        let rank = g.rank();
        let mut t = Trainer::new(g, s_a);
        t.train(0..first);
        t.save_state(&save_dir, &run_state(first as u64, rank))
            .unwrap();
    });
    let load_dir = dir.to_path_buf();
    on_threads(b, move |g| {
        let rank = g.rank();
        let mut t = Trainer::new(g, s_b);
        let run = t.load_state(&load_dir).unwrap();
        assert_eq!(run.step, first as u64);
        assert_eq!(run.schedulers, run_state(first as u64, rank).schedulers);
        assert_eq!(run.grad_scalers, run_state(first as u64, rank).grad_scalers);
        assert_eq!(run.data["batch"], first as u64);
        if a == b {
            assert_eq!(run.random, run_state(first as u64, rank).random);
        } else {
            assert!(run.random.is_null(), "per-rank state of another world size");
        }
        let losses = t.train(run.step as usize..total);
        (losses, t.weights())
    })
}

#[test]
fn resuming_is_bitwise_the_run_that_never_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in [
        StateDictType::ShardedStateDict,
        StateDictType::FullStateDict,
        StateDictType::LocalStateDict,
    ] {
        for strategy in [
            ShardingStrategy::FullShard,
            ShardingStrategy::ShardGradOp,
            ShardingStrategy::NoShard,
        ] {
            let s = setup(strategy, kind, OptimizerKind::AdamW);
            let want = straight(2, s, 10);
            let dir = tmp.path().join(format!("{kind:?}-{strategy:?}"));
            let got = resumed(&dir, 2, s, 2, s, 5, 10);
            for (rank, ((lw, ww), (lg, wg))) in want.iter().zip(&got).enumerate() {
                assert_eq!(
                    &lw[5..],
                    &lg[..],
                    "{kind:?} {strategy:?} rank {rank}: losses"
                );
                assert_eq!(ww, wg, "{kind:?} {strategy:?} rank {rank}: weights");
            }
        }
    }
}

/// Relative difference of losses, and whether weights agree (the attention key bias, whose
/// true gradient is zero, within Adam's bound: see `fsdp_matrix.rs`).
fn agree(a: &[RankRun], b: &[RankRun], skip: usize) -> Result<(), String> {
    let mean = |r: &[(Vec<f32>, _)], s: usize| {
        r.iter().map(|x| x.0[s] as f64).sum::<f64>() / r.len() as f64
    };
    for s in 0..b[0].0.len() {
        let (x, y) = (mean(b, s), mean(a, s + skip));
        if (x - y).abs() / y > 1e-5 {
            return Err(format!("step {}: loss {x} vs {y}", s + skip + 1));
        }
    }
    let (wa, wb) = (a[0].1.as_ref().unwrap(), b[0].1.as_ref().unwrap());
    for (name, want) in wa {
        let got = &wb[name];
        let key_bias = name.ends_with("attention.self.key.bias");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
        for (g, w) in got.iter().zip(want) {
            let ok = if key_bias {
                (g - w).abs() <= 3.2 * 3e-3 * 10.0
            } else {
                (g - w).abs() / scale < 1e-5
            };
            if !ok {
                return Err(format!("{name}: {g} vs {w}"));
            }
        }
    }
    Ok(())
}

/// Without dropout (masks depend on the rank, so runs at different world sizes differ).
fn no_dropout(s: Setup) -> Setup {
    Setup { dropout: 0.0, ..s }
}

#[test]
fn state_moves_between_world_sizes_and_strategies() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for optimizer in [OptimizerKind::AdamW, OptimizerKind::Sgd] {
        for a in 1..=4 {
            let s_a = no_dropout(setup(
                ShardingStrategy::FullShard,
                StateDictType::ShardedStateDict,
                optimizer,
            ));
            let want = straight(a, s_a, 6);
            for b in 1..=4 {
                // The strategy changes too, in turn.
                let strategy = [
                    ShardingStrategy::FullShard,
                    ShardingStrategy::ShardGradOp,
                    ShardingStrategy::NoShard,
                ][(a + b) % 3];
                let s_b = no_dropout(setup(strategy, StateDictType::ShardedStateDict, optimizer));
                let dir = tmp.path().join(format!("{optimizer:?}-{a}-{b}"));
                let got = resumed(&dir, a, s_a, b, s_b, 3, 6);
                if let Err(e) = agree(&want, &got, 3) {
                    failures.push(format!(
                        "{optimizer:?} {a} -> {b} ranks ({strategy:?}): {e}"
                    ));
                }
            }
        }
    }
    // A consolidated checkpoint loads at another world size too.
    let s_full = no_dropout(setup(
        ShardingStrategy::FullShard,
        StateDictType::FullStateDict,
        OptimizerKind::AdamW,
    ));
    let want = straight(2, s_full, 6);
    let got = resumed(&tmp.path().join("full"), 2, s_full, 3, s_full, 3, 6);
    if let Err(e) = agree(&want, &got, 3) {
        failures.push(format!("FULL_STATE_DICT 2 -> 3 ranks: {e}"));
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Saves 2 steps of training on 2 ranks to `dir`.
fn saved(dir: &Path, kind: StateDictType) {
    let dir = dir.to_path_buf();
    on_threads(2, move |g| {
        let rank = g.rank();
        let mut t = Trainer::new(
            g,
            setup(ShardingStrategy::FullShard, kind, OptimizerKind::AdamW),
        );
        t.train(0..2);
        t.save_state(&dir, &run_state(2, rank)).unwrap();
    });
}

/// The error each rank gets loading `dir` on `world` ranks with `setup`.
fn load_errors(dir: &Path, world: usize, s: Setup) -> Vec<String> {
    let dir = dir.to_path_buf();
    on_threads(world, move |g| {
        let mut t = Trainer::new(g, s);
        t.load_state(&dir)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    })
}

fn sharded() -> Setup {
    setup(
        ShardingStrategy::FullShard,
        StateDictType::ShardedStateDict,
        OptimizerKind::AdamW,
    )
}

#[test]
fn damaged_checkpoints_are_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = |name: &str| -> PathBuf {
        let d = tmp.path().join(name);
        saved(&d, StateDictType::ShardedStateDict);
        d
    };
    let all_mention = |errors: &[String], parts: &[&str]| {
        for e in errors {
            assert!(
                parts.iter().all(|p| e.contains(p)),
                "expected {parts:?} in every rank's error: {errors:#?}"
            );
        }
    };

    // A flipped byte in the data of rank 1's model file.
    let d = fresh("flipped");
    let file = d.join("pytorch_model_fsdp_0/rank_1.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    all_mention(
        &load_errors(&d, 2, sharded()),
        &["rank_1.safetensors", "checksum"],
    );

    // A flipped byte in a header.
    let d = fresh("header");
    let file = d.join("optimizer_0/rank_0.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[20] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();
    all_mention(
        &load_errors(&d, 2, sharded()),
        &["optimizer_0/rank_0.safetensors", "header"],
    );

    // A truncated shard.
    let d = fresh("truncated");
    let file = d.join("pytorch_model_fsdp_0/rank_0.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    all_mention(
        &load_errors(&d, 2, sharded()),
        &["rank_0.safetensors", "truncated"],
    );

    // Missing metadata, a missing shard, a missing checkpoint document.
    let d = fresh("no-metadata");
    std::fs::remove_file(d.join("pytorch_model_fsdp_0/metadata.json")).unwrap();
    all_mention(
        &load_errors(&d, 2, sharded()),
        &["pytorch_model_fsdp_0/metadata.json", "missing"],
    );
    let d = fresh("no-shard");
    std::fs::remove_file(d.join("pytorch_model_fsdp_0/rank_1.safetensors")).unwrap();
    all_mention(
        &load_errors(&d, 3, sharded()),
        &["rank_1.safetensors", "missing"],
    );
    let d = fresh("no-document");
    std::fs::remove_file(d.join("fsdp_checkpoint.json")).unwrap();
    all_mention(
        &load_errors(&d, 2, sharded()),
        &["fsdp_checkpoint.json", "missing"],
    );

    // Optimizer state for a parameter the model does not have.
    let d = fresh("foreign");
    let meta = d.join("optimizer_0/metadata.json");
    let text = std::fs::read_to_string(&meta)
        .unwrap()
        .replace("\"classifier.bias.exp_avg\"", "\"classifier.gate.exp_avg\"");
    // Signed again, as a document of another model would be (an unsigned edit fails its
    // checksum first).
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc.as_object_mut().unwrap().remove("crc32");
    std::fs::write(&meta, checkpoint::format::document_bytes(&doc).unwrap()).unwrap();
    all_mention(
        &load_errors(&d, 2, sharded()),
        &["`classifier.gate.exp_avg`", "no parameter"],
    );

    // A model lacking one of the checkpoint's parameters (and the other way round).
    let d = fresh("other-model");
    let errors = on_threads(2, {
        let d = d.clone();
        move |g| {
            let mut t = Trainer::new(g, sharded());
            // One layer instead of two: the checkpoint holds parameters it lacks.
            let small =
                fsdp::models::BertForSequenceClassification::new(fsdp::models::BertConfig {
                    num_hidden_layers: 1,
                    ..t.model.bert.config.clone()
                })
                .unwrap();
            let init = fsdp::nn::LocalParams::init(
                &fsdp::nn::Module::info(&small),
                7,
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
            )
            .unwrap();
            let plugin = fsdp::config::FsdpPlugin::builder()
                .resolve(&fsdp::config::Layer::new(), None)
                .unwrap()
                .fsdp;
            let group = t.engine.mesh().shard.clone();
            t.engine = fsdp::engine::Fsdp::wrap(&small, &init.tensors(), &plugin, group).unwrap();
            t.load_state(&d).unwrap_err().to_string()
        }
    });
    all_mention(
        &errors,
        &["bert.encoder.layer.1", "not a parameter of the model"],
    );

    // LOCAL_STATE_DICT at another world size names both layouts.
    let d = tmp.path().join("local");
    saved(&d, StateDictType::LocalStateDict);
    let local = setup(
        ShardingStrategy::FullShard,
        StateDictType::LocalStateDict,
        OptimizerKind::AdamW,
    );
    all_mention(
        &load_errors(&d, 3, local),
        &["LOCAL_STATE_DICT", "2 rank(s)", "3 rank(s)"],
    );
}

#[test]
fn a_save_some_ranks_skip_fails_fast_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("partial");
    let started = Instant::now();
    let results = on_threads(3, {
        let dir = dir.clone();
        move |g| {
            let rank = g.rank();
            let t = Trainer::new(g, sharded());
            if rank == 2 {
                // Busy elsewhere, as a program that saves on some ranks only.
                std::thread::sleep(Duration::from_millis(800));
                return String::new();
            }
            let options = CheckpointOptions {
                join_timeout: Duration::from_millis(300),
                ..Default::default()
            };
            checkpoint::save_state(
                &dir,
                &[&t.engine],
                &[t.optimizer.as_ref()],
                &run_state(0, rank),
                &options,
            )
            .unwrap_err()
            .to_string()
        }
    });
    assert!(started.elapsed() < Duration::from_secs(10));
    for e in &results[..2] {
        assert!(
            e.contains("save_state: ranks [2] did not join"),
            "{results:#?}"
        );
    }
    assert!(!dir.exists(), "nothing written");
}

#[test]
fn saves_replace_atomically_rotate_and_merge_into_the_live_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let project = tmp.path().to_path_buf();
    let live = on_threads(2, move |g| {
        let rank = g.rank();
        let mut t = Trainer::new(g, sharded());
        let options = CheckpointOptions {
            automatic_naming: true,
            total_limit: Some(2),
            ..Default::default()
        };
        let mut written = Vec::new();
        for step in 0..3 {
            t.train(step..step + 1);
            written.push(
                checkpoint::save_state(
                    &project,
                    &[&t.engine],
                    &[t.optimizer.as_ref()],
                    &run_state(step as u64 + 1, rank),
                    &options,
                )
                .unwrap(),
            );
        }
        // Saving again to the same folder replaces it.
        let fixed = project.join("fixed");
        t.save_state(&fixed, &run_state(3, rank)).unwrap();
        t.train(3..4);
        t.save_state(&fixed, &run_state(4, rank)).unwrap();
        (written, t.weights())
    });
    let (written, weights) = (&live[0].0, live[0].1.as_ref().unwrap());
    assert_eq!(
        written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect::<Vec<_>>(),
        ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    );
    let kept: Vec<String> = std::fs::read_dir(tmp.path().join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut kept = kept;
    kept.sort();
    assert_eq!(
        kept,
        ["checkpoint_1", "checkpoint_2"],
        "total_limit 2 keeps the newest"
    );
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let doc: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("fixed/fsdp_checkpoint.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(doc["step"], 4, "the second save replaced the first");

    // Merged from the root or from the model folder: the live weights, by name.
    for src in [
        tmp.path().join("fixed"),
        tmp.path().join("fixed/pytorch_model_fsdp_0"),
    ] {
        let out = tmp.path().join("merged");
        let report = checkpoint::merge_weights(&src, &out).unwrap();
        assert_eq!(report.tensors, weights.len());
        assert_shareable(&report.output, 0o666);
        let merged =
            candle_core::safetensors::load(&report.output, &candle_core::Device::Cpu).unwrap();
        for (name, want) in weights {
            let got: Vec<f32> = merged[name].flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(&got, want, "{name}");
        }
    }
    let err = checkpoint::merge_weights(tmp.path(), &tmp.path().join("x"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("neither a checkpoint"), "{err}");
}

/// `path` has the permissions `full` less the process's umask (0644 / 0755 as a rule), as
/// an ordinarily created file or folder does.
fn assert_shareable(path: &Path, full: u32) {
    use std::os::unix::fs::PermissionsExt;
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let umask = status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .map(|m| u32::from_str_radix(m.trim(), 8).unwrap())
        .unwrap();
    let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, full & !umask, "{}: {mode:o}", path.display());
}

#[test]
fn save_pretrained_writes_what_transformers_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let keep = std::env::var("FSDP_KEEP_PRETRAINED")
        .ok()
        .map(PathBuf::from);
    let base = keep.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let results = on_threads(2, {
        let base = base.clone();
        move |g| {
            let mut t = Trainer::new(g, sharded());
            t.train(0..2);
            let config = t
                .model
                .bert
                .config
                .to_hf_json("BertForSequenceClassification");
            let one = checkpoint::save_pretrained(&t.engine, &base.join("one"), &config, u64::MAX)
                .unwrap();
            // Small files: split as transformers does, with an index.
            let split =
                checkpoint::save_pretrained(&t.engine, &base.join("split"), &config, 4096).unwrap();
            (one, split, t.weights())
        }
    });
    let (one, split, weights) = (&results[0].0, &results[0].1, results[0].2.as_ref().unwrap());
    let cpu = candle_core::Device::Cpu;
    let single = candle_core::safetensors::load(one.join("model.safetensors"), &cpu).unwrap();
    assert_eq!(single.len(), weights.len());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(split.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), weights.len());
    let files: std::collections::BTreeSet<&str> =
        map.values().map(|v| v.as_str().unwrap()).collect();
    assert!(files.len() > 2, "{files:?}");
    let mut total = 0;
    for (name, want) in weights {
        let got: Vec<f32> = single[name].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(&got, want, "{name}");
        let file = map[name].as_str().unwrap();
        assert!(
            file.ends_with(&format!("-of-{:05}.safetensors", files.len())),
            "{file}"
        );
        let part = candle_core::safetensors::load(split.join(file), &cpu).unwrap();
        let got: Vec<f32> = part[name].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(&got, want, "{name} in {file}");
        total += want.len() * 4;
    }
    assert_eq!(index["metadata"]["total_size"], total);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(one.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "bert");
    assert_eq!(config["architectures"][0], "BertForSequenceClassification");
    // A saved model is for others to load: its folders and files as ordinarily created ones.
    for dir in [one, split] {
        assert_shareable(dir, 0o777);
        for f in std::fs::read_dir(dir).unwrap() {
            assert_shareable(&f.unwrap().path(), 0o666);
        }
    }
    // Our loader takes the file by name, as transformers does.
    let model = common::tiny::model(0.0);
    let (_, report) = fsdp::nn::LocalParams::load(
        &fsdp::nn::Module::info(&model),
        &one.join("model.safetensors"),
        &cpu,
    )
    .unwrap();
    assert!(
        report.unexpected.is_empty() && report.missing.is_empty(),
        "{report:?}"
    );
    // A folder opens as from_pretrained finds its files: the index of a split one, else
    // model.safetensors; every tensor as saved.
    use fsdp::nn::WeightSource;
    let info = fsdp::nn::Module::info(&model);
    for dir in [one, split] {
        let source = fsdp::nn::SafetensorsWeights::open_dir(dir, &info, 0).unwrap();
        assert!(source.report().missing.is_empty(), "{}", dir.display());
        for spec in info.all_params() {
            assert_eq!(
                &source.values(spec).unwrap(),
                &weights[&spec.name],
                "{}",
                spec.name
            );
        }
    }
    // An index that names a file outside the folder, or a file that lacks the tensor.
    let text = std::fs::read_to_string(split.join("model.safetensors.index.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let (name, file) = {
        let (n, f) = doc["weight_map"]
            .as_object()
            .unwrap()
            .iter()
            .next()
            .unwrap();
        (n.clone(), f.as_str().unwrap().to_string())
    };
    let other = map
        .values()
        .map(|v| v.as_str().unwrap())
        .find(|f| *f != file)
        .unwrap()
        .to_string();
    for (bad, expect) in [
        ("../model.safetensors".to_string(), "not a file name"),
        (other, "does not hold it"),
    ] {
        doc["weight_map"][&name] = bad.clone().into();
        std::fs::write(split.join("model.safetensors.index.json"), doc.to_string()).unwrap();
        let e = fsdp::nn::SafetensorsWeights::open_dir(split, &info, 0)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(expect) && e.contains(&name) && e.contains("index.json"),
            "{e}"
        );
    }
    std::fs::write(split.join("model.safetensors.index.json"), text).unwrap();
}

/// Misuse is a typed error a program can match on, not a string: no model to save or load,
/// an optimizer without its model; nothing is written.
#[test]
fn misuse_is_a_typed_error_and_writes_nothing() {
    use fsdp::checkpoint::CheckpointError;
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("ckpt");
    let options = CheckpointOptions::default();
    let err =
        checkpoint::save_state(&target, &[], &[], &RunState::default(), &options).unwrap_err();
    assert!(
        matches!(err, CheckpointError::NoModel { op: "save_state" }),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "save_state needs at least one model");
    let err = checkpoint::load_state(&target, &mut [], &mut [], &options).unwrap_err();
    assert!(
        matches!(err, CheckpointError::NoModel { op: "load_state" }),
        "{err:?}"
    );
    assert!(!target.exists());
}
