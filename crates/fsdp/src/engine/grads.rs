//! [`Gradients`]: one backward's gradients after reduction, as this rank holds them — its
//! rows of each sharded parameter (whole parameters when replicated) — readable and writable
//! by parameter name, and summable over micro-batches.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use super::error::EngineError;
use super::offload::{DiskTier, Key, OffloadError, Region};

/// Where a parameter's rows sit in its unit's reduced block.
#[derive(Debug, Clone)]
pub(crate) struct GradPlace {
    pub unit: usize,
    pub param: usize,
    /// This rank's (unpadded) elements inside the unit's gradient block (its trainable
    /// parameters' rows; empty for a frozen parameter).
    pub elements: Range<usize>,
}

/// Parameter name → place, built once per engine.
pub(crate) type GradIndex = HashMap<String, GradPlace>;

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
    /// The values, once something borrowed them ([`Gradients::get`]).
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

fn square_sum(v: &[f32]) -> f64 {
    v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>()
}

impl GradBlock {
    /// Unit `unit`'s block: kept in memory, or written to `tier` when there is one.
    pub fn store(
        tier: Option<&Arc<DiskTier>>,
        unit: usize,
        values: Vec<f32>,
    ) -> Result<GradBlock, OffloadError> {
        let Some(tier) = tier else {
            return Ok(GradBlock::Memory(values));
        };
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
    fn values(&self) -> Option<&[f32]> {
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
    fn values_mut(&mut self) -> Result<&mut Vec<f32>, OffloadError> {
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
    fn update(&mut self, f: impl FnOnce(&mut [f32])) -> Result<(), OffloadError> {
        match self {
            GradBlock::Memory(v) => f(v),
            GradBlock::Disk(d) => {
                let mut v = d.take_values()?;
                f(&mut v);
                let unit = d.key.0;
                let tier = d.tier.clone();
                *self = GradBlock::store(Some(&tier), unit, v)?;
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
    fn scale(&mut self, factor: f32) {
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
    fn squares(&self) -> Result<f64, OffloadError> {
        match self {
            GradBlock::Memory(v) => Ok(square_sum(v)),
            GradBlock::Disk(d) if d.factors.is_empty() => Ok(d.squares),
            GradBlock::Disk(d) => Ok(square_sum(&d.load()?)),
        }
    }

    /// Whether every value is finite (a scaled block in the tier is read for it).
    fn all_finite(&self) -> Result<bool, OffloadError> {
        let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
        match self {
            GradBlock::Memory(v) => Ok(finite(v)),
            GradBlock::Disk(d) if d.factors.is_empty() => Ok(d.finite),
            GradBlock::Disk(d) => Ok(finite(&d.load()?)),
        }
    }
}

/// Per unit, the whole local gradients a backward without sync kept (packed as the
/// reduction takes them) and which parameters had one.
pub(crate) type UnreducedUnits = Vec<Option<(fsdp_comm::Buffer, Vec<bool>)>>;

/// What backwards have accumulated and no step has taken.
#[derive(Default)]
pub(crate) struct Accumulated {
    /// Per unit, the packed whole local gradients of backwards without sync (added to the
    /// next reduction), and which parameters had one.
    pub unreduced: UnreducedUnits,
    /// The reduced rows of backwards with sync, summed.
    pub reduced: Option<Gradients>,
}

/// One backward's gradients, reduced: each rank holds the rows of the parameters it owns
/// (whole parameters with NO_SHARD and for ignored modules). Dropping them is `zero_grad`.
pub struct Gradients {
    pub(crate) units: Vec<Option<GradBlock>>,
    pub(crate) has_grad: Vec<Vec<bool>>,
    /// Per unit: whole on every rank of the shard group (ignored modules' unit).
    pub(crate) replicated: Vec<bool>,
    pub(crate) index: Arc<GradIndex>,
    /// Every rank's values were found finite (a finite global norm) and not changed since.
    pub(crate) known_finite: bool,
}

impl Gradients {
    /// Adds another backward's gradients (gradient accumulation over micro-batches).
    /// Offloaded blocks are read, summed and written back one unit at a time.
    pub fn accumulate(&mut self, other: Gradients) -> Result<(), EngineError> {
        self.known_finite = false;
        for (mine, theirs) in self.units.iter_mut().zip(other.units) {
            match (mine.as_mut(), theirs) {
                (Some(a), Some(b)) => {
                    let b = b.into_values()?;
                    a.update(|a| a.iter_mut().zip(&b).for_each(|(x, y)| *x += y))?;
                }
                (None, Some(b)) => *mine = Some(b),
                _ => {}
            }
        }
        for (mine, theirs) in self.has_grad.iter_mut().zip(other.has_grad) {
            mine.iter_mut().zip(theirs).for_each(|(a, b)| *a |= b);
        }
        Ok(())
    }

    /// Scales every gradient (e.g. by 1/accumulation steps).
    pub fn scale(&mut self, factor: f32) -> Result<(), EngineError> {
        self.known_finite &= factor.is_finite();
        for g in self.units.iter_mut().flatten() {
            g.scale(factor);
        }
        Ok(())
    }

    /// This rank's gradient rows of parameter `name` (row-major, the rows the engine's
    /// `owned_rows` gives); `None` when it received no gradient.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        let place = self.index.get(name)?;
        if !self.has_grad[place.unit][place.param] {
            return None;
        }
        Some(&self.units[place.unit].as_ref()?.values()?[place.elements.clone()])
    }

    /// [`Gradients::get`], writable.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        self.known_finite = false;
        let place = self.index.get(name)?;
        if !self.has_grad[place.unit][place.param] {
            return None;
        }
        match self.units[place.unit].as_mut()?.values_mut() {
            Ok(v) => Some(&mut v[place.elements.clone()]),
            Err(e) => {
                tracing::error!("offloaded gradients of `{name}`: {e}");
                None
            }
        }
    }

    /// Names of the parameters that received a gradient.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .index
            .iter()
            .filter(|(_, p)| self.has_grad[p.unit][p.param] && self.units[p.unit].is_some())
            .map(|(n, _)| n.as_str())
            .collect();
        names.sort_unstable();
        names
    }

    /// Whether every gradient value this rank holds is finite (the overflow check of fp16
    /// loss scaling, see [`super::GradScaler`]).
    pub fn all_finite(&self) -> Result<bool, EngineError> {
        for g in self.units.iter().flatten() {
            if !g.all_finite()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The first parameter, by unit and then position in its unit, with a non-finite value
    /// among this rank's rows: `(unit, position)`; `None` when every value is finite.
    pub(crate) fn first_non_finite(&self) -> Result<Option<(usize, usize)>, EngineError> {
        for (u, g) in self.units.iter().enumerate() {
            let Some(g) = g else { continue };
            if g.all_finite()? {
                continue;
            }
            let mut places: Vec<&GradPlace> = self.index.values().filter(|p| p.unit == u).collect();
            places.sort_by_key(|p| p.param);
            let values = g.values().unwrap_or_default();
            let bad = places.iter().find(|p| {
                values
                    .get(p.elements.clone())
                    .is_some_and(|v| v.iter().any(|x| !x.is_finite()))
            });
            return Ok(Some((u, bad.map_or(0, |p| p.param))));
        }
        Ok(None)
    }

    /// Sums of squares: of the sharded rows (disjoint across the shard group, padding zero)
    /// and of the units whole on every rank.
    pub(crate) fn squares(&self) -> Result<(f64, f64), EngineError> {
        let (mut sharded, mut replicated) = (0.0, 0.0);
        for (g, &whole) in self.units.iter().zip(&self.replicated) {
            let Some(g) = g else { continue };
            if whole {
                replicated += g.squares()?;
            } else {
                sharded += g.squares()?;
            }
        }
        Ok((sharded, replicated))
    }
}
