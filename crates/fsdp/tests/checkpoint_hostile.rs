//! Checkpoints against a hostile or clumsy user (issue 20): a save never deletes what is not
//! its own (a user's folder, a file, another job's staging folder); documents that name
//! files outside the checkpoint, declare sizes the files do not have, or whose arithmetic
//! wraps are refused before anything is allocated, naming the file (with checksums
//! recomputed, as a crafted file would have them); FIFOs and devices are refused at once;
//! an edited document fails its checksum; version-1 checkpoints still load. An optimizer
//! whose parameter groups differ from the saved ones is refused before anything changes, as
//! are saved group settings the optimizer refuses; matching groups get the saved settings.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fsdp::checkpoint::{self, CheckpointOptions, RunState, format};
use fsdp::config::{CheckpointFormat, ShardingStrategy, StateDictType};

use crate::common;

use crate::common::tiny::{OptimizerKind, Setup, Trainer, on_threads};

fn sharded() -> Setup {
    Setup {
        strategy: ShardingStrategy::FullShard,
        state_dict_type: StateDictType::ShardedStateDict,
        optimizer: OptimizerKind::AdamW,
        dropout: 0.0,
    }
}

fn run_state(step: u64, rank: usize) -> RunState {
    RunState {
        step,
        schedulers: vec![serde_json::json!({"last_step": step})],
        random: serde_json::json!({"rank": rank}),
        data: serde_json::json!({"epoch": 0, "step": step}),
        grad_scalers: Vec::new(),
    }
}

/// What every rank's save of one step of training to `dir` returns.
fn save_results(dir: &Path) -> Vec<Result<PathBuf, String>> {
    let dir = dir.to_path_buf();
    on_threads(2, move |g| {
        let rank = g.rank();
        let mut t = Trainer::new(g, sharded());
        t.train(0..1);
        t.save_state(&dir, &run_state(1, rank))
            .map_err(|e| e.to_string())
    })
}

fn saved(dir: &Path) {
    for r in save_results(dir) {
        r.unwrap();
    }
}

/// The error each of 2 ranks gets loading `dir` (empty for success).
fn load_errors(dir: &Path) -> Vec<String> {
    let dir = dir.to_path_buf();
    on_threads(2, move |g| {
        let mut t = Trainer::new(g, sharded());
        t.load_state(&dir)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    })
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Edits the JSON document at `path` and signs it again, as a crafted file would be.
fn resign(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    edit(&mut doc);
    doc.as_object_mut().unwrap().remove("crc32");
    std::fs::write(path, format::document_bytes(&doc).unwrap()).unwrap();
}

#[test]
fn saves_replace_only_their_own_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    // A user's folder at the destination: refused, untouched, nothing staged left.
    let user = tmp.path().join("step_1");
    std::fs::create_dir(&user).unwrap();
    std::fs::write(user.join("precious.txt"), "precious").unwrap();
    for r in save_results(&user) {
        let e = r.unwrap_err();
        assert!(
            e.contains("step_1") && e.contains("not a checkpoint") && e.contains("nothing was"),
            "{e}"
        );
    }
    assert_eq!(entries(&user), ["precious.txt"]);
    assert_eq!(entries(tmp.path()), ["step_1"], "no staging folder left");

    // A regular file at the destination: refused, kept.
    let file = tmp.path().join("file");
    std::fs::write(&file, "mine").unwrap();
    for r in save_results(&file) {
        let e = r.unwrap_err();
        assert!(e.contains("not a folder"), "{e}");
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");

    // A FIFO where the destination's document would be: refused at once, not a hang.
    let fifo_dest = tmp.path().join("fifo_dest");
    std::fs::create_dir(&fifo_dest).unwrap();
    common::mkfifo(&fifo_dest.join("fsdp_checkpoint.json"));
    for r in save_results(&fifo_dest) {
        let e = r.unwrap_err();
        assert!(e.contains("not a checkpoint"), "{e}");
    }
    std::fs::remove_dir_all(&fifo_dest).unwrap();

    // An empty folder and a checkpoint of ours are replaced.
    let ours = tmp.path().join("ours");
    std::fs::create_dir(&ours).unwrap();
    saved(&ours);
    saved(&ours);
    assert!(ours.join("fsdp_checkpoint.json").is_file());

    // A checkpoint of ours the user put a file into is not.
    std::fs::write(ours.join("notes.txt"), "my notes").unwrap();
    for r in save_results(&ours) {
        let e = r.unwrap_err();
        assert!(e.contains("notes.txt"), "{e}");
    }
    std::fs::remove_file(ours.join("notes.txt")).unwrap();
    std::fs::write(ours.join("pytorch_model_fsdp_0/notes.txt"), "x").unwrap();
    for r in save_results(&ours) {
        let e = r.unwrap_err();
        assert!(e.contains("pytorch_model_fsdp_0/notes.txt"), "{e}");
    }
    assert!(ours.join("pytorch_model_fsdp_0/notes.txt").is_file());
    std::fs::remove_file(ours.join("pytorch_model_fsdp_0/notes.txt")).unwrap();
    // One of its files edited in place (same size): the names and sizes the save checks
    // when it begins all fit, so it writes; the full check before the exchange refuses, and
    // the edited checkpoint stays as it was, with no staging folder left.
    let shard = ours.join("pytorch_model_fsdp_0/rank_0.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    for r in save_results(&ours) {
        let e = r.unwrap_err();
        assert!(
            e.contains("rank_0.safetensors") && e.contains("changed after the save"),
            "{e}"
        );
    }
    assert_eq!(std::fs::read(&shard).unwrap(), bytes);
    assert!(
        !entries(tmp.path()).iter().any(|n| n.contains(".partial-")),
        "{:?}",
        entries(tmp.path())
    );

    // Rotation removes old checkpoints, never a user's folder named like one.
    let project = tmp.path().join("project");
    let foreign = project.join("checkpoints/checkpoint_0");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("mine.txt"), "x").unwrap();
    let p = project.clone();
    on_threads(2, move |g| {
        let rank = g.rank();
        let mut t = Trainer::new(g, sharded());
        let options = CheckpointOptions {
            automatic_naming: true,
            total_limit: Some(1),
            ..Default::default()
        };
        for step in 0..3 {
            t.train(step..step + 1);
            checkpoint::save_state(
                &p,
                &[&t.engine],
                &[t.optimizer.as_ref()],
                &run_state(step as u64, rank),
                &options,
            )
            .unwrap();
        }
    });
    assert_eq!(
        entries(&project.join("checkpoints")),
        ["checkpoint_0", "checkpoint_3"]
    );
    assert_eq!(entries(&foreign), ["mine.txt"]);
}

#[test]
fn save_pretrained_keeps_the_users_files_in_its_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("tokenizer.json"), "{}").unwrap();
    std::fs::write(model.join("README.md"), "# mine").unwrap();
    let dir = model.clone();
    let file = tmp.path().join("a_file");
    std::fs::write(&file, "mine").unwrap();
    let f = file.clone();
    let errors = on_threads(2, move |g| {
        let t = Trainer::new(g, sharded());
        let config = serde_json::json!({"model_type": "bert"});
        checkpoint::save_pretrained(&t.engine, &dir, &config, 4096).unwrap();
        // Saved again as one file: the shards of the first save go, the user's files stay.
        checkpoint::save_pretrained(&t.engine, &dir, &config, u64::MAX).unwrap();
        checkpoint::save_pretrained(&t.engine, &f, &config, u64::MAX)
            .unwrap_err()
            .to_string()
    });
    assert_eq!(
        entries(&model),
        [
            "README.md",
            "config.json",
            "model.safetensors",
            "tokenizer.json"
        ]
    );
    assert_eq!(
        std::fs::read_to_string(model.join("README.md")).unwrap(),
        "# mine"
    );
    assert!(errors[0].contains("not a folder"), "{}", errors[0]);
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
    assert_eq!(entries(tmp.path()), ["a_file", "model"], "no staging left");
}

#[test]
fn a_staging_folder_another_live_job_holds_is_left_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("step_1");
    // Another job's save in progress: its staging folder, its lock held.
    let theirs = tmp.path().join(".step_1.partial-00000000deadbeef");
    std::fs::create_dir(&theirs).unwrap();
    let lock = std::fs::File::create(theirs.join(".lock")).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(
        unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        },
        0
    );
    std::fs::write(theirs.join("half_written"), "x").unwrap();
    // And a folder named like staging that no save of ours made (no lock file).
    let unknown = tmp.path().join(".step_1.partial-someone-elses");
    std::fs::create_dir(&unknown).unwrap();
    saved(&dest);
    assert!(
        theirs.join("half_written").is_file(),
        "a live job's staging folder was removed"
    );
    assert!(unknown.is_dir());
    // Once that job is gone (its lock released), the next save removes its folder.
    drop(lock);
    saved(&dest);
    assert!(!theirs.exists(), "a dead job's staging folder stays");
    assert!(unknown.is_dir());
}

/// The errors of loading and of merging `dir` (each must name `needle`), and that the
/// merge left nothing in its output folder.
fn refused(dir: &Path, needles: &[&str]) {
    for e in load_errors(dir) {
        assert!(needles.iter().all(|n| e.contains(n)), "load: {e}");
    }
    let out = dir.parent().unwrap().join("merged");
    let e = checkpoint::merge_weights(dir, &out)
        .unwrap_err()
        .to_string();
    assert!(needles.iter().all(|n| e.contains(n)), "merge: {e}");
    assert!(entries(&out).is_empty(), "merge left {:?}", entries(&out));
}

#[test]
fn crafted_metadata_is_refused_before_anything_is_read_or_allocated() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = |name: &str| -> PathBuf {
        let d = tmp.path().join(name).join("ck");
        saved(&d);
        d
    };
    let meta = |d: &Path| d.join("pytorch_model_fsdp_0/metadata.json");
    let first_tensor = |doc: &mut serde_json::Value| -> String {
        doc["tensors"]
            .as_object()
            .unwrap()
            .keys()
            .find(|k| k.contains("embeddings.word_embeddings"))
            .unwrap()
            .clone()
    };
    // File names outside the checkpoint, listed and pointed at.
    std::fs::write(tmp.path().join("outside.safetensors"), vec![0u8; 64]).unwrap();
    for (case, name) in [
        ("dotdot", "../../outside.safetensors"),
        ("absolute", "/etc/passwd"),
    ] {
        let d = fresh(case);
        resign(&meta(&d), |doc| {
            let t = first_tensor(doc);
            let files = doc["files"].as_object_mut().unwrap();
            let entry = files["rank_0.safetensors"].clone();
            files.insert(name.into(), entry);
            doc["tensors"][&t]["pieces"][0]["file"] = name.into();
        });
        refused(&d, &["metadata.json", "not a plain file name"]);
    }
    // A piece claiming 2^36 rows of a tensor declared that large.
    let d = fresh("rows");
    resign(&meta(&d), |doc| {
        let t = first_tensor(doc);
        let cols = doc["tensors"][&t]["shape"][1].as_u64().unwrap();
        doc["tensors"][&t]["shape"][0] = (1u64 << 36).into();
        doc["tensors"][&t]["pieces"] = serde_json::json!([{
            "file": "rank_0.safetensors", "rows": [0u64, 1u64 << 36], "offset": 0,
            "bytes": (1u64 << 36) * cols * 4, "crc32": 0
        }]);
    });
    refused(&d, &["metadata.json", "reach past the end"]);
    // A tensor of 2^20 x 2^20 whose pieces cover a few rows.
    let d = fresh("square");
    resign(&meta(&d), |doc| {
        let t = first_tensor(doc);
        doc["tensors"][&t]["shape"] = serde_json::json!([1u64 << 20, 1u64 << 20]);
    });
    refused(&d, &["metadata.json", "word_embeddings"]);
    // Rows x row length that wraps around 2^64.
    let d = fresh("wraps");
    resign(&meta(&d), |doc| {
        let t = first_tensor(doc);
        doc["tensors"][&t]["shape"] = serde_json::json!([1u64 << 62, 8]);
        doc["tensors"][&t]["pieces"][0]["rows"] = serde_json::json!([0, 1u64 << 62]);
    });
    refused(&d, &["metadata.json", "too large"]);
    // Two tensors claiming the same bytes (a merged file larger than the checkpoint).
    let d = fresh("overlap");
    resign(&meta(&d), |doc| {
        let names: Vec<String> = doc["tensors"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let a = doc["tensors"][&names[0]]["pieces"][0].clone();
        let b = &mut doc["tensors"][&names[1]]["pieces"][0];
        if b["bytes"] == a["bytes"] && b["file"] == a["file"] {
            b["offset"] = a["offset"].clone();
        } else {
            b["file"] = a["file"].clone();
            b["offset"] = a["offset"].clone();
        }
    });
    for e in load_errors(&d) {
        assert!(e.contains("metadata.json"), "{e}");
    }
}

#[test]
fn fifos_devices_and_edited_documents_are_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = |name: &str| -> PathBuf {
        let d = tmp.path().join(name).join("ck");
        saved(&d);
        d
    };
    // A FIFO in place of a shard: an error naming it at once (not a wait for a writer).
    let d = fresh("fifo");
    let shard = d.join("pytorch_model_fsdp_0/rank_1.safetensors");
    std::fs::remove_file(&shard).unwrap();
    common::mkfifo(&shard);
    let started = Instant::now();
    refused(&d, &["rank_1.safetensors", "FIFO"]);
    assert!(started.elapsed() < Duration::from_secs(20));

    // A device as a document.
    let d = fresh("device");
    std::fs::remove_file(d.join("fsdp_checkpoint.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", d.join("fsdp_checkpoint.json")).unwrap();
    for e in load_errors(&d) {
        assert!(
            e.contains("fsdp_checkpoint.json") && e.contains("a device"),
            "{e}"
        );
    }

    // Edited documents: the step, a parameter's step count, a scheduler's state.
    let d = fresh("edited");
    let doc = d.join("fsdp_checkpoint.json");
    let text = std::fs::read_to_string(&doc).unwrap();
    std::fs::write(&doc, text.replace("\"step\": 1", "\"step\": 5")).unwrap();
    for e in load_errors(&d) {
        assert!(
            e.contains("fsdp_checkpoint.json") && e.contains("checksum"),
            "{e}"
        );
    }
    let d = fresh("edited_steps");
    let opt = d.join("optimizer_0/metadata.json");
    let text = std::fs::read_to_string(&opt).unwrap();
    let edited = text.replacen(": 1,", ": 18446744073709551615,", 1);
    assert_ne!(edited, text);
    std::fs::write(&opt, edited).unwrap();
    for e in load_errors(&d) {
        assert!(
            e.contains("optimizer_0/metadata.json") && e.contains("checksum"),
            "{e}"
        );
    }
    let d = fresh("edited_scheduler");
    std::fs::write(d.join("scheduler_0.json"), "{\"last_step\": 7}").unwrap();
    for e in load_errors(&d) {
        assert!(
            e.contains("scheduler_0.json") && e.contains("checksum"),
            "{e}"
        );
    }
}

#[test]
fn version_one_checkpoints_without_checksums_still_load() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("v1");
    saved(&d);
    // Written as version 1 was: no checksum fields, no list of documents.
    for path in [
        d.join("fsdp_checkpoint.json"),
        d.join("pytorch_model_fsdp_0/metadata.json"),
        d.join("optimizer_0/metadata.json"),
    ] {
        let mut doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let map = doc.as_object_mut().unwrap();
        map.remove("crc32");
        map.remove("documents");
        map.insert("version".into(), 1.into());
        std::fs::write(&path, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
    }
    assert_eq!(load_errors(&d), ["", ""]);
    // A version-2 document without its checksum is refused.
    let path = d.join("fsdp_checkpoint.json");
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    doc["version"] = 2.into();
    std::fs::write(&path, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
    for e in load_errors(&d) {
        assert!(e.contains("no `crc32` field"), "{e}");
    }
}

/// AdamW over the tiny model's parameters in two groups: `no_decay` picks the second, with
/// weight decay 0 (the first gets `base`'s).
fn grouped(
    t: &Trainer,
    base: fsdp::optim::AdamWConfig,
    no_decay: impl Fn(&str) -> bool,
) -> Box<dyn fsdp::optim::Optimizer> {
    let names = fsdp::nn::Module::info(&t.model)
        .all_params()
        .into_iter()
        .map(|p| p.name.clone())
        .collect::<Vec<_>>();
    Box::new(
        fsdp::optim::AdamW::with_groups(fsdp::optim::split_no_decay(names, base, no_decay))
            .unwrap(),
    )
}

#[test]
fn optimizer_groups_must_match_on_load_and_their_saved_settings_come_back() {
    use fsdp::optim::{AdamWConfig, is_bias_or_norm};
    let saved_with = AdamWConfig {
        lr: 3e-3,
        ..Default::default()
    };
    let other = AdamWConfig {
        lr: 1e-2,
        betas: (0.8, 0.9),
        weight_decay: 0.5,
        ..Default::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let results = on_threads(2, {
        let dir = dir.clone();
        move |g| {
            let run = |t: &mut Trainer, steps| t.train(steps);
            // The uninterrupted run: 4 steps in two groups (decay on weights, none on biases and
            // LayerNorm weights), saved after 2.
            let mut t = Trainer::new(g.clone(), sharded());
            t.optimizer = grouped(&t, saved_with, is_bias_or_norm);
            run(&mut t, 0..2);
            t.save_state(&dir, &RunState::default()).unwrap();
            let straight = run(&mut t, 2..4);
            let saved_settings: Vec<_> = (0..2).map(|i| t.optimizer.group_settings(i)).collect();

            // Groups of other sizes (one parameter, then the rest): refused, nothing changed.
            let mut fresh = Trainer::new(g.clone(), sharded());
            let first = fsdp::nn::Module::info(&fresh.model).all_params()[0]
                .name
                .clone();
            fresh.optimizer = grouped(&fresh, other, move |n| n != first);
            let before: Vec<_> = (0..2).map(|i| fresh.optimizer.group_settings(i)).collect();
            let refused = fresh.load_state(&dir).unwrap_err().to_string();
            let after: Vec<_> = (0..2).map(|i| fresh.optimizer.group_settings(i)).collect();
            assert_eq!(before, after, "a refused load changes no setting");
            assert!(fresh.optimizer.state_names().is_empty(), "nor any state");

            // The same groups built with other settings: loaded, and the saved settings restored,
            // so the run continues exactly as the uninterrupted one.
            let mut resumed = Trainer::new(g.clone(), sharded());
            resumed.optimizer = grouped(&resumed, other, is_bias_or_norm);
            resumed.load_state(&dir).unwrap();
            let restored: Vec<_> = (0..2)
                .map(|i| resumed.optimizer.group_settings(i))
                .collect();
            let continued = run(&mut resumed, 2..4);
            (refused, straight, continued, saved_settings, restored)
        }
    });
    for (rank, (refused, straight, continued, saved, restored)) in results.iter().enumerate() {
        assert!(
            refused.contains("parameter group 0 holds")
                && refused.contains("parameter(s) in the checkpoint and")
                && refused.contains("is in group"),
            "rank {rank}: {refused}"
        );
        assert_eq!(restored, saved, "rank {rank}");
        assert_eq!(saved[1]["weight_decay"], 0.0);
        assert_eq!(saved[0]["weight_decay"], 0.01);
        assert_eq!(saved[0]["betas"], serde_json::json!([0.9, 0.999]));
        assert_eq!(
            continued, straight,
            "rank {rank}: bitwise the uninterrupted run"
        );
    }

    // Saved settings a group refuses (a negative rate in group 1): an error naming the group,
    // and group 0, restored first, gets its own settings back.
    let meta = dir.join("optimizer_0/metadata.json");
    let rewrite = |edit: &dyn Fn(&mut checkpoint::format::OptimizerDoc)| {
        let mut doc: checkpoint::format::FolderDoc =
            checkpoint::format::read_document(&meta).unwrap();
        edit(doc.optimizer.as_mut().unwrap());
        std::fs::write(&meta, checkpoint::format::document_bytes(&doc).unwrap()).unwrap();
    };
    let load_into_other = |dir: PathBuf| {
        on_threads(2, move |g| {
            let mut t = Trainer::new(g, sharded());
            t.optimizer = grouped(&t, other, is_bias_or_norm);
            let loaded = t.load_state(&dir).map(|_| ());
            (
                loaded.map_err(|e| e.to_string()),
                t.optimizer.group_settings(0)["weight_decay"].clone(),
            )
        })
    };
    rewrite(&|o| o.groups[1].settings["lr"] = serde_json::json!(-1.0));
    for (loaded, decay) in load_into_other(dir.clone()) {
        let e = loaded.unwrap_err();
        assert!(
            e.contains("the saved settings of parameter group 1") && e.contains("learning rate -1"),
            "{e}"
        );
        assert_eq!(decay, 0.5, "group 0 keeps its settings");
    }
    // A checkpoint from before groups were recorded: checked by count only, settings kept.
    rewrite(&|o| o.groups.clear());
    for (loaded, decay) in load_into_other(dir.clone()) {
        loaded.unwrap();
        assert_eq!(decay, 0.5);
    }
}

#[test]
fn an_accelerate_checkpoint_of_another_optimizer_grouping_or_model_is_refused_before_anything_loads()
 {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/accelerate_resume/fsdp1/checkpoint");
    let outcomes = on_threads(2, move |g| {
        let mut t = Trainer::new(g.clone(), sharded());
        let before = t.weights();
        let mut errors = Vec::new();
        // One group where the run had two (decay, no decay).
        let mut one_group = fsdp::optim::AdamW::new(Default::default()).unwrap();
        errors.push(
            fsdp::checkpoint::load_state(
                &dir,
                &mut [&mut t.engine],
                &mut [&mut one_group],
                &Default::default(),
            )
            .unwrap_err()
            .to_string(),
        );
        // Two groups of SGD for AdamW's state.
        let names: Vec<String> = t
            .engine
            .parameters()
            .into_iter()
            .map(|(n, _)| n.into())
            .collect();
        let mut sgd = fsdp::optim::Sgd::with_groups(fsdp::optim::split_no_decay(
            names,
            fsdp::optim::SgdConfig::default(),
            fsdp::optim::is_bias_or_norm,
        ))
        .unwrap();
        errors.push(
            fsdp::checkpoint::load_state(
                &dir,
                &mut [&mut t.engine],
                &mut [&mut sgd],
                &Default::default(),
            )
            .unwrap_err()
            .to_string(),
        );
        let unchanged = t.weights() == before;
        // Another model: a vocabulary of 40 instead of 37.
        let model = fsdp::models::BertForSequenceClassification::new(fsdp::models::BertConfig {
            vocab_size: 40,
            hidden_size: 12,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            intermediate_size: 20,
            max_position_embeddings: 8,
            num_labels: 3,
            ..Default::default()
        })
        .unwrap();
        use fsdp::nn::Module;
        let init = fsdp::nn::LocalParams::init(
            &model.info(),
            1,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let plugin = fsdp::config::FsdpPlugin::builder()
            .resolve(&fsdp::config::Layer::new(), None)
            .unwrap()
            .fsdp;
        let mut other = fsdp::engine::Fsdp::wrap(&model, &init.tensors(), &plugin, g).unwrap();
        errors.push(
            fsdp::checkpoint::load_state(
                &dir,
                &mut [&mut other],
                &mut [t.optimizer.as_mut()],
                &Default::default(),
            )
            .unwrap_err()
            .to_string(),
        );
        (errors, unchanged)
    });
    for (rank, (errors, unchanged)) in outcomes.iter().enumerate() {
        assert!(
            errors[0].contains("2 parameter group(s) in the checkpoint, 1 in the optimizer"),
            "rank {rank}: {}",
            errors[0]
        );
        assert!(
            errors[1].contains("holds AdamW state; the optimizer is SGD"),
            "rank {rank}: {}",
            errors[1]
        );
        assert!(
            errors[2].contains("bert.embeddings.word_embeddings.weight")
                && errors[2].contains("[37, 12]")
                && errors[2].contains("[40, 12]"),
            "rank {rank}: {}",
            errors[2]
        );
        assert!(unchanged, "rank {rank}: a refused load changed the weights");
    }
}

/// Every rank's save of one step of training to `dir` cut and written as `options` say.
fn saved_as(dir: &Path, options: CheckpointOptions) {
    let dir = dir.to_path_buf();
    for r in on_threads(2, move |g| {
        let rank = g.rank();
        let mut t = Trainer::new(g, sharded());
        t.train(0..1);
        checkpoint::save_state(
            &dir,
            &[&t.engine],
            &[t.optimizer.as_ref()],
            &run_state(1, rank),
            &options,
        )
        .map_err(|e| e.to_string())
    }) {
        r.unwrap();
    }
}

/// Every file under `root` with its size and checksum, for "nothing was touched".
fn tree(root: &Path) -> Vec<(PathBuf, usize, u32)> {
    let mut out = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(d) = pending.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                pending.push(e.path());
            } else {
                let bytes = std::fs::read(e.path()).unwrap_or_default();
                out.push((e.path(), bytes.len(), crc32fast::hash(&bytes)));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn removing_a_checkpoint_removes_only_what_its_save_wrote() {
    let tmp = tempfile::tempdir().unwrap();
    // Every cut and file format lists all its files: each is removed whole when untouched.
    for (name, state_dict_type, format) in [
        (
            "sharded",
            StateDictType::ShardedStateDict,
            CheckpointFormat::FsdpRs,
        ),
        (
            "full",
            StateDictType::FullStateDict,
            CheckpointFormat::FsdpRs,
        ),
        (
            "local",
            StateDictType::LocalStateDict,
            CheckpointFormat::FsdpRs,
        ),
        (
            "dcp",
            StateDictType::ShardedStateDict,
            CheckpointFormat::TorchDcp,
        ),
    ] {
        let dir = tmp.path().join(name);
        let options = CheckpointOptions {
            state_dict_type: Some(state_dict_type),
            format: Some(format),
            ..Default::default()
        };
        saved_as(&dir, options.clone());
        // A save over it replaces it (the manifest proves it is ours).
        saved_as(&dir, options);
        checkpoint::remove_checkpoint(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!dir.exists(), "{name}");
    }

    let ckpt = tmp.path().join("step_1");
    saved(&ckpt);
    // Its model folder alone: refused, the checkpoint would name a missing folder.
    let e = checkpoint::remove_checkpoint(&ckpt.join("pytorch_model_fsdp_0"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("inside the checkpoint") && e.contains("nothing was removed"),
        "{e}"
    );
    // A user's file anywhere inside, an edited file, a user's folder: refused, naming it,
    // and nothing at all removed.
    let before = tree(&ckpt);
    for (what, add, needle) in [
        ("file", "optimizer_0/mine.txt", "optimizer_0/mine.txt"),
        ("file", "notes.md", "notes.md"),
        (
            "folder",
            "pytorch_model_fsdp_0/sub/x",
            "pytorch_model_fsdp_0/sub",
        ),
    ] {
        let path = ckpt.join(add);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "the user's").unwrap();
        let e = checkpoint::remove_checkpoint(&ckpt)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(needle) && e.contains("nothing was removed"),
            "{what}: {e}"
        );
        let mut now = tree(&ckpt);
        now.retain(|(p, _, _)| p != &path);
        assert_eq!(now, before, "{what}: something was removed");
        std::fs::remove_file(&path).unwrap();
        if path.parent().unwrap().ends_with("sub") {
            std::fs::remove_dir(path.parent().unwrap()).unwrap();
        }
    }
    let shard = ckpt.join("pytorch_model_fsdp_0/rank_1.safetensors");
    let original = std::fs::read(&shard).unwrap();
    let mut edited = original.clone();
    *edited.last_mut().unwrap() ^= 1;
    std::fs::write(&shard, &edited).unwrap();
    let e = checkpoint::remove_checkpoint(&ckpt)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank_1.safetensors") && e.contains("changed after the save"),
        "{e}"
    );
    std::fs::write(&shard, &original).unwrap();
    // A folder that only holds a document of our name is no checkpoint of ours.
    let user = tmp.path().join("user");
    std::fs::create_dir(&user).unwrap();
    std::fs::write(user.join(format::CHECKPOINT_FILE), "{}").unwrap();
    std::fs::write(user.join("precious.txt"), "precious").unwrap();
    let e = checkpoint::remove_checkpoint(&user)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot be trusted"), "{e}");
    assert_eq!(entries(&user), ["fsdp_checkpoint.json", "precious.txt"]);
    checkpoint::remove_checkpoint(&ckpt).unwrap();
    assert!(!ckpt.exists());
}

#[test]
fn overwriting_an_output_folder_removes_only_checkpoints_and_never_a_users_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut acc = fsdp::accelerator::Accelerator::new().unwrap();
    let (mut model, mut opt) = common::tiny::prepare_with_sgd(&mut acc);
    common::tiny::accelerator_step(&mut acc, &mut model, &mut opt, 0);
    for step in ["step_1", "step_2"] {
        acc.save_state(
            Some(&out.join(step)),
            &[&model],
            &[&opt],
            Default::default(),
        )
        .unwrap();
    }
    // The run holds the folder (what claim_output_dir does first).
    acc.lock_output_dir(&out).unwrap();
    // A user's folder that merely holds files of our documents' names (any content).
    let user = out.join("my_notes");
    std::fs::create_dir_all(&user).unwrap();
    std::fs::write(user.join(format::CHECKPOINT_FILE), "{\"mine\": true}").unwrap();
    std::fs::write(user.join(format::RUN_STATE_FILE), "{}").unwrap();
    std::fs::write(user.join("thesis.tex"), "years of work").unwrap();
    let before = tree(&out);
    let e = acc.claim_output_dir(&out, true).unwrap_err().to_string();
    assert!(
        e.contains("my_notes") && e.contains("nothing was removed"),
        "{e}"
    );
    assert_eq!(tree(&out), before, "something was removed");
    std::fs::remove_dir_all(&user).unwrap();
    // A user's file inside one of the checkpoints: refused too, naming it.
    std::fs::write(out.join("step_2/optimizer_0/notes.txt"), "mine").unwrap();
    let before = tree(&out);
    let e = acc.claim_output_dir(&out, true).unwrap_err().to_string();
    assert!(e.contains("step_2/optimizer_0/notes.txt"), "{e}");
    assert_eq!(tree(&out), before, "something was removed");
    std::fs::remove_file(out.join("step_2/optimizer_0/notes.txt")).unwrap();
    // Without it both checkpoints go, and what else the folder holds stays.
    std::fs::write(out.join("README.md"), "mine").unwrap();
    acc.claim_output_dir(&out, true).unwrap();
    assert_eq!(entries(&out), [".fsdp_run.lock", "README.md"]);
}

#[test]
fn every_checkpoint_of_a_run_with_a_schedule_loads() {
    // Learning rates of a linear schedule (nlp_example's checkpoints at steps 4 and 8 were
    // refused: 1.8181818181818182e-05 parsed one ULP off failed the document's checksum)
    // and one that was found refused by itself.
    let schedule = fsdp::optim::LrSchedule::Linear {
        warmup: 1,
        total: 11,
    };
    let mut lrs: Vec<f64> = (0..10).map(|s| schedule.lr(5e-5, s)).collect();
    lrs.push(0.00018749999999999998);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let rates = lrs.clone();
    on_threads(2, move |g| {
        let rank = g.rank();
        let mut t = Trainer::new(g, sharded());
        for (step, lr) in rates.iter().enumerate() {
            t.optimizer.set_lr(0, *lr).unwrap();
            t.train(step..step + 1);
            t.save_state(
                &root.join(format!("step_{step}")),
                &run_state(step as u64, rank),
            )
            .unwrap();
        }
    });
    for (step, lr) in lrs.iter().enumerate() {
        let dir = tmp.path().join(format!("step_{step}"));
        let got = on_threads(2, move |g| {
            let mut t = Trainer::new(g, sharded());
            let run = t.load_state(&dir);
            run.map(|r| (r.step, t.optimizer.lr(0)))
                .map_err(|e| e.to_string())
        });
        for r in got {
            assert_eq!(r, Ok((step as u64, *lr)), "step {step}");
        }
    }
}
