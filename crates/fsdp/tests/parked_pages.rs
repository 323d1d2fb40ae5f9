//! Under [`TrainingAllocator`], a released unit's full parameters hand their pages to the
//! next unit gathered or refilled instead of returning them to the system: the pages parked
//! after a forward are a unit's, the gradients computed from parameters on moved pages equal
//! plain candle's, and nothing stays parked once the ranks' threads are gone.
//!
//! Its own test binary: the allocator and its page figures are process-wide.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use fsdp::config::Layer;
use fsdp::engine::Fsdp;
use fsdp::memory::{self, TrainingAllocator};
use fsdp::nn::{Init, LocalParams, ModuleInfo, ParamSpec, Params};

#[global_allocator]
static ALLOC: TrainingAllocator = TrainingAllocator;

/// Held by each test for its whole run: the parked-page figures are process-wide, and a
/// test running beside another counted the other's pages too (4 units' worth instead of 2,
/// once in a clean-clone CI run).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// 640 x 640 f32 weights: 1.6 MiB, one of the allocator's large blocks.
const WIDTH: usize = 640;
const BLOCKS: usize = 4;

fn info() -> ModuleInfo {
    let mut root = ModuleInfo::new("", "Chain");
    for b in 0..BLOCKS {
        let mut block = ModuleInfo::new(format!("block{b}"), "Block");
        block.params.push(ParamSpec {
            name: format!("block{b}.weight"),
            shape: vec![WIDTH, WIDTH],
            init: Init::Normal { std: 0.04 },
            requires_grad: true,
            sparse_grad: false,
            packing: None,
        });
        root = root.child(block);
    }
    root
}

fn loss(p: &dyn Params, x: &Tensor) -> candle_core::Result<Tensor> {
    let mut h = x.clone();
    for b in 0..BLOCKS {
        let out = h.matmul(&p.get(&format!("block{b}.weight"))?)?.tanh()?;
        h = p.module_output(&format!("block{b}"), out)?;
    }
    h.sqr()?.mean_all()
}

fn input() -> Tensor {
    let v: Vec<f32> = (0..2 * WIDTH)
        .map(|i| ((i * 7 % 17) as f32 - 8.0) / 9.0)
        .collect();
    Tensor::from_vec(v, (2, WIDTH), &Device::Cpu).unwrap()
}

#[test]
fn released_parameters_hand_their_pages_to_the_next_unit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    TrainingAllocator::mark_installed();
    let weights = LocalParams::init(&info(), 5, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    // Two steps on 2 ranks (threads); the second gathers into and refills from pages the
    // first released.
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let out = common::tiny::on_threads(2, move |group| {
        let plugin = common::tiny::block_units()
            .resolve(&Layer::new(), None)
            .unwrap()
            .fsdp;
        let mut engine = Fsdp::new(&info(), &weights, &plugin, &[], group).unwrap();
        let mut parked = 0;
        let mut grads = Vec::new();
        for _ in 0..2 {
            let params = engine.begin_step().unwrap();
            let l = loss(&params, &input()).unwrap();
            barrier.wait();
            parked = memory::parked_bytes();
            barrier.wait();
            engine.backward(params, l, true).unwrap();
            let g = engine.gradients().unwrap();
            grads = (0..BLOCKS)
                .map(|b| g.get(&format!("block{b}.weight")).unwrap().to_vec())
                .collect();
            engine.zero_grad();
        }
        (parked, grads)
    });
    // The gradients (this rank's rows) are plain candle's: the pages that moved between
    // parameters carried no stale values into a product.
    let plain = LocalParams::init(&info(), 5, DType::F32, &Device::Cpu).unwrap();
    let all = loss(&plain, &input()).unwrap().backward().unwrap();
    for (rank, (_, grads)) in out.iter().enumerate() {
        for (b, got) in grads.iter().enumerate() {
            let var = &plain.vars()[&format!("block{b}.weight")];
            let want = all.get(var.as_tensor()).unwrap().flatten_all().unwrap();
            let want: Vec<f32> = want.to_vec1().unwrap();
            let rows = &want[rank * got.len()..(rank + 1) * got.len()];
            for (g, w) in got.iter().zip(rows) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1e-4),
                    "block {b}: {g} vs {w}"
                );
            }
        }
    }
    // After forward each rank holds its last unit's weight parked (the whole pages of it),
    // never more than a unit's; the threads' ends returned them.
    let weight = WIDTH * WIDTH * 4 / 4096 * 4096;
    let parked = out[0].0;
    assert!(
        (2 * weight - 2 * 4096..=2 * weight).contains(&parked),
        "{parked} bytes parked after forward on 2 ranks; a unit's weight is {weight}"
    );
    assert_eq!(
        memory::parked_bytes(),
        0,
        "pages left parked after the ranks ended"
    );
}

/// [`loss`], block 0 adding the sum of its parameter of no elements (zero).
fn loss_with_empty(p: &dyn Params, x: &Tensor) -> candle_core::Result<Tensor> {
    let empty = p.get("block0.empty")?.sum_all()?;
    let mut h = x
        .matmul(&p.get("block0.weight")?)?
        .tanh()?
        .broadcast_add(&empty)?;
    h = p.module_output("block0", h)?;
    for b in 1..BLOCKS {
        let out = h.matmul(&p.get(&format!("block{b}.weight"))?)?.tanh()?;
        h = p.module_output(&format!("block{b}"), out)?;
    }
    h.sqr()?.mean_all()
}

/// A unit holding a parameter of no elements beside a large one is released and refilled
/// like any other (its refill has no pages to take).
#[test]
fn a_parameter_of_no_elements_is_released_and_refilled() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    TrainingAllocator::mark_installed();
    let mut model = info();
    model.children[0].params.push(ParamSpec {
        name: "block0.empty".into(),
        shape: vec![0],
        init: Init::Zeros,
        requires_grad: true,
        sparse_grad: false,
        packing: None,
    });
    let weights = LocalParams::init(&model, 5, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    let losses = common::tiny::on_threads(2, move |group| {
        let plugin = common::tiny::block_units()
            .resolve(&Layer::new(), None)
            .unwrap()
            .fsdp;
        let mut engine = Fsdp::new(&model, &weights, &plugin, &[], group).unwrap();
        let params = engine.begin_step().unwrap();
        let l = loss_with_empty(&params, &input()).unwrap();
        let value = l.to_scalar::<f32>().unwrap();
        engine.backward(params, l, true).unwrap();
        value
    });
    assert!(
        losses[0].is_finite() && losses[0] == losses[1],
        "{losses:?}"
    );
}
