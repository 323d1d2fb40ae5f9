//! fsdp-comm's integration tests, one module per file, in one test binary: one build and link
//! instead of one per file, and tests of different files run side by side (libtest's
//! threads), so every test makes its own folders and ports. Workers that re-run this binary
//! name their test with its module (`checkpoint_processes::checkpoint_worker`).

#[macro_use]
mod common;

mod local_group;
mod mpi;
mod multiprocess;
#[path = "../../fsdp/tests/common/poisoned.rs"]
mod poisoned;
mod store_hostile;
