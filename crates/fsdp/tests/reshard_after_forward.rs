//! `fsdp_no_reshard_after_forward`: the units it names stay gathered from forward to
//! backward (the timeline shows no all-gather before their backward), training is bitwise
//! what it is without, the plan counts their memory, and a pattern matching no unit, or a
//! strategy that keeps every unit gathered anyway, is an error naming the setting. A unit
//! released after forward refills before its backward only the parameters a backward
//! formula reads (not the embeddings' tables), and a table the last step only looked up gets
//! only the rows its lookups ask for out of the gathered block.

use fsdp::config::{FsdpPlugin, Layer, ShardingStrategy, StateDictType};
use fsdp::engine::UnitPlan;
use fsdp::nn::Module;

use crate::common::tiny::{OptimizerKind, Setup, Trainer, on_threads};

fn setup() -> Setup {
    Setup {
        strategy: ShardingStrategy::FullShard,
        state_dict_type: StateDictType::ShardedStateDict,
        optimizer: OptimizerKind::AdamW,
        dropout: 0.0,
    }
}

/// The plugin: FULL_SHARD, tracing into `trace`, keeping the units `kept` matches.
fn plugin(kept: Option<&str>, trace: &std::path::Path) -> FsdpPlugin {
    let mut b = FsdpPlugin::builder()
        .sharding_strategy(ShardingStrategy::FullShard)
        .trace_dir(trace.to_str().unwrap());
    if let Some(k) = kept {
        b = b.no_reshard_after_forward(k);
    }
    b.resolve(&Layer::new(), None).unwrap().fsdp
}

/// Trains 3 steps on 2 threads-as-ranks: rank 0's weights, and the all-gathers every trace
/// file of `trace` records before a backward, by unit.
fn train(
    kept: Option<&'static str>,
    trace: &std::path::Path,
) -> (
    std::collections::BTreeMap<String, Vec<f32>>,
    std::collections::BTreeMap<String, usize>,
) {
    let dir = trace.to_path_buf();
    let weights = on_threads(2, move |g| {
        let mut t = Trainer::with_plugin(g, setup(), &plugin(kept, &dir));
        t.train(0..3);
        t.weights()
    });
    let mut regathered = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(trace).unwrap() {
        let path = e.unwrap().path();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for ev in doc["traceEvents"].as_array().unwrap() {
            if ev["cat"] == "all_gather" {
                let unit = ev["args"]["unit"].as_str().unwrap().to_string();
                let before_backward = ev["args"]["when"] == "before its backward";
                *regathered.entry(unit).or_insert(0) += usize::from(before_backward);
            }
        }
    }
    (weights.into_iter().flatten().next().unwrap(), regathered)
}

#[test]
fn kept_units_are_not_gathered_again_for_backward_and_train_bitwise_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let (plain, plain_gathers) = train(None, &tmp.path().join("plain"));
    let (kept, kept_gathers) = train(Some(r"^bert\.encoder\.layer\.0$"), &tmp.path().join("kept"));
    assert_eq!(kept, plain, "the same gathered values, the same steps");
    assert!(
        plain_gathers["bert.encoder.layer.0"] > 0,
        "{plain_gathers:?}"
    );
    assert_eq!(kept_gathers["bert.encoder.layer.0"], 0, "{kept_gathers:?}");
    assert_eq!(
        kept_gathers["bert.encoder.layer.1"],
        plain_gathers["bert.encoder.layer.1"]
    );
}

/// Per unit, the parameters its refills before backward wrote (every trace file of `trace`),
/// each with the bytes the refill events reported in all.
fn refills(
    trace: &std::path::Path,
) -> std::collections::BTreeMap<String, (std::collections::BTreeSet<String>, u64)> {
    let mut by_unit = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(trace).unwrap() {
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(e.unwrap().path()).unwrap()).unwrap();
        for ev in doc["traceEvents"].as_array().unwrap() {
            if ev["cat"] == "refill" {
                let unit = ev["args"]["unit"].as_str().unwrap().to_string();
                let (names, bytes) = by_unit
                    .entry(unit)
                    .or_insert((std::collections::BTreeSet::new(), 0));
                for p in ev["args"]["params"].as_array().unwrap() {
                    names.insert(p.as_str().unwrap().to_string());
                }
                *bytes += ev["args"]["bytes"].as_u64().unwrap();
            }
        }
    }
    by_unit
}

#[test]
fn a_unit_released_after_forward_refills_only_what_its_backward_reads() {
    let tmp = tempfile::tempdir().unwrap();
    train(None, tmp.path());
    let info = crate::common::tiny::model(0.0).info();
    let params = info.all_params();
    let numel = |name: &str| params.iter().find(|p| p.name == name).unwrap().numel() as u64;
    let refilled = refills(tmp.path());
    // 3 steps on 2 ranks: each unit released after forward refills 6 times.
    let (embeddings, bytes) = &refilled["bert.embeddings"];
    let norms = [
        "bert.embeddings.LayerNorm.bias",
        "bert.embeddings.LayerNorm.weight",
    ];
    assert_eq!(
        embeddings.iter().map(String::as_str).collect::<Vec<_>>(),
        norms,
        "the tables (read in backward only as ids) stay released: {refilled:?}"
    );
    assert_eq!(*bytes, 6 * 4 * norms.iter().map(|n| numel(n)).sum::<u64>());
    let (layer, bytes) = &refilled["bert.encoder.layer.0"];
    let all: Vec<&str> = params
        .iter()
        .map(|p| p.name.as_str())
        .filter(|n| n.starts_with("bert.encoder.layer.0."))
        .collect();
    assert_eq!(layer.len(), all.len(), "{layer:?}");
    assert_eq!(*bytes, 6 * 4 * all.iter().map(|n| numel(n)).sum::<u64>());
}

#[test]
fn a_table_the_last_step_only_looked_up_gets_only_its_looked_up_rows() {
    let tmp = tempfile::tempdir().unwrap();
    train(None, tmp.path());
    // Per rank, the tables each forward of the embeddings unit wrote row by row.
    let mut forwards = Vec::new();
    for e in std::fs::read_dir(tmp.path()).unwrap() {
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(e.unwrap().path()).unwrap()).unwrap();
        let mut steps: Vec<(f64, Vec<String>)> = doc["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|ev| ev["cat"] == "forward" && ev["args"]["unit"] == "bert.embeddings")
            .map(|ev| {
                let tables = ev["args"]["by_rows"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let tables = tables.iter().map(|t| t.as_str().unwrap().to_string());
                (ev["ts"].as_f64().unwrap(), tables.collect())
            })
            .collect();
        steps.sort_by(|a, b| a.0.total_cmp(&b.0));
        forwards.push(steps.into_iter().map(|s| s.1).collect::<Vec<_>>());
    }
    let tables: Vec<String> = ["word", "position", "token_type"]
        .iter()
        .map(|t| format!("bert.embeddings.{t}_embeddings.weight"))
        .collect();
    for rank in &forwards {
        // The first step unpacks them whole; the next ones, having seen them only looked up,
        // write the rows each lookup asks for (the weights are bitwise those of the whole
        // unpack: `kept_units_are_not_gathered_again_for_backward_and_train_bitwise_alike`
        // and the FSDP matrix in debug mode, where the rows not written read as NaN).
        let sorted = |mut v: Vec<String>| {
            v.sort();
            v
        };
        assert_eq!(rank.len(), 3, "{forwards:?}");
        assert!(rank[0].is_empty(), "{forwards:?}");
        assert_eq!(
            sorted(rank[1].clone()),
            sorted(tables.clone()),
            "{forwards:?}"
        );
        assert_eq!(
            sorted(rank[2].clone()),
            sorted(tables.clone()),
            "{forwards:?}"
        );
    }
    assert_eq!(forwards.len(), 2);
}

#[test]
fn the_plan_counts_kept_units_and_refuses_patterns_that_do_nothing() {
    let info = crate::common::tiny::model(0.0).info();
    let plan_of =
        |p: &FsdpPlugin| UnitPlan::build(&info, p, fsdp::models::BertModel::no_split_modules(), 2);
    let with = |kept: &str, strategy| {
        FsdpPlugin::builder()
            .sharding_strategy(strategy)
            .no_reshard_after_forward(kept)
            .resolve(&Layer::new(), None)
    };
    let base = FsdpPlugin::builder()
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp;
    let plain = plan_of(&base).unwrap();
    let kept = plan_of(&with("layer", ShardingStrategy::FullShard).unwrap().fsdp).unwrap();
    let layers: usize = kept
        .units
        .iter()
        .filter(|u| u.path.contains("layer"))
        .map(|u| u.numel())
        .sum();
    assert!(layers > 0);
    assert_eq!(kept.kept_gathered(), layers);
    assert_eq!(
        kept.memory_estimate().gathered_peak - plain.memory_estimate().gathered_peak,
        layers * 4
    );
    assert!(
        kept.memory_summary()
            .contains("kept gathered from forward to backward")
    );
    assert!(!plain.memory_summary().contains("kept gathered"));
    let err = plan_of(&with("decoder", ShardingStrategy::FullShard).unwrap().fsdp)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fsdp_no_reshard_after_forward `decoder` matches no unit")
            && err.contains("bert.encoder.layer.0"),
        "{err}"
    );
    let err = with("layer", ShardingStrategy::ShardGradOp)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fsdp_no_reshard_after_forward") && err.contains("fsdp_sharding_strategy"),
        "{err}"
    );
}
