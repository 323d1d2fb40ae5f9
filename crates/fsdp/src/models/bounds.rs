//! Bounds on the sizes a model's configuration declares (a `config.json`, a GGUF file's
//! metadata, an estimate's input), checked before anything is built from them: a crafted
//! `block_count` of 2^40 or a width of 2^40 is an error naming the key, its value and the
//! bytes the model would need against the memory present, never an allocation that aborts
//! the process; an epsilon that is not positive is refused too.

use candle_core::Result;

/// A model is refused when its f32 parameters would need more than this many times the
/// machine's memory: sharding over many machines and offloading to disk let a job train a
/// model larger than one machine's memory, but not by three orders of magnitude.
const MEMORY_MULTIPLE: u128 = 1024;
/// The largest width, vocabulary or context length accepted (2^31: indices are 32-bit).
const MAX_SIZE: usize = 1 << 31;
/// The most layers accepted (the deepest published models have a few hundred).
pub(crate) const MAX_LAYERS: usize = 1 << 16;

fn bail(model: &str, msg: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("{model} config: {msg}"))
}

/// Checks `model`'s sizes (`(key, value, most)`, `most` defaulting to [`MAX_SIZE`]), its
/// parameter count `params` (computed in u128 from sizes within bounds, so it cannot wrap)
/// against the memory present, and its normalisation epsilon (`(key, value)`).
pub(crate) fn check(
    model: &str,
    sizes: &[(&str, usize, Option<usize>)],
    params: impl FnOnce() -> u128,
    epsilon: (&str, f64),
) -> Result<()> {
    for &(key, value, most) in sizes {
        let most = most.unwrap_or(MAX_SIZE);
        if value > most {
            return Err(bail(
                model,
                format!(
                    "`{key}` is {value}, more than any model has (at most {most} accepted): a crafted or damaged configuration"
                ),
            ));
        }
    }
    let (eps_key, eps) = epsilon;
    if !(eps.is_finite() && eps > 0.0) {
        return Err(bail(
            model,
            format!("`{eps_key}` is {eps}: a normalisation epsilon must be a positive number"),
        ));
    }
    let bytes = params().saturating_mul(4);
    let memory = crate::memory::physical_memory_bytes().unwrap_or(1 << 30) as u128;
    if bytes > memory.saturating_mul(MEMORY_MULTIPLE) {
        let (key, value, _) = sizes
            .iter()
            .max_by_key(|(_, v, _)| *v)
            .copied()
            .unwrap_or(("?", 0, None));
        return Err(bail(
            model,
            format!(
                "its sizes make {} parameters, {} in f32, where this machine has {} of memory (more than {MEMORY_MULTIPLE} times that is refused); its largest size is `{key}` = {value}: a crafted or damaged configuration",
                bytes / 4,
                human(bytes),
                human(memory)
            ),
        ));
    }
    Ok(())
}

/// `bytes` in binary units.
fn human(bytes: u128) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < units.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", units[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_memory_and_epsilon_are_bounded_naming_the_key() {
        let ok = check("toy", &[("hidden_size", 64, None)], || 4096, ("eps", 1e-5));
        assert!(ok.is_ok());
        let e = check(
            "toy",
            &[("block_count", 1 << 40, Some(MAX_LAYERS))],
            || 0,
            ("eps", 1e-5),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`block_count` is 1099511627776"), "{e}");
        let e = check(
            "toy",
            &[
                ("vocab_size", 1 << 30, None),
                ("hidden_size", 1 << 29, None),
            ],
            || (1u128 << 30) * (1 << 30),
            ("eps", 1e-5),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("4.0 EiB in f32") && e.contains("of memory") && e.contains("`vocab_size`"),
            "{e}"
        );
        for eps in [-1.0, 0.0, f64::NAN, f64::INFINITY] {
            let e = check("toy", &[], || 1, ("rms_norm_eps", eps))
                .unwrap_err()
                .to_string();
            assert!(e.contains("`rms_norm_eps`"), "{e}");
        }
    }
}
