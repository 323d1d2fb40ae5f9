//! Two-hop collectives across machines (`fsdp_hierarchical_collectives`) on the in-process
//! communicator: gathers deliver what flat ones deliver (the first step's loss is the same
//! bit for bit), f32 reductions add in another order (training equal within 1e-5 over 6
//! steps), int8 ones round each machine's mean once more (within the int8 bounds), and the
//! shard group itself then carries only the other collectives.

use fsdp::config::{AllGatherDtype, ReduceDtype, ShardingStrategy};

use super::quantized::within_rounding;
use super::{Compute, close, losses, run_with};

/// FULL_SHARD and SHARD_GRAD_OP on 2 machines of 2 ranks, 3 machines of 2 and 2 machines of
/// 3: losses and weights as the flat collectives' within 1e-5, both hops used.
#[test]
fn two_hops_train_like_flat_collectives() {
    const STEPS: usize = 6;
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
        for (world, per_machine) in [(4, 2), (6, 2), (6, 3)] {
            let what = format!("{strategy} on {world} ranks, machines of {per_machine}");
            let flat = run_with(world, 0, STEPS, None, strategy, None, Compute::cpu());
            let hops = Compute {
                machines: Some(per_machine),
                ..Compute::cpu()
            };
            let got = run_with(world, 0, STEPS, None, strategy, None, hops);
            let (g, w) = (losses(&got), losses(&flat));
            assert_eq!(
                g[0], w[0],
                "{what}: the first forward computed on other values"
            );
            for (step, (a, b)) in g.iter().zip(&w).enumerate() {
                assert!(
                    (a - b).abs() / b < 1e-5,
                    "{what} step {step}: loss {a} vs {b}"
                );
            }
            let (gf, wf) = (
                got[0].full.as_ref().unwrap(),
                flat[0].full.as_ref().unwrap(),
            );
            for (name, want) in wf {
                let g: Vec<f32> = gf[name].flatten_all().unwrap().to_vec1().unwrap();
                let w: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
                assert!(close(name, &g, &w, STEPS), "{what}: {name}");
            }
            for (rank, (g, w)) in got.iter().zip(&flat).enumerate() {
                let (within, across) = g.two_hop_bytes;
                assert!(
                    within > 0 && across > 0,
                    "{what}: rank {rank} {within} {across}"
                );
                assert_eq!(w.two_hop_bytes, (0, 0), "{what}: rank {rank}");
                // Left on the shard group: the gradient norm's all-reduce and the full state
                // gathered at the end (a fifth to a third of the flat run's bytes here).
                assert!(
                    g.shard_bytes * 2 < w.shard_bytes,
                    "{what}: rank {rank} still sent {} of {} bytes flat",
                    g.shard_bytes,
                    w.shard_bytes
                );
            }
        }
    }
}

/// int8 gathers and reductions with a secondary partition of each machine, in two hops:
/// within the int8 bounds of the f32 flat run (2e-3 on losses over 8 steps, Adam's reach on
/// weights), on 2 machines of 2 and 2 machines of 3.
#[test]
fn two_hops_with_int8_and_a_secondary_partition_train_within_int8_rounding() {
    const STEPS: usize = 8;
    let strategy = ShardingStrategy::FullShard;
    for (world, per_machine) in [(4, 2), (6, 3)] {
        let want = run_with(world, 0, STEPS, None, strategy, None, Compute::cpu());
        let zero_pp = Compute {
            gather: AllGatherDtype::Int8,
            reduce: ReduceDtype::Int8,
            hpz: per_machine as u64,
            machines: Some(per_machine),
            ..Compute::cpu()
        };
        let got = run_with(world, 0, STEPS, None, strategy, None, zero_pp);
        let what = format!("int8 and hpZ in two hops on {world} ranks, machines of {per_machine}");
        within_rounding(&what, &got, &want, 2e-3);
        assert!(got.iter().all(|r| r.secondary_bytes > 0), "{what}");
    }
}
