//! Runs a test binary's worker entry as `world` real processes joined by the torchrun
//! environment, with a deadline; returns each rank's output.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `world` copies of this test binary running test `entry` with `role=1` set, waits up
/// to `deadline` (killing all on expiry), and returns each rank's stdout+stderr. Panics if a
/// worker fails, with its output.
pub fn run_workers(
    entry: &str,
    role: &str,
    world: usize,
    env: &[(&str, &str)],
    deadline: Duration,
) -> Vec<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let mut children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", entry, "--nocapture", "--test-threads=1"])
                .env(role, "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("FSDP_JOB_SECRET", "test")
                .env("RAYON_NUM_THREADS", "1")
                .env("FSDP_COMM_TIMEOUT_SECS", "120")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let end = Instant::now() + deadline;
    for i in 0..children.len() {
        while children[i].try_wait().unwrap().is_none() {
            if Instant::now() > end {
                for c in children.iter_mut() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                panic!("workers of {entry} did not finish within {deadline:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let mut outputs = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "worker failed:\n{text}");
        outputs.push(text);
    }
    outputs
}

/// The JSON a worker printed after `RESULT `.
pub fn result_of(output: &str) -> serde_json::Value {
    let line = output
        .lines()
        .find_map(|l| l.split("RESULT ").nth(1))
        .unwrap_or_else(|| panic!("no RESULT line in:\n{output}"));
    serde_json::from_str(line).unwrap()
}
