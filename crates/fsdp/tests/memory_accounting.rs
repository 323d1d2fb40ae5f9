//! The counting allocator's figures for FULL_SHARD's released parameters: their returned
//! pages stay out of the resident count for as long as the storage lives, even after the
//! engine has let go of the step (the autograd graph a caller still holds keeps the storage
//! alive), and count again exactly when it is freed. A transient overstatement here once
//! showed as a doubled peak in `fsdp bench memory` whenever another thread allocated at
//! the wrong moment.

mod common;

use candle_core::{DType, Device, Tensor};
use fsdp::config::{FsdpPlugin, Layer, ShardingStrategy};
use fsdp::engine::Fsdp;
use fsdp::memory::{self, CountingAllocator};
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Held by each test for its whole run: the counts are process-wide, so a test running
/// beside another would count the other's allocations too.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const HIDDEN: usize = 128;
const LAYERS: usize = 3;

fn model() -> BertForSequenceClassification {
    BertForSequenceClassification::new(BertConfig {
        vocab_size: 64,
        hidden_size: HIDDEN,
        num_hidden_layers: LAYERS,
        num_attention_heads: 2,
        intermediate_size: 4 * HIDDEN,
        max_position_embeddings: 4,
        ..BertConfig::default()
    })
    .unwrap()
}

#[test]
fn released_parameters_stay_uncounted_until_their_storage_is_freed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    CountingAllocator::mark_installed();
    // One training step per rank; each rank hands back its logits, whose graph keeps every
    // gathered (and, after backward, released) parameter's storage alive.
    let held: Vec<Tensor> = common::tiny::on_threads(2, |group| {
        let m = model();
        let init = LocalParams::init(&m.info(), 3, DType::F32, &Device::Cpu).unwrap();
        let plugin = FsdpPlugin::builder()
            .sharding_strategy(ShardingStrategy::FullShard)
            .resolve(&Layer::new(), None)
            .unwrap()
            .fsdp;
        let mut engine = Fsdp::wrap(&m, &init.tensors(), &plugin, group).unwrap();
        let ids = Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu).unwrap();
        let labels = Tensor::new(&[1u32], &Device::Cpu).unwrap();
        let params = engine.begin_step().unwrap();
        let logits = m.forward(&params, &ids, None, None).unwrap();
        let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
        engine.backward(params, loss, true).unwrap();
        logits
    });
    let while_held = memory::resident_bytes();
    drop(held);
    let after = memory::resident_bytes();
    // Each layer's parameters, as one rank gathers them: 12 h^2 weights (and small vectors).
    let layer_bytes = 12 * HIDDEN * HIDDEN * 4;
    // What the held graph keeps resident is a few small activations (1 sample of 4 tokens)
    // and the pages at the edges of released buffers, not the layers' parameters.
    let kept = while_held.saturating_sub(after);
    assert!(
        kept < layer_bytes,
        "holding the graph counted {kept} bytes resident; one layer's parameters are \
         {layer_bytes} and 2 ranks x {LAYERS} layers were released"
    );
}

/// The patched backward (vendor/candle-core) frees each activation once its backward has run,
/// while the graph is still alive: after back-propagating a chain of 32 activations of 4 MiB
/// (each op's output kept by the next op), only the ones the caller holds remain; a tensor
/// the caller holds, and a view sharing its storage, keep their values.
#[test]
fn backward_frees_activations_as_it_goes_but_never_what_the_caller_holds() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    CountingAllocator::mark_installed();
    let n = 1 << 20; // 4 MiB of f32 per activation
    let x =
        candle_core::Var::from_tensor(&Tensor::ones(n, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let mut h = x.as_tensor().clone();
    let mut held = None;
    for i in 0..16 {
        h = h.exp().unwrap().affine(0.25, 0.0).unwrap();
        if i == 7 {
            held = Some(h.clone());
        }
    }
    let held = held.unwrap();
    let view = held.reshape((1024, 1024)).unwrap();
    let want: Vec<f32> = held.to_vec1().unwrap();
    let loss = h.sum_all().unwrap();
    let before = memory::resident_bytes() as f64 / (4 << 20) as f64;
    let grads = loss.backward().unwrap();
    // `loss` still holds the whole graph: without freeing, its 32 activations are all there.
    let after = memory::resident_bytes() as f64 / (4 << 20) as f64;
    assert!(
        after < before - 25.0,
        "{before:.1} activations' worth before backward, {after:.1} after it"
    );
    assert_eq!(held.to_vec1::<f32>().unwrap(), want);
    assert_eq!(view.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
    assert!(grads.get(x.as_tensor()).is_some());
    drop(loss);
}

/// The engine's pre-backward hook is a view (vendor/candle-core's `Tensor::hooked_view`):
/// hooking a 4 MiB activation allocates nothing, the view reads the activation's values, and
/// backward runs the hook's backward (once) before passing its gradient on.
#[test]
fn a_hooked_view_copies_nothing_and_runs_its_hook_in_backward() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct CountingHook(Arc<AtomicUsize>);
    impl candle_core::CustomOp1 for CountingHook {
        fn name(&self) -> &'static str {
            "counting-hook"
        }
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            Err(candle_core::Error::Msg("a view is never computed".into()))
        }
        fn bwd(
            &self,
            _arg: &Tensor,
            _res: &Tensor,
            grad: &Tensor,
        ) -> candle_core::Result<Option<Tensor>> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(Some(grad.clone()))
        }
    }

    CountingAllocator::mark_installed();
    let n = 1 << 20;
    let x = candle_core::Var::from_tensor(&Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap())
        .unwrap();
    let y = x.as_tensor().affine(2.0, 1.0).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let before = memory::resident_bytes();
    let hooked = y.hooked_view(CountingHook(calls.clone()));
    let grown = memory::resident_bytes().saturating_sub(before);
    assert!(
        grown < 4096,
        "hooking a 4 MiB tensor allocated {grown} bytes"
    );
    assert_eq!(
        hooked.to_vec1::<f32>().unwrap(),
        y.to_vec1::<f32>().unwrap()
    );
    let loss = (hooked * 3.0).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let g: Vec<f32> = grads.get(x.as_tensor()).unwrap().to_vec1().unwrap();
    assert!(g.iter().all(|&v| v == 6.0), "d(3 * (2x + 1))/dx is 6");
}
