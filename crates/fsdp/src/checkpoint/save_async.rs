//! Asynchronous save: the caller is blocked only while every rank copies its rows (and its
//! optimizer state) into a staging copy in memory; a background thread per rank writes,
//! checksums and syncs its files, and rank 0's thread publishes the checkpoint once every
//! rank has reported. The threads use no collective (the training's communicator stays the
//! training's): each rank reports through a small file in the staging folder, which every
//! save already needs on a file system all ranks share. [`PendingSave::wait`] is where the
//! outcome meets every rank again.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fsdp_comm::Mesh;
use serde::{Deserialize, Serialize};

use super::collect::{agree, agree_on_first};
use super::error::CheckpointError;
use super::report::{DocInputs, RankReport};
use super::save;
use super::save_parts::{self, RankParts};
use super::{CheckpointOptions, RunState, atomic};
use crate::config::{CheckpointFormat, StateDictType};
use crate::engine::Fsdp;
use crate::optim::Optimizer;

/// A rank's report file in the staging folder (removed before the folder is published).
fn report_file(staging: &Path, rank: usize) -> PathBuf {
    staging.join(format!(".report_{rank}.json"))
}

/// What a rank's writer reports to rank 0.
#[derive(Serialize, Deserialize)]
enum Outcome {
    Written(RankReport),
    Failed(String),
}

/// A checkpoint being written in the background (see [`super::save_state_async`]). Its
/// [`wait`](PendingSave::wait) is collective; dropped without it, it still waits for this
/// rank's writer and logs a failure.
pub struct PendingSave {
    dest: PathBuf,
    mesh: Mesh,
    staged_bytes: u64,
    writer: Option<JoinHandle<Result<(), CheckpointError>>>,
}

impl std::fmt::Debug for PendingSave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSave")
            .field("dest", &self.dest)
            .field("staged_bytes", &self.staged_bytes)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl PendingSave {
    /// The folder the checkpoint is published at (the numbered one with automatic naming).
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Bytes of tensor values this rank copied for the writer (held until its files are
    /// written): its parameter rows and their optimizer state.
    pub fn staged_bytes(&self) -> u64 {
        self.staged_bytes
    }

    /// Whether this rank's writer has ended (rank 0's ends after publishing).
    pub fn is_finished(&self) -> bool {
        self.writer.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for the checkpoint (collective): every rank returns the folder once it is
    /// published, or the same error — the first failing rank's, naming the file — when any
    /// rank failed, in which case nothing was published and the previous checkpoint at the
    /// destination is untouched.
    pub fn wait(mut self) -> Result<PathBuf, CheckpointError> {
        let mine = self.join_writer();
        // The first failure, not this rank's own: once rank 0 gives up it removes the
        // staging folder, and the others' errors are only that.
        agree_on_first(&self.mesh, mine)?;
        Ok(self.dest.clone())
    }

    fn join_writer(&mut self) -> Result<(), CheckpointError> {
        match self.writer.take() {
            None => Ok(()),
            Some(handle) => handle.join().unwrap_or_else(|_| {
                Err(CheckpointError::WriterPanicked {
                    dest: self.dest.clone(),
                })
            }),
        }
    }
}

impl Drop for PendingSave {
    fn drop(&mut self) {
        if let Err(e) = self.join_writer() {
            tracing::error!(
                "asynchronous checkpoint {} failed on this rank: {e}",
                self.dest.display()
            );
        }
    }
}

/// See [`super::save_state_async`].
pub(crate) fn save_async(
    dest: &Path,
    models: &[&Fsdp],
    optimizers: &[&dyn Optimizer],
    run: &RunState,
    options: &CheckpointOptions,
) -> Result<PendingSave, CheckpointError> {
    let kind = options
        .state_dict_type
        .or(models.first().map(|m| m.state_dict_type()));
    if kind == Some(StateDictType::FullStateDict) {
        return Err(CheckpointError::AsyncFullStateDict);
    }
    let mut begun = save::begin(dest, models, optimizers, options)?;
    let local = begun.kind == StateDictType::LocalStateDict;
    // The staging copy: offloaded rows are read from the disk tier here too.
    let captured = save_parts::rank_parts(models, optimizers, run, local)
        .and_then(|parts| parts.to_owned_parts());
    // Every rank captured, or all fail (rank 0's staging folder goes with `begun`).
    let parts = agree(&begun.mesh, captured)?;
    let staged_bytes = parts.value_bytes();
    let writer = Writer {
        staging: begun.staging.clone(),
        dest: begun.dest.clone(),
        world_size: begun.mesh.world_size(),
        held: begun.held.take(),
        inputs: DocInputs::of(models, optimizers),
        parts,
        run: run.clone(),
        kind: begun.kind,
        files: begun.files,
        options: options.clone(),
    };
    let handle = std::thread::Builder::new()
        .name("fsdp-checkpoint-writer".into())
        .spawn(move || writer.run())
        .map_err(|e| CheckpointError::io("starting the writer of", &begun.dest, e))?;
    Ok(PendingSave {
        dest: begun.dest,
        mesh: begun.mesh,
        staged_bytes,
        writer: Some(handle),
    })
}

/// One rank's background work.
struct Writer {
    staging: PathBuf,
    dest: PathBuf,
    world_size: usize,
    /// Rank 0's staging folder: rank 0 publishes.
    held: Option<atomic::Staging>,
    inputs: DocInputs,
    parts: RankParts<Vec<f32>>,
    run: RunState,
    kind: StateDictType,
    files: CheckpointFormat,
    options: CheckpointOptions,
}

impl Writer {
    fn run(self) -> Result<(), CheckpointError> {
        let started = Instant::now();
        let written = save::write_rank_parts(&self.staging, &self.parts, self.files);
        let rank = self.parts.rank;
        drop(self.parts);
        let Some(mut held) = self.held else {
            let outcome = match &written {
                Ok(r) => Outcome::Written(r.clone()),
                Err(e) => Outcome::Failed(e.to_string()),
            };
            let reported = write_report(&self.staging, rank, &outcome);
            return written.and(reported);
        };
        let mut reports = vec![written?];
        // The others write about as much as rank 0: twice its time, beyond the join timeout.
        let deadline = Instant::now() + self.options.join_timeout + 2 * started.elapsed();
        for r in 1..self.world_size {
            reports.push(await_report(&self.staging, r, deadline)?);
        }
        save::publish(
            &mut held,
            &self.dest,
            &reports,
            &self.inputs,
            &self.run,
            (self.kind, self.files),
            &self.options,
        )
    }
}

/// Writes `outcome` as this rank's report, whole or not at all (a synced file renamed in).
fn write_report(staging: &Path, rank: usize, outcome: &Outcome) -> Result<(), CheckpointError> {
    let path = report_file(staging, rank);
    let bytes = serde_json::to_vec(outcome)
        .map_err(|e| CheckpointError::json(format!("rank {rank}'s report"), e))?;
    let mut partial = path.clone().into_os_string();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    atomic::write_synced(&partial, &bytes)?;
    std::fs::rename(&partial, &path).map_err(|e| CheckpointError::io("renaming", &partial, e))
}

/// Rank 0: waits until `deadline` for rank `rank`'s report, reads and removes it.
fn await_report(
    staging: &Path,
    rank: usize,
    deadline: Instant,
) -> Result<RankReport, CheckpointError> {
    let path = report_file(staging, rank);
    let mut pause = Duration::from_millis(1);
    while !path.exists() {
        if Instant::now() > deadline {
            return Err(CheckpointError::Missing {
                path,
                what: format!(
                    "rank {rank} did not report its files in time: the rank died or stalled while writing"
                ),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
    let bytes = super::files::read_bounded(&path, super::format::DOCUMENT_LIMIT, "rank report")?;
    std::fs::remove_file(&path).map_err(|e| CheckpointError::io("removing", &path, e))?;
    match serde_json::from_slice(&bytes) {
        Ok(Outcome::Written(report)) => Ok(report),
        Ok(Outcome::Failed(message)) => Err(CheckpointError::OnRank { rank, message }),
        Err(e) => Err(CheckpointError::Corrupt {
            path,
            reason: format!("rank {rank}'s report: {e}"),
        }),
    }
}
