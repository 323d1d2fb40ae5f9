//! The optimizer updates as kernels: one pass over a parameter's elements (read parameter,
//! gradient and state, write parameter and state), compiled for AVX-512 / AVX2 / the
//! baseline and chosen at run time, and split over the threads for large shards.
//!
//! Bit for bit PyTorch's single-tensor updates: the same f32 operations in the same order,
//! never fused (`a * b + c` stays two roundings; vector `sqrt` and division are correctly
//! rounded like the scalar ones), so the lanes and threads change the speed, not the bits.

use fsdp_nn::multiversion;

/// Shards below this many elements are updated on the calling thread (a thread costs more
/// than the pass).
const PARALLEL_MIN: usize = 1 << 18;

/// Threads split a shard at multiples of this many elements (whole cache lines per thread).
const SPLIT_ALIGN: usize = 16;

/// The scalars of one Adam-family update, formed as PyTorch forms them (double precision,
/// rounded to f32 once).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AdamScalars {
    /// `1 - beta1`: the weight of `exp_avg.lerp_(grad, 1 - beta1)`.
    pub w1: f32,
    /// `beta2`.
    pub b2: f32,
    /// `1 - beta2`.
    pub w2: f32,
    /// AdamW's `1 - lr * weight_decay` (1 for Adam).
    pub shrink: f32,
    /// Adam's L2 weight decay added to the gradient (0 for AdamW).
    pub l2: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// Denominator epsilon.
    pub eps: f32,
}

/// The settings of one SGD update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SgdScalars {
    pub lr: f32,
    pub weight_decay: f32,
    pub momentum: f32,
    /// `1 - dampening`.
    pub damp: f32,
    pub nesterov: bool,
    /// The momentum buffer does not exist yet: it starts as the (decayed) gradient.
    pub first: bool,
}

/// One Adam-family update of `param` with `grad`, moments `m` (`exp_avg`) and `v`
/// (`exp_avg_sq`), all of one length.
pub(crate) fn adam(param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], k: AdamScalars) {
    let n = param.len();
    assert!(
        grad.len() == n && m.len() == n && v.len() == n,
        "adam kernel: lengths"
    );
    let per = part_len(n);
    let parts =
        (param.chunks_mut(per).zip(grad.chunks(per))).zip(m.chunks_mut(per).zip(v.chunks_mut(per)));
    on_threads(parts, |((p, g), (m, v))| adam_pass(p, g, m, v, k));
}

/// One SGD update of `param` with `grad` and, with momentum, `buf` (`momentum_buffer`; empty
/// without momentum).
pub(crate) fn sgd(param: &mut [f32], grad: &[f32], buf: &mut [f32], k: SgdScalars) {
    let n = param.len();
    let with_buf = k.momentum != 0.0;
    assert!(
        grad.len() == n && (!with_buf || buf.len() == n),
        "sgd kernel: lengths"
    );
    let per = part_len(n);
    // Without momentum every part gets an empty buffer.
    let bufs =
        (buf.chunks_mut(per).filter(|_| with_buf).map(Some)).chain(std::iter::repeat_with(|| None));
    let parts = param.chunks_mut(per).zip(grad.chunks(per)).zip(bufs);
    on_threads(parts, |((p, g), b)| sgd_pass(p, g, b.unwrap_or(&mut []), k));
}

/// How many elements each thread updates: candle's thread count (the one the matrix products
/// use) splits the shard at whole cache lines; shards too small to be worth a thread are one
/// part.
fn part_len(n: usize) -> usize {
    let threads = if n < PARALLEL_MIN {
        1
    } else {
        candle_core::utils::get_num_threads().clamp(1, n / (PARALLEL_MIN / 2))
    };
    if threads == 1 {
        return n.max(1);
    }
    n.div_ceil(threads).div_ceil(SPLIT_ALIGN) * SPLIT_ALIGN
}

/// Runs `pass` on each part, one thread per part (the calling thread takes the first).
fn on_threads<T: Send>(mut parts: impl Iterator<Item = T>, pass: impl Fn(T) + Sync) {
    let Some(first) = parts.next() else {
        return;
    };
    let Some(second) = parts.next() else {
        return pass(first);
    };
    let pass = &pass;
    std::thread::scope(|s| {
        for part in std::iter::once(second).chain(parts) {
            s.spawn(move || pass(part));
        }
        pass(first);
    });
}

/// The Adam pass on one range, with the loop-invariant choices (L2 term, shrink) taken out of
/// the loop so it vectorises.
fn adam_pass(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: AdamScalars) {
    match (k.l2 != 0.0, k.shrink != 1.0) {
        (false, false) => adam_plain(p, g, m, v, k),
        (false, true) => adam_decoupled(p, g, m, v, k),
        (true, _) => adam_l2(p, g, m, v, k),
    }
}

multiversion! {
    /// AdamW or Adam without weight decay.
    fn adam_plain(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: AdamScalars) {
        adam_loop::<false, false>(p, g, m, v, k)
    }
}

multiversion! {
    /// AdamW with weight decay.
    fn adam_decoupled(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: AdamScalars) {
        adam_loop::<false, true>(p, g, m, v, k)
    }
}

multiversion! {
    /// Adam with L2 weight decay.
    fn adam_l2(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: AdamScalars) {
        adam_loop::<true, false>(p, g, m, v, k)
    }
}

/// PyTorch's single-tensor Adam/AdamW on f32, element by element.
#[inline(always)]
fn adam_loop<const L2: bool, const SHRINK: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: AdamScalars,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        // `grad.add(param, alpha=wd)` (Adam) before the moments.
        let gi = if L2 { g[i] + k.l2 * p[i] } else { g[i] };
        // `param.mul_(1 - lr * wd)` (AdamW).
        let pi = if SHRINK { p[i] * k.shrink } else { p[i] };
        // `exp_avg.lerp_(grad, 1 - beta1)` with weight < 0.5: m + w (g - m).
        let mi = m[i] + k.w1 * (gi - m[i]);
        // `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`.
        let vi = v[i] * k.b2 + k.w2 * gi * gi;
        // `(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`.
        let denom = vi.sqrt() / k.bc2_sqrt + k.eps;
        // `param.addcdiv_(exp_avg, denom, value=-step_size)`.
        p[i] = pi - k.step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

multiversion! {
    /// PyTorch's single-tensor SGD on f32 (weight decay, momentum with dampening, Nesterov).
    fn sgd_pass(p: &mut [f32], g: &[f32], buf: &mut [f32], k: SgdScalars) {
        let n = p.len();
        let g = &g[..n];
        if k.momentum == 0.0 {
            for i in 0..n {
                let d = if k.weight_decay != 0.0 { g[i] + k.weight_decay * p[i] } else { g[i] };
                p[i] -= k.lr * d;
            }
            return;
        }
        let buf = &mut buf[..n];
        for i in 0..n {
            let d = if k.weight_decay != 0.0 { g[i] + k.weight_decay * p[i] } else { g[i] };
            let b = if k.first { d } else { buf[i] * k.momentum + k.damp * d };
            buf[i] = b;
            let d = if k.nesterov { d + k.momentum * b } else { b };
            p[i] -= k.lr * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The element-by-element Adam of PyTorch, written plainly: what the kernel must equal.
    fn adam_reference(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: AdamScalars) {
        for i in 0..p.len() {
            let gi = if k.l2 != 0.0 {
                g[i] + k.l2 * p[i]
            } else {
                g[i]
            };
            if k.shrink != 1.0 {
                p[i] *= k.shrink;
            }
            m[i] += k.w1 * (gi - m[i]);
            v[i] = v[i] * k.b2 + k.w2 * gi * gi;
            let denom = v[i].sqrt() / k.bc2_sqrt + k.eps;
            p[i] -= k.step_size * m[i] / denom;
        }
    }

    fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut rng = crate::rng::XorShift64::seeded(seed);
        (0..n)
            .map(|_| {
                let x = rng.next_u64();
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }

    fn scalars(l2: f32, shrink: f32) -> AdamScalars {
        AdamScalars {
            w1: (1.0 - 0.9f64) as f32,
            b2: 0.999,
            w2: (1.0 - 0.999f64) as f32,
            shrink,
            l2,
            step_size: (1e-3 / (1.0 - 0.9f64.powi(3))) as f32,
            bc2_sqrt: (1.0 - 0.999f64.powi(3)).sqrt() as f32,
            eps: 1e-8,
        }
    }

    #[test]
    fn adam_kernel_equals_the_plain_update_bit_for_bit_across_lanes_and_threads() {
        // Lengths below, at and above the thread split, and not multiples of any lane count.
        for n in [1, 7, 33, 1000, PARALLEL_MIN - 1, PARALLEL_MIN * 3 + 5] {
            for (l2, shrink) in [(0.0, 1.0), (0.0, 1.0 - 1e-5), (0.01, 1.0)] {
                let k = scalars(l2, shrink);
                let (p0, g) = (noise(n, 1, 2.0), noise(n, 2, 1e-2));
                let (m0, v0) = (
                    noise(n, 3, 1e-3),
                    noise(n, 4, 1e-6)
                        .iter()
                        .map(|x| x.abs())
                        .collect::<Vec<_>>(),
                );
                let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                let (mut rp, mut rm, mut rv) = (p0, m0, v0);
                adam(&mut p, &g, &mut m, &mut v, k);
                adam_reference(&mut rp, &g, &mut rm, &mut rv, k);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&p), bits(&rp), "param, n={n} l2={l2} shrink={shrink}");
                assert_eq!(bits(&m), bits(&rm), "exp_avg, n={n}");
                assert_eq!(bits(&v), bits(&rv), "exp_avg_sq, n={n}");
            }
        }
    }

    #[test]
    fn sgd_kernel_equals_the_plain_update_bit_for_bit() {
        let n = PARALLEL_MIN * 2 + 3;
        for (momentum, nesterov, first, wd) in [
            (0.0, false, true, 0.0),
            (0.0, false, true, 0.1),
            (0.9, false, true, 0.01),
            (0.9, false, false, 0.01),
            (0.9, true, false, 0.0),
        ] {
            let k = SgdScalars {
                lr: 0.05,
                weight_decay: wd,
                momentum,
                damp: 0.75,
                nesterov,
                first,
            };
            let (p0, g, b0) = (noise(n, 5, 1.0), noise(n, 6, 0.1), noise(n, 7, 0.1));
            let (mut p, mut b) = (
                p0.clone(),
                if momentum != 0.0 { b0.clone() } else { vec![] },
            );
            sgd(&mut p, &g, &mut b, k);
            let (mut rp, mut rb) = (p0, b0);
            for i in 0..n {
                let mut d = if wd != 0.0 { g[i] + wd * rp[i] } else { g[i] };
                if momentum != 0.0 {
                    rb[i] = if first {
                        d
                    } else {
                        rb[i] * momentum + 0.75 * d
                    };
                    d = if nesterov {
                        d + momentum * rb[i]
                    } else {
                        rb[i]
                    };
                }
                rp[i] -= 0.05 * d;
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&p),
                bits(&rp),
                "momentum={momentum} nesterov={nesterov}"
            );
            if momentum != 0.0 {
                assert_eq!(bits(&b), bits(&rb));
            }
        }
    }
}
