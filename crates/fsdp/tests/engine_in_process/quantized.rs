//! ZeRO++'s communication on the in-process communicator: with int8 weights and gradients
//! training stays within the rounding of the full-precision run; with a secondary partition
//! (hpZ) it is the same run, bit for bit.

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
pub(super) fn within_rounding(what: &str, got: &[RankResult], want: &[RankResult], tolerance: f64) {
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

/// `fsdp_hpz_partition_size` (ZeRO++'s hpZ): backward gathers each unit from the secondary
/// group of 2 consecutive ranks, out of the share each kept after forward's gather; since
/// that share is forward's gathered block, training is the same run bit for bit — with f32
/// and int8 gathers, FULL_SHARD on 4 ranks and HYBRID_SHARD on 2 machines of 4 — and the
/// secondary group carries backward's gathers (bytes sent there, none without it).
#[test]
fn a_secondary_partition_trains_the_same_run() {
    const STEPS: usize = 4;
    let cases = [
        (ShardingStrategy::FullShard, 4, None, AllGatherDtype::Auto),
        (ShardingStrategy::FullShard, 4, None, AllGatherDtype::Int8),
        (
            ShardingStrategy::HybridShard,
            8,
            Some(4),
            AllGatherDtype::Int8,
        ),
    ];
    for (strategy, world, hybrid, gather) in cases {
        let plain = Compute {
            gather,
            ..Compute::cpu()
        };
        let hpz = Compute {
            hpz: 2,
            ..plain.clone()
        };
        let want = run_with(world, 0, STEPS, None, strategy, hybrid, plain);
        let got = run_with(world, 0, STEPS, None, strategy, hybrid, hpz);
        let what = format!("{strategy} on {world} ranks, gathers {gather:?}");
        assert_eq!(losses(&got), losses(&want), "{what}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.params, w.params, "{what}");
            assert_eq!(w.secondary_bytes, 0, "{what}");
            assert!(
                g.secondary_bytes > 0,
                "{what}: nothing gathered from the secondary group"
            );
        }
    }
}

/// A secondary partition that cannot work is refused naming the key, before any collective:
/// under a strategy that never gathers again in backward, or of a size that does not divide
/// the shard group.
#[test]
fn a_secondary_partition_that_cannot_work_is_refused() {
    use std::sync::Arc;

    use candle_core::{DType, Device};
    use fsdp::config::FsdpPlugin;
    use fsdp::engine::Fsdp;
    use fsdp::nn::{LocalParams, Module};
    use fsdp_comm::{Communicator, LocalGroup};

    let m = super::model();
    let init = LocalParams::init(&m.info(), 7, DType::F32, &Device::Cpu).unwrap();
    for (strategy, size, says) in [
        (
            ShardingStrategy::ShardGradOp,
            2,
            "use FULL_SHARD or HYBRID_SHARD",
        ),
        (
            ShardingStrategy::FullShard,
            3,
            "does not divide the 4 ranks",
        ),
    ] {
        let plugin = FsdpPlugin::builder()
            .sharding_strategy(strategy)
            .hpz_partition_size(size)
            .build()
            .unwrap();
        let group: Arc<dyn Communicator> = Arc::new(LocalGroup::create(4).remove(0));
        let e = Fsdp::wrap(&m, &init.tensors(), &plugin, group)
            .err()
            .unwrap();
        let e = e.to_string();
        assert!(
            e.contains(&format!("`fsdp_hpz_partition_size: {size}`")) && e.contains(says),
            "{e}"
        );
    }
}

/// `fsdp_reduce_dtype: int4` (ZeRO++'s 4-bit gradients: 15 levels a block of 128): FULL_SHARD
/// on 2 and 4 ranks, HYBRID_SHARD on 2 x 2, and two hops over 2 machines of 2, within 2e-3
/// of the f32 reduction's losses over 8 steps (measured: 5.6e-4 at most, as int8's) and
/// within Adam's reach of its weights.
#[test]
fn an_int4_reduction_trains_as_the_f32_reduction_within_its_rounding() {
    const STEPS: usize = 8;
    let int4 = Compute {
        reduce: ReduceDtype::Int4,
        ..Compute::cpu()
    };
    let full = ShardingStrategy::FullShard;
    let two_hops = Compute {
        machines: Some(2),
        ..int4.clone()
    };
    let cases = [
        (full, 2, None, int4.clone()),
        (full, 4, None, int4.clone()),
        (ShardingStrategy::HybridShard, 4, Some(2), int4.clone()),
        (full, 4, None, two_hops),
    ];
    for (strategy, world, hybrid, compute) in cases {
        let hops = compute.machines;
        let want = run_with(world, 0, STEPS, None, strategy, hybrid, Compute::cpu());
        let got = run_with(world, 0, STEPS, None, strategy, hybrid, compute);
        let what = format!(
            "int4 {strategy} on {world} ranks (shard groups {hybrid:?}, machines {hops:?})"
        );
        within_rounding(&what, &got, &want, 2e-3);
    }
}
