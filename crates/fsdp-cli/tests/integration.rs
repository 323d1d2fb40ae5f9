//! fsdp-cli's integration tests, one module per file, in one test binary: one build and link
//! instead of one per file, and the tests that mostly wait (network namespaces, SLURM's
//! daemons, timeouts a test provokes) run beside those that compute instead of after them.
//! Each module's tests run at once with the others' (libtest's threads), so every test
//! makes its own folders, ports and namespaces. Workers that re-run this binary name their
//! test with its module (`machines::vanish_worker`).

#[macro_use]
mod common;

#[cfg(feature = "bench")]
mod bench_loading;
#[cfg(feature = "bench")]
mod bench_memory;
#[cfg(feature = "bench")]
mod bench_qlora;
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

/// The scenarios that spend 12-24 s each waiting (SLURM's daemons coming up and its jobs; a
/// vanished machine's connections timing out) and almost no CPU, in threads side by side:
/// as separate tests each held one of libtest's threads (two on a 2-core machine) for its
/// whole wait. Each makes its own daemons, namespaces and ports; a failure of any fails
/// this test with that scenario's panic message. Named to sort first: libtest starts tests
/// in name order, so its wait overlaps the CPU-bound tests instead of ending the run alone.
#[test]
fn all_scenarios_that_mostly_wait_run_side_by_side() {
    let scenarios: [(&str, fn()); 3] = [
        (
            "slurm::srun_sbatch_and_fsdp_launch_in_an_allocation_on_one_node",
            slurm::srun_sbatch_and_fsdp_launch_in_an_allocation_on_one_node,
        ),
        (
            "slurm::srun_across_two_nodes_on_a_real_network",
            slurm::srun_across_two_nodes_on_a_real_network,
        ),
        (
            "machines::a_machine_that_vanishes_mid_transfer_is_named_within_seconds",
            machines::a_machine_that_vanishes_mid_transfer_is_named_within_seconds,
        ),
    ];
    let failed: Vec<&str> = std::thread::scope(|s| {
        let running: Vec<_> = scenarios
            .iter()
            .map(|&(name, scenario)| {
                // Named, so a skip inside says which scenario it was.
                let thread = std::thread::Builder::new().name(name.to_string());
                (name, thread.spawn_scoped(s, scenario).unwrap())
            })
            .collect();
        running
            .into_iter()
            .filter_map(|(name, h)| h.join().is_err().then_some(name))
            .collect()
    });
    assert!(failed.is_empty(), "failed (their panics above): {failed:?}");
}
