//! One sharded parameter ([`FsdpParam`]): this rank's rows in a buffer that carries its dtype
//! and device, how rows move between a rank's shard and a unit's gathered block (pack and
//! unpack).

use std::ops::Range;

use candle_core::Device;
use fsdp_comm::Buffer;

use super::error::EngineError;
use super::plan::ShardLayout;

/// A buffer of a parameter's elements together with the device it lives on.
#[derive(Debug, Clone)]
pub(crate) struct ShardBuffer {
    data: Buffer,
    device: Device,
}

impl ShardBuffer {
    /// f32 values on `device`.
    pub fn f32(values: Vec<f32>, device: Device) -> ShardBuffer {
        ShardBuffer {
            data: Buffer::F32(values),
            device,
        }
    }

    /// An empty buffer on the same device (what a shard stored on disk leaves behind).
    pub fn emptied(&self) -> ShardBuffer {
        ShardBuffer::f32(Vec::new(), self.device.clone())
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() * self.data.dtype().size()
    }

    /// The elements as f32 (master shards are f32 in host memory).
    pub fn values(&self) -> Result<&[f32], EngineError> {
        self.data.as_slice::<f32>().ok_or_else(|| self.not_f32())
    }

    /// The elements as f32, writable.
    pub fn values_mut(&mut self) -> Result<&mut [f32], EngineError> {
        let (dtype, device) = (self.data.dtype(), format!("{:?}", self.device));
        self.data
            .as_mut_slice::<f32>()
            .ok_or(EngineError::UnsupportedTensor {
                op: "parameter shard",
                what: "the master shard".into(),
                found: format!("{dtype:?} on {device}"),
                expected: "f32 master shards in host memory",
            })
    }

    fn not_f32(&self) -> EngineError {
        EngineError::UnsupportedTensor {
            op: "parameter shard",
            what: "the master shard".into(),
            found: format!("{:?} on {:?}", self.data.dtype(), self.device),
            expected: "f32 master shards in host memory",
        }
    }
}

/// One parameter of a unit as this rank holds it between steps.
#[derive(Debug, Clone)]
pub(crate) struct FsdpParam {
    /// Name, shape, rows per rank and place in the unit's packed block.
    pub(crate) layout: ShardLayout,
    /// This rank's rows, padded to `rows_per_rank` (the whole parameter when the shard
    /// group is one rank); padding rows hold zeros.
    pub(crate) shard: ShardBuffer,
    /// This rank's index in the shard group.
    rank: usize,
}

impl FsdpParam {
    /// This rank's `rows` (`layout.shard_numel()` values, padding included) as received.
    pub fn from_rows(
        layout: ShardLayout,
        rows: Vec<f32>,
        rank: usize,
        device: Device,
    ) -> Result<FsdpParam, EngineError> {
        if rows.len() != layout.shard_numel() {
            return Err(EngineError::State {
                name: layout.name.clone(),
                problem: format!(
                    "{} values received for a shard of {} elements",
                    rows.len(),
                    layout.shard_numel()
                ),
            });
        }
        Ok(FsdpParam {
            layout,
            shard: ShardBuffer::f32(rows, device),
            rank,
        })
    }

    /// The rows of the full parameter this rank owns (empty for a rank holding only padding).
    pub fn owned_rows(&self) -> Range<usize> {
        let (start, end) = self.layout.rows_of(self.rank);
        start..end
    }

    /// This rank's values of the owned rows (padding left out).
    pub fn local_values(&self) -> Result<&[f32], EngineError> {
        let n = self.owned_rows().len() * self.layout.row_elems;
        self.shard
            .values()?
            .get(..n)
            .ok_or_else(|| self.not_in_memory())
    }

    fn not_in_memory(&self) -> EngineError {
        EngineError::State {
            name: self.layout.name.clone(),
            problem:
                "its rows are not in memory: they are stored on disk (read them through the engine)"
                    .into(),
        }
    }

    /// Replaces the values of the owned rows (exactly `owned_rows().len()` rows).
    pub fn set_local_values(&mut self, values: &[f32]) -> Result<(), EngineError> {
        let n = self.owned_rows().len() * self.layout.row_elems;
        if values.len() != n {
            return Err(EngineError::State {
                name: self.layout.name.clone(),
                problem: format!(
                    "{} values given for rows {:?} of {} elements each ({n} expected)",
                    values.len(),
                    self.owned_rows(),
                    self.layout.row_elems
                ),
            });
        }
        if self.shard.len() < n {
            return Err(self.not_in_memory());
        }
        self.shard.values_mut()?[..n].copy_from_slice(values);
        Ok(())
    }
}

/// `pieces` one after another into `out`.
fn copy_pieces<'a, T: Copy + 'a>(pieces: impl Iterator<Item = &'a [T]>, out: &mut [T]) {
    let mut at = 0;
    for piece in pieces {
        out[at..at + piece.len()].copy_from_slice(piece);
        at += piece.len();
    }
}

impl ShardLayout {
    /// Copies the full parameter out of an all-gathered unit (rank r's shard block of `block`
    /// elements at `r * block`, `ranks` blocks) into `out`, leaving the padding rows out.
    pub fn unpack<T: Copy>(&self, gathered: &[T], block: usize, ranks: usize, out: &mut [T]) {
        copy_pieces(self.gathered_pieces(gathered, block, ranks), out);
    }

    /// The full parameter's rows in an all-gathered unit, rank by rank, in order: what
    /// [`ShardLayout::unpack`] copies, for a caller that appends them to a fresh buffer
    /// (one pass over the bytes, no zero fill first).
    pub fn gathered_pieces<'a, T>(
        &'a self,
        gathered: &'a [T],
        block: usize,
        ranks: usize,
    ) -> impl Iterator<Item = &'a [T]> + 'a {
        (0..ranks).map(move |r| &gathered[r * block..][self.piece_of(r)])
    }

    /// [`ShardLayout::gathered_pieces`] out of every rank's block apart (`blocks[r]`: rank
    /// r's).
    pub fn pieces_in<'a, T>(&'a self, blocks: &'a [&'a [T]]) -> impl Iterator<Item = &'a [T]> + 'a {
        blocks
            .iter()
            .enumerate()
            .map(move |(r, block)| &block[self.piece_of(r)])
    }

    /// [`ShardLayout::unpack`] out of every rank's block apart (`blocks[r]`: rank r's).
    pub fn unpack_blocks<T: Copy>(&self, blocks: &[&[T]], out: &mut [T]) {
        copy_pieces(self.pieces_in(blocks), out);
    }

    /// Where rank `r`'s rows of the parameter sit in rank `r`'s block.
    fn piece_of(&self, r: usize) -> Range<usize> {
        let (start, end) = self.rows_of(r);
        self.offset..self.offset + (end - start) * self.row_elems
    }

    /// The inverse of [`ShardLayout::unpack`]: scatters the full `values` into `ranks` shard
    /// blocks of `block` elements (padding rows untouched).
    pub fn pack<T: Copy>(&self, values: &[T], block: usize, ranks: usize, packed: &mut [T]) {
        self.pack_rows(0, values, block, ranks, packed);
    }

    /// [`ShardLayout::pack`] of a piece of whole rows starting at row `first`.
    pub fn pack_rows<T: Copy>(
        &self,
        first: usize,
        piece: &[T],
        block: usize,
        ranks: usize,
        packed: &mut [T],
    ) {
        self.pack_runs(first, piece.len(), block, ranks, |from, to| {
            packed[to].copy_from_slice(&piece[from])
        });
    }

    /// Where [`ShardLayout::pack_rows`] puts a piece of `len` elements of whole rows starting
    /// at row `first`: `run` is called with each run's range in the piece and in the packed
    /// blocks (of the same length), rank by rank.
    pub fn pack_runs(
        &self,
        first: usize,
        len: usize,
        block: usize,
        ranks: usize,
        mut run: impl FnMut(Range<usize>, Range<usize>),
    ) {
        let end_row = first + len / self.row_elems.max(1);
        for r in 0..ranks {
            let (start, end) = self.rows_of(r);
            let (a, b) = (start.max(first), end.min(end_row));
            if a >= b {
                continue;
            }
            let len = (b - a) * self.row_elems;
            let to = r * block + self.offset + (a - start) * self.row_elems;
            let from = (a - first) * self.row_elems;
            run(from..from + len, to..to + len);
        }
    }
}
