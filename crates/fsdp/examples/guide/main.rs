//! The program of the guide "Train your own model" (`crates/fsdp/src/guide.md`, the README's
//! section of that name), kept verbatim in `program.rs` (a test compares them): the fresh-crate
//! test (`crates/fsdp-cli/tests/downstream.rs`) runs this build of it under `fsdp launch`.

include!("program.rs");
