//! The enumerated configuration values, spelled as Accelerate spells them. Each accepts its
//! name in any case or its 1-based number in Accelerate's menus.

use std::fmt;
use std::str::FromStr;

/// A configuration enum: its canonical names in menu order (number `i + 1` is `NAMES[i]`).
pub trait Choice: Sized + Copy + 'static {
    /// Canonical names in Accelerate's menu order.
    const NAMES: &'static [&'static str];
    /// Variants in the same order as [`Choice::NAMES`].
    const ALL: &'static [Self];

    /// The canonical name.
    fn name(self) -> &'static str;

    /// Parses a name (any case) or a 1-based menu number.
    fn parse_choice(text: &str) -> Option<Self> {
        parse_choice_index(Self::NAMES, text).map(|i| Self::ALL[i])
    }
}

/// Index of `text` in `names`: a name in any case, or a 1-based number.
pub fn parse_choice_index(names: &[&str], text: &str) -> Option<usize> {
    let text = text.trim();
    if let Ok(n) = text.parse::<usize>() {
        return (1..=names.len()).contains(&n).then(|| n - 1);
    }
    names
        .iter()
        .position(|name| name.eq_ignore_ascii_case(text))
}

macro_rules! choice_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vmeta])* $variant),+ }

        impl Choice for $name {
            const NAMES: &'static [&'static str] = &[$($text),+];
            const ALL: &'static [Self] = &[$(Self::$variant),+];
            fn name(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                Self::parse_choice(s).ok_or_else(|| describe_choices(Self::NAMES))
            }
        }
    };
}

/// "one of FULL_SHARD (1), SHARD_GRAD_OP (2), ...": the valid spellings for an error message.
pub fn describe_choices(names: &[&str]) -> String {
    let listed: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{n} ({})", i + 1))
        .collect();
    format!("expected one of {}", listed.join(", "))
}

choice_enum!(
    /// How parameters, gradients and optimizer state are split across ranks.
    ShardingStrategy {
        /// Shard everything; gather parameters for forward and again for backward (ZeRO-3).
        FullShard => "FULL_SHARD",
        /// Shard gradients and optimizer state; keep parameters gathered through backward (ZeRO-2).
        ShardGradOp => "SHARD_GRAD_OP",
        /// Replicate everything; all-reduce gradients (DDP).
        NoShard => "NO_SHARD",
        /// FULL_SHARD inside a node group, replicated across node groups.
        HybridShard => "HYBRID_SHARD",
        /// SHARD_GRAD_OP inside a node group, replicated across node groups.
        HybridShardZero2 => "HYBRID_SHARD_ZERO2",
    }
);

impl ShardingStrategy {
    /// True for the strategies that shard inside a node group and replicate across groups.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Self::HybridShard | Self::HybridShardZero2)
    }

    /// True for the strategies that release a unit's parameters after its forward and gather
    /// them again for its backward (FULL_SHARD, HYBRID_SHARD).
    pub fn reshards_after_forward(self) -> bool {
        matches!(self, Self::FullShard | Self::HybridShard)
    }
}

choice_enum!(
    /// How the model is split into FSDP units.
    AutoWrapPolicy {
        /// One unit per module whose type name is listed (or the model's default list).
        TransformerBasedWrap => "TRANSFORMER_BASED_WRAP",
        /// One unit per subtree holding at least `fsdp_min_num_params` parameters.
        SizeBasedWrap => "SIZE_BASED_WRAP",
        /// The whole model is one unit.
        NoWrap => "NO_WRAP",
    }
);

choice_enum!(
    /// When the next unit's parameters are gathered during backward.
    BackwardPrefetch {
        /// Before the current unit's gradient computation.
        BackwardPre => "BACKWARD_PRE",
        /// After the current unit's gradient computation.
        BackwardPost => "BACKWARD_POST",
        /// Only when the unit is reached.
        NoPrefetch => "NO_PREFETCH",
    }
);

choice_enum!(
    /// How checkpoints store the model.
    StateDictType {
        /// One consolidated file written by rank 0.
        FullStateDict => "FULL_STATE_DICT",
        /// Each rank's raw shards, loadable only at the same world size.
        LocalStateDict => "LOCAL_STATE_DICT",
        /// Each rank's shards plus metadata; reloadable at any world size.
        ShardedStateDict => "SHARDED_STATE_DICT",
    }
);

choice_enum!(
    /// The files a SHARDED_STATE_DICT checkpoint is written as.
    CheckpointFormat {
        /// fsdp-rs's own: safetensors shards with checksummed JSON metadata.
        FsdpRs => "fsdp-rs",
        /// PyTorch's distributed checkpoint (`torch.distributed.checkpoint`), as Accelerate's
        /// `save_state` writes it: `accelerator.load_state` in PyTorch resumes it.
        TorchDcp => "torch-dcp",
    }
);

choice_enum!(
    /// Precision of compute and communication.
    MixedPrecision {
        /// Everything in fp32.
        No => "no",
        /// fp16 parameters for compute, fp32 master weights.
        Fp16 => "fp16",
        /// bf16 parameters for compute, fp32 master weights.
        Bf16 => "bf16",
    }
);

choice_enum!(
    /// The element type gradients are reduced in (PyTorch's `MixedPrecision.reduce_dtype`):
    /// f32 by default whatever the compute dtype, since summing half-precision gradients
    /// over ranks rounds away their low bits; a half type halves the reduction's bytes.
    ReduceDtype {
        /// f32.
        Fp32 => "fp32",
        /// bf16.
        Bf16 => "bf16",
        /// fp16 (needs a loss scale that keeps gradients in range: `mixed_precision: fp16`'s).
        Fp16 => "fp16",
        /// Symmetric int8 with one f32 scale per block of 128 elements, exchanged all-to-all
        /// and summed in f32 (ZeRO++'s quantized gradients): a quarter of f32's bytes; the
        /// sum is never formed in low precision.
        Int8 => "int8",
        /// Symmetric int4 with one f32 scale per block of 128 elements, exchanged and summed
        /// as int8 is (ZeRO++'s 4-bit quantized gradients): 13% of f32's bytes.
        Int4 => "int4",
    }
);

impl ReduceDtype {
    /// Whether gradients travel as integer blocks summed in f32 on arrival.
    pub fn is_quantized(self) -> bool {
        matches!(self, ReduceDtype::Int8 | ReduceDtype::Int4)
    }
}

choice_enum!(
    /// The element type parameters are all-gathered in: the compute dtype, or int8 blocks
    /// (ZeRO++'s quantized weights: a quarter of f32's bytes on the wire, half of bf16's).
    AllGatherDtype {
        /// The compute dtype (`mixed_precision`'s): bf16 with bf16, else f32.
        Auto => "auto",
        /// Symmetric int8 with one f32 scale per block of 128 elements of a rank's shard,
        /// dequantized into the compute dtype on arrival; master weights stay f32.
        Int8 => "int8",
    }
);

choice_enum!(
    /// What kind of job the configuration describes.
    DistributedType {
        /// A single process.
        No => "NO",
        /// Data-parallel (replicated) training on CPU processes.
        MultiCpu => "MULTI_CPU",
        /// Data-parallel (replicated) training on GPUs.
        MultiGpu => "MULTI_GPU",
        /// Fully sharded data-parallel training.
        Fsdp => "FSDP",
    }
);

choice_enum!(
    /// Where the job runs.
    ComputeEnvironment {
        /// Machines the user starts the launcher on.
        LocalMachine => "LOCAL_MACHINE",
    }
);

choice_enum!(
    /// How processes on several machines find each other.
    RendezvousBackend {
        /// Fixed world size; every machine is told the main process address.
        Static => "static",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers() {
        assert_eq!("full_shard".parse(), Ok(ShardingStrategy::FullShard));
        assert_eq!("5".parse(), Ok(ShardingStrategy::HybridShardZero2));
        assert_eq!("3".parse(), Ok(AutoWrapPolicy::NoWrap));
        assert_eq!("2".parse(), Ok(BackwardPrefetch::BackwardPost));
        assert_eq!("3".parse(), Ok(StateDictType::ShardedStateDict));
        assert!("0".parse::<ShardingStrategy>().is_err());
        assert!("6".parse::<ShardingStrategy>().is_err());
        let err = "FULL".parse::<ShardingStrategy>().unwrap_err();
        assert!(
            err.contains("FULL_SHARD (1)") && err.contains("HYBRID_SHARD_ZERO2 (5)"),
            "{err}"
        );
    }
}
