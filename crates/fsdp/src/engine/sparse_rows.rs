//! Row-sparse gradient reduction: a unit whose parameters include row-sparse ones (an
//! embedding table looked up by a batch: `nn::Embedding::sparse`) sends, for those, only the
//! rows some rank's gradient touches, and reduce-scatters the rest of its block as usual.
//! The result is the dense reduction's: the same mean, rows nobody touched zero.
//!
//! On the group the reduction runs over, every rank issues, in this order: an all-gather of
//! its touched-row and value counts, which it waits for (the sizes of what follows must agree
//! on every rank, so this waits for the group's earlier collectives, too: it suits the unit
//! reduced last, the root, where the step waits for every reduction anyway); the dense
//! part's reduce-scatter (all-reduce with a shard group of one rank: NO_SHARD); and
//! all-gathers of the touched rows' ids and of their values, padded to the largest count.

use fsdp_comm::finish_avg;
use fsdp_comm::{Buffer, BufferElement, CommError, Communicator, Mesh, ReduceOp, Work};

use candle_core::Tensor;

use super::buffers::{GradPack, GradientVisitor, visit_gradient};
use super::error::EngineError;
use super::plan::{ShardLayout, UnitPlan};

/// One row-sparse parameter's place in a unit's packed block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    /// Start inside each rank's block.
    offset: usize,
    /// Rows each rank's block holds (`rows_per_rank`).
    rows: usize,
    /// Elements per row.
    row_elems: usize,
    /// First id of its rows: ids number the row-sparse parameters' rows of all blocks,
    /// parameter by parameter, block by block.
    base: usize,
}

/// Where a unit's row-sparse parameters lie in its packed gradient of `ranks` blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowSparsePlan {
    block: usize,
    ranks: usize,
    /// By offset.
    segments: Vec<Segment>,
}

impl RowSparsePlan {
    /// The plan for a unit's `layouts` (packed in blocks of `block` elements, `ranks` of
    /// them); `None` when none of its trainable parameters has a row-sparse gradient.
    pub fn new(layouts: &[&ShardLayout], block: usize, ranks: usize) -> Option<RowSparsePlan> {
        let mut sparse: Vec<&ShardLayout> = layouts
            .iter()
            .copied()
            .filter(|l| l.sparse_grad && l.requires_grad && l.rows_per_rank > 0)
            .collect();
        if sparse.is_empty() {
            return None;
        }
        sparse.sort_by_key(|l| l.offset);
        let mut base = 0;
        let segments = sparse
            .iter()
            .map(|l| {
                let s = Segment {
                    offset: l.offset,
                    rows: l.rows_per_rank,
                    row_elems: l.row_elems,
                    base,
                };
                base += l.rows_per_rank * ranks;
                s
            })
            .collect();
        Some(RowSparsePlan {
            block,
            ranks,
            segments,
        })
    }

    /// Elements of a block outside the row-sparse parameters.
    fn dense_block(&self) -> usize {
        self.block
            - self
                .segments
                .iter()
                .map(|s| s.rows * s.row_elems)
                .sum::<usize>()
    }

    /// The ranges of a block outside the row-sparse parameters, in order.
    fn dense_ranges(&self) -> Vec<std::ops::Range<usize>> {
        let mut ranges = Vec::new();
        let mut at = 0;
        for s in &self.segments {
            if s.offset > at {
                ranges.push(at..s.offset);
            }
            at = s.offset + s.rows * s.row_elems;
        }
        if at < self.block {
            ranges.push(at..self.block);
        }
        ranges
    }

    /// The segment, block and row of row id `id`.
    fn locate(&self, id: usize) -> Option<(&Segment, usize, usize)> {
        let s = self
            .segments
            .iter()
            .rev()
            .find(|s| s.base <= id && id < s.base + s.rows * self.ranks)?;
        let at = id - s.base;
        Some((s, at / s.rows, at % s.rows))
    }

    /// Splits a packed gradient into its dense part (each block without the row-sparse
    /// parameters), the ids of the row-sparse rows that are not all zero, and their values.
    fn split<T: BufferElement>(&self, packed: &[T]) -> (Vec<T>, Vec<i64>, Vec<T>) {
        let zero = T::default();
        let ranges = self.dense_ranges();
        let mut dense = Vec::with_capacity(self.dense_block() * self.ranks);
        let (mut ids, mut values) = (Vec::new(), Vec::new());
        for r in 0..self.ranks {
            let block = &packed[r * self.block..(r + 1) * self.block];
            for range in &ranges {
                dense.extend_from_slice(&block[range.clone()]);
            }
            for s in &self.segments {
                let rows = &block[s.offset..s.offset + s.rows * s.row_elems];
                for (j, row) in rows.chunks_exact(s.row_elems).enumerate() {
                    if row.iter().any(|&x| x != zero) {
                        ids.push((s.base + r * s.rows + j) as i64);
                        values.extend_from_slice(row);
                    }
                }
            }
        }
        (dense, ids, values)
    }
}

/// A unit's gradients collected for a row-sparse reduction as they arrive, instead of
/// packed whole: the other parameters packed into blocks without the row-sparse ones, and of
/// those only the rows that are not all zero — the dense table gradient is read once and
/// never copied (a backward without sync, or one adding carried gradients, packs whole).
pub(crate) struct CompactGrads {
    plan: RowSparsePlan,
    dense: GradPack,
    ids: Vec<i64>,
    values: Buffer,
}

impl CompactGrads {
    /// Empty, in `dtype` (the reduction's).
    pub fn new(plan: RowSparsePlan, dtype: fsdp_comm::DType) -> CompactGrads {
        CompactGrads {
            dense: GradPack::new(dtype, plan.dense_block(), plan.ranks),
            values: Buffer::empty(dtype),
            ids: Vec::new(),
            plan,
        }
    }

    /// Takes the full gradient of the parameter laid out as `layout`.
    pub fn add(&mut self, layout: &ShardLayout, grad: &Tensor) -> Result<(), EngineError> {
        let plan = &self.plan;
        let Some(s) = plan
            .segments
            .iter()
            .find(|s| s.offset == layout.offset && layout.sparse_grad)
        else {
            // A dense parameter: packed at its place in blocks without the sparse ones.
            let before: usize = plan
                .segments
                .iter()
                .filter(|s| s.offset < layout.offset)
                .map(|s| s.rows * s.row_elems)
                .sum();
            let moved = ShardLayout {
                offset: layout.offset - before,
                ..layout.clone()
            };
            return self.dense.add(&moved, grad);
        };
        struct Touched<'a> {
            base: usize,
            row_elems: usize,
            ids: &'a mut Vec<i64>,
        }
        impl GradientVisitor for Touched<'_> {
            fn visit<T: BufferElement>(self, grad: &[T], values: &mut Vec<T>) {
                let zero = T::default();
                // Row g of the parameter is row g % rows of block g / rows: id base + g.
                for (g, row) in grad.chunks_exact(self.row_elems.max(1)).enumerate() {
                    if row.iter().any(|&x| x != zero) {
                        self.ids.push((self.base + g) as i64);
                        values.extend_from_slice(row);
                    }
                }
            }
        }
        let touched = Touched {
            base: s.base,
            row_elems: s.row_elems,
            ids: &mut self.ids,
        };
        visit_gradient(&layout.name, grad, &mut self.values, touched)
    }

    /// Starts the reduction over `group` (see [`RowSparseReduce::start`]).
    pub fn start(self, group: &dyn Communicator) -> Result<RowSparseReduce, CommError> {
        let dense = self.dense.finish();
        RowSparseReduce::start_parts(self.plan, group, dense, self.ids, self.values)
    }
}

/// A row-sparse reduction in flight (see the module's documentation).
pub(crate) struct RowSparseReduce {
    plan: RowSparsePlan,
    /// The dense part's reduction; `None` when every parameter of the unit is row-sparse.
    dense: Option<Work<Buffer>>,
    /// Ids and values of every rank's touched rows; `None` when no rank touched any.
    rows: Option<(Work<Buffer>, Work<Buffer>)>,
    /// Each rank's (ids, values) counts and the padded lengths.
    counts: Vec<(usize, usize)>,
    padded: (usize, usize),
    /// The block this rank keeps (its rank; 0 with a shard group of one rank).
    kept: usize,
    /// Ranks averaged over, and this rank among them (for errors).
    size: usize,
    rank: usize,
    /// Payload bytes this rank sends.
    pub bytes: usize,
}

impl RowSparseReduce {
    /// Starts the reduction of `packed` over `group`: a reduce-scatter of `plan.ranks` blocks
    /// when that is the group's size, an all-reduce of one block otherwise (the replicas of
    /// NO_SHARD). An error only from the counts' all-gather; later failures come from `wait`.
    pub fn start(
        plan: RowSparsePlan,
        group: &dyn Communicator,
        packed: Buffer,
    ) -> Result<RowSparseReduce, CommError> {
        let (dense, ids, values) = split_buffer(&plan, &packed).ok_or_else(|| {
            invalid(
                group.rank(),
                format!("gradients packed as {:?}", packed.dtype()),
            )
        })?;
        drop(packed);
        Self::start_parts(plan, group, dense, ids, values)
    }

    /// [`RowSparseReduce::start`] of a gradient already split: the dense part (blocks
    /// without the row-sparse parameters), and the touched rows' ids and values.
    pub fn start_parts(
        plan: RowSparsePlan,
        group: &dyn Communicator,
        dense: Buffer,
        ids: Vec<i64>,
        values: Buffer,
    ) -> Result<RowSparseReduce, CommError> {
        let n = group.size();
        let mine = vec![ids.len() as i64, values.len() as i64];
        let counts: Vec<(usize, usize)> = group
            .all_gather(Buffer::I64(mine))
            .wait()?
            .into_vec::<i64>()
            .map_err(|b| {
                invalid(
                    group.rank(),
                    format!("row counts came back as {:?}", b.dtype()),
                )
            })?
            .chunks_exact(2)
            .map(|c| (c[0].max(0) as usize, c[1].max(0) as usize))
            .collect();
        let padded = counts
            .iter()
            .fold((0, 0), |(a, b), &(i, v)| (a.max(i), b.max(v)));
        // What the ring algorithms send: (n-1)/n of the buffer for a reduce-scatter, twice
        // that for an all-reduce; n-1 times this rank's part for an all-gather.
        let scatter = plan.ranks == n && n > 1;
        let dense_bytes = dense.len() * dense.dtype().size() * (n - 1) / n;
        let mut bytes = 16 * (n - 1);
        let dense = (plan.dense_block() > 0).then(|| {
            if scatter {
                bytes += dense_bytes;
                group.reduce_scatter(dense, ReduceOp::Avg)
            } else {
                bytes += 2 * dense_bytes;
                group.all_reduce(dense, ReduceOp::Avg)
            }
        });
        let rows = (padded.0 > 0).then(|| {
            let mut ids = ids;
            ids.resize(padded.0, -1);
            let values = pad(values, padded.1);
            bytes += (ids.len() * 8 + values.len() * values.dtype().size()) * (n - 1);
            (group.all_gather(Buffer::I64(ids)), group.all_gather(values))
        });
        Ok(RowSparseReduce {
            rank: group.rank(),
            kept: if plan.ranks == n { group.rank() } else { 0 },
            plan,
            dense,
            rows,
            counts,
            padded,
            size: n,
            bytes,
        })
    }

    /// This rank's block of the mean, in f32.
    pub fn wait(self) -> Result<Vec<f32>, CommError> {
        let plan = &self.plan;
        let mut out = vec![0f32; plan.block];
        if let Some(dense) = self.dense {
            let dense = dense.wait()?;
            let mut values = vec![0f32; dense.len()];
            dense.to_f32_into(&mut values);
            let mut from = values.iter();
            for range in plan.dense_ranges() {
                for (o, v) in out[range].iter_mut().zip(&mut from) {
                    *o = *v;
                }
            }
        }
        if let Some((ids, values)) = self.rows {
            let ids = ids
                .wait()?
                .into_vec::<i64>()
                .map_err(|b| invalid(self.rank, format!("row ids came back as {:?}", b.dtype())))?;
            let values = values.wait()?;
            let mut vals = vec![0f32; values.len()];
            values.to_f32_into(&mut vals);
            // Rank by rank: the sum of each row in rank order, as every rank computes it.
            for (q, &(count, _)) in self.counts.iter().enumerate() {
                let ids = &ids[q * self.padded.0..q * self.padded.0 + count];
                let mut at = q * self.padded.1;
                for &id in ids {
                    let Some((s, block, row)) =
                        usize::try_from(id).ok().and_then(|i| plan.locate(i))
                    else {
                        return Err(invalid(
                            self.rank,
                            format!(
                                "rank {q} sent row id {id}, outside the unit's row-sparse parameters"
                            ),
                        ));
                    };
                    let src = vals.get(at..at + s.row_elems).ok_or_else(|| {
                        invalid(
                            self.rank,
                            format!("rank {q} sent fewer row values than ids"),
                        )
                    })?;
                    if block == self.kept {
                        let dst = s.offset + row * s.row_elems;
                        for (o, v) in out[dst..dst + s.row_elems].iter_mut().zip(src) {
                            *o += *v;
                        }
                    }
                    at += s.row_elems;
                }
            }
        }
        for s in &plan.segments {
            let rows = &mut out[s.offset..s.offset + s.rows * s.row_elems];
            finish_avg(rows, ReduceOp::Avg, self.size);
        }
        Ok(out)
    }
}

/// Refuses row-sparse gradients under hybrid sharding (a reduce-scatter inside machines and a
/// mean across them, which the touched rows' exchange does not do).
pub(crate) fn refuse_hybrid(plan: &UnitPlan, mesh: &Mesh) -> Result<(), EngineError> {
    let sparse = plan
        .units
        .iter()
        .flat_map(|u| &u.params)
        .find(|p| p.sparse_grad);
    match (sparse, &mesh.replicate) {
        (Some(p), Some(_)) if mesh.shard_size() > 1 => Err(EngineError::Unsupported {
            setting: format!(
                "the row-sparse gradient of `{}` with hybrid sharding",
                p.name
            ),
            hint: "use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, or a dense embedding",
        }),
        _ => Ok(()),
    }
}

/// A malformed row-sparse exchange, as the communication layer reports bad arguments.
fn invalid(rank: usize, reason: String) -> CommError {
    CommError::InvalidArgument {
        rank,
        op: "row-sparse gradient reduction".into(),
        reason,
    }
}

/// [`RowSparsePlan::split`] on a float buffer of any width, results in its dtype; `None` for
/// a buffer of integers.
fn split_buffer(plan: &RowSparsePlan, packed: &Buffer) -> Option<(Buffer, Vec<i64>, Buffer)> {
    fn typed<T: BufferElement>(plan: &RowSparsePlan, p: &[T]) -> (Buffer, Vec<i64>, Buffer) {
        let (dense, ids, values) = plan.split(p);
        (T::into_buffer(dense), ids, T::into_buffer(values))
    }
    Some(match packed {
        Buffer::F32(p) => typed(plan, p),
        Buffer::F64(p) => typed(plan, p),
        Buffer::F16(p) => typed(plan, p),
        Buffer::BF16(p) => typed(plan, p),
        _ => return None,
    })
}

/// `values` padded with zeros to `len` elements.
fn pad(mut values: Buffer, len: usize) -> Buffer {
    fn grow<T: BufferElement>(mut v: Vec<T>, len: usize) -> Buffer {
        v.resize(len, T::default());
        T::into_buffer(v)
    }
    match std::mem::replace(&mut values, Buffer::F32(Vec::new())) {
        Buffer::F32(v) => grow(v, len),
        Buffer::F64(v) => grow(v, len),
        Buffer::F16(v) => grow(v, len),
        Buffer::BF16(v) => grow(v, len),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use fsdp_comm::LocalGroup;

    fn layout(
        name: &str,
        rows: usize,
        row_elems: usize,
        ranks: usize,
        sparse: bool,
    ) -> ShardLayout {
        ShardLayout {
            name: name.into(),
            shape: vec![rows, row_elems],
            requires_grad: true,
            sparse_grad: sparse,
            rows_per_rank: rows.div_ceil(ranks),
            row_elems,
            offset: 0,
            packing: None,
        }
    }

    /// A unit of a dense bias, a sparse table of 7 rows (uneven over 3 ranks) and a second
    /// sparse table, packed as the engine packs; each rank's gradient touches a few rows.
    fn unit(ranks: usize) -> (Vec<ShardLayout>, usize) {
        let mut ls = vec![
            layout("bias", 5, 1, ranks, false),
            layout("table", 7, 3, ranks, true),
            layout("other", 4, 2, ranks, true),
        ];
        let mut at = 0;
        for l in &mut ls {
            l.offset = at;
            at += l.rows_per_rank * l.row_elems;
        }
        (ls, at)
    }

    /// Rank `r`'s full gradient of parameter `li`: integers (exact sums in any order), zero
    /// outside the rows rank `r` touches.
    fn param_gradient(l: &ShardLayout, li: usize, r: usize) -> Vec<f32> {
        let mut g = vec![0f32; l.shape[0] * l.row_elems];
        for (row, values) in g.chunks_exact_mut(l.row_elems).enumerate() {
            if l.sparse_grad && !(row + r).is_multiple_of(3) {
                continue;
            }
            for (e, v) in values.iter_mut().enumerate() {
                *v = (1 + r * 7 + li * 5 + row * 3 + e) as f32 - 10.0;
            }
        }
        g
    }

    /// Rank `r`'s gradients packed as the engine packs them.
    fn gradient(ls: &[ShardLayout], block: usize, ranks: usize, r: usize) -> Vec<f32> {
        let mut packed = vec![0f32; block * ranks];
        for (li, l) in ls.iter().enumerate() {
            l.pack(&param_gradient(l, li, r), block, ranks, &mut packed);
        }
        packed
    }

    fn run(ranks: usize, shard: bool) -> Vec<(Vec<f32>, Vec<f32>)> {
        let members = LocalGroup::create(ranks);
        let blocks = if shard { ranks } else { 1 };
        std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .enumerate()
                .map(|(r, g)| {
                    s.spawn(move || {
                        let (ls, block) = unit(blocks);
                        let refs: Vec<&ShardLayout> = ls.iter().collect();
                        let packed = gradient(&ls, block, blocks, r);
                        let plan = RowSparsePlan::new(&refs, block, blocks).unwrap();
                        let dense = if shard {
                            g.reduce_scatter(Buffer::F32(packed.clone()), ReduceOp::Avg)
                        } else {
                            g.all_reduce(Buffer::F32(packed.clone()), ReduceOp::Avg)
                        };
                        let dense = dense.wait().unwrap().into_vec::<f32>().unwrap();
                        let sparse = RowSparseReduce::start(plan.clone(), &g, Buffer::F32(packed))
                            .unwrap()
                            .wait()
                            .unwrap();
                        // Collected parameter by parameter as backward delivers them.
                        let mut compact = CompactGrads::new(plan, fsdp_comm::DType::F32);
                        for (li, l) in ls.iter().enumerate() {
                            let dims = (l.shape[0], l.row_elems);
                            let t = Tensor::from_vec(param_gradient(l, li, r), dims, &Device::Cpu);
                            compact.add(l, &t.unwrap()).unwrap();
                        }
                        assert_eq!(compact.start(&g).unwrap().wait().unwrap(), sparse);
                        (dense, sparse)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn touched_rows_reduce_to_the_dense_mean_on_shards_and_replicas() {
        for ranks in 1..=4 {
            for shard in [true, false] {
                for (r, (dense, sparse)) in run(ranks, shard).into_iter().enumerate() {
                    assert_eq!(dense, sparse, "{ranks} ranks, shard {shard}, rank {r}");
                    assert!(sparse.iter().any(|&x| x != 0.0));
                }
            }
        }
    }

    #[test]
    fn only_touched_rows_are_split_off() {
        let (ls, block) = unit(2);
        let refs: Vec<&ShardLayout> = ls.iter().collect();
        let plan = RowSparsePlan::new(&refs, block, 2).unwrap();
        assert_eq!(plan.dense_ranges(), vec![0..3]);
        let (dense, ids, values) = plan.split(&gradient(&ls, block, 2, 1));
        assert_eq!(dense.len(), 6);
        // Rank 1 touches rows 2 and 5 of `table` (block 0 row 2, block 1 row 1: ids 2, 5)
        // and row 2 of `other` (block 1 row 0: 8 + 2); listed block by block.
        assert_eq!(ids, vec![2, 5, 10]);
        assert_eq!(values.len(), 3 + 2 + 3);
        for id in ids {
            let (s, b, j) = plan.locate(id as usize).unwrap();
            assert_eq!(s.base + b * s.rows + j, id as usize);
        }
        assert!(plan.locate(16).is_none());
        // No sparse parameter, or only frozen ones: no plan.
        let dense_only = [&ls[0]];
        assert!(RowSparsePlan::new(&dense_only, block, 2).is_none());
    }
}
