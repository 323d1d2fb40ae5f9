//! The few collectives a save or load needs: joining (failing fast when a rank does not
//! come), exchanging each rank's small documents, and agreeing on success, so every rank
//! returns the same outcome.

use std::time::Duration;

use fsdp_comm::{Buffer, Mesh, ReduceOp};

use super::error::CheckpointError;

/// Every rank of the mesh enters `what`, or all fail within `timeout` naming the absent.
pub(crate) fn join(mesh: &Mesh, what: &str, timeout: Duration) -> Result<(), CheckpointError> {
    mesh.shard.join(what, timeout)?;
    if let Some(r) = &mesh.replicate {
        r.join(what, timeout)?;
    }
    Ok(())
}

/// Every rank's bytes, on every rank, in mesh-rank order (two collectives).
pub(crate) fn all_gather_bytes(mesh: &Mesh, mine: &[u8]) -> Result<Vec<Vec<u8>>, CheckpointError> {
    let longest = mesh.all_reduce_vec(vec![mine.len() as i64], ReduceOp::Max)?[0] as usize;
    let mut padded = (mine.len() as u64).to_le_bytes().to_vec();
    padded.extend_from_slice(mine);
    padded.resize(8 + longest, 0);
    let all = mesh.all_gather_vec(padded)?;
    Ok(all
        .chunks(8 + longest)
        .map(|c| {
            let n = u64::from_le_bytes(c[..8].try_into().unwrap_or_default()) as usize;
            c[8..8 + n.min(longest)].to_vec()
        })
        .collect())
}

/// Rank 0's bytes on every rank.
pub(crate) fn broadcast_bytes(mesh: &Mesh, mine: &[u8]) -> Result<Vec<u8>, CheckpointError> {
    let len = mesh
        .broadcast_from_first(Buffer::I64(vec![mine.len() as i64]))?
        .into_vec::<i64>()
        .unwrap_or_default();
    let n = len.first().copied().unwrap_or(0).max(0) as usize;
    let mut buf = mine.to_vec();
    buf.resize(n, 0);
    Ok(mesh
        .broadcast_from_first(Buffer::U8(buf))?
        .into_vec::<u8>()
        .unwrap_or_default())
}

/// Every rank's error message (empty where it succeeded), in mesh-rank order.
fn messages<T>(
    mesh: &Mesh,
    mine: &Result<T, CheckpointError>,
) -> Result<Vec<Vec<u8>>, CheckpointError> {
    let text = match mine {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    };
    all_gather_bytes(mesh, text.as_bytes())
}

/// The error of rank `rank`, as the other ranks report it.
fn on_rank(all: &[Vec<u8>], rank: usize) -> CheckpointError {
    CheckpointError::OnRank {
        rank,
        message: String::from_utf8_lossy(&all[rank]).into_owned(),
    }
}

/// Every rank learns whether every rank succeeded: this rank's own error, or the first
/// failing rank's message.
pub(crate) fn agree<T>(
    mesh: &Mesh,
    mine: Result<T, CheckpointError>,
) -> Result<T, CheckpointError> {
    let all = messages(mesh, &mine)?;
    let value = mine?;
    match all.iter().position(|m| !m.is_empty()) {
        None => Ok(value),
        Some(rank) => Err(on_rank(&all, rank)),
    }
}

/// Every rank gets the same outcome: the error of the first failing rank in rank order (its
/// own error on that rank), for failures where later ranks' errors may be consequences of
/// an earlier one's (a folder removed under them).
pub(crate) fn agree_on_first<T>(
    mesh: &Mesh,
    mine: Result<T, CheckpointError>,
) -> Result<T, CheckpointError> {
    let all = messages(mesh, &mine)?;
    match all.iter().position(|m| !m.is_empty()) {
        None => mine,
        Some(rank) if rank == mesh.rank() => mine,
        Some(rank) => Err(on_rank(&all, rank)),
    }
}
