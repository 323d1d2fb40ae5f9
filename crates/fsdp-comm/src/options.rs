//! How a process group behaves: timeouts, the job secret, the engine and transport asked for
//! (`FSDP_COMM_BACKEND`), and who hosts the rendezvous store, with the environment variables
//! that set them.

use std::time::Duration;

use crate::error::CommError;

/// Environment variable holding the per-job secret (set by `fsdp launch`).
pub const SECRET_ENV: &str = "FSDP_JOB_SECRET";
/// Environment variable: collective timeout in seconds.
pub const TIMEOUT_ENV: &str = "FSDP_COMM_TIMEOUT_SECS";
/// Environment variable: rendezvous timeout in seconds.
pub const RENDEZVOUS_TIMEOUT_ENV: &str = "FSDP_RENDEZVOUS_TIMEOUT_SECS";
/// Environment variable: `auto` (shared memory when every member is on this host, else TCP),
/// `tcp` or `shm` — the older spelling of [`BACKEND_ENV`], still accepted.
pub const TRANSPORT_ENV: &str = "FSDP_COMM_TRANSPORT";

/// Environment variable: set to 1 when the launcher hosts the rendezvous store (rank 0 then
/// connects to it like every other rank).
pub const STORE_HOSTED_ENV: &str = "FSDP_STORE_HOSTED";
/// Environment variable: prefix of this attempt's keys in the store (a restarted job uses a
/// new prefix on the same store).
pub const PREFIX_ENV: &str = "FSDP_RENDEZVOUS_PREFIX";
/// Environment variable: set to 1 by `fsdp launch`, which starts every line of a worker's
/// console output with `[rankN]: `, so the worker's own log lines leave the rank out.
pub const OUTPUT_PREFIXED_ENV: &str = "FSDP_OUTPUT_PREFIXED";
/// Environment variable: which attempt of the job this is, 0 for the first (set by `fsdp
/// launch`; its `--max_restarts` counts them): a restarted program resumes from its newest
/// checkpoint. torchrun's `TORCHELASTIC_RESTART_COUNT` is read too.
pub const RESTART_COUNT_ENV: &str = "FSDP_RESTART_COUNT";
/// The store key (under the attempt's prefix) a launcher sets, with its reason, when its
/// part of the job fails: ranks still waiting to join fail within a second naming it,
/// instead of waiting out the rendezvous timeout.
pub const ABORT_KEY: &str = "abort";

/// Which transport carries a group's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory when all members share this host, TCP otherwise.
    Auto,
    /// TCP only (for testing the network path on one host).
    Tcp,
    /// Shared memory; an error if members are on different hosts.
    Shm,
}

/// How a group behaves when things go wrong.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// How long a collective may wait for a peer that is alive (compute skew). A dead peer
    /// is detected as soon as its connection closes, regardless of this.
    pub timeout: Duration,
    /// How long to wait for every rank to arrive.
    pub rendezvous_timeout: Duration,
    /// The per-job secret every process must present.
    pub secret: Vec<u8>,
    /// Which transport carries data.
    pub transport: TransportChoice,
    /// Whether rank 0 starts the store (false when the launcher hosts it).
    pub host_store: bool,
    /// Prefix of this job attempt's store keys.
    pub store_prefix: String,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            timeout: Duration::from_secs(300),
            rendezvous_timeout: Duration::from_secs(120),
            secret: Vec::new(),
            transport: TransportChoice::Auto,
            host_store: true,
            store_prefix: String::new(),
        }
    }
}

/// A positive, finite number of seconds below 10^9 (about 31 years): what every timeout
/// takes, from a flag or from the environment alike.
pub fn parse_seconds(text: &str) -> Result<Duration, String> {
    match text.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
        _ => Err(format!(
            "`{text}` is not a positive number of seconds (below 10^9)"
        )),
    }
}

/// The value of environment variable `var`, `None` when unset; an error naming it when
/// its value is not UTF-8 text (it is never silently ignored).
pub(crate) fn env_text(var: &str) -> Result<Option<String>, String> {
    match std::env::var_os(var) {
        None => Ok(None),
        Some(v) => v
            .into_string()
            .map(Some)
            .map_err(|v| format!("{var}={}: not UTF-8 text", v.to_string_lossy())),
    }
}

/// Environment variable: the engine that carries collectives (`auto`, `shm`, `tcp`, `mpi`).
pub const BACKEND_ENV: &str = "FSDP_COMM_BACKEND";

/// The engine asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// Shared memory on one host, MPI across hosts when possible, else the TCP ring.
    Auto,
    /// Shared memory; an error when ranks are on different hosts.
    Shm,
    /// fsdp-rs's TCP ring, also between ranks of one host.
    Tcp,
    /// MPI (feature `mpi`, and started by `mpirun` or `srun --mpi=pmix`).
    Mpi,
}

impl BackendChoice {
    /// The names, in the order of [`BackendChoice::ALL`].
    pub const NAMES: &'static [&'static str] = &["auto", "shm", "tcp", "mpi"];
    /// Every choice.
    pub const ALL: &'static [BackendChoice] = &[
        BackendChoice::Auto,
        BackendChoice::Shm,
        BackendChoice::Tcp,
        BackendChoice::Mpi,
    ];

    /// Its name.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// A name in any case, or its 1-based number (as the configuration accepts it).
    pub fn parse(text: &str) -> Option<BackendChoice> {
        let text = text.trim();
        let i = match text.parse::<usize>() {
            Ok(n) => n.checked_sub(1).filter(|&i| i < Self::ALL.len())?,
            Err(_) => Self::NAMES
                .iter()
                .position(|n| n.eq_ignore_ascii_case(text))?,
        };
        Some(Self::ALL[i])
    }

    /// `FSDP_COMM_BACKEND`, or its older spelling `FSDP_COMM_TRANSPORT` (auto, tcp, shm);
    /// `auto` when neither is set. A value that is not a choice, or the two variables
    /// disagreeing, is an error naming them.
    pub fn from_env() -> std::result::Result<BackendChoice, String> {
        let read = |var: &str| -> std::result::Result<Option<BackendChoice>, String> {
            match env_text(var)? {
                None => Ok(None),
                Some(t) if t.trim().is_empty() => Ok(None),
                Some(t) => match BackendChoice::parse(&t) {
                    Some(BackendChoice::Mpi) if var == TRANSPORT_ENV => Err(format!(
                        "{var}=`{t}`: MPI is a backend: set {BACKEND_ENV}=mpi"
                    )),
                    Some(c) => Ok(Some(c)),
                    None => Err(format!(
                        "{var}: `{}` is not one of {}",
                        t.trim(),
                        Self::NAMES.join(", ")
                    )),
                },
            }
        };
        match (read(BACKEND_ENV)?, read(TRANSPORT_ENV)?) {
            (Some(a), Some(b)) if a != b => Err(format!(
                "{BACKEND_ENV}={} and {TRANSPORT_ENV}={} disagree (set one)",
                a.name(),
                b.name()
            )),
            (a, b) => Ok(a.or(b).unwrap_or(BackendChoice::Auto)),
        }
    }

    /// The transport a [`ProcessGroup`](crate::ProcessGroup) uses for this choice (MPI groups have none).
    pub fn transport(self) -> TransportChoice {
        match self {
            BackendChoice::Shm => TransportChoice::Shm,
            BackendChoice::Tcp => TransportChoice::Tcp,
            BackendChoice::Auto | BackendChoice::Mpi => TransportChoice::Auto,
        }
    }
}

impl GroupOptions {
    /// Defaults overridden by `FSDP_COMM_TIMEOUT_SECS`, `FSDP_RENDEZVOUS_TIMEOUT_SECS`,
    /// `FSDP_JOB_SECRET` and `FSDP_COMM_BACKEND` / `FSDP_COMM_TRANSPORT` (the transport of
    /// `auto`, `tcp` or `shm`). A value that
    /// does not parse is an error naming the variable, as the launcher's flags are.
    pub fn from_env() -> Result<GroupOptions, CommError> {
        let invalid = |reason: String| CommError::InvalidArgument {
            rank: std::env::var("RANK")
                .ok()
                .and_then(|r| r.trim().parse().ok())
                .unwrap_or(0),
            op: "reading the environment".into(),
            reason,
        };
        let text = |var: &str| env_text(var).map_err(invalid);
        let secs = |var: &str, default: Duration| -> Result<Duration, CommError> {
            match text(var)? {
                None => Ok(default),
                Some(t) => parse_seconds(&t).map_err(|e| invalid(format!("{var}: {e}"))),
            }
        };
        let d = GroupOptions::default();
        let transport = BackendChoice::from_env().map_err(invalid)?.transport();
        Ok(GroupOptions {
            timeout: secs(TIMEOUT_ENV, d.timeout)?,
            rendezvous_timeout: secs(RENDEZVOUS_TIMEOUT_ENV, d.rendezvous_timeout)?,
            secret: text(SECRET_ENV)?.unwrap_or_default().into_bytes(),
            transport,
            host_store: text(STORE_HOSTED_ENV)?.is_none_or(|v| v.trim() != "1"),
            store_prefix: text(PREFIX_ENV)?.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_positive_finite_and_bounded() {
        assert_eq!(parse_seconds(" 2.5 "), Ok(Duration::from_millis(2500)));
        for bad in [
            "inf",
            "1e23",
            "18446744073709551616",
            "-5",
            "0",
            "abc",
            "NaN",
            "",
        ] {
            let e = parse_seconds(bad).unwrap_err();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }
}
