//! The `fsdp config` questionnaire, in the order Accelerate asks: machine type, machines and
//! multi-node details, debug checks, CPU use, FSDP settings, number of processes, GPUs, mixed
//! precision. Defaults shown come from the schema (the number of processes from the cores, as
//! `fsdp config default` picks it), so pressing Enter through every question writes a valid
//! file.

use anyhow::Result;
use fsdp::config::{
    AllGatherDtype, AutoWrapPolicy, BackwardPrefetch, CheckpointFormat, Choice, DefaultValue, Key,
    Layer, MixedPrecision, ReduceDtype, ShardingStrategy, Source, StateDictType, Value, parse_text,
};

use crate::prompt::Prompter;

/// Where questionnaire answers say they came from.
fn source() -> Source {
    Source::Cli {
        flag: "fsdp config".into(),
    }
}

/// Asks the questions and returns the answers as a layer ready to validate and write.
pub fn ask(p: &mut dyn Prompter) -> Result<Layer> {
    let mut answers = Answers(Layer::new());
    answers.set(Key::ComputeEnvironment, text("LOCAL_MACHINE"));
    p.note("Compute environment: this machine (LOCAL_MACHINE)")?;

    let machine = p.select(
        "Which type of machine are you using?",
        &["No distributed training", "multi-CPU", "multi-GPU"],
        1,
    )?;
    let distributed = machine > 0;
    let on_cpu = machine == 1;

    let mut num_machines = 1;
    if distributed {
        num_machines = answers.ask_uint(
            p,
            Key::NumMachines,
            "How many different machines will you use (use more than 1 for multi-node training)?",
        )?;
        if num_machines > 1 {
            let ranks: Vec<String> = (0..num_machines).map(|r| r.to_string()).collect();
            let ranks: Vec<&str> = ranks.iter().map(String::as_str).collect();
            let rank = p.select("What is the rank of this machine?", &ranks, 0)?;
            answers.set(Key::MachineRank, Value::UInt(rank as u64));
            answers.ask_parsed(
                p,
                Key::MainProcessIp,
                "What is the IP address of the machine that will host the main process?",
                None,
            )?;
            answers.ask_parsed(
                p,
                Key::MainProcessPort,
                "What is the port you will use to communicate with the main process?",
                Some("29500"),
            )?;
        } else {
            answers.set(Key::MachineRank, Value::UInt(0));
        }
        answers.ask_bool(
            p,
            Key::Debug,
            "Should distributed operations be checked while running for errors? This can avoid timeout issues but will be slower.",
        )?;
    } else {
        answers.set(Key::MachineRank, Value::UInt(0));
        answers.set(Key::Debug, Value::Bool(false));
    }
    answers.set(Key::NumMachines, Value::UInt(num_machines));

    let use_cpu = if machine == 0 {
        answers.ask_bool(
            p,
            Key::UseCpu,
            "Do you want to run your training on CPU only (even if a GPU is available)?",
        )?
    } else {
        answers.set(Key::UseCpu, Value::Bool(on_cpu));
        on_cpu
    };

    let use_fsdp =
        distributed && p.confirm("Do you want to use FullyShardedDataParallel?", true)?;
    let distributed_type = match (use_fsdp, machine) {
        (true, _) => "FSDP",
        (false, 0) => "NO",
        (false, 1) => "MULTI_CPU",
        _ => "MULTI_GPU",
    };
    answers.set(Key::DistributedType, text(distributed_type));
    if use_fsdp {
        ask_fsdp(p, &mut answers, on_cpu, num_machines > 1)?;
    }

    if distributed {
        let what = if on_cpu { "processes" } else { "GPU(s)" };
        // On a CPU, one process per core (what `fsdp config default` writes).
        let default = match on_cpu {
            true => (crate::system::available_cores() as u64).clamp(1, 2),
            false => 1,
        };
        let processes = answers.ask_uint_or(
            p,
            Key::NumProcesses,
            &format!("How many {what} should be used for distributed training?"),
            default,
        )?;
        if use_fsdp {
            ask_secondary_partition(p, &mut answers, num_machines, processes)?;
        }
    } else {
        answers.set(Key::NumProcesses, Value::UInt(1));
    }
    if !use_cpu {
        answers.ask_parsed(
            p,
            Key::GpuIds,
            "What GPU(s) (by id) should be used for training on this machine as a comma-separated list?",
            Some("all"),
        )?;
    }
    answers.ask_choice::<MixedPrecision>(
        p,
        Key::MixedPrecision,
        "Do you wish to use mixed precision?",
    )?;

    // Written as Accelerate writes them, so the file stays interchangeable with it.
    answers.set(Key::DowncastBf16, text("no"));
    answers.set(Key::MainTrainingFunction, text("main"));
    answers.set(Key::RdzvBackend, text("static"));
    answers.set(Key::SameNetwork, Value::Bool(true));
    answers.set(Key::TpuEnv, Value::List(Vec::new()));
    answers.set(Key::TpuUseCluster, Value::Bool(false));
    answers.set(Key::TpuUseSudo, Value::Bool(false));
    Ok(answers.0)
}

/// For FULL_SHARD over several machines of 2 or more processes each: whether backward
/// gathers inside each machine (ZeRO++'s hpZ, a partition of the machine's size).
fn ask_secondary_partition(
    p: &mut dyn Prompter,
    answers: &mut Answers,
    machines: u64,
    processes: u64,
) -> Result<()> {
    let full_shard = answers.0.get(Key::FsdpShardingStrategy).map(|s| &s.value)
        == Some(&text(ShardingStrategy::FullShard.name()));
    let per_machine = processes / machines.max(1);
    let fits = machines > 1 && per_machine > 1 && processes.is_multiple_of(machines);
    if full_shard
        && fits
        && p.confirm(
            &format!(
                "Keep 1/{per_machine} of each gathered unit on every process so backward gathers inside its machine (ZeRO++'s hpZ, fsdp_hpz_partition_size: {per_machine}: fewer bytes between machines, the same training)?"
            ),
            false,
        )?
    {
        answers.set(Key::FsdpHpzPartitionSize, Value::UInt(per_machine));
    }
    Ok(())
}

fn ask_fsdp(
    p: &mut dyn Prompter,
    answers: &mut Answers,
    on_cpu: bool,
    across_machines: bool,
) -> Result<()> {
    answers.ask_choice::<ShardingStrategy>(
        p,
        Key::FsdpShardingStrategy,
        "What should be your sharding strategy?",
    )?;
    // Between machines the link, not the cores, often sets the step time.
    if across_machines
        && p.confirm(
            "Send parameters as int8 blocks and gradients as int4 blocks (ZeRO++'s quantized weights and gradients: a quarter and an eighth of f32's bytes, for links slower than the machines compute)?",
            false,
        )?
    {
        answers.set(Key::FsdpAllGatherDtype, text(AllGatherDtype::Int8.name()));
        answers.set(Key::FsdpReduceDtype, text(ReduceDtype::Int4.name()));
    }
    // On a CPU the state already lives in host memory: the offload worth asking about is to
    // disk.
    let to_host = !on_cpu
        && answers.ask_bool(
            p,
            Key::FsdpOffloadParams,
            "Do you want to offload parameters and gradients to CPU?",
        )?;
    let folder = answers.ask_optional_text(
        p,
        Key::FsdpOffloadDir,
        "Offload state to files in a local folder, for models larger than memory (fsdp_offload_dir)? Its path, or Enter for none",
    )?;
    if folder {
        let everything = to_host
            || p.confirm(
                "Offload parameter shards and gradients there too (yes), or only the optimizer state (no)?",
                true,
            )?;
        answers.set(Key::FsdpOffloadParams, Value::Bool(everything));
        answers.set(Key::FsdpOffloadOptimizer, Value::Bool(!everything));
    } else if on_cpu {
        answers.set(Key::FsdpOffloadParams, Value::Bool(false));
    }
    let policy = answers.ask_choice::<AutoWrapPolicy>(
        p,
        Key::FsdpAutoWrapPolicy,
        "What should be your auto wrap policy?",
    )?;
    match policy {
        AutoWrapPolicy::TransformerBasedWrap => {
            let model_default = p.confirm(
                "Do you want to use the model's default list of layer classes to wrap (its `_no_split_modules`)?",
                true,
            )?;
            if !model_default {
                answers.ask_parsed(
                    p,
                    Key::FsdpTransformerLayerClsToWrap,
                    "Specify the comma-separated list of transformer layer class names (case-sensitive) to wrap, e.g. `BertLayer`, `GPT2Block`, `BertLayer,BertEmbeddings`",
                    None,
                )?;
            }
        }
        AutoWrapPolicy::SizeBasedWrap => {
            answers.ask_uint(
                p,
                Key::FsdpMinNumParams,
                "What should be your FSDP's minimum number of parameters per unit?",
            )?;
        }
        AutoWrapPolicy::NoWrap => {}
    }
    answers.ask_choice::<BackwardPrefetch>(
        p,
        Key::FsdpBackwardPrefetch,
        "What should be your FSDP's backward prefetch policy?",
    )?;
    let state_dict = answers.ask_choice::<StateDictType>(
        p,
        Key::FsdpStateDictType,
        "What should be your FSDP's state dict type?",
    )?;
    if state_dict == StateDictType::ShardedStateDict {
        answers.ask_choice::<CheckpointFormat>(
            p,
            Key::FsdpCheckpointFormat,
            "In which files should sharded checkpoints be written (fsdp-rs: checksummed safetensors; torch-dcp: PyTorch's distributed checkpoint, resumable by Accelerate)?",
        )?;
    }
    answers.ask_bool(
        p,
        Key::FsdpForwardPrefetch,
        "Do you want to enable FSDP's forward prefetch policy?",
    )?;
    // fsdp-rs always keeps original parameters (per-parameter sharding); written for Accelerate.
    answers.set(Key::FsdpUseOrigParams, Value::Bool(true));
    let efficient = answers.ask_bool(
        p,
        Key::FsdpCpuRamEfficientLoading,
        "Do you want to enable CPU RAM efficient model loading (only rank 0 reads the full weights)?",
    )?;
    if efficient {
        answers.set(Key::FsdpSyncModuleStates, Value::Bool(true));
    } else {
        answers.ask_bool(
            p,
            Key::FsdpSyncModuleStates,
            "Do you want each FSDP unit to broadcast module parameters from rank 0 at the start?",
        )?;
    }
    answers.ask_bool(
        p,
        Key::FsdpActivationCheckpointing,
        "Do you want to enable FSDP activation checkpointing?",
    )?;
    answers.ask_optional_text(
        p,
        Key::FsdpTraceDir,
        "Write each rank's timeline of every step to a folder (fsdp_trace_dir; for Perfetto or `fsdp trace plot`)? Its path, or Enter for none",
    )?;
    Ok(())
}

fn text(t: &str) -> Value {
    Value::Text(t.to_string())
}

/// The layer being filled, with question helpers that take defaults from the schema.
struct Answers(Layer);

impl Answers {
    fn set(&mut self, key: Key, value: Value) {
        self.0.set(key, value, source());
    }

    fn ask_bool(&mut self, p: &mut dyn Prompter, key: Key, question: &str) -> Result<bool> {
        let default = matches!(key.spec().default, DefaultValue::Bool(true));
        let answer = p.confirm(question, default)?;
        self.set(key, Value::Bool(answer));
        Ok(answer)
    }

    fn ask_choice<T: Choice>(
        &mut self,
        p: &mut dyn Prompter,
        key: Key,
        question: &str,
    ) -> Result<T> {
        let default = match key.spec().default {
            DefaultValue::Text(d) => T::NAMES.iter().position(|n| *n == d).unwrap_or(0),
            _ => 0,
        };
        let chosen = T::ALL[p.select(question, T::NAMES, default)?];
        self.set(key, text(chosen.name()));
        Ok(chosen)
    }

    fn ask_uint(&mut self, p: &mut dyn Prompter, key: Key, question: &str) -> Result<u64> {
        let default = match key.spec().default {
            DefaultValue::UInt(n) => Some(n.to_string()),
            _ => None,
        };
        self.ask_uint_default(p, key, question, default.as_deref())
    }

    /// [`Answers::ask_uint`] with `default` instead of the schema's.
    fn ask_uint_or(
        &mut self,
        p: &mut dyn Prompter,
        key: Key,
        question: &str,
        default: u64,
    ) -> Result<u64> {
        self.ask_uint_default(p, key, question, Some(&default.to_string()))
    }

    fn ask_uint_default(
        &mut self,
        p: &mut dyn Prompter,
        key: Key,
        question: &str,
        default: Option<&str>,
    ) -> Result<u64> {
        match self.ask_parsed(p, key, question, default)? {
            Value::UInt(n) => Ok(n),
            other => anyhow::bail!("schema bug: {} parsed as {other:?}", key.name()),
        }
    }

    /// A text key that may stay unset: an empty answer sets nothing. Whether it was set.
    fn ask_optional_text(
        &mut self,
        p: &mut dyn Prompter,
        key: Key,
        question: &str,
    ) -> Result<bool> {
        let answer = p.input(question, Some(""))?;
        if answer.trim().is_empty() {
            return Ok(false);
        }
        self.set(key, text(answer.trim()));
        Ok(true)
    }

    /// Asks until the answer parses for `key`.
    fn ask_parsed(
        &mut self,
        p: &mut dyn Prompter,
        key: Key,
        question: &str,
        default: Option<&str>,
    ) -> Result<Value> {
        loop {
            let answer = p.input(question, default)?;
            match parse_text(key.spec(), &answer) {
                Ok(value) => {
                    self.set(key, value.clone());
                    return Ok(value);
                }
                Err(reason) => p.note(&format!("  `{answer}` is not valid: {reason}"))?,
            }
        }
    }
}
