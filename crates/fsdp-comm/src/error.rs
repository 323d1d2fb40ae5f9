//! Communication errors. Every error names the rank that saw it and, where one is involved,
//! the peer rank and the collective (its sequence number and kind).

use std::time::Duration;

/// A failed store or collective operation.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// An I/O failure talking to a peer or the store.
    #[error("rank {rank}: {what}: {message}")]
    Io {
        /// The rank that saw the failure.
        rank: usize,
        /// What it was doing.
        what: String,
        /// The I/O error text.
        message: String,
    },
    /// A peer's connection closed: the peer process died or tore its group down.
    #[error("rank {rank}: connection to rank {peer} lost{}: the peer process exited or crashed", during(.op))]
    PeerLost {
        /// The rank that saw the loss.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The collective in flight, if any.
        op: Option<String>,
    },
    /// Ranks called different collectives (or the same with different dtype or size).
    #[error(
        "rank {rank}: collective mismatch with rank {peer}: this rank called {mine}, rank {peer} called {theirs}"
    )]
    Mismatch {
        /// The rank that detected it.
        rank: usize,
        /// The other rank.
        peer: usize,
        /// This rank's collective.
        mine: String,
        /// The peer's collective.
        theirs: String,
    },
    /// Another rank failed and told everyone.
    #[error("rank {rank}: aborted because rank {origin} failed: {message}")]
    Aborted {
        /// The rank that received the abort.
        rank: usize,
        /// The rank that failed first.
        origin: usize,
        /// Its error.
        message: String,
    },
    /// An operation did not complete in time.
    #[error("rank {rank}: {what} timed out after {timeout:?}")]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// What it waited for.
        what: String,
        /// How long.
        timeout: Duration,
    },
    /// The rendezvous store could not be reached before the deadline (no process hosts it
    /// there, or the network does not lead to it).
    #[error("rank {rank}: {what}: {message}")]
    StoreUnreachable {
        /// The rank that tried.
        rank: usize,
        /// Where and for how long it tried.
        what: String,
        /// The last connection error.
        message: String,
    },
    /// The rendezvous did not complete: names the ranks that never arrived.
    #[error(
        "rank {rank}: rendezvous timed out after {timeout:?}; ranks that never arrived: {missing:?}"
    )]
    RendezvousTimeout {
        /// The waiting rank.
        rank: usize,
        /// The ranks whose registration never appeared.
        missing: Vec<usize>,
        /// How long it waited.
        timeout: Duration,
    },
    /// Some members did not reach a join point in time (a collective step such as saving a
    /// checkpoint called by some ranks only).
    #[error(
        "rank {rank}: {what}: ranks {missing:?} did not join within {timeout:?} (every rank must call it)"
    )]
    NotJoined {
        /// The waiting rank.
        rank: usize,
        /// What was joined.
        what: String,
        /// The ranks that did not arrive.
        missing: Vec<usize>,
        /// How long it waited.
        timeout: Duration,
    },
    /// The store or a peer refused this process (wrong secret, rank taken, ...).
    #[error("rank {rank}: refused: {reason}")]
    Refused {
        /// The refused rank.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// A launcher of the job stopped it while this rank waited to join (its part of the
    /// job failed): every rank still joining fails at once with its reason.
    #[error("rank {rank}: the job was stopped before it could start: {reason}")]
    JobStopped {
        /// The waiting rank.
        rank: usize,
        /// What the launcher said.
        reason: String,
    },
    /// The caller passed arguments that cannot work (sizes, ranks).
    #[error("rank {rank}: invalid {op} call: {reason}")]
    InvalidArgument {
        /// The calling rank.
        rank: usize,
        /// The operation.
        op: String,
        /// What is wrong.
        reason: String,
    },
    /// The group was shut down before the operation ran.
    #[error("rank {rank}: process group is shut down")]
    Closed {
        /// The rank.
        rank: usize,
    },
}

fn during(op: &Option<String>) -> String {
    op.as_ref()
        .map(|o| format!(" during {o}"))
        .unwrap_or_default()
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, CommError>;
