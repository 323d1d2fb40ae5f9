//! The attention kernels on the emulator (row and tiled), and their plans.

use super::*;

/// One attention case: `heads` over `[batch, seq]`, optionally causal, with a padding mask
/// hiding the last `masked` keys of the second sequence, q, k, v read in place from one fused
/// `[batch, seq, 3 * width]` projection (`fused`, equal head counts) or given apart, and
/// optionally dropout.
struct AttentionCase {
    batch: usize,
    seq: usize,
    heads: AttentionHeads,
    head_dim: usize,
    masked: usize,
    fused: bool,
    /// Dropout on the probabilities, `(probability, seed)`.
    dropout: Option<(f64, u64)>,
}

fn check_attention(emulator: &Emulator, c: &AttentionCase, dtype: DType) {
    use attention_buffers as ab;
    let AttentionCase {
        batch,
        seq,
        heads,
        head_dim,
        masked,
        fused,
        dropout,
    } = *c;
    let case = format!(
        "attention {heads:?}, {batch} x {seq}, head_dim {head_dim}, {masked} masked, fused {fused}, dropout {dropout:?}, {dtype:?}"
    );
    let (qw, kw) = (heads.heads * head_dim, heads.kv_heads * head_dim);
    let seed = (seq * 100 + head_dim) as u64;
    let t = |shape: &[usize], s: u64| rand(shape, seed + s, 1.5, dtype);
    let mask = (masked > 0).then(|| {
        let mut m = vec![0f32; batch * seq];
        for key in seq - masked..seq {
            m[seq + key] = -1e4;
        }
        Tensor::from_vec(m, (batch, 1, 1, seq), &candle_core::Device::Cpu).unwrap()
    });
    let grad = t(&[batch, seq, qw], 9);
    // The CPU op and its gradients: of q, k and v, or of the fused projection.
    let (inputs, (y, grads)) = if fused {
        let qkv = t(&[batch, seq, 3 * qw], 1);
        let cpu = on_the_cpu(
            |t| ops::packed_attention(&t[0], heads.heads, heads.causal, mask.as_ref(), dropout),
            &[&qkv],
            &grad,
        );
        (vec![qkv], cpu)
    } else {
        let (q, k, v) = (
            t(&[batch, seq, qw], 1),
            t(&[batch, seq, kw], 2),
            t(&[batch, seq, kw], 3),
        );
        let cpu = on_the_cpu(
            |t| ops::grouped_query_attention(&t[0], &t[1], &t[2], heads, mask.as_ref(), dropout),
            &[&q, &k, &v],
            &grad,
        );
        (vec![q, k, v], cpu)
    };
    // Operand bytes and strides: the fused projection's rows hold q, k, v side by side, each
    // bound at its own offset (as a GPU pointer into a view would be).
    let size = dtype.size_in_bytes();
    let (operands, strides): (Vec<Vec<u8>>, Vec<(usize, usize)>) = if fused {
        let all = bytes(&inputs[0]);
        let at = |part: usize| all[part * qw * size..].to_vec();
        (vec![at(0), at(1), at(2)], vec![(seq * 3 * qw, 3 * qw); 3])
    } else {
        (
            inputs.iter().map(bytes).collect(),
            vec![(seq * qw, qw), (seq * kw, kw), (seq * kw, kw)],
        )
    };
    let shape = AttentionShape {
        batch,
        seq,
        q: strides[0],
        k: strides[1],
        v: strides[2],
        mask: mask.as_ref().map(|_| [batch, 1, 1, seq]),
        dropout,
        ..call_of(heads, head_dim, dtype)
    };
    let mut buffers = Buffers::default();
    for (index, data) in [ab::Q, ab::K, ab::V].into_iter().zip(operands) {
        buffers.0.insert(index, data);
    }
    if let Some(m) = &mask {
        buffers = buffers.input(ab::MASK, m);
    }
    let case = format!("{case}, tiled {}", shape.tiled);
    run_attention(emulator, &case, &shape, buffers, (&y, &grads, &grad), fused);
}

/// One attention plan on the emulator against the CPU op's output and gradients (of q, k, v,
/// or of the fused projection).
fn run_attention(
    emulator: &Emulator,
    case: &str,
    shape: &AttentionShape,
    buffers: Buffers,
    (y, grads, grad): (&Tensor, &[Tensor], &Tensor),
    fused: bool,
) {
    use attention_buffers as ab;
    let AttentionShape {
        batch,
        seq,
        dtype,
        head_dim,
        ..
    } = *shape;
    let (qw, kw) = (shape.heads * head_dim, shape.kv_heads * head_dim);
    let rows = batch * shape.heads * seq;
    // Token rows: the padded batch's, or the packed sequences' (whose operands have no
    // batch stride).
    let tokens = y.elem_count() / qw;
    let batch_stride = |width: usize| if shape.packed { 0 } else { seq * width };
    let forward_buffers = Buffers(buffers.0.clone())
        .output(ab::OUT, tokens * qw, dtype)
        .scratch(ab::LSE, rows);
    let out = emulator.run(&shape.forward().unwrap(), &forward_buffers.0);
    assert_close(case, "output", &out[&ab::OUT], dtype, y);

    let mut backward_buffers = buffers
        .input(ab::DOUT, grad)
        .scratch(ab::DELTA, rows)
        .output(ab::DQ, tokens * qw, dtype)
        .output(ab::DK, tokens * kw, dtype)
        .output(ab::DV, tokens * kw, dtype);
    backward_buffers.0.insert(ab::OUT, out[&ab::OUT].clone());
    backward_buffers.0.insert(ab::LSE, out[&ab::LSE].clone());
    let plan = shape
        .backward((batch_stride(qw), qw), (batch_stride(kw), kw))
        .unwrap();
    let out = emulator.run(&plan, &backward_buffers.0);
    let want: Vec<Tensor> = if fused {
        (0..3)
            .map(|i| grads[0].narrow(2, i * qw, qw).unwrap())
            .collect()
    } else {
        grads.to_vec()
    };
    for (i, (index, name)) in [(ab::DQ, "q"), (ab::DK, "k"), (ab::DV, "v")]
        .into_iter()
        .enumerate()
    {
        assert_close(
            case,
            &format!("{name} gradient"),
            &out[&index],
            dtype,
            &want[i],
        );
    }
}

/// Packed sequences (`varlen_attention`) of `lengths` tokens out of a padded batch of
/// `padded_len`, on the emulator against the CPU op: values and the three gradients, with
/// dropout drawing the padded batch's masks where given; heads of 64 on the tiled kernels.
fn check_varlen_attention(
    emulator: &Emulator,
    (lengths, padded_len): (&[usize], usize),
    heads: AttentionHeads,
    head_dim: usize,
    dropout: Option<(f64, u64)>,
    dtype: DType,
) {
    use attention_buffers as ab;
    let seqs = ops::PackedSequences::from_lengths(lengths, padded_len).unwrap();
    let case = format!(
        "varlen attention {heads:?}, lengths {lengths:?} of {padded_len}, head_dim {head_dim}, dropout {dropout:?}, {dtype:?}"
    );
    let (qw, kw, n) = (
        heads.heads * head_dim,
        heads.kv_heads * head_dim,
        seqs.tokens(),
    );
    let t = |shape: &[usize], s: u64| rand(shape, (n * 10 + head_dim) as u64 + s, 1.5, dtype);
    let (q, k, v, grad) = (
        t(&[n, qw], 1),
        t(&[n, kw], 2),
        t(&[n, kw], 3),
        t(&[n, qw], 4),
    );
    let (y, grads) = on_the_cpu(
        |t| ops::varlen_attention(&t[0], &t[1], &t[2], heads, &seqs, dropout),
        &[&q, &k, &v],
        &grad,
    );
    let shape = AttentionShape {
        batch: seqs.sequences(),
        seq: padded_len,
        q: (0, qw),
        k: (0, kw),
        v: (0, kw),
        dropout,
        packed: true,
        ..call_of(heads, head_dim, dtype)
    };
    let buffers = Buffers::default()
        .input(ab::Q, &q)
        .input(ab::K, &k)
        .input(ab::V, &v)
        .u32s(ab::STARTS, &seqs.row_starts());
    let case = format!("{case}, tiled {}", shape.tiled);
    run_attention(emulator, &case, &shape, buffers, (&y, &grads, &grad), false);
}

/// An attention call of `heads` over heads of `head_dim` in `dtype`, scaled as the CPU op
/// scales; heads of 64 take the tiled kernels (as on a GPU), the others the row kernels. The
/// caller sets the extents, strides, mask, dropout and packing (none here).
fn call_of(heads: AttentionHeads, head_dim: usize, dtype: DType) -> AttentionShape {
    AttentionShape {
        batch: 0,
        seq: 0,
        heads: heads.heads,
        kv_heads: heads.kv_heads,
        head_dim,
        dtype,
        causal: heads.causal,
        scale: 1.0 / (head_dim as f64).sqrt(),
        q: (0, 0),
        k: (0, 0),
        v: (0, 0),
        mask: None,
        dropout: None,
        tiled: head_dim == 64,
        packed: false,
    }
}

/// `heads` query heads sharing `kv_heads` K/V heads, causal or not.
fn gqa(heads: usize, kv_heads: usize, causal: bool) -> AttentionHeads {
    AttentionHeads {
        heads,
        kv_heads,
        causal,
    }
}

/// Attention on the emulator against the CPU op, values and the three gradients, in f32 and
/// bf16: multi-head, grouped-query 4:2 causal with heads wider than a warp (40: two elements
/// a lane, some lanes idle) and a last block of rows half full, multi-query with a padding
/// mask, q, k, v read in place from a fused projection, causal and masked, and dropout; heads
/// of 64 on the tiled kernels too.
#[test]
fn attention_kernels_on_the_emulator_match_the_cpu_op() {
    let Some(emulator) = emulator() else {
        return;
    };
    let case = |batch, seq, heads, head_dim, masked, fused, dropout| AttentionCase {
        batch,
        seq,
        heads,
        head_dim,
        masked,
        fused,
        dropout,
    };
    let cases = [
        case(2, 6, gqa(2, 2, false), 8, 0, false, None),
        case(1, 9, gqa(4, 2, true), 40, 0, false, None),
        case(2, 5, gqa(4, 1, false), 16, 2, false, None),
        case(2, 7, gqa(2, 2, true), 12, 3, true, None),
        // Dropout draws the CPU's masks: grouped-query causal, and fused with a mask.
        case(2, 9, gqa(4, 2, true), 40, 0, false, Some((0.25, 17))),
        case(2, 7, gqa(2, 2, false), 12, 3, true, Some((0.5, 3))),
        // Heads of 64 run the tiled kernels: several tiles of rows and keys, the last ones
        // partial, causal grouped-query, fused with a mask and dropout.
        case(1, 70, gqa(2, 1, true), 64, 0, false, None),
        case(2, 37, gqa(1, 1, true), 64, 4, true, Some((0.2, 9))),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for c in &cases {
            check_attention(emulator, c, dtype);
        }
    }
}

/// Packed sequences on the emulator against the CPU's `varlen_attention`, in f32 and bf16:
/// grouped-query with heads wider than a warp and dropout, causal multi-head, and heads of
/// 64 on the tiled kernels with sequences longer than a block of rows and one of a single
/// token (a block's rows spanning sequences' ends, blocks past a sequence's end idle).
#[test]
fn packed_attention_kernels_on_the_emulator_match_the_cpu_op() {
    let Some(emulator) = emulator() else {
        return;
    };
    for dtype in [DType::F32, DType::BF16] {
        let short: (&[usize], usize) = (&[3, 7, 1, 5], 8);
        check_varlen_attention(
            emulator,
            short,
            gqa(4, 2, false),
            40,
            Some((0.3, 11)),
            dtype,
        );
        check_varlen_attention(emulator, short, gqa(2, 2, true), 12, None, dtype);
        let long: (&[usize], usize) = (&[70, 1, 33], 72);
        check_varlen_attention(emulator, long, gqa(2, 1, false), 64, Some((0.2, 4)), dtype);
        check_varlen_attention(emulator, long, gqa(2, 2, true), 64, None, dtype);
    }
}

/// Attention's plans: heads of 64 on the tiled kernels (64 rows a block, the key pass 32) unless
/// `FSDP_CUDA_ATTENTION=rows`, other heads on the row kernels (4 warps a block); heads past
/// 256, uneven groups and tiled kernels for other head sizes refused by name.
#[test]
fn attention_plans_pick_the_kernels_their_heads_fit() {
    let rows_asked = std::env::var("FSDP_CUDA_ATTENTION").as_deref() == Ok("rows");
    assert_eq!(AttentionShape::tiles(64), !rows_asked);
    assert!(!AttentionShape::tiles(40) && !AttentionShape::tiles(128));
    let shape = AttentionShape {
        batch: 2,
        seq: 100,
        heads: 6,
        kv_heads: 2,
        head_dim: 64,
        dtype: DType::BF16,
        causal: true,
        scale: 0.125,
        q: (100 * 384, 384),
        k: (100 * 128, 128),
        v: (100 * 128, 128),
        mask: None,
        dropout: None,
        tiled: true,
        packed: false,
    };
    let plan = shape.backward((100 * 384, 384), (100 * 128, 128)).unwrap();
    let geometry: Vec<(&str, [u32; 3], [u32; 3])> = plan
        .iter()
        .map(|l| (l.kernel.as_str(), l.grid, l.block))
        .collect();
    assert_eq!(
        geometry,
        [
            (
                "fsdp_attention_backward_queries64_bf16",
                [2, 6, 2],
                [64, 1, 1]
            ),
            ("fsdp_attention_backward_keys64_bf16", [4, 2, 2], [32, 1, 1]),
        ]
    );
    let rows = AttentionShape {
        tiled: false,
        ..shape
    };
    let forward = rows.forward().unwrap();
    assert_eq!(forward[0].kernel, "fsdp_attention_forward_bf16");
    assert_eq!(
        (forward[0].grid, forward[0].block),
        ([25, 6, 2], [128, 1, 1])
    );
    let e = AttentionShape {
        head_dim: 40,
        ..shape
    }
    .forward()
    .unwrap_err()
    .to_string();
    assert!(e.contains("tiled kernels take heads of 64"), "{e}");
    let wide = AttentionShape {
        head_dim: 300,
        tiled: false,
        ..shape
    };
    assert!(wide.forward().unwrap_err().to_string().contains("1..=256"));
    let uneven = AttentionShape {
        kv_heads: 4,
        ..shape
    };
    assert!(uneven.forward().unwrap_err().to_string().contains("evenly"));
}
