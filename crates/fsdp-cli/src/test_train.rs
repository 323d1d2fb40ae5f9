//! The training part of `fsdp test`: a few steps of a small BERT classifier through the
//! `Accelerator` under the configuration the launcher passed (so a setting the engine cannot
//! honour fails here, naming it), checked on rank 0 against the same steps in one process.

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use fsdp::accelerator::{Accelerator, ReduceOp};
use fsdp::config::ShardingStrategy;
use fsdp::data::{CollateError, DataLoader};
use fsdp::engine::Fsdp;
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::candle::{DType, Device, Tensor};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{AdamW, AdamWConfig, is_bias_or_norm, split_no_decay};
use fsdp_comm::{Communicator, SingleRank};

const STEPS: usize = 8;
const PER_RANK: usize = 4;
const SEQ: usize = 12;
const VOCAB: usize = 128;

fn model() -> Result<BertForSequenceClassification> {
    Ok(BertForSequenceClassification::new(BertConfig {
        vocab_size: VOCAB,
        hidden_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 64,
        max_position_embeddings: SEQ,
        num_labels: 2,
        ..BertConfig::default()
    })?)
}

/// A learnable task: the class shows in the first token and in which half of the
/// vocabulary the others come from.
fn examples(n: usize) -> Vec<(Vec<u32>, u32)> {
    let mut s = fsdp::rng::XorShift64::new(fsdp::rng::GOLDEN_GAMMA);
    let mut next = move || s.next_u64();
    let half = (VOCAB as u64 - 4) / 2;
    (0..n)
        .map(|_| {
            let label = (next() % 2) as u32;
            let mut ids = vec![2 + label];
            ids.extend((1..SEQ).map(|_| (4 + u64::from(label) * half + next() % half) as u32));
            (ids, label)
        })
        .collect()
}

fn collate(examples: &[(Vec<u32>, u32)]) -> Result<(Tensor, Tensor), CollateError> {
    let ids: Vec<u32> = examples.iter().flat_map(|e| e.0.iter().copied()).collect();
    let labels: Vec<u32> = examples.iter().map(|e| e.1).collect();
    Ok((
        Tensor::from_vec(ids, (examples.len(), SEQ), &Device::Cpu)?,
        Tensor::from_vec(labels, examples.len(), &Device::Cpu)?,
    ))
}

fn adamw(names: Vec<String>) -> Result<AdamW> {
    Ok(AdamW::with_groups(split_no_decay(
        names,
        AdamWConfig::default(),
        is_bias_or_norm,
    ))?)
}

/// Trains the check's steps over `group` under the environment's configuration; rank 0
/// prints the losses and compares them with one process. With `die_in_step`, this rank
/// exits in the third step, between its forward and its backward (its peers are then in
/// backward's collectives).
pub fn train(group: Arc<dyn Communicator>, die_in_step: bool) -> Result<()> {
    let mut acc = Accelerator::builder()
        .communicator(group)
        .build()
        .context("reading the configuration from the environment")?;
    let world = acc.num_processes();
    let place = fsdp_comm::WorldInfo::from_env()?;
    if acc.local_process_index() != place.local_rank {
        bail!(
            "the Accelerator puts rank {} at local rank {}, its launch environment ({:?}) at {}",
            acc.process_index(),
            acc.local_process_index(),
            place.launcher,
            place.local_rank
        );
    }
    let m = model()?;
    let init = LocalParams::init(&m.info(), 11, DType::F32, &Device::Cpu)?.tensors();
    let names: Vec<String> = init.keys().cloned().collect();
    let mut model = acc
        .prepare_model(m, &init)
        .context("the engine refused this configuration")?;
    let mut optimizer = acc.prepare_optimizer(adamw(names.clone())?)?;
    let data = examples(STEPS * PER_RANK * world);
    let mut loader = acc.prepare_data_loader(DataLoader::new(data.clone(), PER_RANK, collate));
    let mut losses = Vec::new();
    while let Some(batch) = loader.next_batch() {
        let (ids, labels) = batch.map_err(|e| anyhow::anyhow!("{e}"))?.batch;
        let logits = model.forward(|m, p| m.forward(p, &ids, None, None))?;
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default())?;
        let local = loss.to_scalar::<f32>()?;
        if die_in_step && losses.len() == 2 {
            eprintln!("rank {} exits on purpose in step 3", acc.process_index());
            std::process::exit(3);
        }
        acc.backward(&mut model, loss)?;
        acc.clip_grad_norm(&mut model, 1.0)?;
        acc.optimizer_step(&mut model, &mut optimizer)?;
        losses.push(acc.reduce(vec![local], ReduceOp::Avg)?[0]);
    }
    let (mesh, machines) = {
        let m = model.engine().mesh();
        let machines = m.machines.as_ref().map(|h| h.gathers.machines());
        ((m.shard_size(), m.replicas()), machines)
    };
    if !acc.is_main_process() {
        return Ok(());
    }
    // The same steps in this process alone, on whole global batches.
    let m = model_single(&init, acc.plugin())?;
    let (single, mut engine) = m;
    let mut opt = adamw(names)?;
    let mut worst = 0f64;
    for (step, chunk) in data.chunks(PER_RANK * world).enumerate() {
        let (ids, labels) = collate(chunk).map_err(|e| anyhow::anyhow!("{e}"))?;
        let params = engine.begin_step()?;
        let logits = single.forward(&params, &ids, None, None)?;
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default())?;
        let want = loss.to_scalar::<f32>()? as f64;
        engine.backward(params, loss, true)?;
        engine.clip_grad_norm(Some(1.0))?;
        engine.step(&mut opt)?;
        let got = losses[step] as f64;
        worst = worst.max((got - want).abs() / want.abs().max(1e-12));
        println!("step {}: loss {got:.6} (one process: {want:.6})", step + 1);
    }
    // bf16 compute rounds every activation to 8 significant bits, and ranks round their
    // halves of the batch where one process rounds the whole: equal within 2^-7 then.
    // Int8 communication rounds each value that crosses the wire to within half a step of
    // 1/127 of its block's largest (measured within 6.6e-4 on the test matrix); int4
    // gradients to half of 1/7 of a block of 128's (4.4e-3 here on 2 machines of 2).
    use fsdp::config::Choice;
    let plugin = acc.plugin();
    let mut widths = Vec::new();
    if plugin.all_gather_dtype == fsdp::config::AllGatherDtype::Int8 {
        widths.push("int8");
    }
    if plugin.reduce_dtype.is_quantized() && !widths.contains(&plugin.reduce_dtype.name()) {
        widths.push(plugin.reduce_dtype.name());
    }
    let tolerance = match plugin.mixed_precision {
        fsdp::config::MixedPrecision::No if widths.contains(&"int4") => 1e-2,
        fsdp::config::MixedPrecision::No if !widths.is_empty() => 2e-3,
        fsdp::config::MixedPrecision::No => 1e-5,
        _ => 1.0 / 128.0,
    };
    let mut how = String::new();
    if !widths.is_empty() {
        how += &format!(", {} communication", widths.join("/"));
    }
    if let Some(n) = machines {
        how += &format!(", two hops across {n} machines");
    }
    if plugin.hpz_partition_size > 1 {
        how += &format!(", secondary partition of {}", plugin.hpz_partition_size);
    }
    if worst > tolerance {
        bail!(
            "sharded training differs from one process by {worst:.2e} (relative) in the loss (tolerance {tolerance:.1e})"
        );
    }
    if losses[STEPS - 1] >= losses[0] {
        bail!("the loss did not decrease: {losses:?}");
    }
    println!(
        "training ok: {STEPS} steps on {world} processes (shard groups of {} x {} replicas{how}), loss {:.4} -> {:.4}, equal to one process within {worst:.1e}",
        mesh.0,
        mesh.1,
        losses[0],
        losses[STEPS - 1]
    );
    Ok(())
}

/// The model under an engine of one process (hybrid strategies, which need machines to
/// shard inside, become their single-machine counterparts).
fn model_single(
    init: &std::collections::BTreeMap<String, Tensor>,
    plugin: &fsdp::config::FsdpPlugin,
) -> Result<(BertForSequenceClassification, Fsdp)> {
    let m = model()?;
    let mut plugin = plugin.clone();
    plugin.sharding_strategy = match plugin.sharding_strategy {
        ShardingStrategy::HybridShard => ShardingStrategy::FullShard,
        ShardingStrategy::HybridShardZero2 => ShardingStrategy::ShardGradOp,
        s => s,
    };
    let engine = Fsdp::wrap(&m, init, &plugin, Arc::new(SingleRank::new(0)))?;
    Ok((m, engine))
}
