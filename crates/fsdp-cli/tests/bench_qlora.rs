//! `fsdp bench qlora` on the tiny Llama shape over 2 processes: NF4 projections store and
//! all-gather the blocks' bytes (about 0.14x of f32 for the projections), the loss is finite
//! every step, and the f32 comparison run stores exactly the f32 bytes it reports.

use crate::common;

#[test]
fn qlora_bench_stores_and_gathers_the_blocks() {
    let run = |format: &str| {
        common::bench_json(
            "qlora",
            &["--model", "tiny", "--steps", "2", "--format", format],
        )
    };
    let nf4 = run("nf4");
    let r = &nf4["result"];
    assert_eq!(nf4["quantized_layers"], 14, "{nf4}");
    let f = |k: &str| r[k].as_f64().unwrap();
    assert!(f("stored_bytes") < 0.6 * f("stored_bytes_f32"), "{r}");
    assert!(f("gathered_bytes") < 0.5 * f("gathered_bytes_f32"), "{r}");
    for s in r["steps"].as_array().unwrap() {
        assert!(s["loss"].as_f64().unwrap().is_finite(), "{s}");
    }
    let plain = run("f32");
    let p = &plain["result"];
    assert_eq!(plain["quantized_layers"], 0);
    assert_eq!(p["stored_bytes"], p["stored_bytes_f32"], "{p}");
    assert_eq!(p["gathered_bytes"], p["gathered_bytes_f32"], "{p}");
    // The same model's f32 figures either way.
    assert_eq!(p["stored_bytes_f32"], r["stored_bytes_f32"]);
}
