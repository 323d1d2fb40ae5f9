//! Processes a worker started that left its process group (`setsid`, a daemon's double
//! fork): the launcher is their subreaper (`PR_SET_CHILD_SUBREAPER`), so when their parent
//! ends they become the launcher's children instead of init's, and every teardown ends and
//! reaps them — the group signal alone cannot reach them.

use std::time::{Duration, Instant};

/// How long a teardown keeps ending orphans (each one ended may leave children of its own).
const ORPHANS_DEADLINE: Duration = Duration::from_secs(5);

/// Makes this process the subreaper of everything it starts. Fails only on kernels before
/// 3.4; the launcher then works as before (orphans go to init).
pub(super) fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The pids whose parent is this process, from `/proc/<pid>/stat`.
fn children() -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                // After the command name (in parentheses, which may hold anything): the
                // state, then the parent's pid.
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok())
                    == Some(me)
            })
        })
        .collect()
}

/// Kills and reaps every child of this process except `keep` (the workers, which their
/// supervisor reaps), round after round as the killed ones' children are reparented here,
/// until none is left or the deadline passes. Returns how many were ended.
pub(super) fn end_orphans(keep: &[u32]) -> usize {
    let deadline = Instant::now() + ORPHANS_DEADLINE;
    let mut ended = 0;
    loop {
        let orphans: Vec<i32> = children()
            .into_iter()
            .filter(|pid| !keep.contains(&(*pid as u32)))
            .collect();
        if orphans.is_empty() || Instant::now() >= deadline {
            return ended;
        }
        for &pid in &orphans {
            // SAFETY: `pid` is a child of this process not yet reaped, so the id cannot
            // have been reused by another process.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        for &pid in &orphans {
            while Instant::now() < deadline {
                let mut status = 0;
                // SAFETY: waiting for our own child.
                let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if rc != 0 {
                    ended += usize::from(rc == pid);
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}
