//! Distributed data loading as Accelerate does it (`split_batches=False`,
//! `even_batches=True`): every rank draws the same permutation of the dataset from the seed
//! and epoch, each step takes the next `batch_size × ranks` indices, and rank r takes its
//! `batch_size` of them. The last step is either dropped (`drop_last`) or filled up from the
//! start of the permutation, and [`LoadedBatch::real`] says how many of the step's samples are
//! not such repeats, so metrics count every sample once.

use serde::{Deserialize, Serialize};

pub use super::order::{LengthsMismatch, group_by_length, permutation};

/// A dataset: items by index.
pub trait Dataset {
    /// One example.
    type Item;
    /// Number of examples.
    fn len(&self) -> usize;
    /// Whether there is no example.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Example `index` (`< len()`).
    fn get(&self, index: usize) -> Self::Item;
}

impl<T: Clone> Dataset for Vec<T> {
    type Item = T;

    fn len(&self) -> usize {
        <[T]>::len(self)
    }

    fn get(&self, index: usize) -> T {
        self[index].clone()
    }
}

/// Where a loader is: the epoch, and how many samples of the epoch's order all ranks have
/// taken together (what a checkpoint keeps). Counting samples, not steps, lets a job resumed
/// with another number of processes (another global batch) continue at exactly the next
/// unseen sample of the same permutation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LoaderPosition {
    /// The epoch.
    pub epoch: u64,
    /// Samples of the epoch's order already taken, over all ranks.
    pub samples: usize,
    /// A position saved before samples were counted (`{epoch, step}`): steps of the global
    /// batch the loader it is given to has (the only one such positions were resumed with).
    #[serde(skip)]
    legacy_steps: Option<usize>,
}

impl LoaderPosition {
    /// The start of `epoch`.
    pub fn start_of(epoch: u64) -> LoaderPosition {
        LoaderPosition::at(epoch, 0)
    }

    /// `samples` samples into `epoch`.
    pub fn at(epoch: u64, samples: usize) -> LoaderPosition {
        LoaderPosition {
            epoch,
            samples,
            legacy_steps: None,
        }
    }
}

impl<'de> Deserialize<'de> for LoaderPosition {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Saved {
            epoch: u64,
            samples: Option<usize>,
            step: Option<usize>,
        }
        let saved = Saved::deserialize(d)?;
        Ok(match (saved.samples, saved.step) {
            (Some(samples), _) => LoaderPosition::at(saved.epoch, samples),
            (None, Some(steps)) => LoaderPosition {
                epoch: saved.epoch,
                samples: 0,
                legacy_steps: Some(steps),
            },
            (None, None) => return Err(serde::de::Error::missing_field("samples")),
        })
    }
}

/// One step's batch for this rank.
#[derive(Debug, Clone)]
pub struct LoadedBatch<B> {
    /// The collated batch.
    pub batch: B,
    /// The step within the epoch (counted in this loader's global batch: a loader resumed
    /// at a position between its steps counts the partial one before it).
    pub step: usize,
    /// The dataset indices of this rank's examples.
    pub indices: Vec<usize>,
    /// How many of the step's examples, over all ranks in rank order, are not repeats (the
    /// last step of an epoch is filled up with examples from its start).
    pub real: usize,
}

/// A data loader over a dataset: per-rank batches of `batch_size` examples, collated.
pub struct DataLoader<D: Dataset, B> {
    dataset: D,
    batch_size: usize,
    shuffle: Option<u64>,
    /// Each example's length, for batches of similar lengths (`group_by_length`).
    lengths: Option<Vec<usize>>,
    drop_last: bool,
    /// `batch_size` is the global batch, split over the ranks (Accelerate's
    /// `split_batches`), in shares that may differ by one.
    split: bool,
    collate: CollateFn<D::Item, B>,
    rank: usize,
    ranks: usize,
    epoch: u64,
    /// Samples of the epoch's order taken before this loader's steps of it began.
    start: usize,
    /// Steps this loader has taken since `start`.
    taken: usize,
    /// The order of the epoch being read, and that epoch.
    order: Option<(u64, Vec<usize>)>,
    /// `next_batch` reported the epoch's end and nothing set a position since: the next
    /// call starts the next epoch.
    ended: bool,
}

/// What collation may fail with (a boxed error, so any collate function fits).
pub type CollateError = Box<dyn std::error::Error + Send + Sync>;

/// A batch that could not be collated: which one, and the collate function's error. A
/// concrete error type, so `loader.next_batch()` results take `?` in any program (`anyhow`,
/// `Box<dyn Error>`).
#[derive(Debug, thiserror::Error)]
#[error("collating the batch of epoch {epoch}, step {step}: {source}")]
pub struct BatchError {
    /// The epoch.
    pub epoch: u64,
    /// The step within it.
    pub step: usize,
    /// What the collate function returned.
    #[source]
    pub source: CollateError,
}

/// A collate function: examples into one batch.
type CollateFn<I, B> = Box<dyn Fn(&[I]) -> Result<B, CollateError> + Send>;

impl<D: Dataset, B> DataLoader<D, B> {
    /// A loader of `batch_size` examples per rank per step, collated by `collate`, in dataset
    /// order, keeping a partial last step (filled up to full batches).
    pub fn new(
        dataset: D,
        batch_size: usize,
        collate: impl Fn(&[D::Item]) -> Result<B, CollateError> + Send + 'static,
    ) -> Self {
        DataLoader {
            dataset,
            batch_size: batch_size.max(1),
            shuffle: None,
            lengths: None,
            drop_last: false,
            split: false,
            collate: Box::new(collate),
            rank: 0,
            ranks: 1,
            epoch: 0,
            start: 0,
            taken: 0,
            order: None,
            ended: false,
        }
    }

    /// Shuffles each epoch with `seed` (the same permutation on every rank).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// Batches of similar lengths (transformers' `group_by_length`): each epoch's order
    /// (shuffled or not) is cut into megabatches of up to 50 global batches, each sorted by
    /// `lengths` (one per example, e.g. its token count), longest first — still one order
    /// identical on every rank, and a position within it resumes exactly. Less padding per
    /// batch; the batches of an epoch are no longer a uniform shuffle.
    pub fn group_by_length(mut self, lengths: Vec<usize>) -> Result<Self, LengthsMismatch> {
        if lengths.len() != self.dataset.len() {
            return Err(LengthsMismatch {
                lengths: lengths.len(),
                examples: self.dataset.len(),
            });
        }
        self.lengths = Some(lengths);
        Ok(self)
    }

    /// `batch_size` is the global batch, split over the ranks (Accelerate's
    /// `split_batches`): a global batch the ranks do not divide gives shares that differ by
    /// one (8 over 3 ranks: 3, 3, 2), the first ranks taking the larger — to weigh every
    /// example alike, normalise the loss by the step's count
    /// ([`crate::accelerator::Accelerator::backward_sum`]). A global batch smaller than the
    /// ranks leaves some none: their `next_batch` is an error saying so.
    pub fn split_batches(mut self, split: bool) -> Self {
        self.split = split;
        self
    }

    /// Drops the last, partial step of each epoch instead of filling it up.
    pub fn drop_last(mut self, drop: bool) -> Self {
        self.drop_last = drop;
        self
    }

    /// Takes this rank's share of every step (set by the accelerator's `prepare`).
    pub fn shard(mut self, rank: usize, ranks: usize) -> Self {
        self.rank = rank.min(ranks.saturating_sub(1));
        self.ranks = ranks.max(1);
        self
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// Examples per step over all ranks.
    pub fn global_batch_size(&self) -> usize {
        if self.split {
            self.batch_size
        } else {
            self.batch_size * self.ranks
        }
    }

    /// This rank's share of each step: (offset in the step, examples).
    fn share(&self) -> (usize, usize) {
        if !self.split {
            return (self.rank * self.batch_size, self.batch_size);
        }
        let (q, extra) = (self.batch_size / self.ranks, self.batch_size % self.ranks);
        (
            self.rank * q + self.rank.min(extra),
            q + usize::from(self.rank < extra),
        )
    }

    /// Steps per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        let (n, g) = (self.dataset.len(), self.global_batch_size());
        if self.drop_last { n / g } else { n.div_ceil(g) }
    }

    /// Where the next step starts in the epoch's order.
    fn next_sample(&self) -> usize {
        self.start
            .saturating_add(self.taken.saturating_mul(self.global_batch_size()))
    }

    /// Steps left in the current epoch (the next one included).
    pub fn steps_left_in_epoch(&self) -> usize {
        let (n, g) = (self.dataset.len(), self.global_batch_size());
        let left = n.saturating_sub(self.next_sample());
        if self.drop_last {
            left / g
        } else {
            left.div_ceil(g)
        }
    }

    /// Where the loader is.
    pub fn position(&self) -> LoaderPosition {
        LoaderPosition::at(self.epoch, self.next_sample().min(self.dataset.len()))
    }

    /// Starts `epoch` from its first step.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.set_position(LoaderPosition::start_of(epoch));
    }

    /// Continues from `position` (a checkpoint's, saved with any number of ranks): the next
    /// step starts at its first sample not yet taken.
    pub fn set_position(&mut self, position: LoaderPosition) {
        self.epoch = position.epoch;
        self.start = match position.legacy_steps {
            Some(steps) => steps.saturating_mul(self.global_batch_size()),
            None => position.samples,
        };
        self.taken = 0;
        self.ended = false;
    }

    /// This rank's batch of the next step of the current epoch; `None` at the epoch's end,
    /// and the call after that starts the next epoch (in that epoch's shuffled order), as
    /// iterating Accelerate's prepared loader again does: `while let Some(b) =
    /// loader.next_batch()` inside an epoch loop reads every epoch. [`DataLoader::set_epoch`]
    /// or [`DataLoader::set_position`] say where to go instead.
    pub fn next_batch(&mut self) -> Option<Result<LoadedBatch<B>, BatchError>> {
        if self.steps_left_in_epoch() == 0 {
            if !self.ended {
                self.ended = true;
                return None;
            }
            self.set_position(LoaderPosition::start_of(self.epoch + 1));
            if self.steps_left_in_epoch() == 0 {
                // An empty dataset: every epoch ends at once.
                self.ended = true;
                return None;
            }
        }
        let n = self.dataset.len();
        let epoch = self.epoch;
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let order = match self.shuffle {
                Some(seed) => permutation(n, seed, epoch),
                None => (0..n).collect(),
            };
            let order = match &self.lengths {
                Some(lengths) => group_by_length(&order, lengths, self.global_batch_size()),
                None => order,
            };
            self.order = Some((epoch, order));
        }
        let order = self
            .order
            .as_ref()
            .map(|(_, o)| o.as_slice())
            .unwrap_or(&[]);
        let g = self.global_batch_size();
        let start = self.next_sample();
        let step = start.div_ceil(g);
        let real = n.saturating_sub(start).min(g);
        let (offset, len) = self.share();
        self.taken += 1;
        if len == 0 {
            return Some(Err(BatchError {
                epoch,
                step,
                source: format!(
                    "a global batch of {g} split over {} ranks leaves rank {} no example",
                    self.ranks, self.rank
                )
                .into(),
            }));
        }
        let indices: Vec<usize> = (0..len).map(|i| order[(start + offset + i) % n]).collect();
        let items: Vec<D::Item> = indices.iter().map(|&i| self.dataset.get(i)).collect();
        Some(
            (self.collate)(&items)
                .map(|batch| LoadedBatch {
                    batch,
                    step,
                    indices,
                    real,
                })
                .map_err(|source| BatchError {
                    epoch,
                    step,
                    source,
                }),
        )
    }
}

#[cfg(test)]
mod tests {
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

    fn loader(
        n: usize,
        batch: usize,
        rank: usize,
        ranks: usize,
    ) -> DataLoader<Vec<usize>, Vec<usize>> {
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
}
