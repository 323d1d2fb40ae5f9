//! What offloading promises about memory, counted by the counting allocator: with
//! `fsdp_offload_params` a rank's shards and AdamW state stay out of memory between steps,
//! and saving and loading a checkpoint stream them (the state is never all in memory at
//! once). Its own test binary: the allocator's counts are process-wide.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use fsdp::checkpoint::RunState;
use fsdp::config::{FsdpPlugin, Layer};
use fsdp::engine::Fsdp;
use fsdp::memory::{self, CountingAllocator};
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{Module, SeededWeights};
use fsdp::optim::{AdamW, AdamWConfig};
use fsdp_comm::SingleRank;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn model() -> BertForSequenceClassification {
    BertForSequenceClassification::new(BertConfig {
        vocab_size: 1000,
        hidden_size: 128,
        num_hidden_layers: 4,
        num_attention_heads: 2,
        intermediate_size: 512,
        max_position_embeddings: 8,
        ..BertConfig::default()
    })
    .unwrap()
}

/// Bytes live after two steps, the peak above them while saving, and while loading.
fn run(offload: bool, scratch: &std::path::Path, checkpoint: &std::path::Path) -> [usize; 3] {
    let m = model();
    let mut b = FsdpPlugin::builder();
    if offload {
        b = b
            .offload_params(true)
            .offload_dir(scratch.to_str().unwrap());
    }
    let plugin = b.resolve(&Layer::new(), None).unwrap().fsdp;
    let new_engine =
        || Fsdp::wrap(&m, &SeededWeights(3), &plugin, Arc::new(SingleRank::new(0))).unwrap();
    let mut engine = new_engine();
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    for step in 0..2u32 {
        let ids: Vec<u32> = (0..32).map(|i| (i * 37 + step * 11) % 1000).collect();
        let ids = Tensor::from_vec(ids, (4, 8), &Device::Cpu).unwrap();
        let labels = Tensor::from_vec(vec![0u32, 1, 1, 0], 4, &Device::Cpu).unwrap();
        let params = engine.begin_step().unwrap();
        let logits = m.forward(&params, &ids, None, None).unwrap();
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
        drop(logits);
        engine.backward(params, loss, true).unwrap();
        engine.clip_grad_norm(Some(1.0)).unwrap();
        engine.step(&mut opt).unwrap();
    }
    let live = memory::resident_bytes();
    memory::reset_peak();
    fsdp::checkpoint::save_state(
        checkpoint,
        &[&engine],
        &[&opt],
        &RunState::default(),
        &Default::default(),
    )
    .unwrap();
    let saving = memory::peak_bytes().saturating_sub(live);
    drop(engine);
    drop(opt);
    let mut engine = new_engine();
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let before = memory::resident_bytes();
    memory::reset_peak();
    fsdp::checkpoint::load_state(
        checkpoint,
        &mut [&mut engine],
        &mut [&mut opt],
        &Default::default(),
    )
    .unwrap();
    let loading = memory::peak_bytes().saturating_sub(before);
    drop(engine);
    [live, saving, loading]
}

#[test]
fn offloaded_state_stays_out_of_memory_and_checkpoints_stream_it() {
    CountingAllocator::mark_installed();
    let root = std::env::temp_dir().join(format!("fsdp-offload-memory-{}", std::process::id()));
    let params: usize = model()
        .info()
        .all_params()
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    // Parameters and AdamW's two buffers, f32.
    let state = params * 12;
    let [mem_live, mem_save, _] = run(false, &root.join("unused"), &root.join("a"));
    let [disk_live, disk_save, disk_load] = run(true, &root.join("scratch"), &root.join("b"));
    println!(
        "state {state} bytes; live after the step: in memory {mem_live}, offloaded {disk_live}; peak above while saving: {mem_save} / {disk_save}; while loading offloaded: {disk_load}"
    );
    assert!(
        mem_live - disk_live >= state * 9 / 10,
        "offloading kept {} of {state} state bytes in memory",
        state - (mem_live - disk_live).min(state)
    );
    // The largest parameter (the 1000 x 128 embedding) is 0.5 MB: saving and loading hold a
    // few of those, never the whole 12 B/parameter state.
    assert!(
        disk_save < state / 4,
        "saving held {disk_save} of {state} bytes"
    );
    assert!(
        disk_load < state / 4,
        "loading held {disk_load} of {state} bytes"
    );
    let _ = mem_save;
    std::fs::remove_dir_all(&root).unwrap();
}
