//! Where state lives between steps, when not where the step computes: on the compute device
//! or in host memory (`placement`, `fsdp_offload_params`), and the disk tier
//! (`fsdp_offload_dir`): a rank's parameter shards, reduced gradients and optimizer state
//! kept in files between uses, a unit's block per file, moved by one I/O thread so reads
//! ahead and writes behind overlap the compute. The rest of the engine sees the units'
//! [`ShardStore`], the reduced [`GradBlock`]s and [`StateOnDisk`], built from the plan here
//! (`from_plan`).
//!
//! Every region is one file of f32 values in the layout the unit's all-gather sends (each
//! parameter's padded rows at its offset in the unit's block), so a unit's gather reads its
//! file into the send buffer and nothing is packed. Reads and writes are whole-file
//! positioned I/O (`pread` / `pwrite`) through the page cache: one large request per
//! region, which the kernel turns into sequential disk transfers. (`O_DIRECT` writes were
//! measured slower on GPT-2 XL: they hold the one I/O thread until the device has the data,
//! delaying the reads queued behind them.) Writes waiting for the disk are capped, so a slow
//! disk slows the step instead of growing memory.

pub(crate) mod from_plan;
mod grad_block;
mod io_thread;
mod optimizer_state;
mod placement;
mod scratch;
mod store;
mod streamed_step;

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};

pub(crate) use grad_block::GradBlock;
use io_thread::{Counters, Job, PendingRead, io_thread, read_exact};
pub(crate) use optimizer_state::StateOnDisk;
pub use placement::{OFFLOAD_ON_CPU, Placement};
pub use scratch::{OffloadError, ScratchDir, free_bytes};
pub(crate) use store::ShardStore;

/// What a file holds for one unit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Region {
    /// This rank's master shards.
    Params,
    /// One backward's reduced gradients (numbered: accumulated backwards coexist).
    Grads(u64),
    /// An optimizer state buffer by PyTorch's name (`exp_avg`, ...).
    State(String),
}

/// A unit's region.
pub(crate) type Key = (usize, Region);

/// Bytes and seconds the tier has moved (for benchmarks).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OffloadStats {
    /// Bytes read from the files.
    pub bytes_read: u64,
    /// Bytes written to them.
    pub bytes_written: u64,
    /// Seconds the I/O thread spent in reads.
    pub read_seconds: f64,
    /// Seconds it spent in writes.
    pub write_seconds: f64,
}

/// Bytes of writes a tier lets wait for the disk before a new one waits (until the engine
/// sets its own cap from the plan).
const DEFAULT_WRITE_CAP: u64 = 256 << 20;

/// This rank's offloaded state: the scratch folder, its files and the I/O thread.
pub struct DiskTier {
    dir: ScratchDir,
    /// Parameter shards and gradients live here too (`fsdp_offload_params`), not only the
    /// optimizer state.
    pub(crate) params: bool,
    files: Mutex<HashMap<Key, (Arc<File>, PathBuf)>>,
    queue: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    reads_ahead: Mutex<HashMap<Key, PendingRead>>,
    /// The first failed write (writes are asynchronous; it surfaces at the next call).
    failed: Arc<Mutex<Option<OffloadError>>>,
    /// That failure in words, once it surfaced: every later call fails with it.
    poisoned: Mutex<Option<String>>,
    counters: Arc<Counters>,
    next_grads: AtomicU64,
    /// At most this many bytes of writes wait for the disk (a slow disk slows the step
    /// instead of growing memory); one larger write is always let through.
    write_cap: AtomicU64,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("dir", &self.dir.path())
            .field("params", &self.params)
            .finish()
    }
}

impl DiskTier {
    /// A tier in a new scratch folder under `parent` for rank `rank`, after checking that
    /// `needed` bytes are free there.
    pub(crate) fn create(
        parent: &std::path::Path,
        rank: usize,
        params: bool,
        needed: u64,
        what: &str,
    ) -> Result<DiskTier, OffloadError> {
        let dir = ScratchDir::create(parent, rank, needed, what)?;
        let (tx, rx) = channel::<Job>();
        let failed: Arc<Mutex<Option<OffloadError>>> = Arc::default();
        let counters: Arc<Counters> = Arc::default();
        let (f, c) = (failed.clone(), counters.clone());
        let worker = std::thread::Builder::new()
            .name("fsdp-offload".into())
            .spawn(move || io_thread(rx, f, c))
            .map_err(|source| OffloadError::Io {
                path: dir.path().to_path_buf(),
                what: "starting the I/O thread".into(),
                source,
            })?;
        Ok(DiskTier {
            dir,
            params,
            files: Mutex::default(),
            queue: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
            reads_ahead: Mutex::default(),
            failed,
            poisoned: Mutex::default(),
            counters,
            next_grads: AtomicU64::new(0),
            write_cap: AtomicU64::new(DEFAULT_WRITE_CAP),
        })
    }

    /// The scratch folder.
    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// What the tier has moved so far.
    pub fn stats(&self) -> OffloadStats {
        let c = &self.counters;
        OffloadStats {
            bytes_read: c.read.load(Ordering::Relaxed),
            bytes_written: c.written.load(Ordering::Relaxed),
            read_seconds: c.read_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            write_seconds: c.write_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    /// Lets at most `bytes` of writes wait for the disk at once (the engine: one unit's
    /// blocks of every offloaded kind, what its memory plan counts).
    pub(crate) fn set_write_cap(&self, bytes: u64) {
        self.write_cap.store(bytes.max(1), Ordering::Relaxed);
    }

    /// A new gradient region number (one per backward's reduced block of a unit).
    pub(crate) fn next_grads(&self) -> u64 {
        self.next_grads.fetch_add(1, Ordering::Relaxed)
    }

    fn file(&self, key: &Key) -> Result<(Arc<File>, PathBuf), OffloadError> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((f, p)) = files.get(key) {
            return Ok((f.clone(), p.clone()));
        }
        let name = match &key.1 {
            Region::Params => format!("unit-{:05}.params", key.0),
            Region::Grads(n) => format!("unit-{:05}.grads-{n}", key.0),
            Region::State(s) => format!("unit-{:05}.state-{s}", key.0),
        };
        let file = Arc::new(self.dir.create_file(&name)?);
        let path = self.dir.path().join(name);
        files.insert(key.clone(), (file.clone(), path.clone()));
        Ok((file, path))
    }

    /// Whether region `key` has been written.
    pub(crate) fn has(&self, key: &Key) -> bool {
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(key)
    }

    fn send(&self, job: Job) -> Result<(), OffloadError> {
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        match queue.as_ref().map(|q| q.send(job)) {
            Some(Ok(())) => Ok(()),
            _ => Err(self.io_error(
                "queueing I/O",
                std::io::Error::other("the I/O thread ended"),
            )),
        }
    }

    fn io_error(&self, what: &str, source: std::io::Error) -> OffloadError {
        OffloadError::Io {
            path: self.dir.path().to_path_buf(),
            what: what.into(),
            source,
        }
    }

    fn check_failed(&self) -> Result<(), OffloadError> {
        let mut poisoned = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(first) = poisoned.as_ref() {
            return Err(OffloadError::Failed {
                path: self.dir.path().to_path_buf(),
                first: first.clone(),
            });
        }
        match self.failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => {
                *poisoned = Some(e.to_string());
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Starts reading region `key` (`len` values) in the background, unless a read of it
    /// is already under way; [`DiskTier::read`] takes the result.
    pub(crate) fn read_ahead(&self, key: &Key, len: usize) -> Result<(), OffloadError> {
        let mut ahead = self.reads_ahead.lock().unwrap_or_else(|e| e.into_inner());
        if ahead.contains_key(key) || !self.has(key) {
            return Ok(());
        }
        ahead.insert(key.clone(), self.queue_read(key, len)?);
        Ok(())
    }

    /// Queues a read of region `key` (`len` values) behind the writes already queued.
    fn queue_read(&self, key: &Key, len: usize) -> Result<PendingRead, OffloadError> {
        let (file, path) = self.file(key)?;
        let (reply, rx) = channel();
        self.send(Job::Read {
            file,
            path,
            len,
            reply,
        })?;
        Ok(rx)
    }

    /// Region `key`'s `len` values (the read ahead's, or read now). Reads come after every
    /// write queued before them.
    pub(crate) fn read(&self, key: &Key, len: usize) -> Result<Vec<f32>, OffloadError> {
        self.check_failed()?;
        let ahead = self.take_read_ahead(key);
        let rx = match ahead {
            Some(rx) => rx,
            None => self.queue_read(key, len)?,
        };
        let values = rx.recv().map_err(|_| {
            self.io_error("reading", std::io::Error::other("the I/O thread ended"))
        })??;
        if values.len() != len {
            return Err(self.io_error(
                "reading",
                std::io::Error::other(format!("{} values where {len} were expected", values.len())),
            ));
        }
        Ok(values)
    }

    /// Writes `data` as region `key`, in the background (a failure surfaces at the next
    /// read, write or [`DiskTier::flush`]), after waiting while the writes already queued
    /// exceed the cap. A read ahead of the old contents is dropped.
    pub(crate) fn write(&self, key: &Key, data: Vec<f32>) -> Result<(), OffloadError> {
        self.check_failed()?;
        self.take_read_ahead(key);
        let (file, path) = self.file(key)?;
        let bytes = data.len() as u64 * 4;
        {
            let cap = self.write_cap.load(Ordering::Relaxed);
            let c = &self.counters;
            let mut q = c.queued.lock().unwrap_or_else(|e| e.into_inner());
            while *q > 0 && *q + bytes > cap {
                q = c.drained.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            *q += bytes;
        }
        let sent = self.send(Job::Write { file, path, data });
        if sent.is_err() {
            self.counters.written_out(bytes);
        }
        sent
    }

    /// Waits until every queued write is on its file; the first failure, naming the file.
    pub(crate) fn flush(&self) -> Result<(), OffloadError> {
        let (reply, rx) = channel();
        self.send(Job::Flush { reply })?;
        let _ = rx.recv();
        self.check_failed()
    }

    /// The read ahead of region `key`, if one is under way (dropping it discards it).
    fn take_read_ahead(&self, key: &Key) -> Option<PendingRead> {
        self.reads_ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key)
    }

    /// Drops reads ahead nobody took (a step ended without using them).
    pub(crate) fn discard_reads_ahead(&self) {
        self.reads_ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Removes region `key`'s file (a gradient block that was consumed).
    pub(crate) fn remove(&self, key: &Key) {
        self.take_read_ahead(key);
        let removed = self
            .files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        if let Some((_, path)) = removed {
            // The I/O thread may still hold the file open for a queued write; the name goes
            // now and the space when it is done.
            let _ = std::fs::remove_file(path);
        }
    }

    /// `values.len()` values of region `key` from element `offset`, read now (after the
    /// queued writes).
    pub(crate) fn read_at(
        &self,
        key: &Key,
        offset: usize,
        len: usize,
    ) -> Result<Vec<f32>, OffloadError> {
        self.flush()?;
        let (file, path) = self.file(key)?;
        let mut out = vec![0f32; len];
        read_exact(&file, &mut out, offset).map_err(|source| OffloadError::Io {
            path,
            what: format!("reading {} bytes at byte {}", len * 4, offset * 4),
            source,
        })?;
        self.counters
            .read
            .fetch_add(len as u64 * 4, Ordering::Relaxed);
        Ok(out)
    }

    /// Writes `values` into region `key` (of `region_len` values: a new file is extended to
    /// it with zeros) from element `offset`, now (after the queued writes).
    pub(crate) fn write_at(
        &self,
        key: &Key,
        offset: usize,
        values: &[f32],
        region_len: usize,
    ) -> Result<(), OffloadError> {
        self.flush()?;
        self.take_read_ahead(key);
        let (file, path) = self.file(key)?;
        let io = |what: String| {
            let path = path.clone();
            move |source| OffloadError::Io { path, what, source }
        };
        file.write_all_at(bytemuck::cast_slice(values), offset as u64 * 4)
            .map_err(io(format!(
                "writing {} bytes at byte {}",
                values.len() * 4,
                offset * 4
            )))?;
        let len = region_len as u64 * 4;
        if file
            .metadata()
            .map_err(io("reading its size".into()))?
            .len()
            < len
        {
            file.set_len(len)
                .map_err(io(format!("extending it to {len} bytes")))?;
        }
        self.counters
            .written
            .fetch_add(values.len() as u64 * 4, Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // End the I/O thread (it finishes what is queued) before the folder goes.
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder on a 256 KiB tmpfs (root only: `None` elsewhere), unmounted when dropped.
    struct SmallDisk(PathBuf);

    impl SmallDisk {
        fn mount() -> Option<SmallDisk> {
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                return None;
            }
            let dir = std::env::temp_dir().join(format!("fsdp-small-disk-{}", std::process::id()));
            std::fs::create_dir_all(&dir).ok()?;
            let ok = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
            ok.then_some(SmallDisk(dir))
        }
    }

    impl Drop for SmallDisk {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
            let _ = std::fs::remove_dir(&self.0);
        }
    }

    #[test]
    fn writes_waiting_for_the_disk_stay_under_the_cap_and_land_in_order() {
        let parent = std::env::temp_dir().join(format!("fsdp-tier-cap-{}", std::process::id()));
        let tier = DiskTier::create(&parent, 0, true, 0, "test").unwrap();
        tier.set_write_cap(3 * 4096);
        for i in 0..64usize {
            tier.write(&(i % 5, Region::Params), vec![i as f32; 1024])
                .unwrap();
            let queued = *tier.counters.queued.lock().unwrap();
            assert!(queued <= 3 * 4096, "{queued} bytes queued after write {i}");
        }
        // One write larger than the cap still goes through.
        tier.write(&(9, Region::Params), vec![7.0; 4096]).unwrap();
        tier.flush().unwrap();
        assert_eq!(*tier.counters.queued.lock().unwrap(), 0);
        for u in 0..5 {
            let last = (0..64).filter(|i| i % 5 == u).max().unwrap() as f32;
            assert_eq!(
                tier.read(&(u, Region::Params), 1024).unwrap(),
                vec![last; 1024]
            );
        }
        assert_eq!(
            tier.read(&(9, Region::Params), 4096).unwrap(),
            vec![7.0; 4096]
        );
        drop(tier);
        std::fs::remove_dir_all(&parent).unwrap();
    }

    #[test]
    fn a_full_disk_is_an_error_naming_the_file_and_the_bytes_and_later_calls_fail() {
        let Some(disk) = SmallDisk::mount() else {
            skipped!("mounting a small tmpfs needs root");
            return;
        };
        // The plan is checked first: more than the disk holds is refused before any write.
        let err = DiskTier::create(&disk.0, 0, true, 1 << 30, "the plan").unwrap_err();
        assert!(matches!(err, OffloadError::NoSpace { .. }), "{err}");
        let tier = DiskTier::create(&disk.0, 0, true, 0, "nothing").unwrap();
        let key = (3, Region::Params);
        tier.write(&key, vec![1.0; 16]).unwrap();
        assert_eq!(tier.read(&key, 16).unwrap(), vec![1.0; 16]);
        // A block larger than the disk: the write behind fails, and says where and how much.
        tier.write(&(4, Region::Grads(0)), vec![2.0; 1 << 20])
            .unwrap();
        let err = tier.flush().unwrap_err().to_string();
        assert!(err.contains("unit-00004.grads-0"), "{err}");
        assert!(err.contains(&format!("writing {} bytes", 4 << 20)), "{err}");
        assert!(err.contains("No space left on device"), "{err}");
        // The files no longer hold one consistent state: every later call says so.
        let later = tier.read(&key, 16).unwrap_err();
        assert!(matches!(later, OffloadError::Failed { .. }), "{later}");
        assert!(
            later.to_string().contains("No space left on device"),
            "{later}"
        );
        let path = tier.path().to_path_buf();
        drop(tier);
        assert!(!path.exists(), "the scratch folder is removed");
    }
}
