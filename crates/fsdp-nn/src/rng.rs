//! The seeded generators fsdp-rs draws from — initial weights, dropout masks, the epoch's
//! sample order, sampling in generation — and that its tests and benchmarks make data with:
//! small, fast, the same on every rank, run and platform (none of them is for secrets).

/// 2⁶⁴ divided by the golden ratio: the increment of SplitMix64's counter and the multiplier
/// that spreads a small seed over all 64 bits.
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (Steele, Lea and Flood): a bijection of `z` whose every
/// output bit depends on every input bit, so consecutive counters give independent-looking
/// values.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `x`'s top 53 bits as a float in [0, 1): every value of the grid equally likely.
#[inline]
pub fn unit_f64(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// The SplitMix64 stream: a counter advanced by [`GOLDEN_GAMMA`] and mixed by [`mix64`].
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The stream whose counter starts at `state` (the first value is `mix64(state + γ)`).
    pub fn new(state: u64) -> SplitMix64 {
        SplitMix64 { state }
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }
}

/// Marsaglia's xorshift64 (shifts 13, 7, 17): one multiply-free step per value, for data that
/// needs to be arbitrary rather than good.
#[derive(Debug, Clone)]
pub struct XorShift64 {
    state: u64,
}

impl XorShift64 {
    /// The generator at raw `state` (not zero: zero stays zero).
    pub fn new(state: u64) -> XorShift64 {
        XorShift64 { state }
    }

    /// The generator for `seed`, any value (spread over 64 bits, never zero).
    pub fn seeded(seed: u64) -> XorShift64 {
        XorShift64::new(seed.wrapping_mul(GOLDEN_GAMMA) | 1)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state
    }

    /// The next value's top 53 bits as a float in [0, 1).
    pub fn next_unit(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }
}

/// FNV-1a's offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a (64-bit) of `text` from `basis`.
fn fnv1a_from(basis: u64, text: &str) -> u64 {
    text.bytes()
        .fold(basis, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// FNV-1a (64-bit) of `text`: a parameter's name as the key of its own stream.
pub fn fnv1a(text: &str) -> u64 {
    fnv1a_from(FNV_OFFSET, text)
}

/// A seed per (step seed, call site): FNV-1a of the site's name over the seed, so every
/// dropout site draws its own mask.
pub fn site_seed(seed: u64, site: &str) -> u64 {
    fnv1a_from(seed ^ FNV_OFFSET, site)
}

/// A seeded normal generator (xorshift64* + Box-Muller) so initial weights are the same on
/// every rank and every run.
pub struct NormalRng {
    state: u64,
    spare: Option<f64>,
}

impl NormalRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> NormalRng {
        NormalRng {
            state: seed.wrapping_mul(GOLDEN_GAMMA) ^ 0xD1B5_4A32_D192_ED03 | 1,
            spare: None,
        }
    }

    /// A uniform sample in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let x = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// A standard normal sample.
    pub fn normal(&mut self) -> f64 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some(r * theta.sin());
        r * theta.cos()
    }
}

/// Whether element `index` survives dropout with probability `p` under `seed`: SplitMix64 of
/// (seed, index), a counter-based draw, so any element's is known without drawing the others
/// (the dropout and attention ops regenerate their masks in backward).
#[inline]
pub(crate) fn dropout_keep(seed: u64, index: u64, p: f64) -> bool {
    unit_f64(mix64(seed ^ index.wrapping_mul(GOLDEN_GAMMA))) >= p
}

/// [`dropout_keep`]'s test in integers: a draw's top 53 bits (exact as f64) divided by 2⁵³
/// (exact) is at least `p` exactly when they are at least `⌈p · 2⁵³⌉`.
pub(crate) fn dropout_threshold(p: f64) -> u64 {
    (p * (1u64 << 53) as f64).ceil() as u64
}

crate::multiversion! {
    /// [`dropout_keep`] of elements `first..first + keep.len()` under `seed`, with the
    /// probability's [`dropout_threshold`]: the same draws, many lanes at a time.
    fn dropout_keep_into(seed: u64, first: u64, threshold: u64, keep: &mut [bool]) {
        for (j, k) in keep.iter_mut().enumerate() {
            let index = first.wrapping_add(j as u64);
            *k = mix64(seed ^ index.wrapping_mul(GOLDEN_GAMMA)) >> 11 >= threshold;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer test keeps exactly the elements the float one does, at probabilities
    /// whose threshold is and is not a whole number, and across index wrap-around.
    #[test]
    fn dropout_keep_into_draws_what_dropout_keep_draws() {
        let mut keep = vec![false; 301];
        for p in [1e-12, 0.1, 0.25, 0.5, 0.9, 1.0 - 1e-9] {
            for seed in [0, 7, 0xDEAD_BEEF_u64 << 20] {
                for first in [0, 12_345, u64::MAX - 150] {
                    dropout_keep_into(seed, first, dropout_threshold(p), &mut keep);
                    for (j, &k) in keep.iter().enumerate() {
                        let want = dropout_keep(seed, first.wrapping_add(j as u64), p);
                        assert_eq!(k, want, "p {p} seed {seed} element {first} + {j}");
                    }
                }
            }
        }
        // Boundary: a draw whose top 53 bits are exactly the threshold is kept.
        let p = 0.5;
        assert_eq!(dropout_threshold(p), 1 << 52);
        assert!(unit_f64(1 << 63) >= p && unit_f64((1 << 63) - (1 << 11)) < p);
    }
}
