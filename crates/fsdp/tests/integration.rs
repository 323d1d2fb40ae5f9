//! fsdp's integration tests, one module per file, in one test binary: one build and link
//! instead of one per file, and tests of different files run side by side (libtest's
//! threads), so every test makes its own folders and ports. Workers that re-run this binary
//! name their test with its module (`checkpoint_processes::checkpoint_worker`). The tests that count this process's allocations (memory_accounting, offload_memory) are binaries of their own: nothing else may allocate while they count.

#[macro_use]
mod common;

/// The engine gathers, unpacks and converts into reserved, uninitialised memory: here every
/// allocation starts as NaN bytes, so an element it never wrote cannot pass as a zero.
#[path = "common/poisoned.rs"]
mod poisoned;

mod accelerator;
mod bert_reference;
mod checkpoint;
mod checkpoint_hostile;
mod checkpoint_processes;
mod checkpoint_torch_dcp;
mod config;
mod dcp;
mod docs;
mod engine_in_process;
mod examples;
mod frozen_gradients;
mod fsdp_matrix;
mod fsdp_reference;
mod fsdp_usage;
mod gather_ahead;
mod generation;
mod gguf;
mod grad_scaler;
mod ignored_modules;
mod llama;
mod loading;
mod lora;
mod minilm;
mod models;
mod non_finite;
mod offload;
mod open_step;
mod plan;
mod qlora;
mod reshard_after_forward;
mod resume_data;
mod skips;
mod tied_tables;
mod token_loss;
mod transformers_files;
