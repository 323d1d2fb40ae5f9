//! The PyTorch FSDP reference run the anchored numerics tests reproduce: by default the one in
//! `tests/data/reference` (written by `tools/make_reference_fixture.py`, part of every clone);
//! `FSDP_REFERENCE_DIR` names another folder of the same layout, such as the larger
//! `../shared/reference` (hidden 256, 4 layers, lr 1e-4) it was modelled on.

use std::path::{Path, PathBuf};

use fsdp::models::BertConfig;
use fsdp::optim::{AdamW, AdamWConfig};

/// The reference run's folder.
pub fn dir() -> PathBuf {
    match std::env::var_os("FSDP_REFERENCE_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference"),
    }
}

/// The model's config, from `init.safetensors`'s metadata.
pub fn config() -> BertConfig {
    let bytes = std::fs::read(dir().join("init.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let json = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("config"))
        .expect("config in metadata")
        .clone();
    BertConfig::from_json(&json).unwrap()
}

/// `losses.json`.
pub fn losses() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("losses.json")).unwrap()).unwrap()
}

/// The per-step losses of run `key` (`fsdp_full_shard_2_ranks`, `single_process_batch_16`).
pub fn losses_of(key: &str) -> Vec<f64> {
    losses()[key]
        .as_array()
        .unwrap_or_else(|| panic!("losses.json has no `{key}`"))
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

/// The run's AdamW: `losses.json`'s `optimizer` settings (the shared run, which has none,
/// used lr 1e-4; both decay every parameter by 0.01).
pub fn adamw() -> AdamW {
    let o = &losses()["optimizer"];
    let f = |k: &str, default: f64| o[k].as_f64().unwrap_or(default);
    let betas = (
        o["betas"][0].as_f64().unwrap_or(0.9),
        o["betas"][1].as_f64().unwrap_or(0.999),
    );
    AdamW::new(AdamWConfig {
        lr: f("lr", 1e-4),
        betas,
        eps: f("eps", 1e-8),
        weight_decay: f("weight_decay", 0.01),
    })
    .unwrap()
}
