//! A unit whose frozen weight sits beside trainable parameters (LoRA's base projection beside
//! its adapter) reduces only the trainable parameters' gradients: the frozen weight's rows
//! are not packed, sent or scaled, and the gradients that are sent equal plain candle's.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use fsdp::config::Layer;
use fsdp::engine::Fsdp;
use fsdp::nn::{Init, LocalParams, ModuleInfo, ParamSpec, Params};

use crate::common;

const WIDTH: usize = 64;

fn param(name: &str, shape: Vec<usize>, requires_grad: bool) -> ParamSpec {
    ParamSpec {
        name: name.into(),
        shape,
        init: Init::Normal { std: 0.2 },
        requires_grad,
        sparse_grad: false,
        packing: None,
    }
}

/// One unit `block` holding a square weight (frozen or not) and a trainable bias.
fn info(frozen: bool) -> ModuleInfo {
    let mut block = ModuleInfo::new("block", "Block");
    block
        .params
        .push(param("block.weight", vec![WIDTH, WIDTH], !frozen));
    block.params.push(param("block.bias", vec![WIDTH], true));
    ModuleInfo::new("", "Toy").child(block)
}

fn loss(p: &dyn Params, x: &Tensor) -> candle_core::Result<Tensor> {
    let h = x
        .matmul(&p.get("block.weight")?)?
        .broadcast_add(&p.get("block.bias")?)?;
    p.module_output("block", h)?.tanh()?.sqr()?.mean_all()
}

fn input() -> Tensor {
    let v: Vec<f32> = (0..4 * WIDTH)
        .map(|i| ((i * 5 % 13) as f32 - 6.0) / 7.0)
        .collect();
    Tensor::from_vec(v, (4, WIDTH), &Device::Cpu).unwrap()
}

/// Rank 0's bias gradient and the bytes every rank sent in one backward on 2 ranks.
fn backward(frozen: bool) -> (Vec<f32>, Option<Vec<f32>>, u64) {
    let out = common::tiny::on_threads(2, move |group| {
        let plugin = common::tiny::block_units()
            .resolve(&Layer::new(), None)
            .unwrap()
            .fsdp;
        let weights = LocalParams::init(&info(false), 9, DType::F32, &Device::Cpu)
            .unwrap()
            .tensors();
        let mut engine =
            Fsdp::new(&info(frozen), &weights, &plugin, &[], Arc::clone(&group)).unwrap();
        let params = engine.begin_step().unwrap();
        let l = loss(&params, &input()).unwrap();
        let before = group.bytes_sent();
        engine.backward(params, l, true).unwrap();
        let grads = engine.gradients().unwrap();
        let sent = group.bytes_sent() - before;
        let bias = grads.get("block.bias").unwrap().to_vec();
        let weight = grads.get("block.weight").map(<[f32]>::to_vec);
        (bias, weight, sent)
    });
    let sent = out.iter().map(|(_, _, s)| s).sum();
    let (bias, weight, _) = out.into_iter().next().unwrap();
    (bias, weight, sent)
}

#[test]
fn a_frozen_weight_beside_trainable_parameters_is_not_reduced() {
    let (bias_all, weight_all, sent_all) = backward(false);
    let (bias_frozen, weight_frozen, sent_frozen) = backward(true);
    assert!(weight_all.is_some() && weight_frozen.is_none());
    // The bias's gradient is the same either way, and plain candle's.
    assert_eq!(bias_all, bias_frozen);
    let plain = LocalParams::init(&info(false), 9, DType::F32, &Device::Cpu).unwrap();
    let grads = loss(&plain, &input()).unwrap().backward().unwrap();
    let bias_var = &plain.vars()["block.bias"];
    let want: Vec<f32> = grads.get(bias_var.as_tensor()).unwrap().to_vec1().unwrap();
    for (g, w) in bias_frozen.iter().zip(&want[..bias_frozen.len()]) {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-3), "{g} vs {w}");
    }
    // A reduce-scatter sends at least (S-1)/S of its input per rank: the weight's half of
    // 64 x 64 f32 on each of the two ranks is no longer sent.
    let weight_share = 2 * (WIDTH * WIDTH * 4 / 2) as u64;
    assert!(
        sent_frozen + weight_share <= sent_all,
        "with the weight frozen {sent_frozen} bytes were sent, {sent_all} with it trained"
    );
}
