//! fsdp-cli's integration tests, one module per file, in one test binary: one build and link
//! instead of one per file, and the tests that mostly wait (network namespaces, SLURM's
//! daemons, timeouts a test provokes) run beside those that compute instead of after them.
//! Each module's tests run at once with the others' (libtest's threads), so every test
//! makes its own folders, ports and namespaces. Workers that re-run this binary name their
//! test with its module (`machines::vanish_worker`).

mod common;

mod bench_loading;
mod bench_memory;
mod cli;
mod cluster;
mod downstream;
mod fuzz_inputs;
mod hostile_inputs;
mod launch;
mod launch_hardening;
mod machines;
mod slurm;
mod trace;
