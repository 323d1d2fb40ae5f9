use std::path::PathBuf;

use fsdp::accelerator::Accelerator;
use fsdp::data::{CollateError, DataLoader};
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::candle::{Device, Tensor};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{Module, SeededWeights};
use fsdp::optim::{AdamW, AdamWConfig, LrSchedule, is_bias_or_norm, split_no_decay};

/// One example: token ids and its class.
#[derive(Clone)]
struct Example { ids: Vec<u32>, label: u32 }

/// One rank's batch: ids and attention mask [batch, longest] (padded with id 0), labels [batch].
struct Batch { ids: Tensor, mask: Tensor, labels: Tensor }

/// The collate function: this rank's examples of a step into one batch, on `device` (where
/// the model computes). Any error converts into `CollateError` with `?`.
fn collate(examples: &[Example], device: &Device) -> Result<Batch, CollateError> {
    let (n, len) = (examples.len(), examples.iter().map(|e| e.ids.len()).max().unwrap_or(1));
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for e in examples {
        for i in 0..len {
            ids.push(e.ids.get(i).copied().unwrap_or(0));
            mask.push(u32::from(i < e.ids.len()));
        }
    }
    let labels: Vec<u32> = examples.iter().map(|e| e.label).collect();
    Ok(Batch {
        ids: Tensor::from_vec(ids, (n, len), device)?,
        mask: Tensor::from_vec(mask, (n, len), device)?,
        labels: Tensor::from_vec(labels, n, device)?,
    })
}

/// `n` generated sequences of 4-11 ids in 1..64, labelled by whether any id is below 5: a
/// task a small model learns in a few epochs (your data goes here).
fn examples(n: usize, mut state: u64) -> Vec<Example> {
    let mut draw = move |below: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) % below) as u32
    };
    (0..n)
        .map(|_| {
            let len = 4 + draw(8) as usize;
            let ids: Vec<u32> = (0..len).map(|_| 1 + draw(63)).collect();
            Example { label: u32::from(ids.iter().any(|&id| id < 5)), ids }
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let mut acc = Accelerator::new()?; // the job `fsdp launch` started, or one process
    let config = BertConfig {
        vocab_size: 64, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
        intermediate_size: 64, max_position_embeddings: 16, ..BertConfig::default()
    };
    let model = BertForSequenceClassification::new(config.clone())?;
    // AdamW with no weight decay on biases and LayerNorm weights (two parameter groups).
    let names: Vec<String> = model.info().all_params().iter().map(|p| p.name.clone()).collect();
    let adamw = AdamWConfig { lr: 3e-3, weight_decay: 0.01, ..AdamWConfig::default() };
    let groups = split_no_decay(names, adamw, is_bias_or_norm);
    let mut model = acc.prepare_model(model, &SeededWeights(42))?; // sharded as configured
    let mut opt = acc.prepare_optimizer(AdamW::with_groups(groups)?)?;

    // 8 examples per rank and step; each rank reads its share of every step, made on the
    // device the model computes on (`acc.device()`).
    let on = |d: Device| move |e: &[Example]| collate(e, &d);
    let train = DataLoader::new(examples(512, 1), 8, on(acc.device().clone())).shuffle(42);
    let mut train = acc.prepare_data_loader(train);
    let mut held_out = acc.prepare_data_loader(DataLoader::new(examples(100, 2), 8, on(acc.device().clone())));
    let epochs = 4;
    let total = epochs * train.steps_per_epoch() as u64;
    acc.prepare_scheduler(&mut opt, LrSchedule::Linear { warmup: total / 10, total })?;

    for epoch in 0..epochs {
        train.set_epoch(epoch); // this epoch's shuffle (without it the loader moves on by itself)
        let mut last_loss = f32::NAN;
        while let Some(batch) = train.next_batch() {
            let b = batch?.batch;
            let logits = model.forward(|m, p| m.forward(p, &b.ids, Some(&b.mask), None))?;
            let loss = cross_entropy(&logits, &b.labels, CrossEntropy::default())?;
            last_loss = loss.to_scalar::<f32>()?;
            acc.backward(&mut model, loss)?;
            acc.clip_grad_norm(&mut model, 1.0)?;
            acc.optimizer_step(&mut model, &mut opt)?; // and the scheduler's step
        }
        // Evaluation without a graph: each rank predicts its share, and gather_for_metrics
        // collects every rank's results without the repeats that filled up the last step.
        let (mut correct, mut seen) = (0, 0);
        held_out.set_epoch(0);
        while let Some(batch) = held_out.next_batch() {
            let batch = batch?;
            let b = &batch.batch;
            let predicted: Vec<u32> =
                model.evaluate(|m, p| m.forward(p, &b.ids, Some(&b.mask), None)?.argmax(1)?.to_vec1())?;
            let labels: Vec<u32> = b.labels.to_vec1()?;
            let hits: Vec<bool> = predicted.iter().zip(&labels).map(|(p, l)| p == l).collect();
            let hits = acc.gather_for_metrics(hits, &batch)?;
            correct += hits.iter().filter(|&&hit| hit).count();
            seen += hits.len();
        }
        let accuracy = 100.0 * correct as f64 / seen as f64;
        acc.print(format!("epoch {epoch}: last loss {last_loss:.4}, held-out accuracy {accuracy:.2}% of {seen}"));
    }

    // The trained model for sharing: model.safetensors and config.json (transformers' names).
    let default = || std::env::temp_dir().join(format!("fsdp-training-{}", std::process::id()));
    let out = std::env::args().nth(1).map_or_else(default, PathBuf::from);
    let saved = acc.save_model(&model, &out.join("model"), &config.to_hf_json("BertForSequenceClassification"))?;
    acc.print(format!("model saved to {}", saved.display()));
    Ok(())
}
