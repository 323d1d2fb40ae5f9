//! The in-process group (threads as peers) keeps the communicator contract: every collective
//! gives the same results as the definition on every member, and a mismatch, a departed
//! member, a timeout or a bad argument is an error on every member naming the ranks and the
//! op. Also the single-rank group and meshes built from them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fsdp_comm::{Buffer, Communicator, CommunicatorExt, LocalGroup, Mesh, ReduceOp, SingleRank};
use half::bf16;

/// Runs `f(member)` on one thread per member and returns the results in rank order.
fn on_members<T: Send + 'static>(
    members: Vec<LocalGroup>,
    f: impl Fn(&Arc<LocalGroup>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = members
        .into_iter()
        .map(|m| {
            let f = f.clone();
            std::thread::spawn(move || f(&Arc::new(m)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn value(rank: usize, i: usize) -> f32 {
    ((rank * 7 + i * 3) % 5) as f32
}

#[test]
fn every_collective_matches_its_definition_for_one_to_four_members() {
    for n in 1..=4 {
        let len = 6;
        let results = on_members(LocalGroup::create(n), move |g| {
            let r = g.rank();
            let mine: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
            let sum = g
                .all_reduce_vec(mine.clone(), ReduceOp::Sum)
                .wait()
                .unwrap();
            let avg = g
                .all_reduce_vec(mine.clone(), ReduceOp::Avg)
                .wait()
                .unwrap();
            let gathered = g.all_gather_vec(mine.clone()).wait().unwrap();
            let full: Vec<f32> = (0..len * n).map(|i| value(r, i)).collect();
            let (_, part) = g
                .reduce_scatter_into(Buffer::from(full), Buffer::F32(Vec::new()), ReduceOp::Sum)
                .wait()
                .unwrap();
            let part = part.into_vec::<f32>().unwrap();
            let full: Vec<f32> = (0..len * n).map(|i| value(r, i)).collect();
            let exchanged = g.all_to_all(Buffer::from(full)).wait().unwrap();
            let exchanged = exchanged.into_vec::<f32>().unwrap();
            let bcast = g.broadcast_vec(mine.clone(), n - 1).wait().unwrap();
            let gather = g.gather_vec(mine, 0).wait().unwrap();
            // The last member scatters its rows; the others pass only the element type.
            let rows = if r == n - 1 {
                Buffer::from((0..len * n).map(|i| value(r, i)).collect::<Vec<f32>>())
            } else {
                Buffer::empty(fsdp_comm::DType::F32)
            };
            let scattered = g.scatter(rows, len, n - 1).wait().unwrap();
            let scattered = scattered.into_vec::<f32>().unwrap();
            let halves = g
                .all_reduce_vec(vec![bf16::from_f32(r as f32); 3], ReduceOp::Max)
                .wait()
                .unwrap();
            g.barrier().wait().unwrap();
            (
                sum, avg, gathered, part, bcast, gather, halves, scattered, exchanged,
            )
        });
        for (r, (sum, avg, gathered, part, bcast, gather, halves, scattered, exchanged)) in
            results.iter().enumerate()
        {
            let want_sum: Vec<f32> = (0..len)
                .map(|i| (0..n).map(|q| value(q, i)).sum())
                .collect();
            assert_eq!(sum, &want_sum, "{n} members, rank {r}: all_reduce");
            let want_avg: Vec<f32> = want_sum.iter().map(|x| x / n as f32).collect();
            assert_eq!(avg, &want_avg);
            let want_gathered: Vec<f32> = (0..n)
                .flat_map(|q| (0..len).map(move |i| value(q, i)))
                .collect();
            assert_eq!(gathered, &want_gathered);
            let want_part: Vec<f32> = (r * len..(r + 1) * len)
                .map(|i| (0..n).map(|q| value(q, i)).sum())
                .collect();
            assert_eq!(part, &want_part, "reduce_scatter");
            let want_exchanged: Vec<f32> = (0..n)
                .flat_map(|q| (r * len..(r + 1) * len).map(move |i| value(q, i)))
                .collect();
            assert_eq!(exchanged, &want_exchanged, "all_to_all");
            let want_bcast: Vec<f32> = (0..len).map(|i| value(n - 1, i)).collect();
            assert_eq!(bcast, &want_bcast);
            assert_eq!(gather.is_some(), r == 0);
            if let Some(g) = gather {
                assert_eq!(g, &want_gathered);
            }
            assert_eq!(halves, &vec![bf16::from_f32((n - 1) as f32); 3]);
            let want_scattered: Vec<f32> =
                (r * len..(r + 1) * len).map(|i| value(n - 1, i)).collect();
            assert_eq!(scattered, &want_scattered, "scatter");
        }
    }
}

#[test]
fn a_mismatch_fails_every_member_naming_both_calls() {
    let errors = on_members(LocalGroup::create(3), |g| {
        let result = if g.rank() == 1 {
            g.barrier().wait()
        } else {
            g.all_reduce_vec(vec![1.0f32], ReduceOp::Sum)
                .wait()
                .map(|_| ())
        };
        let first = result.unwrap_err().to_string();
        // The group stays broken: later calls fail at once.
        let again = g.barrier().wait().unwrap_err().to_string();
        (first, again)
    });
    assert!(
        errors
            .iter()
            .any(|(e, _)| e.contains("collective mismatch") && e.contains("Barrier")),
        "{errors:#?}"
    );
    for (_, again) in &errors {
        assert!(
            again.contains("aborted because rank") || again.contains("mismatch"),
            "{again}"
        );
    }
}

#[test]
fn a_departed_member_and_a_late_one_are_named() {
    let mut members = LocalGroup::create(2);
    let second = members.pop().unwrap();
    drop(second);
    let first = members.pop().unwrap();
    let e = first.barrier().wait().unwrap_err().to_string();
    assert!(e.contains("connection to rank 1 lost"), "{e}");

    let mut members = LocalGroup::with_timeout(3, Duration::from_millis(200));
    let started = Instant::now();
    let late = members.pop().unwrap();
    let errors = on_members(members, |g| g.barrier().wait().unwrap_err().to_string());
    drop(late);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        errors
            .iter()
            .any(|e| e.contains("waiting for ranks [2]") && e.contains("timed out")),
        "{errors:#?}"
    );
}

#[test]
fn a_bad_argument_on_one_member_stops_the_others_at_once() {
    let started = Instant::now();
    let errors = on_members(LocalGroup::create(2), |g| {
        let len = if g.rank() == 0 { 5 } else { 4 };
        g.reduce_scatter_into(
            Buffer::F32(vec![1.0; len]),
            Buffer::F32(Vec::new()),
            ReduceOp::Sum,
        )
        .wait()
        .unwrap_err()
        .to_string()
    });
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        errors[0].contains("input length 5 is not a multiple of the group size 2"),
        "{errors:#?}"
    );
    assert!(
        errors[1].contains("aborted because rank 0 failed"),
        "{errors:#?}"
    );
}

#[test]
fn two_hop_collectives_match_their_definitions_over_one_to_three_machines() {
    for (n, machine) in [(2, 1), (2, 2), (4, 2), (6, 2), (6, 3)] {
        let results = on_members(LocalGroup::create(n), move |g| {
            crate::common::check_two_hops(g.as_ref(), machine)
        });
        for (rank, r) in results.into_iter().enumerate() {
            assert_eq!(r, Ok(()), "{n} members, {machine} per machine, rank {rank}");
        }
    }
    // A reduction whose input does not split into one part per member is refused naming it.
    let results = on_members(LocalGroup::create(4), |g| {
        let hops = fsdp_comm::TwoHops::new(g.as_ref(), 2).unwrap();
        let bad = hops
            .reduce_scatter(Buffer::from(vec![1f32; 6]), ReduceOp::Sum)
            .wait();
        bad.map(|_| ()).map_err(|e| e.to_string())
    });
    for r in results {
        let e = r.unwrap_err();
        assert!(
            e.contains("two-hop reduce_scatter") && e.contains("6 elements"),
            "{e}"
        );
    }
}

#[test]
fn an_in_place_all_gather_keeps_each_block_and_refuses_an_output_that_does_not_split() {
    // The trait's default (copy the block out, gather it) on in-process ranks.
    let results = on_members(LocalGroup::create(3), |g| {
        let r = g.rank();
        let mut output = vec![-1i32; 6];
        output[2 * r..2 * r + 2].copy_from_slice(&[10 * r as i32, 10 * r as i32 + 1]);
        let gathered = g.all_gather_in_place(Buffer::from(output)).wait().unwrap();
        let bad = g.all_gather_in_place(Buffer::from(vec![0i32; 7])).wait();
        (
            gathered.into_vec::<i32>().unwrap(),
            bad.unwrap_err().to_string(),
        )
    });
    for (gathered, bad) in results {
        assert_eq!(gathered, [0, 1, 10, 11, 20, 21]);
        assert!(
            bad.contains("all_gather_in_place") && bad.contains("7 elements"),
            "{bad}"
        );
    }
}

#[test]
fn single_rank_and_meshes() {
    let one = SingleRank::new(3);
    let (input, out) = one
        .all_gather_into(Buffer::from(vec![1i64, 2]), Buffer::I64(Vec::new()))
        .wait()
        .unwrap();
    assert_eq!(input.as_slice::<i64>(), out.as_slice::<i64>());
    assert!(one.broadcast(Buffer::from(vec![1u8]), 1).wait().is_err());

    // NO_SHARD's mesh: nothing on the shard dimension, everything on the replicate one.
    let results = on_members(LocalGroup::create(2), |g| {
        let mesh = Mesh::replicated(g.clone());
        let summed = mesh
            .all_reduce(Buffer::from(vec![g.rank() as f32 + 1.0]), ReduceOp::Sum)
            .unwrap();
        (
            mesh.shard_size(),
            mesh.replicas(),
            mesh.rank(),
            summed.into_vec::<f32>().unwrap(),
        )
    });
    assert_eq!(results[0], (1, 2, 0, vec![3.0]));
    assert_eq!(results[1], (1, 2, 1, vec![3.0]));
}

#[test]
fn join_names_the_members_that_did_not_come() {
    let started = Instant::now();
    let results = on_members(LocalGroup::create(3), |g| {
        if g.rank() == 2 {
            // Alive but elsewhere (a departed member would be reported as lost).
            std::thread::sleep(Duration::from_secs(1));
            return None;
        }
        Some(
            g.join("save_state", Duration::from_millis(300))
                .unwrap_err()
                .to_string(),
        )
    });
    assert!(started.elapsed() < Duration::from_secs(5));
    let e = results[0].clone().unwrap();
    assert!(
        e.contains("save_state: ranks [2] did not join"),
        "{results:?}"
    );
    // Everyone joining passes; different steps are a mismatch.
    let ok = on_members(LocalGroup::create(2), |g| {
        g.join("x", Duration::from_secs(5)).is_ok()
    });
    assert_eq!(ok, [true, true]);
    let mixed = on_members(LocalGroup::create(2), |g| {
        let what = if g.rank() == 0 { "save" } else { "load" };
        g.join(what, Duration::from_secs(5))
            .unwrap_err()
            .to_string()
    });
    assert!(
        mixed
            .iter()
            .any(|e| e.contains("join(save)") && e.contains("join(load)")),
        "{mixed:?}"
    );
}

#[test]
fn a_handle_says_when_its_collective_has_run_without_waiting() {
    let results = on_members(LocalGroup::create(2), |g| {
        // Rank 1 joins late: rank 0's all-reduce cannot have run before it does.
        if g.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        let work = g.all_reduce(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum);
        let early = work.is_finished();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !work.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let finished = work.is_finished();
        (
            early,
            finished,
            work.wait().unwrap().into_vec::<f32>().unwrap(),
        )
    });
    assert!(
        !results[0].0,
        "rank 0's all-reduce finished before its peer called it"
    );
    for (_, finished, sum) in &results {
        assert!(finished);
        assert_eq!(sum, &vec![2.0; 4]);
    }
    // A transport that does not say is never reported finished before it is waited for.
    assert!(!fsdp_comm::Work::ready(Ok(1)).is_finished());
}
