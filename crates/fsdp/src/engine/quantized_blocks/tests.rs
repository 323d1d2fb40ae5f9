//! The codec's round trips, bounds and refusals.

use super::*;

const C: Codec = Codec::INT8;
const BLOCK: usize = C.block;

fn encode(v: &[f32], runs: &[usize]) -> Vec<u8> {
    C.encode(v, runs)
}

fn encoded_len(runs: &[usize]) -> usize {
    C.encoded_len(runs)
}

fn encode_parts(v: &[f32], runs: &[usize], parts: usize) -> Vec<u8> {
    C.encode_parts(v, runs, parts)
}

fn mean_of_parts(
    b: &[u8],
    runs: &[usize],
    members: usize,
    blocks: usize,
) -> Result<Vec<f32>, String> {
    C.mean_of_parts(b, runs, members, blocks)
}

fn decode_gathered(
    g: &Buffer,
    runs: &[usize],
    ranks: usize,
    dtype: DType,
) -> Result<Buffer, String> {
    C.decode_gathered(g, runs, ranks, dtype)
}

fn spans(runs: &[usize]) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
    C.spans(runs)
}

fn as_f32(b: Buffer) -> Vec<f32> {
    let mut out = vec![0f32; b.len()];
    assert!(b.to_f32_into(&mut out));
    out
}

/// Values of every magnitude, a block of zeros, and a tail shorter than a block.
fn values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match (i / BLOCK) % 3 {
            0 => ((i * 37 % 101) as f32 - 50.0) / 7.0,
            1 => 0.0,
            _ => ((i * 13 % 29) as f32 - 14.0) * 1e-3,
        })
        .collect()
}

/// Three parameters' runs: one over two blocks, a short one, one of a whole block.
const RUNS: [usize; 3] = [2 * BLOCK + 10, 67, BLOCK];

/// The quantization blocks of a block of `runs`: value ranges.
fn quantization_blocks(runs: &[usize]) -> Vec<Range<usize>> {
    spans(runs)
        .flat_map(|(v, _)| {
            v.clone()
                .step_by(BLOCK)
                .map(move |b| b..(b + BLOCK).min(v.end))
        })
        .collect()
}

/// Half a step of the quantization block holding each element of `values`.
fn half_steps(values: &[f32], runs: &[usize]) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for b in quantization_blocks(runs) {
        let step = values[b.clone()].iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        out[b].iter_mut().for_each(|h| *h = step / 2.0);
    }
    out
}

#[test]
fn every_value_comes_back_within_half_a_step_of_its_block() {
    let (block, ranks) = (RUNS.iter().sum::<usize>(), 3);
    let mine: Vec<Vec<f32>> = (0..ranks)
        .map(|r| values(block).iter().map(|v| v * (r + 1) as f32).collect())
        .collect();
    let wire: Vec<u8> = mine.iter().flat_map(|m| encode(m, &RUNS)).collect();
    assert_eq!(wire.len(), ranks * encoded_len(&RUNS));
    assert!(
        encoded_len(&RUNS) < block + block / 32 + 16,
        "scales about 3%"
    );
    for dtype in [DType::F32, DType::BF16] {
        let got = decode_gathered(&Buffer::U8(wire.clone()), &RUNS, ranks, dtype).unwrap();
        let got = as_f32(got);
        for (r, m) in mine.iter().enumerate() {
            // bf16's own rounding on top of the int8 step.
            let slack = if dtype == DType::BF16 {
                1.0 / 128.0
            } else {
                1e-6
            };
            for (i, (v, h)) in m.iter().zip(half_steps(m, &RUNS)).enumerate() {
                let g = got[r * block + i];
                let bound = h * (1.0 + 1e-5) + v.abs() * slack;
                assert!((g - v).abs() <= bound, "rank {r} element {i}: {g} for {v}");
            }
        }
    }
    // A block of zeros comes back as zeros.
    let zeros = decode_gathered(
        &Buffer::U8(encode(&[0.0; 700], &[700])),
        &[700],
        1,
        DType::F32,
    );
    assert!(as_f32(zeros.unwrap()).iter().all(|v| *v == 0.0));
}

#[test]
fn a_small_parameter_beside_a_large_one_keeps_its_own_scale() {
    // A bias of 1e-4 after a weight of 1: in one block its values would round to zero.
    let runs = [300, 12];
    let v: Vec<f32> = (0..312)
        .map(|i| {
            if i < 300 {
                1.0 - i as f32 / 300.0
            } else {
                1e-4 * (i - 299) as f32
            }
        })
        .collect();
    let got =
        as_f32(decode_gathered(&Buffer::U8(encode(&v, &runs)), &runs, 1, DType::F32).unwrap());
    // Half a step of the bias's own scale (1.2e-3 / 127), where a shared block's would be
    // half of 1 / 127 and round every value to zero.
    let half_step = 1.2e-3 / 127.0 / 2.0 * (1.0 + 1e-5);
    for i in 300..312 {
        assert!((got[i] - v[i]).abs() <= half_step, "{}: {}", v[i], got[i]);
    }
}

#[test]
fn a_non_finite_weight_dequantizes_to_nan_in_its_block_only() {
    let mut v = values(2 * BLOCK);
    v[3] = f32::INFINITY;
    let runs = [v.len()];
    let got = decode_gathered(&Buffer::U8(encode(&v, &runs)), &runs, 1, DType::F32).unwrap();
    let got = as_f32(got);
    assert!(got[..BLOCK].iter().all(|x| x.is_nan()));
    assert!(got[BLOCK..].iter().all(|x| x.is_finite()));
}

#[test]
fn a_mean_of_parts_is_the_mean_of_the_rounded_values_in_f32() {
    let (k, ranks) = (RUNS.iter().sum::<usize>(), 3);
    // Rank r's gradient of `ranks` parts; this rank (1) receives part 1 of each.
    let grads: Vec<Vec<f32>> = (0..ranks)
        .map(|r| {
            values(k * ranks)
                .iter()
                .map(|v| v * (r as f32 - 0.7))
                .collect()
        })
        .collect();
    let mine = 1;
    let part = encoded_len(&RUNS);
    let wire: Vec<u8> = grads
        .iter()
        .flat_map(|g| encode_parts(g, &RUNS, ranks)[mine * part..(mine + 1) * part].to_vec())
        .collect();
    let got = mean_of_parts(&wire, &RUNS, ranks, 1).unwrap();
    // Each contribution is within half its block's step; the mean within the mean of
    // those half-steps.
    let mut bound = vec![0f32; k];
    for g in &grads {
        for (b, h) in bound
            .iter_mut()
            .zip(half_steps(&g[mine * k..(mine + 1) * k], &RUNS))
        {
            *b += h / ranks as f32;
        }
    }
    for i in 0..k {
        let exact: f32 = grads.iter().map(|g| g[mine * k + i]).sum::<f32>() / ranks as f32;
        assert!(
            (got[i] - exact).abs() <= bound[i] * (1.0 + 1e-4) + 1e-7,
            "element {i}: {} for {exact} (bound {})",
            got[i],
            bound[i]
        );
    }
    // Empty parts and a non-finite contribution.
    assert!(mean_of_parts(&[], &[0], 4, 1).unwrap().is_empty());
    let mut bad = values(4);
    bad[2] = f32::NAN;
    let got = mean_of_parts(&encode_parts(&bad, &[4], 1), &[4], 1, 1).unwrap();
    assert!(got.iter().all(|v| v.is_nan()));
    let e = mean_of_parts(&[0; 7], &[8], 2, 1).unwrap_err();
    assert!(e.contains("7 bytes arrived for 2 parts"), "{e}");
}

#[test]
fn means_of_several_blocks_are_each_blocks_mean_over_its_senders() {
    let (k, part) = (RUNS.iter().sum::<usize>(), encoded_len(&RUNS));
    let (members, blocks) = (2, 3);
    let sent: Vec<Vec<u8>> = (0..members)
        .map(|s| {
            let g: Vec<f32> = values(k * blocks)
                .iter()
                .map(|v| v * (s as f32 + 0.5))
                .collect();
            encode_parts(&g, &RUNS, blocks)
        })
        .collect();
    let got = mean_of_parts(&sent.concat(), &RUNS, members, blocks).unwrap();
    assert_eq!(got.len(), k * blocks);
    for b in 0..blocks {
        let one: Vec<u8> = sent
            .iter()
            .flat_map(|s| s[b * part..(b + 1) * part].to_vec())
            .collect();
        let want = mean_of_parts(&one, &RUNS, members, 1).unwrap();
        assert_eq!(&got[b * k..(b + 1) * k], &want[..], "block {b}");
    }
}

/// Both codecs on runs of odd lengths (a nibble left over, a block's tail): every value
/// back within half its block's step (its largest magnitude over the largest level),
/// a non-finite value poisoning its block only, int4 taking a little over half int8's
/// bytes, and a mean of parts equal to the mean of the decoded parts.
#[test]
fn both_widths_round_trip_within_half_a_step_on_odd_runs() {
    for codec in [Codec::INT8, Codec::INT4] {
        let b = codec.block;
        let runs = [2 * b + 11, 67, b, 1];
        let k: usize = runs.iter().sum();
        let v: Vec<f32> = (0..k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0 * if i % 3 == 0 { 1e-3 } else { 1.0 })
            .collect();
        // Within half a step of each block; subnormal blocks too (their step's inverse
        // overflows f32), where the step itself is rounded to a multiple of 2^-149.
        let round_trips = |v: &[f32], slack: f32| {
            let wire = codec.encode(v, &runs);
            assert_eq!(wire.len(), codec.encoded_len(&runs));
            let got = as_f32(
                codec
                    .decode_gathered(&Buffer::U8(wire), &runs, 1, DType::F32)
                    .unwrap(),
            );
            for (values, _) in codec.spans(&runs) {
                for blk in values
                    .clone()
                    .step_by(b)
                    .map(|s| s..(s + b).min(values.end))
                {
                    let amax = v[blk.clone()].iter().fold(0f32, |m, x| m.max(x.abs()));
                    let half = amax / codec.levels() / 2.0 * (1.0 + 1e-5) + slack;
                    for i in blk {
                        assert!(
                            (got[i] - v[i]).abs() <= half,
                            "{codec:?} {i}: {} for {}",
                            got[i],
                            v[i]
                        );
                    }
                }
            }
        };
        round_trips(&v, 0.0);
        let subnormal: Vec<f32> = v.iter().map(|x| x * 1e-40).collect();
        assert!(subnormal.iter().all(|x| !x.is_normal()));
        round_trips(&subnormal, 8.0 * f32::from_bits(1) * codec.levels());
        let mut bad = v.clone();
        bad[b + 3] = f32::NAN;
        let got = as_f32(
            codec
                .decode_gathered(&Buffer::U8(codec.encode(&bad, &runs)), &runs, 1, DType::F32)
                .unwrap(),
        );
        assert!(got[b..2 * b].iter().all(|x| x.is_nan()), "{codec:?}");
        assert!(
            got[..b].iter().chain(&got[2 * b..]).all(|x| x.is_finite()),
            "{codec:?}"
        );
        // Two senders' parts: the mean of what each decodes to.
        let w: Vec<f32> = v.iter().map(|x| -0.5 * x).collect();
        let both = [codec.encode(&v, &runs), codec.encode(&w, &runs)].concat();
        let mean = codec.mean_of_parts(&both, &runs, 2, 1).unwrap();
        let decoded = |e: &[u8]| {
            as_f32(
                codec
                    .decode_gathered(&Buffer::U8(e.to_vec()), &runs, 1, DType::F32)
                    .unwrap(),
            )
        };
        let (a, c) = (
            decoded(&both[..both.len() / 2]),
            decoded(&both[both.len() / 2..]),
        );
        for i in 0..k {
            assert_eq!(mean[i], (a[i] + c[i]) / 2.0, "{codec:?} {i}");
        }
    }
    let (eight, four) = (
        Codec::INT8.encoded_len(&[4096]),
        Codec::INT4.encoded_len(&[4096]),
    );
    assert_eq!((eight, four), (4096 + 32 * 4, 2048 + 32 * 4));
}

#[test]
fn bytes_of_the_wrong_length_or_type_are_refused() {
    let e = decode_gathered(&Buffer::U8(vec![0; 10]), &[600], 2, DType::F32).unwrap_err();
    assert!(e.contains("for 2 ranks of"), "{e}");
    let e = decode_gathered(&Buffer::F32(vec![0.0; 10]), &[8], 1, DType::F32).unwrap_err();
    assert!(e.contains("F32"), "{e}");
}
