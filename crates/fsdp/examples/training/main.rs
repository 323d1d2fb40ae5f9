//! The complete program of docs/TRAINING.md ("A complete program"), kept verbatim in
//! `program.rs` (a test compares them and runs this build on 2 processes).

include!("program.rs");
