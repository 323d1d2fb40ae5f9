//! A run that goes non-finite stops before the optimizer writes NaN into the weights
//! (issue 52 item 8): a NaN or inf in any rank's gradients is an error on every rank naming
//! the first such parameter in the plan's order, with every weight as it was; the
//! accelerator names the step, or skips it when asked to.

use fsdp::accelerator::{Accelerator, AcceleratorError};
use fsdp::config::{ShardingStrategy, StateDictType};
use fsdp::engine::EngineError;
use fsdp::nn::ops::{CrossEntropy, cross_entropy};

use crate::common;
use crate::common::tiny::{OptimizerKind, Setup, Trainer, on_threads};

/// Two parameters of different units: the one first in the plan's order is named.
const A: &str = "bert.encoder.layer.0.attention.self.query.weight";
const B: &str = "classifier.weight";

/// Where `name` is in the plan: (unit, position).
fn place(engine: &fsdp::engine::Fsdp, name: &str) -> (usize, usize) {
    engine
        .plan()
        .units
        .iter()
        .enumerate()
        .find_map(|(u, unit)| Some((u, unit.params.iter().position(|p| p.name == name)?)))
        .expect("a parameter of the plan")
}

#[test]
fn one_ranks_nan_gradient_stops_every_rank_before_any_weight_changes() {
    for (clip, strategy) in [
        (None, ShardingStrategy::FullShard),
        (Some(1.0), ShardingStrategy::FullShard),
        (None, ShardingStrategy::NoShard),
    ] {
        let results = on_threads(2, move |g| {
            let rank = g.rank();
            let mut t = Trainer::new(
                g,
                Setup {
                    strategy,
                    state_dict_type: StateDictType::ShardedStateDict,
                    optimizer: OptimizerKind::AdamW,
                    dropout: 0.0,
                },
            );
            t.train(0..1);
            let before = t.weights();
            let (ids, labels) = common::tiny::batch(1);
            let params = t.engine.begin_step().unwrap();
            let logits = t.model.forward(&params, &ids, None, None).unwrap();
            let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
            t.engine.backward(params, loss, true).unwrap();
            // Rank 1 has a NaN in one weight's rows, rank 0 an inf in the other's.
            let first = if place(&t.engine, A) < place(&t.engine, B) {
                A
            } else {
                B
            };
            let (name, bad) = match rank {
                1 => (A, f32::NAN),
                _ => (B, f32::INFINITY),
            };
            let grads = t.engine.gradients_mut().expect("gradients");
            grads.get_mut(name).expect("a gradient")[0] = bad;
            if clip.is_some() {
                t.engine.clip_grad_norm(clip).unwrap();
            }
            let e = t
                .engine
                .step(t.optimizer.as_mut())
                .expect_err("a non-finite step");
            let named = match &e {
                EngineError::NonFiniteGradient { name } => name.clone(),
                other => panic!("{other}"),
            };
            (named, first, e.to_string(), before == t.weights())
        });
        for (named, first, text, unchanged) in results {
            assert_eq!(named, first, "{strategy:?} clip {clip:?}: {text}");
            assert!(
                text.contains("not finite") && text.contains(first),
                "{text}"
            );
            assert!(unchanged, "{strategy:?} clip {clip:?}: a weight changed");
        }
    }
}

#[test]
fn the_accelerator_names_the_step_or_skips_it_when_asked() {
    for skip in [false, true] {
        let mut acc = Accelerator::builder()
            .skip_non_finite_steps(skip)
            .build()
            .unwrap();
        let (mut model, mut opt) = common::tiny::prepare_with_sgd(&mut acc);
        common::tiny::accelerator_step(&mut acc, &mut model, &mut opt, 0);
        let before = acc.get_state_dict(&model).unwrap().unwrap();
        // A loss gone NaN: every gradient is NaN.
        let (ids, labels) = common::tiny::batch(1);
        let logits = model
            .forward(|m, p| m.forward(p, &ids, None, None))
            .unwrap();
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
        acc.backward(&mut model, (loss * f64::NAN).unwrap())
            .unwrap();
        let stepped = acc.optimizer_step(&mut model, &mut opt);
        match (skip, stepped) {
            (false, Err(AcceleratorError::NonFiniteGradient { step, name })) => {
                assert_eq!(step, 2);
                // Every gradient is NaN: the plan's first parameter is named.
                assert_eq!(name, model.engine().plan().units[0].params[0].name);
            }
            (true, Ok(false)) => assert!(acc.optimizer_step_was_skipped()),
            (skip, other) => panic!("skip {skip}: {:?}", other.map_err(|e| e.to_string())),
        }
        assert_eq!(acc.step(), 1, "skip {skip}: the step was counted");
        let after = acc.get_state_dict(&model).unwrap().unwrap();
        for (name, t) in &before {
            assert_eq!(common::max_abs_diff(t, &after[name]), 0.0, "{name} changed");
        }
        // Training goes on from the finite weights.
        common::tiny::accelerator_step(&mut acc, &mut model, &mut opt, 2);
        assert_eq!(acc.step(), 2);
    }
}
