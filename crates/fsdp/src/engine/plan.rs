//! The unit plan: which parameters form each FSDP unit (the wrap policy), which are kept out
//! of FSDP (ignored modules, replicated), how each parameter is sharded on dim 0, and what a
//! rank holds. Built and checked before any tensor exists, so a bad wrap configuration stops
//! the run with a message instead of a wrong training.

use super::DiskOffload;
use super::quantized_blocks::Codec;
use crate::config::{AutoWrapPolicy, FsdpPlugin, ReduceDtype, ShardingStrategy};
use crate::nn::{ModuleInfo, ParamSpec};

/// Why a plan cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// Mixed precision or an int8 gather asked for with quantized weights, whose words must
    /// travel bit for bit and which compute in f32.
    #[error(
        "{setting} with a quantized base (`{param}`) is not supported: its words are gathered as they are and it computes in f32; {fix}"
    )]
    CastQuantized {
        /// The setting, as `key: value`.
        setting: String,
        /// What to set instead.
        fix: &'static str,
        /// A quantized parameter.
        param: String,
    },
    /// TRANSFORMER_BASED_WRAP named module types the model does not have.
    #[error(
        "fsdp_transformer_layer_cls_to_wrap names {missing:?}, which match no module of this model; its module types are: {available}{}",
        suggestions.iter().map(|(w, t)| format!("; did you mean `{t}` for `{w}`?")).collect::<String>()
    )]
    NoSuchModuleType {
        /// The names that matched nothing.
        missing: Vec<String>,
        /// The model's module type names, comma-separated.
        available: String,
        /// (name given, the module type it likely meant): the same name in another case
        /// (`MLPBlock` for `MlpBlock`), or one a few edits away.
        suggestions: Vec<(String, String)>,
    },
    /// A tied parameter's owner and another user landed in different units.
    #[error(
        "parameter `{param}` is shared by `{owner}` (unit {owner_unit}) and `{user}` (unit {user_unit}); tied parameters must be in one unit: wrap a module that contains both, or do not wrap either"
    )]
    TiedAcrossUnits {
        /// The tied parameter.
        param: String,
        /// The module owning it.
        owner: String,
        /// The owner's unit.
        owner_unit: usize,
        /// The other module using it.
        user: String,
        /// That module's unit.
        user_unit: usize,
    },
    /// The shard group size is zero.
    #[error("the shard group size must be at least 1")]
    EmptyGroup,
    /// A pattern on unit paths matched no unit (the setting would do nothing).
    #[error("{key} `{pattern}` matches no unit of this plan; its units are: {units}")]
    NoSuchUnit {
        /// The setting.
        key: &'static str,
        /// Its pattern.
        pattern: String,
        /// The plan's unit paths (the root excluded), comma-separated.
        units: String,
    },
}

/// How one parameter is laid out across the shard group.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardLayout {
    /// Fully qualified name.
    pub name: String,
    /// Full shape.
    pub shape: Vec<usize>,
    /// Trainable.
    pub requires_grad: bool,
    /// Its gradient is row-sparse: only the rows some rank's gradient touches are sent when
    /// gradients are reduced.
    pub sparse_grad: bool,
    /// Rows of dim 0 each rank owns (dim 0 padded up to a multiple of the group size).
    pub rows_per_rank: usize,
    /// Elements per row (product of the other dims).
    pub row_elems: usize,
    /// Where this parameter's shard starts inside its unit's packed shard block.
    pub offset: usize,
    /// A quantized weight's packing: its elements are the words of its blocks, moved bit
    /// for bit and dequantized where it is exported ([`crate::nn::quant`]).
    pub packing: Option<crate::nn::quant::Packing>,
}

impl ShardLayout {
    fn new(spec: &ParamSpec, group: usize) -> ShardLayout {
        let rows = spec.shape.first().copied().unwrap_or(1);
        ShardLayout {
            name: spec.name.clone(),
            shape: spec.shape.clone(),
            requires_grad: spec.requires_grad,
            sparse_grad: spec.sparse_grad,
            rows_per_rank: rows.div_ceil(group),
            row_elems: spec.shape.iter().skip(1).product(),
            offset: 0,
            packing: spec.packing,
        }
    }

    /// This parameter's elements inside its unit's packed shard block.
    pub fn shard_range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.shard_numel()
    }

    /// Elements of the full parameter.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Elements each rank stores (padding included).
    pub fn shard_numel(&self) -> usize {
        self.rows_per_rank * self.row_elems
    }

    /// The rows `[start, end)` of the full parameter that `rank` owns (empty for ranks that
    /// hold only padding).
    pub fn rows_of(&self, rank: usize) -> (usize, usize) {
        let rows = self.shape.first().copied().unwrap_or(1);
        let start = (rank * self.rows_per_rank).min(rows);
        (start, ((rank + 1) * self.rows_per_rank).min(rows))
    }

    /// Where row `row` of the full parameter lies in an all-gathered unit (rank r's shard
    /// block of `block` elements at `r * block`), as [`ShardLayout::unpack`] reads it; `None`
    /// past its rows.
    pub fn gathered_row(&self, block: usize, row: usize) -> Option<std::ops::Range<usize>> {
        let rows = self.shape.first().copied().unwrap_or(1);
        if row >= rows || self.rows_per_rank == 0 {
            return None;
        }
        let rank = row / self.rows_per_rank;
        let start = rank * block + self.offset + (row % self.rows_per_rank) * self.row_elems;
        Some(start..start + self.row_elems)
    }
}

/// One unit: the parameters gathered together and reduced together.
#[derive(Debug, Clone, PartialEq)]
pub struct Unit {
    /// Path of the module the unit wraps (empty for the root unit).
    pub path: String,
    /// That module's type name.
    pub type_name: &'static str,
    /// Its parameters, in registration order.
    pub params: Vec<ShardLayout>,
    /// Released after its forward and gathered again for its backward (FULL_SHARD and
    /// HYBRID_SHARD, except the root and units `fsdp_no_reshard_after_forward` keeps).
    pub reshard_after_forward: bool,
}

impl Unit {
    /// Elements of all full parameters.
    pub fn numel(&self) -> usize {
        self.params.iter().map(ShardLayout::numel).sum()
    }

    /// Elements a rank stores.
    pub fn shard_numel(&self) -> usize {
        self.params.iter().map(ShardLayout::shard_numel).sum()
    }

    /// The parameters' runs in a rank's packed block: their shard lengths in order (what
    /// int8 blocks are quantized apart by).
    pub fn param_runs(&self) -> Vec<usize> {
        runs(&self.params, |_| true)
    }

    /// The trainable parameters' runs in a rank's gradient block.
    pub fn grad_runs(&self) -> Vec<usize> {
        runs(&self.params, |p| p.requires_grad)
    }
}

/// The shard lengths of the `layouts` that `keep` keeps, in order: their runs in a rank's
/// packed block.
pub(crate) fn runs(layouts: &[ShardLayout], keep: impl Fn(&ShardLayout) -> bool) -> Vec<usize> {
    layouts
        .iter()
        .filter(|l| keep(l))
        .map(ShardLayout::shard_numel)
        .collect()
}

/// The whole plan.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitPlan {
    /// Units; the root unit (leftover parameters) comes first.
    pub units: Vec<Unit>,
    /// Parameters kept out of FSDP (replicated on every rank).
    pub ignored: Vec<ShardLayout>,
    /// Ranks a parameter is sharded over.
    pub group_size: usize,
    /// The strategy the memory estimate assumes.
    pub strategy: ShardingStrategy,
    /// Bytes per gathered parameter element: 4, or 2 with mixed precision (parameters
    /// gathered and computed in bf16 or fp16).
    pub gathered_bytes: usize,
    /// Bytes per gradient element packed for a reduction: 4, or 2 with `fsdp_reduce_dtype`
    /// bf16/fp16 (int8 packs in f32 and quantizes the packed block).
    pub reduce_bytes: usize,
    /// Parameters travel as int8 blocks (`fsdp_all_gather_dtype: int8`).
    pub gather_int8: bool,
    /// What gradients are reduced in (`fsdp_reduce_dtype`: a quantized one travels as
    /// integer blocks).
    pub reduce_dtype: ReduceDtype,
    /// Ranks of the secondary group backward gathers resharded units from (ZeRO++'s hpZ,
    /// `fsdp_hpz_partition_size`); 1 for none.
    pub secondary_partition: usize,
    /// What the plan keeps on disk between uses.
    pub disk: DiskOffload,
}

/// How a unit is spread over the mesh: what decides how it is gathered, where its gradients
/// may come from, and how they are reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnitKind {
    /// Split by rows over the shard dimension: gathered before use, read only inside the
    /// unit, its gradients reduce-scattered (then averaged over replicas) as soon as every
    /// one expected has arrived.
    Sharded,
    /// Whole on every rank of the mesh (the parameters of ignored modules): nothing is
    /// gathered, its parameters are read anywhere (their gradients add wherever they
    /// arrive), and the gradients are averaged over every rank (both mesh dimensions) once
    /// backward is over.
    Replicated,
}

impl UnitKind {
    /// Ranks the unit's parameters are split over: the shard group's, or one when whole.
    pub fn ranks(self, shard_size: usize) -> usize {
        match self {
            UnitKind::Sharded => shard_size,
            UnitKind::Replicated => 1,
        }
    }

    /// Whole on every rank.
    pub fn is_replicated(self) -> bool {
        self == UnitKind::Replicated
    }
}

impl UnitPlan {
    /// Elements one rank receives by all-gathers in a training step, `elements(unit)` being
    /// a rank's block of each unit: every other rank's block, before forward and again
    /// before backward for a unit resharded after forward (none when one rank holds all).
    pub fn gathered_per_step(&self, elements: impl Fn(&Unit) -> usize) -> usize {
        if self.group_size < 2 {
            return 0;
        }
        self.units
            .iter()
            .map(|u| (1 + usize::from(u.reshard_after_forward)) * elements(u))
            .sum::<usize>()
            * (self.group_size - 1)
    }

    /// Bytes one rank receives by all-gathers in a training step ([`Self::gathered_per_step`]
    /// of the units' blocks, as sent: a quantized weight travels as its packed words).
    pub fn gathered_bytes_per_step(&self) -> usize {
        self.gathered_per_step(|u| self.gather_wire_bytes(u))
    }

    /// Bytes one rank's block of `unit` takes in an all-gather: the compute dtype's, or
    /// int8 blocks with their scales.
    pub fn gather_wire_bytes(&self, unit: &Unit) -> usize {
        if self.gather_int8 {
            Codec::INT8.encoded_len(&unit.param_runs())
        } else {
            unit.shard_numel() * self.gathered_bytes
        }
    }

    /// Bytes one rank's block of `unit`'s gradients takes in a reduction's exchange: the
    /// reduce dtype's, or integer blocks with their scales.
    pub fn reduce_wire_bytes(&self, unit: &Unit) -> usize {
        let runs = unit.grad_runs();
        match Codec::for_reduce(self.reduce_dtype) {
            Some(codec) => codec.encoded_len(&runs),
            None => runs.iter().sum::<usize>() * self.reduce_bytes,
        }
    }

    /// Splits `model` into units per `plugin`'s wrap policy; `default_wrap` is the model's own
    /// list for TRANSFORMER_BASED_WRAP without class names. `group_size` is the number of
    /// ranks parameters are sharded over (1 for NO_SHARD).
    pub fn build(
        model: &ModuleInfo,
        plugin: &FsdpPlugin,
        default_wrap: &[&str],
        group_size: usize,
    ) -> Result<UnitPlan, PlanError> {
        if group_size == 0 {
            return Err(PlanError::EmptyGroup);
        }
        let group = if plugin.sharding_strategy == ShardingStrategy::NoShard {
            1
        } else {
            group_size
        };
        let ignored_paths: Vec<&ModuleInfo> = match &plugin.ignored_modules {
            Some(re) => model
                .modules()
                .into_iter()
                .filter(|m| !m.path.is_empty() && re.is_match(&m.path))
                .collect(),
            None => Vec::new(),
        };
        let is_ignored = |path: &str| {
            ignored_paths
                .iter()
                .any(|m| path == m.path || path.starts_with(&format!("{}.", m.path)))
        };

        // Which modules become units.
        let roots: Vec<&ModuleInfo> = match plugin.auto_wrap_policy {
            AutoWrapPolicy::NoWrap => Vec::new(),
            AutoWrapPolicy::TransformerBasedWrap => {
                let wanted: Vec<String> = match &plugin.transformer_layer_cls_to_wrap {
                    Some(list) => list.clone(),
                    None => default_wrap.iter().map(|s| s.to_string()).collect(),
                };
                let modules = model.modules();
                let missing: Vec<String> = wanted
                    .iter()
                    .filter(|w| !modules.iter().any(|m| m.type_name == w.as_str()))
                    .cloned()
                    .collect();
                if !missing.is_empty() {
                    let mut types: Vec<&str> = modules.iter().map(|m| m.type_name).collect();
                    types.sort_unstable();
                    types.dedup();
                    let suggestions = missing
                        .iter()
                        .filter_map(|w| Some((w.clone(), nearest_type(w, &types)?.to_string())))
                        .collect();
                    return Err(PlanError::NoSuchModuleType {
                        missing,
                        available: types.join(", "),
                        suggestions,
                    });
                }
                modules
                    .into_iter()
                    .filter(|m| {
                        !m.path.is_empty()
                            && wanted.iter().any(|w| w == m.type_name)
                            && !is_ignored(&m.path)
                    })
                    .collect()
            }
            AutoWrapPolicy::SizeBasedWrap => {
                let mut roots = Vec::new();
                size_based(
                    model,
                    model,
                    plugin.min_num_params as usize,
                    &is_ignored,
                    &mut roots,
                );
                roots
            }
        };

        // Each parameter goes to the innermost unit root containing its module.
        let resharding = plugin.sharding_strategy.reshards_after_forward();
        let kept = |path: &str| {
            plugin
                .no_reshard_after_forward
                .as_ref()
                .is_some_and(|re| re.is_match(path))
        };
        let mut units: Vec<Unit> = std::iter::once(Unit {
            path: String::new(),
            type_name: model.type_name,
            params: Vec::new(),
            reshard_after_forward: false,
        })
        .chain(roots.iter().map(|m| Unit {
            path: m.path.clone(),
            type_name: m.type_name,
            params: Vec::new(),
            reshard_after_forward: resharding && !kept(&m.path),
        }))
        .collect();
        if let Some(re) = &plugin.no_reshard_after_forward
            && !roots.iter().any(|m| re.is_match(&m.path))
        {
            return Err(PlanError::NoSuchUnit {
                key: "fsdp_no_reshard_after_forward",
                pattern: re.as_str().to_string(),
                units: roots
                    .iter()
                    .map(|m| m.path.clone())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let mut ignored = Vec::new();
        let unit_of = |path: &str| -> usize {
            roots
                .iter()
                .enumerate()
                .filter(|(_, r)| path == r.path || path.starts_with(&format!("{}.", r.path)))
                .max_by_key(|(_, r)| r.path.len())
                .map_or(0, |(i, _)| i + 1)
        };
        for module in model.modules() {
            for spec in &module.params {
                if is_ignored(&module.path) {
                    ignored.push(ShardLayout::new(spec, 1));
                } else {
                    units[unit_of(&module.path)]
                        .params
                        .push(ShardLayout::new(spec, group));
                }
            }
        }
        // Tied parameters: every user must be in the owner's unit.
        for module in model.modules() {
            for param in &module.uses {
                let Some(owner) = model
                    .modules()
                    .into_iter()
                    .find(|m| m.params.iter().any(|p| &p.name == param))
                else {
                    continue;
                };
                let (owner_unit, user_unit) = (unit_of(&owner.path), unit_of(&module.path));
                if owner_unit != user_unit && !is_ignored(&owner.path) {
                    return Err(PlanError::TiedAcrossUnits {
                        param: param.clone(),
                        owner: owner.path.clone(),
                        owner_unit,
                        user: module.path.clone(),
                        user_unit,
                    });
                }
            }
        }
        // A root unit left without parameters is dropped (everything was wrapped).
        if units[0].params.is_empty() && units.len() > 1 {
            units.remove(0);
        }
        // Each unit's parameters packed one after another; the ignored modules' too, as the
        // engine's unit of them (whole on every rank) holds them.
        for params in units
            .iter_mut()
            .map(|u| &mut u.params)
            .chain([&mut ignored])
        {
            let mut offset = 0;
            for p in params {
                p.offset = offset;
                offset += p.shard_numel();
            }
        }
        // A quantized weight's words must travel as they are: a cast or a rounding would
        // corrupt them.
        let packed = model.all_params().into_iter().find(|p| p.packing.is_some());
        if let Some(p) = packed {
            let refused = if plugin.mixed_precision != crate::config::MixedPrecision::No {
                let setting = format!("{:?}", plugin.mixed_precision).to_lowercase();
                Some((
                    format!("mixed_precision: {setting}"),
                    "set mixed_precision: no",
                ))
            } else if plugin.all_gather_dtype == crate::config::AllGatherDtype::Int8 {
                let fix = "leave fsdp_all_gather_dtype unset (auto)";
                Some(("fsdp_all_gather_dtype: int8".to_string(), fix))
            } else {
                None
            };
            if let Some((setting, fix)) = refused {
                return Err(PlanError::CastQuantized {
                    setting,
                    fix,
                    param: p.name.clone(),
                });
            }
        }
        Ok(UnitPlan {
            units,
            ignored,
            group_size: group,
            strategy: plugin.sharding_strategy,
            gathered_bytes: match plugin.mixed_precision {
                crate::config::MixedPrecision::No => 4,
                _ => 2,
            },
            reduce_bytes: match plugin.reduce_dtype {
                ReduceDtype::Fp32 | ReduceDtype::Int8 | ReduceDtype::Int4 => 4,
                ReduceDtype::Bf16 | ReduceDtype::Fp16 => 2,
            },
            gather_int8: plugin.all_gather_dtype == crate::config::AllGatherDtype::Int8,
            reduce_dtype: plugin.reduce_dtype,
            secondary_partition: if plugin.sharding_strategy.reshards_after_forward() {
                plugin.hpz_partition_size.max(1)
            } else {
                1
            },
            disk: DiskOffload::for_plugin(plugin),
        })
    }
}

/// Post-order: a subtree whose not-yet-wrapped parameters reach `min` becomes a unit.
/// Returns the subtree's unwrapped parameter count.
/// PyTorch's size-based policy: a module becomes a unit when the parameters not already in
/// a wrapped descendant reach `min`. A module whose tied parameters are shared with a module
/// outside it is never wrapped on its own (the policy chose it, not the user): its
/// parameters stay with the enclosing unit, so tied weights share one unit.
fn size_based<'a>(
    model: &ModuleInfo,
    m: &'a ModuleInfo,
    min: usize,
    is_ignored: &dyn Fn(&str) -> bool,
    roots: &mut Vec<&'a ModuleInfo>,
) -> usize {
    if is_ignored(&m.path) {
        return 0;
    }
    let own: usize = m
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    let children: usize = m
        .children
        .iter()
        .map(|c| size_based(model, c, min, is_ignored, roots))
        .sum();
    let total = own + children;
    if !m.path.is_empty() && total >= min.max(1) && !tied_outside(model, m) {
        roots.push(m);
        0
    } else {
        total
    }
}

/// Whether a parameter owned inside `m` is used outside it, or `m` uses one owned outside.
fn tied_outside(model: &ModuleInfo, m: &ModuleInfo) -> bool {
    let inside = |path: &str| path == m.path || path.starts_with(&format!("{}.", m.path));
    let owned_inside = |name: &str| m.all_params().iter().any(|p| p.name == name);
    model.modules().iter().any(|user| {
        user.uses
            .iter()
            .any(|name| inside(&user.path) != owned_inside(name))
    })
}
/// The module type `wanted` most likely means: one equal to it but for case, else the closest
/// by edits (case ignored) within a third of its length.
fn nearest_type<'a>(wanted: &str, types: &[&'a str]) -> Option<&'a str> {
    if let Some(t) = types.iter().find(|t| t.eq_ignore_ascii_case(wanted)) {
        return Some(t);
    }
    let wanted = wanted.to_lowercase();
    types
        .iter()
        .map(|t| (strsim::damerau_levenshtein(&wanted, &t.to_lowercase()), *t))
        .filter(|(d, t)| *d <= (t.len() / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, t)| t)
}
