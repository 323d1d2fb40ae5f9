//! The order an epoch's samples are taken in: a seeded permutation, the same on every rank,
//! and transformers' length grouping of it.

use crate::rng::{GOLDEN_GAMMA, SplitMix64};

/// `seed`+`epoch`'s permutation of `0..n` (the same on every rank): a splitmix64 stream
/// drives a Fisher-Yates shuffle.
pub fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut stream =
        SplitMix64::new(seed ^ epoch.wrapping_mul(GOLDEN_GAMMA) ^ 0xD1B5_4A32_D192_ED03);
    let mut next = move || stream.next_u64();
    let mut out: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        out.swap(i, j);
    }
    out
}

/// transformers' `get_length_grouped_indices` on `order`: megabatches of `mult × batch`
/// consecutive samples (`mult` = min(n / 4 batches, 50), at least 1), each sorted longest
/// first (stably), and the longest sample of all moved to the very first place (so a run that
/// runs out of memory does so at once). A permutation of `order`.
pub fn group_by_length(order: &[usize], lengths: &[usize], batch: usize) -> Vec<usize> {
    let n = order.len();
    let batch = batch.max(1);
    let mult = (n / (batch * 4)).clamp(1, 50);
    let mut grouped: Vec<Vec<usize>> = order
        .chunks(mult * batch)
        .map(|mega| {
            let mut mega = mega.to_vec();
            mega.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
            mega
        })
        .collect();
    // The megabatch whose first (longest) sample is the longest; the first such one.
    let longest = grouped
        .iter()
        .enumerate()
        .fold(None, |best: Option<(usize, usize)>, (k, mega)| {
            let len = lengths[mega[0]];
            match best {
                Some((_, l)) if l >= len => best,
                _ => Some((k, len)),
            }
        })
        .map_or(0, |(k, _)| k);
    if longest != 0 {
        let first = grouped[longest][0];
        grouped[longest][0] = grouped[0][0];
        grouped[0][0] = first;
    }
    grouped.concat()
}

/// `group_by_length`'s lengths do not match the dataset.
#[derive(Debug, thiserror::Error)]
#[error("group_by_length: {lengths} lengths for a dataset of {examples} examples")]
pub struct LengthsMismatch {
    /// Lengths given.
    pub lengths: usize,
    /// Examples in the dataset.
    pub examples: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{DataLoader, LoaderPosition};

    /// Every epoch order a loader of `ranks` ranks takes, as the dataset indices of each
    /// global step (rank by rank), and the loader's positions.
    fn global_steps(lengths: &[usize], batch: usize, ranks: usize, epoch: u64) -> Vec<Vec<usize>> {
        let loaders: Vec<_> = (0..ranks)
            .map(|r| {
                let data: Vec<usize> = (0..lengths.len()).collect();
                let mut l = DataLoader::new(data, batch, |x: &[usize]| Ok(x.to_vec()))
                    .shuffle(3)
                    .shard(r, ranks)
                    .group_by_length(lengths.to_vec())
                    .unwrap();
                l.set_epoch(epoch);
                l
            })
            .collect();
        let mut loaders = loaders;
        let mut steps = Vec::new();
        while loaders[0].steps_left_in_epoch() > 0 {
            let mut step = Vec::new();
            for l in &mut loaders {
                step.extend(l.next_batch().unwrap().unwrap().indices);
            }
            steps.push(step);
        }
        steps
    }

    #[test]
    fn grouped_batches_hold_similar_lengths_in_one_order_on_every_rank_and_resume() {
        // Lengths from a fixed stream: 1..=64.
        let lengths: Vec<usize> = permutation(1000, 11, 0)
            .iter()
            .map(|i| i % 64 + 1)
            .collect();
        let steps = global_steps(&lengths, 4, 2, 0);
        let order: Vec<usize> = steps.concat();
        // Every example once per epoch (1000 = 125 steps of 8, nothing filled up).
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        // The same as the order computed directly, on every rank; another epoch differs.
        assert_eq!(
            order,
            group_by_length(&permutation(1000, 3, 0), &lengths, 8)
        );
        assert_ne!(order, global_steps(&lengths, 4, 2, 1).concat());
        // The longest example comes first, and each megabatch (min(n / 4 batches, 50) = 31
        // global batches here) is sorted longest first after its first place.
        assert_eq!(lengths[order[0]], 64);
        let mega = 31 * 8;
        for chunk in order.chunks(mega) {
            assert!(
                chunk[1..]
                    .windows(2)
                    .all(|w| lengths[w[0]] >= lengths[w[1]])
            );
        }
        // Padding: each step pads to its longest; grouping leaves far less of it.
        let padded = |steps: &[Vec<usize>]| -> usize {
            steps
                .iter()
                .map(|s| s.iter().map(|&i| lengths[i]).max().unwrap() * s.len())
                .sum()
        };
        let plain: Vec<Vec<usize>> = permutation(1000, 3, 0)
            .chunks(8)
            .map(<[usize]>::to_vec)
            .collect();
        let real: usize = lengths.iter().sum();
        let (grouped_pad, plain_pad) = (padded(&steps) - real, padded(&plain) - real);
        assert!(
            grouped_pad * 10 < plain_pad,
            "{grouped_pad} vs {plain_pad} padding tokens"
        );
        // A position mid-epoch resumes the same order, here with another number of ranks.
        let data: Vec<usize> = (0..1000).collect();
        let mut resumed = DataLoader::new(data, 8, |x: &[usize]| Ok(x.to_vec()))
            .shuffle(3)
            .group_by_length(lengths.clone())
            .unwrap();
        resumed.set_position(LoaderPosition::at(0, 40 * 8));
        let next = resumed.next_batch().unwrap().unwrap().indices;
        assert_eq!(next, order[320..328]);
        // Lengths that do not match the dataset are refused.
        let e = DataLoader::new(vec![1u32, 2], 1, |x: &[u32]| Ok(x.to_vec()))
            .group_by_length(vec![1])
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "group_by_length: 1 lengths for a dataset of 2 examples"
        );
    }
}
