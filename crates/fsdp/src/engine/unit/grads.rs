//! A unit's gradients in one step, the unit's side of gradient accumulation: what this
//! backward delivers (packed as the reduction takes them, or collected by rows for a
//! row-sparse reduction), what backwards without sync carried in, and whether this backward
//! reduces their sum or keeps it whole for the next one.

use candle_core::Tensor;
use fsdp_comm::{Buffer, DType};

use super::FsdpUnit;
use crate::engine::buffers::GradPack;
use crate::engine::data_plane::DataPlane;
use crate::engine::error::EngineError;
use crate::engine::sparse_rows::{CompactGrads, RowSparsePlan};

/// What a unit's gradients of this backward come to when they are all in.
pub(crate) enum Completed {
    /// Nothing to reduce (no gradient, or kept whole without sync).
    Nothing,
    /// The packed sum, to reduce.
    Packed(Buffer),
    /// A row-sparse unit's gradients, collected by rows.
    Rows(CompactGrads),
}

/// One unit's gradients in one step.
pub(crate) struct UnitGrads {
    /// This backward's gradients, packed as the reduction takes them.
    pack: Option<GradPack>,
    /// Instead of `pack`, for a unit with row-sparse parameters reducing this backward with
    /// nothing carried: its gradients collected for the row-sparse reduction.
    rows: Option<CompactGrads>,
    /// Gradients this backward will deliver (known from the graph before it runs).
    pub expected: Option<usize>,
    received: usize,
    /// Which parameters received a gradient (in this backward or the carried ones).
    pub has_grad: Vec<bool>,
    /// Whole local gradients of earlier backwards without sync, packed as the reduction
    /// takes them: added to this backward's before its reduction.
    carried: Option<Buffer>,
    /// This backward runs without sync: the sum is kept whole, not reduced.
    keep: bool,
    /// What a backward without sync kept (collected by the step at its end).
    pub unreduced: Option<Buffer>,
}

/// Where a gradient goes: parameter `param` of `unit`, whose rows are split over `ranks`,
/// reduced in `dtype`.
pub(crate) struct GradTarget<'a> {
    pub unit: &'a FsdpUnit,
    pub param: usize,
    pub ranks: usize,
    pub dtype: DType,
}

impl UnitGrads {
    /// No gradient yet, for a unit of `params` parameters.
    pub fn new(params: usize) -> UnitGrads {
        UnitGrads {
            pack: None,
            rows: None,
            expected: None,
            received: 0,
            has_grad: vec![false; params],
            carried: None,
            keep: false,
            unreduced: None,
        }
    }

    /// Backward is about to run: with `sync` the gradients are reduced (with `carried`, what
    /// backwards without sync kept, and which parameters had one there); without, kept whole.
    pub fn begin_backward(&mut self, sync: bool, carried: Option<(Buffer, Vec<bool>)>) {
        self.keep = !sync;
        if let Some((pack, had)) = carried {
            self.has_grad.iter_mut().zip(had).for_each(|(a, b)| *a |= b);
            self.carried = Some(pack);
        }
    }

    /// Adds parameter `to.param`'s complete gradient; `sparse` gives the row-sparse plan, if
    /// the unit has one, for its first gradient of a backward that reduces with nothing
    /// carried. Returns whether the unit's last expected gradient is in.
    pub fn add(
        &mut self,
        plane: &dyn DataPlane,
        to: GradTarget<'_>,
        grad: &Tensor,
        sparse: impl FnOnce() -> Option<RowSparsePlan>,
    ) -> Result<bool, EngineError> {
        let (layout, block) = (&to.unit.grad_layouts[to.param], to.unit.grad_block);
        let first = self.pack.is_none() && self.rows.is_none();
        if first && !self.keep && self.carried.is_none() {
            self.rows = sparse().map(|plan| CompactGrads::new(plan, to.dtype));
        }
        if let Some(rows) = self.rows.as_mut() {
            rows.add(layout, grad)?;
        } else if to.unit.kind.is_replicated() && self.has_grad[to.param] {
            // Read in several places (inside and outside checkpointed units): the parts add.
            let mut part = GradPack::new(to.dtype, block, 1);
            plane.pack_gradient(layout, grad, &mut part)?;
            let pack = self
                .pack
                .as_mut()
                .ok_or_else(|| EngineError::GradientOutsideUnit {
                    param: layout.name.clone(),
                    unit: to.unit.name(),
                    state: "holding no gradient pack",
                })?;
            let op = "summing a parameter's gradients read in several places";
            pack.add_assign(&part.finish(), op, &to.unit.path)?;
        } else {
            let pack = self
                .pack
                .get_or_insert_with(|| GradPack::new(to.dtype, block, to.ranks));
            plane.pack_gradient(layout, grad, pack)?;
        }
        self.has_grad[to.param] = true;
        self.received += 1;
        // A replicated unit's parameters may be read anywhere: it completes when the step
        // finishes, never on a count.
        Ok(!to.unit.kind.is_replicated() && Some(self.received) == self.expected)
    }

    /// Whether anything is left to complete (gradients in, or carried).
    pub fn pending(&self) -> bool {
        self.pack.is_some() || self.carried.is_some() || self.rows.is_some()
    }

    /// Takes this backward's gradients with the carried ones added: to reduce, or (without
    /// sync) kept in `unreduced` for the next backward.
    pub fn complete(&mut self, unit: &FsdpUnit) -> Result<Completed, EngineError> {
        if let Some(rows) = self.rows.take() {
            return Ok(Completed::Rows(rows));
        }
        let merged = match (self.pack.take(), self.carried.take()) {
            (Some(mut pack), Some(carried)) => {
                let op = "gradient accumulation without sync";
                pack.add_assign(&carried, op, &unit.path)?;
                Some(pack.finish())
            }
            (pack, carried) => pack.map(GradPack::finish).or(carried),
        };
        if self.keep {
            self.unreduced = merged;
            return Ok(Completed::Nothing);
        }
        Ok(merged.map_or(Completed::Nothing, Completed::Packed))
    }
}
