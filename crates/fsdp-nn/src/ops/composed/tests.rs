//! Each composition against its fused op on the CPU, values and gradients of every
//! differentiable input, in f32 (1e-5 of each element's size) and bf16 (2e-2: one rounding
//! of f32 against one of f64, carried through the backward).

use candle_core::{DType, Device, Tensor};

use crate::numerics::{Fun, eval, max_rel_diff as error, rand};

use super::super::{
    self as ops, AttentionHeads, CrossEntropy, GeluApprox, Reduction, RopeLayout, RopeTable,
};

/// `f` on `device` against `reference` on the CPU at `inputs` (f32) and at the same inputs
/// in bf16, values and gradients; `f32_tol` for f32. With `bf16_in_f32` the bf16 case's
/// reference computes in f32 on the bf16 values: a GPU kernel rounds at other points than
/// the CPU's bf16 op, so both are held to the exact result instead of to each other.
fn compare(
    name: &str,
    f: &Fun<'_>,
    device: &Device,
    reference: &Fun<'_>,
    inputs: &[Tensor],
    (f32_tol, bf16_in_f32): (f64, bool),
) {
    for (dtype, tol) in [(DType::F32, f32_tol), (DType::BF16, 2e-2)] {
        let inputs: Vec<Tensor> = inputs.iter().map(|t| t.to_dtype(dtype).unwrap()).collect();
        let on_device: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.to_device(device).unwrap())
            .collect();
        let (va, ga) = eval(f, &on_device);
        // The types to expect are the reference's in `dtype` (a loss of bf16 logits is f32).
        let (typed, typed_grads) = eval(reference, &inputs);
        let (vb, gb) = if bf16_in_f32 && dtype == DType::BF16 {
            let wide: Vec<Tensor> = inputs
                .iter()
                .map(|t| t.to_dtype(DType::F32).unwrap())
                .collect();
            eval(reference, &wide)
        } else {
            (typed.clone(), typed_grads.clone())
        };
        assert!(
            va.device().same_device(device),
            "{name}: the output left {device:?}"
        );
        assert_eq!(
            va.dtype(),
            typed.dtype(),
            "{name} {dtype:?}: output types differ"
        );
        let d = error(&va, &vb);
        assert!(
            d < tol,
            "{name} {dtype:?}: value off by {d:e} (tol {tol:e})"
        );
        for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
            assert_eq!(
                a.dtype(),
                typed_grads[i].dtype(),
                "{name} {dtype:?}: gradient {i}'s type"
            );
            let d = error(a, b);
            assert!(
                d < tol,
                "{name} {dtype:?}: gradient of input {i} off by {d:e} (tol {tol:e})"
            );
        }
    }
}

/// What a case list asks of each op: `(name, the op, its composition, inputs)`.
type Checker<'a> = &'a dyn Fn(&str, &Fun<'_>, &Fun<'_>, &[Tensor]);

/// Every op's cases, each given to `check`.
fn every_op(check: Checker<'_>) {
    norms_activations_and_softmax(check);
    projections(check);
    embedding_and_losses(check);
    rope(check);
    attention(check);
}

/// Each composition against its fused op, both on the CPU; in bf16 against the fused op's
/// result in f32 on the same bf16 values (a composition rounds at other points than the bf16
/// op: packed attention with dropout put the two 2.04e-2 apart, each within 2e-2 of it).
#[test]
fn compositions_match_the_fused_ops() {
    every_op(&|name, fused, composed, inputs| {
        compare(name, composed, &Device::Cpu, fused, inputs, (1e-5, true))
    });
}

/// Each op on the GPU (its composition, until its kernel lands) against the fused op on the
/// CPU. Skips where no GPU is usable; under `FSDP_REQUIRE_GPU=1` (tools/gpu-check.sh) that
/// fails instead.
#[test]
fn every_op_on_a_gpu_matches_the_cpu() {
    let Some(gpu) = crate::device::gpu_for_tests() else {
        return;
    };
    every_op(&|name, op, _, inputs| compare(name, op, &gpu, op, inputs, (1e-5, true)));
}

fn norms_activations_and_softmax(check: Checker<'_>) {
    let (x, r) = (
        rand(&[3, 5, 16], 1, 2.0, DType::F32),
        rand(&[3, 5, 16], 2, 2.0, DType::F32),
    );
    let (g, b) = (
        rand(&[16], 3, 1.5, DType::F32),
        rand(&[16], 4, 0.5, DType::F32),
    );
    check(
        "layer_norm",
        &|t| ops::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        &|t| super::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        &[x.clone(), g.clone(), b.clone()],
    );
    check(
        "add_layer_norm",
        &|t| ops::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-12),
        &|t| super::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-12),
        &[x.clone(), r.clone(), g.clone(), b.clone()],
    );
    check(
        "rms_norm",
        &|t| ops::rms_norm(&t[0], &t[1], 1e-6),
        &|t| super::rms_norm(&t[0], &t[1], 1e-6),
        &[x.clone(), g.clone()],
    );
    // Rows wider than a CUDA block's threads and more rows than one chunk of the kernels'
    // parameter-gradient sums.
    let (wide, wide_r) = (
        rand(&[130, 300], 11, 2.0, DType::F32),
        rand(&[130, 300], 12, 1.0, DType::F32),
    );
    let (wide_g, wide_b) = (
        rand(&[300], 13, 1.5, DType::F32),
        rand(&[300], 14, 0.5, DType::F32),
    );
    check(
        "add_layer_norm (wide)",
        &|t| ops::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-5),
        &|t| super::add_layer_norm(&t[0], &t[1], &t[2], &t[3], 1e-5),
        &[wide.clone(), wide_r, wide_g.clone(), wide_b],
    );
    check(
        "rms_norm (wide)",
        &|t| ops::rms_norm(&t[0], &t[1], 1e-6),
        &|t| super::rms_norm(&t[0], &t[1], 1e-6),
        &[wide, wide_g],
    );
    let (h, bias) = (
        rand(&[4, 24], 5, 3.0, DType::F32),
        rand(&[24], 6, 1.0, DType::F32),
    );
    for approx in [GeluApprox::Erf, GeluApprox::Tanh] {
        check(
            "gelu",
            &|t| ops::gelu(&t[0], approx),
            &|t| super::gelu(&t[0], approx == GeluApprox::Tanh),
            std::slice::from_ref(&h),
        );
        check(
            "bias_gelu",
            &|t| ops::bias_gelu(&t[0], &t[1], approx),
            &|t| super::bias_gelu(&t[0], &t[1], approx == GeluApprox::Tanh),
            &[h.clone(), bias.clone()],
        );
    }
    check(
        "swiglu",
        &|t| ops::swiglu(&t[0], &t[1]),
        &|t| super::swiglu(&t[0], &t[1]),
        &[h.clone(), rand(&[4, 24], 7, 2.0, DType::F32)],
    );
    check(
        "softmax_last_dim",
        &|t| ops::softmax_last_dim(&t[0]),
        &|t| super::softmax_last_dim(&t[0]),
        &[rand(&[4, 3, 17], 8, 4.0, DType::F32)],
    );
    let p = 0.3;
    check(
        "dropout",
        &|t| ops::dropout(&t[0], p, 7),
        &|t| super::dropout(&t[0], p, 7),
        &[rand(&[4, 32], 9, 1.0, DType::F32)],
    );
    let seqs = ops::PackedSequences::from_lengths(&[3, 1, 4], 5).unwrap();
    check(
        "dropout_packed",
        &|t| ops::dropout_packed(&t[0], p, 7, &seqs),
        &|t| super::dropout_packed(&t[0], p, 7, &seqs),
        &[rand(&[seqs.tokens(), 32], 10, 1.0, DType::F32)],
    );
}

fn projections(check: Checker<'_>) {
    let x = rand(&[2, 3, 8], 11, 1.0, DType::F32);
    let (w, b, u) = (
        rand(&[6, 8], 12, 0.5, DType::F32),
        rand(&[6], 13, 0.5, DType::F32),
        rand(&[2, 3, 6], 14, 1.0, DType::F32),
    );
    check(
        "linear",
        &|t| ops::linear(&t[0], &t[1], &t[2]),
        &|t| super::project(&t[0], &t[1], true, Some(&t[2]), None),
        &[x.clone(), w.clone(), b.clone()],
    );
    check(
        "linear_no_bias",
        &|t| ops::linear_no_bias(&t[0], &t[1]),
        &|t| super::project(&t[0], &t[1], true, None, None),
        &[x.clone(), w.clone()],
    );
    check(
        "linear_no_bias_add",
        &|t| ops::linear_no_bias_add(&t[0], &t[1], &t[2]),
        &|t| super::project(&t[0], &t[1], true, None, None)? + &t[2],
        &[x.clone(), w.clone(), u.clone()],
    );
    check(
        "linear_gelu",
        &|t| ops::linear_gelu(&t[0], &t[1], &t[2], GeluApprox::Tanh),
        &|t| super::project(&t[0], &t[1], true, Some(&t[2]), Some(true)),
        &[x.clone(), w.clone(), b.clone()],
    );
    let w_in_out = rand(&[8, 6], 15, 0.5, DType::F32);
    // A GPU's projections with GELU: the product, then the fused bias-and-GELU kernel.
    for (approx, w_out_in, w) in [
        (GeluApprox::Tanh, true, &w),
        (GeluApprox::Erf, false, &w_in_out),
    ] {
        check(
            "product then bias_gelu",
            &|t| match w_out_in {
                true => ops::linear_gelu(&t[0], &t[1], &t[2], approx),
                false => ops::conv1d(&t[0], &t[1], &t[2], Some(approx)),
            },
            &|t| {
                super::super::linear::product_then_bias_gelu(&t[0], &t[1], w_out_in, &t[2], approx)
            },
            &[x.clone(), w.clone(), b.clone()],
        );
    }
    for gelu in [None, Some(GeluApprox::Erf)] {
        check(
            "conv1d",
            &|t| ops::conv1d(&t[0], &t[1], &t[2], gelu),
            &|t| {
                super::project(
                    &t[0],
                    &t[1],
                    false,
                    Some(&t[2]),
                    gelu.map(|a| a == GeluApprox::Tanh),
                )
            },
            &[x.clone(), w_in_out.clone(), b.clone()],
        );
    }
    check(
        "lora_update",
        &|t| ops::lora_update(&t[0], &t[1], &t[2], 2.0),
        &|t| super::lora_update(&t[0], &t[1], &t[2], 2.0),
        &[
            x.clone(),
            rand(&[4, 8], 16, 0.5, DType::F32),
            rand(&[6, 4], 17, 0.5, DType::F32),
        ],
    );
}

fn embedding_and_losses(check: Checker<'_>) {
    let ids = Tensor::new(&[[0u32, 3, 9, 3], [1, 0, 0, 7]], &Device::Cpu).unwrap();
    for pad in [None, Some(0)] {
        check(
            "embedding",
            &|t| ops::embedding(&t[0], &ids.to_device(t[0].device())?, pad),
            &|t| super::embedding(&t[0], &ids, pad),
            &[rand(&[10, 6], 21, 1.0, DType::F32)],
        );
    }
    let targets = Tensor::new(&[2i64, -100, 0, 4, 1, 4], &Device::Cpu).unwrap();
    let settings = [
        CrossEntropy::default(),
        CrossEntropy {
            reduction: Reduction::Sum,
            ..CrossEntropy::default()
        },
        CrossEntropy {
            label_smoothing: 0.1,
            ..CrossEntropy::default()
        },
    ];
    for s in settings {
        check(
            "cross_entropy",
            &|t| ops::cross_entropy(&t[0], &targets.to_device(t[0].device())?, s),
            &|t| {
                super::cross_entropy(
                    &t[0],
                    &targets,
                    s.ignore_index,
                    s.label_smoothing,
                    s.reduction == Reduction::Mean,
                )
            },
            &[rand(&[6, 5], 22, 3.0, DType::F32)],
        );
        check(
            "linear_cross_entropy",
            &|t| ops::linear_cross_entropy(&t[0], &t[1], &targets.to_device(t[0].device())?, s),
            &|t| {
                let logits = super::project(&t[0], &t[1], true, None, None)?;
                super::cross_entropy(
                    &logits,
                    &targets,
                    s.ignore_index,
                    s.label_smoothing,
                    s.reduction == Reduction::Mean,
                )
            },
            &[
                rand(&[6, 8], 23, 1.0, DType::F32),
                rand(&[5, 8], 24, 1.0, DType::F32),
            ],
        );
    }
}

fn rope(check: Checker<'_>) {
    let table = RopeTable::new(8, 10_000.0, None).unwrap();
    let shared: Vec<u32> = (3..7).collect();
    let per_row: Vec<u32> = (0..4).chain(10..14).collect();
    for positions in [&shared, &per_row] {
        let angles = table.angles_at(positions);
        for (layout, shape) in [
            (RopeLayout::HeadsFirst, [2, 3, 4, 8]),
            (RopeLayout::SeqFirst, [2, 4, 3, 8]),
        ] {
            check(
                "rope",
                &|t| ops::rope_with(&t[0], &angles, layout),
                &|t| {
                    let (cos, sin, positions) = angles.parts();
                    super::rope(&t[0], cos, sin, positions, layout == RopeLayout::SeqFirst)
                },
                &[rand(&shape, 31, 1.0, DType::F32)],
            );
        }
    }
}

fn attention(check: Checker<'_>) {
    let (b, s, hd) = (2, 5, 4);
    let q = rand(&[b, s, 4 * hd], 41, 1.0, DType::F32);
    let kv = |seed| rand(&[b, s, 2 * hd], seed, 1.0, DType::F32);
    for causal in [false, true] {
        let heads = AttentionHeads {
            heads: 4,
            kv_heads: 2,
            causal,
        };
        check(
            "grouped_query_attention",
            &|t| ops::grouped_query_attention(&t[0], &t[1], &t[2], heads, None, None),
            &|t| super::attention(&t[0], &t[1], &t[2], (4, 2), causal, None, None),
            &[q.clone(), kv(42), kv(43)],
        );
    }
    // A padding mask hiding each sequence's last key, and dropout on the probabilities.
    let hide: Vec<f32> = (0..b * s)
        .map(|i| if i % s == s - 1 { -1e4 } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(hide, (b, 1, 1, s), &Device::Cpu).unwrap();
    let (k, v) = (
        rand(&[b, s, 4 * hd], 44, 1.0, DType::F32),
        rand(&[b, s, 4 * hd], 45, 1.0, DType::F32),
    );
    check(
        "scaled_dot_product_attention",
        &|t| {
            let m = mask.to_device(t[0].device())?.to_dtype(t[0].dtype())?;
            ops::scaled_dot_product_attention(&t[0], &t[1], &t[2], 4, Some(&m), Some((0.2, 3)))
        },
        &|t| {
            let m = mask.to_dtype(t[0].dtype())?;
            super::attention(&t[0], &t[1], &t[2], (4, 4), false, Some(&m), Some((0.2, 3)))
        },
        &[q.clone(), k.clone(), v.clone()],
    );
    // The mask without dropout (what the CUDA kernels compute), and heads of 64 over 40
    // positions (two elements a lane, several blocks of rows).
    check(
        "scaled_dot_product_attention (mask)",
        &|t| {
            let m = mask.to_device(t[0].device())?.to_dtype(t[0].dtype())?;
            ops::scaled_dot_product_attention(&t[0], &t[1], &t[2], 4, Some(&m), None)
        },
        &|t| {
            let m = mask.to_dtype(t[0].dtype())?;
            super::attention(&t[0], &t[1], &t[2], (4, 4), false, Some(&m), None)
        },
        &[q.clone(), k.clone(), v.clone()],
    );
    let wide = AttentionHeads {
        heads: 2,
        kv_heads: 1,
        causal: true,
    };
    check(
        "grouped_query_attention (wide heads)",
        &|t| ops::grouped_query_attention(&t[0], &t[1], &t[2], wide, None, None),
        &|t| super::attention(&t[0], &t[1], &t[2], (2, 1), true, None, None),
        &[
            rand(&[1, 40, 128], 47, 1.0, DType::F32),
            rand(&[1, 40, 64], 48, 1.0, DType::F32),
            rand(&[1, 40, 64], 49, 1.0, DType::F32),
        ],
    );
    check(
        "packed_attention",
        &|t| ops::packed_attention(&t[0], 4, true, None, None),
        &|t| {
            let part = |i: usize| t[0].narrow(2, i * 4 * hd, 4 * hd);
            super::attention(&part(0)?, &part(1)?, &part(2)?, (4, 4), true, None, None)
        },
        &[rand(&[b, s, 12 * hd], 46, 1.0, DType::F32)],
    );
    // Packed sequences of 3, 5, 1 and 4 tokens (padded to 5), grouped-query, with dropout
    // drawing the padded batch's masks and causal; heads of 64 too (the tiled kernels on a
    // GPU, rows of one block spanning sequences).
    let seqs = ops::PackedSequences::from_lengths(&[3, 5, 1, 4], 5).unwrap();
    let n = seqs.tokens();
    for (causal, dropout) in [(false, Some((0.2, 5))), (true, None)] {
        let heads = AttentionHeads {
            heads: 4,
            kv_heads: 2,
            causal,
        };
        check(
            "varlen_attention",
            &|t| ops::varlen_attention(&t[0], &t[1], &t[2], heads, &seqs, dropout),
            &|t| super::varlen_attention(&t[0], &t[1], &t[2], (4, 2), causal, &seqs, dropout),
            &[
                rand(&[n, 4 * hd], 50, 1.0, DType::F32),
                rand(&[n, 2 * hd], 51, 1.0, DType::F32),
                rand(&[n, 2 * hd], 52, 1.0, DType::F32),
            ],
        );
    }
    let long = ops::PackedSequences::from_lengths(&[70, 3, 40], 80).unwrap();
    let n = long.tokens();
    check(
        "varlen_attention (heads of 64)",
        &|t| ops::varlen_attention(&t[0], &t[1], &t[2], wide, &long, Some((0.1, 8))),
        &|t| super::varlen_attention(&t[0], &t[1], &t[2], (2, 1), true, &long, Some((0.1, 8))),
        &[
            rand(&[n, 128], 53, 1.0, DType::F32),
            rand(&[n, 64], 54, 1.0, DType::F32),
            rand(&[n, 64], 55, 1.0, DType::F32),
        ],
    );
}
