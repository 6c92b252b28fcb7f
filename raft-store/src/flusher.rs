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

use crate::unsynced::SyncMark;
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

/// Bytes of a file to drop from the OS page cache once a sync made them
/// durable ([`Flusher::request_dropping`]).
#[derive(Debug)]
pub struct CacheDrop {
    /// First byte, a file position.
    pub offset: u64,
    /// Length, bytes.
    pub len: u64,
    /// The durable point of the log the file belongs to: after a failed
    /// fsync of it (a trip) nothing is dropped, since a later fsync that
    /// returns success proves nothing of the pages the failed one lost
    /// ("fsyncgate"), and dropping them would turn reads of what may still
    /// be cached into reads of what the disk never got. Best effort: the
    /// kernel may evict such clean pages by itself, and an fsync outside
    /// the flusher (a seal, a clean stop) that takes a file's error races
    /// the flusher's own; what protects the data is the tripped mark and
    /// the cut of the unsynced tail at the next open ([`crate::unsynced`]).
    pub mark: Arc<SyncMark>,
}

struct Request {
    file: FileRef,
    done: Option<FlushCallback>,
    drop: Option<CacheDrop>,
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
    /// Ranges of synced files dropped from the page cache.
    pub cache_drops: AtomicU64,
    /// Drops the OS refused (`posix_fadvise` errors); they cost memory only.
    pub cache_drop_errors: AtomicU64,
    /// Set once any sync round failed: from then on nothing is dropped
    /// from the page cache, and every file gets its own `fdatasync`
    /// (never `syncfs`). A `syncfs(2)` reports an error of one log's
    /// pages once, through whichever file the round used, so after any
    /// failure the flusher cannot tell which logs are clean.
    tainted: std::sync::atomic::AtomicBool,
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
    /// The count of segment events of the logs of this data directory
    /// ([`Flusher::segment_events_total`]), watched.
    segment_events: Arc<tokio::sync::watch::Sender<u64>>,
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

    #[allow(
        clippy::disallowed_methods,
        reason = "the flusher's thread only where the file system is not a simulation's"
    )]
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
            return Ok(Self { tx: Queue::Task(tx), stats, fs, segment_events: Arc::default() });
        }
        let (tx, rx) = mpsc::sync_channel(QUEUE_REQUESTS_MAX);
        thread::Builder::new().name(format!("flusher {name}")).spawn(move || run(rx, &s, fsync))?;
        Ok(Self { tx: Queue::Thread(tx), stats, fs, segment_events: Arc::default() })
    }

    /// The file system of this flusher's data directory.
    pub fn fs(&self) -> &Fs {
        &self.fs
    }

    /// Counts a segment event of a log of this data directory (see
    /// `PartitionLog::segment_events`), waking [`Flusher::segment_event_after`].
    pub(crate) fn note_segment_event(&self) {
        self.segment_events.send_modify(|total| *total += 1);
    }

    /// The sum of the segment events of every log opened with this flusher
    /// (one broker's data directory, one load): when it has not moved, no
    /// log there rolled a segment or moved its log start.
    pub fn segment_events_total(&self) -> u64 {
        *self.segment_events.borrow()
    }

    /// Completes once [`Flusher::segment_events_total`] differs from `seen`
    /// (at once if it already does). Per flusher, so brokers of one process
    /// (a simulation, an embedding) wake only for their own logs.
    pub async fn segment_event_after(&self, seen: u64) {
        let mut events = self.segment_events.subscribe();
        // `self` holds the sender: the wait cannot fail while it is polled.
        let _ = events.wait_for(|total| *total != seen).await;
    }

    /// Queues `file` to be synced and `done` to run afterwards. With `done`
    /// = `None` the file is synced with the next round and nobody waits.
    ///
    /// If the flusher is gone (it never stops while a handle lives, so only
    /// during shutdown) the callback runs at once with an error.
    pub fn request(&self, file: FileRef, done: Option<FlushCallback>) {
        self.request_dropping(file, None, done);
    }

    /// As [`Flusher::request`], and once the sync succeeded (and the
    /// round's callbacks ran) the bytes `drop` names are dropped from the
    /// OS page cache ([`crate::vfs::VfsFile::drop_cached`]). The caller
    /// names only bytes written before this request, which its sync makes
    /// durable. Nothing is dropped after a failed sync, after any failed
    /// sync of the same log (`drop.mark` tripped) or any failed round of
    /// this flusher, or by a flusher that does not fsync (the negative
    /// control).
    pub fn request_dropping(&self, file: FileRef, drop: Option<CacheDrop>, done: Option<FlushCallback>) {
        let req = Request { file, done, drop };
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
/// and runs its callbacks with the outcome; then, if the sync succeeded,
/// drops the ranges the requests asked for from the page cache (after the
/// callbacks, so that this round's acknowledgements do not wait for it;
/// the next round does, which is why ranges are bounded, see
/// [`crate::segment::CACHE_DROP_MAX_BYTES`]).
fn finish_round(round: Vec<Request>, stats: &FlushStats, fsync: bool) {
    let result = if fsync { sync_round(&round, stats) } else { Ok(()) };
    stats.rounds.fetch_add(1, Ordering::Relaxed);
    stats.requests.fetch_add(round.len() as u64, Ordering::Relaxed);
    let mut drops = Vec::new();
    for r in round {
        if let Some(done) = r.done {
            done(match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            });
        }
        if let Some(range) = r.drop {
            drops.push((r.file, range));
        }
    }
    if result.is_err() {
        stats.tainted.store(true, Ordering::Relaxed);
    }
    if stats.tainted.load(Ordering::Relaxed) || !fsync {
        return;
    }
    for (file, drop) in drops {
        // The round's callbacks ran first, so a failure of this log's
        // earlier round has tripped its mark by now.
        if drop.mark.is_tripped() {
            continue;
        }
        // A hint: a failure costs only memory, and is counted rather than
        // logged once per round.
        let counter = match file.drop_cached(drop.offset, drop.len) {
            Ok(()) => &stats.cache_drops,
            Err(_) => &stats.cache_drop_errors,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

fn sync_round(round: &[Request], stats: &FlushStats) -> io::Result<()> {
    let mut files: Vec<&FileRef> = Vec::with_capacity(round.len());
    for r in round {
        if !files.iter().any(|f| Arc::ptr_eq(f, &r.file)) {
            files.push(&r.file);
        }
    }
    // One syncfs covers them only if they share a file system whose
    // syncfs makes data durable (not FUSE: `VfsFile::syncfs_domain`), and
    // only while no round has failed: syncfs reports a writeback error
    // once per open file, so after one a later syncfs through the same
    // file can succeed over pages the disk never got, where each file's
    // own fdatasync still reports it.
    let domain = files.first().and_then(|f| f.syncfs_domain());
    if files.len() >= SYNCFS_FILES_MIN
        && !stats.tainted.load(Ordering::Relaxed)
        && domain.is_some()
        && files.iter().all(|f| f.syncfs_domain() == domain)
    {
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

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::vfs::{Faults, FaultyFs, OpenMode};

    /// Requests `file` with a drop, its callback reporting through `mark`
    /// as a log's does, and waits for the outcome; then waits for a second
    /// round, by which the first one's drops are done.
    fn flush(flusher: &Flusher, file: &FileRef, mark: &Arc<SyncMark>) -> io::Result<()> {
        let (tx, rx) = mpsc::channel();
        let (m, covered) = (mark.clone(), mark.request(1));
        let drop = CacheDrop { offset: 0, len: 1 << 20, mark: mark.clone() };
        let done: FlushCallback = Box::new(move |r| tx.send(m.checked(r, covered)).unwrap());
        flusher.request_dropping(file.clone(), Some(drop), Some(done));
        let outcome = rx.recv_timeout(Duration::from_secs(10)).expect("the flusher answers");
        let (tx, rx) = mpsc::channel();
        flusher.request(file.clone(), Some(Box::new(move |r| tx.send(r.is_ok()).unwrap())));
        let _ = rx.recv_timeout(Duration::from_secs(10)).expect("the flusher answers");
        outcome
    }

    fn drops(flusher: &Flusher) -> u64 {
        flusher.stats().cache_drops.load(Ordering::Relaxed)
    }

    #[test]
    fn a_range_is_dropped_only_after_a_successful_sync_of_a_log_that_never_failed_one() {
        let fs = FaultyFs::new(7);
        let mount: Fs = fs.mount();
        let file = mount.open(Path::new("/seg"), OpenMode::CreateTruncate).expect("create");
        file.write_all_at(&[1; 4096], 0).expect("write");
        let flusher = Flusher::spawn_on("drops", mount.clone()).expect("flusher");

        // A healthy log: dropped.
        let healthy = Arc::new(SyncMark::new(mount.clone(), Path::new("/"), 0));
        flush(&flusher, &file, &healthy).expect("sync");
        assert_eq!(drops(&flusher), 1, "a successful sync dropped nothing");

        // A failed sync drops nothing, and neither does a later sync that
        // reports success: the cached pages may be the only good copy.
        let failing = Arc::new(SyncMark::new(mount.clone(), Path::new("/"), 0));
        file.write_all_at(&[2; 4096], 4096).expect("write");
        fs.set_faults(Faults { eio_on_sync: true, ..Faults::default() });
        assert!(flush(&flusher, &file, &failing).is_err(), "the injected EIO did not reach the callback");
        fs.set_faults(Faults::default());
        assert!(flush(&flusher, &file, &failing).is_err(), "a sync after a failed one proved something");
        assert_eq!(drops(&flusher), 1, "dropped after a failed sync of the log");
        // Nor is any other log's range: a syncfs may have reported the
        // failure through any file, so the flusher trusts none.
        flush(&flusher, &file, &healthy).expect("sync");
        assert_eq!(drops(&flusher), 1, "dropped after a failed round of the flusher");
        // The page the failed sync lost is still readable: the cache holds
        // the only copy (a drop would read zeros from the disk, as the
        // fault-injecting file system's own test shows).
        let mut page = [0u8; 4096];
        assert_eq!(file.read_at(&mut page, 4096).expect("read"), 4096);
        assert!(page.iter().all(|b| *b == 2), "the lost page's cached copy is gone");
    }

    /// Requests every file in one round (the flusher is blocked meanwhile
    /// by a first request's callback) and waits for all outcomes.
    fn flush_together(flusher: &Flusher, files: &[FileRef]) -> Vec<io::Result<()>> {
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        let (tx, rx) = mpsc::channel();
        let (first_tx, first_rx) = mpsc::channel();
        flusher.request(
            files[0].clone(),
            Some(Box::new(move |_| {
                first_tx.send(()).unwrap();
                let _ = gate_rx.recv_timeout(Duration::from_secs(10));
            })),
        );
        first_rx.recv_timeout(Duration::from_secs(10)).expect("the flusher answers");
        for f in files {
            let tx = tx.clone();
            flusher.request(f.clone(), Some(Box::new(move |r| tx.send(r).unwrap())));
        }
        drop(gate_tx);
        (0..files.len())
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).expect("the flusher answers"))
            .collect()
    }

    #[test]
    fn after_a_failed_round_every_file_gets_its_own_fdatasync_never_syncfs() {
        let fs = FaultyFs::new(9);
        let mount: Fs = fs.mount();
        let files: Vec<FileRef> = (0..SYNCFS_FILES_MIN)
            .map(|i| {
                mount.open(&Path::new("/").join(format!("f{i}")), OpenMode::CreateTruncate).expect("create")
            })
            .collect();
        let flusher = Flusher::spawn_on("syncfs", mount.clone()).expect("flusher");
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let write = |n: u8| files.iter().for_each(|f| f.write_all_at(&[n; 16], 0).expect("write"));

        write(1);
        assert!(flush_together(&flusher, &files).iter().all(Result::is_ok));
        assert_eq!(count(&flusher.stats().syncfs), 1, "a round of {SYNCFS_FILES_MIN} files used no syncfs");

        write(2);
        fs.set_faults(Faults { eio_on_sync: true, ..Faults::default() });
        assert!(
            flush_together(&flusher, &files).iter().all(Result::is_err),
            "the injected EIO was not reported"
        );
        fs.set_faults(Faults::default());

        write(3);
        let before = count(&flusher.stats().fdatasyncs);
        assert!(flush_together(&flusher, &files).iter().all(Result::is_ok));
        // (The failing step's first round, the gate's alone, already failed.)
        assert_eq!(count(&flusher.stats().syncfs), 1, "syncfs used after a failed round");
        assert!(count(&flusher.stats().fdatasyncs) >= before + files.len() as u64);
    }
}
