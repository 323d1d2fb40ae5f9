//! One training step's unit lifecycle: lazy all-gather of a unit when forward first reads one
//! of its parameters (with forward prefetch of the next unit), release after the unit's
//! forward (FULL_SHARD), refill before its backward (with BACKWARD_PRE / BACKWARD_POST
//! prefetch), and the post-backward reduce-scatter issued as soon as the unit's last gradient
//! arrives, after which its full parameters and gradients are freed.
//!
//! Per unit the state moves Sharded → Gathered → (Released → Refilled) → Reduced; a parameter
//! read in the wrong state is an error naming the parameter and its unit.
//!
//! The graph ops hold a `Weak` reference to the step, so there is no reference cycle between
//! the step, its tensors and their ops.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use candle_core::{
    CpuStorage, CustomOp1, Device, InplaceOp1, Layout, Shape, Tensor, TensorId, Var,
};
use fsdp_comm::{ProcessGroup, ReduceOp, Work};

use super::plan::ShardLayout;
use crate::config::BackwardPrefetch;
use crate::nn::Params;

/// What the step knows of one unit before it starts.
pub(crate) struct UnitSpec {
    /// Module path (empty for the root unit).
    pub path: String,
    /// Parameters in the unit's packing order.
    pub params: Vec<ShardLayout>,
    /// This rank's shards, packed (the all-gather's input; whole parameters when replicated),
    /// shared with the engine without a copy.
    pub packed: Arc<Vec<f32>>,
    /// Free the full parameters after the unit's forward (FULL_SHARD, non-root units).
    pub release_after_forward: bool,
}

/// Step-wide settings.
pub(crate) struct StepOptions {
    /// Ranks that hold shards (1: parameters are whole on every rank, gradients all-reduced).
    pub sharded: bool,
    /// Free full parameters once the unit's gradients are reduced.
    pub release_after_backward: bool,
    pub forward_prefetch: bool,
    pub backward_prefetch: BackwardPrefetch,
    /// Poison released parameters with NaN instead of returning their pages.
    pub debug: bool,
    pub device: Device,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Sharded,
    Gathered,
    Released,
    Refilled,
    Reduced,
}

impl Phase {
    fn describe(self) -> &'static str {
        match self {
            Phase::Sharded => "sharded",
            Phase::Gathered => "gathered",
            Phase::Released => "released after its forward",
            Phase::Refilled => "re-gathered for its backward",
            Phase::Reduced => "reduced (its backward is over)",
        }
    }
}

/// Pages of a full parameter returned to the system while its allocation stays live, so the
/// counting allocator's figures show what FSDP frees.
#[derive(Default)]
struct PageLedger(AtomicUsize);

impl PageLedger {
    fn set(&self, bytes: usize) {
        let before = self.0.swap(bytes, Ordering::Relaxed);
        crate::memory::note_released(bytes);
        crate::memory::note_reclaimed(before);
    }
}

impl Drop for PageLedger {
    fn drop(&mut self) {
        crate::memory::note_reclaimed(*self.0.get_mut());
    }
}

struct FullParam {
    tensor: Tensor,
    pages: Arc<PageLedger>,
}

struct UnitRun {
    phase: Phase,
    in_flight: Option<Work<Vec<f32>>>,
    anchor: Option<Var>,
    full: Vec<FullParam>,
    /// Output tensors passed through `module_output` (hooked when the unit is released).
    outputs: Vec<Tensor>,
    hooked: bool,
    grad_pack: Option<Vec<f32>>,
    /// Gradients this backward will deliver (known from the graph before backward runs).
    expected: Option<usize>,
    received: usize,
    has_grad: Vec<bool>,
}

struct Inner {
    units: Vec<UnitRun>,
    /// Units in the order forward first read them.
    forward_order: Vec<usize>,
    backward_order: Vec<usize>,
    /// Reductions issued, in issue order.
    pending: Vec<(usize, Work<Vec<f32>>)>,
}

/// Each unit's reduced gradient block (None: no gradient this step) and which of its
/// parameters received one.
pub(crate) type ReducedGrads = (Vec<Option<Vec<f32>>>, Vec<Vec<bool>>);

pub(crate) struct StepShared {
    pg: Arc<ProcessGroup>,
    units: Vec<UnitSpec>,
    index: HashMap<String, (usize, usize)>,
    by_path: HashMap<String, usize>,
    /// Forward order of the previous step (plan order in the first), for forward prefetch.
    prefetch_order: Vec<usize>,
    opts: StepOptions,
    inner: Mutex<Inner>,
}

fn msg(text: String) -> candle_core::Error {
    candle_core::Error::Msg(text)
}

fn unit_name(spec: &UnitSpec) -> String {
    if spec.path.is_empty() {
        "the root unit".into()
    } else {
        format!("unit `{}`", spec.path)
    }
}

/// The step a graph op belongs to, while it runs.
fn live(step: &Weak<StepShared>) -> candle_core::Result<Arc<StepShared>> {
    step.upgrade()
        .ok_or_else(|| msg("fsdp: backward ran after its step ended".into()))
}

/// Produces a gathered parameter as the output of an op on the unit's anchor variable, so the
/// parameter is a node of the graph; its backward receives the full gradient after every
/// consumer ran (the post-backward hook).
struct Unshard {
    data: Mutex<Option<Vec<f32>>>,
    shape: Shape,
    step: Weak<StepShared>,
    unit: usize,
    param: usize,
}

impl CustomOp1 for Unshard {
    fn name(&self) -> &'static str {
        "fsdp-unshard"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let data = self
            .data
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| msg("fsdp-unshard: parameter already materialised".into()))?;
        Ok((CpuStorage::F32(data), self.shape.clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let step = live(&self.step)?;
        step.gradient_arrived(self.unit, self.param, grad)?;
        Ok(None)
    }
}

/// Identity on a unit's output; its backward runs before any backward node of the unit and
/// refills the unit's parameters (the pre-backward hook).
struct PreBackward {
    step: Weak<StepShared>,
    unit: usize,
}

impl CustomOp1 for PreBackward {
    fn name(&self) -> &'static str {
        "fsdp-pre-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(v) = s else {
            return Err(msg("fsdp-pre-backward: activations are f32".into()));
        };
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| msg("fsdp-pre-backward: unit output must be contiguous".into()))?;
        Ok((CpuStorage::F32(v[start..end].to_vec()), l.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let step = live(&self.step)?;
        step.pre_backward(self.unit)?;
        Ok(Some(grad.clone()))
    }
}

/// Releases a full parameter's memory in place, keeping the storage's length (candle's
/// kernels index without bounds checks, so a shorter storage would be unsound).
struct Release<'a> {
    poison: bool,
    pages: &'a PageLedger,
}

impl InplaceOp1 for Release<'_> {
    fn name(&self) -> &'static str {
        "fsdp-release"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, _l: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = s else {
            return Err(msg("fsdp-release: parameters are f32".into()));
        };
        if self.poison {
            v.iter_mut().for_each(|x| *x = f32::NAN);
            return Ok(());
        }
        // Return the whole pages inside the buffer; they read as zeros until refilled.
        let page = 4096usize;
        let start = v.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(v.as_slice());
        let (first, last) = (start.div_ceil(page) * page, end / page * page);
        if last > first {
            // SAFETY: [first, last) lies inside the vector's allocation; MADV_DONTNEED on
            // private anonymous memory keeps the mapping valid (pages read back as zeros).
            let rc = unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_DONTNEED,
                )
            };
            if rc == 0 {
                self.pages.set(last - first);
            }
        }
        Ok(())
    }
}

/// Writes a parameter's rows from an all-gathered block back into its released storage.
struct Refill<'a> {
    layout: &'a ShardLayout,
    gathered: &'a [f32],
    block: usize,
    ranks: usize,
}

impl InplaceOp1 for Refill<'_> {
    fn name(&self) -> &'static str {
        "fsdp-refill"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = s else {
            return Err(msg("fsdp-refill: parameters are f32".into()));
        };
        let start = l.start_offset();
        let out = &mut v[start..start + self.layout.numel()];
        self.layout
            .unpack(self.gathered, self.block, self.ranks, out);
        Ok(())
    }
}

impl StepShared {
    pub(crate) fn new(
        pg: Arc<ProcessGroup>,
        units: Vec<UnitSpec>,
        prefetch_order: Vec<usize>,
        opts: StepOptions,
    ) -> Arc<StepShared> {
        let mut index = HashMap::new();
        let mut by_path = HashMap::new();
        let mut runs = Vec::with_capacity(units.len());
        for (u, spec) in units.iter().enumerate() {
            for (i, p) in spec.params.iter().enumerate() {
                index.insert(p.name.clone(), (u, i));
            }
            by_path.insert(spec.path.clone(), u);
            runs.push(UnitRun {
                phase: Phase::Sharded,
                in_flight: None,
                anchor: None,
                full: Vec::new(),
                outputs: Vec::new(),
                hooked: false,
                grad_pack: None,
                expected: None,
                received: 0,
                has_grad: vec![false; spec.params.len()],
            });
        }
        let prefetch_order = if prefetch_order.is_empty() {
            (0..units.len()).collect()
        } else {
            prefetch_order
        };
        Arc::new(StepShared {
            pg,
            units,
            index,
            by_path,
            prefetch_order,
            opts,
            inner: Mutex::new(Inner {
                units: runs,
                forward_order: Vec::new(),
                backward_order: Vec::new(),
                pending: Vec::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ranks(&self) -> usize {
        if self.opts.sharded { self.pg.size() } else { 1 }
    }

    /// Starts unit `u`'s all-gather (nothing to send when parameters are replicated).
    fn start_gather(&self, u: usize) -> Option<Work<Vec<f32>>> {
        self.opts
            .sharded
            .then(|| self.pg.all_gather(self.units[u].packed.to_vec()))
    }

    /// The gathered block of unit `u`: the prefetched one, or a fresh all-gather.
    fn gathered(
        &self,
        inner: &mut Inner,
        u: usize,
        what: &str,
    ) -> candle_core::Result<Option<Vec<f32>>> {
        let work = inner.units[u]
            .in_flight
            .take()
            .or_else(|| self.start_gather(u));
        match work {
            None => Ok(None),
            Some(w) => w.wait().map(Some).map_err(|e| {
                msg(format!(
                    "all-gather of {} {what}: {e}",
                    unit_name(&self.units[u])
                ))
            }),
        }
    }

    /// Starts a unit's gradient reduction (mean over ranks): reduce-scatter of the packed
    /// blocks, or all-reduce of whole gradients when parameters are replicated.
    fn start_reduce(&self, pack: Vec<f32>) -> Work<Vec<f32>> {
        if self.opts.sharded {
            self.pg.reduce_scatter(pack, ReduceOp::Avg)
        } else {
            self.pg.all_reduce(pack, ReduceOp::Avg)
        }
    }

    /// Issues the all-gather of `u` ahead of its use if it is waiting for one.
    fn prefetch(&self, inner: &mut Inner, u: usize, waiting: Phase) {
        let run = &mut inner.units[u];
        if self.opts.sharded && run.phase == waiting && run.in_flight.is_none() {
            run.in_flight = self.start_gather(u);
        }
    }

    /// Gathers unit `u` and creates its full parameters as graph nodes.
    fn materialise(self: &Arc<Self>, inner: &mut Inner, u: usize) -> candle_core::Result<()> {
        let spec = &self.units[u];
        let gathered = self.gathered(inner, u, "before its forward")?;
        let (source, ranks) = match &gathered {
            Some(g) => (g.as_slice(), self.pg.size()),
            None => (spec.packed.as_slice(), 1),
        };
        let anchor = Var::zeros(1, candle_core::DType::F32, &self.opts.device)?;
        let mut full = Vec::with_capacity(spec.params.len());
        for (i, p) in spec.params.iter().enumerate() {
            let mut values = vec![0f32; p.numel()];
            p.unpack(source, spec.packed.len(), ranks, &mut values);
            let op = Unshard {
                data: Mutex::new(Some(values)),
                shape: Shape::from(p.shape.clone()),
                step: Arc::downgrade(self),
                unit: u,
                param: i,
            };
            let tensor = if p.requires_grad {
                anchor.as_tensor().apply_op1(op)?
            } else {
                anchor.as_tensor().detach().apply_op1_no_bwd(&op)?
            };
            full.push(FullParam {
                tensor,
                pages: Arc::new(PageLedger::default()),
            });
        }
        let run = &mut inner.units[u];
        run.anchor = Some(anchor);
        run.full = full;
        run.phase = Phase::Gathered;
        inner.forward_order.push(u);
        if self.opts.forward_prefetch {
            let pos = self.prefetch_order.iter().position(|&x| x == u);
            if let Some(&next) = pos.and_then(|p| self.prefetch_order.get(p + 1)) {
                self.prefetch(inner, next, Phase::Sharded);
            }
        }
        Ok(())
    }

    fn release(&self, inner: &mut Inner, u: usize) -> candle_core::Result<()> {
        for f in &inner.units[u].full {
            f.tensor.inplace_op1(&Release {
                poison: self.opts.debug,
                pages: &f.pages,
            })?;
        }
        Ok(())
    }

    /// Pre-backward: refills unit `u` (from its prefetched gather when there is one), then
    /// with BACKWARD_PRE prefetches the next unit in backward order.
    fn pre_backward(&self, u: usize) -> candle_core::Result<()> {
        let mut inner = self.lock();
        if inner.units[u].phase == Phase::Released {
            let spec = &self.units[u];
            let gathered = self
                .gathered(&mut inner, u, "before its backward")?
                .ok_or_else(|| msg(format!("{}: released while replicated", unit_name(spec))))?;
            let run = &mut inner.units[u];
            for (f, p) in run.full.iter().zip(&spec.params) {
                f.tensor.inplace_op1(&Refill {
                    layout: p,
                    gathered: &gathered,
                    block: spec.packed.len(),
                    ranks: self.pg.size(),
                })?;
                f.pages.set(0);
            }
            run.phase = Phase::Refilled;
            if self.opts.backward_prefetch == BackwardPrefetch::BackwardPre {
                self.prefetch_next_backward(&mut inner, u);
            }
        }
        Ok(())
    }

    fn prefetch_next_backward(&self, inner: &mut Inner, u: usize) {
        let pos = inner.backward_order.iter().position(|&x| x == u);
        if let Some(&next) = pos.and_then(|p| inner.backward_order.get(p + 1)) {
            self.prefetch(inner, next, Phase::Released);
        }
    }

    /// Post-backward: packs the gradient of parameter `i` of unit `u`; once the unit's last
    /// gradient is in, issues its reduce-scatter (all-reduce when replicated), frees the full
    /// gradient, releases the full parameters, and with BACKWARD_POST prefetches the next unit.
    fn gradient_arrived(&self, u: usize, i: usize, grad: &Tensor) -> candle_core::Result<()> {
        let mut inner = self.lock();
        let spec = &self.units[u];
        let p = &spec.params[i];
        let phase = inner.units[u].phase;
        if phase == Phase::Released || phase == Phase::Reduced {
            return Err(msg(format!(
                "gradient of `{}` arrived while {} is {}: the parameter was used outside its unit",
                p.name,
                unit_name(spec),
                phase.describe()
            )));
        }
        let ranks = self.ranks();
        let run = &mut inner.units[u];
        let pack = run
            .grad_pack
            .get_or_insert_with(|| vec![0f32; spec.packed.len() * ranks]);
        // Read the gradient in place when it is a contiguous f32 buffer (no copy).
        let grad = grad.contiguous()?;
        let (storage, layout) = grad.storage_and_layout();
        let candle_core::Storage::Cpu(CpuStorage::F32(values)) = &*storage else {
            return Err(msg(format!(
                "gradient of `{}` is not an f32 CPU tensor",
                p.name
            )));
        };
        let (first, last) = layout
            .contiguous_offsets()
            .ok_or_else(|| msg("fsdp: gradient not contiguous".into()))?;
        p.pack(&values[first..last], spec.packed.len(), ranks, pack);
        drop(storage);
        run.has_grad[i] = true;
        run.received += 1;
        if Some(run.received) != run.expected {
            return Ok(());
        }
        let work = self.start_reduce(run.grad_pack.take().unwrap_or_default());
        run.phase = Phase::Reduced;
        inner.pending.push((u, work));
        // Frozen parameters may still be read by backward nodes of this unit that have not
        // run yet; such units keep their parameters until the step ends.
        let all_trainable = spec.params.iter().all(|p| p.requires_grad);
        if self.opts.release_after_backward && all_trainable {
            self.release(&mut inner, u)?;
        }
        if self.opts.backward_prefetch == BackwardPrefetch::BackwardPost {
            self.prefetch_next_backward(&mut inner, u);
        }
        Ok(())
    }

    /// Plans the backward from the graph of `loss` before any kernel runs: the units' backward
    /// order (for prefetch) and the gradients each unit will receive. With `check`, also
    /// verifies that every released unit's output was hooked and that each parameter reaching
    /// the loss does so through its own unit's output.
    pub(crate) fn plan_backward(&self, loss: &Tensor, check: bool) -> Result<(), String> {
        let sorted = loss.sorted_nodes();
        let in_graph: std::collections::HashSet<TensorId> = sorted.iter().map(|t| t.id()).collect();
        let mut inner = self.lock();
        let mut hook_unit: HashMap<TensorId, usize> = HashMap::new();
        for (u, run) in inner.units.iter().enumerate() {
            for o in &run.outputs {
                hook_unit.insert(o.id(), u);
            }
        }
        let mut order = Vec::new();
        for node in &sorted {
            if let Some(&u) = hook_unit.get(&node.id()) {
                if !order.contains(&u) {
                    order.push(u);
                }
            }
        }
        for (u, run) in inner.units.iter_mut().enumerate() {
            let spec = &self.units[u];
            let mut expected = 0;
            for (p, f) in spec.params.iter().zip(&run.full) {
                if p.requires_grad && in_graph.contains(&f.tensor.id()) {
                    expected += 1;
                }
            }
            run.expected = Some(expected);
            if !check || run.phase == Phase::Sharded || spec.path.is_empty() {
                continue;
            }
            if spec.release_after_forward && !run.hooked {
                return Err(format!(
                    "{} (gathered in forward) never passed its output through Params::module_output, so it cannot be released and refilled; call module_output at the end of the module's forward",
                    unit_name(spec)
                ));
            }
            if run.outputs.is_empty() {
                continue;
            }
            let mut reach: std::collections::HashSet<TensorId> = Default::default();
            for o in &run.outputs {
                reach.extend(o.sorted_nodes().iter().map(|t| t.id()));
            }
            for (p, f) in spec.params.iter().zip(&run.full) {
                let id = f.tensor.id();
                if in_graph.contains(&id) && !reach.contains(&id) {
                    return Err(format!(
                        "parameter `{}` of {} reaches the loss without going through the unit's output: it is used outside its unit (wrap or tie the modules so that it is used inside one unit)",
                        p.name,
                        unit_name(spec)
                    ));
                }
            }
        }
        inner.backward_order = order;
        Ok(())
    }

    /// In debug mode released parameters read as NaN, so a non-finite loss may come from a
    /// parameter used after its unit released it. Finds the first computed (not a view of a
    /// released parameter) non-finite value in forward order (values computed before a
    /// release stay finite) and names the released parameters it depends on; `None` when the
    /// cause is not a released parameter.
    pub(crate) fn diagnose_non_finite(&self, loss: &Tensor) -> Option<String> {
        let finite = |t: &Tensor| -> bool {
            t.to_dtype(candle_core::DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map(|v| v.iter().all(|x| x.is_finite()))
                .unwrap_or(true)
        };
        let buffer = |t: &Tensor| -> usize {
            let (storage, _) = t.storage_and_layout();
            match &*storage {
                candle_core::Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr() as usize,
                _ => 0,
            }
        };
        if finite(loss) {
            return None;
        }
        let inner = self.lock();
        let mut released: HashMap<TensorId, (usize, &str)> = HashMap::new();
        let mut released_buffers = std::collections::HashSet::new();
        for (u, run) in inner.units.iter().enumerate() {
            if run.phase != Phase::Released {
                continue;
            }
            for (p, f) in self.units[u].params.iter().zip(&run.full) {
                released.insert(f.tensor.id(), (u, p.name.as_str()));
                released_buffers.insert(buffer(&f.tensor));
            }
        }
        if released.is_empty() {
            return None;
        }
        let sorted = loss.sorted_nodes();
        let first_bad = sorted
            .iter()
            .rev()
            .find(|n| !n.is_variable() && !released_buffers.contains(&buffer(n)) && !finite(n))?;
        let culprits: Vec<String> = first_bad
            .sorted_nodes()
            .iter()
            .filter_map(|a| released.get(&a.id()))
            .map(|(u, name)| format!("`{name}` of {}", unit_name(&self.units[*u])))
            .collect();
        (!culprits.is_empty()).then(|| {
            format!(
                "the loss is not finite because a released parameter was read after its unit's forward (debug mode poisons released parameters with NaN): {} used outside its unit",
                culprits.join(" or ")
            )
        })
    }

    /// After backward: waits for every reduction; returns each unit's reduced gradient block
    /// and which parameters had a gradient. Drops the step's tensors.
    pub(crate) fn finish(&self) -> candle_core::Result<ReducedGrads> {
        let mut inner = self.lock();
        // Units whose gradients did not all arrive (the caller ran backward itself): reduce now.
        for u in 0..inner.units.len() {
            let run = &mut inner.units[u];
            if let Some(pack) = run.grad_pack.take() {
                let work = self.start_reduce(pack);
                inner.pending.push((u, work));
            }
        }
        let mut reduced: Vec<Option<Vec<f32>>> = vec![None; self.units.len()];
        for (u, work) in std::mem::take(&mut inner.pending) {
            let values = work.wait().map_err(|e| {
                msg(format!(
                    "reduce-scatter of {}'s gradients: {e}",
                    unit_name(&self.units[u])
                ))
            })?;
            reduced[u] = Some(values);
        }
        let has_grad = inner.units.iter().map(|r| r.has_grad.clone()).collect();
        for run in &mut inner.units {
            if let Some(w) = run.in_flight.take() {
                // A prefetch nobody consumed: complete it so every rank stays in step.
                w.wait().map_err(|e| msg(format!("unused prefetch: {e}")))?;
            }
            run.full.clear();
            run.outputs.clear();
            run.anchor = None;
        }
        Ok((reduced, has_grad))
    }

    /// Units in the order this step's forward first used them.
    pub(crate) fn forward_order(&self) -> Vec<usize> {
        self.lock().forward_order.clone()
    }
}

/// The parameters of one step: full tensors (graph nodes) gathered unit by unit as forward
/// reaches them, and the replicated (ignored) variables.
pub struct StepParams {
    pub(crate) shared: Arc<StepShared>,
    pub(crate) replicated: HashMap<String, Tensor>,
}

impl Params for StepParams {
    fn get(&self, name: &str) -> candle_core::Result<Tensor> {
        let Some(&(u, i)) = self.shared.index.get(name) else {
            return self
                .replicated
                .get(name)
                .cloned()
                .ok_or_else(|| msg(format!("unknown parameter {name}")));
        };
        let mut inner = self.shared.lock();
        match inner.units[u].phase {
            Phase::Sharded => self.shared.materialise(&mut inner, u)?,
            Phase::Gathered | Phase::Refilled => {}
            phase @ (Phase::Released | Phase::Reduced) => {
                return Err(msg(format!(
                    "parameter `{name}` was read while {} is {}: a parameter may only be used inside its own unit (tied weights must share a unit)",
                    unit_name(&self.shared.units[u]),
                    phase.describe()
                )));
            }
        }
        Ok(inner.units[u].full[i].tensor.clone())
    }

    fn module_output(&self, path: &str, output: Tensor) -> candle_core::Result<Tensor> {
        let Some(&u) = self.shared.by_path.get(path) else {
            return Ok(output);
        };
        let mut inner = self.shared.lock();
        let run = &mut inner.units[u];
        run.hooked = true;
        let releasing = self.shared.units[u].release_after_forward
            && matches!(run.phase, Phase::Gathered | Phase::Released);
        if !releasing {
            return Ok(output);
        }
        let hooked = output.contiguous()?.apply_op1(PreBackward {
            step: Arc::downgrade(&self.shared),
            unit: u,
        })?;
        run.outputs.push(hooked.clone());
        if run.phase == Phase::Gathered {
            run.phase = Phase::Released;
            self.shared.release(&mut inner, u)?;
        }
        Ok(hooked)
    }
}
