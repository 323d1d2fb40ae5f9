//! The skip policy itself: a skip is logged; under `FSDP_REQUIRE_ALL=1` (what `.ci/run` sets)
//! a skip for something missing fails the test, and one for what no setup provides
//! (`skipped_optional!`) still passes. The test binary re-runs one test of its own as the
//! skipping test.

use std::process::Command;

use crate::common::skip::{LOG_ENV, REQUIRE_ALL_ENV};

const ROLE: &str = "FSDP_SKIP_POLICY_WORKER";

/// The skipping test (does nothing unless run by the test below).
#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn skipping_worker() {
    match std::env::var(ROLE).as_deref() {
        Ok("required") => skipped!("a tool this test needs is missing (on purpose)"),
        Ok("optional") => skipped_optional!("no GPU here (on purpose)"),
        _ => {}
    }
}

#[test]
fn require_all_fails_a_skip_for_something_missing_and_only_that() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("skipped.log");
    let run = |kind: &str, require: &str| {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "skips::skipping_worker",
                "--include-ignored",
                "--test-threads",
                "1",
            ])
            .env(ROLE, kind)
            .env(REQUIRE_ALL_ENV, require)
            .env(LOG_ENV, &log)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = run("required", "1");
    assert!(
        !ok,
        "a required skip under {REQUIRE_ALL_ENV}=1 must fail:\n{text}"
    );
    assert!(text.contains("FSDP_REQUIRE_ALL=1"), "{text}");
    let (ok, text) = run("required", "0");
    assert!(ok, "without {REQUIRE_ALL_ENV} a skip passes:\n{text}");
    let (ok, text) = run("optional", "1");
    assert!(
        ok,
        "an optional skip passes even under {REQUIRE_ALL_ENV}=1:\n{text}"
    );
    // Every skip was logged, failing or not.
    let logged = std::fs::read_to_string(&log).unwrap();
    assert_eq!(logged.lines().count(), 3, "{logged}");
    assert!(
        logged
            .lines()
            .all(|l| l.starts_with("SKIPPED skips::skipping_worker: ")),
        "{logged}"
    );
}
