//! [`Gradients`]: one backward's gradients after reduction, as this rank holds them — its
//! rows of each sharded parameter (whole parameters when replicated) — readable and writable
//! by parameter name, and summable over micro-batches.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use super::GradBlock;
use super::error::EngineError;
use super::plan::UnitKind;

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
    /// Per unit: how it is spread (a replicated unit's rows are whole copies).
    pub(crate) kinds: Vec<UnitKind>,
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
                tracing::error!("gradients of `{name}` stored on disk: {e}");
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
        for (g, kind) in self.units.iter().zip(&self.kinds) {
            let Some(g) = g else { continue };
            if kind.is_replicated() {
                replicated += g.squares()?;
            } else {
                sharded += g.squares()?;
            }
        }
        Ok((sharded, replicated))
    }
}
