//! Wrap policies, ignored modules, tied parameters and shard layouts of the unit plan.

use std::collections::BTreeSet;

use fsdp::config::{AutoWrapPolicy, FsdpPlugin, Layer, ShardingStrategy};
use fsdp::engine::{PlanError, UnitPlan};
use fsdp::models::{
    BertConfig, BertForSequenceClassification, BertModel, Gpt2Config, Gpt2LmHeadModel,
};
use fsdp::nn::Module;

fn bert() -> BertForSequenceClassification {
    BertForSequenceClassification::new(
        BertConfig::from_json(r#"{"vocab_size": 100, "hidden_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 8}"#).unwrap(),
    ).unwrap()
}

fn plugin(
    f: impl FnOnce(fsdp::config::FsdpPluginBuilder) -> fsdp::config::FsdpPluginBuilder,
) -> FsdpPlugin {
    f(FsdpPlugin::builder())
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp
}

fn names(plan: &UnitPlan) -> Vec<(String, usize)> {
    plan.units
        .iter()
        .map(|u| (u.path.clone(), u.params.len()))
        .collect()
}

#[test]
fn transformer_wrap_uses_the_models_default_list_and_covers_every_parameter_once() {
    let model = bert();
    let info = model.info();
    let plan = UnitPlan::build(&info, &plugin(|b| b), BertModel::no_split_modules(), 2).unwrap();
    let units = names(&plan);
    assert_eq!(
        units[0],
        ("".to_string(), 4),
        "root keeps pooler and classifier"
    );
    assert_eq!(units[1], ("bert.embeddings".to_string(), 5));
    assert_eq!(
        units[2..]
            .iter()
            .map(|(p, n)| (p.as_str(), *n))
            .collect::<Vec<_>>(),
        [
            ("bert.encoder.layer.0", 16),
            ("bert.encoder.layer.1", 16),
            ("bert.encoder.layer.2", 16),
            ("bert.encoder.layer.3", 16),
        ]
    );
    let planned: BTreeSet<String> = plan
        .units
        .iter()
        .flat_map(|u| u.params.iter().map(|p| p.name.clone()))
        .collect();
    let all: BTreeSet<String> = info.all_params().iter().map(|p| p.name.clone()).collect();
    assert_eq!(planned, all);
    assert_eq!(
        plan.units.iter().map(|u| u.params.len()).sum::<usize>(),
        all.len()
    );
    assert!(
        plan.render()
            .contains("unit 2: bert.encoder.layer.0 (BertLayer)")
    );
}

#[test]
fn explicit_classes_size_policy_and_no_wrap() {
    let info = bert().info();
    let plan = UnitPlan::build(
        &info,
        &plugin(|b| b.transformer_layer_cls_to_wrap("BertLayer")),
        &[],
        2,
    )
    .unwrap();
    assert_eq!(plan.units.len(), 5);
    assert_eq!(
        plan.units[0].params.len(),
        5 + 4,
        "embeddings, pooler and classifier in the root"
    );

    let err = UnitPlan::build(
        &info,
        &plugin(|b| b.transformer_layer_cls_to_wrap("GPT2Block,BertLayer")),
        &[],
        2,
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, PlanError::NoSuchModuleType { .. }));
    assert!(
        text.contains("[\"GPT2Block\"]")
            && text.contains("BertLayer")
            && text.contains("BertSelfAttention")
            && !text.contains("did you mean"),
        "{text}"
    );
    // A name that differs only in case, or by a typo, gets the type it likely meant.
    for (given, meant) in [("BERTLAYER", "BertLayer"), ("BertLayr", "BertLayer")] {
        let text = UnitPlan::build(
            &info,
            &plugin(|b| b.transformer_layer_cls_to_wrap(given)),
            &[],
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(
            text.contains(&format!("did you mean `{meant}` for `{given}`?")),
            "{text}"
        );
    }

    // A layer of this model has 4*(16*16+16) + (16*32+32) + (32*16+16) + 2*(16+16) = 2224 parameters.
    let layer_params = info
        .modules()
        .iter()
        .find(|m| m.path == "bert.encoder.layer.0")
        .map(|m| {
            m.modules()
                .iter()
                .flat_map(|x| &x.params)
                .map(|p| p.shape.iter().product::<usize>())
                .sum::<usize>()
        });
    assert_eq!(layer_params, Some(2224));
    let plan = UnitPlan::build(
        &info,
        &plugin(|b| {
            b.auto_wrap_policy(AutoWrapPolicy::SizeBasedWrap)
                .min_num_params(2000)
        }),
        &[],
        2,
    )
    .unwrap();
    let paths: Vec<&str> = plan.units.iter().map(|u| u.path.as_str()).collect();
    // Layers reach the threshold alone; the embeddings (1792) do not, and are wrapped together
    // with the pooler by their parent `bert`; the classifier stays in the root.
    assert_eq!(
        paths,
        [
            "",
            "bert.encoder.layer.0",
            "bert.encoder.layer.1",
            "bert.encoder.layer.2",
            "bert.encoder.layer.3",
            "bert"
        ]
    );
    assert_eq!(plan.units[0].params.len(), 2);
    let plan = UnitPlan::build(
        &info,
        &plugin(|b| b.auto_wrap_policy(AutoWrapPolicy::NoWrap)),
        &[],
        2,
    )
    .unwrap();
    assert_eq!(plan.units.len(), 1);
}

#[test]
fn ignored_modules_are_replicated() {
    let info = bert().info();
    let plan = UnitPlan::build(
        &info,
        &plugin(|b| b.ignored_modules("^classifier$")),
        BertModel::no_split_modules(),
        4,
    )
    .unwrap();
    let ignored: Vec<&str> = plan.ignored.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(ignored, ["classifier.weight", "classifier.bias"]);
    assert!(
        plan.units
            .iter()
            .all(|u| u.params.iter().all(|p| !p.name.starts_with("classifier")))
    );
}

#[test]
fn tied_parameters_stay_in_one_unit_or_stop_the_run() {
    let gpt2 = Gpt2LmHeadModel::new(
        Gpt2Config::from_json(
            r#"{"vocab_size": 50, "n_positions": 8, "n_embd": 16, "n_layer": 2, "n_head": 2}"#,
        )
        .unwrap(),
    )
    .unwrap();
    let info = gpt2.info();
    let plan = UnitPlan::build(
        &info,
        &plugin(|b| b),
        Gpt2LmHeadModel::no_split_modules(),
        2,
    )
    .unwrap();
    assert!(
        plan.units[0]
            .params
            .iter()
            .any(|p| p.name == "transformer.wte.weight")
    );
    let err = UnitPlan::build(
        &info,
        &plugin(|b| b.transformer_layer_cls_to_wrap("Embedding,GPT2Block")),
        &[],
        2,
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("`transformer.wte.weight` is shared by `transformer.wte`")
            && text.contains("`lm_head`"),
        "{text}"
    );
}

#[test]
fn shard_layout_pads_dim_zero_and_memory_follows_the_strategy() {
    let info = bert().info();
    let plan = UnitPlan::build(&info, &plugin(|b| b), BertModel::no_split_modules(), 3).unwrap();
    let word = plan
        .units
        .iter()
        .flat_map(|u| &u.params)
        .find(|p| p.name == "bert.embeddings.word_embeddings.weight")
        .unwrap();
    assert_eq!((word.rows_per_rank, word.row_elems), (34, 16));
    assert_eq!((word.rows_of(0), word.rows_of(2)), ((0, 34), (68, 100)));
    let bias = plan
        .units
        .iter()
        .flat_map(|u| &u.params)
        .find(|p| p.name == "classifier.bias")
        .unwrap();
    assert_eq!(
        (bias.rows_per_rank, bias.rows_of(2)),
        (1, (2, 2)),
        "a rank may hold only padding"
    );

    let total: usize = info.num_params();
    let full = UnitPlan::build(&info, &plugin(|b| b), BertModel::no_split_modules(), 4)
        .unwrap()
        .memory_estimate();
    let ddp = UnitPlan::build(
        &info,
        &plugin(|b| b.sharding_strategy(ShardingStrategy::NoShard)),
        BertModel::no_split_modules(),
        4,
    )
    .unwrap()
    .memory_estimate();
    assert_eq!(ddp.params, total * 4);
    assert_eq!(ddp.optimizer, 2 * total * 4);
    assert_eq!(ddp.gathered_peak, 0);
    // Sharded state is a quarter (plus padding) of the replicated one.
    let ratio = full.params as f64 / ddp.params as f64;
    assert!((0.25..0.27).contains(&ratio), "{ratio}");
    assert!(full.gathered_peak > 0 && full.total() < ddp.total());
    // Mixed precision gathers half the bytes; master state stays f32.
    let bf16 = UnitPlan::build(
        &info,
        &plugin(|b| b.mixed_precision(fsdp::config::MixedPrecision::Bf16)),
        BertModel::no_split_modules(),
        4,
    )
    .unwrap()
    .memory_estimate();
    assert_eq!(2 * bf16.gathered_peak, full.gathered_peak);
    assert_eq!(
        (bf16.params, bf16.grads, bf16.optimizer),
        (full.params, full.grads, full.optimizer)
    );
    // Offloaded to disk, state leaves memory for the disk tier (shards, gradients and two
    // Adam buffers), and memory streams two units' blocks of each kind.
    let disk = UnitPlan::build(
        &info,
        &plugin(|b| b.offload_params(true).offload_dir("/scratch")),
        BertModel::no_split_modules(),
        4,
    )
    .unwrap();
    let blocks = {
        let mut b: Vec<usize> = disk.units.iter().map(|u| u.shard_numel()).collect();
        b.sort_unstable_by(|x, y| y.cmp(x));
        b[0] + b[1]
    };
    let largest = {
        let plan =
            UnitPlan::build(&info, &plugin(|b| b), BertModel::no_split_modules(), 4).unwrap();
        plan.units.iter().map(|u| u.numel()).max().unwrap()
    };
    let largest_block = {
        let plan =
            UnitPlan::build(&info, &plugin(|b| b), BertModel::no_split_modules(), 4).unwrap();
        plan.units.iter().map(|u| u.shard_numel()).max().unwrap()
    };
    let disk = disk.memory_estimate();
    // Backward: the largest unit's gradient and its packed f32 copy; offloaded, also three
    // of its blocks (being written, waiting, read ahead).
    assert_eq!(full.reducing, largest * 8);
    assert_eq!(disk.reducing, full.reducing + 3 * largest_block * 4);
    // The peak: state kept in memory plus the larger of backward's and the step's buffers.
    assert_eq!(
        disk.total(),
        (disk.gathered_peak + disk.reducing).max(disk.streaming)
    );
    assert_eq!((disk.params, disk.grads, disk.optimizer), (0, 0, 0));
    assert_eq!(disk.disk, full.params + full.grads + full.optimizer);
    assert_eq!(disk.streaming, 4 * blocks * 4);
    assert_eq!(disk.gathered_peak, full.gathered_peak);
    let state_only = UnitPlan::build(
        &info,
        &plugin(|b| b.offload_optimizer(true).offload_dir("/scratch")),
        BertModel::no_split_modules(),
        4,
    )
    .unwrap()
    .memory_estimate();
    assert_eq!((state_only.params, state_only.optimizer), (full.params, 0));
    assert_eq!(state_only.disk, full.optimizer);
    assert_eq!(full.disk + full.streaming, 0);
}
