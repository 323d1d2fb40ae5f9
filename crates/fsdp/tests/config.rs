//! The configuration schema end to end: Accelerate's files, every key's round trip,
//! precedence between sources, and every validation message.

use std::path::Path;

use fsdp::config::{
    AllGatherDtype, AutoWrapPolicy, BackwardPrefetch, ConfigError, DistributedType, FsdpPlugin,
    Key, Kind, Layer, MixedPrecision, ReduceDtype, ResolvedConfig, ShardingStrategy, Source,
    StateDictType, Value, yaml,
};

const GUIDE: &str = include_str!("data/accelerate_guide_fsdp.yaml");

fn file(text: &str) -> Result<Layer, ConfigError> {
    Layer::from_yaml_str(text, Path::new("cfg.yaml"))
}

fn resolve_file(text: &str) -> Result<ResolvedConfig, ConfigError> {
    ResolvedConfig::resolve(&[&file(text)?])
}

fn env(vars: &[(&str, &str)]) -> Layer {
    Layer::from_env_vars(vars.iter().copied()).unwrap()
}

/// The error text of resolving `text`, which must fail.
fn error_of(text: &str) -> String {
    match file(text).and_then(|l| ResolvedConfig::resolve(&[&l])) {
        Ok(_) => panic!("expected an error for:\n{text}"),
        Err(e) => e.to_string(),
    }
}

fn assert_contains(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "expected {part:?} in:\n{text}");
    }
}

#[test]
fn accelerate_guide_yaml_parses_unchanged() {
    let config = resolve_file(GUIDE).unwrap();
    let l = &config.launch;
    assert_eq!(l.distributed_type, DistributedType::Fsdp);
    assert_eq!((l.num_processes, l.num_machines, l.machine_rank), (2, 1, 0));
    assert_eq!(l.mixed_precision, MixedPrecision::Bf16);
    assert!(!l.use_cpu && !l.debug);
    let f = &config.fsdp;
    assert_eq!(f.sharding_strategy, ShardingStrategy::FullShard);
    assert_eq!(f.auto_wrap_policy, AutoWrapPolicy::TransformerBasedWrap);
    assert_eq!(
        f.transformer_layer_cls_to_wrap,
        Some(vec!["BertLayer".to_string()])
    );
    // The guide spells the alias `fsdp_backward_prefetch_policy`.
    assert_eq!(f.backward_prefetch, BackwardPrefetch::BackwardPre);
    assert_eq!(
        config.get(Key::FsdpBackwardPrefetch).unwrap().source,
        Source::File {
            path: "cfg.yaml".into(),
            line: 7
        }
    );
    assert_eq!(f.state_dict_type, StateDictType::ShardedStateDict);
    assert!(f.cpu_ram_efficient_loading && f.sync_module_states);
    assert!(!f.forward_prefetch && !f.offload_params && !f.activation_checkpointing);
    // Every key the guide sets is recognised and nothing is left at a non-default NA value.
    assert!(
        config.not_applicable().is_empty(),
        "{:?}",
        config.not_applicable()
    );
}

#[test]
fn enum_numbers_and_case_are_accepted() {
    let text = GUIDE
        .replace(
            "fsdp_sharding_strategy: FULL_SHARD",
            "fsdp_sharding_strategy: 2",
        )
        .replace(
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
            "fsdp_auto_wrap_policy: 1",
        )
        .replace(
            "fsdp_backward_prefetch_policy: BACKWARD_PRE",
            "fsdp_backward_prefetch: 2",
        )
        .replace(
            "fsdp_state_dict_type: SHARDED_STATE_DICT",
            "fsdp_state_dict_type: full_state_dict",
        );
    let config = resolve_file(&text).unwrap();
    assert_eq!(config.fsdp.sharding_strategy, ShardingStrategy::ShardGradOp);
    assert_eq!(
        config.fsdp.backward_prefetch,
        BackwardPrefetch::BackwardPost
    );
    assert_eq!(config.fsdp.state_dict_type, StateDictType::FullStateDict);
    for (n, strategy) in ShardingStrategy_all() {
        let v = fsdp::config::parse_text(Key::FsdpShardingStrategy.spec(), &n.to_string()).unwrap();
        assert_eq!(v, Value::Text(strategy.to_string()));
    }
    // DeepSpeed's names for ZeRO++'s secondary partition, quantized weights and gradients.
    let config = resolve_file("fsdp_config:\n  zero_hpz_partition_size: 2\n").unwrap();
    assert_eq!(config.fsdp.hpz_partition_size, 2);
    let both = "fsdp_config:\n  zero_quantized_weights: true\n  zero_quantized_gradients: true\n";
    let config = resolve_file(both).unwrap();
    assert_eq!(config.fsdp.all_gather_dtype, AllGatherDtype::Int8);
    // DeepSpeed's qgZ sends gradients in 4 bits; our int8 is the other quantized choice.
    assert_eq!(config.fsdp.reduce_dtype, ReduceDtype::Int4);
    let int8 = "fsdp_config:\n  zero_quantized_gradients: true\n  fsdp_reduce_dtype: int8\n";
    assert_eq!(
        resolve_file(int8).unwrap().fsdp.reduce_dtype,
        ReduceDtype::Int8
    );
    let agreeing = "fsdp_config:\n  zero_quantized_weights: true\n  fsdp_all_gather_dtype: int8\n";
    assert_eq!(
        resolve_file(agreeing).unwrap().fsdp.all_gather_dtype,
        AllGatherDtype::Int8
    );
    let off = "fsdp_config:\n  zero_quantized_gradients: false\n";
    assert_eq!(
        resolve_file(off).unwrap().fsdp.reduce_dtype,
        ReduceDtype::Fp32
    );
    let e =
        resolve_file("fsdp_config:\n  fsdp_reduce_dtype: bf16\n  zero_quantized_gradients: true\n")
            .unwrap_err()
            .to_string();
    assert!(
        e.contains("fsdp_reduce_dtype: bf16") && e.contains("zero_quantized_gradients: true"),
        "{e}"
    );
}

#[allow(non_snake_case)]
fn ShardingStrategy_all() -> Vec<(usize, ShardingStrategy)> {
    use fsdp::config::Choice;
    ShardingStrategy::ALL
        .iter()
        .enumerate()
        .map(|(i, s)| (i + 1, *s))
        .collect()
}

#[test]
fn fsdp_version_2_reshard_after_forward_maps_to_strategies() {
    let base = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n";
    let c = resolve_file(&format!("{base}  fsdp_reshard_after_forward: false\n")).unwrap();
    assert_eq!(
        (c.fsdp.version, c.fsdp.sharding_strategy),
        (2, ShardingStrategy::ShardGradOp)
    );
    let c = resolve_file(&format!("{base}  fsdp_reshard_after_forward: true\n")).unwrap();
    assert_eq!(c.fsdp.sharding_strategy, ShardingStrategy::FullShard);
    // FSDP1 files may spell the strategy under the new name.
    let c = resolve_file("fsdp_config:\n  fsdp_reshard_after_forward: NO_SHARD\n").unwrap();
    assert_eq!(c.fsdp.sharding_strategy, ShardingStrategy::NoShard);
    let e = error_of(&format!(
        "{base}  fsdp_reshard_after_forward: SHARD_GRAD_OP\n"
    ));
    assert_contains(
        &e,
        &[
            "cfg.yaml:4",
            "fsdp_reshard_after_forward",
            "fsdp_version 2 it must be true or false",
        ],
    );
}

/// A valid non-default value for every key, derived from the schema.
fn non_default_value(key: Key) -> Value {
    let spec = key.spec();
    match spec.kind {
        Kind::Bool => Value::Bool(Value::from_default(spec.default) != Some(Value::Bool(true))),
        Kind::UInt { min, max } => Value::UInt((min + 3).min(max)),
        Kind::ParamCount => Value::UInt(12_345),
        Kind::Text => Value::Text(format!("{}-value", spec.name)),
        Kind::Choice(names) => Value::Text(names[names.len() - 1].to_string()),
        Kind::BoolOrStrategy => Value::Bool(false),
        Kind::TextList => Value::List(vec!["A=1".into(), "two words".into(), "no".into()]),
        Kind::Opaque => Value::Yaml(yaml::parse("zero_stage: 3\nnested:\n  x: [1, 2]\n").unwrap()),
    }
}

fn without_lines(v: &Value) -> Value {
    match v {
        Value::Yaml(node) => Value::Yaml(strip_lines(node)),
        other => other.clone(),
    }
}

fn strip_lines(node: &yaml::Node) -> yaml::Node {
    use yaml::NodeKind;
    let kind = match &node.kind {
        NodeKind::Scalar { text, .. } => NodeKind::Scalar {
            text: text.clone(),
            quoted: false,
        },
        NodeKind::Seq(items) => NodeKind::Seq(items.iter().map(strip_lines).collect()),
        NodeKind::Map(entries) => NodeKind::Map(
            entries
                .iter()
                .map(|(k, v)| (strip_lines(k), strip_lines(v)))
                .collect(),
        ),
    };
    yaml::Node { line: 0, kind }
}

#[test]
fn every_key_round_trips_through_yaml_and_environment() {
    let mut layer = Layer::new();
    for key in Key::all() {
        layer.set(key, non_default_value(key), Source::Code);
    }
    let text = layer.to_yaml();
    let back = file(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    for key in Key::all() {
        let got = back
            .get(key)
            .unwrap_or_else(|| panic!("{} lost in:\n{text}", key.name()));
        assert_eq!(
            without_lines(&got.value),
            without_lines(&non_default_value(key)),
            "{}",
            key.name()
        );
        assert!(matches!(got.source, Source::File { line, .. } if line > 0));
    }
    // Writing what was read gives the same text (canonical form is a fixed point).
    assert_eq!(back.to_yaml(), text);

    for key in Key::all() {
        let Some(var) = key.spec().env else { continue };
        let value = match key {
            Key::DistributedType => Value::Text("FSDP".into()), // ACCELERATE_USE_FSDP is a switch
            _ => non_default_value(key),
        };
        let text = match key {
            Key::DistributedType => "true".to_string(),
            _ => value.to_env_text(),
        };
        let layer = env(&[(var, text.as_str())]);
        let got = layer.get(key).unwrap_or_else(|| panic!("{var} not read"));
        assert_eq!(got.value, value, "{var}");
        assert_eq!(
            got.source,
            Source::Env {
                var: var.to_string()
            }
        );
    }
}

#[test]
fn environment_overrides_file_and_code_overrides_environment() {
    let file_layer = file(GUIDE).unwrap();
    let env_layer = env(&[
        ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"),
        ("FSDP_OFFLOAD_PARAMS", "true"),
        ("ACCELERATE_MIXED_PRECISION", "fp16"),
        ("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH"),
        ("UNRELATED_VARIABLE", "x"),
    ]);
    let c = ResolvedConfig::resolve(&[&env_layer, &file_layer]).unwrap();
    assert_eq!(c.fsdp.sharding_strategy, ShardingStrategy::ShardGradOp);
    assert!(c.fsdp.offload_params);
    assert_eq!(c.launch.mixed_precision, MixedPrecision::Fp16);
    assert_eq!(c.fsdp.backward_prefetch, BackwardPrefetch::NoPrefetch);
    assert_eq!(
        c.get(Key::FsdpShardingStrategy).unwrap().source,
        Source::Env {
            var: "FSDP_SHARDING_STRATEGY".into()
        }
    );
    // Keys the environment does not set keep the file's value and say so.
    assert!(matches!(
        c.get(Key::NumProcesses).unwrap().source,
        Source::File { line: 20, .. }
    ));

    let c = FsdpPlugin::builder()
        .sharding_strategy(ShardingStrategy::NoShard)
        .mixed_precision(MixedPrecision::No)
        .resolve(&env_layer, Some(&file_layer))
        .unwrap();
    assert_eq!(c.fsdp.sharding_strategy, ShardingStrategy::NoShard);
    assert_eq!(c.fsdp.mixed_precision, MixedPrecision::No);
    assert_eq!(
        c.get(Key::FsdpShardingStrategy).unwrap().source,
        Source::Code
    );
    assert!(
        c.fsdp.offload_params,
        "environment still applies where code is silent"
    );

    // ACCELERATE_USE_FSDP turns a plain data-parallel file into an FSDP job.
    let multi_cpu = file("distributed_type: MULTI_CPU\nnum_processes: 2\n").unwrap();
    let c = ResolvedConfig::resolve(&[&env(&[("ACCELERATE_USE_FSDP", "1")]), &multi_cpu]).unwrap();
    assert_eq!(c.launch.distributed_type, DistributedType::Fsdp);
}

#[test]
fn defaults_are_one_table() {
    let c = ResolvedConfig::resolve(&[]).unwrap();
    for key in Key::all() {
        let expected = Value::from_default(key.spec().default);
        assert_eq!(
            c.get(key).map(|s| s.value.clone()),
            expected,
            "{}",
            key.name()
        );
    }
    let plugin = FsdpPlugin::builder()
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp;
    assert_eq!(plugin.sharding_strategy, ShardingStrategy::FullShard);
    assert_eq!(
        plugin.auto_wrap_policy,
        AutoWrapPolicy::TransformerBasedWrap
    );
    assert_eq!(plugin.backward_prefetch, BackwardPrefetch::BackwardPre);
    assert_eq!(plugin.state_dict_type, StateDictType::ShardedStateDict);
    assert!(plugin.sync_module_states && !plugin.cpu_ram_efficient_loading);
}

#[test]
fn unknown_keys_get_suggestions() {
    let e = error_of("fsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n");
    assert_contains(
        &e,
        &[
            "cfg.yaml:2",
            "unknown key `fsdp_sharding_stratgy` in `fsdp_config`",
            "did you mean `fsdp_sharding_strategy`?",
        ],
    );
    let e = error_of("num_proceses: 2\n");
    assert_contains(
        &e,
        &[
            "cfg.yaml:1",
            "unknown key `num_proceses`",
            "did you mean `num_processes`?",
        ],
    );
    let e = error_of("fsdp_offload_params: true\n");
    assert_contains(
        &e,
        &["did you mean `fsdp_offload_params` inside `fsdp_config`?"],
    );
    let e = error_of("completely_unrelated: 1\n");
    assert_contains(
        &e,
        &["unknown key `completely_unrelated`", "fsdp config --help"],
    );
}

#[test]
fn bad_values_name_file_line_key_and_choices() {
    let e = error_of("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL\n");
    assert_contains(
        &e,
        &[
            "cfg.yaml:3",
            "invalid value `FULL` for `fsdp_sharding_strategy`",
            "FULL_SHARD (1), SHARD_GRAD_OP (2), NO_SHARD (3), HYBRID_SHARD (4), HYBRID_SHARD_ZERO2 (5)",
        ],
    );
    let e = error_of("num_processes: two\n");
    assert_contains(
        &e,
        &["cfg.yaml:1", "`num_processes`", "whole number from 1"],
    );
    let e = error_of("main_process_port: 70000\n");
    assert_contains(&e, &["from 0 to 65535"]);
    let e = error_of("mixed_precision: fp8\n");
    assert_contains(&e, &["`mixed_precision`", "no (1), fp16 (2), bf16 (3)"]);
    let e = error_of("debug: maybe\n");
    assert_contains(&e, &["`debug`", "expected true or false"]);
    let e = error_of("gpu_ids: 0,x\n");
    assert_contains(&e, &["gpu_ids", "comma-separated GPU ids"]);
    let e = error_of("fsdp_config:\n  fsdp_ignored_modules: 'layer.('\n");
    assert_contains(
        &e,
        &["fsdp_ignored_modules", "not a valid regular expression"],
    );
    let e = error_of("fsdp_config:\n  fsdp_reduce_dtype: fp8\n");
    assert_contains(
        &e,
        &[
            "cfg.yaml:2",
            "`fsdp_reduce_dtype`",
            "fp32 (1), bf16 (2), fp16 (3)",
        ],
    );
    let e = error_of("fsdp_config: [1, 2]\n");
    assert_contains(&e, &["cfg.yaml:1", "`fsdp_config` must be a mapping"]);
    let e = error_of("a: [1, 2\n");
    assert_contains(&e, &["cfg.yaml:", "invalid YAML"]);
    let e = error_of(
        "fsdp_config:\n  fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_backward_prefetch_policy: BACKWARD_POST\n",
    );
    assert_contains(
        &e,
        &[
            "cfg.yaml:3",
            "`fsdp_backward_prefetch` is set twice (first at cfg.yaml:2)",
        ],
    );

    let e = Layer::from_env_vars([("FSDP_SHARDING_STRATEGY", "SIDEWAYS")])
        .unwrap_err()
        .to_string();
    assert_contains(
        &e,
        &[
            "environment variable FSDP_SHARDING_STRATEGY",
            "`SIDEWAYS`",
            "FULL_SHARD (1)",
        ],
    );
}

#[test]
fn inconsistent_settings_are_errors_naming_both_sides() {
    let e = error_of(
        "fsdp_config:\n  fsdp_cpu_ram_efficient_loading: true\n  fsdp_sync_module_states: false\n",
    );
    assert_contains(
        &e,
        &[
            "`fsdp_cpu_ram_efficient_loading: true` (cfg.yaml:2) requires `fsdp_sync_module_states: true`",
            "`fsdp_sync_module_states: false` (cfg.yaml:3)",
        ],
    );
    let e = error_of("fsdp_config:\n  fsdp_offload_optimizer: true\n");
    assert_contains(
        &e,
        &["`fsdp_offload_optimizer: true` (cfg.yaml:2) needs `fsdp_offload_dir`"],
    );
    let e = error_of(
        "fsdp_config:\n  fsdp_checkpoint_format: torch-dcp\n  fsdp_state_dict_type: FULL_STATE_DICT\n",
    );
    assert_contains(
        &e,
        &[
            "`fsdp_checkpoint_format: torch-dcp` (cfg.yaml:2) writes SHARDED_STATE_DICT checkpoints only",
            "`fsdp_state_dict_type: FULL_STATE_DICT` (cfg.yaml:3)",
        ],
    );
    let e = error_of("fsdp_config:\n  fsdp_checkpoint_format: dcp\n");
    assert_contains(
        &e,
        &["fsdp_checkpoint_format", "fsdp-rs (1), torch-dcp (2)"],
    );
    let e = error_of("fsdp_config:\n  fsdp_offload_dir: /scratch\n");
    assert_contains(
        &e,
        &[
            "`fsdp_offload_dir: /scratch` (cfg.yaml:2) offloads nothing",
            "fsdp_offload_params: true",
            "fsdp_offload_optimizer: true",
        ],
    );
    let ok = |yaml: &str| {
        ResolvedConfig::resolve(&[&file(yaml).unwrap()])
            .unwrap()
            .fsdp
    };
    assert_eq!(
        ok("fsdp_config:\n  fsdp_checkpoint_format: torch-dcp\n").checkpoint_format,
        fsdp::config::CheckpointFormat::TorchDcp
    );
    let f = ok("fsdp_config:\n  fsdp_offload_params: true\n  fsdp_offload_dir: /scratch\n");
    assert!(f.offload_params && !f.offload_optimizer);
    assert_eq!(
        f.offload_dir.as_deref(),
        Some(std::path::Path::new("/scratch"))
    );
    let e = error_of("fsdp_config:\n  fsdp_min_num_params: 1000\n");
    assert_contains(
        &e,
        &[
            "`fsdp_min_num_params: 1000` (cfg.yaml:2) only applies with `fsdp_auto_wrap_policy: SIZE_BASED_WRAP`",
            "TRANSFORMER_BASED_WRAP` (default)",
        ],
    );
    let e = error_of(
        "fsdp_config:\n  fsdp_auto_wrap_policy: NO_WRAP\n  fsdp_transformer_layer_cls_to_wrap: BertLayer\n",
    );
    assert_contains(
        &e,
        &[
            "fsdp_transformer_layer_cls_to_wrap: BertLayer",
            "only applies with `fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`",
        ],
    );
    let e = error_of("num_processes: 3\nnum_machines: 2\nmain_process_ip: 10.0.0.1\n");
    assert_contains(
        &e,
        &["`num_processes: 3` (cfg.yaml:1) must be a multiple of `num_machines: 2` (cfg.yaml:2)"],
    );
    let e =
        error_of("num_processes: 4\nnum_machines: 2\nmachine_rank: 2\nmain_process_ip: 10.0.0.1\n");
    assert_contains(
        &e,
        &["`machine_rank: 2` (cfg.yaml:3) must be below `num_machines: 2`"],
    );
    let e = error_of("num_processes: 4\nnum_machines: 2\n");
    assert_contains(
        &e,
        &["`num_machines: 2` (cfg.yaml:2) needs `main_process_ip`"],
    );
    let e = error_of("num_processes: 4\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n");
    assert_contains(
        &e,
        &[
            "`fsdp_sharding_strategy: HYBRID_SHARD` (cfg.yaml:3) shards inside each machine",
            "at least 2 machines",
        ],
    );
    let ok = "num_processes: 4\nnum_machines: 2\nmain_process_ip: 127.0.0.1\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD_ZERO2\n";
    assert_eq!(
        resolve_file(ok).unwrap().fsdp.sharding_strategy,
        ShardingStrategy::HybridShardZero2
    );
    let e = error_of(
        "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_reshard_after_forward: false\n",
    );
    assert_contains(
        &e,
        &["ask for different strategies (FULL_SHARD vs SHARD_GRAD_OP)"],
    );
    let e = error_of("distributed_type: MULTI_CPU\nfsdp_config:\n  fsdp_offload_params: true\n");
    assert_contains(
        &e,
        &[
            "`fsdp_offload_params: true` (cfg.yaml:3)",
            "`distributed_type: MULTI_CPU` (cfg.yaml:1)",
        ],
    );
    let e = error_of("distributed_type: NO\nnum_processes: 2\n");
    assert_contains(&e, &["runs a single process"]);
    // Accelerate's non-FSDP files carry an empty `fsdp_config: {}`: that is fine.
    resolve_file("distributed_type: MULTI_CPU\nnum_processes: 2\nfsdp_config: {}\n").unwrap();
}

#[test]
fn all_problems_are_reported_at_once() {
    let e = error_of("num_proceses: 2\ndebug: maybe\nfsdp_config:\n  fsdp_bogus: 1\n");
    assert_contains(
        &e,
        &[
            "3 configuration problems",
            "num_proceses",
            "debug",
            "fsdp_bogus",
        ],
    );
}

#[test]
fn not_applicable_keys_are_reported_not_dropped() {
    let text = format!("{GUIDE}deepspeed_config:\n  zero_stage: 3\n")
        .replace("tpu_use_sudo: false", "tpu_use_sudo: true")
        .replace("fsdp_use_orig_params: true", "fsdp_use_orig_params: false");
    let c = resolve_file(&text).unwrap();
    let na: Vec<&str> = c
        .not_applicable()
        .iter()
        .map(|(k, _, _)| k.name())
        .collect();
    assert_eq!(
        na,
        ["tpu_use_sudo", "deepspeed_config", "fsdp_use_orig_params"]
    );
    // And they survive a rewrite.
    let rewritten = file(&text).unwrap().to_yaml();
    assert_contains(
        &rewritten,
        &["deepspeed_config:\n  zero_stage: 3\n", "tpu_use_sudo: true"],
    );
}

#[test]
fn null_means_unset_and_empty_file_is_defaults() {
    let c = resolve_file("main_process_ip: null\nmain_process_port: ~\n").unwrap();
    assert_eq!(
        (
            c.launch.main_process_ip.as_deref(),
            c.launch.main_process_port
        ),
        (None, None)
    );
    resolve_file("").unwrap();
    resolve_file("# only a comment\n").unwrap();
}

/// A program that a cluster's launcher starts (no `fsdp launch`) resolves the job's layout
/// from that launcher's variables, so hybrid sharding finds its machines; SLURM's uneven
/// block layout has no whole number of processes per machine, and hybrid is refused there.
#[test]
fn cluster_launchers_give_workers_their_layout() {
    let hybrid = ("FSDP_SHARDING_STRATEGY", "HYBRID_SHARD");
    let mpi = env(&[
        hybrid,
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]);
    let distributed = file("distributed_type: FSDP\n").unwrap();
    let r = ResolvedConfig::resolve(&[&mpi, &distributed]).unwrap();
    assert_eq!((r.launch.num_processes, r.launch.num_machines), (4, 2));
    assert_eq!(r.launch.machine_rank, 1);
    let slurm = |per_node: &str| {
        env(&[
            hybrid,
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", per_node),
            ("SLURM_JOB_NODELIST", "cn[1-2]"),
        ])
    };
    let r = ResolvedConfig::resolve(&[&slurm("2(x2)"), &distributed]).unwrap();
    assert_eq!(
        (r.launch.num_machines, r.launch.main_process_ip.as_deref()),
        (2, Some("cn1"))
    );
    let e = ResolvedConfig::resolve(&[&slurm("3,1"), &distributed]).unwrap_err();
    assert_contains(
        &e.to_string(),
        &["at least 2 machines with the same number of processes"],
    );
}

/// A configuration asking for another layout than the one the cluster's launcher started
/// is an error naming both, not silently outvoted by the launcher's variables.
#[test]
fn a_cluster_layout_that_disagrees_with_the_file_is_an_error() {
    let mpi = env(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]);
    let four = file("distributed_type: FSDP\nnum_processes: 4\n").unwrap();
    let e = ResolvedConfig::resolve(&[&mpi, &four])
        .unwrap_err()
        .to_string();
    assert_contains(
        &e,
        &[
            "`num_processes: 2` (environment variable OMPI_COMM_WORLD_SIZE)",
            "`num_processes: 4` (cfg.yaml:2)",
        ],
    );
    let two = file("distributed_type: FSDP\nnum_processes: 2\n").unwrap();
    ResolvedConfig::resolve(&[&mpi, &two]).unwrap();
    // fsdp's own commands are launchers: they drop what the cluster's variables say.
    let mut launcher = mpi.clone();
    launcher.drop_cluster_layout();
    assert!(launcher.get(fsdp::config::Key::NumProcesses).is_none());
}
