//! Checkpoints written as PyTorch distributed checkpoints (`fsdp_checkpoint_format:
//! torch-dcp`), across real processes: a run that came from PyTorch + Accelerate, trained
//! here and saved as DCP, resumes here exactly and continues in PyTorch + Accelerate as it
//! does here (`tools/make_accelerate_roundtrip_fixture.py` recorded PyTorch's continuation
//! from the very files this test writes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fsdp::checkpoint::{CheckpointOptions, RunState};
use fsdp::config::{CheckpointFormat, ShardingStrategy, StateDictType};
use fsdp_comm::ProcessGroup;

use crate::common;
use crate::common::tiny::{OptimizerKind, Setup, Trainer, pytorch_fixture_adamw};

const ROLE: &str = "FSDP_TORCH_DCP_WORKER";

/// The fixtures: Accelerate's checkpoint after 3 steps (from `make_accelerate_resume_fixture.py`)
/// and PyTorch's continuation of our DCP checkpoint after step 6.
fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// The worker: `FSDP_DCP_MODE` is `from-accelerate` (load Accelerate's checkpoint of step 3
/// from `FSDP_DCP_FROM`, train to step 6, save as DCP to `FSDP_DCP_DIR`, train on to 9) or
/// `resume` (load `FSDP_DCP_DIR`, train steps 6 to 9). With `FSDP_DCP_ASYNC_DIR`,
/// `from-accelerate` also saves asynchronously there while steps 7-9 train.
#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn torch_dcp_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let mode = std::env::var("FSDP_DCP_MODE").unwrap();
    let dir = PathBuf::from(std::env::var("FSDP_DCP_DIR").unwrap());
    let pg = std::sync::Arc::new(ProcessGroup::from_env().unwrap());
    let mut t = Trainer::new(
        pg.clone(),
        Setup {
            strategy: ShardingStrategy::FullShard,
            state_dict_type: StateDictType::ShardedStateDict,
            optimizer: OptimizerKind::AdamW,
            dropout: 0.0,
        },
    );
    t.optimizer = pytorch_fixture_adamw(&t.engine);
    let mut losses = Vec::new();
    match mode.as_str() {
        "from-accelerate" => {
            let from = PathBuf::from(std::env::var("FSDP_DCP_FROM").unwrap());
            assert_eq!(t.load_state(&from).unwrap().step, 3);
            losses.extend(t.train(3..6));
            let options = CheckpointOptions {
                format: Some(CheckpointFormat::TorchDcp),
                ..Default::default()
            };
            // A constant schedule's state, which PyTorch reads as a LambdaLR's.
            let run = RunState {
                step: 6,
                data: serde_json::json!({"epoch": 0, "batch": 6}),
                schedulers: vec![serde_json::json!({"schedule": "Constant", "steps": 6})],
                ..Default::default()
            };
            let saved = fsdp::checkpoint::save_state(
                &dir,
                &[&t.engine],
                &[t.optimizer.as_ref()],
                &run,
                &options,
            )
            .unwrap();
            assert_eq!(saved, dir);
            // The same state saved asynchronously while steps 7-9 train.
            let pending = match std::env::var("FSDP_DCP_ASYNC_DIR") {
                Ok(d) => Some(
                    fsdp::checkpoint::save_state_async(
                        Path::new(&d),
                        &[&t.engine],
                        &[t.optimizer.as_ref()],
                        &run,
                        &options,
                    )
                    .unwrap(),
                ),
                Err(_) => None,
            };
            losses.extend(t.train(6..9));
            if let Some(p) = pending {
                p.wait().unwrap();
            }
        }
        "resume" => {
            let run = t.load_state(&dir).unwrap();
            assert_eq!(run.step, 6, "the step the run state records");
            assert_eq!(run.data, serde_json::json!({"epoch": 0, "batch": 6}));
            assert_eq!(run.schedulers[0]["steps"], 6);
            losses.extend(t.train(6..9));
        }
        other => panic!("unknown mode {other}"),
    }
    t.print_result(pg.as_ref(), losses);
}

fn run(world: usize, mode: &str, dir: &Path) -> serde_json::Value {
    run_with(world, mode, dir, &[])
}

#[track_caller]
fn run_with(world: usize, mode: &str, dir: &Path, more: &[(&str, &str)]) -> serde_json::Value {
    let from = fixtures().join("accelerate_resume/fsdp2/checkpoint");
    let mut env = vec![
        ("FSDP_DCP_MODE", mode),
        ("FSDP_DCP_DIR", dir.to_str().unwrap()),
        ("FSDP_DCP_FROM", from.to_str().unwrap()),
    ];
    env.extend_from_slice(more);
    let outputs = common::run_workers(
        "torch_dcp_worker",
        ROLE,
        world,
        &env,
        Duration::from_secs(120),
    );
    common::result_of(&outputs[0])
}

/// Every file of the checkpoint at `dir` with its length and CRC-32 (names relative to
/// `dir`).
fn digests(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let name = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
            let bytes = std::fs::read(&p).unwrap();
            let crc = crc32fast::hash(&bytes);
            out.insert(name, format!("{} bytes, crc32 {crc:08x}", bytes.len()));
        }
    }
    out
}

/// Rank 0's weights as name → values.
fn weights_of(r: &serde_json::Value) -> BTreeMap<String, Vec<f32>> {
    serde_json::from_value(r["weights"].clone()).unwrap()
}

/// The largest difference of `got` from `want`, relative to max(1, |want|).
fn worst(got: &BTreeMap<String, Vec<f32>>, want: &BTreeMap<String, Vec<f32>>) -> f32 {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    let mut worst = 0f32;
    for (name, g) in got {
        for (a, b) in g.iter().zip(&want[name]) {
            worst = worst.max((a - b).abs() / b.abs().max(1.0));
        }
    }
    worst
}

#[test]
fn a_run_saved_as_dcp_resumes_here_exactly_and_continues_in_pytorch_as_it_does_here() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ours_at_step_6");
    let async_dir = tmp.path().join("async");
    let async_path = async_dir.to_str().unwrap();
    let straight = run_with(
        2,
        "from-accelerate",
        &dir,
        &[("FSDP_DCP_ASYNC_DIR", async_path)],
    );

    // The files are the ones PyTorch + Accelerate loaded when the fixture was made.
    let roundtrip = fixtures().join("accelerate_roundtrip");
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(roundtrip.join("expected.json")).unwrap())
            .unwrap();
    // Our run state (`fsdp_run_state.json`) is read by fsdp-rs only; it now also lists
    // every file with its checksum, which the recorded digest predates. The tensors' bytes
    // are those of steps 4-6 trained here, which round differently where the CPU's vector
    // instructions differ from the recording machine's (AVX2 against AVX-512): their files
    // must match in size (the same layout), the rest byte for byte; the values are checked
    // below, against PyTorch's continuation from them.
    let ours_only = |files: BTreeMap<String, String>| -> BTreeMap<String, String> {
        files
            .into_iter()
            .filter(|(name, _)| name != fsdp::checkpoint::format::RUN_STATE_FILE)
            .map(|(name, digest)| match name.ends_with(".distcp") {
                true => {
                    let size = digest.split(',').next().unwrap_or_default().to_string();
                    (name, size)
                }
                false => (name, digest),
            })
            .collect()
    };
    let recorded_files: BTreeMap<String, String> =
        serde_json::from_value(recorded["files"].clone()).unwrap();
    assert_eq!(
        ours_only(digests(&dir)),
        ours_only(recorded_files),
        "the DCP files written differ from those PyTorch read: rerun tools/make_accelerate_roundtrip_fixture.py"
    );
    assert_eq!(
        digests(&async_dir),
        digests(&dir),
        "an asynchronous save writes the same files"
    );
    for folder in ["pytorch_model_fsdp_0", "optimizer_0"] {
        assert!(dir.join(folder).join(".metadata").is_file());
        assert!(dir.join(folder).join("__0_0.distcp").is_file());
        assert!(dir.join(folder).join("__1_0.distcp").is_file());
    }

    // Same size: bitwise the run that never stopped.
    let resumed = run(2, "resume", &dir);
    assert_eq!(
        resumed["losses"].as_array().unwrap()[..],
        straight["losses"].as_array().unwrap()[3..]
    );
    assert_eq!(resumed["weights"], straight["weights"]);

    // Another size: the rows reshard.
    let three = run(3, "resume", &dir);
    let w = weights_of(&three);
    assert!(worst(&w, &weights_of(&straight)) < 1e-6);

    // PyTorch + Accelerate continued from these files as we do: FSDP2 at every step and in
    // the final weights, and as PyTorch alone did. FSDP1's `load_state` drops the optimizer
    // state (of its own checkpoints too; the fixture records it), so only its first step,
    // which depends on the weights alone, can agree.
    let close = |got: &[serde_json::Value], want: &[serde_json::Value], what: &str| {
        for (step, (g, p)) in got.iter().zip(want).enumerate() {
            let (g, p) = (g.as_f64().unwrap(), p.as_f64().unwrap());
            assert!(
                (g - p).abs() < 1e-6,
                "{what}, step {}: loss {g} here, {p} in PyTorch",
                step + 7
            );
        }
    };
    let ours = resumed["losses"].as_array().unwrap();
    let fsdp2 = recorded["fsdp2"]["losses"].as_array().unwrap();
    close(ours, fsdp2, "FSDP2");
    let alone = recorded["pytorch_alone"]["losses"].as_array().unwrap();
    close(ours, &alone[6..], "PyTorch alone");
    close(
        &ours[..1],
        &recorded["fsdp1"]["losses"].as_array().unwrap()[..1],
        "FSDP1",
    );
    assert_eq!(recorded["fsdp1"]["rank0_params_with_state_after_load"], 0);
    let final_weights: BTreeMap<String, Vec<f32>> = candle_core::safetensors::load(
        roundtrip.join("fsdp2/final.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap()
    .into_iter()
    .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap()))
    .collect();
    let d = worst(&weights_of(&resumed), &final_weights);
    eprintln!("FSDP2: final weights within {d:e} of PyTorch's");
    assert!(d < 1e-5, "FSDP2: final weights differ by {d}");
}

/// What `tools/make_accelerate_roundtrip_fixture.py` runs to get the checkpoint it gives
/// PyTorch: the DCP checkpoint of step 6 written into `FSDP_DCP_FIXTURE_OUT`.
#[test]
#[ignore = "run by tools/make_accelerate_roundtrip_fixture.py"]
fn writes_the_checkpoint_for_the_roundtrip_fixture() {
    let out = std::env::var("FSDP_DCP_FIXTURE_OUT").expect("FSDP_DCP_FIXTURE_OUT");
    let r = run(2, "from-accelerate", Path::new(&out));
    println!("OURS {}", serde_json::json!({"losses": r["losses"]}));
}

/// A `torch.save` file of a scheduler state `{"base_lrs": base_lrs, "last_epoch": steps}`.
fn scheduler_state(base_lrs: &[f64], steps: u8) -> Vec<u8> {
    use std::io::Write;
    let text = |s: &str| {
        let mut b = vec![b'X'];
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
        b
    };
    let mut pkl = vec![0x80, 2, b'}', b'('];
    pkl.extend(text("base_lrs"));
    pkl.extend([b']', b'(']);
    for lr in base_lrs {
        pkl.push(b'G');
        pkl.extend_from_slice(&lr.to_be_bytes());
    }
    pkl.push(b'e');
    pkl.extend(text("last_epoch"));
    pkl.extend([b'K', steps, b'u', b'.']);
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in [("archive/data.pkl", &pkl[..]), ("archive/version", b"3\n")] {
        zip.start_file(name, stored).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap().into_inner()
}

/// An accelerator in this process that saves as DCP, with the tiny model, AdamW at `lr` and,
/// when `schedule`, a linear schedule (warmup 2 of 10 steps).
fn dcp_accelerator(
    lr: f64,
    schedule: bool,
) -> (
    fsdp::accelerator::Accelerator,
    fsdp::accelerator::PreparedModel<fsdp::models::BertForSequenceClassification>,
    fsdp::accelerator::PreparedOptimizer,
) {
    use fsdp::nn::Module;
    let plugin = fsdp::config::FsdpPlugin::builder().checkpoint_format(CheckpointFormat::TorchDcp);
    let mut acc = fsdp::accelerator::Accelerator::builder()
        .fsdp_plugin(plugin)
        .build()
        .unwrap();
    let m = common::tiny::model(0.0);
    let w = fsdp::nn::LocalParams::init(
        &m.info(),
        1,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap()
    .tensors();
    let model = acc.prepare_model(m, &w).unwrap();
    let adamw = fsdp::optim::AdamWConfig {
        lr,
        ..Default::default()
    };
    let mut opt = acc
        .prepare_optimizer(fsdp::optim::AdamW::new(adamw).unwrap())
        .unwrap();
    if schedule {
        let linear = fsdp::optim::LrSchedule::Linear {
            warmup: 2,
            total: 10,
        };
        acc.prepare_scheduler(&mut opt, linear).unwrap();
    }
    (acc, model, opt)
}

#[test]
fn an_accelerator_set_to_torch_dcp_resumes_its_schedule_here_and_from_pytorchs_scheduler_state() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (mut acc, mut model, mut opt) = dcp_accelerator(1e-3, true);
    for step in 0..3 {
        common::tiny::accelerator_step(&mut acc, &mut model, &mut opt, step);
    }
    acc.save_state(Some(&dir), &[&model], &[&opt], Default::default())
        .unwrap();
    for f in [
        "pytorch_model_fsdp_0/.metadata",
        "pytorch_model_fsdp_0/__0_0.distcp",
        "optimizer_0/.metadata",
        "optimizer_0/__0_1.distcp",
        "scheduler.bin",
        "fsdp_run_state.json",
    ] {
        assert!(dir.join(f).is_file(), "{f} written");
    }
    assert!(!dir.join("fsdp_checkpoint.json").exists());
    let next_lr = opt.scheduler().unwrap().next_lr(opt.optimizer(), 0);
    common::tiny::accelerator_step(&mut acc, &mut model, &mut opt, 3);
    let straight = acc.get_state_dict(&model).unwrap().unwrap();

    // Resumed here: the run state is ours, the step and schedule exact.
    let resume = |dir: &Path| {
        let (mut acc, mut model, mut opt) = dcp_accelerator(1e-3, true);
        acc.load_state(dir, &mut [&mut model], &mut [&mut opt])
            .unwrap();
        assert_eq!(opt.scheduler().unwrap().steps, 3);
        assert_eq!(
            opt.scheduler().unwrap().next_lr(opt.optimizer(), 0),
            next_lr
        );
        common::tiny::accelerator_step(&mut acc, &mut model, &mut opt, 3);
        let w = acc.get_state_dict(&model).unwrap().unwrap();
        for (name, t) in &straight {
            assert_eq!(common::max_abs_diff(t, &w[name]), 0.0, "{name}");
        }
        acc.step()
    };
    assert_eq!(resume(&dir), 4);
    assert!(
        fsdp::checkpoint::latest_checkpoint(tmp.path())
            .unwrap()
            .is_some_and(|(p, step)| p == dir && step == 3),
        "a DCP checkpoint of ours is a candidate to resume from"
    );

    // Without our run state it is what Accelerate would have written: the step comes from
    // PyTorch's scheduler state (`scheduler.bin`'s last_epoch) into the schedule given.
    let pytorch = tmp.path().join("as_accelerate");
    std::fs::create_dir(&pytorch).unwrap();
    for sub in ["pytorch_model_fsdp_0", "optimizer_0"] {
        std::fs::create_dir(pytorch.join(sub)).unwrap();
        for e in std::fs::read_dir(dir.join(sub)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), pytorch.join(sub).join(e.file_name())).unwrap();
        }
    }
    std::fs::copy(dir.join("scheduler.bin"), pytorch.join("scheduler.bin")).unwrap();
    resume(&pytorch);

    // A scheduler state with nothing to restore it into, or of other base rates: errors
    // naming the file.
    let (mut acc, mut model, mut opt) = dcp_accelerator(1e-3, false);
    let err = acc
        .load_state(&pytorch, &mut [&mut model], &mut [&mut opt])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("scheduler.bin") && err.contains("prepare_scheduler"),
        "{err}"
    );
    std::fs::write(pytorch.join("scheduler.bin"), scheduler_state(&[0.5], 3)).unwrap();
    let (mut acc, mut model, mut opt) = dcp_accelerator(1e-3, true);
    let err = acc
        .load_state(&pytorch, &mut [&mut model], &mut [&mut opt])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("scheduler.bin") && err.contains("base_lrs"),
        "{err}"
    );

    // A save replaces a DCP checkpoint of ours, never Accelerate's own (no run state of
    // ours); automatic naming rotates DCP checkpoints of ours like any other.
    acc.save_state(Some(&dir), &[&model], &[&opt], Default::default())
        .unwrap();
    let err = acc
        .save_state(Some(&pytorch), &[&model], &[&opt], Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not a checkpoint written by save_state"),
        "{err}"
    );
    assert!(pytorch.join("scheduler.bin").is_file(), "left as it was");
    let project = tmp.path().join("project");
    let rotating = CheckpointOptions {
        format: Some(CheckpointFormat::TorchDcp),
        automatic_naming: true,
        total_limit: Some(2),
        ..Default::default()
    };
    for _ in 0..3 {
        fsdp::checkpoint::save_state(
            &project,
            &[model.engine()],
            &[opt.optimizer()],
            &RunState::default(),
            &rotating,
        )
        .unwrap();
    }
    let mut kept: Vec<String> = std::fs::read_dir(project.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(kept, ["checkpoint_1", "checkpoint_2"]);

    // torch-dcp writes SHARDED_STATE_DICT only: another cut is refused before anything is
    // written.
    let local = tmp.path().join("local");
    let err = fsdp::checkpoint::save_state(
        &local,
        &[model.engine()],
        &[],
        &RunState::default(),
        &CheckpointOptions {
            state_dict_type: Some(StateDictType::LocalStateDict),
            format: Some(CheckpointFormat::TorchDcp),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("SHARDED_STATE_DICT checkpoints only"), "{err}");
    assert!(!local.exists());
}
