//! The next step's first gather is issued by the optimizer step, as soon as the unit the
//! next forward gathers first is updated, so a step opens with it under way; shards that
//! change before that forward (a checkpoint's load) drop it, so forward reads what was loaded.

use std::collections::BTreeMap;

use fsdp::config::{FsdpPlugin, Layer, ShardingStrategy, StateDictType};

use crate::common::tiny::{self, GLOBAL_BATCH, OptimizerKind, Setup, Trainer};

const SETUP: Setup = Setup {
    strategy: ShardingStrategy::FullShard,
    state_dict_type: StateDictType::ShardedStateDict,
    optimizer: OptimizerKind::AdamW,
    dropout: 0.0,
};

/// A trace file's events of category `cat`.
fn events<'a>(doc: &'a serde_json::Value, cat: &str) -> Vec<&'a serde_json::Value> {
    let all = doc["traceEvents"].as_array().unwrap();
    all.iter().filter(|e| e["cat"] == cat).collect()
}

#[test]
fn the_first_gather_of_a_step_is_issued_during_the_last_optimizer_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let plugin = FsdpPlugin::builder()
        .sharding_strategy(ShardingStrategy::FullShard)
        .trace_dir(dir.to_str().unwrap())
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp;
    tiny::on_threads(2, move |g| {
        Trainer::with_plugin(g, SETUP, &plugin).train(0..3);
    });
    let mut files = 0;
    for e in std::fs::read_dir(tmp.path()).unwrap() {
        let path = e.unwrap().path();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let at = |e: &serde_json::Value| e["ts"].as_f64().unwrap();
        let mut steps = events(&doc, "step");
        steps.sort_by(|a, b| at(a).total_cmp(&at(b)));
        let mut optimizer = events(&doc, "optimizer");
        optimizer.sort_by(|a, b| at(a).total_cmp(&at(b)));
        let first = events(&doc, "forward")
            .into_iter()
            .min_by(|a, b| at(a).total_cmp(&at(b)))
            .unwrap()["args"]["unit"]
            .clone();
        let gathers: Vec<f64> = events(&doc, "all_gather")
            .into_iter()
            .filter(|e| e["args"]["unit"] == first && e["args"]["when"] == "before its forward")
            .map(|e| e["args"]["issued"].as_f64().unwrap())
            .collect();
        assert_eq!((steps.len(), gathers.len()), (3, 3), "{}", path.display());
        for n in 1..3 {
            let (began, updating) = (at(steps[n]), at(optimizer[n - 1]));
            // Issued while the previous step's optimizer update ran, before this step began.
            let ahead = gathers.iter().any(|&g| g >= updating && g < began);
            assert!(
                ahead,
                "{}: step {n} began at {began} and its first unit ({first}) had gathers issued at {gathers:?}, the optimizer step before began at {updating}",
                path.display()
            );
        }
        files += 1;
    }
    assert_eq!(files, 2);
}

/// Two evaluations' logits on rank 0 after one step and, with `scale`, every shard scaled by
/// it (loaded between the step and the first evaluation).
fn evaluations(scale: Option<f32>) -> (Vec<f32>, Vec<f32>) {
    let out = tiny::on_threads(2, move |group| {
        let mut t = Trainer::new(group, SETUP);
        t.train(0..1);
        if let Some(scale) = scale {
            let shards = t.engine.local_shards().unwrap();
            let scaled: BTreeMap<String, Vec<f32>> = shards
                .iter()
                .map(|s| {
                    (
                        s.name.to_string(),
                        s.values.iter().map(|v| v * scale).collect(),
                    )
                })
                .collect();
            drop(shards);
            for (name, values) in &scaled {
                t.engine.load_local_shard(name, values).unwrap();
            }
        }
        let per_rank = GLOBAL_BATCH / 2;
        let (ids, _) = tiny::batch(5);
        let rank = t.engine.mesh().rank();
        let ids = ids.narrow(0, rank * per_rank, per_rank).unwrap();
        let eval = || {
            let params = t.engine.begin_eval(false).unwrap();
            let logits = t.model.forward(&params, &ids, None, None).unwrap();
            logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        (eval(), eval())
    });
    out.into_iter().next().unwrap()
}

#[test]
fn shards_loaded_after_a_step_are_what_its_next_forward_gathers() {
    let (trained, again) = evaluations(None);
    assert_eq!(trained, again);
    let (loaded, again) = evaluations(Some(0.5));
    assert_ne!(loaded, trained, "the load changed the model");
    assert_eq!(
        loaded, again,
        "the first forward after the load read the loaded shards"
    );
}
