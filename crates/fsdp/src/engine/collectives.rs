//! A unit's communication: the all-gather of its shards and the reduction of its gradients,
//! each one collective on the mesh in the dtype given — mixed precision is the cast made
//! while packing, hybrid sharding the second collective on the replicate dimension.

use std::sync::Arc;
use std::time::Instant;

use fsdp_comm::{Buffer, CommError, Communicator, DType, Mesh, ReduceOp, TwoHops, Work};

use super::error::EngineError;
use super::plan::UnitKind;
use super::quantized_blocks::Codec;
use super::sparse_rows::{CompactGrads, RowSparsePlan, RowSparseReduce};
use crate::config::{AllGatherDtype, FsdpPlugin, MixedPrecision, ReduceDtype};
use crate::trace::Tracer;

/// The element types a unit communicates in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommDtypes {
    /// What parameters are gathered (and computed) in.
    pub param: DType,
    /// What gradients are reduced in.
    pub reduce: DType,
    /// Parameters cross the wire as int8 blocks, dequantized into `param` on arrival
    /// (`fsdp_all_gather_dtype: int8`).
    pub gather_int8: bool,
    /// Gradients (packed in f32, `reduce`) cross the wire as integer blocks of this codec,
    /// summed in f32 on arrival (`fsdp_reduce_dtype: int8` or `int4`).
    pub(crate) reduce_codec: Option<Codec>,
}

impl CommDtypes {
    /// The element types of communication and compute: parameters gathered (and computed)
    /// in `mixed_precision`'s dtype over f32 master shards and optimizer state; gradients
    /// reduced in `fsdp_reduce_dtype` (f32 unless set: half-precision gradients summed over
    /// ranks lose low bits). fp16 has bf16's precision and a narrower range: scale the loss
    /// with a `GradScaler` (the Accelerator does).
    pub(crate) fn for_plugin(plugin: &FsdpPlugin) -> CommDtypes {
        CommDtypes {
            param: match plugin.mixed_precision {
                MixedPrecision::No => DType::F32,
                MixedPrecision::Bf16 => DType::BF16,
                MixedPrecision::Fp16 => DType::F16,
            },
            reduce: match plugin.reduce_dtype {
                ReduceDtype::Fp32 | ReduceDtype::Int8 | ReduceDtype::Int4 => DType::F32,
                ReduceDtype::Bf16 => DType::BF16,
                ReduceDtype::Fp16 => DType::F16,
            },
            gather_int8: plugin.all_gather_dtype == AllGatherDtype::Int8,
            reduce_codec: Codec::for_reduce(plugin.reduce_dtype),
        }
    }
}

impl Default for CommDtypes {
    /// Full precision.
    fn default() -> Self {
        CommDtypes {
            param: DType::F32,
            reduce: DType::F32,
            gather_int8: false,
            reduce_codec: None,
        }
    }
}

/// Starts gathering a unit: this rank's block as it `send`s it ([`send_block`]),
/// all-gathered over the shard dimension (of more than one rank), in two hops across
/// machines where the mesh has them.
pub(crate) fn all_gather(mesh: &Mesh, send: Buffer) -> Work<Buffer> {
    match &mesh.machines {
        Some(m) => m.gathers.all_gather(send),
        None => mesh.shard.all_gather(send),
    }
}

/// The group a unit's all-gather runs on in place ([`Communicator::all_gather_in_place`]):
/// the shard group, unless the gather takes two hops across machines ([`all_gather`]).
pub(crate) fn in_place_group(mesh: &Mesh) -> Option<&Arc<dyn Communicator>> {
    mesh.machines.is_none().then_some(&mesh.shard)
}

/// This rank's `packed` rows (its parameters' shards, `runs` long each) as an all-gather in
/// `dtypes` sends them: cast to `dtypes.param`, or quantized to int8 blocks with
/// `dtypes.gather_int8` ([`Codec::INT8`]) apart by `runs`.
pub(crate) fn send_block(
    packed: Vec<f32>,
    runs: &[usize],
    dtypes: CommDtypes,
) -> Result<Buffer, EngineError> {
    let dtype = dtypes.param;
    Ok(if dtypes.gather_int8 {
        Buffer::U8(Codec::INT8.encode(&packed, runs))
    } else if dtype == DType::F32 {
        Buffer::F32(packed)
    } else {
        super::cpu_floats::float_buffer(&packed, dtype).ok_or(EngineError::Unsupported {
            setting: format!("gathering parameters in {dtype:?}"),
            hint: "parameters are gathered in a float type",
        })?
    })
}

/// A unit's gradients on their way to this rank's rows: a reduce-scatter (mean) over the
/// shard dimension in flight, then a mean over replicas when the mesh has them — or, with a
/// shard dimension of one rank (NO_SHARD), the replicas' mean itself in flight.
pub(crate) struct PendingReduce {
    scatter: Work<Buffer>,
    /// A unit with row-sparse parameters: the whole reduction (`scatter` is then empty).
    sparse: Option<RowSparseReduce>,
    /// The collective in flight, for the trace.
    kind: &'static str,
    /// Replicas to average over once the reduce-scatter is done (taken when that mean is
    /// issued).
    replicate: Option<Arc<dyn Communicator>>,
    /// How means travel when they are quantized ([`mean`]).
    quantized: Option<Quantized>,
    /// When the reduce-scatter ran, once the replicas' mean has replaced it in `scatter`.
    scattered: Option<(Instant, Instant)>,
    /// When it was issued, and the bytes sent (for the trace).
    issued: Instant,
    bytes: usize,
}

impl PendingReduce {
    /// Issues the replicas' mean if the reduce-scatter has finished; returns whether nothing
    /// is left to issue. Call it on a step's reductions in the order they were issued,
    /// stopping at the first that returns false, so every rank issues the replicas' means in
    /// one order whenever each rank sees its reduce-scatters finish.
    pub fn advance(&mut self) -> bool {
        if self.replicate.is_none() {
            return true;
        }
        if !self.scatter.is_finished() {
            return false;
        }
        self.issue_replicate();
        true
    }

    /// Replaces the finished (or awaited) reduce-scatter with the replicas' mean of its
    /// result; a failure stays in `scatter` for [`PendingReduce::wait`].
    fn issue_replicate(&mut self) {
        let Some(r) = self.replicate.take() else {
            return;
        };
        let scatter =
            std::mem::replace(&mut self.scatter, Work::ready(Ok(Buffer::F32(Vec::new()))));
        self.scatter = match scatter.wait_timed() {
            Ok((out, ran)) => {
                self.scattered = Some(ran.unwrap_or((self.issued, Instant::now())));
                mean(r.as_ref(), out, self.quantized.clone(), Spread::Whole).0
            }
            Err(e) => Work::ready(Err(e)),
        };
    }

    /// This rank's reduced gradient rows of the unit, in f32 (the optimizer's type); the
    /// reduction is recorded in `trace` as `unit`'s.
    pub fn wait(mut self, trace: Option<&Tracer>, unit: &str) -> Result<Vec<f32>, CommError> {
        let waited = Instant::now();
        if let Some(sparse) = self.sparse.take() {
            let out = sparse.wait()?;
            if let Some(t) = trace {
                let args = serde_json::json!({ "bytes": self.bytes, "row_sparse": true });
                let ran = (self.issued, Instant::now());
                t.collective(self.kind, "reduce", unit, ran, waited, args);
            }
            return Ok(out);
        }
        self.issue_replicate();
        let (out, ran) = self.scatter.wait_timed()?;
        let first = self.scattered.unwrap_or((self.issued, waited));
        let (start, end) = match ran {
            Some((s, e)) => (first.0.min(s), e),
            None => (first.0, Instant::now()),
        };
        if let Some(t) = trace {
            let args = serde_json::json!({ "bytes": self.bytes });
            t.collective(self.kind, "reduce", unit, (start, end), waited, args);
        }
        match out {
            Buffer::F32(v) => Ok(v),
            other => {
                let mut v = vec![0f32; other.len()];
                other.to_f32_into(&mut v);
                Ok(v)
            }
        }
    }
}

/// Starts reducing a unit's packed gradients (`size` shard blocks) to their mean; with a
/// `sparse` plan (the unit has row-sparse parameters, the mesh one dimension), only their
/// touched rows are sent (in f32). A replicated unit (every rank holds all of it: ignored
/// modules) is averaged over the shard dimension whole instead of reduce-scattered. With
/// `quantized` (f32 gradients packed), every exchange carries integer blocks summed in f32.
pub(crate) fn reduce(
    mesh: &Mesh,
    packed: Buffer,
    sparse: Option<RowSparsePlan>,
    kind: UnitKind,
    quantized: Option<Quantized>,
) -> Result<PendingReduce, CommError> {
    if let (Some(plan), Some(group)) = (sparse, row_sparse_group(mesh)) {
        return row_sparse(mesh, RowSparseReduce::start(plan, group, packed)?);
    }
    let ((scatter, bytes), kind, replicate) = match (mesh.shard_size(), &mesh.replicate) {
        // One rank: nothing leaves it.
        (1, None) => ((Work::ready(Ok(packed)), 0), "reduce-scatter", None),
        // Nothing to scatter: the replicas' mean starts now, while backward goes on, instead
        // of when the step waits for it.
        (1, Some(r)) => (
            mean(r.as_ref(), packed, quantized.clone(), Spread::Whole),
            "all-reduce",
            None,
        ),
        _ if kind.is_replicated() => (
            mean(
                mesh.shard.as_ref(),
                packed,
                quantized.clone(),
                Spread::Whole,
            ),
            "all-reduce",
            mesh.replicate.clone(),
        ),
        _ => (
            match &mesh.machines {
                Some(m) => two_hop_mean(&m.reductions, packed, quantized.clone()),
                None => mean(
                    mesh.shard.as_ref(),
                    packed,
                    quantized.clone(),
                    Spread::Parts,
                ),
            },
            "reduce-scatter",
            mesh.replicate.clone(),
        ),
    };
    Ok(PendingReduce {
        bytes,
        scatter,
        sparse: None,
        kind,
        replicate,
        quantized,
        scattered: None,
        issued: Instant::now(),
    })
}

/// Gradients quantized for the wire: the codec, and the runs of a rank's block.
#[derive(Clone)]
pub(crate) struct Quantized {
    pub codec: Codec,
    pub runs: Arc<[usize]>,
}

/// Where a group's mean goes: whole to every member, or a part (of `size`) to each.
#[derive(Clone, Copy)]
enum Spread {
    Whole,
    Parts,
}

/// The group's mean of `values` spread as `spread` says, and the bytes this member sends
/// for it: an all-reduce or a reduce-scatter; with `quantized`, an all-gather of every
/// member's integer blocks or an all-to-all of its integer parts, which each
/// member dequantizes and sums in f32 in rank order (ZeRO++'s quantized gradients: the sum
/// is never formed in low precision, and members holding the same part hold the same
/// values).
fn mean(
    group: &dyn Communicator,
    values: Buffer,
    quantized: Option<Quantized>,
    spread: Spread,
) -> (Work<Buffer>, usize) {
    let Some(Quantized { codec, runs }) = quantized else {
        let bytes = values.len() * values.dtype().size();
        // Not `reduce_scatter_into`: the packed input is freed when the collective is done
        // with it, not held until the step waits for every unit's reduction.
        let work = match spread {
            Spread::Whole => group.all_reduce(values, ReduceOp::Avg),
            Spread::Parts => group.reduce_scatter(values, ReduceOp::Avg),
        };
        return (work, bytes);
    };
    let n = group.size();
    let encoded = match (values.as_slice::<f32>(), spread) {
        (Some(v), Spread::Whole) => codec.encode(v, &runs),
        (Some(v), Spread::Parts) => codec.encode_parts(v, &runs, n),
        (None, _) => return (not_f32(group.global_rank(), &values), 0),
    };
    drop(values);
    let (bytes, rank) = (encoded.len(), group.global_rank());
    let exchanged = match spread {
        Spread::Whole => group.all_gather(Buffer::U8(encoded)),
        Spread::Parts => group.all_to_all(Buffer::U8(encoded)),
    };
    let work = exchanged.map(move |parts| summed(codec, rank, &parts, &runs, n, 1));
    (work, bytes)
}

/// The reduce-scatter mean of `values` over a group spread across machines, in two hops
/// (each machine's mean first, then the machines' mean: the same mean) and the bytes this
/// member hands over; with `quantized`, each hop exchanges integer parts that
/// the receiver dequantizes and averages in f32, and a machine's means are quantized again
/// for the second hop (ZeRO++'s hierarchical quantized gradients).
fn two_hop_mean(
    hops: &TwoHops,
    values: Buffer,
    quantized: Option<Quantized>,
) -> (Work<Buffer>, usize) {
    let Some(Quantized { codec, runs }) = quantized else {
        let bytes = values.len() * values.dtype().size();
        return (hops.reduce_scatter(values, ReduceOp::Avg), bytes);
    };
    let (processes, machines) = (hops.machine_size(), hops.machines());
    let encoded = match values.as_slice::<f32>() {
        Some(v) => codec.encode_parts(v, &runs, processes * machines),
        None => return (not_f32(hops.global_rank(), &values), 0),
    };
    drop(values);
    let bytes = encoded.len();
    let rank = hops.global_rank();
    let machine_runs = runs.clone();
    let work = hops
        .all_to_all_through(Buffer::U8(encoded), move |from_machine| {
            let means = summed(
                codec,
                rank,
                &from_machine,
                &machine_runs,
                processes,
                machines,
            )?;
            let means = means.as_slice::<f32>().unwrap_or(&[]);
            Ok(Buffer::U8(codec.encode_parts(
                means,
                &machine_runs,
                machines,
            )))
        })
        .map(move |parts| summed(codec, rank, &parts, &runs, machines, 1));
    (work, bytes)
}

/// The means of `members` senders' `codec` parts of `runs`, `blocks` parts from each, in
/// f32.
fn summed(
    codec: Codec,
    rank: usize,
    parts: &Buffer,
    runs: &[usize],
    members: usize,
    blocks: usize,
) -> Result<Buffer, CommError> {
    let bytes = parts.as_slice::<u8>().unwrap_or(&[]);
    codec
        .mean_of_parts(bytes, runs, members, blocks)
        .map(Buffer::F32)
        .map_err(|reason| CommError::InvalidArgument {
            rank,
            op: "quantized gradient reduction".into(),
            reason,
        })
}

/// Gradients to quantize arrive packed in f32; anything else is a bug in the engine, reported
/// as the reduction's error.
fn not_f32(rank: usize, values: &Buffer) -> Work<Buffer> {
    Work::ready(Err(CommError::InvalidArgument {
        rank,
        op: "quantized gradient reduction".into(),
        reason: format!(
            "gradients were packed in {:?}, not f32 (a bug in the engine)",
            values.dtype()
        ),
    }))
}

/// Starts reducing gradients collected for a row-sparse reduction as they arrived.
pub(crate) fn reduce_compact(mesh: &Mesh, grads: CompactGrads) -> Result<PendingReduce, CommError> {
    let group = row_sparse_group(mesh).ok_or_else(|| CommError::InvalidArgument {
        rank: mesh.shard.rank(),
        op: "row-sparse gradient reduction".into(),
        reason: "hybrid sharding has two dimensions to reduce over".into(),
    })?;
    row_sparse(mesh, grads.start(group)?)
}

/// The one group a row-sparse reduction runs over: the shard group, or the replicas with a
/// shard group of one rank (NO_SHARD); `None` for hybrid sharding (refused when the engine
/// is made).
fn row_sparse_group(mesh: &Mesh) -> Option<&dyn Communicator> {
    match (mesh.shard_size(), &mesh.replicate) {
        (1, Some(r)) => Some(r.as_ref()),
        (_, None) => Some(mesh.shard.as_ref()),
        (_, Some(_)) => None,
    }
}

/// A row-sparse reduction as a step's pending reduction.
fn row_sparse(mesh: &Mesh, sparse: RowSparseReduce) -> Result<PendingReduce, CommError> {
    Ok(PendingReduce {
        bytes: sparse.bytes,
        scatter: Work::ready(Ok(Buffer::F32(Vec::new()))),
        sparse: Some(sparse),
        kind: if mesh.shard_size() > 1 {
            "reduce-scatter"
        } else {
            "all-reduce"
        },
        replicate: None,
        quantized: None,
        scattered: None,
        issued: Instant::now(),
    })
}
