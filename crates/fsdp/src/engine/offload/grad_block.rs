//! One unit's reduced gradient block on this rank, kept where the shards are: in memory, or
//! written to the disk tier as the reduction ends (with offloaded parameters), with what the
//! step asks of it before reading it back.

use std::sync::{Arc, OnceLock};

use super::{DiskTier, Key, OffloadError, Region};

/// One unit's reduced gradient block on this rank: in memory, or in the disk tier (written
/// as the reduction ended, with what the step asks of it before reading it back: its sum of
/// squares and whether it is finite).
pub(crate) enum GradBlock {
    Memory(Vec<f32>),
    Disk(DiskGrad),
}

/// A gradient block in the disk tier; its file goes when it is dropped.
pub(crate) struct DiskGrad {
    tier: Arc<DiskTier>,
    key: Key,
    len: usize,
    /// Factors to multiply the file's values by, in order, when they are read (scaling an
    /// offloaded block costs no pass over the disk; the products are the ones scaling in
    /// memory makes, one rounding each).
    factors: Vec<f32>,
    /// Sum of squares and finiteness of the file's values (before `factors`).
    squares: f64,
    finite: bool,
    /// The values, once something borrowed them (`Gradients::get`).
    cache: OnceLock<Option<Vec<f32>>>,
}

impl DiskGrad {
    /// The values with the factors applied.
    fn load(&self) -> Result<Vec<f32>, OffloadError> {
        let mut v = self.tier.read(&self.key, self.len)?;
        for &f in &self.factors {
            v.iter_mut().for_each(|x| *x *= f);
        }
        Ok(v)
    }

    /// The values, taken from the cache when something borrowed them, else read.
    fn take_values(&mut self) -> Result<Vec<f32>, OffloadError> {
        match self.cache.take().flatten() {
            Some(v) => Ok(v),
            None => self.load(),
        }
    }
}

impl Drop for DiskGrad {
    fn drop(&mut self) {
        self.tier.remove(&self.key);
    }
}

/// Partial sums [`square_sum`] keeps: enough independent additions in flight for the vector
/// units (one f64 chain in order was bound by the adder's latency).
const SQUARE_LANES: usize = 16;

fsdp_nn::multiversion! {
    /// `v`'s squares in f64 added into `sums`, element `i` into sum `i % SQUARE_LANES`
    /// (products and sums never fused: the same bits on every CPU).
    fn square_partials(v: &[f32], sums: &mut [f64; SQUARE_LANES]) {
        let chunks = v.chunks_exact(SQUARE_LANES);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (s, &x) in sums.iter_mut().zip(chunk) {
                let x = f64::from(x);
                *s += x * x;
            }
        }
        for (s, &x) in sums.iter_mut().zip(rest) {
            let x = f64::from(x);
            *s += x * x;
        }
    }
}

/// The sum of `v`'s squares in f64: [`SQUARE_LANES`] partial sums, then those in order.
fn square_sum(v: &[f32]) -> f64 {
    let mut sums = [0f64; SQUARE_LANES];
    square_partials(v, &mut sums);
    sums.iter().sum()
}

impl GradBlock {
    /// Unit `unit`'s block written to `tier`, with what the step asks of it before reading
    /// it back.
    pub(super) fn on_disk(
        tier: &Arc<DiskTier>,
        unit: usize,
        values: Vec<f32>,
    ) -> Result<GradBlock, OffloadError> {
        let key = (unit, Region::Grads(tier.next_grads()));
        let (len, squares) = (values.len(), square_sum(&values));
        let finite = values.iter().all(|x| x.is_finite());
        tier.write(&key, values)?;
        Ok(GradBlock::Disk(DiskGrad {
            tier: tier.clone(),
            key,
            len,
            factors: Vec::new(),
            squares,
            finite,
            cache: OnceLock::new(),
        }))
    }

    /// The values (read back from the tier).
    pub fn into_values(self) -> Result<Vec<f32>, OffloadError> {
        match self {
            GradBlock::Memory(v) => Ok(v),
            GradBlock::Disk(mut d) => d.take_values(),
        }
    }

    /// Starts reading a block in the tier ahead of [`GradBlock::into_values`].
    pub fn read_ahead(&self) -> Result<(), OffloadError> {
        match self {
            GradBlock::Disk(d) if d.cache.get().is_none() => d.tier.read_ahead(&d.key, d.len),
            _ => Ok(()),
        }
    }

    /// The values borrowed (a block in the tier is read into memory once).
    pub(crate) fn values(&self) -> Option<&[f32]> {
        match self {
            GradBlock::Memory(v) => Some(v),
            GradBlock::Disk(d) => d
                .cache
                .get_or_init(|| match d.load() {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::error!("offloaded gradients: {e}");
                        None
                    }
                })
                .as_deref(),
        }
    }

    /// The values, writable: a block in the tier comes back into memory.
    pub(crate) fn values_mut(&mut self) -> Result<&mut Vec<f32>, OffloadError> {
        if let GradBlock::Disk(d) = self {
            *self = GradBlock::Memory(d.take_values()?);
        }
        match self {
            GradBlock::Memory(v) => Ok(v),
            GradBlock::Disk(d) => Err(OffloadError::Failed {
                path: d.tier.path().to_path_buf(),
                first: "a gradient block could not come back into memory".into(),
            }),
        }
    }

    /// Applies `f` to the values in place, wherever they live (a block in the tier is read,
    /// changed and written back).
    pub(crate) fn update(&mut self, f: impl FnOnce(&mut [f32])) -> Result<(), OffloadError> {
        match self {
            GradBlock::Memory(v) => f(v),
            GradBlock::Disk(d) => {
                let mut v = d.take_values()?;
                f(&mut v);
                let unit = d.key.0;
                let tier = d.tier.clone();
                *self = GradBlock::on_disk(&tier, unit, v)?;
            }
        }
        Ok(())
    }

    /// The values, when they are in memory.
    pub fn memory(&self) -> Option<&[f32]> {
        match self {
            GradBlock::Memory(v) => Some(v),
            GradBlock::Disk(_) => None,
        }
    }

    /// Multiplies the values by `factor`: in memory now, for a block in the tier when it
    /// is read.
    pub(crate) fn scale(&mut self, factor: f32) {
        match self {
            GradBlock::Memory(v) => v.iter_mut().for_each(|x| *x *= factor),
            GradBlock::Disk(d) => {
                if let Some(Some(v)) = d.cache.get_mut() {
                    v.iter_mut().for_each(|x| *x *= factor);
                }
                d.factors.push(factor);
            }
        }
    }

    /// Sum of squares (a scaled block in the tier is read for it).
    pub(crate) fn squares(&self) -> Result<f64, OffloadError> {
        match self {
            GradBlock::Memory(v) => Ok(square_sum(v)),
            GradBlock::Disk(d) if d.factors.is_empty() => Ok(d.squares),
            GradBlock::Disk(d) => Ok(square_sum(&d.load()?)),
        }
    }

    /// Whether every value is finite (a scaled block in the tier is read for it).
    pub(crate) fn all_finite(&self) -> Result<bool, OffloadError> {
        let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
        match self {
            GradBlock::Memory(v) => Ok(finite(v)),
            GradBlock::Disk(d) if d.factors.is_empty() => Ok(d.finite),
            GradBlock::Disk(d) => Ok(finite(&d.load()?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::square_sum;

    #[test]
    fn the_sum_of_squares_is_the_exact_one_within_f64_rounding_and_keeps_non_finite_values() {
        let mut rng = fsdp_nn::rng::XorShift64::new(0x9e37_79b9_7f4a_7c15);
        let mut next = || ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0;
        for len in (0..70).chain([1000, 1 << 16, (1 << 16) + 13]) {
            let v: Vec<f32> = (0..len).map(|_| next()).collect();
            // Each square is exact in f64; Neumaier's compensated sum of them is within an
            // ulp or two, and any order of plain f64 additions within len·ε of it.
            let (mut exact, mut lost) = (0f64, 0f64);
            for &x in &v {
                let term = f64::from(x) * f64::from(x);
                let t = exact + term;
                lost += if exact.abs() >= term.abs() {
                    (exact - t) + term
                } else {
                    (term - t) + exact
                };
                exact = t;
            }
            let exact = exact + lost;
            let got = square_sum(&v);
            let bound = (len as f64 / 16.0 + 16.0) * f64::EPSILON * exact;
            assert!(
                (got - exact).abs() <= bound,
                "{len} elements: {got} against {exact}"
            );
        }
        let mut v = vec![1.0f32; 37];
        assert_eq!(square_sum(&v), 37.0);
        v[20] = f32::INFINITY;
        assert_eq!(square_sum(&v), f64::INFINITY);
        v[5] = f32::NAN;
        assert!(square_sum(&v).is_nan());
    }
}
