//! How a process group behaves: timeouts, the job secret, the transport, and who hosts the
//! rendezvous store, with the environment variables that set them.

use std::time::Duration;

/// Environment variable holding the per-job secret (set by `fsdp launch`).
pub const SECRET_ENV: &str = "FSDP_JOB_SECRET";
/// Environment variable: collective timeout in seconds.
pub const TIMEOUT_ENV: &str = "FSDP_COMM_TIMEOUT_SECS";
/// Environment variable: rendezvous timeout in seconds.
pub const RENDEZVOUS_TIMEOUT_ENV: &str = "FSDP_RENDEZVOUS_TIMEOUT_SECS";
/// Environment variable: `auto` (shared memory when every member is on this host, else TCP),
/// `tcp` or `shm`.
pub const TRANSPORT_ENV: &str = "FSDP_COMM_TRANSPORT";

/// Environment variable: set to 1 when the launcher hosts the rendezvous store (rank 0 then
/// connects to it like every other rank).
pub const STORE_HOSTED_ENV: &str = "FSDP_STORE_HOSTED";
/// Environment variable: prefix of this attempt's keys in the store (a restarted job uses a
/// new prefix on the same store).
pub const PREFIX_ENV: &str = "FSDP_RENDEZVOUS_PREFIX";

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

impl GroupOptions {
    /// Defaults overridden by `FSDP_COMM_TIMEOUT_SECS`, `FSDP_RENDEZVOUS_TIMEOUT_SECS`,
    /// `FSDP_JOB_SECRET` and `FSDP_COMM_TRANSPORT` (an unknown transport name is treated as
    /// `auto`).
    pub fn from_env() -> GroupOptions {
        let secs = |var: &str| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| *s > 0.0)
                .map(Duration::from_secs_f64)
        };
        let d = GroupOptions::default();
        GroupOptions {
            timeout: secs(TIMEOUT_ENV).unwrap_or(d.timeout),
            rendezvous_timeout: secs(RENDEZVOUS_TIMEOUT_ENV).unwrap_or(d.rendezvous_timeout),
            secret: std::env::var(SECRET_ENV).unwrap_or_default().into_bytes(),
            transport: match std::env::var(TRANSPORT_ENV)
                .unwrap_or_default()
                .to_ascii_lowercase()
                .as_str()
            {
                "tcp" => TransportChoice::Tcp,
                "shm" => TransportChoice::Shm,
                _ => TransportChoice::Auto,
            },
            host_store: std::env::var(STORE_HOSTED_ENV).map_or(true, |v| v.trim() != "1"),
            store_prefix: std::env::var(PREFIX_ENV).unwrap_or_default(),
        }
    }
}
