//! The loader's sharding, ordering, resumption and epoch handling.

use super::*;

#[test]
fn reading_on_after_an_epoch_ends_starts_the_next_as_set_epoch_would() {
    let loader = || {
        DataLoader::new((0..10u32).collect::<Vec<u32>>(), 4, |items: &[u32]| {
            Ok::<_, CollateError>(items.to_vec())
        })
        .shuffle(7)
    };
    // An epoch loop around `while let`, with no set_epoch: every epoch is read, in its
    // own order, exactly as with set_epoch(e) before each.
    let (mut plain, mut set) = (loader(), loader());
    for epoch in 0..3u64 {
        let mut got = Vec::new();
        while let Some(b) = plain.next_batch() {
            got.push(b.unwrap().batch);
        }
        set.set_epoch(epoch);
        let mut want = Vec::new();
        while let Some(b) = set.next_batch() {
            want.push(b.unwrap().batch);
        }
        assert_eq!(got.len(), 3, "epoch {epoch} read nothing");
        assert_eq!(got, want, "epoch {epoch}");
        assert_eq!(plain.position().epoch, epoch);
    }
    // A program that moves on itself after the end (the examples do) skips nothing.
    let mut own = loader();
    while own.next_batch().is_some() {}
    own.set_epoch(own.position().epoch + 1);
    assert_eq!(own.position().epoch, 1);
    assert!(own.next_batch().is_some());
    // An empty dataset ends every epoch at once, whatever is asked.
    let mut empty = DataLoader::new(Vec::<u32>::new(), 4, |items: &[u32]| {
        Ok::<_, CollateError>(items.to_vec())
    });
    assert!((0..5).all(|_| empty.next_batch().is_none()));
}

#[test]
fn split_batches_share_a_global_batch_the_ranks_do_not_divide() {
    // 20 examples, global batches of 8 over 3 ranks: shares 3, 3, 2, disjoint, every
    // example of a step once; the last step (4 left) filled up from the epoch's start.
    let shares = |ranks: usize| -> Vec<Vec<Vec<usize>>> {
        (0..ranks)
            .map(|r| {
                let mut l =
                    DataLoader::new((0..20usize).collect::<Vec<_>>(), 8, |x: &[usize]| {
                        Ok(x.to_vec())
                    })
                    .split_batches(true)
                    .shard(r, ranks);
                assert_eq!((l.global_batch_size(), l.steps_per_epoch()), (8, 3));
                std::iter::from_fn(|| l.next_batch().map(|b| b.unwrap().indices)).collect()
            })
            .collect()
    };
    let three = shares(3);
    for (step, want) in [(0usize, 0..8usize), (1, 8..16)] {
        assert_eq!(
            three.iter().map(|r| r[step].len()).collect::<Vec<_>>(),
            [3, 3, 2]
        );
        let mut all: Vec<usize> = three.iter().flat_map(|r| r[step].clone()).collect();
        all.sort();
        assert_eq!(all, want.collect::<Vec<_>>());
    }
    assert_eq!(
        three[2][2],
        [2, 3],
        "filled up from the start: samples 22, 23 of 20"
    );
    // The same order as one process reading whole global batches.
    let one = shares(1);
    let joined: Vec<usize> = (0..3).flat_map(|r| three[r][0].clone()).collect();
    assert_eq!(joined, one[0][0]);
    // Fewer examples per step than ranks: the rank without one is told so.
    let mut l = DataLoader::new(vec![1u32, 2], 2, |x: &[u32]| Ok(x.to_vec()))
        .split_batches(true)
        .shard(2, 3);
    let e = l.next_batch().unwrap().unwrap_err().to_string();
    assert!(
        e.contains("a global batch of 2 split over 3 ranks leaves rank 2 no example"),
        "{e}"
    );
}

#[test]
fn a_collate_error_names_its_batch_and_takes_question_marks() {
    let mut loader = DataLoader::new(vec![1u32, 2, 3, 4], 2, |x: &[u32]| {
        if x.contains(&3) {
            Err("three is not allowed".into())
        } else {
            Ok(x.to_vec())
        }
    });
    loader.set_epoch(5);
    assert!(loader.next_batch().unwrap().is_ok());
    let e = loader.next_batch().unwrap().unwrap_err();
    assert_eq!(
        e.to_string(),
        "collating the batch of epoch 5, step 1: three is not allowed"
    );
    assert_eq!(
        std::error::Error::source(&e).unwrap().to_string(),
        "three is not allowed"
    );
    // `?` into the usual error types of programs.
    let boxed = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> { Err(e)? };
    assert!(boxed().is_err());
}

fn loader(n: usize, batch: usize, rank: usize, ranks: usize) -> DataLoader<Vec<usize>, Vec<usize>> {
    DataLoader::new((0..n).collect::<Vec<_>>(), batch, |x: &[usize]| {
        Ok(x.to_vec())
    })
    .shuffle(7)
    .shard(rank, ranks)
}

/// Every rank's batches of one epoch, step by step: (indices per rank, real).
fn epoch(
    n: usize,
    batch: usize,
    ranks: usize,
    drop_last: bool,
    epoch: u64,
) -> Vec<(Vec<Vec<usize>>, usize)> {
    let mut loaders: Vec<_> = (0..ranks)
        .map(|r| {
            let mut l = loader(n, batch, r, ranks).drop_last(drop_last);
            l.set_epoch(epoch);
            l
        })
        .collect();
    let mut steps = Vec::new();
    loop {
        let got: Vec<_> = loaders.iter_mut().map(|l| l.next_batch()).collect();
        if got.iter().all(Option::is_none) {
            break;
        }
        let got: Vec<LoadedBatch<Vec<usize>>> =
            got.into_iter().map(|b| b.unwrap().unwrap()).collect();
        assert!(
            got.iter()
                .all(|b| b.real == got[0].real && b.batch == b.indices)
        );
        steps.push((got.iter().map(|b| b.indices.clone()).collect(), got[0].real));
    }
    steps
}

#[test]
fn ranks_take_disjoint_parts_that_cover_the_epoch() {
    for n in [10, 12, 13, 1] {
        for ranks in 1..=4 {
            for drop_last in [false, true] {
                let steps = epoch(n, 3, ranks, drop_last, 0);
                let g = 3 * ranks;
                assert_eq!(steps.len(), if drop_last { n / g } else { n.div_ceil(g) });
                let mut seen: Vec<usize> = Vec::new();
                for (per_rank, real) in &steps {
                    // Rank order is step order: the first `real` are new, the rest repeats.
                    let all: Vec<usize> = per_rank.concat();
                    assert_eq!(all.len(), g);
                    seen.extend(&all[..*real]);
                }
                let mut sorted = seen.clone();
                sorted.sort();
                sorted.dedup();
                assert_eq!(
                    sorted.len(),
                    seen.len(),
                    "n {n}, {ranks} ranks: a repeat counted"
                );
                if drop_last {
                    assert_eq!(seen.len(), n / g * g);
                } else {
                    assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n {n}, {ranks} ranks");
                }
            }
        }
    }
}

#[test]
fn every_rank_draws_the_same_permutation_per_epoch() {
    // The concatenation over ranks is the permutation, whatever the number of ranks.
    for ranks in 1..=4 {
        let order: Vec<usize> = epoch(12, 1, ranks, false, 3)
            .into_iter()
            .flat_map(|(r, _)| r.concat())
            .collect();
        assert_eq!(order, permutation(12, 7, 3));
    }
    assert_ne!(permutation(100, 7, 0), permutation(100, 7, 1));
    assert_ne!(permutation(100, 7, 0), permutation(100, 8, 0));
    assert_ne!(permutation(100, 7, 0), (0..100).collect::<Vec<_>>());
}

#[test]
fn a_loader_set_to_a_position_continues_where_another_stopped() {
    let mut straight = loader(50, 4, 1, 2);
    straight.set_epoch(2);
    for _ in 0..3 {
        straight.next_batch();
    }
    let position = straight.position();
    assert_eq!(position, LoaderPosition::at(2, 3 * 8));
    let mut resumed = loader(50, 4, 1, 2);
    resumed.set_position(position);
    loop {
        match (straight.next_batch(), resumed.next_batch()) {
            (None, None) => break,
            (Some(a), Some(b)) => {
                let (a, b) = (a.unwrap(), b.unwrap());
                assert_eq!((a.indices, a.step, a.real), (b.indices, b.step, b.real));
            }
            _ => panic!("the resumed loader ended at another step"),
        }
    }
}

#[test]
fn a_resume_with_another_number_of_ranks_takes_each_remaining_sample_once() {
    // 96 examples, 8 per rank: 2 ranks take 8 steps (epoch 0's 6, then 2 of epoch 1),
    // and a job of 3 ranks, or of 1, continues with exactly the 64 samples left.
    let (n, batch) = (96, 8);
    let mut first: Vec<_> = (0..2).map(|r| loader(n, batch, r, 2)).collect();
    for l in &mut first {
        l.set_epoch(1);
        l.next_batch();
        l.next_batch();
    }
    let position = first[0].position();
    assert_eq!(position, LoaderPosition::at(1, 32));
    // Through a checkpoint's JSON.
    let saved: LoaderPosition =
        serde_json::from_value(serde_json::to_value(position).unwrap()).unwrap();
    let order = permutation(n, 7, 1);
    for ranks in [3, 1, 4, 2] {
        let mut resumed: Vec<_> = (0..ranks).map(|r| loader(n, batch, r, ranks)).collect();
        for l in &mut resumed {
            l.set_position(saved);
        }
        let want_steps = (n - 32).div_ceil(batch * ranks);
        assert_eq!(
            resumed[0].steps_left_in_epoch(),
            want_steps,
            "{ranks} ranks"
        );
        let mut taken: Vec<usize> = Vec::new();
        for _ in 0..want_steps {
            let got: Vec<_> = resumed
                .iter_mut()
                .map(|l| l.next_batch().unwrap().unwrap())
                .collect();
            let all: Vec<usize> = got.iter().flat_map(|b| b.indices.clone()).collect();
            taken.extend(&all[..got[0].real]);
        }
        assert!(resumed.iter_mut().all(|l| l.next_batch().is_none()));
        assert_eq!(
            taken,
            order[32..],
            "{ranks} ranks: the samples after the 32 taken"
        );
        assert_eq!(resumed[0].position(), LoaderPosition::at(1, n));
    }
    // A position saved as steps (before samples were counted) means steps of the
    // loader's own global batch.
    let legacy: LoaderPosition =
        serde_json::from_value(serde_json::json!({"epoch": 1, "step": 2})).unwrap();
    let mut l = loader(n, batch, 0, 2);
    l.set_position(legacy);
    assert_eq!(l.position(), LoaderPosition::at(1, 32));
}
