//! The `fsdp` binary as a user runs it: the questionnaire driven through piped input,
//! `config default`, `config update`, `env`, and the help texts.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use fsdp::config::{Choice, Layer, ResolvedConfig};

const GUIDE: &str = include_str!("../../fsdp/tests/data/accelerate_guide_fsdp.yaml");

/// `fsdp` with a private HOME, so no real config file is read or written.
fn fsdp(home: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fsdp"));
    cmd.env("HOME", home)
        .env_remove("FSDP_CONFIG_FILE")
        .env_remove("FSDP_HOME")
        .env_remove("HF_HOME")
        .env_remove("XDG_CACHE_HOME");
    for (var, _) in std::env::vars() {
        if var.starts_with("FSDP_") || var.starts_with("ACCELERATE_") {
            cmd.env_remove(var);
        }
    }
    cmd
}

fn run_with_input(mut cmd: Command, input: &str) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn resolved(path: &Path) -> ResolvedConfig {
    ResolvedConfig::resolve(&[&Layer::from_yaml_file(path).unwrap()]).unwrap()
}

/// Every key's resolved value, sources left out.
fn values(config: &ResolvedConfig) -> Vec<(String, String)> {
    config
        .iter()
        .map(|(k, s)| (k.name().to_string(), s.value.to_string()))
        .collect()
}

/// The answers that, asked in order, describe the Accelerate guide's FSDP example.
const GUIDE_ANSWERS: &[&str] = &[
    "3",  // multi-GPU
    "",   // one machine (default)
    "no", // no debug checks
    "",   // use FSDP (default yes)
    "1",  // FULL_SHARD
    "",   // no offload (default)
    "",   // no offload folder (default)
    "TRANSFORMER_BASED_WRAP",
    "no",        // not the model's default list
    "BertLayer", // class to wrap
    "1",         // BACKWARD_PRE
    "",          // SHARDED_STATE_DICT (default)
    "",          // fsdp-rs's checkpoint files (default)
    "",          // no forward prefetch (default)
    "yes",       // CPU RAM efficient loading
    "",          // no activation checkpointing (default)
    "",          // no trace folder (default)
    "2",         // two processes
    "",          // all GPUs
    "bf16",
];

#[test]
fn questionnaire_produces_the_guides_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out").join("config.yaml");
    let mut cmd = fsdp(dir.path());
    cmd.args(["config", "--config_file"]).arg(&path);
    let out = run_with_input(cmd, &(GUIDE_ANSWERS.join("\n") + "\n"));
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("What should be your sharding strategy?"),
        "{}",
        text(&out)
    );
    let guide_path = dir.path().join("guide.yaml");
    std::fs::write(&guide_path, GUIDE).unwrap();
    assert_eq!(values(&resolved(&path)), values(&resolved(&guide_path)));

    // Every key of the guide is written with the guide's value (the alias under its
    // canonical name); the file adds only the questions newer than the guide.
    let written = std::fs::read_to_string(&path).unwrap();
    let guide = GUIDE.replace("fsdp_backward_prefetch_policy", "fsdp_backward_prefetch");
    for line in guide.lines() {
        assert!(
            written.lines().any(|l| l == line),
            "missing {line:?} in:\n{written}"
        );
    }
    let extra: Vec<&str> = written
        .lines()
        .filter(|l| !guide.lines().any(|g| g == *l))
        .collect();
    assert_eq!(
        extra,
        [
            "  fsdp_activation_checkpointing: false",
            "  fsdp_checkpoint_format: fsdp-rs",
            "gpu_ids: all"
        ]
    );
}

#[test]
fn questionnaire_entered_through_writes_what_config_default_writes() {
    // Enter on every question: the defaults make a valid file (the model's own layer classes,
    // one process per core up to 2) with the values `fsdp config default` writes.
    let dir = tempfile::tempdir().unwrap();
    let (asked, default) = (
        dir.path().join("asked.yaml"),
        dir.path().join("default.yaml"),
    );
    let mut cmd = fsdp(dir.path());
    cmd.args(["config", "--config_file"]).arg(&asked);
    let out = run_with_input(cmd, &"\n".repeat(40));
    assert!(out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(
        !t.contains("offload parameters and gradients to CPU"),
        "a CPU job is not asked about host memory:\n{t}"
    );
    assert!(t.contains("(fsdp_offload_dir)"), "{t}");
    let out = fsdp(dir.path())
        .args(["config", "default", "--config_file"])
        .arg(&default)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(values(&resolved(&asked)), values(&resolved(&default)));

    // A folder for offloading on a CPU job: everything there, or the optimizer state only;
    // a trace folder.
    for (everything, params, optimizer) in [("", true, false), ("no", false, true)] {
        let path = dir.path().join(format!("offload{everything}.yaml"));
        let answers = [
            "",
            "",
            "",
            "",
            "",
            "/scratch/fsdp",
            everything,
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "target/trace",
            "",
            "",
        ];
        let mut cmd = fsdp(dir.path());
        cmd.args(["config", "--config_file"]).arg(&path);
        let out = run_with_input(cmd, &(answers.join("\n") + "\n"));
        assert!(out.status.success(), "{}", text(&out));
        let c = resolved(&path);
        assert_eq!(
            c.fsdp.offload_dir.as_deref(),
            Some(Path::new("/scratch/fsdp"))
        );
        assert_eq!(
            (c.fsdp.offload_params, c.fsdp.offload_optimizer),
            (params, optimizer)
        );
        assert_eq!(c.fsdp.trace_dir.as_deref(), Some(Path::new("target/trace")));
    }
}

#[test]
fn questionnaire_offers_zero_plus_plus_communication_to_jobs_across_machines() {
    // Multi-CPU on 2 machines (this one rank 0, the main process at 10.1.2.3), FSDP with the
    // default strategy, then the quantized-collectives question; Enter through the rest.
    let dir = tempfile::tempdir().unwrap();
    for (answer, gather, reduce) in [("yes", "int8", "int4"), ("", "auto", "fp32")] {
        let path = dir.path().join(format!("machines{answer}.yaml"));
        let answers = ["2", "2", "", "10.1.2.3", "", "", "", "", answer];
        let input = answers.join("\n") + &"\n".repeat(30);
        let mut cmd = fsdp(dir.path());
        cmd.args(["config", "--config_file"]).arg(&path);
        let out = run_with_input(cmd, &input);
        assert!(out.status.success(), "{}", text(&out));
        assert!(text(&out).contains("as int4 blocks"), "{}", text(&out));
        let c = resolved(&path);
        assert_eq!(c.launch.num_machines, 2);
        assert_eq!(
            (c.fsdp.all_gather_dtype.name(), c.fsdp.reduce_dtype.name()),
            (gather, reduce),
            "answer {answer:?}"
        );
    }
    // With 4 processes on the 2 machines, FULL_SHARD is offered a secondary partition of each
    // machine's 2 (after the 11 remaining FSDP questions and the number of processes).
    for (answer, hpz) in [("yes", 2), ("", 0)] {
        let path = dir.path().join(format!("hpz{answer}.yaml"));
        let mut answers = vec!["2", "2", "", "10.1.2.3", "", "", "", "", ""];
        answers.extend([""; 11]);
        answers.extend(["4", answer]);
        let input = answers.join("\n") + &"\n".repeat(10);
        let mut cmd = fsdp(dir.path());
        cmd.args(["config", "--config_file"]).arg(&path);
        let out = run_with_input(cmd, &input);
        assert!(out.status.success(), "{}", text(&out));
        assert!(
            text(&out).contains("fsdp_hpz_partition_size: 2"),
            "{}",
            text(&out)
        );
        let c = resolved(&path);
        assert_eq!(c.launch.num_processes, 4);
        assert_eq!(c.fsdp.hpz_partition_size, hpz, "answer {answer:?}");
    }
    // One machine is not asked.
    let mut cmd = fsdp(dir.path());
    cmd.args(["config", "--config_file"])
        .arg(dir.path().join("one.yaml"));
    let out = run_with_input(cmd, &"\n".repeat(40));
    assert!(out.status.success(), "{}", text(&out));
    assert!(!text(&out).contains("as int4 blocks"), "{}", text(&out));
    assert!(!text(&out).contains("hpz"), "{}", text(&out));
}

#[test]
fn questionnaire_rejects_bad_answers_and_never_hangs_on_short_input() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    let mut answers: Vec<&str> = GUIDE_ANSWERS.to_vec();
    answers.insert(17, "zero"); // not a number: asked again
    let mut cmd = fsdp(dir.path());
    cmd.args(["config", "--config_file"]).arg(&path);
    let out = run_with_input(cmd, &(answers.join("\n") + "\n"));
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("`zero` is not valid: expected a whole number from 1"),
        "{}",
        text(&out)
    );

    let mut cmd = fsdp(dir.path());
    cmd.args(["config", "--config_file"])
        .arg(dir.path().join("never.yaml"));
    let out = run_with_input(cmd, "3\n\n");
    assert!(!out.status.success());
    assert!(
        text(&out).contains("input ended before the question"),
        "{}",
        text(&out)
    );
    assert!(!dir.path().join("never.yaml").exists());

    // Answers that make an invalid whole (HYBRID on one machine) are refused, nothing written.
    let mut hybrid = GUIDE_ANSWERS.to_vec();
    hybrid[4] = "HYBRID_SHARD";
    let mut cmd = fsdp(dir.path());
    cmd.args(["config", "--config_file"])
        .arg(dir.path().join("hybrid.yaml"));
    let out = run_with_input(cmd, &(hybrid.join("\n") + "\n"));
    assert!(!out.status.success());
    assert!(text(&out).contains("at least 2 machines"), "{}", text(&out));
    assert!(!dir.path().join("hybrid.yaml").exists());
}

#[test]
fn config_default_writes_a_valid_file_and_keeps_existing_ones() {
    let dir = tempfile::tempdir().unwrap();
    let out = fsdp(dir.path())
        .args(["config", "default", "--num_processes", "4"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let path: PathBuf = dir.path().join(".cache/fsdp-rs/default_config.yaml");
    assert!(
        text(&out).contains(&path.display().to_string()),
        "{}",
        text(&out)
    );
    let config = resolved(&path);
    assert_eq!(config.launch.num_processes, 4);
    assert_eq!(
        config.launch.distributed_type,
        fsdp::config::DistributedType::Fsdp
    );

    let out = fsdp(dir.path())
        .args(["config", "default"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("already exists; pass --force"),
        "{}",
        text(&out)
    );
    let out = fsdp(dir.path())
        .args(["config", "default", "--force", "--mixed_precision", "bf16"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        resolved(&path).launch.mixed_precision,
        fsdp::config::MixedPrecision::Bf16
    );
}

#[test]
fn config_update_rewrites_canonically_and_refuses_invalid_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    let original = GUIDE.replace(
        "fsdp_sharding_strategy: FULL_SHARD",
        "fsdp_sharding_strategy: 2",
    );
    std::fs::write(&path, &original).unwrap();
    let out = fsdp(dir.path())
        .args(["config", "update", "--config_file"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let updated = std::fs::read_to_string(&path).unwrap();
    assert!(
        updated.contains("  fsdp_sharding_strategy: SHARD_GRAD_OP\n"),
        "{updated}"
    );
    assert!(
        updated.contains("  fsdp_backward_prefetch: BACKWARD_PRE\n"),
        "{updated}"
    );
    assert!(updated.contains("downcast_bf16: 'no'\n"), "{updated}");

    let broken = "num_processes: 2\nfsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n";
    std::fs::write(&path, broken).unwrap();
    let out = fsdp(dir.path())
        .args(["config", "update", "--config_file"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("c.yaml:3: unknown key `fsdp_sharding_stratgy`"),
        "{}",
        text(&out)
    );
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        broken,
        "an invalid file is left untouched"
    );
}

/// `FSDP_BF16_GEMM=f32` pins bf16 products to the f32 GEMM on widened operands, and `fsdp
/// env` says so (and why); left to choose, it names the kernel and, where it measured, both
/// instructions' rates.
#[test]
fn env_names_the_bf16_gemm_and_what_pinned_or_measured_it() {
    let dir = tempfile::tempdir().unwrap();
    let line = |pin: Option<&str>| {
        let mut cmd = fsdp(dir.path());
        cmd.arg("env");
        if let Some(p) = pin {
            cmd.env("FSDP_BF16_GEMM", p);
        }
        let t = text(&cmd.output().unwrap());
        t.lines()
            .find(|l| l.starts_with("- bf16 matmul: "))
            .unwrap_or_else(|| panic!("{t}"))
            .to_string()
    };
    let pinned = line(Some("f32"));
    let has_dot = fsdp::nn::ops::bf16_dot_products_available();
    let why = if has_dot {
        "(FSDP_BF16_GEMM=f32)"
    } else {
        "(this CPU has no AVX512_BF16)"
    };
    assert!(
        pinned.contains("f32 GEMM on widened operands") && pinned.contains(why),
        "{pinned}"
    );
    let chosen = line(None);
    let amx = matches!(
        fsdp::nn::ops::amx_support(),
        fsdp::nn::ops::AmxSupport::Ready
    );
    if has_dot && !amx {
        assert!(
            chosen.contains("GFLOP/s; FSDP_BF16_GEMM pins it)"),
            "{chosen}"
        );
    }
}

#[test]
fn env_reports_machine_and_sources() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    std::fs::write(&path, GUIDE).unwrap();
    let out = fsdp(dir.path())
        .args(["env", "--config_file"])
        .arg(&path)
        .env("FSDP_OFFLOAD_PARAMS", "true")
        .output()
        .unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for part in [
        "`fsdp` version: 0.1.0",
        "- CPU: ",
        "- bf16 matmul: ",
        "- Memory: ",
        "- CUDA: ",
        "Standalone: rank 0 of 1",
    ] {
        assert!(t.contains(part), "{part:?} missing in:\n{t}");
    }
    assert!(
        t.lines().any(|l| l.contains("fsdp_offload_params")
            && l.contains("[environment variable FSDP_OFFLOAD_PARAMS]")),
        "{t}"
    );
    // Int8 gathers and reductions and a secondary partition where nothing is gathered or
    // reduced (one process) are said, not ignored silently.
    let out = fsdp(dir.path())
        .args(["env"])
        .env("FSDP_ALL_GATHER_DTYPE", "int8")
        .env("FSDP_REDUCE_DTYPE", "int8")
        .env("FSDP_HPZ_PARTITION_SIZE", "2")
        .output()
        .unwrap();
    let int8 = text(&out);
    for note in [
        "- Note: `fsdp_all_gather_dtype: int8`: nothing is gathered",
        "- Note: `fsdp_reduce_dtype: int8`: nothing is reduced",
        "- Note: `fsdp_hpz_partition_size`: nothing is gathered",
    ] {
        assert!(int8.lines().any(|l| l.starts_with(note)), "{note}: {int8}");
    }
    assert!(!t.contains("dtype: int8`"), "{t}");
    assert!(!t.contains("two hops"), "one machine: {t}");
    // A job of 2 machines of 2 processes gathers and reduces in two hops, and env says so.
    let machines = dir.path().join("machines.yaml");
    std::fs::write(&machines, "distributed_type: FSDP\nnum_machines: 2\nnum_processes: 4\nmachine_rank: 0\nmain_process_ip: 10.0.0.1\nmain_process_port: 29500\n").unwrap();
    let out = fsdp(dir.path())
        .args(["env", "--config_file"])
        .arg(&machines)
        .output()
        .unwrap();
    let two = text(&out);
    assert!(
        two.contains("- Note: `fsdp_hierarchical_collectives: true`: the shard group of 4 gathers and reduces in two hops, inside each machine of 2 processes, then across the 2 machines"),
        "{two}"
    );
    // Offloading on the CPU is said once, not refused or ignored silently.
    assert!(
        t.lines()
            .any(|l| l.starts_with("- Note: `fsdp_offload_params: true`")
                && l.contains("offloading moves nothing")),
        "{t}"
    );
    assert!(
        t.lines()
            .any(|l| l.contains("fsdp_sharding_strategy") && l.contains("c.yaml:11]")),
        "{t}"
    );
    // With a folder for it, offloading goes to disk, and env says what goes where.
    let out = fsdp(dir.path())
        .args(["env", "--config_file"])
        .arg(&path)
        .env("FSDP_OFFLOAD_PARAMS", "true")
        .env("FSDP_OFFLOAD_DIR", "/scratch/x")
        .output()
        .unwrap();
    let d = text(&out);
    assert!(out.status.success(), "{d}");
    assert!(
        d.lines().any(|l| l.contains("fsdp_offload_dir")
            && l.contains("/scratch/x")
            && l.contains("[environment variable FSDP_OFFLOAD_DIR]")),
        "{d}"
    );
    assert!(
        d.lines().any(
            |l| l.starts_with("- Note: offloaded to disk: parameter shards")
                && l.contains("/scratch/x")
        ),
        "{d}"
    );
    assert!(
        t.lines()
            .any(|l| l.contains("fsdp_activation_checkpointing") && l.contains("[default]")),
        "{t}"
    );

    let out = fsdp(dir.path())
        .args(["env", "--json"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["config"]["valid"], true);
    assert!(doc["config_file"].is_null());
    assert!(
        doc["launch_environment"]
            .as_str()
            .unwrap()
            .contains("rank 1 of 2")
    );
    assert!(doc["available_cores"].as_u64().unwrap() >= 1);
    assert!(doc["bf16_matmul_kernel"].is_string());
    assert!(doc["f32_matmul_kernel"].is_string());
    // Whether candle can open a GPU, in this build and on this machine: a count, or the
    // reason none can be used, named.
    let gpus = doc["cuda"]["gpu_tensors"].as_str().unwrap();
    let built = doc["cuda"]["cuda_support_built"].as_bool().unwrap();
    assert_eq!(built, cfg!(feature = "cuda"));
    if !built {
        assert!(gpus.contains("this build has no CUDA support"), "{gpus}");
    } else if !std::path::Path::new("/proc/driver/nvidia/version").exists() {
        assert!(gpus.starts_with("no GPU (CUDA device 0: "), "{gpus}");
    } else {
        assert!(gpus.contains("CUDA device"), "{gpus}");
    }
    // AMX as the kernel reports it agrees with the CPU flags Linux shows.
    let amx = doc["amx"].as_str().unwrap();
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if flags.contains("amx_bf16") {
        assert!(!amx.contains("no AMX-BF16"), "{amx}");
    } else {
        assert_eq!(amx, "this CPU has no AMX-BF16 tiles");
        assert!(!doc["bf16_matmul_kernel"].as_str().unwrap().contains("AMX"));
    }

    let out = fsdp(dir.path())
        .args(["env"])
        .env("FSDP_SHARDING_STRATEGY", "SIDEWAYS")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("environment variable FSDP_SHARDING_STRATEGY"),
        "{}",
        text(&out)
    );
}

#[test]
fn accelerates_default_file_is_used_when_there_is_no_fsdp_one() {
    let dir = tempfile::tempdir().unwrap();
    let accelerate = dir
        .path()
        .join(".cache/huggingface/accelerate/default_config.yaml");
    std::fs::create_dir_all(accelerate.parent().unwrap()).unwrap();
    std::fs::write(&accelerate, GUIDE).unwrap();
    let out = fsdp(dir.path()).args(["env"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("Config file: {}", accelerate.display())),
        "{}",
        text(&out)
    );
}

#[test]
fn help_texts() {
    let dir = tempfile::tempdir().unwrap();
    let out = fsdp(dir.path()).arg("--help").output().unwrap();
    assert!(out.status.success());
    let t = text(&out);
    assert!(t.contains("config") && t.contains("env"), "{t}");
    let out = fsdp(dir.path())
        .args(["config", "--help"])
        .output()
        .unwrap();
    let t = text(&out);
    assert!(
        t.contains("default") && t.contains("update") && t.contains("--config_file"),
        "{t}"
    );
    // Offloading's help says where the state goes (disk with a folder, else host memory).
    let out = fsdp(dir.path())
        .args(["launch", "--help"])
        .output()
        .unwrap();
    let t = text(&out).split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        t.contains("--fsdp_offload_params <VALUE> offload parameter shards, gradients and optimizer state between uses: to fsdp_offload_dir when it is set (disk), else to host memory"),
        "{t}"
    );
}

#[cfg(feature = "bench")]
#[test]
fn bench_collectives_prints_a_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    // MPI beside ours where this build has it and mpirun is installed.
    let want: &[&str] = if cfg!(feature = "mpi") && crate::common::has_mpirun() {
        &["shm", "tcp", "mpi"]
    } else {
        &["shm", "tcp"]
    };
    let out = fsdp(dir.path())
        .args(["bench", "collectives", "--transport", &want.join(",")])
        .args([
            "--iters",
            "2",
            "--max_mib",
            "1",
            "--reduce_op",
            "avg",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("busbw_GB/s"), "{}", text(&out));
    // Each transport's largest size as a share of memcpy alone and with every rank copying.
    let shares = "bus bandwidth at 1048576 bytes as a share of memcpy alone / all copying at once";
    assert_eq!(
        text(&out).matches(shares).count(),
        want.len(),
        "{}",
        text(&out)
    );
    let share_rows = text(&out)
        .lines()
        .filter(|l| l.trim_start().starts_with("all_reduce") && l.trim_end().ends_with('%'))
        .count();
    assert_eq!(share_rows, want.len(), "{}", text(&out));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let runs = doc["runs"].as_array().unwrap();
    let transports: Vec<&str> = runs
        .iter()
        .map(|r| r["transport"].as_str().unwrap())
        .collect();
    assert_eq!(transports, want);
    for run in runs {
        let results = run["results"].as_array().unwrap();
        // 4 KiB, 16 KiB, 64 KiB, 256 KiB, 1 MiB for each of the six ops, and over shared
        // memory the shared blocks' all-gather and reduce-scatter too.
        let shm = run["transport"] == "shm";
        let per_size = if shm { 8 } else { 6 };
        assert_eq!(results.len(), 5 * per_size);
        let ops: Vec<&str> = results[..per_size]
            .iter()
            .map(|r| r["op"].as_str().unwrap())
            .collect();
        let mut expected = vec![
            "all_reduce",
            "all_gather",
            "all_gather_in_place",
            "reduce_scatter",
            "all_to_all",
            "broadcast",
        ];
        if shm {
            expected.extend(["all_gather_shared", "reduce_scatter_shared"]);
        }
        assert_eq!(ops, expected);
        assert!(
            results
                .iter()
                .all(|r| r["busbw_gbps"].as_f64().unwrap() > 0.0)
        );
        assert!(run["memcpy_gbps"].as_f64().unwrap() > 0.0);
        assert!(run["memcpy_together_gbps"].as_f64().unwrap() > 0.0);
        // The workers reduced as asked (they report what they ran).
        assert_eq!(run["reduce_op"], "avg");
    }
    // shm's bus bandwidth over each other transport's, per op and size they both ran.
    assert_eq!(
        doc["ratios"].as_array().unwrap().len(),
        30 * (want.len() - 1)
    );
}

#[test]
fn estimate_memory_prints_units_and_per_rank_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("config.json");
    std::fs::write(&model, r#"{"model_type": "bert", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 32}"#).unwrap();
    let out = fsdp(dir.path())
        .args(["estimate-memory", "--num_processes", "4", "--model_config"])
        .arg(&model)
        .output()
        .unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("4 unit(s), sharded over 4 rank(s), FullShard"),
        "{t}"
    );
    assert!(
        t.contains("unit 2: bert.encoder.layer.0 (BertLayer)") && t.contains("per rank: params"),
        "{t}"
    );
    // What a step sends, and with int8 gathers and reductions about a quarter of it.
    let inside = |t: &str| -> f64 {
        let line = t
            .lines()
            .find(|l| l.starts_with("communication per step"))
            .unwrap_or_else(|| panic!("no communication line in:\n{t}"));
        let at = line.find(" MiB inside its shard group of 4").expect(line);
        line[..at].rsplit(' ').next().unwrap().parse().unwrap()
    };
    let out = fsdp(dir.path())
        .args(["estimate-memory", "--num_processes", "4", "--model_config"])
        .arg(&model)
        .env("FSDP_ALL_GATHER_DTYPE", "int8")
        .env("FSDP_REDUCE_DTYPE", "int8")
        .output()
        .unwrap();
    let q = text(&out);
    assert!(out.status.success(), "{q}");
    assert!(
        q.contains("(parameters gathered as int8 blocks, gradients reduced as int8 blocks)"),
        "{q}"
    );
    let ratio = inside(&q) / inside(&t);
    assert!(
        (0.24..0.32).contains(&ratio),
        "int8 / f32 bytes {ratio}:\n{t}\n{q}"
    );
    // On one host f32 gathers go through shared memory (its bytes said); int8 ones do not.
    let shared = "shared memory for gathers on one host: about ";
    assert!(t.contains(shared), "{t}");
    assert!(!q.contains(shared), "{q}");
    // A secondary partition of 2 moves backward's gathers into its group, and says so.
    let out = fsdp(dir.path())
        .args(["estimate-memory", "--num_processes", "4", "--model_config"])
        .arg(&model)
        .env("FSDP_HPZ_PARTITION_SIZE", "2")
        .output()
        .unwrap();
    let h = text(&out);
    assert!(out.status.success(), "{h}");
    assert!(h.contains(" MiB inside its secondary group of 2, "), "{h}");
    assert!(h.contains("secondary partition "), "{h}");
    assert!(inside(&h) < inside(&t), "{t}\n{h}");
    // On 2 machines of 2, the shard group's blocks go in two hops: 2 of every 3 inside the
    // machine, 1 across; flat when fsdp_hierarchical_collectives is false.
    let machines = |hierarchical: &str| {
        let config = dir.path().join(format!("machines-{hierarchical}.yaml"));
        std::fs::write(&config, format!("distributed_type: FSDP\nnum_machines: 2\nnum_processes: 4\nmachine_rank: 0\nmain_process_ip: 10.0.0.1\nmain_process_port: 29500\nfsdp_config:\n  fsdp_hierarchical_collectives: {hierarchical}\n")).unwrap();
        let out = fsdp(dir.path())
            .args(["estimate-memory", "--model_config"])
            .arg(&model)
            .arg("--config_file")
            .arg(&config)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        text(&out)
    };
    let two = machines("true");
    let mib = |t: &str, after: &str| -> f64 {
        let at = t
            .find(after)
            .unwrap_or_else(|| panic!("no {after:?} in:\n{t}"));
        t[..at].rsplit(' ').next().unwrap().parse().unwrap()
    };
    let within = mib(&two, " MiB inside its machine of 2 and ");
    let across = mib(&two, " MiB across the 2 machines");
    assert!(
        two.contains("in two hops over its shard group of 4, "),
        "{two}"
    );
    assert!((within / across - 2.0).abs() < 0.05, "{two}");
    assert!(
        ((within + across) / inside(&t) - 1.0).abs() < 0.05,
        "{t}\n{two}"
    );
    let flat = machines("false");
    assert!(
        (inside(&flat) / inside(&t) - 1.0).abs() < 1e-9,
        "{t}\n{flat}"
    );
    let out = fsdp(dir.path())
        .args(["estimate-memory", "--model_config"])
        .arg(&model)
        .env("FSDP_TRANSFORMER_CLS_TO_WRAP", "NoSuchLayer")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("match no module of this model"),
        "{}",
        text(&out)
    );
}

/// Llama-3-8B's `config.json` (as its model card publishes it).
const LLAMA3_8B: &str = r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 128256}"#;

#[test]
fn estimate_memory_covers_llama_configs() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("config.json");
    std::fs::write(&model, LLAMA3_8B).unwrap();
    let mut per_rank = Vec::new();
    for n in ["8", "64"] {
        let out = fsdp(dir.path())
            .args(["estimate-memory", "--num_processes", n, "--model_config"])
            .arg(&model)
            .output()
            .unwrap();
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        // Meta's published count for Llama-3-8B.
        assert!(t.contains("LlamaForCausalLM: 8030261248 parameters"), "{t}");
        assert!(
            t.contains(&format!("33 unit(s), sharded over {n} rank(s), FullShard")),
            "{t}"
        );
        assert!(t.contains("(LlamaDecoderLayer)"), "{t}");
        // The summary first: the model and its units, the state per rank, the activations
        // (estimated, saying how), what a step sends; one line per unit after it, no
        // parameter rows.
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("LlamaForCausalLM: 8030261248 parameters; 33 unit(s)"),
            "{t}"
        );
        assert!(lines[1].starts_with("per rank: params"), "{t}");
        assert!(
            lines[2].starts_with("activations, for 1 sequence(s) per rank (--batch_size) of 2048 tokens, assumed: the model's position limit 8192, at most 2048; --seq_len sets it: about ")
                && lines[2].contains(" MiB per rank at 4 bytes a value")
                && lines[2].contains("upper estimate"),
            "{t}"
        );
        assert!(
            lines[3].starts_with("communication per step (one micro-batch), sent by each rank: ")
                && lines[3].contains(&format!(
                    " MiB inside its shard group of {n}, 0.0 MiB across 1 replica(s)"
                )),
            "{t}"
        );
        // On one host (the default launch) gathers go through shared memory.
        assert!(
            lines[4].starts_with("shared memory for gathers on one host: about "),
            "{t}"
        );
        assert_eq!(lines.len(), 6 + 33, "{t}");
        per_rank.push(
            t.lines()
                .find(|l| l.contains("per rank: params"))
                .unwrap()
                .to_string(),
        );
    }
    assert_ne!(per_rank[0], per_rank[1], "{per_rank:?}");
    // --params lists every parameter's rows; a longer batch estimates more activations.
    let out = fsdp(dir.path())
        .args([
            "estimate-memory",
            "--params",
            "--batch_size",
            "2",
            "--model_config",
        ])
        .arg(&model)
        .output()
        .unwrap();
    let t = text(&out);
    assert!(
        t.contains("model.layers.0.mlp.gate_proj.weight [14336, 4096]"),
        "{t}"
    );
    assert!(t.lines().count() > 4 + 33 + 32 * 9, "{t}");
    assert!(
        t.contains("for 2 sequence(s) per rank (--batch_size) of 2048 tokens, assumed"),
        "{t}"
    );
    let out = fsdp(dir.path())
        .args(["estimate-memory", "--seq_len", "512", "--model_config"])
        .arg(&model)
        .output()
        .unwrap();
    let t = text(&out);
    assert!(
        t.contains("activations, for 1 sequence(s) per rank (--batch_size) of 512 tokens (--seq_len): about "),
        "{t}"
    );
}

#[test]
fn estimate_memory_refuses_sizes_no_model_has_instead_of_aborting() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("config.json");
    let bert = r#""model_type": "bert", "vocab_size": 1000, "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 32"#;
    let llama = r#""model_type": "llama", "vocab_size": 1000, "num_attention_heads": 4, "intermediate_size": 128"#;
    for (config, needle) in [
        (
            format!(r#"{{{bert}, "hidden_size": 1099511627776, "num_hidden_layers": 2}}"#),
            "`hidden_size` is 1099511627776",
        ),
        (
            format!(r#"{{{bert}, "hidden_size": 64, "num_hidden_layers": 4294967296}}"#),
            "`num_hidden_layers` is 4294967296",
        ),
        (
            format!(r#"{{{llama}, "hidden_size": 1048576, "num_hidden_layers": 2}}"#),
            "of memory",
        ),
        (
            format!(r#"{{{llama}, "hidden_size": 64, "num_hidden_layers": 2, "rms_norm_eps": -1}}"#),
            "`rms_norm_eps` is -1",
        ),
        (
            r#"{"model_type": "gpt2", "vocab_size": 100, "n_positions": 16, "n_embd": 64, "n_layer": 70000, "n_head": 4}"#.to_string(),
            "`n_layer` is 70000",
        ),
    ] {
        std::fs::write(&model, &config).unwrap();
        let out = fsdp(dir.path())
            .args(["estimate-memory", "--model_config"])
            .arg(&model)
            .output()
            .unwrap();
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{config}: {t}");
        assert!(t.contains(needle), "{config}: {t}");
    }
}

#[test]
fn merge_weights_reads_accelerate_checkpoints_and_never_removes_them() {
    let home = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fsdp/tests/data/dcp/fsdp1");
    // A copy, since the folder is removed afterwards.
    let ckpt = home.path().join("ckpt/pytorch_model_fsdp_0");
    std::fs::create_dir_all(&ckpt).unwrap();
    for e in std::fs::read_dir(fixture.join("pytorch_model_fsdp_0")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), ckpt.join(e.file_name())).unwrap();
    }
    let out = home.path().join("merged");
    // An output inside the checkpoint to be removed: refused before anything is written
    // (it used to be merged and then deleted with the checkpoint), also through `..`.
    for inside in [
        home.path().join("ckpt/merged"),
        home.path().join("ckpt/pytorch_model_fsdp_0/../merged"),
        home.path().join("ckpt"),
    ] {
        let refused = fsdp(home.path())
            .arg("merge-weights")
            .arg(home.path().join("ckpt"))
            .arg(&inside)
            .arg("--remove_checkpoint_dir")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && err.contains("inside"), "{err}");
        assert!(
            ckpt.join(".metadata").is_file(),
            "the checkpoint was touched"
        );
        assert!(!home.path().join("ckpt/merged").exists());
    }
    let refused = fsdp(home.path())
        .args(["merge-weights", "--unsafe_serialization"])
        .arg(&ckpt)
        .arg(&out)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("pickle"));
    // Accelerate wrote it, not fsdp-rs: --remove_checkpoint_dir refuses before anything is
    // merged (only what this library wrote is ever removed), and so for its model folder.
    for dir in [home.path().join("ckpt"), ckpt.clone()] {
        let refused = fsdp(home.path())
            .arg("merge-weights")
            .arg(&dir)
            .arg(&out)
            .arg("--remove_checkpoint_dir")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(
            !refused.status.success()
                && err.contains("not a checkpoint written by save_state")
                && err.contains("nothing was merged"),
            "{err}"
        );
        assert!(!out.exists(), "merged although refused");
        assert!(
            ckpt.join(".metadata").is_file(),
            "the checkpoint was touched"
        );
    }
    let done = fsdp(home.path())
        .arg("merge-weights")
        .arg(home.path().join("ckpt"))
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(String::from_utf8_lossy(&done.stdout).contains("merged 41 tensors"));
    let ours = std::fs::read(out.join("model.safetensors")).unwrap();
    let theirs = std::fs::read(fixture.join("accelerate_merged.safetensors")).unwrap();
    assert!(ours == theirs, "differs from accelerate merge-weights");
    assert!(
        ckpt.join(".metadata").is_file(),
        "kept without --remove_checkpoint_dir"
    );
    let missing = fsdp(home.path())
        .arg("merge-weights")
        .arg(home.path().join("nowhere"))
        .arg(&out)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&missing.stderr).contains("nowhere"));
}

#[cfg(feature = "bench")]
#[test]
fn bench_reshard_saves_at_one_world_size_and_loads_at_others() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("reshard.json");
    let out = fsdp(dir.path())
        .args(["bench", "reshard", "--save", "4", "--load", "2,8"])
        .args([
            "--hidden", "64", "--layers", "1", "--vocab", "512", "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("read / share"), "{}", text(&out));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let checkpoint = doc["checkpoint_bytes"].as_f64().unwrap();
    let loads = doc["loads"].as_array().unwrap();
    assert_eq!(
        loads
            .iter()
            .map(|l| l["processes"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [2, 8]
    );
    for l in loads {
        // Every rank read something, none read the whole checkpoint twice over, and none
        // held the whole of it.
        let read = l["read_bytes_max"].as_f64().unwrap();
        assert!(read > 0.0 && read < checkpoint, "{l}");
        assert!(
            l["heap_above_bytes_max"].as_f64().unwrap() < checkpoint,
            "{l}"
        );
    }
}

#[test]
fn env_remeasures_the_core_peak_on_request() {
    // A cached peak (here made absurdly low, as one measured under heavy load would be) is
    // what `env` and MFU use; `--remeasure_peak` measures again and replaces it when the
    // machine was idle enough, saying how busy it was. A peak measured under load says its
    // instruction limit is a floor.
    let dir = tempfile::tempdir().unwrap();
    let env = |args: &[&str]| -> Output {
        let out = fsdp(dir.path()).arg("env").args(args).output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        out
    };
    let json = |args: &[&str]| -> serde_json::Value {
        let with_json: Vec<&str> = args.iter().copied().chain(["--json"]).collect();
        serde_json::from_slice(&env(&with_json).stdout).unwrap()
    };
    let first = json(&[]);
    let cache = dir.path().join(".cache/fsdp-rs/core_peak.json");
    std::fs::create_dir_all(cache.parent().unwrap()).unwrap();
    // The cache as a run on this CPU writes it, idle or not.
    let write_cache = |f32: f64, others_busy: f64| {
        let cached = serde_json::json!({
            "cpu": first["core_peak_cpu"], "f32": f32, "bf16": 2.0,
            "f32_instruction": 3.0, "bf16_instruction": 4.0, "others_busy": others_busy,
        });
        std::fs::write(&cache, cached.to_string()).unwrap();
    };
    write_cache(1.0, 0.0);
    assert_eq!(
        json(&[])["core_peak_flops"]["f32"],
        1.0,
        "the cache is read"
    );
    let idle = text(&env(&[]));
    assert!(!idle.contains("a floor, not the limit"), "{idle}");
    write_cache(1.0, 0.6);
    let busy = text(&env(&[]));
    assert!(
        busy.contains("Instruction peak")
            && busy.contains(
                "(measured under the same load: a floor, not the limit; MFU lines leave it out)"
            ),
        "{busy}"
    );
    write_cache(1.0, 0.0);
    let again = json(&["--remeasure_peak"]);
    let f32 = again["core_peak_flops"]["f32"].as_f64().unwrap();
    assert!(f32 > 1e8, "{again}");
    let rewritten: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cache).unwrap()).unwrap();
    let busy = again["core_peak_others_busy"].as_f64().unwrap();
    if busy <= 0.25 {
        assert_eq!(rewritten["f32"].as_f64().unwrap(), f32, "cached when idle");
    } else {
        assert_eq!(rewritten["f32"], 1.0, "not cached under load ({busy})");
    }
}

#[test]
fn a_printing_command_whose_reader_is_gone_ends_quietly() {
    // `fsdp env | head -1` with the reader already gone: the first write meets a closed pipe.
    // It ends by SIGPIPE, as Unix tools do, not with a panic in println!.
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    for args in [&["env"][..], &["config", "--help"]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = fsdp(dir.path())
            .args(args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        if args[0] == "env" {
            assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{args:?}: {err}");
        }
    }
}

/// A build without the `bench` feature (what users install) keeps the benchmarks out, and
/// `fsdp bench ...` says how to build them instead of failing as an unknown command.
#[cfg(not(feature = "bench"))]
#[test]
fn bench_without_the_feature_says_how_to_build_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = fsdp(dir.path())
        .args(["bench", "memory", "--num_processes", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("cargo build --release -p fsdp-cli --features bench"),
        "{}",
        text(&out)
    );
}

#[test]
fn launch_example_outside_a_workspace_or_of_another_name_says_what_to_do() {
    let launch = |dir: &Path, name: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
            .args(["launch", "--num_processes", "1", "--example", name])
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // As after `cargo install`, in a folder of one's own.
    let elsewhere = tempfile::tempdir().unwrap();
    let e = launch(elsewhere.path(), "nlp_example");
    assert!(
        e.contains("is in none: run it inside the fsdp-rs checkout")
            && e.contains("or build your program and give its path"),
        "{e}"
    );
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR"));
    let e = launch(checkout, "nlp_exampel");
    assert!(
        e.contains("has no example `nlp_exampel`; its examples: custom_model_example, gpt2_example, guide, llama_example, nlp_example, training"),
        "{e}"
    );
}
