//! f32 element-wise kernels, and the bf16 <-> f32 conversions around them in mixed precision,
//! written so the compiler vectorises them (no calls, no branches in the loops: `exp` by range
//! reduction and a polynomial, `erf` by Abramowitz-Stegun 7.1.26), compiled for AVX-512,
//! AVX2+FMA and the baseline, and chosen at run time.
//!
//! Accuracy (tested): `exp` within 2.5e-7 relative over its range (exactly 0 below -87.3);
//! `erf` within 1e-6 absolute (Abramowitz-Stegun's 1.5e-7 plus f32 rounding; PyTorch's
//! vectorised CPU erf uses the same formula); GELU within 2e-7 of max(|x|, 1).

/// `a * b + c`, fused into one instruction in the FMA builds (`F`); plain in the baseline,
/// where `mul_add` would be a slow library call.
#[inline(always)]
fn fma<const F: bool>(a: f32, b: f32, c: f32) -> f32 {
    if F { a.mul_add(b, c) } else { a * b + c }
}

/// Independent accumulators in reductions (vectorisable, unlike one sequential sum).
const LANES: usize = 16;

/// e^x, branch-free.
#[inline(always)]
fn exp<const F: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let c = x.clamp(-87.0, 88.0);
    let t = fma::<F>(c, LOG2E, ROUND);
    let n = t - ROUND;
    let r = fma::<F>(-n, LN2_LO, fma::<F>(-n, LN2_HI, c));
    let mut p = 1.0 / 5040.0;
    for coef in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = fma::<F>(p, r, coef);
    }
    // n sits in the low mantissa bits of t (|n| < 2^22): 2^n from integer operations only
    // (a float-to-int cast would not vectorise, as Rust's `as` saturates).
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    let e = p * scale;
    if x < -87.3 { 0.0 } else { e }
}

/// erf(x) and e^{-x^2} (the latter is needed by GELU's derivative).
#[inline(always)]
fn erf_and_gauss<const F: bool>(x: f32) -> (f32, f32) {
    let z = x.abs();
    let e = exp::<F>(-z * z);
    let t = 1.0 / fma::<F>(0.327_591_1, z, 1.0);
    let mut poly = 1.061_405_4;
    for coef in [-1.453_152_1, 1.421_413_7, -0.284_496_74, 0.254_829_6] {
        poly = fma::<F>(poly, t, coef);
    }
    let r = fma::<F>(-poly * t, e, 1.0);
    (if x < 0.0 { -r } else { r }, e)
}

/// tanh(u) = 1 - 2 / (e^{2u} + 1).
#[inline(always)]
fn tanh<const F: bool>(u: f32) -> f32 {
    1.0 - 2.0 / (exp::<F>(2.0 * u) + 1.0)
}

const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// (gelu(x), gelu'(x)), exact (erf) form.
#[inline(always)]
fn gelu_erf<const F: bool>(x: f32) -> (f32, f32) {
    let (erf, gauss) = erf_and_gauss::<F>(x * INV_SQRT_2);
    let cdf = fma::<F>(0.5, erf, 0.5);
    (x * cdf, fma::<F>(x * INV_SQRT_2PI, gauss, cdf))
}

/// (gelu(x), gelu'(x)), tanh form.
#[inline(always)]
fn gelu_tanh<const F: bool>(x: f32) -> (f32, f32) {
    let x2 = x * x;
    let inner = SQRT_2_OVER_PI * x * fma::<F>(0.044_715, x2, 1.0);
    let t = tanh::<F>(inner);
    let dinner = SQRT_2_OVER_PI * fma::<F>(3.0 * 0.044_715, x2, 1.0);
    let half = fma::<F>(0.5, t, 0.5);
    (
        x * half,
        fma::<F>(0.5 * x * fma::<F>(-t, t, 1.0), dinner, half),
    )
}

multiversion! {
    /// `out = gelu(x + bias)`, bias broadcast over rows of `bias.len()` (empty: no bias).
    fn gelu_forward(x: &[f32], bias: &[f32], out: &mut [f32], tanh_form: bool) {
        let d = if bias.is_empty() { x.len().max(1) } else { bias.len() };
        for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
            if tanh_form {
                if bias.is_empty() {
                    xr.iter().zip(or.iter_mut()).for_each(|(&v, o)| *o = gelu_tanh::<FMA>(v).0);
                } else {
                    xr.iter().zip(bias).zip(or.iter_mut()).for_each(|((&v, &b), o)| *o = gelu_tanh::<FMA>(v + b).0);
                }
            } else if bias.is_empty() {
                xr.iter().zip(or.iter_mut()).for_each(|(&v, o)| *o = gelu_erf::<FMA>(v).0);
            } else {
                xr.iter().zip(bias).zip(or.iter_mut()).for_each(|((&v, &b), o)| *o = gelu_erf::<FMA>(v + b).0);
            }
        }
    }
}

multiversion! {
    /// `dx = g * gelu'(x + bias)`; with a bias, also its gradient (column sums of `dx`,
    /// accumulated in f64) into `dbias`.
    fn gelu_backward(x: &[f32], bias: &[f32], g: &[f32], dx: &mut [f32], dbias: &mut [f64], tanh_form: bool) {
        let d = if bias.is_empty() { x.len().max(1) } else { bias.len() };
        for ((xr, gr), dr) in x.chunks(d).zip(g.chunks(d)).zip(dx.chunks_mut(d)) {
            if bias.is_empty() {
                if tanh_form {
                    for ((&v, &gv), o) in xr.iter().zip(gr).zip(dr.iter_mut()) {
                        *o = gv * gelu_tanh::<FMA>(v).1;
                    }
                } else {
                    for ((&v, &gv), o) in xr.iter().zip(gr).zip(dr.iter_mut()) {
                        *o = gv * gelu_erf::<FMA>(v).1;
                    }
                }
            } else {
                if tanh_form {
                    for (((&v, &b), &gv), o) in xr.iter().zip(bias).zip(gr).zip(dr.iter_mut()) {
                        *o = gv * gelu_tanh::<FMA>(v + b).1;
                    }
                } else {
                    for (((&v, &b), &gv), o) in xr.iter().zip(bias).zip(gr).zip(dr.iter_mut()) {
                        *o = gv * gelu_erf::<FMA>(v + b).1;
                    }
                }
                for (acc, &v) in dbias.iter_mut().zip(dr.iter()) {
                    *acc += v as f64;
                }
            }
        }
    }
}

/// (silu(g), silu'(g)): `g σ(g)` and `σ(g) (1 + g (1 - σ(g)))`, σ through the branch-free
/// `exp` (exactly 0 and 1 in its tails).
#[inline(always)]
fn silu<const F: bool>(g: f32) -> (f32, f32) {
    let s = 1.0 / (1.0 + exp::<F>(-g));
    (g * s, s * fma::<F>(g, 1.0 - s, 1.0))
}

multiversion! {
    /// `out = silu(gate) * up`.
    fn swiglu_forward(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((&g, &u), o) in gate.iter().zip(up).zip(out.iter_mut()) {
            *o = silu::<FMA>(g).0 * u;
        }
    }
}

multiversion! {
    /// `dgate = dy * up * silu'(gate)`, `dup = dy * silu(gate)`.
    fn swiglu_backward(gate: &[f32], up: &[f32], dy: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
        for (((&g, &u), &d), (dg, du)) in gate.iter().zip(up).zip(dy).zip(dgate.iter_mut().zip(dup.iter_mut())) {
            let (s, ds) = silu::<FMA>(g);
            *dg = d * u * ds;
            *du = d * s;
        }
    }
}

multiversion! {
    /// Softmax of each row of `s` (length `d`) in place, keeping each row's log-sum-exp (so a
    /// backward pass can recompute the probabilities instead of storing them).
    fn softmax_rows_in_place(s: &mut [f32], lse: &mut [f64], d: usize) {
        let d = d.max(1);
        for (row, l) in s.chunks_mut(d).zip(lse.iter_mut()) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            row.iter_mut().for_each(|v| *v = exp::<FMA>(*v - max));
            let mut acc = [0f32; LANES];
            for chunk in row.chunks(LANES) {
                for (a, &v) in acc.iter_mut().zip(chunk) {
                    *a += v;
                }
            }
            let sum = acc.iter().sum::<f32>();
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|v| *v *= inv);
            *l = max as f64 + (sum as f64).ln();
        }
    }
}

multiversion! {
    /// `s = exp(s - lse)` per row of length `d`: probabilities from scores and saved
    /// log-sum-exps.
    fn exp_rows_minus(s: &mut [f32], lse: &[f64], d: usize) {
        let d = d.max(1);
        for (row, &l) in s.chunks_mut(d).zip(lse) {
            let l = l as f32;
            row.iter_mut().for_each(|v| *v = exp::<FMA>(*v - l));
        }
    }
}

multiversion! {
    /// Softmax backward per row: `dx = y * (g - sum(g * y))`.
    fn softmax_rows_backward(y: &[f32], g: &[f32], dx: &mut [f32], d: usize) {
        let d = d.max(1);
        for ((yr, gr), dr) in y.chunks(d).zip(g.chunks(d)).zip(dx.chunks_mut(d)) {
            let mut acc = [0f32; LANES];
            for (yc, gc) in yr.chunks(LANES).zip(gr.chunks(LANES)) {
                for ((a, &yv), &gv) in acc.iter_mut().zip(yc).zip(gc) {
                    *a += yv * gv;
                }
            }
            let dot: f32 = acc.iter().sum();
            for ((o, &yv), &gv) in dr.iter_mut().zip(yr).zip(gr) {
                *o = yv * (gv - dot);
            }
        }
    }
}

/// Sum of a row with `LANES` independent accumulators.
#[inline(always)]
fn row_sum(row: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    for chunk in row.chunks(LANES) {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += f(v);
        }
    }
    acc.iter().sum()
}

multiversion! {
    /// LayerNorm (`center`) or RMSNorm of each row of length `d`: `(x - mean) * rstd * gamma
    /// (+ beta)`; `beta` empty for none.
    fn norm_rows(x: &[f32], gamma: &[f32], beta: &[f32], y: &mut [f32], d: usize, eps: f32, center: bool) {
        let d = d.max(1);
        let n = d as f32;
        for (xr, yr) in x.chunks(d).zip(y.chunks_mut(d)) {
            let mean = if center { row_sum(xr, |v| v) / n } else { 0.0 };
            let var = row_sum(xr, |v| (v - mean) * (v - mean)) / n;
            let rstd = 1.0 / (var + eps).sqrt();
            if beta.is_empty() {
                for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(gamma) {
                    *o = (v - mean) * rstd * g;
                }
            } else {
                for (((o, &v), &g), &b) in yr.iter_mut().zip(xr).zip(gamma).zip(beta) {
                    *o = (v - mean) * rstd * g + b;
                }
            }
        }
    }
}

multiversion! {
    /// Backward of [`norm_rows`]: `dx`, and the column sums `dgamma += g * xhat`,
    /// `dbeta += g` (f64).
    fn norm_rows_backward(
        x: &[f32],
        gamma: &[f32],
        g: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f64],
        dbeta: &mut [f64],
        d: usize,
        eps: f32,
        center: bool,
    ) {
        let d = d.max(1);
        let n = d as f32;
        let mut xhat = vec![0f32; d];
        let mut dxhat = vec![0f32; d];
        for ((xr, gr), dr) in x.chunks(d).zip(g.chunks(d)).zip(dx.chunks_mut(d)) {
            let mean = if center { row_sum(xr, |v| v) / n } else { 0.0 };
            let var = row_sum(xr, |v| (v - mean) * (v - mean)) / n;
            let rstd = 1.0 / (var + eps).sqrt();
            for ((h, dh), ((&v, &gv), &ga)) in xhat.iter_mut().zip(dxhat.iter_mut()).zip(xr.iter().zip(gr).zip(gamma)) {
                *h = (v - mean) * rstd;
                *dh = gv * ga;
            }
            let sum_dxhat = row_sum(&dxhat, |v| v);
            let mut acc = [0f32; LANES];
            for (hc, dc) in xhat.chunks(LANES).zip(dxhat.chunks(LANES)) {
                for ((a, &h), &dh) in acc.iter_mut().zip(hc).zip(dc) {
                    *a += h * dh;
                }
            }
            let sum_dxhat_xhat: f32 = acc.iter().sum();
            let mean_dxhat = if center { sum_dxhat / n } else { 0.0 };
            for ((o, &h), &dh) in dr.iter_mut().zip(&xhat).zip(&dxhat) {
                *o = rstd * (dh - mean_dxhat - h * sum_dxhat_xhat / n);
            }
            for (((dga, dbe), &gv), &h) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(gr).zip(&xhat) {
                *dga += (gv * h) as f64;
                *dbe += gv as f64;
            }
        }
    }
}

/// `b` as f32: exact, a NaN made quiet; bit for bit `bf16::to_f32`, without its branch, so
/// loops over it vectorise.
#[inline(always)]
pub(super) fn bf16_as_f32(b: half::bf16) -> f32 {
    let b = u32::from(b.to_bits());
    let b = if b & 0x7fff > 0x7f80 { b | 0x40 } else { b };
    f32::from_bits(b << 16)
}

/// `x` rounded to bf16: to nearest, ties to even, a NaN kept quiet; bit for bit
/// `bf16::from_f32`, without its branches, so loops over it vectorise.
#[inline(always)]
pub(super) fn round_to_bf16(x: f32) -> half::bf16 {
    let x = x.to_bits();
    // Wraps only for NaNs, which take the other branch.
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let quiet_nan = (x >> 16) | 0x40;
    let bits = if x & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    };
    half::bf16::from_bits(bits as u16)
}

multiversion! {
    /// `src` widened to f32 into `dst` (of the same length), as [`bf16_as_f32`].
    fn bf16_to_f32(src: &[half::bf16], dst: &mut [std::mem::MaybeUninit<f32>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.write(bf16_as_f32(s));
        }
    }
}

multiversion! {
    /// `a + b` into `out` (all of one length): the widened values' sum rounded once, as
    /// `half::bf16`'s `+` does, bit for bit.
    fn bf16_add(a: &[half::bf16], b: &[half::bf16], out: &mut [std::mem::MaybeUninit<half::bf16>]) {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            o.write(round_to_bf16(bf16_as_f32(x) + bf16_as_f32(y)));
        }
    }
}

multiversion! {
    /// `src` rounded to bf16 into `dst` (of the same length, written only), as
    /// [`round_to_bf16`].
    fn f32_to_bf16_uninit(src: &[f32], dst: &mut [std::mem::MaybeUninit<half::bf16>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.write(round_to_bf16(s));
        }
    }
}

multiversion! {
    /// Dropout's survivors in f32: each of `x` where `keep` says, times `scale` in f64 and
    /// rounded to f32 (as `Float::scale_kept` element by element), zero elsewhere, into
    /// `out` (written only, as far as all three reach).
    fn scale_kept_f32(x: &[f32], keep: &[bool], scale: f64, out: &mut [std::mem::MaybeUninit<f32>]) {
        for ((o, &v), &kept) in out.iter_mut().zip(x).zip(keep) {
            let scaled = (f64::from(v) * scale) as f32;
            o.write(if kept { scaled } else { 0.0 });
        }
    }
}

/// `src` rounded to bf16 into `dst` (of the same length), as [`round_to_bf16`].
pub(crate) fn f32_to_bf16(src: &[f32], dst: &mut [half::bf16]) {
    // SAFETY: `MaybeUninit<bf16>` has bf16's layout, and the kernel writes only bf16
    // values, so `dst` stays initialised.
    let dst =
        unsafe { &mut *(dst as *mut [half::bf16] as *mut [std::mem::MaybeUninit<half::bf16>]) };
    f32_to_bf16_uninit(src, dst)
}

/// Appends to `out` the `n` elements `write` fills in (a kernel writing into the vector's
/// spare capacity: no zero fill first).
///
/// # Safety
/// `write` initialises every element of the slice it is given.
pub(crate) unsafe fn append_written<T>(
    out: &mut Vec<T>,
    n: usize,
    write: impl FnOnce(&mut [std::mem::MaybeUninit<T>]),
) {
    let start = out.len();
    out.reserve(n);
    write(&mut out.spare_capacity_mut()[..n]);
    // SAFETY: the caller vouches that `write` initialised the `n` elements past `start`.
    unsafe { out.set_len(start + n) };
}

/// `src` rounded to bf16 in a new vector, written once (no zero fill first).
pub(crate) fn bf16_vec_from_f32(src: &[f32]) -> Vec<half::bf16> {
    bf16_vec_from_parts(&[src])
}

/// `parts` one after another, rounded to bf16 in a new vector, each element written once.
pub(crate) fn bf16_vec_from_parts(parts: &[&[f32]]) -> Vec<half::bf16> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    for src in parts {
        // SAFETY: the kernel writes every element of a destination as long as `src`.
        unsafe { append_written(&mut out, src.len(), |d| f32_to_bf16_uninit(src, d)) };
    }
    out
}

/// `src` widened to f32, appended to `out` (no zero fill first).
pub(crate) fn extend_bf16_as_f32(src: &[half::bf16], out: &mut Vec<f32>) {
    // SAFETY: the kernel writes every element of a destination as long as `src`.
    unsafe { append_written(out, src.len(), |d| bf16_to_f32(src, d)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_concatenate_rounded_as_half_rounds_each_value() {
        // Ties, a carry into the exponent, subnormals, infinities and NaN; parts of lengths
        // that straddle the 16-lane kernels, one empty.
        let special = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            f32::from_bits(0x3f7f_ffff),
            1e-40,
            -1e-45,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.0,
            f32::MAX,
        ];
        let long: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let parts: [&[f32]; 4] = [&special, &[], &long, &long[..17]];
        let got = bf16_vec_from_parts(&parts);
        let want: Vec<half::bf16> = parts
            .concat()
            .into_iter()
            .map(half::bf16::from_f32)
            .collect();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "element {i}");
        }
    }

    #[test]
    fn exp_is_within_two_ulp_and_underflows_to_zero() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp::<false>(x) as f64;
            worst = worst.max(((exp::<true>(x) as f64 - want) / want).abs());
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2.5e-7, "relative error {worst:e}");
        assert_eq!(exp::<false>(-100.0), 0.0);
        assert_eq!(exp::<true>(f32::MIN), 0.0);
        assert_eq!(exp::<false>(0.0), 1.0);
    }

    #[test]
    fn erf_and_gelu_match_libm() {
        let mut worst_erf = 0f64;
        let mut worst_gelu = 0f64;
        let mut x = -8.0f32;
        while x < 8.0 {
            let xf = x as f64;
            let want = 0.5 * xf * (1.0 + libm::erf(xf / std::f64::consts::SQRT_2));
            for (erf, gelu) in [
                (erf_and_gauss::<false>(x).0, gelu_erf::<false>(x).0),
                (erf_and_gauss::<true>(x).0, gelu_erf::<true>(x).0),
            ] {
                worst_erf = worst_erf.max((erf as f64 - libm::erf(xf)).abs());
                worst_gelu = worst_gelu.max((gelu as f64 - want).abs() / xf.abs().max(1.0));
            }
            x += 0.001;
        }
        assert!(worst_erf < 1e-6, "erf error {worst_erf:e}");
        assert!(worst_gelu < 2e-7, "gelu error {worst_gelu:e}");
    }

    #[test]
    fn bf16_conversions_match_half_bit_for_bit() {
        use half::bf16;
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut wide = vec![std::mem::MaybeUninit::uninit(); all.len()];
        bf16_to_f32(&all, &mut wide);
        for (h, w) in all.iter().zip(&wide) {
            // SAFETY: bf16_to_f32 wrote every element.
            let w = unsafe { w.assume_init() };
            assert_eq!(w.to_bits(), h.to_f32().to_bits(), "{:#06x}", h.to_bits());
        }
        // f32 patterns: every sign, exponent and the mantissa bits rounding looks at (ties,
        // just above and below, odd and even results), plus a sweep of the whole range.
        let mut xs: Vec<f32> = Vec::new();
        for high in 0..=u16::MAX as u32 {
            for low in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                xs.push(f32::from_bits(high << 16 | low));
            }
        }
        xs.extend((0..1u64 << 20).map(|i| f32::from_bits((i * 4093) as u32)));
        let mut narrow = vec![bf16::ZERO; xs.len()];
        f32_to_bf16(&xs, &mut narrow);
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&bf16_vec_from_f32(&xs)), bits(&narrow));
        for (x, n) in xs.iter().zip(&narrow) {
            let want = bf16::from_f32(*x);
            assert_eq!(n.to_bits(), want.to_bits(), "{:#010x}", x.to_bits());
        }
    }
}
