//! The order an epoch's samples are taken in: a seeded permutation, the same on every rank,
//! and transformers' length grouping of it; and how a step's samples may be dealt to the ranks
//! so that each pads about as many tokens.

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

/// A step's samples dealt to `ranks` ranks so that the slowest rank's padded batch (its
/// examples times its longest `lengths`, which is what its forward and backward compute) is
/// as small as contiguous runs of the samples sorted longest first allow: fewer of the longest
/// examples to one rank, more of the short ones to another. Every rank gets at least one
/// sample when there are as many as ranks. Returns each rank's positions in the step, longest
/// first; the same on every rank (ties keep the step's order).
pub fn balanced_shares(lengths: &[usize], ranks: usize) -> Vec<Vec<usize>> {
    let (g, ranks) = (lengths.len(), ranks.max(1));
    let mut by_length: Vec<usize> = (0..g).collect();
    by_length.sort_by_key(|&p| std::cmp::Reverse(lengths[p]));
    let length_at = |i: usize| lengths[by_length[i]].max(1);
    // Ranks needed when no rank's padded batch may exceed `budget` (greedy, longest first).
    let ranks_within = |budget: usize| {
        let (mut i, mut used) = (0, 0);
        while i < g {
            i += (budget / length_at(i)).max(1).min(g - i);
            used += 1;
        }
        used
    };
    let (mut low, mut high) = match g {
        0 => (1, 1),
        _ => (length_at(0), g * length_at(0)),
    };
    while low < high {
        let mid = low + (high - low) / 2;
        if ranks_within(mid) <= ranks {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    // The same greedy cut, keeping one sample for each rank still to come.
    let mut at = 0;
    (0..ranks)
        .map(|r| {
            let later = ranks - r - 1;
            let most = (g - at).saturating_sub(later);
            let take = match (later, at < g) {
                (_, false) => 0,
                (0, true) => g - at,
                _ => (low / length_at(at)).clamp(1, most.max(1)),
            };
            let share = by_length[at..at + take].to_vec();
            at += take;
            share
        })
        .collect()
}

/// The lengths given for `group_by_length` or `balance_lengths` do not match the dataset.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {lengths} lengths for a dataset of {examples} examples")]
pub struct LengthsMismatch {
    /// What was given them.
    pub op: &'static str,
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

    /// The slowest rank's padded batch: its examples times its longest.
    fn slowest(shares: &[Vec<usize>], lengths: &[usize]) -> usize {
        let padded = |s: &Vec<usize>| s.len() * s.iter().map(|&p| lengths[p]).max().unwrap_or(0);
        shares.iter().map(padded).max().unwrap_or(0)
    }

    /// The best any cut of the longest-first order into `ranks` non-empty runs can do
    /// (every cut tried).
    fn best_cut(lengths: &[usize], ranks: usize) -> usize {
        let mut sorted = lengths.to_vec();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let cost = |from: usize, to: usize| (to - from) * sorted[from];
        // best[r][i]: the first i samples in r runs.
        let g = sorted.len();
        let mut best = vec![vec![usize::MAX; g + 1]; ranks + 1];
        best[0][0] = 0;
        for r in 1..=ranks {
            for i in r..=g {
                best[r][i] = (r - 1..i)
                    .filter(|&j| best[r - 1][j] != usize::MAX)
                    .map(|j| best[r - 1][j].max(cost(j, i)))
                    .min()
                    .unwrap_or(usize::MAX);
            }
        }
        best[ranks][g]
    }

    #[test]
    fn balanced_shares_cut_the_slowest_ranks_padding_as_far_as_any_cut_can() {
        let mut stream = SplitMix64::new(5);
        for case in 0..300 {
            let g = 1 + (stream.next_u64() % 40) as usize;
            let ranks = 1 + (stream.next_u64() % 5) as usize;
            let spread = 1 + (stream.next_u64() % 120) as usize;
            let lengths: Vec<usize> = (0..g)
                .map(|_| 1 + (stream.next_u64() as usize % spread))
                .collect();
            let shares = balanced_shares(&lengths, ranks);
            assert_eq!(shares.len(), ranks);
            // Every position once; every rank some when there are enough.
            let mut all: Vec<usize> = shares.concat();
            all.sort_unstable();
            assert_eq!(all, (0..g).collect::<Vec<_>>(), "case {case}");
            if g >= ranks {
                assert!(shares.iter().all(|s| !s.is_empty()), "case {case}");
                assert_eq!(
                    slowest(&shares, &lengths),
                    best_cut(&lengths, ranks),
                    "case {case}: {lengths:?} over {ranks}"
                );
            }
            // Never slower than equal shares in the step's order.
            let b = g.div_ceil(ranks);
            let plain: Vec<Vec<usize>> = (0..g)
                .collect::<Vec<_>>()
                .chunks(b)
                .map(<[usize]>::to_vec)
                .collect();
            assert!(slowest(&shares, &lengths) <= slowest(&plain, &lengths));
        }
        // Two ranks, 8 examples: the longest two on one rank, the six short ones on the other
        // (2 x 60 and 6 x 20 against 4 x 60 each way).
        let lengths = [20, 60, 20, 20, 55, 20, 20, 20];
        assert_eq!(
            balanced_shares(&lengths, 2),
            [vec![1, 4], vec![0, 2, 3, 5, 6, 7]]
        );
    }

    #[test]
    fn balanced_steps_hold_the_same_examples_dealt_by_length_and_resume() {
        let lengths: Vec<usize> = permutation(103, 9, 0).iter().map(|i| i % 50 + 1).collect();
        let loader = |rank: usize, ranks: usize, balance: bool| {
            let data: Vec<usize> = (0..lengths.len()).collect();
            let l = DataLoader::new(data, 4, |x: &[usize]| Ok(x.to_vec()))
                .shuffle(7)
                .shard(rank, ranks);
            if balance {
                l.balance_lengths(lengths.clone()).unwrap()
            } else {
                l
            }
        };
        for ranks in [2, 3] {
            let take_epoch = |balance: bool| -> Vec<Vec<Vec<usize>>> {
                let mut ls: Vec<_> = (0..ranks).map(|r| loader(r, ranks, balance)).collect();
                let mut steps = Vec::new();
                while ls[0].steps_left_in_epoch() > 0 {
                    steps.push(
                        ls.iter_mut()
                            .map(|l| l.next_batch().unwrap().unwrap().indices)
                            .collect(),
                    );
                }
                steps
            };
            let (balanced, plain) = (take_epoch(true), take_epoch(false));
            assert_eq!(balanced.len(), plain.len());
            let mut unequal = 0;
            for (b, p) in balanced.iter().zip(&plain) {
                let sorted = |s: &Vec<Vec<usize>>| {
                    let mut v = s.concat();
                    v.sort_unstable();
                    v
                };
                // The same examples in each step.
                assert_eq!(sorted(b), sorted(p));
                let shares: Vec<Vec<usize>> = b.clone();
                let of_step: Vec<Vec<usize>> = shares
                    .iter()
                    .map(|s| s.iter().map(|&i| lengths[i]).collect())
                    .collect();
                let pad = |s: &Vec<usize>| s.len() * s.iter().max().copied().unwrap_or(0);
                let plain_pad = p
                    .iter()
                    .map(|s| pad(&s.iter().map(|&i| lengths[i]).collect()))
                    .max()
                    .unwrap();
                assert!(of_step.iter().map(pad).max().unwrap() <= plain_pad);
                unequal += usize::from(b.iter().any(|s| s.len() != 4));
            }
            // Shares of different sizes in most steps; the last, filled-up step as plain.
            assert!(
                unequal * 2 > balanced.len(),
                "{unequal} of {}",
                balanced.len()
            );
            assert_eq!(balanced.last(), plain.last());
            // A position mid-epoch resumes the same shares.
            let mut resumed = loader(1, ranks, true);
            resumed.set_position(LoaderPosition::at(0, 3 * 4 * ranks));
            assert_eq!(
                resumed.next_batch().unwrap().unwrap().indices,
                balanced[3][1]
            );
        }
        let e = loader(0, 2, false).balance_lengths(vec![1]).err().unwrap();
        assert_eq!(
            e.to_string(),
            "balance_lengths: 1 lengths for a dataset of 103 examples"
        );
    }
}
