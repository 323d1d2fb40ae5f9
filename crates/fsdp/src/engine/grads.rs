//! [`Gradients`]: one backward's gradients after reduction, as this rank holds them — its
//! rows of each sharded parameter (whole parameters when replicated) — readable and writable
//! by parameter name, and summable over micro-batches.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

/// Where a parameter's rows sit in its unit's reduced block.
#[derive(Debug, Clone)]
pub(crate) struct GradPlace {
    pub unit: usize,
    pub param: usize,
    /// This rank's (unpadded) elements inside the unit's block.
    pub elements: Range<usize>,
}

/// Parameter name → place, built once per engine.
pub(crate) type GradIndex = HashMap<String, GradPlace>;

/// One backward's gradients, reduced: each rank holds the rows of the parameters it owns
/// (whole parameters with NO_SHARD and for ignored modules). Dropping them is `zero_grad`.
pub struct Gradients {
    pub(crate) units: Vec<Option<Vec<f32>>>,
    pub(crate) has_grad: Vec<Vec<bool>>,
    pub(crate) replicated: BTreeMap<String, Vec<f32>>,
    pub(crate) index: Arc<GradIndex>,
}

impl Gradients {
    /// Adds another backward's gradients (gradient accumulation over micro-batches).
    pub fn accumulate(&mut self, other: Gradients) {
        for (mine, theirs) in self.units.iter_mut().zip(other.units) {
            match (mine.as_mut(), theirs) {
                (Some(a), Some(b)) => a.iter_mut().zip(&b).for_each(|(x, y)| *x += y),
                (None, Some(b)) => *mine = Some(b),
                _ => {}
            }
        }
        for (mine, theirs) in self.has_grad.iter_mut().zip(other.has_grad) {
            mine.iter_mut().zip(theirs).for_each(|(a, b)| *a |= b);
        }
        for (name, g) in other.replicated {
            match self.replicated.get_mut(&name) {
                Some(a) => a.iter_mut().zip(&g).for_each(|(x, y)| *x += y),
                None => {
                    self.replicated.insert(name, g);
                }
            }
        }
    }

    /// Scales every gradient (e.g. by 1/accumulation steps).
    pub fn scale(&mut self, factor: f32) {
        self.units
            .iter_mut()
            .flatten()
            .chain(self.replicated.values_mut())
            .for_each(|g| g.iter_mut().for_each(|x| *x *= factor));
    }

    /// This rank's gradient rows of parameter `name` (row-major, the rows the engine's
    /// `owned_rows` gives); `None` when it received no gradient.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        if let Some(g) = self.replicated.get(name) {
            return Some(g);
        }
        let place = self.index.get(name)?;
        if !self.has_grad[place.unit][place.param] {
            return None;
        }
        Some(&self.units[place.unit].as_ref()?[place.elements.clone()])
    }

    /// [`Gradients::get`], writable.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut [f32]> {
        if let Some(g) = self.replicated.get_mut(name) {
            return Some(g);
        }
        let place = self.index.get(name)?;
        if !self.has_grad[place.unit][place.param] {
            return None;
        }
        Some(&mut self.units[place.unit].as_mut()?[place.elements.clone()])
    }

    /// Names of the parameters that received a gradient.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .index
            .iter()
            .filter(|(_, p)| self.has_grad[p.unit][p.param] && self.units[p.unit].is_some())
            .map(|(n, _)| n.as_str())
            .chain(self.replicated.keys().map(String::as_str))
            .collect();
        names.sort_unstable();
        names
    }

    /// Whether every gradient value this rank holds is finite (the overflow check of fp16
    /// loss scaling, see [`super::GradScaler`]).
    pub fn all_finite(&self) -> bool {
        self.units
            .iter()
            .flatten()
            .chain(self.replicated.values())
            .all(|g| g.iter().all(|x| x.is_finite()))
    }

    /// Sums of squares: of the sharded rows (disjoint across the shard group, padding zero)
    /// and of the whole replicated gradients.
    pub(crate) fn squares(&self) -> (f64, f64) {
        let square = |v: &[f32]| v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>();
        let sharded = self.units.iter().flatten().map(|g| square(g)).sum();
        let replicated = self.replicated.values().map(|g| square(g)).sum();
        (sharded, replicated)
    }
}
