//! Distributed data loading as Accelerate does it (`split_batches=False`,
//! `even_batches=True`): every rank draws the same permutation of the dataset from the seed
//! and epoch, each step takes the next `batch_size × ranks` indices, and rank r takes its
//! `batch_size` of them (with `balance_lengths`, a share of them dealt by length). The last step is either dropped (`drop_last`) or filled up from the
//! start of the permutation, and [`LoadedBatch::real`] says how many of the step's samples are
//! not such repeats, so metrics count every sample once.

use serde::{Deserialize, Serialize};

pub use super::order::{LengthsMismatch, balanced_shares, group_by_length, permutation};

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
    /// Each example's length (`group_by_length`, `balance_lengths`).
    lengths: Option<Vec<usize>>,
    /// Order each epoch in megabatches sorted by length (`group_by_length`).
    grouped: bool,
    /// Deal each step's examples by length (`balance_lengths`).
    balanced: bool,
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
    ///
    /// ```
    /// use fsdp::data::{CollateError, DataLoader};
    /// use fsdp::nn::candle::{Device, Tensor};
    ///
    /// // The collate function: a step's examples (this rank's share) into one batch.
    /// fn collate(examples: &[(Vec<f32>, u32)]) -> Result<(Tensor, Tensor), CollateError> {
    ///     let n = examples.len();
    ///     let x: Vec<f32> = examples.iter().flat_map(|(x, _)| x.clone()).collect();
    ///     let y: Vec<u32> = examples.iter().map(|(_, y)| *y).collect();
    ///     Ok((Tensor::from_vec(x, (n, 2), &Device::Cpu)?, Tensor::from_vec(y, n, &Device::Cpu)?))
    /// }
    /// let data: Vec<(Vec<f32>, u32)> = (0..10).map(|i| (vec![i as f32, 1.0], i % 2)).collect();
    /// let mut loader = DataLoader::new(data, 4, collate).shuffle(42);
    /// for epoch in 0..2 {
    ///     let mut seen = 0;
    ///     while let Some(batch) = loader.next_batch() {
    ///         let batch = batch?;                       // a collate error names its step
    ///         assert_eq!(batch.batch.0.dims(), [4, 2]);
    ///         seen += batch.indices.len();
    ///     }
    ///     assert_eq!(seen, 12, "epoch {epoch}: 3 steps of 4, the last filled up from the start");
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
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
            grouped: false,
            balanced: false,
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
    pub fn group_by_length(self, lengths: Vec<usize>) -> Result<Self, LengthsMismatch> {
        let mut loader = self.with_lengths("group_by_length", lengths)?;
        loader.grouped = true;
        Ok(loader)
    }

    /// Deals each step's examples to the ranks by `lengths` (one per example, e.g. its token
    /// count) so that every rank pads about as many tokens ([`balanced_shares`]): the rank
    /// with the longest examples takes fewer of them, instead of every rank taking
    /// `batch_size` and all waiting for the one whose batch pads longest. The step's examples
    /// are the same as without (the last, filled-up step of an epoch keeps the plain shares,
    /// so [`LoadedBatch::real`] still counts from the end); the shares differ in size, so
    /// weigh every example alike by normalising the loss by the step's count
    /// ([`crate::accelerator::Accelerator::backward_sum`]). Training computes the same sums
    /// in another order (and draws dropout for other positions); pass the same lengths as to
    /// `group_by_length` when using both.
    pub fn balance_lengths(self, lengths: Vec<usize>) -> Result<Self, LengthsMismatch> {
        let mut loader = self.with_lengths("balance_lengths", lengths)?;
        loader.balanced = true;
        Ok(loader)
    }

    fn with_lengths(
        mut self,
        op: &'static str,
        lengths: Vec<usize>,
    ) -> Result<Self, LengthsMismatch> {
        if lengths.len() != self.dataset.len() {
            return Err(LengthsMismatch {
                op,
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
                Some(lengths) if self.grouped => {
                    group_by_length(&order, lengths, self.global_batch_size())
                }
                _ => order,
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
        let indices: Vec<usize> = match &self.lengths {
            Some(lengths) if self.balanced && real == g && self.ranks > 1 => {
                let step = &order[start..start + g];
                let step_lengths: Vec<usize> = step.iter().map(|&i| lengths[i]).collect();
                let shares = balanced_shares(&step_lengths, self.ranks);
                shares[self.rank].iter().map(|&p| step[p]).collect()
            }
            _ => (0..len).map(|i| order[(start + offset + i) % n]).collect(),
        };
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
mod tests;
