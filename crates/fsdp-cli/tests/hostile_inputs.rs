//! Bad bytes in the environment and config files, and what workers leave behind (issue 20,
//! items 11-16), with the real launcher and real workers: timeouts that do not parse are
//! errors naming the variable (never a panic or a silent default); a non-UTF-8 setting is an
//! error; a NUL in a config file is an error at its line and `config update` leaves the file
//! alone; a byte-order mark is skipped; a worker's `setsid` children are stopped with it;
//! two ranks' partial lines never run together; a local-rank filter that shows nothing and
//! a reused log folder are refused. Every launch is bounded in time.

use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use crate::common::{alive, finish, fsdp, launch};

#[test]
fn timeouts_that_do_not_parse_are_errors_naming_the_variable() {
    for var in ["FSDP_COMM_TIMEOUT_SECS", "FSDP_RENDEZVOUS_TIMEOUT_SECS"] {
        for bad in ["inf", "1e23", "18446744073709551616", "-5", "abc"] {
            let child = fsdp()
                .args(["launch", "--num_processes", "1", "true"])
                .env(var, bad)
                .spawn()
                .unwrap();
            let run = finish(child, Duration::from_secs(20));
            assert!(
                run.code.is_some_and(|c| c != 0 && c != 101),
                "{var}={bad}: exit {:?}\n{}",
                run.code,
                run.out
            );
            assert!(
                run.out.contains(var) && run.out.contains(bad) && !run.out.contains("panicked"),
                "{var}={bad}: {}",
                run.out
            );
        }
    }
    let child = fsdp()
        .args(["launch", "--num_processes", "1", "true"])
        .env("FSDP_COMM_TRANSPORT", "carrier-pigeon")
        .spawn()
        .unwrap();
    let run = finish(child, Duration::from_secs(20));
    assert_ne!(run.code, Some(0), "{}", run.out);
    assert!(run.out.contains("FSDP_COMM_TRANSPORT"), "{}", run.out);
}

#[test]
fn a_setting_that_is_not_utf8_is_an_error_naming_it() {
    let child = fsdp()
        .args(["launch", "--num_processes", "1", "true"])
        .env(
            "FSDP_SHARDING_STRATEGY",
            std::ffi::OsStr::from_bytes(b"FULL\xff"),
        )
        .spawn()
        .unwrap();
    let run = finish(child, Duration::from_secs(20));
    assert_ne!(run.code, Some(0), "{}", run.out);
    assert!(
        run.out.contains("FSDP_SHARDING_STRATEGY") && run.out.contains("not UTF-8"),
        "{}",
        run.out
    );
}

#[test]
fn a_nul_in_a_config_file_is_an_error_and_a_byte_order_mark_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cfg.yaml");
    let text = b"compute_environment: LOCAL_MACHINE\nmixed_precision: 'no'\0\nnum_processes: 2\n";
    std::fs::write(&file, text).unwrap();
    let child = fsdp()
        .args(["launch", "--config_file"])
        .arg(&file)
        .arg("true")
        .spawn()
        .unwrap();
    let run = finish(child, Duration::from_secs(20));
    assert_ne!(run.code, Some(0), "{}", run.out);
    assert!(
        run.out.contains("cfg.yaml:2:") && run.out.contains("NUL"),
        "{}",
        run.out
    );
    // `config update` refuses it too, and writes nothing back.
    let out = fsdp()
        .args(["config", "update", "--config_file"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(
        std::fs::read(&file).unwrap(),
        text,
        "the file was rewritten"
    );

    // A byte-order mark (as Windows editors write, and PyYAML skips).
    std::fs::write(
        &file,
        "\u{feff}num_processes: 2\ncompute_environment: LOCAL_MACHINE\n",
    )
    .unwrap();
    let child = fsdp()
        .args(["launch", "--main_process_port", "0", "--config_file"])
        .arg(&file)
        .args(["sh", "-c", "echo up"])
        .spawn()
        .unwrap();
    let run = finish(child, Duration::from_secs(30));
    assert_eq!(run.code, Some(0), "{}", run.out);
    assert!(run.out.contains("[rank1]: up"), "{}", run.out);
}

#[test]
fn what_a_worker_moved_out_of_its_process_group_is_stopped_with_it() {
    // Each worker starts a `setsid` child (its own session) and a double-forked one (its
    // parent exits at once), prints their pids, and exits 0 (rank 0) or 3 (rank 1).
    let script = "setsid sleep 300 & echo \"session $!\"; \
                  (setsid sleep 301 & echo \"double $!\"); \
                  sleep 0.5; exit $((RANK * 3))";
    for (processes, code) in [("1", 0), ("2", 3)] {
        let child = fsdp()
            .args([
                "launch",
                "--num_processes",
                processes,
                "--main_process_port",
                "0",
            ])
            .args(["sh", "-c", script])
            .spawn()
            .unwrap();
        let run = finish(child, Duration::from_secs(30));
        assert_eq!(run.code, Some(code), "{}", run.out);
        let pids: Vec<u32> = run
            .out
            .lines()
            .filter_map(|l| {
                let rest = l.split("]: ").nth(1)?;
                let (what, pid) = rest.split_once(' ')?;
                ["session", "double"]
                    .contains(&what)
                    .then(|| pid.trim().parse().ok())?
            })
            .collect();
        assert_eq!(
            pids.len(),
            2 * processes.parse::<usize>().unwrap(),
            "{}",
            run.out
        );
        let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        for &p in &left {
            // SAFETY: cleaning up processes this test started.
            unsafe {
                libc::kill(p as i32, libc::SIGKILL);
            }
        }
        assert!(left.is_empty(), "left running: {left:?}\n{}", run.out);
    }
}

#[test]
fn two_ranks_partial_lines_never_run_together() {
    // Rank 1 leaves a line open; rank 0 writes a whole one meanwhile (flag files order them,
    // whatever the load: rank 0 waits for rank 1's partial line, rank 1 for rank 0's line).
    let dir = tempfile::tempdir().unwrap();
    let wait_for = |f: &str| {
        format!("i=0; while [ ! -e $D/{f} ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done")
    };
    let script = format!(
        "if [ $RANK = 1 ]; then printf 'no end yet'; touch $D/open; {}; printf ' and the end\\n'; \
         else {}; sleep 0.5; echo 'whole line'; touch $D/said; fi",
        wait_for("said"),
        wait_for("open")
    );
    let out = fsdp()
        .args(["launch", "--num_processes", "2", "--main_process_port", "0"])
        .args(["sh", "-c", &script])
        .env("D", dir.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.contains(&"[rank0]: whole line"), "{text}");
    assert!(lines.contains(&"[rank1]: no end yet"), "{text}");
    assert!(lines.contains(&"[rank1]:  and the end"), "{text}");
}

#[test]
fn a_filter_that_shows_nothing_and_a_reused_log_folder_are_refused() {
    let run = launch(
        &["--num_processes", "2", "--local_ranks_filter", "5", "true"],
        Duration::from_secs(20),
    );
    assert_ne!(run.code, Some(0), "{}", run.out);
    assert!(
        run.out.contains("no local rank 5") && run.out.contains("0..2"),
        "{}",
        run.out
    );
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().to_str().unwrap();
    let first = launch(
        &[
            "--num_processes",
            "2",
            "--main_process_port",
            "0",
            "--log_dir",
            logs,
            "true",
        ],
        Duration::from_secs(20),
    );
    assert_eq!(first.code, Some(0), "{}", first.out);
    let again = launch(
        &[
            "--num_processes",
            "1",
            "--log_dir",
            logs,
            "sh",
            "-c",
            "echo second",
        ],
        Duration::from_secs(20),
    );
    assert_ne!(again.code, Some(0), "{}", again.out);
    assert!(
        again.out.contains("holds the logs of an earlier job") && !again.out.contains("second"),
        "{}",
        again.out
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("rank1.stdout")).unwrap(),
        "",
        "the first job's logs stay"
    );
}
