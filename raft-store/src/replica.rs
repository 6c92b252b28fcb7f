//! One partition replica's storage: opens the log and state, and hands out
//! the two halves openraft drives ([`LogStore`], [`PartitionStateMachine`])
//! plus the consumer read path, all sharing one state.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::config::StoreConfig;
use crate::error::{Result, StoreError};
use crate::flusher::Flusher;
use crate::fsutil;
use crate::log::{PartitionLog, ReadPlan, StoredBatch};
use crate::log_store::LogStore;
use crate::meta::{self, MetaStore, Sync};
use crate::meta_db::MetaDb;
use crate::producer::{ProducerStates, SequenceCheck};
use crate::snapshot::{self, SnapshotFiles};
use crate::state_machine::PartitionStateMachine;
use crate::types::{LogId, SnapshotMeta, StoredMembership};
use crate::vfs::Fs;

/// The persisted record of the current snapshot.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct SnapshotRecord {
    pub meta: SnapshotMeta,
    pub next_offset: u64,
    pub dir_name: String,
}

/// State derived by applying committed entries (Raft paper §5.3).
#[derive(Debug)]
pub(crate) struct Applied {
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
    /// Offset one past the last applied record: the high watermark.
    pub next_offset: u64,
    pub snapshot: Option<SnapshotRecord>,
    /// Idempotent producer state after `last_applied` (KIP-98).
    pub producers: ProducerStates,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub log: Mutex<PartitionLog>,
    pub applied: Mutex<Applied>,
    pub high_watermark: watch::Sender<u64>,
    pub snapshot_root: PathBuf,
    /// The file system of the replica's directory.
    pub fs: Fs,
    /// Serializes snapshot builds and installs.
    pub snapshot_lock: Mutex<()>,
    /// Held by a compaction pass: one at a time per replica.
    pub compacting: Mutex<()>,
    /// Mirrors [`PartitionLog::recovering`] for lock-free checks (votes).
    pub recovering: std::sync::atomic::AtomicBool,
    /// Log id (term, index) of the last log entry when the replica was opened.
    pub opened_last: Option<(u64, u64)>,
    /// Term of the vote it had recorded when it was opened (0: none).
    pub opened_term: u64,
    /// [`PartitionLog::segment_events`].
    pub segment_events: Arc<std::sync::atomic::AtomicU64>,
    /// The leader's idempotent proposals not in the log yet.
    pub appends: crate::appends::AppendWatch,
}

/// Replicas open in this process (an `Inner` not dropped yet).
static OPEN_REPLICAS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Of those, the ones recovering (their `recovering` flag set).
static RECOVERING_REPLICAS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Drop for Inner {
    fn drop(&mut self) {
        if self.recovering.load(std::sync::atomic::Ordering::Acquire) {
            RECOVERING_REPLICAS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        OPEN_REPLICAS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Storage of one partition replica. Cheap to clone; clones share state.
#[derive(Clone, Debug)]
pub struct Replica {
    pub(crate) inner: Arc<Inner>,
}

/// The term a founded group's first leader leads without an election
/// ([`Replica::found`]); elections start from the next.
pub const FOUNDING_TERM: u64 = 1;

/// What [`Replica::found`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Founding {
    /// The log already held entries (or a snapshot): nothing written.
    Existing,
    /// The group's first configuration was written now.
    Founded {
        /// The founding leader whose vote was recorded with it
        /// (committed, term [`FOUNDING_TERM`]); `None` if none was asked
        /// for or a vote was already recorded.
        leader: Option<crate::types::NodeId>,
    },
}

/// Subdirectory of a replica directory that holds its log (segments, indexes, metadata).
pub const LOG_DIR: &str = "log";
/// Subdirectory of a replica directory that holds its snapshots.
pub const SNAPSHOT_DIR: &str = "snapshots";

impl Replica {
    /// The file system the replica's directory is on.
    pub fn fs(&self) -> &Fs {
        &self.inner.fs
    }

    /// Opens the replica stored under `dir` (created if missing), recovering
    /// the log (see [`PartitionLog::open`]) and the high watermark: the
    /// offset after the persisted commit index, so reads are served from the
    /// right point before Raft has caught up.
    ///
    /// # Errors
    /// [`StoreError`] from opening the log or the metadata.
    pub fn open(dir: &Path, config: StoreConfig, flusher: Flusher) -> Result<Self> {
        Self::open_with(dir, config, flusher, false)
    }

    /// As [`Replica::open`]; with `rescan`, every segment is verified frame
    /// by frame, not only the active one (see [`PartitionLog::open_with`]):
    /// for reopening a replica that stopped on a storage error.
    ///
    /// # Errors
    /// As [`Replica::open`].
    pub fn open_with(dir: &Path, config: StoreConfig, flusher: Flusher, rescan: bool) -> Result<Self> {
        let meta = Self::own_meta(flusher.fs(), dir)?;
        Self::open_with_meta(dir, meta, config, flusher, rescan)
    }

    /// Opens this replica again in place, every segment verified frame by
    /// frame (as [`Replica::open_with`] with `rescan`), for a replica whose
    /// Raft node stopped on a storage error and which must come back
    /// without a process restart while clones of this handle may still be
    /// alive (requests under way). The new handle takes over the replica's
    /// metadata ([`crate::meta::MetaStore::reopen`]): this handle's writes
    /// to them are refused from then on. Entries after a failed fsync are
    /// cut as on any open (see [`crate::unsynced`]).
    ///
    /// The caller must have stopped whatever wrote through this handle (its
    /// Raft node) first: two handles appending to one log would interleave.
    ///
    /// # Errors
    /// As [`Replica::open`]: the disk still failing (its metadata cannot be
    /// read back, a file cannot be written), or damage opening cannot set
    /// aside. A failed reopen may be tried again, from this handle.
    pub fn reopen(&self, config: StoreConfig, flusher: Flusher) -> Result<Self> {
        let dir = self.inner.snapshot_root.parent().map(Path::to_owned).ok_or_else(|| {
            StoreError::Invalid(format!("replica at {} has no directory", self.inner.snapshot_root.display()))
        })?;
        let meta = self.log().meta().reopen()?;
        Self::open_with_meta(&dir, meta, config, flusher, true)
    }

    /// The metadata of a replica alone in `dir` (opened with
    /// [`Replica::open`]): a database in `dir` itself.
    fn own_meta(fs: &Fs, dir: &Path) -> Result<MetaStore> {
        let fresh = !fsutil::exists(&**fs, dir)?;
        let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        create_dirs(fs, dir, fresh, parent)?;
        MetaStore::open(MetaDb::open_on(fs, dir)?, meta::ALONE, Some(&legacy_meta_file(dir)), false)
    }

    /// Opens (or creates) the replica stored in `dir`, one of many replicas
    /// under the directory of `db` (a broker's partitions): its metadata are
    /// its keys in that shared database, named by `dir`'s path relative to
    /// it (the metadata of a directory created here start empty, whatever
    /// an earlier replica of that name left). As [`Replica::open_with`]
    /// otherwise. Remove such a replica with [`Replica::remove`], which also
    /// removes its keys; a replica is open once at a time.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] if `dir` is not inside the database's
    /// directory; [`StoreError::Meta`] if the replica is open already; as
    /// [`Replica::open`].
    pub fn open_in(
        db: &Arc<MetaDb>,
        dir: &Path,
        config: StoreConfig,
        flusher: Flusher,
        rescan: bool,
    ) -> Result<Self> {
        let meta = Self::shared_meta(db, dir)?;
        Self::open_with_meta(dir, meta, config, flusher, rescan)
    }

    fn shared_meta(db: &Arc<MetaDb>, dir: &Path) -> Result<MetaStore> {
        let name = name_in(db, dir)?;
        let fs = db.fs();
        // A removal cut short by a crash (see `Replica::remove`).
        fsutil::remove_dir_if_exists(&**fs, &tombstone(dir))?;
        let fresh = !fsutil::exists(&**fs, dir)?;
        create_dirs(fs, dir, fresh, db.given_dir())?;
        MetaStore::open(db.clone(), &name, Some(&legacy_meta_file(dir)), fresh)
    }

    /// Opens only the log of the replica alone in `dir` (opened with
    /// [`Replica::open`]), for tools and benchmarks that read its data.
    ///
    /// # Errors
    /// As [`Replica::open`].
    pub fn open_log(dir: &Path, config: StoreConfig, flusher: Flusher) -> Result<PartitionLog> {
        let meta = Self::own_meta(flusher.fs(), dir)?;
        PartitionLog::open_in(&dir.join(LOG_DIR), meta, config, flusher, false)
    }

    /// Opens only the log of the replica in `dir` (as [`Replica::open_in`]
    /// would find it), for tools that read a stopped broker's data.
    ///
    /// # Errors
    /// As [`Replica::open_in`].
    pub fn open_log_in(
        db: &Arc<MetaDb>,
        dir: &Path,
        config: StoreConfig,
        flusher: Flusher,
    ) -> Result<PartitionLog> {
        let meta = Self::shared_meta(db, dir)?;
        PartitionLog::open_in(&dir.join(LOG_DIR), meta, config, flusher, false)
    }

    /// Removes the replica in `dir` (opened with [`Replica::open_in`], and
    /// closed): renames its directory aside (durably), removes its keys in
    /// `db` (durably; a handle still open is cut off), then deletes the
    /// directory. A crash after the rename leaves keys without a directory,
    /// which the database removes when it next opens, and a renamed
    /// directory, which the next open of `dir` deletes: never a directory
    /// without its metadata, nor metadata a new replica of that name could
    /// take for its own. A missing directory is not an error.
    ///
    /// # Errors
    /// [`StoreError::Io`] if the directory cannot be renamed or deleted;
    /// [`StoreError::Meta`] if the keys cannot be removed.
    pub fn remove(db: &Arc<MetaDb>, dir: &Path) -> Result<()> {
        let name = name_in(db, dir)?;
        let aside = tombstone(dir);
        let fs = db.fs();
        if fsutil::exists(&**fs, dir)? {
            fs.rename(dir, &aside).map_err(|e| StoreError::io("rename", dir, e))?;
            fsutil::sync_dir(&**fs, dir.parent().unwrap_or(Path::new(".")))?;
        }
        futures::executor::block_on(db.remove_replica(&name))?;
        fsutil::remove_dir_if_exists(&**fs, &aside)
    }

    fn open_with_meta(
        dir: &Path,
        meta: MetaStore,
        config: StoreConfig,
        flusher: Flusher,
        rescan: bool,
    ) -> Result<Self> {
        let fs = flusher.fs().clone();
        let log = PartitionLog::open_in(&dir.join(LOG_DIR), meta, config, flusher, rescan)?;
        let snapshot_root = dir.join(SNAPSHOT_DIR);
        fsutil::create_dir_durable(&*fs, &snapshot_root)?;
        let record: Option<SnapshotRecord> = log.meta().get(meta::KEY_SNAPSHOT)?;
        let keep = record.as_ref().map(|r| snapshot_root.join(&r.dir_name));
        snapshot::remove_others(&*fs, &snapshot_root, keep.as_deref(), true)?;
        let (last_applied, membership, next_offset) = match &record {
            Some(r) => (r.meta.last_log_id, r.meta.last_membership.clone(), r.next_offset),
            None => (None, StoredMembership::default(), 0),
        };
        let committed_hw = match log.committed() {
            Some(c) => log.next_offset_after(c.index)?.unwrap_or(0),
            None => 0,
        };
        let (high_watermark, _) = watch::channel(next_offset.max(committed_hw));
        let producers = match &keep {
            Some(dir) => SnapshotFiles::new(fs.clone(), dir.clone()).manifest()?.producers,
            None => ProducerStates::default(),
        };
        let applied = Applied { last_applied, membership, next_offset, snapshot: record, producers };
        let recovering = std::sync::atomic::AtomicBool::new(log.recovering().is_some());
        if log.recovering().is_some() {
            RECOVERING_REPLICAS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let opened_last = log.log_state().last_log_id.map(|l| (l.leader_id.term, l.index));
        let opened_term = log.vote().map_or(0, |v| v.leader_id.term);
        let segment_events = log.segment_events();
        OPEN_REPLICAS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            inner: Arc::new(Inner {
                log: Mutex::new(log),
                applied: Mutex::new(applied),
                high_watermark,
                snapshot_root,
                fs,
                snapshot_lock: Mutex::new(()),
                compacting: Mutex::new(()),
                recovering,
                opened_last,
                opened_term,
                segment_events,
                appends: crate::appends::AppendWatch::default(),
            }),
        })
    }

    /// Founds a new group in this replica's log: if the log is empty (no
    /// entry, nothing purged, no snapshot), appends the group's first
    /// configuration, `voters` (node id → peer address) as its only voter
    /// set, and waits until it is durable under the flush policy. Call it
    /// before the Raft node starts.
    ///
    /// Every founding member writes the same entry, log id (term 0, the
    /// lowest voter's node id, index 0), so any of them can campaign and
    /// no follower replaces its first entry with the leader's. (openraft's
    /// own initialization writes an entry carrying the calling node's id,
    /// so the followers of whichever founder won cut theirs and wrote the
    /// leader's: two fsyncs each at every partition's creation; and
    /// founding only by a campaigner leaves a group without anyone able to
    /// campaign if that campaigner is lost after winning votes.) Entries
    /// with one log id are identical on every replica, as Raft's Log
    /// Matching property requires (Raft paper §5.3), as long as the voters'
    /// addresses agree; addresses are informational (peers are found
    /// through the cluster's metadata).
    ///
    /// With `leader` (one of `voters`, the same on every founding member),
    /// each member also records, durably and before its node starts, its
    /// vote for that leader in term [`FOUNDING_TERM`], as committed: the
    /// founding leader then holds every voter's vote for its term by
    /// construction and leads from its first start, without an election
    /// (see `ferrolog_replica::RaftNode::start_founding_leader`). A member
    /// holding that vote grants no other candidate of a leadership ranked
    /// at or below it (Raft paper §5.2: one vote per term); openraft's
    /// leader ids carry the node id, so a founder that recorded no
    /// founding vote may still lead a later-ranked leadership of the same
    /// term, and Raft's up-to-date check (§5.4.1) keeps that safe as for
    /// any election. The vote is written only if none is recorded, so it
    /// never moves a vote backwards.
    ///
    /// The entry (a segment fsync) and the vote (a metadata commit) are
    /// made durable separately, so a crash between them keeps either:
    /// with only the vote, the next call writes the entry and reports no
    /// founding leader (`Founded { leader: None }`), and the node elects
    /// as usual; with only the entry, the log is not empty, nothing is
    /// written (`Existing`) and it elects as usual (term 2 and on). When
    /// thousands of partitions are created at once, this saves each one
    /// its pre-vote and vote rounds and their fsyncs.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for no voters, or a `leader` that is not one
    /// of them; [`StoreError::Io`] if the append, the vote or a flush fails.
    pub async fn found(
        &self,
        voters: std::collections::BTreeMap<crate::types::NodeId, String>,
        leader: Option<crate::types::NodeId>,
    ) -> Result<Founding> {
        use crate::types::{Entry, EntryPayload, Membership, Node, Vote};
        let Some(&lowest) = voters.keys().next() else {
            return Err(StoreError::Invalid("a group needs at least one voter".into()));
        };
        if let Some(l) = leader.filter(|l| !voters.contains_key(l)) {
            return Err(StoreError::Invalid(format!("founding leader {l} is not a founding voter")));
        }
        let nodes: std::collections::BTreeMap<_, _> =
            voters.into_iter().map(|(n, addr)| (n, Node { addr })).collect();
        let membership = Membership::new(vec![nodes.keys().copied().collect()], nodes)
            .map_err(|e| StoreError::Invalid(format!("founding configuration: {e}")))?;
        let entry = Entry {
            log_id: crate::types::log_id(0, lowest, 0),
            payload: EntryPayload::Membership(membership),
        };
        let (flushed, durable) = futures::channel::oneshot::channel();
        let (dir, vote) = {
            if self.inner.applied.lock().unwrap_or_else(|p| p.into_inner()).snapshot.is_some() {
                return Ok(Founding::Existing);
            }
            let mut log = self.log();
            let state = log.log_state();
            if state.last_log_id.is_some() || state.last_purged_log_id.is_some() {
                return Ok(Founding::Existing);
            }
            log.append(
                vec![entry],
                Box::new(move |r| {
                    let _ = flushed.send(r);
                }),
            )?;
            // Queued right after the entry; each is awaited below.
            let vote = match leader.filter(|_| log.vote().is_none()) {
                Some(l) => {
                    let v = Vote::new_committed(FOUNDING_TERM, l);
                    Some((v, log.queue_vote(&v)?))
                }
                None => None,
            };
            (log.dir().to_path_buf(), vote)
        };
        let leader = match vote {
            Some((v, saved)) => {
                saved.await?;
                self.log().vote_saved(v);
                leader
            }
            None => None,
        };
        match durable.await {
            Ok(Ok(())) => Ok(Founding::Founded { leader }),
            Ok(Err(e)) => Err(StoreError::io("flush", dir, e)),
            Err(_) => Err(StoreError::io("flush", dir, std::io::Error::other("the flush was dropped"))),
        }
    }

    /// fsyncs the log's active segment now: everything appended so far is
    /// durable when it returns (sealed segments were fsynced when sealed).
    /// Blocking file IO, outside the log's lock.
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn sync(&self) -> Result<()> {
        let Some((file, path, mark, covered)) = self.log().sync_handle() else { return Ok(()) };
        // Through the durable point: a failure trips it, and after one a
        // success proves nothing ([`crate::unsynced`]).
        mark.checked(file.sync_data(), covered).map_err(|e| StoreError::io("fsync", path, e))
    }

    /// How many replicas are open in this process: opened and not yet
    /// dropped by every holder (openraft's tasks, the broker's tables). A
    /// count that does not fall back after replicas are stopped means
    /// something still holds one, and its log, caches and state.
    pub fn open_count() -> usize {
        OPEN_REPLICAS.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The log half, for `openraft::Raft::new`.
    pub fn log_store(&self) -> LogStore {
        LogStore { replica: self.clone() }
    }

    /// The state machine half, for `openraft::Raft::new`.
    pub fn state_machine(&self) -> PartitionStateMachine {
        PartitionStateMachine { replica: self.clone() }
    }

    pub(crate) fn log(&self) -> MutexGuard<'_, PartitionLog> {
        // A poisoned lock means a panic mid-operation; the on-disk state is
        // still consistent (every write is verified on reopen), so go on.
        self.inner.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn applied(&self) -> MutexGuard<'_, Applied> {
        self.inner.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// High watermark: offset one past the last committed and applied record.
    /// Consumers never see records at or above it.
    pub fn high_watermark(&self) -> u64 {
        *self.inner.high_watermark.borrow()
    }

    /// A receiver that changes whenever the high watermark advances, for
    /// long-polling fetches.
    pub fn watch_high_watermark(&self) -> watch::Receiver<u64> {
        self.inner.high_watermark.subscribe()
    }

    /// First offset still stored.
    pub fn log_start_offset(&self) -> u64 {
        self.log().log_start_offset()
    }

    /// Offset the next appended record will get (may be above the high
    /// watermark while entries await commit).
    pub fn log_end_offset(&self) -> u64 {
        self.log().log_end_offset()
    }

    /// Reads committed record batches from `from_offset`, at most
    /// `max_bytes` (one whole batch at least), never at or past the high
    /// watermark. See [`PartitionLog::read`].
    ///
    /// The log's lock, which appends need, is held only to plan the read
    /// ([`PartitionLog::plan_read`]); the files are read without it, so a
    /// large fetch does not hold up appends. Blocking file IO: call it off
    /// async worker threads.
    ///
    /// # Errors
    /// [`StoreError::OffsetOutOfRange`] with the log start offset and high
    /// watermark; [`StoreError::Corruption`] with file and position.
    pub fn read(&self, from_offset: u64, max_bytes: usize) -> Result<Vec<StoredBatch>> {
        self.read_with_high_watermark(from_offset, max_bytes).map(|(batches, _)| batches)
    }

    /// As [`Replica::read`], with the high watermark the read stopped at
    /// (never below the end of the batches returned; a consumer's next
    /// offset is never past it).
    ///
    /// # Errors
    /// As [`Replica::read`].
    pub fn read_with_high_watermark(
        &self,
        from_offset: u64,
        max_bytes: usize,
    ) -> Result<(Vec<StoredBatch>, u64)> {
        let (plan, hw) = self.plan_read(from_offset, max_bytes)?;
        match plan.sharing_cpu().run() {
            Ok(batches) => Ok((batches, hw)),
            // A frame past the high watermark may have been truncated and
            // rewritten while the files were read: only a read under the
            // lock, where they cannot change, can say the log is damaged.
            Err(_) => Ok((self.log().read(from_offset, max_bytes, hw)?, hw)),
        }
    }

    /// The first half of [`Replica::read`]: plans a read of committed
    /// batches under the log's lock and returns it with the high watermark
    /// it stops at. [`ReadPlan::run`] reads the files without the lock.
    ///
    /// # Errors
    /// As [`Replica::read`].
    pub fn plan_read(&self, from_offset: u64, max_bytes: usize) -> Result<(ReadPlan, u64)> {
        let hw = self.high_watermark();
        let log = self.log();
        if from_offset > hw {
            // Past the committed end: the bounds a consumer may use.
            return Err(StoreError::OffsetOutOfRange {
                offset: from_offset,
                log_start_offset: log.log_start_offset(),
                log_end_offset: hw,
            });
        }
        Ok((log.plan_read(from_offset, max_bytes, hw)?, hw))
    }

    /// Kafka's ListOffsets by timestamp (KIP-79) over committed records: the
    /// first record in offset order whose timestamp is ≥ `timestamp_ms`, as
    /// `(offset, record timestamp in ms)`, or `None` when no committed
    /// record is that late. `record_timestamps` decodes a batch's records
    /// into their timestamps (see [`PartitionLog::offset_for_timestamp`]).
    ///
    /// # Errors
    /// [`StoreError::Corruption`], also for records that do not decode or
    /// contradict their frame header; [`StoreError::Io`].
    pub fn offset_for_timestamp<E: std::fmt::Display>(
        &self,
        timestamp_ms: i64,
        record_timestamps: impl FnMut(bytes::Bytes) -> std::result::Result<Vec<(u32, i64)>, E>,
    ) -> Result<Option<(u64, i64)>> {
        let hw = self.high_watermark();
        self.log().offset_for_timestamp(timestamp_ms, hw, record_timestamps)
    }

    /// Judges a batch about to be proposed against the idempotent producer
    /// state of everything applied so far (KIP-98). The caller (the
    /// partition's leader) must account for its own proposals that are not
    /// applied yet.
    pub fn check_sequence(
        &self,
        producer_id: i64,
        epoch: i16,
        first_sequence: i32,
        record_count: u32,
    ) -> SequenceCheck {
        self.applied().producers.check(producer_id, epoch, first_sequence, record_count)
    }

    /// The leader's idempotent proposals that have not reached this log
    /// yet (see [`crate::appends`]).
    pub fn append_watch(&self) -> &crate::appends::AppendWatch {
        &self.inner.appends
    }

    /// Raft index of the last entry in this replica's log, as stored (not
    /// as the Raft library last published it); `None` if the log holds no
    /// entry.
    pub fn last_log_index(&self) -> Option<u64> {
        self.log().next_index().checked_sub(1)
    }

    /// Producer ids the applied state tracks.
    pub fn producer_count(&self) -> usize {
        self.applied().producers.len()
    }

    /// The compaction target the last pass finished, if one did since the
    /// replica opened (see [`PartitionLog::compacted_to`]).
    pub fn compacted_to(&self) -> Option<crate::compaction::CompactionTarget> {
        self.log().compacted_to()
    }

    /// Producer ids of the applied state that would expire at `now_ms`
    /// after `expiration_ms` without writes (see [`ProducerStates::idle`]).
    pub fn idle_producers(&self, now_ms: i64, expiration_ms: i64) -> usize {
        self.applied().producers.idle(now_ms, expiration_ms)
    }

    /// Why this replica may have lost entries it had acknowledged, if it
    /// may have (see [`PartitionLog::recovering`]): until a leader has
    /// brought it back it must neither vote nor campaign.
    pub fn recovering(&self) -> Option<String> {
        self.log().recovering().map(str::to_owned)
    }

    /// A reader of the committed entries of every segment (whose bytes no
    /// longer change), oldest first, for a scrub (see
    /// [`PartitionLog::committed_segment_readers`] and
    /// [`crate::segment::SegmentReader::verify`]); the log's lock is held
    /// only to collect them.
    pub fn committed_segment_readers(&self) -> Vec<crate::segment::SegmentReader> {
        self.log().committed_segment_readers()
    }

    /// Whether `reader`'s segment is still this log's as the reader saw it
    /// ([`PartitionLog::still_holds`]): damage a scrub found through a
    /// reader is the log's only then.
    pub fn still_holds(&self, reader: &crate::segment::SegmentReader) -> bool {
        self.log().still_holds(reader)
    }

    /// Every segment as retention sees it (see
    /// [`PartitionLog::segment_summaries`]).
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn segment_summaries(&self) -> Result<Vec<crate::SegmentSummary>> {
        self.log().segment_summaries()
    }

    /// How many times since the replica opened the log rolled its active
    /// segment on an append or moved its log start offset (see
    /// [`PartitionLog::segment_events`]); lock-free, so a broker can poll it
    /// often and react to a change.
    pub fn segment_events(&self) -> u64 {
        self.inner.segment_events.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The Raft index of the last entry of the segments retention retired
    /// (wholly below the log start offset, never the active one) that are
    /// still on disk; `None` if there are none. Raft purging through it
    /// deletes them (see [`PartitionLog::delete_retired_segments`]).
    pub fn retired_through_index(&self) -> Option<u64> {
        self.log().retired_through_index()
    }

    /// Whether the current snapshot holds a log start below this
    /// replica's: it may hard-link segment files retention has retired
    /// since, which a new snapshot lets go. False without a snapshot, or
    /// when its manifest cannot be read.
    pub fn snapshot_behind_log_start(&self) -> bool {
        let start = self.log().log_start_offset();
        if start == 0 {
            // Retention never ran here: no manifest to read.
            return false;
        }
        let Some(record) = self.applied().snapshot.clone() else { return false };
        self.snapshot_files(&record).manifest().is_ok_and(|m| m.log_start_offset < start)
    }

    /// The compaction target this replica applied (see
    /// [`PartitionLog::compaction_target`]).
    pub fn compaction_target(&self) -> crate::compaction::CompactionTarget {
        self.log().compaction_target()
    }

    /// Counts replacements and cuts of this replica's segments since it
    /// opened (a snapshot installed, a truncation; not appends, rolls,
    /// retention's deletions or compaction's rewrites): where it moves,
    /// what this replica's compaction passes reached may be gone.
    pub fn segments_generation(&self) -> u64 {
        self.log().generation()
    }

    /// Whether a compaction pass has work: a target, with tombstones capped
    /// at `tombstones_below_max` (see [`Replica::compact`]), it has not
    /// finished since the replica opened.
    pub fn compaction_pending(&self, tombstones_below_max: u64) -> bool {
        let log = self.log();
        let t = log.compaction_target().capped(tombstones_below_max);
        t.through > 0 && log.compacted_to() != Some(t)
    }

    /// Sets when the active segment rolls (see
    /// [`PartitionLog::set_roll_limits`]).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for values the store refuses.
    pub fn set_roll_limits(&self, segment_bytes: u64, segment_ms: u64) -> Result<()> {
        self.log().set_roll_limits(segment_bytes, segment_ms)
    }

    /// The active segment's roll limits: (`segment_bytes`, `segment_ms`).
    pub fn roll_limits(&self) -> (u64, u64) {
        self.log().roll_limits()
    }

    /// How many replicas open in this process are recovering (see
    /// [`Replica::recovering`]): zero lets a caller skip looking at each.
    pub fn recovering_count() -> usize {
        RECOVERING_REPLICAS.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether [`Replica::recovering`] is set, without taking the log's lock.
    pub fn is_recovering(&self) -> bool {
        self.inner.recovering.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records (durably) that this replica has been brought back by a
    /// leader and may vote again (the rule is the caller's:
    /// `ferrolog_replica::recovery::caught_up`).
    ///
    /// # Errors
    /// [`StoreError::Meta`].
    pub fn finish_recovery(&self) -> Result<()> {
        self.log().set_recovering(None)?;
        if self.inner.recovering.swap(false, std::sync::atomic::Ordering::AcqRel) {
            RECOVERING_REPLICAS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// Records a clean stop (see [`PartitionLog::mark_clean_stop`]); call
    /// after the Raft node has shut down.
    ///
    /// # Errors
    /// [`StoreError::Io`], [`StoreError::Meta`].
    pub fn close_cleanly(&self) -> Result<()> {
        self.log().mark_clean_stop()
    }

    /// What opening found damaged and set aside (see [`PartitionLog::damage`]).
    pub fn damage(&self) -> Vec<crate::log::Damage> {
        self.log().damage().to_vec()
    }

    /// Log id of the last entry in the log (or of the purge pointer when
    /// the log holds none after it), for comparing logs (Raft §5.4.1).
    /// Log id (term, index) of the last log entry when this replica was
    /// opened (`None`: the log was empty). An applied entry whose log id is
    /// greater reached this replica from a leader after it opened (see
    /// `ferrolog_replica::recovery`): every entry it held had a log id at
    /// most this one (terms never decrease along a log).
    pub fn opened_last_log_id(&self) -> Option<(u64, u64)> {
        self.inner.opened_last
    }

    /// The term of the vote this replica had recorded when it was opened
    /// (0: none): every entry it had acknowledged is of that term or an
    /// earlier one (a follower takes a leader's term before its entries).
    pub fn opened_term(&self) -> u64 {
        self.inner.opened_term
    }

    /// The vote this replica has durably recorded (Raft paper Figure 2:
    /// `currentTerm`, `votedFor`), if any.
    pub fn vote(&self) -> Option<crate::types::Vote> {
        self.log().vote()
    }

    /// Raft index and term of the last log entry, if any.
    pub fn last_log_id(&self) -> Option<LogId> {
        self.log().log_state().last_log_id
    }

    /// Raft index of the last applied entry, if any.
    pub fn last_applied_index(&self) -> Option<u64> {
        self.applied().last_applied.map(|l| l.index)
    }

    pub(crate) fn publish_high_watermark(&self, next_offset: u64) {
        self.inner.high_watermark.send_if_modified(|hw| {
            let advanced = next_offset > *hw;
            if advanced {
                *hw = next_offset;
            }
            advanced
        });
    }

    /// Records `files` as the current snapshot (durably) and removes older
    /// ones, unless the current one is newer: then `files` is removed and
    /// the current record returned. Callers hold `snapshot_lock`.
    pub(crate) fn set_current_snapshot(
        &self,
        files: &SnapshotFiles,
        meta: SnapshotMeta,
        next_offset: u64,
    ) -> Result<SnapshotRecord> {
        let current = self.applied().snapshot.clone();
        if let Some(cur) = current.filter(|c| c.meta.last_log_id > meta.last_log_id) {
            let _ = self.inner.fs.remove_dir_all(&files.dir);
            return Ok(cur);
        }
        let dir_name = files.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let record = SnapshotRecord { meta, next_offset, dir_name };
        self.log().meta().put(meta::KEY_SNAPSHOT, Some(&record), Sync::Durable)?;
        self.applied().snapshot = Some(record.clone());
        snapshot::remove_others(&*self.inner.fs, &self.inner.snapshot_root, Some(&files.dir), false)?;
        Ok(record)
    }

    /// The files of a recorded snapshot.
    pub(crate) fn snapshot_files(&self, record: &SnapshotRecord) -> SnapshotFiles {
        SnapshotFiles::new(self.inner.fs.clone(), self.inner.snapshot_root.join(&record.dir_name))
    }

    pub(crate) fn snapshot_lock(&self) -> MutexGuard<'_, ()> {
        self.inner.snapshot_lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Purges the Raft log up to `upto`. If that is past the last stored
    /// entry (the log lost its unsynced tail, or a snapshot came from the
    /// leader), the log is first rebuilt from the current snapshot, which
    /// knows the offsets and holds the retained records.
    pub(crate) fn purge(&self, upto: LogId) -> Result<()> {
        let snapshot = self.applied().snapshot.clone();
        let mut log = self.log();
        if upto.index >= log.next_index()
            && let Some(r) = snapshot.filter(|r| r.meta.last_log_id.is_some_and(|l| l.index >= upto.index))
            && let Some(last) = r.meta.last_log_id
        {
            tracing::info!(dir = %log.dir().display(), %upto, "purge past the log's end: rebuilding it from the snapshot");
            let files = self.snapshot_files(&r);
            log.replace_segments(&files.segments()?, (last.index + 1, r.next_offset))?;
        }
        log.purge(upto)
    }

    pub(crate) fn snapshot_root(&self) -> &Path {
        &self.inner.snapshot_root
    }
}

/// Where a replica kept its own metadata database before they were shared.
fn legacy_meta_file(dir: &Path) -> PathBuf {
    dir.join(LOG_DIR).join(meta::LEGACY_META_FILE)
}

/// Where [`Replica::remove`] renames a replica directory before deleting it.
fn tombstone(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_owned();
    name.push(".removing");
    dir.with_file_name(name)
}

/// Creates replica directory `dir` and its subdirectories. A `fresh` one
/// (it did not exist) is made durable up to `top`: fsynced, and each
/// directory above it up to `top`, so a crash cannot lose the directory of
/// a replica whose vote is already durable elsewhere.
fn create_dirs(fs: &Fs, dir: &Path, fresh: bool, top: &Path) -> Result<()> {
    for d in [dir.join(LOG_DIR), dir.join(SNAPSHOT_DIR)] {
        fs.create_dir_all(&d).map_err(|e| StoreError::io("create", &d, e))?;
    }
    if fresh {
        let abs = |p: &Path| std::path::absolute(p).map_err(|e| StoreError::io("resolve", p, e));
        let (dir, top) = (abs(dir)?, abs(top)?);
        // Not under `top`: the directory and its parent only.
        let stop = if dir.starts_with(&top) { top } else { dir.parent().unwrap_or(&dir).to_owned() };
        for d in dir.ancestors() {
            fsutil::sync_dir(&**fs, d)?;
            if d == stop {
                break;
            }
        }
    }
    Ok(())
}

/// The name of replica directory `dir` in `db`: its path relative to the
/// database's directory, which must contain it. Compared as given (made
/// absolute) first, so a replica directory that is a symbolic link to
/// another disk keeps its name; then resolved.
fn name_in(db: &MetaDb, dir: &Path) -> Result<String> {
    let lexical =
        std::path::absolute(dir).ok().and_then(|a| a.strip_prefix(db.given_dir()).ok().map(Path::to_owned));
    let rel = lexical.or_else(|| resolve(dir).strip_prefix(db.dir()).ok().map(Path::to_owned));
    let clean = |r: &Path| r.components().all(|c| matches!(c, std::path::Component::Normal(_)));
    match rel.as_deref().filter(|r| !r.as_os_str().is_empty() && clean(r)).and_then(Path::to_str) {
        Some(r) => Ok(r.to_owned()),
        None => Err(StoreError::Invalid(format!(
            "replica directory {} is not inside {}",
            dir.display(),
            db.given_dir().display()
        ))),
    }
}

/// `path` made absolute and free of symbolic links, as far as it exists
/// (a directory already removed still resolves through its parents).
fn resolve(path: &Path) -> PathBuf {
    let mut tail = Vec::new();
    let mut p = path;
    loop {
        if let Ok(mut found) = std::fs::canonicalize(p) {
            found.extend(tail.iter().rev());
            return found;
        }
        match (p.parent(), p.file_name()) {
            (Some(parent), Some(name)) => {
                tail.push(name);
                p = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
            }
            _ => return path.to_owned(),
        }
    }
}
