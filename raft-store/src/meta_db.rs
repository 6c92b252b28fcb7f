//! One metadata database per directory of replicas, written by one thread
//! that commits many replicas' changes together.
//!
//! Every replica keeps a few small values (its vote, commit index, purge
//! pointer, snapshot record: see [`meta`](crate::meta)). Kept in a database
//! of its own, each replica paid a redb file, an open descriptor, a page
//! cache and one fsynced commit per saved vote: at creation of thousands of
//! partitions, opening those files and fsyncing one vote at a time was a
//! third of the brokers' work. Here all replicas under one directory share
//! `replica-meta.redb` in it, keyed `"<replica dir, relative>/<key>"`:
//!
//! ```text
//!  replica A ─ put(vote, durable) ──┐                 ┌─> A's waiter
//!  replica B ─ put(vote, durable) ──┼─> queue ─> one ─┼─> B's waiter
//!  replica C ─ put(committed, lazy)─┘  (lazy:   write txn, fsynced if any
//!                                       latest   durable put is in it
//!                                       per key)
//! ```
//!
//! - A durable put resolves once a commit with `Durability::Immediate`
//!   holds it; every durable put queued meanwhile joins that commit (group
//!   commit).
//! - A lazy put returns at once; the value is committed with the next round
//!   and made durable by the next durable commit, which the writer makes
//!   itself within [`LAZY_DURABLE_WITHIN`] (and when the database closes).
//!   Lazy values alone start a round at most every [`LAZY_ROUND_EVERY`]
//!   (a durable put starts one at once and takes them along).
//!   Of several lazy puts of one key before a round, only the last is
//!   written; a lazy put is newer than any durable put of its key queued
//!   before it, and is written after it. A crash may roll a lazy value back
//!   to an older one, never tear it.
//! - A commit that fails with an IO error fails the durable puts in it and
//!   the database is reopened (as after a crash) for the next round; lazy
//!   values not yet durable are written again then.
//! - One replica name is open once at a time (a second open is refused, as
//!   redb refused a second open of a replica's own file); removing a
//!   replica invalidates its handle, whose later writes are refused.
//! - Opening the database removes the keys of replica directories that no
//!   longer exist (a replica removed by a crash half way, or by hand), so a
//!   directory created later under the same name starts with no metadata.
//!   Only a directory the file system says is not there counts as gone: any
//!   other error stops the open.
//!
//! On a file system that asks for it ([`crate::vfs::Vfs::background_on_runtime`]:
//! a deterministic simulation's in-memory disk, everything on one thread)
//! there is no writer thread: a call that queues a durable operation runs
//! the round itself before it returns, and a task of the tokio runtime
//! that opened the database runs the rounds of lazy values when they are due.
//!
//! A corrupt `replica-meta.redb` stops every replica of its directory (a
//! broker's partitions), where a corrupt per-replica file stopped one.
//!
//! redb refuses to open one file twice in a process, so databases are
//! shared through a process-wide registry keyed by directory; the database
//! closes (its lazy values made durable) when the last handle is dropped.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

// tokio's clock: the OS's monotonic clock, except in a simulation whose
// runtime pauses time (then it is the simulated time).
use tokio::time::Instant;

use futures::channel::oneshot;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

use crate::error::{Result, StoreError};
use crate::vfs::{FileRef, Fs, OpenMode};

/// File name of the shared metadata database in a directory of replicas.
pub const META_DB_FILE: &str = "replica-meta.redb";

/// A lazy value is made durable (by a commit of the writer's own) at most
/// this long after it was written.
pub const LAZY_DURABLE_WITHIN: Duration = Duration::from_secs(1);

/// Lazy values alone start a round (a commit that is not fsynced) at most
/// this often. Every commit index a replica saves is a lazy put: with one
/// batch in flight, a round per put was a redb transaction per record on
/// every broker (7% of the machine at 760 records/s, 2026-12-02), although
/// nothing reads a lazy value back before the next round and a crash may
/// roll it back anyway.
pub const LAZY_ROUND_EVERY: Duration = Duration::from_millis(50);

const TABLE: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("replica_meta");

/// redb's page cache for one shared database, bytes. The whole database of
/// 10,000 replicas is a few MiB.
const CACHE_BYTES: usize = 4 << 20;

/// Most queued operations taken into one commit.
const ROUND_OPS_MAX: usize = 8192;

/// How long an open waits for an instance of the same database that is
/// still closing in this process (its last handle was just dropped).
const REOPEN_WAIT: Duration = Duration::from_secs(5);

/// Counters of a shared database, for tests and benchmarks.
#[derive(Debug, Default)]
pub struct MetaDbStats {
    /// Write transactions committed.
    pub commits: AtomicU64,
    /// Of which with `Durability::Immediate` (each an fsync or two).
    pub durable_commits: AtomicU64,
    /// Durable puts and removals acknowledged.
    pub durable_writes: AtomicU64,
    /// Lazy values written (after coalescing).
    pub lazy_writes: AtomicU64,
    /// Times the database was opened (1 + reopens after errors).
    pub opens: AtomicU64,
}

type Reply<T> = oneshot::Sender<std::result::Result<T, String>>;

enum Op {
    /// Write (or, with `None`, remove) durably.
    Put { key: String, value: Option<Vec<u8>>, done: Reply<()> },
    /// Remove every key under `prefix` durably.
    RemovePrefix { prefix: String, done: Reply<()> },
    /// Read every key under `prefix`, after everything queued before it.
    Load { prefix: String, done: Reply<Vec<(String, Vec<u8>)>> },
}

impl Op {
    fn writes(&self) -> bool {
        !matches!(self, Op::Load { .. })
    }
}

/// Ordered, so that a round writes its keys in the same order every time.
type Values = BTreeMap<String, Option<Vec<u8>>>;

#[derive(Default)]
struct Queue {
    ops: Vec<Op>,
    /// Latest lazy value per key (newer than any queued durable put of it).
    lazy: Values,
    /// The open replica names and the id of the handle that holds each.
    open: HashMap<String, u64>,
    next_handle: u64,
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Wakes the writer: a thread, or a task.
    wake: Condvar,
    wake_task: tokio::sync::Notify,
    stats: MetaDbStats,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(&self) {
        self.wake.notify_one();
        self.wake_task.notify_one();
    }
}

/// The shared metadata database of one directory of replicas. Obtained with
/// [`MetaDb::open`]; cheap to share (`Arc`).
pub struct MetaDb {
    /// The file system the database and the replica directories are on.
    fs: Fs,
    /// The directory as given (made absolute), and resolved.
    given: PathBuf,
    dir: PathBuf,
    path: PathBuf,
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// The writer, when rounds run in the callers and a runtime task
    /// instead of a thread of its own (see the module's documentation).
    inline: Option<Arc<Mutex<Writer>>>,
}

impl std::fmt::Debug for MetaDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaDb").field("path", &self.path).finish_non_exhaustive()
    }
}

/// A replica's claim on its name in a [`MetaDb`] (see [`MetaDb::claim`]).
#[derive(Debug)]
pub struct Claim {
    name: String,
    id: u64,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Drop for Claim {
    /// Gives up the claim (the replica closed, or failed to open). Its
    /// queued writes still land.
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        if q.open.get(&self.name) == Some(&self.id) {
            q.open.remove(&self.name);
        }
    }
}

impl Claim {
    /// The replica's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Open databases, by file-system incarnation and resolved directory.
type Registry = HashMap<(u64, PathBuf), Weak<MetaDb>>;
static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Default::default);

impl MetaDb {
    /// The database of the replicas in `dir` (which must exist), opened (or
    /// created) on first use in this process and shared after that.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if redb cannot create or open it (also when
    /// another process has it open), [`StoreError::Io`] for file errors,
    /// including one that leaves unclear whether a replica directory exists.
    pub fn open(dir: &Path) -> Result<Arc<Self>> {
        Self::open_on(&crate::vfs::real(), dir)
    }

    /// As [`MetaDb::open`], on file system `fs` (tests:
    /// [`crate::vfs::FaultyFs`]); databases are shared per file-system
    /// incarnation and directory.
    ///
    /// # Errors
    /// As [`MetaDb::open`].
    #[allow(
        clippy::disallowed_methods,
        reason = "the writer's thread only where the file system is not a simulation's"
    )]
    pub fn open_on(fs: &Fs, dir: &Path) -> Result<Arc<Self>> {
        let given = if fs.is_os() {
            std::path::absolute(dir).map_err(|e| StoreError::io("resolve", dir, e))?
        } else {
            dir.to_owned()
        };
        let dir = fs.canonicalize(dir).map_err(|e| StoreError::io("resolve", dir, e))?;
        let key = (fs.incarnation(), dir.clone());
        let mut registry = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(db) = registry.get(&key).and_then(Weak::upgrade) {
            return Ok(db);
        }
        registry.retain(|_, w| w.strong_count() > 0);
        let path = dir.join(META_DB_FILE);
        let db = open_database(fs, &path)?;
        remove_orphans(fs, &db, &dir, &path)?;
        let shared = Arc::new(Shared {
            queue: Mutex::default(),
            wake: Condvar::new(),
            wake_task: tokio::sync::Notify::new(),
            stats: MetaDbStats::default(),
        });
        shared.stats.opens.fetch_add(1, Ordering::Relaxed);
        let mut w = Writer {
            db: Some(db),
            fs: fs.clone(),
            path: path.clone(),
            shared: shared.clone(),
            since_durable: Values::new(),
            last_durable: Instant::now(),
            rewrite_lazy: false,
            retry_at: None,
            retry_after: RETRY_FIRST,
            last_round: Instant::now(),
            done: false,
        };
        let (writer, inline) = if fs.background_on_runtime() {
            let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
                StoreError::io("start the metadata writer task for", &dir, std::io::Error::other(e))
            })?;
            let w = Arc::new(Mutex::new(w));
            runtime.spawn(run_lazy_rounds(w.clone(), shared.clone()));
            (None, Some(w))
        } else {
            let thread = std::thread::Builder::new()
                .name("replica-meta".into())
                .spawn(move || w.run())
                .map_err(|e| StoreError::io("spawn the metadata writer for", &dir, e))?;
            (Some(thread), None)
        };
        let me =
            Arc::new(Self { fs: fs.clone(), given, dir, path, shared, writer: Mutex::new(writer), inline });
        registry.insert(key, Arc::downgrade(&me));
        Ok(me)
    }

    /// The directory of replicas it serves (resolved: no symbolic links).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The directory of replicas it serves, as given to [`MetaDb::open`]
    /// (made absolute).
    pub fn given_dir(&self) -> &Path {
        &self.given
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file system it is on.
    pub fn fs(&self) -> &Fs {
        &self.fs
    }

    /// Its counters.
    pub fn stats(&self) -> &MetaDbStats {
        &self.shared.stats
    }

    /// Claims replica `name`: only the holder of the claim writes its keys,
    /// until the claim is dropped or the replica removed.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the name is claimed already (the replica is
    /// open).
    pub fn claim(&self, name: &str) -> Result<Claim> {
        let mut q = self.shared.lock();
        if q.open.contains_key(name) {
            return Err(self.err(format!("replica {name} is open already")));
        }
        q.next_handle += 1;
        let id = q.next_handle;
        q.open.insert(name.to_owned(), id);
        Ok(Claim { name: name.to_owned(), id, shared: self.shared.clone() })
    }

    /// Takes replica `name`'s claim over from whoever holds it, for a
    /// replica reopened in place while the handle that held the claim may
    /// still be alive (see `Replica::reopen`): from now on only the new
    /// claim writes the replica's keys; the old one's writes are refused
    /// ("removed or reopened") and its drop leaves the new claim alone.
    /// Writes the old claim queued before this call still land. Only the
    /// holder of the claim may call it (it is not checked): a stale handle
    /// reclaiming would cut off the live one.
    pub fn reclaim(&self, name: &str) -> Claim {
        let mut q = self.shared.lock();
        q.next_handle += 1;
        let id = q.next_handle;
        q.open.insert(name.to_owned(), id);
        Claim { name: name.to_owned(), id, shared: self.shared.clone() }
    }

    /// Writes `value` under the claimed replica's `key` (removes the key for
    /// `None`); the future resolves once a durable commit holds it.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the claim is no longer held (the replica was
    /// removed) or the commit failed (e.g. a full disk).
    pub fn put_durable(
        &self,
        claim: &Claim,
        key: &str,
        value: Option<Vec<u8>>,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let (done, rx) = oneshot::channel();
        let key = full_key(&claim.name, key);
        let refused = {
            let mut q = self.shared.lock();
            if q.open.get(&claim.name) == Some(&claim.id) {
                q.lazy.remove(&key);
                q.ops.push(Op::Put { key, value, done });
                None
            } else {
                Some(self.err(format!("replica {} was removed or reopened: write refused", claim.name)))
            }
        };
        self.wake();
        let answer = self.answer(rx);
        async move {
            match refused {
                Some(e) => Err(e),
                None => answer.await,
            }
        }
    }

    /// Queues `value` under the claimed replica's `key` (removes it for
    /// `None`) for the next commit, without waiting. A failure is logged,
    /// not reported: a lazy value may always roll back. Dropped if the
    /// claim is no longer held.
    pub fn put_lazy(&self, claim: &Claim, key: &str, value: Option<Vec<u8>>) {
        let mut q = self.shared.lock();
        if q.open.get(&claim.name) == Some(&claim.id) {
            // The writer schedules its round when the first lazy value
            // comes; later ones do not move it.
            let first = q.lazy.is_empty();
            q.lazy.insert(full_key(&claim.name, key), value);
            drop(q);
            if first {
                self.wake();
            }
        }
    }

    /// Removes every key of replica `name` durably; a claim on it ends
    /// (later writes through it are refused).
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the commit failed.
    pub fn remove_replica(&self, name: &str) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let prefix = prefix_of(name);
        let (done, rx) = oneshot::channel();
        {
            let mut q = self.shared.lock();
            q.open.remove(name);
            q.lazy.retain(|k, _| !k.starts_with(&prefix));
            q.ops.push(Op::RemovePrefix { prefix, done });
        }
        self.wake();
        self.answer(rx)
    }

    /// Replaces every key of the claimed replica with `rows` (key, value)
    /// durably; the future resolves once all are durable.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if a commit failed.
    pub fn replace(
        &self,
        claim: &Claim,
        rows: Vec<(String, Vec<u8>)>,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let prefix = prefix_of(&claim.name);
        let mut answers = Vec::with_capacity(rows.len() + 1);
        {
            let mut q = self.shared.lock();
            q.lazy.retain(|k, _| !k.starts_with(&prefix));
            let (done, rx) = oneshot::channel();
            q.ops.push(Op::RemovePrefix { prefix, done });
            answers.push(self.answer(rx));
            for (key, value) in rows {
                let (done, rx) = oneshot::channel();
                q.ops.push(Op::Put { key: full_key(&claim.name, &key), value: Some(value), done });
                answers.push(self.answer(rx));
            }
        }
        self.wake();
        async move {
            for a in answers {
                a.await?;
            }
            Ok(())
        }
    }

    /// Every key of the claimed replica (without the prefix) and its value,
    /// as of after everything queued before this call. With `fresh` (a
    /// replica just created), its keys are removed first, durably: any left
    /// by an earlier replica of that name are not its own.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the read (or the commit before it) failed.
    pub fn load(
        &self,
        claim: &Claim,
        fresh: bool,
    ) -> impl Future<Output = Result<Vec<(String, Vec<u8>)>>> + Send + 'static + use<> {
        let prefix = prefix_of(&claim.name);
        let (done, rx) = oneshot::channel();
        let mut removed = None;
        {
            let mut q = self.shared.lock();
            if fresh {
                q.lazy.retain(|k, _| !k.starts_with(&prefix));
                let (done, rx) = oneshot::channel();
                q.ops.push(Op::RemovePrefix { prefix: prefix.clone(), done });
                removed = Some(self.answer(rx));
            }
            q.ops.push(Op::Load { prefix: prefix.clone(), done });
        }
        self.wake();
        let rows = self.answer(rx);
        async move {
            // A failed removal must not let the load hand back old keys.
            if let Some(removed) = removed {
                removed.await?;
            }
            let rows = rows.await?;
            Ok(rows.into_iter().map(|(k, v)| (k[prefix.len()..].to_owned(), v)).collect())
        }
    }

    fn err(&self, detail: String) -> StoreError {
        StoreError::Meta { path: self.path.clone(), detail }
    }

    /// Wakes the writer; without a writer thread, runs the rounds of what
    /// is queued here and now.
    fn wake(&self) {
        match &self.inline {
            None => self.shared.wake(),
            Some(writer) => {
                // The lazy rounds' task reconsiders its wait.
                self.shared.wake_task.notify_one();
                let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
                while !w.done {
                    let round = {
                        let mut q = self.shared.lock();
                        if q.ops.is_empty() && !q.closed {
                            break;
                        }
                        take_round(&mut q)
                    };
                    w.run_round(round.0, round.1, round.2);
                }
            }
        }
    }

    fn answer<T: Send + 'static>(
        &self,
        rx: oneshot::Receiver<std::result::Result<T, String>>,
    ) -> impl Future<Output = Result<T>> + Send + 'static + use<T> {
        let path = self.path.clone();
        async move {
            match rx.await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(detail)) => Err(StoreError::Meta { path, detail }),
                Err(_) => Err(StoreError::Meta { path, detail: "the metadata writer stopped".into() }),
            }
        }
    }
}

impl Drop for MetaDb {
    /// Stops the writer after it has committed (durably) what is queued, so
    /// the file is closed when this returns and can be opened again (the
    /// writer thread is joined; without one, the closing round runs here).
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.wake();
        if let Some(writer) = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = writer.join();
        }
    }
}

/// The key prefix of replica `name` (its directory's path relative to the
/// database's): the name and a slash. Keys after it contain none.
fn prefix_of(name: &str) -> String {
    format!("{name}/")
}

fn full_key(name: &str, key: &str) -> String {
    debug_assert!(!key.contains('/'), "key names contain no slash");
    format!("{name}/{key}")
}

/// The end (exclusive) of the key range of `prefix` (`"a/"` → `"a0"`:
/// `'0'` follows `'/'`).
fn prefix_end(prefix: &str) -> String {
    format!("{}0", &prefix[..prefix.len() - 1])
}

fn meta_err(path: &Path, e: impl std::fmt::Display) -> StoreError {
    StoreError::Meta { path: path.to_owned(), detail: e.to_string() }
}

/// Whether a directory entry exists at `path`, not following a final
/// symbolic link (on the OS's file system); only "not found" counts as
/// absent.
fn entry_exists(fs: &Fs, path: &Path) -> Result<bool> {
    if !fs.is_os() {
        return crate::fsutil::exists(&**fs, path);
    }
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(StoreError::io("stat", path, e)),
    }
}

/// Opens the database file, creating it atomically if missing; waits up to
/// [`REOPEN_WAIT`] for an instance of it still closing in this process.
fn open_database(fs: &Fs, path: &Path) -> Result<Database> {
    if !crate::fsutil::exists(&**fs, path)? {
        // redb's first write of a new file is not atomic: a crash during it
        // leaves a file redb refuses to open. Create it aside, make it
        // durable, then link it into place (which, unlike a rename, never
        // replaces a file that appeared meanwhile).
        let fresh = path.with_extension("redb-new");
        crate::fsutil::remove_if_exists(&**fs, &fresh)?;
        drop(create(fs, &fresh, OpenMode::CreateTruncate).map_err(|e| meta_err(&fresh, e))?);
        fs.open(&fresh, OpenMode::Read)
            .and_then(|f| f.sync_data())
            .map_err(|e| StoreError::io("fsync", &fresh, e))?;
        match fs.hard_link(&fresh, path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::io("link", path, e)),
        }
        crate::fsutil::remove_if_exists(&**fs, &fresh)?;
        crate::fsutil::sync_dir(&**fs, path.parent().unwrap_or(Path::new(".")))?;
    }
    let started = std::time::Instant::now();
    loop {
        match create(fs, path, OpenMode::ReadWrite) {
            Ok(db) => {
                // Create the table so reads never find it missing.
                let txn = db.begin_write().map_err(|e| meta_err(path, e))?;
                txn.open_table(TABLE).map_err(|e| meta_err(path, e))?;
                txn.commit().map_err(|e| meta_err(path, e))?;
                return Ok(db);
            }
            Err(redb::DatabaseError::DatabaseAlreadyOpen) if started.elapsed() < REOPEN_WAIT => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(meta_err(path, e)),
        }
    }
}

/// Opens (or with `OpenMode::CreateTruncate` creates) the database at
/// `path`: through redb's own file handling on the OS's file system (which
/// also locks the file against other processes), through a
/// [`VfsBackend`] on any other.
fn create(fs: &Fs, path: &Path, mode: OpenMode) -> std::result::Result<Database, redb::DatabaseError> {
    let mut builder = redb::Builder::new();
    builder.set_cache_size(CACHE_BYTES);
    if fs.is_os() {
        return builder.create(path);
    }
    let file = fs.open(path, mode).map_err(|e| redb::DatabaseError::Storage(redb::StorageError::Io(e)))?;
    builder.create_with_backend(VfsBackend(file))
}

/// A redb storage backend over a [`crate::vfs::VfsFile`], so the metadata
/// lives on the same (possibly fault-injecting) file system as the logs.
#[derive(Debug)]
struct VfsBackend(FileRef);

impl redb::StorageBackend for VfsBackend {
    fn len(&self) -> std::result::Result<u64, std::io::Error> {
        self.0.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::result::Result<(), std::io::Error> {
        let mut done = 0;
        while done < out.len() {
            match self.0.read_at(&mut out[done..], offset + done as u64)? {
                0 => return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "read past the end")),
                n => done += n,
            }
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::result::Result<(), std::io::Error> {
        self.0.set_len(len)
    }

    fn sync_data(&self) -> std::result::Result<(), std::io::Error> {
        self.0.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::result::Result<(), std::io::Error> {
        self.0.write_all_at(data, offset)
    }
}

/// Removes (durably) the keys of replicas whose directory under `dir` does
/// not exist.
fn remove_orphans(fs: &Fs, db: &Database, dir: &Path, path: &Path) -> Result<()> {
    let mut orphans: Vec<String> = Vec::new();
    {
        let txn = db.begin_read().map_err(|e| meta_err(path, e))?;
        let table = txn.open_table(TABLE).map_err(|e| meta_err(path, e))?;
        let mut last: Option<String> = None;
        for row in table.iter().map_err(|e| meta_err(path, e))? {
            let (k, _) = row.map_err(|e| meta_err(path, e))?;
            let key = k.value();
            let name = key.rsplit_once('/').map_or(key, |(n, _)| n);
            if last.as_deref() == Some(name) {
                continue;
            }
            last = Some(name.to_owned());
            // A symbolic link counts as present even if what it points
            // to is missing (a disk not mounted): only a missing entry is gone.
            if !entry_exists(fs, &dir.join(name))? {
                orphans.push(name.to_owned());
            }
        }
    }
    if orphans.is_empty() {
        return Ok(());
    }
    let txn = db.begin_write().map_err(|e| meta_err(path, e))?;
    {
        let mut table = txn.open_table(TABLE).map_err(|e| meta_err(path, e))?;
        for name in &orphans {
            let prefix = prefix_of(name);
            let end = prefix_end(&prefix);
            table.retain_in(prefix.as_str()..end.as_str(), |_, _| false).map_err(|e| meta_err(path, e))?;
        }
    }
    txn.commit().map_err(|e| meta_err(path, e))?;
    tracing::info!(db = %path.display(), replicas = orphans.len(), "removed the metadata of replica directories that no longer exist");
    Ok(())
}

/// One write transaction: the `earlier` lazy values, `ops` in order, then
/// this round's `lazy` values (each newer than the one before).
fn write(
    db: &Database,
    earlier: &Values,
    ops: &[Op],
    lazy: &Values,
    durable: bool,
) -> std::result::Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(if durable { Durability::Immediate } else { Durability::None })?;
    {
        let mut table = txn.open_table(TABLE)?;
        let put_values = |table: &mut redb::Table<'_, &str, &[u8]>,
                          values: &Values|
         -> std::result::Result<(), redb::Error> {
            for (key, value) in values {
                match value {
                    Some(v) => table.insert(key.as_str(), v.as_slice()).map(drop)?,
                    None => table.remove(key.as_str()).map(drop)?,
                }
            }
            Ok(())
        };
        put_values(&mut table, earlier)?;
        for op in ops {
            match op {
                Op::Put { key, value: Some(v), .. } => {
                    table.insert(key.as_str(), v.as_slice())?;
                }
                Op::Put { key, value: None, .. } => {
                    table.remove(key.as_str())?;
                }
                Op::RemovePrefix { prefix, .. } => {
                    let end = prefix_end(prefix);
                    table.retain_in(prefix.as_str()..end.as_str(), |_, _| false)?;
                }
                Op::Load { .. } => {}
            }
        }
        put_values(&mut table, lazy)?;
    }
    txn.commit()?;
    Ok(())
}

/// What owns the database and commits rounds of operations: run by its
/// thread, or (see the module's documentation) by callers and a task.
struct Writer {
    db: Option<Database>,
    fs: Fs,
    path: PathBuf,
    shared: Arc<Shared>,
    /// Lazy values committed since the last durable commit: written again
    /// after a reopen (which rolls them back).
    since_durable: Values,
    last_durable: Instant,
    /// The last commit failed: the next writes all of `since_durable`.
    rewrite_lazy: bool,
    /// After a failed round: no round for lazy values alone before this.
    retry_at: Option<Instant>,
    /// The wait before the next retry, doubling up to [`LAZY_DURABLE_WITHIN`].
    retry_after: Duration,
    /// When the last round ended ([`LAZY_ROUND_EVERY`]).
    last_round: Instant,
    /// The closing round has run.
    done: bool,
}

/// Without a writer thread, the task that runs the rounds of lazy values
/// (and makes them durable) when they are due, until the database closes.
async fn run_lazy_rounds(writer: Arc<Mutex<Writer>>, shared: Arc<Shared>) {
    loop {
        let wait = {
            let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
            if w.done {
                return;
            }
            let mut q = shared.lock();
            match w.wait_before_round(&q) {
                Some(left) if left.is_zero() => {
                    let (ops, lazy, closing) = take_round(&mut q);
                    drop(q);
                    w.run_round(ops, lazy, closing);
                    continue;
                }
                other => other,
            }
        };
        // A wake-up given while the task did not wait is kept for its next wait.
        match wait {
            Some(left) => {
                let _ = tokio::time::timeout(left, shared.wake_task.notified()).await;
            }
            None => shared.wake_task.notified().await,
        }
    }
}

/// Takes the next round's work off the queue: operations, lazy values, and
/// whether the database closes after it.
fn take_round(q: &mut Queue) -> (Vec<Op>, Values, bool) {
    let take = q.ops.len().min(ROUND_OPS_MAX);
    let ops: Vec<Op> = q.ops.drain(..take).collect();
    // Lazy values are newer than every durable put of their key queued
    // before them: take them only with all of those.
    let lazy = if q.ops.is_empty() { std::mem::take(&mut q.lazy) } else { Values::new() };
    (ops, lazy, q.closed && q.ops.is_empty())
}

/// The first wait before a failed round's lazy values are tried again.
const RETRY_FIRST: Duration = Duration::from_millis(10);

impl Writer {
    /// The writer as a thread: waits for work, runs rounds, until closed.
    fn run(&mut self) {
        loop {
            let (ops, lazy, closing) = {
                let mut q = self.shared.lock();
                loop {
                    match self.wait_before_round(&q) {
                        Some(left) if left.is_zero() => break,
                        Some(left) => {
                            q = self.shared.wake.wait_timeout(q, left).unwrap_or_else(|p| p.into_inner()).0;
                        }
                        None => q = self.shared.wake.wait(q).unwrap_or_else(|p| p.into_inner()),
                    }
                }
                take_round(&mut q)
            };
            if self.run_round(ops, lazy, closing) {
                return;
            }
        }
    }

    /// How long to wait before the next round (zero: now; `None`: until
    /// woken), given what is queued.
    fn wait_before_round(&self, q: &Queue) -> Option<Duration> {
        // After a failed round, lazy work waits for the retry (a full or
        // failing disk must not make this spin).
        let retry_wait =
            self.retry_at.map_or(Duration::ZERO, |t| t.saturating_duration_since(Instant::now()));
        // Lazy values alone wait for their round.
        let lazy_in = (!q.lazy.is_empty())
            .then(|| LAZY_ROUND_EVERY.saturating_sub(self.last_round.elapsed()).max(retry_wait));
        if !q.ops.is_empty() || q.closed || lazy_in == Some(Duration::ZERO) {
            return Some(Duration::ZERO);
        }
        if self.since_durable.is_empty() && q.lazy.is_empty() {
            return None;
        }
        let durable_in = LAZY_DURABLE_WITHIN.saturating_sub(self.last_durable.elapsed()).max(retry_wait);
        Some(lazy_in.map_or(durable_in, |l| l.min(durable_in)))
    }

    /// Runs one round; whether it was the last (the database closed).
    fn run_round(&mut self, ops: Vec<Op>, lazy: Values, closing: bool) -> bool {
        let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.round(ops, lazy, closing)));
        self.last_round = Instant::now();
        if round.is_err() {
            // Its waiters were answered by their dropped senders. Lazy work
            // waits for the retry, as after a failed commit (no spinning).
            tracing::error!(db = %self.path.display(), "the metadata writer panicked in a round; reopening the database");
            self.db = None;
            self.rewrite_lazy = true;
            self.retry_at = Some(Instant::now() + self.retry_after);
            self.retry_after = (self.retry_after * 2).min(LAZY_DURABLE_WITHIN);
        }
        if closing {
            // The file is closed now, whoever still holds the writer.
            self.db = None;
            self.done = true;
        }
        closing
    }

    /// Commits one round: durable operations in order, then the latest lazy
    /// values; then answers loads and waiters.
    fn round(&mut self, ops: Vec<Op>, lazy: Values, closing: bool) {
        let writes = ops.iter().any(Op::writes);
        let undurable = !(self.since_durable.is_empty() && lazy.is_empty());
        let lazy_due = undurable && self.last_durable.elapsed() >= LAZY_DURABLE_WITHIN;
        let durable = writes || ((closing || lazy_due) && undurable);
        // Lazy values to write again (after a failure or a reopen) go in
        // before any load reads.
        let rewrite_due = (self.rewrite_lazy || self.db.is_none()) && !self.since_durable.is_empty();
        let committed = if writes || durable || !lazy.is_empty() || rewrite_due {
            self.commit(&ops, lazy, durable)
        } else {
            Ok(())
        };
        match &committed {
            Ok(()) => {
                self.retry_at = None;
                self.retry_after = RETRY_FIRST;
            }
            Err(e) => {
                tracing::error!(db = %self.path.display(), error = %e, retry_in = ?self.retry_after,
                    "a metadata commit failed; its durable writes fail, its lazy values are written again later");
                self.retry_at = Some(Instant::now() + self.retry_after);
                self.retry_after = (self.retry_after * 2).min(LAZY_DURABLE_WITHIN);
            }
        }
        for op in ops {
            match op {
                Op::Put { done, .. } | Op::RemovePrefix { done, .. } => {
                    let _ = done.send(committed.clone());
                }
                Op::Load { prefix, done } => {
                    let rows = match &committed {
                        Ok(()) => self.read_prefix(&prefix),
                        Err(e) => Err(e.clone()),
                    };
                    let _ = done.send(rows);
                }
            }
        }
    }

    fn commit(&mut self, ops: &[Op], lazy: Values, durable: bool) -> std::result::Result<(), String> {
        // Removed replicas' lazy values must not come back with a rewrite.
        for op in ops {
            if let Op::RemovePrefix { prefix, .. } = op {
                self.since_durable.retain(|k, _| !k.starts_with(prefix.as_str()));
            }
        }
        let lazy_count = lazy.len() as u64;
        // After a failed commit (or a reopen, which rolls back what was not
        // durable) every lazy value since the last durable commit is
        // written again, first (they are older than this round's ops);
        // otherwise only this round's, after its ops.
        let rewrite = self.rewrite_lazy || self.db.is_none();
        let none = Values::new();
        let result =
            match self.database().and_then(|()| self.db.as_ref().ok_or_else(|| "no database".to_owned())) {
                Err(e) => Err(e),
                Ok(db) => {
                    let earlier = if rewrite { &self.since_durable } else { &none };
                    match write(db, earlier, ops, &lazy, durable) {
                        Ok(()) => Ok(()),
                        Err(e) => {
                            if matches!(e, redb::Error::Io(_) | redb::Error::PreviousIo) {
                                // redb refuses every later transaction after an
                                // IO error: reopen it for the next round, as
                                // after a crash.
                                self.db = None;
                            }
                            Err(e.to_string())
                        }
                    }
                }
            };
        self.since_durable.extend(lazy);
        let stats = &self.shared.stats;
        match result {
            Ok(()) => {
                self.rewrite_lazy = false;
                stats.commits.fetch_add(1, Ordering::Relaxed);
                stats.lazy_writes.fetch_add(lazy_count, Ordering::Relaxed);
                if durable {
                    stats.durable_commits.fetch_add(1, Ordering::Relaxed);
                    let writes = ops.iter().filter(|o| o.writes()).count();
                    stats.durable_writes.fetch_add(writes as u64, Ordering::Relaxed);
                    self.since_durable.clear();
                    self.last_durable = Instant::now();
                }
                Ok(())
            }
            Err(e) => {
                self.rewrite_lazy = true;
                Err(e)
            }
        }
    }

    /// Opens the database again if an error closed it.
    fn database(&mut self) -> std::result::Result<(), String> {
        if self.db.is_none() {
            let db =
                open_database(&self.fs, &self.path).map_err(|e| format!("reopening after an error: {e}"))?;
            self.shared.stats.opens.fetch_add(1, Ordering::Relaxed);
            self.db = Some(db);
        }
        Ok(())
    }

    fn read_prefix(&mut self, prefix: &str) -> std::result::Result<Vec<(String, Vec<u8>)>, String> {
        self.database()?;
        let db = self.db.as_ref().ok_or_else(|| "no database".to_owned())?;
        let read = || -> std::result::Result<Vec<(String, Vec<u8>)>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(TABLE)?;
            let end = prefix_end(prefix);
            let mut rows = Vec::new();
            for row in table.range(prefix..end.as_str())? {
                let (k, v) = row?;
                rows.push((k.value().to_owned(), v.value().to_vec()));
            }
            Ok(rows)
        };
        read().map_err(|e| e.to_string())
    }
}
