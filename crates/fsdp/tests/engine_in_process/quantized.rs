//! Quantized communication (ZeRO++'s int8 weights and gradients) on the in-process
//! communicator: training stays within the rounding of the full-precision run.

use fsdp::config::{AllGatherDtype, ReduceDtype, ShardingStrategy};

use super::{Compute, RankResult, losses, run, run_with};

/// `fsdp_all_gather_dtype: int8` (ZeRO++'s quantized weights): on 2 and 4 ranks, FULL_SHARD
/// and SHARD_GRAD_OP, every step's loss within 2e-3 of the run gathering f32 over 8 steps
/// (measured: 3.8e-4 at most; the rounding is real: the losses differ), every weight within
/// Adam's reach of the f32 run's (2 lr per step: this tiny model's near-zero gradients let
/// Adam turn rounding into whole steps); on 1 rank nothing is gathered and the run equals
/// the f32 one bit for bit.
#[test]
fn an_int8_gather_trains_as_the_f32_gather_within_its_rounding() {
    const STEPS: usize = 8;
    let int8 = Compute {
        gather: AllGatherDtype::Int8,
        ..Compute::cpu()
    };
    let one = run(1, 0, STEPS, None);
    let one_int8 = run_with(
        1,
        0,
        STEPS,
        None,
        ShardingStrategy::FullShard,
        None,
        int8.clone(),
    );
    assert_eq!(losses(&one), losses(&one_int8), "1 rank gathers nothing");
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
        for world in [2, 4] {
            let want = run_with(world, 0, STEPS, None, strategy, None, Compute::cpu());
            let got = run_with(world, 0, STEPS, None, strategy, None, int8.clone());
            within_rounding(&format!("{strategy} on {world} ranks"), &got, &want, 2e-3);
        }
    }
}

/// Every step's loss within `tolerance` (relative) of `want`'s yet not all equal (the
/// rounding is real), and every weight within Adam's reach of `want`'s: 2 lr per step (this
/// tiny model's near-zero gradients let Adam turn rounding into whole steps).
fn within_rounding(what: &str, got: &[RankResult], want: &[RankResult], tolerance: f64) {
    let (g, w) = (losses(got), losses(want));
    assert_ne!(
        g, w,
        "{what}: int8 rounding changed nothing: not quantized?"
    );
    for (step, (g, w)) in g.iter().zip(&w).enumerate() {
        assert!(
            (g - w).abs() / w < tolerance,
            "{what} step {step}: loss {g} vs {w}"
        );
    }
    let worst = g
        .iter()
        .zip(&w)
        .fold(0f64, |m, (g, w)| m.max((g - w).abs() / w));
    eprintln!("MEASURE {what}: {worst:e}");
    let (gf, wf) = (
        got[0].full.as_ref().unwrap(),
        want[0].full.as_ref().unwrap(),
    );
    for (name, w) in wf {
        let g: Vec<f32> = gf[name].flatten_all().unwrap().to_vec1().unwrap();
        let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let d = g
            .iter()
            .zip(&w)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let steps = losses(want).len() as f32;
        assert!(d <= 2.0 * 3e-3 * steps, "{what}: {name} moved {d} apart");
    }
}

/// `fsdp_reduce_dtype: int8` (ZeRO++'s quantized gradients: int8 parts exchanged all-to-all
/// and summed in f32; replicas' means as int8 all-gathers summed in f32): every strategy on
/// 2 and 4 ranks, with hybrid meshes of shard groups of 2 and 1, and with int8 gathers too,
/// trains within 2e-3 of the f32 reduction's losses over 8 steps (measured: 5.4e-4 at most)
/// and within Adam's reach of its weights; replicas end with equal rows bit for bit; on 1 rank nothing is reduced and
/// the run equals the f32 one bit for bit.
#[test]
fn an_int8_reduction_trains_as_the_f32_reduction_within_its_rounding() {
    const STEPS: usize = 8;
    let int8 = Compute {
        reduce: ReduceDtype::Int8,
        ..Compute::cpu()
    };
    let one = run(1, 0, STEPS, None);
    let full = ShardingStrategy::FullShard;
    let one_int8 = run_with(1, 0, STEPS, None, full, None, int8.clone());
    assert_eq!(losses(&one), losses(&one_int8), "1 rank reduces nothing");
    let both = Compute {
        gather: AllGatherDtype::Int8,
        ..int8.clone()
    };
    let cases = [
        (full, 2, None, int8.clone()),
        (full, 4, None, int8.clone()),
        (ShardingStrategy::ShardGradOp, 2, None, int8.clone()),
        (ShardingStrategy::NoShard, 2, None, int8.clone()),
        (ShardingStrategy::HybridShard, 4, Some(2), int8.clone()),
        (ShardingStrategy::HybridShardZero2, 4, Some(1), int8.clone()),
        (full, 4, None, both.clone()),
        (ShardingStrategy::HybridShard, 4, Some(2), both),
    ];
    for (strategy, world, hybrid, compute) in cases {
        let gathered = compute.gather;
        let want = run_with(world, 0, STEPS, None, strategy, hybrid, Compute::cpu());
        let got = run_with(world, 0, STEPS, None, strategy, hybrid, compute);
        let what =
            format!("{strategy} on {world} ranks (shard groups {hybrid:?}, gathers {gathered:?})");
        within_rounding(&what, &got, &want, 2e-3);
        // Replicas (the same place in each shard group) hold the same rows bit for bit.
        let shard = match (strategy, hybrid) {
            (ShardingStrategy::NoShard, _) => 1,
            (_, Some(s)) => s,
            _ => world,
        };
        for (i, r) in got.iter().enumerate().skip(shard) {
            for (name, part) in &r.params {
                assert_eq!(
                    &got[i % shard].params[name],
                    part,
                    "{what}: rank {i}'s {name}"
                );
            }
        }
    }
}
