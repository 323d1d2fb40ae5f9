//! One step at a time: a unit's state within a step belongs to the unit, so while a step's
//! parameters are held a second step is refused, and so are changes to the shards (the
//! optimizer step, loading rows) — each with a typed error that loses nothing: the refused
//! call leaves the gradients and weights as they were, and training goes on to the same
//! bits as a run that never made it.

use std::collections::BTreeMap;

use fsdp::config::{ShardingStrategy, StateDictType};
use fsdp::engine::EngineError;
use fsdp::nn::ops::{CrossEntropy, cross_entropy};

use crate::common::tiny::{self, GLOBAL_BATCH, OptimizerKind, Setup, Trainer};

const SETUP: Setup = Setup {
    strategy: ShardingStrategy::FullShard,
    state_dict_type: StateDictType::ShardedStateDict,
    optimizer: OptimizerKind::AdamW,
    dropout: 0.0,
};

/// Whether `result` is the open-step refusal of `op`.
fn refused<T>(result: Result<T, EngineError>, op: &str) -> bool {
    matches!(result, Err(EngineError::StepOpen { op: o }) if o == op)
}

/// Three steps on 2 thread ranks; with `misuse`, every refused call is tried in between
/// (and one forward abandoned). Rank 0's weights afterwards.
fn train(misuse: bool) -> BTreeMap<String, Vec<f32>> {
    let weights = tiny::on_threads(2, move |group| {
        let mut t = Trainer::new(group, SETUP);
        let rank = t.engine.mesh().rank();
        let per_rank = GLOBAL_BATCH / 2;
        for step in 0..3 {
            let (ids, labels) = tiny::batch(step);
            let ids = ids.narrow(0, rank * per_rank, per_rank).unwrap();
            let labels = labels.narrow(0, rank * per_rank, per_rank).unwrap();
            if misuse && step == 1 {
                // A forward abandoned before its backward: dropping its parameters ends it.
                let params = t.engine.begin_step().unwrap();
                t.model.forward(&params, &ids, None, None).unwrap();
            }
            let params = t.engine.begin_step().unwrap();
            let logits = t.model.forward(&params, &ids, None, None).unwrap();
            let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
            if misuse {
                assert!(refused(t.engine.begin_step(), "a training forward"));
                assert!(refused(t.engine.begin_eval(true), "an evaluation"));
                let shards = t.engine.local_shards().unwrap();
                let (name, rows) = (shards[0].name.to_string(), shards[0].values.to_vec());
                drop(shards);
                assert!(refused(
                    t.engine.load_local_shard(&name, &rows),
                    "loading a parameter's rows"
                ));
            }
            t.engine.backward(params, loss, true).unwrap();
            t.engine.clip_grad_norm(Some(1.0)).unwrap();
            if misuse {
                // An evaluation's parameters held over the optimizer step.
                let eval = t.engine.begin_eval(false).unwrap();
                t.model.forward(&eval, &ids, None, None).unwrap();
                assert!(refused(
                    t.engine.step(t.optimizer.as_mut()),
                    "the optimizer step"
                ));
                assert!(t.engine.gradients().is_some(), "the refusal kept them");
                drop(eval);
            }
            t.engine.step(t.optimizer.as_mut()).unwrap();
        }
        t.weights()
    });
    weights.into_iter().flatten().next().unwrap()
}

#[test]
fn a_second_step_or_a_shard_change_while_a_step_is_open_is_refused_and_loses_nothing() {
    let plain = train(false);
    let tried = train(true);
    assert_eq!(plain.len(), tried.len());
    for (name, want) in &plain {
        let got = &tried[name];
        let same = want
            .iter()
            .zip(got)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "`{name}` differs after the refused calls");
    }
}
