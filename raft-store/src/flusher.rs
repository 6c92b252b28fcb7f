//! Group commit: one flusher thread per data directory makes appends of many
//! partitions durable together.
//!
//! Appenders write their frames to the page cache, then hand the flusher the
//! file and a completion callback. The flusher takes everything queued,
//! syncs each distinct file once — or, when more than
//! [`SYNCFS_FILES_MIN`] files are dirty, the whole file system with one
//! `syncfs(2)` — and then runs every callback. So N busy partitions cost one
//! sync round, not N fsyncs each, and a round's latency is shared by
//! everything that arrived during the previous one.
//!
//! ```text
//!  partition A ─ write ─┐                      ┌─> A's callbacks
//!  partition B ─ write ─┼─> queue ─> flusher ──┼─> B's callbacks
//!  partition C ─ write ─┘   (bounded)  fdatasync ×k or syncfs ×1
//! ```
//!
//! On a file system that asks for it ([`crate::vfs::Vfs::background_on_runtime`]:
//! a deterministic simulation's in-memory disk) the rounds run in a task of
//! the tokio runtime that starts the flusher instead of on a thread.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::thread;

use crate::vfs::{FileRef, Fs};

/// Above this many distinct dirty files in one round, one `syncfs(2)`
/// replaces per-file `fdatasync(2)` calls.
pub const SYNCFS_FILES_MIN: usize = 8;
/// Capacity of the flusher's queue, requests. Appenders block when it is
/// full, which is the back-pressure a saturated disk should exert.
pub const QUEUE_REQUESTS_MAX: usize = 65_536;
/// Most requests taken into one round.
const ROUND_REQUESTS_MAX: usize = 16_384;

/// What to run when the data is durable (or the sync failed).
pub type FlushCallback = Box<dyn FnOnce(io::Result<()>) + Send>;

struct Request {
    file: FileRef,
    done: Option<FlushCallback>,
}

/// The way to the flusher: its thread's bounded queue, or its task's.
#[derive(Clone)]
enum Queue {
    Thread(SyncSender<Request>),
    Task(tokio::sync::mpsc::UnboundedSender<Request>),
}

/// Counters of a flusher, for benchmarks and metrics.
#[derive(Debug, Default)]
pub struct FlushStats {
    /// Sync rounds run.
    pub rounds: AtomicU64,
    /// `fdatasync(2)` calls made.
    pub fdatasyncs: AtomicU64,
    /// `syncfs(2)` calls made.
    pub syncfs: AtomicU64,
    /// Requests completed.
    pub requests: AtomicU64,
}

/// Handle to the flusher of one data directory. Cloning shares it; the
/// thread (or task) ends when the last handle is dropped and the queue is
/// drained.
///
/// A data directory is one file system, so the flusher also carries the
/// [`Fs`] its replicas' files live on: everything opened with this flusher
/// reads and writes through it.
#[derive(Clone)]
pub struct Flusher {
    tx: Queue,
    stats: Arc<FlushStats>,
    fs: Fs,
}

impl std::fmt::Debug for Flusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flusher").field("stats", &self.stats).finish()
    }
}

impl Flusher {
    /// Starts a flusher thread named after `name` (the data directory).
    ///
    /// # Errors
    /// `io::Error` if the thread cannot be spawned.
    pub fn spawn(name: &str) -> io::Result<Self> {
        Self::spawn_on(name, crate::vfs::real())
    }

    /// As [`Flusher::spawn`], for a data directory on file system `fs`
    /// (tests: [`crate::vfs::FaultyFs`]); a task of the current tokio
    /// runtime instead of a thread if `fs` asks for it
    /// ([`crate::vfs::Vfs::background_on_runtime`]).
    ///
    /// # Errors
    /// `io::Error` if the thread cannot be spawned, or if a task is asked
    /// for outside a tokio runtime.
    pub fn spawn_on(name: &str, fs: Fs) -> io::Result<Self> {
        Self::spawn_with(name, fs, true)
    }

    /// A flusher that never calls fsync yet reports every flush done: the
    /// negative control of the power-loss tests, which must see it lose
    /// acknowledged entries. Compiled only with the `test-switches`
    /// feature, which no release build enables.
    ///
    /// # Errors
    /// `io::Error` if the thread cannot be spawned.
    #[cfg(feature = "test-switches")]
    pub fn spawn_without_fsync_unsafe(name: &str, fs: Fs) -> io::Result<Self> {
        Self::spawn_with(name, fs, false)
    }

    fn spawn_with(name: &str, fs: Fs, fsync: bool) -> io::Result<Self> {
        let stats = Arc::new(FlushStats::default());
        let s = stats.clone();
        if fs.background_on_runtime() {
            let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
                io::Error::other(format!(
                    "the flusher of {name} runs on a tokio runtime, and there is none: {e}"
                ))
            })?;
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            runtime.spawn(run_task(rx, s, fsync));
            return Ok(Self { tx: Queue::Task(tx), stats, fs });
        }
        let (tx, rx) = mpsc::sync_channel(QUEUE_REQUESTS_MAX);
        thread::Builder::new().name(format!("flusher {name}")).spawn(move || run(rx, &s, fsync))?;
        Ok(Self { tx: Queue::Thread(tx), stats, fs })
    }

    /// The file system of this flusher's data directory.
    pub fn fs(&self) -> &Fs {
        &self.fs
    }

    /// Queues `file` to be synced and `done` to run afterwards. With `done`
    /// = `None` the file is synced with the next round and nobody waits.
    ///
    /// If the flusher is gone (it never stops while a handle lives, so only
    /// during shutdown) the callback runs at once with an error.
    pub fn request(&self, file: FileRef, done: Option<FlushCallback>) {
        let req = Request { file, done };
        let req = match &self.tx {
            Queue::Thread(tx) => match tx.try_send(req) {
                Ok(()) => return,
                Err(TrySendError::Full(req)) => match tx.send(req) {
                    Ok(()) => return,
                    Err(e) => e.0,
                },
                Err(TrySendError::Disconnected(req)) => req,
            },
            Queue::Task(tx) => match tx.send(req) {
                Ok(()) => return,
                Err(e) => e.0,
            },
        };
        if let Some(done) = req.done {
            done(Err(io::Error::other("flusher stopped")));
        }
    }

    /// The flusher's counters.
    pub fn stats(&self) -> &Arc<FlushStats> {
        &self.stats
    }
}

fn run(rx: Receiver<Request>, stats: &FlushStats, fsync: bool) {
    while let Ok(first) = rx.recv() {
        finish_round(round_from(first, || rx.try_recv().ok()), stats, fsync);
    }
}

/// The flusher as a task: as [`run`], taking what is queued when it runs.
async fn run_task(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Request>,
    stats: Arc<FlushStats>,
    fsync: bool,
) {
    while let Some(first) = rx.recv().await {
        finish_round(round_from(first, || rx.try_recv().ok()), &stats, fsync);
    }
}

/// One round: `first` and what else is queued (`next`), up to
/// [`ROUND_REQUESTS_MAX`] requests.
fn round_from(first: Request, mut next: impl FnMut() -> Option<Request>) -> Vec<Request> {
    let mut round = vec![first];
    while round.len() < ROUND_REQUESTS_MAX {
        match next() {
            Some(r) => round.push(r),
            None => break,
        }
    }
    round
}

/// Syncs one round's files (unless `fsync` is off: the negative control)
/// and runs its callbacks with the outcome.
fn finish_round(round: Vec<Request>, stats: &FlushStats, fsync: bool) {
    let result = if fsync { sync_round(&round, stats) } else { Ok(()) };
    stats.rounds.fetch_add(1, Ordering::Relaxed);
    stats.requests.fetch_add(round.len() as u64, Ordering::Relaxed);
    for r in round {
        if let Some(done) = r.done {
            done(match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            });
        }
    }
}

fn sync_round(round: &[Request], stats: &FlushStats) -> io::Result<()> {
    let mut files: Vec<&FileRef> = Vec::with_capacity(round.len());
    for r in round {
        if !files.iter().any(|f| Arc::ptr_eq(f, &r.file)) {
            files.push(&r.file);
        }
    }
    if files.len() >= SYNCFS_FILES_MIN {
        stats.syncfs.fetch_add(1, Ordering::Relaxed);
        return files[0].sync_file_system();
    }
    let mut result = Ok(());
    for f in files {
        stats.fdatasyncs.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = f.sync_data() {
            result = Err(e);
        }
    }
    result
}
