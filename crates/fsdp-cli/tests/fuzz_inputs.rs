//! Seeded fuzzing of what users feed the commands: config files (valid keys with wild
//! values, broken YAML, several documents, huge values, binary garbage) and `FSDP_*` /
//! `ACCELERATE_*` environment values. No input may panic a command; a refusal names the file
//! or the variable. Bounded: a fixed number of cases, each command with a deadline.

use std::time::Duration;

use crate::common;

use crate::common::{finish, fsdp};

/// splitmix64: the same cases on every run.
struct Rng(fsdp::rng::SplitMix64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const KEYS: &[&str] = &[
    "compute_environment",
    "distributed_type",
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_port",
    "main_process_ip",
    "mixed_precision",
    "use_cpu",
    "num_cpu_threads_per_process",
    "debug",
    "gpu_ids",
    "rdzv_backend",
    "downcast_bf16",
];
const FSDP_KEYS: &[&str] = &[
    "fsdp_sharding_strategy",
    "fsdp_auto_wrap_policy",
    "fsdp_min_num_params",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_backward_prefetch",
    "fsdp_state_dict_type",
    "fsdp_offload_params",
    "fsdp_version",
    "fsdp_ignored_modules",
    "fsdp_reshard_after_forward",
    "fsdp_activation_checkpointing",
    "fsdp_cpu_ram_efficient_loading",
];
const ENV_VARS: &[&str] = &[
    "FSDP_SHARDING_STRATEGY",
    "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "FSDP_MIN_NUM_PARAMS",
    "FSDP_AUTO_WRAP_POLICY",
    "FSDP_BACKWARD_PREFETCH",
    "FSDP_STATE_DICT_TYPE",
    "FSDP_OFFLOAD_PARAMS",
    "FSDP_VERSION",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_DEBUG_MODE",
];

/// A value a user (or a bad day) might write.
fn value(r: &mut Rng) -> String {
    match r.below(14) {
        0 => r.next().to_string(),
        1 => format!("-{}", r.below(1000)),
        2 => r
            .pick(&[
                "1e3", "2.5", "1e400", "NaN", "0x10", "1_000", "  7  ", "+3", "٣",
            ])
            .into(),
        3 => r
            .pick(&[
                "true",
                "no",
                "FULL_SHARD",
                "2",
                "bf16",
                "SIZE_BASED_WRAP",
                "BertLayer",
            ])
            .into(),
        4 => "x".repeat(70_000 + r.below(1000)),
        5 => "é✓\u{202e}漢".repeat(1 + r.below(50)),
        6 => "'unterminated".into(),
        7 => "[a, [b, c]]".into(),
        8 => "{nested: {deep: 1}}".into(),
        9 => "&anchor 5".into(),
        10 => "*alias".into(),
        11 => "\"tab\\there\"".into(),
        12 => String::new(),
        _ => format!("{}", r.next() as f64 / 3.0),
    }
}

/// A config file: mostly well-formed with wild values, sometimes broken on purpose.
fn config_file(r: &mut Rng) -> Vec<u8> {
    let mut text = String::new();
    for _ in 0..r.below(6) {
        text.push_str(&format!("{}: {}\n", r.pick(KEYS), value(r)));
    }
    if r.below(2) == 0 {
        text.push_str("fsdp_config:\n");
        for _ in 0..r.below(6) {
            text.push_str(&format!("  {}: {}\n", r.pick(FSDP_KEYS), value(r)));
        }
    }
    match r.below(12) {
        0 => text.push_str("---\nnum_processes: 3\n"),
        1 => text.push_str("\tbad_indent: 1\n"),
        2 => text.push_str("unknown_key_here: 1\n"),
        3 => text = format!("- a list\n- at the top\n{text}"),
        4 => text.push_str(": no key\n"),
        _ => {}
    }
    let mut bytes = text.into_bytes();
    if r.below(15) == 0 {
        bytes.extend((0..r.below(300)).map(|_| r.next() as u8));
    }
    bytes
}

fn check(what: &str, run: &common::Run, names: &[&str]) {
    assert!(
        !run.out.contains("panicked") && !matches!(run.code, Some(101) | None),
        "{what} panicked or died (code {:?}):\n{}",
        run.code,
        &run.out[..run.out.len().min(4000)]
    );
    if run.code != Some(0) {
        let last = run.out.lines().last().unwrap_or_default();
        assert!(
            names.iter().any(|n| run.out.contains(n)),
            "{what} failed without naming any of {names:?}:\n{}",
            &last[..last.len().min(2000)]
        );
    }
}

#[test]
fn no_config_file_or_environment_value_panics_a_command() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("config.json");
    std::fs::write(
        &model,
        r#"{"model_type":"bert","vocab_size":100,"hidden_size":16,"num_hidden_layers":2,"num_attention_heads":2,"intermediate_size":32,"max_position_embeddings":16}"#,
    )
    .unwrap();
    let mut r = Rng(fsdp::rng::SplitMix64::new(0x5EED));
    let limit = Duration::from_secs(30);
    for case in 0..60 {
        let file = dir.path().join(format!("case{case}.yaml"));
        std::fs::write(&file, config_file(&mut r)).unwrap();
        let f = file.to_str().unwrap();
        let name = file.file_name().unwrap().to_str().unwrap();
        // Configuration problems name the file; `launch` may also fail for what it then
        // tries (a port in use, a machine that never comes), with its own message.
        let names = [name];
        let launch_names = [name, "error:"];
        let what = format!("case {case} ({f})");
        let run = |args: &[&str]| {
            let mut cmd = fsdp();
            cmd.args(args).env("FSDP_RENDEZVOUS_TIMEOUT_SECS", "2");
            finish(cmd.spawn().unwrap(), limit)
        };
        check(
            &format!("env, {what}"),
            &run(&["env", "--config_file", f]),
            &names,
        );
        check(
            &format!("estimate-memory, {what}"),
            &run(&[
                "estimate-memory",
                "--config_file",
                f,
                "--model_config",
                model.to_str().unwrap(),
            ]),
            &names,
        );
        check(
            &format!("launch, {what}"),
            &run(&["launch", "--config_file", f, "--num_processes", "1", "true"]),
            &launch_names,
        );
        check(
            &format!("config update, {what}"),
            &run(&["config", "update", "--config_file", f]),
            &names,
        );
    }
    // The environment: each variable with wild values, for env and launch.
    for case in 0..40 {
        let var = r.pick(ENV_VARS);
        let v = value(&mut r);
        for args in [
            &["env"][..],
            &["launch", "--num_processes", "1", "true"][..],
        ] {
            let mut cmd = fsdp();
            cmd.args(args)
                .env(var, &v)
                .env("FSDP_RENDEZVOUS_TIMEOUT_SECS", "2");
            let run = finish(cmd.spawn().unwrap(), limit);
            check(
                &format!("{args:?} with {var} (case {case})"),
                &run,
                &[var, "error:"],
            );
        }
    }
    // Not files: a device and a folder.
    for f in ["/dev/zero", "/dev/null", "/"] {
        let run = finish(
            fsdp().args(["env", "--config_file", f]).spawn().unwrap(),
            limit,
        );
        check(&format!("env --config_file {f}"), &run, &[f]);
    }
}

#[test]
fn config_traps_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let limit = Duration::from_secs(30);
    let env = |f: &str| {
        finish(
            fsdp().args(["env", "--config_file", f]).spawn().unwrap(),
            limit,
        )
    };
    let two = write("two.yaml", "num_processes: 2\n---\nnum_processes: 3\n");
    let run = env(&two);
    assert_eq!(run.code, Some(1), "{}", run.out);
    assert!(
        run.out.contains("two.yaml:2") && run.out.contains("second YAML document"),
        "{}",
        run.out
    );
    let sci = write("sci.yaml", "num_processes: 1e3\n");
    let run = env(&sci);
    assert_eq!(run.code, Some(1), "{}", run.out);
    assert!(
        run.out.contains("sci.yaml") && run.out.contains("num_processes"),
        "{}",
        run.out
    );
    let ok = write(
        "ok.yaml",
        "fsdp_config:\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 1e6\n",
    );
    assert_eq!(env(&ok).code, Some(0));
    let started = std::time::Instant::now();
    let run = env("/dev/zero");
    assert_eq!(run.code, Some(1), "{}", run.out);
    assert!(run.out.contains("larger than 1 MiB"), "{}", run.out);
    assert!(started.elapsed() < Duration::from_secs(5));
    // An OS error is said once in a message.
    let run = env("/nonexistent/c.yaml");
    assert_eq!(run.code, Some(1), "{}", run.out);
    assert!(
        run.out.contains("No such file or directory")
            && run
                .out
                .lines()
                .all(|l| l.matches("No such file or directory").count() <= 1),
        "{}",
        run.out
    );
    // A 70,000-character value is printed, not a panic.
    let run = finish(
        fsdp()
            .arg("env")
            .env("FSDP_TRANSFORMER_CLS_TO_WRAP", "B".repeat(70_000))
            .spawn()
            .unwrap(),
        limit,
    );
    assert_eq!(run.code, Some(0), "{}", &run.out[..run.out.len().min(2000)]);
}
