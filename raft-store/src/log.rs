//! The log of one partition replica: an ordered list of segment files, the
//! offsets of its records, the tail cache, and the persisted Raft metadata.
//!
//! Two starts are kept apart on purpose:
//! - the **Raft purge pointer** (`purged`): entries at or below it are gone
//!   for Raft (openraft purged them after a snapshot) and are never returned
//!   to it;
//! - the **log start offset**: the first record still on disk for
//!   consumers. Segment files are deleted only by retention, never by a Raft
//!   purge, so a snapshot can ship every retained record to a new replica.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// tokio's clock: the OS's monotonic clock, except in a simulation whose
// runtime pauses time (then it is the simulated time).
use tokio::time::Instant;

use bytes::Bytes;

use crate::compaction::CompactionTarget;
use crate::config::{FlushPolicy, StoreConfig};
use crate::error::{Result, StoreError};
use crate::flusher::{FlushCallback, Flusher};
use crate::format::{self, FrameHeader, SEGMENT_HEADER_BYTES};
use crate::fsutil;
use crate::meta::{self, MetaStore, Sync};
use crate::meta_db::MetaDb;
use crate::segment::{Segment, SegmentReader, parse_segment_file_name};
use crate::tail_cache::TailCache;
use crate::types::{Entry, LogId, LogState, Vote};
use crate::unsynced::{self, SyncMark};
use crate::vfs::Fs;

/// One stored record batch as it lies on disk: its frame header and the
/// exact frame bytes (header and records), CRC-verified when read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBatch {
    /// The parsed frame header: log id, offsets, timestamps, producer.
    pub header: FrameHeader,
    /// The whole frame, byte for byte as stored.
    pub frame: Bytes,
}

impl StoredBatch {
    /// The batch's encoded records (the frame without its header).
    pub fn records(&self) -> Bytes {
        self.frame.slice(format::FRAME_HEADER_BYTES..)
    }
}

/// A consumer read planned under the log's lock by
/// [`PartitionLog::plan_read`] and run, without it, by [`ReadPlan::run`]:
/// a large fetch then reads its files while appends go on.
#[derive(Debug)]
pub struct ReadPlan {
    /// Segments to read, in order, with the byte position to start at.
    parts: Vec<(SegmentReader, u64)>,
    from_offset: u64,
    max_bytes: usize,
    /// Exclusive offset no returned batch reaches past.
    up_to: u64,
}

impl ReadPlan {
    /// This plan, its reads yielding the CPU between chunks
    /// ([`SegmentReader::sharing_cpu`]): for a plan run without the log's
    /// lock, so a large read does not hold a CPU that a Raft or produce
    /// thread waits for.
    pub fn sharing_cpu(mut self) -> Self {
        self.parts = self.parts.into_iter().map(|(reader, pos)| (reader.sharing_cpu(), pos)).collect();
        self
    }

    /// Reads the planned batches (see [`PartitionLog::read`]). Blocking
    /// file IO: call it off async worker threads.
    ///
    /// # Errors
    /// [`StoreError::Corruption`] for a frame that does not verify (which,
    /// past the high watermark, may be a concurrent truncation: see
    /// [`SegmentReader`]); [`StoreError::Io`].
    pub fn run(self) -> Result<Vec<StoredBatch>> {
        let mut out: Vec<StoredBatch> = Vec::new();
        let mut budget = self.max_bytes;
        let mut from = self.from_offset;
        let up_to = self.up_to;
        for (reader, pos) in &self.parts {
            if from >= up_to {
                break;
            }
            // Go on to the next segment only if this one was read to its end.
            let (frames, exhausted) =
                reader.read_frames(*pos, budget, out.is_empty(), |h| h.next_offset() <= up_to)?;
            for (header, frame) in frames {
                budget = budget.saturating_sub(header.frame_bytes);
                from = header.next_offset();
                if header.record_count > 0 {
                    out.push(StoredBatch { header, frame });
                }
            }
            if !exhausted || budget == 0 {
                break;
            }
        }
        Ok(out)
    }
}

/// One segment as retention sees it ([`PartitionLog::segment_summaries`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentSummary {
    /// Offset of its first record.
    pub base_offset: u64,
    /// Offset after its last record.
    pub next_offset: u64,
    /// File size, bytes.
    pub size_bytes: u64,
    /// Largest record timestamp in it, ms (i64::MIN if none).
    pub max_timestamp_ms: i64,
    /// When the file was last written, ms since the Unix epoch.
    pub modified_ms: i64,
}

/// The durable log of one partition replica.
#[derive(Debug)]
pub struct PartitionLog {
    /// The file system of the log's data directory (the flusher's).
    fs: Fs,
    dir: PathBuf,
    config: StoreConfig,
    /// Sorted by base index; never empty; the last one is active.
    segments: Vec<Segment>,
    meta: Arc<MetaStore>,
    flusher: Flusher,
    cache: TailCache,
    purged: Option<LogId>,
    /// The log start offset retention set (0 until it does); see
    /// [`PartitionLog::advance_log_start`].
    log_start: u64,
    committed: Option<LogId>,
    vote: Option<Vote>,
    last_interval_flush: Instant,
    /// First fsync failure of a background (interval-policy) flush; every
    /// later append fails with it, so an error is never silently dropped.
    flush_error: Arc<Mutex<Option<String>>>,
    /// The durable point, shared with flush callbacks; trips on a failed
    /// fsync ([`crate::unsynced`]).
    sync_mark: Arc<SyncMark>,
    /// [`meta::KEY_FLUSHED`] as recorded, raised by flush callbacks.
    flushed: Arc<FlushedRecord>,
    encode_buf: Vec<u8>,
    /// See [`PartitionLog::recovering`].
    recovering: Option<String>,
    /// See [`PartitionLog::damage`].
    damage: Vec<Damage>,
    /// See [`PartitionLog::compaction_target`].
    compaction: CompactionTarget,
    /// The target a compaction pass last finished (in memory: after a
    /// restart one pass runs again, finding nothing to remove). Cleared
    /// whenever segments are replaced or cut.
    compacted_to: Option<CompactionTarget>,
    /// Counts replacements and cuts of the segment list (not appends, rolls
    /// or retention's deletions): a compaction pass that saw it change
    /// does not count as finished.
    generation: u64,
    /// See [`PartitionLog::segment_events`].
    segment_events: Arc<std::sync::atomic::AtomicU64>,
}

/// A sealed segment a compaction pass may rewrite
/// ([`PartitionLog::compaction_candidates`]).
#[derive(Debug)]
pub struct CompactionCandidate {
    pub(crate) path: PathBuf,
    pub(crate) reader: SegmentReader,
    pub(crate) header: format::SegmentHeader,
    pub(crate) size_bytes: u64,
    pub(crate) modified: Option<std::time::SystemTime>,
    pub(crate) index_interval_bytes: u64,
    pub(crate) fs: Fs,
    file: crate::vfs::FileRef,
}

impl PartitionLog {
    /// Opens (or creates) the log in `dir`: loads sealed segments from their
    /// index files, scans the active segment verifying every frame, and cuts
    /// a torn tail left by a crash (never an entry before it).
    ///
    /// Where a log with no segment file begins (a new replica, or a crash
    /// while the log was being replaced) is read from the metadata, written
    /// before any replacement starts.
    ///
    /// Damage is repaired, never served: a segment with a bad frame before
    /// valid ones, a sealed segment that does not verify, or a segment that
    /// does not continue the one before it ends the log there; the damaged
    /// bytes and every later segment are set aside in [`DAMAGED_DIR`] (see
    /// [`PartitionLog::damage`]) and the replica is marked
    /// [recovering](PartitionLog::recovering): it may have lost entries it
    /// had acknowledged, which a leader must send again. A committed log id
    /// past the end of what remains (a follower may record a commit index
    /// ahead of what it has flushed, and a crash then cuts the tail; or the
    /// damage cut it) is lowered to the log's end.
    ///
    /// # Errors
    /// [`StoreError::Corruption`] if the log no longer reaches back to the
    /// entry after the Raft purge pointer (its first segment is gone);
    /// [`StoreError::Io`] or [`StoreError::Meta`] for IO failures; an
    /// invalid `config`.
    pub fn open(dir: &Path, config: StoreConfig, flusher: Flusher) -> Result<Self> {
        Self::open_with(dir, config, flusher, false)
    }

    /// As [`PartitionLog::open`]; with `rescan`, sealed segments are also
    /// verified frame by frame instead of loaded from their index files
    /// (used to reopen a replica after a storage error: a damaged frame in a
    /// sealed segment is otherwise found only by the read that reaches it).
    ///
    /// # Errors
    /// As [`PartitionLog::open`].
    ///
    /// The log's metadata is kept in a database in `dir` itself (see
    /// [`MetaDb`]). A replica's log is opened through
    /// [`Replica`](crate::replica::Replica) instead, which keeps it in the
    /// replica's database and moves an earlier version's file in.
    pub fn open_with(dir: &Path, config: StoreConfig, flusher: Flusher, rescan: bool) -> Result<Self> {
        fsutil::create_dir_durable(&**flusher.fs(), dir)?;
        let meta = MetaStore::open(MetaDb::open_on(flusher.fs(), dir)?, meta::ALONE, None, false)?;
        Self::open_in(dir, meta, config, flusher, rescan)
    }

    /// As [`PartitionLog::open_with`], with its metadata in `meta` (a
    /// replica's keys in its directory's shared database) instead of a
    /// database of its own in `dir`.
    ///
    /// # Errors
    /// As [`PartitionLog::open`].
    pub fn open_in(
        dir: &Path,
        meta: MetaStore,
        config: StoreConfig,
        flusher: Flusher,
        rescan: bool,
    ) -> Result<Self> {
        config.validate().map_err(|e| StoreError::Invalid(e.to_string()))?;
        let fs = flusher.fs().clone();
        fsutil::create_dir_durable(&*fs, dir)?;
        let mut bases = Vec::new();
        for name in fs.list(dir).map_err(|e| StoreError::io("list", dir, e))? {
            if name.ends_with(".tmp") {
                fsutil::remove_if_exists(&*fs, &dir.join(&name))?;
            } else if let Some(base) = parse_segment_file_name(&name) {
                bases.push(base);
            }
        }
        bases.sort_unstable();
        let (segments, damage) = open_segments(&fs, dir, &bases, &config, rescan)?;
        let recovering = meta.get(meta::KEY_RECOVERING)?;
        let clean_stop = meta.get::<bool>(meta::KEY_CLEAN_STOP)?.unwrap_or(false);
        let compaction: CompactionTarget = meta.get(meta::KEY_COMPACTION)?.unwrap_or_default();
        if clean_stop {
            // From here on a crash is unclean again.
            meta.put::<bool>(meta::KEY_CLEAN_STOP, None, Sync::Durable)?;
        }
        let sync_mark = Arc::new(SyncMark::new(fs.clone(), dir, 0));
        let flushed_recorded: u64 = meta.get(meta::KEY_FLUSHED)?.unwrap_or(0);
        let meta = Arc::new(meta);
        let flushed = Arc::new(FlushedRecord {
            state: Mutex::new(Flushed { recorded: flushed_recorded, meta: Some(meta.clone()) }),
        });
        let mut log = Self {
            fs,
            dir: dir.to_owned(),
            cache: TailCache::new(config.tail_cache_bytes),
            config,
            segments,
            purged: meta.get(meta::KEY_PURGED)?,
            log_start: meta.get(meta::KEY_LOG_START)?.unwrap_or(0),
            committed: meta.get(meta::KEY_COMMITTED)?,
            vote: meta.get(meta::KEY_VOTE)?,
            meta,
            flusher,
            last_interval_flush: Instant::now(),
            flush_error: Arc::new(Mutex::new(None)),
            sync_mark,
            flushed,
            encode_buf: Vec::new(),
            recovering,
            damage,
            compaction,
            compacted_to: None,
            generation: 0,
            segment_events: Arc::default(),
        };
        log.cut_unsynced_tail()?;
        log.check_flushed_kept()?;
        log.start_sync_mark();
        log.check_reaches_purge_pointer()?;
        if log.segments.is_empty() {
            let start: Option<(u64, u64)> = log.meta.get(meta::KEY_EMPTY_START)?;
            let (i, o) = start.unwrap_or((log.purged.map_or(0, |p| p.index + 1), 0));
            log.segments.push(Segment::create(&log.fs, dir, i, o, log.config.index_interval_bytes)?);
        }
        // Only after an import a crash interrupted: otherwise a linked
        // tail is this log's own active segment, which its snapshots hold a
        // prefix of (appending is fine, and a roll at every start would
        // cost fsyncs and a segment per partition).
        if log.meta.get::<bool>(meta::KEY_IMPORTING)?.unwrap_or(false) {
            log.roll_if_linked()?;
            log.meta.put::<bool>(meta::KEY_IMPORTING, None, Sync::Durable)?;
        }
        if !log.damage.is_empty() {
            let reason = log.damage.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
            log.set_recovering(Some(reason))?;
        } else if !clean_stop
            && matches!(log.config.flush, FlushPolicy::Interval { .. })
            && (log.last_stored_log_id().is_some() || log.vote.is_some())
            && log.recovering.is_none()
        {
            // Writes were acknowledged before they were fsynced; after a
            // crash nothing proves they survived (Raft §5.4.1 needs voters
            // that kept what they acknowledged). An empty log proves
            // nothing either once the replica has a vote: a power cut can
            // take every entry it acknowledged before the first fsync, and
            // trusted, it would vote for a candidate without them (one
            // replica's power loss, then its leader's crash: the loss
            // `interval` promises to survive).
            log.set_recovering(Some(
                "stopped uncleanly under flush = interval: entries acknowledged since the last fsync may be gone"
                    .into(),
            ))?;
        }
        log.lower_committed_to_end()?;
        Ok(log)
    }

    /// Entries after the purge pointer must all be stored: a log whose first
    /// segment starts later lost its beginning. With nothing purged the log
    /// starts empty again at index 0 (an empty log is a prefix of every
    /// log; the leader sends everything), the segments set aside.
    fn check_reaches_purge_pointer(&mut self) -> Result<()> {
        let need = self.purged.map_or(0, |p| p.index + 1);
        let Some(first) = self.segments.first() else { return Ok(()) };
        // A log replaced from a snapshot legitimately starts later; it
        // starts at or before the point recorded before the replacement.
        let replaced_at: Option<(u64, u64)> = self.meta.get(meta::KEY_EMPTY_START)?;
        if first.base_index() <= need || replaced_at.is_some_and(|(i, _)| first.base_index() <= i) {
            return Ok(());
        }
        let error = StoreError::Corruption {
            path: first.path().to_owned(),
            position: 0,
            source: format::DecodeError::Invalid {
                field: "log start",
                detail: format!(
                    "the log starts at index {}, entries from {need} are missing",
                    first.base_index()
                ),
            },
        };
        if self.purged.is_some() {
            return Err(error);
        }
        let mut bases: Vec<u64> = self.segments.iter().map(Segment::base_index).collect();
        self.segments.clear();
        self.damage.push(set_aside(&self.fs, &self.dir, &mut bases, 0, &error)?);
        self.meta.put(meta::KEY_EMPTY_START, Some(&(0u64, 0u64)), Sync::Durable)?;
        Ok(())
    }

    /// Lowers a committed log id that points past the last stored entry to
    /// that entry (Raft does not require the commit index to be durable;
    /// the leader tells it again).
    fn lower_committed_to_end(&mut self) -> Result<()> {
        let last = self.log_state().last_log_id;
        if let Some(c) = self.committed
            && Some(c.index) > last.map(|l| l.index)
        {
            tracing::warn!(dir = %self.dir.display(), committed = %c, last = ?last,
                "the recorded commit index is past the end of the log; lowering it, the leader sends the rest");
            self.meta.put(meta::KEY_COMMITTED, last.as_ref(), Sync::Durable)?;
            self.committed = last;
        }
        Ok(())
    }

    /// Records a clean stop: fsyncs the active segment (sealed ones were
    /// fsynced when sealed) and then, durably, that it was done, so the next
    /// open knows nothing acknowledged was lost. The log must not be
    /// written after this. Under `flush = always` nothing is written: every
    /// entry was fsynced before it was acknowledged, and only an open under
    /// `interval` reads the mark (which then treats the stop as unclean:
    /// safe, it costs a catch-up). That spares two fsyncs per replica when a
    /// broker hosting thousands stops.
    ///
    /// # Errors
    /// [`StoreError::Io`], [`StoreError::Meta`].
    pub fn mark_clean_stop(&self) -> Result<()> {
        if matches!(self.config.flush, FlushPolicy::Always) {
            return Ok(());
        }
        self.sync()?;
        self.meta.put(meta::KEY_CLEAN_STOP, Some(&true), Sync::Durable)
    }

    /// What opening this log found damaged and set aside (empty normally).
    pub fn damage(&self) -> &[Damage] {
        &self.damage
    }

    /// Why this replica may have lost entries it had acknowledged, if it
    /// may have: set (durably) when opening found damage, cleared by
    /// [`PartitionLog::set_recovering`] once a leader has brought it back.
    /// A recovering replica must not vote or campaign (a vote from a log
    /// that lost acknowledged entries could elect a leader without them:
    /// Raft §5.4.1 assumes votes come from intact logs).
    pub fn recovering(&self) -> Option<&str> {
        self.recovering.as_deref()
    }

    /// Records (durably) whether this replica is recovering, and why.
    ///
    /// # Errors
    /// [`StoreError::Meta`].
    pub fn set_recovering(&mut self, reason: Option<String>) -> Result<()> {
        if reason != self.recovering {
            self.meta.put(meta::KEY_RECOVERING, reason.as_ref(), Sync::Durable)?;
            self.recovering = reason;
        }
        Ok(())
    }

    /// The replica directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file system the log's files live on.
    pub fn fs(&self) -> &Fs {
        &self.fs
    }

    fn active(&mut self) -> Result<&mut Segment> {
        // Never empty after `open`; only a failed replacement whose fallback
        // also failed leaves it so, and then every write reports it.
        self.segments.last_mut().ok_or_else(|| StoreError::Invalid("the log has no active segment".into()))
    }

    /// The tail segment of a log that was being replaced may be a hard link
    /// to a snapshot's file held whole: it must never be written, so seal
    /// it and start a new active segment. (Called after an import, and at
    /// open only when an import was interrupted: see `KEY_IMPORTING`.)
    fn roll_if_linked(&mut self) -> Result<()> {
        let interval = self.config.index_interval_bytes;
        let fs = self.fs.clone();
        let active = self.active()?;
        let linked =
            fs.metadata(active.path()).map_err(|e| StoreError::io("stat", active.path(), e))?.links > 1;
        if linked && !active.is_empty() {
            let (i, o) = (active.next_index(), active.next_offset());
            self.seal_active()?;
            self.segments.push(Segment::create(&self.fs, &self.dir, i, o, interval)?);
        }
        Ok(())
    }

    /// Raft index the next appended entry gets.
    pub fn next_index(&self) -> u64 {
        self.segments.last().map_or(0, Segment::next_index)
    }

    /// Log end offset: the offset the next record will get.
    pub fn log_end_offset(&self) -> u64 {
        self.segments.last().map_or(0, Segment::next_offset)
    }

    /// Log start offset: the first offset served to consumers. The larger
    /// of where the first segment begins and where retention set it
    /// ([`PartitionLog::advance_log_start`]); never past the log end.
    pub fn log_start_offset(&self) -> u64 {
        self.segments.first().map_or(0, Segment::base_offset).max(self.log_start).min(self.log_end_offset())
    }

    /// Retention: moves the log start offset up to `offset` (never down),
    /// persists it, and deletes the segments it retired (see
    /// [`PartitionLog::delete_retired_segments`]). Offsets do not shift:
    /// later records keep theirs. Returns whether it moved.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if it cannot be saved; [`StoreError::Io`].
    pub fn advance_log_start(&mut self, offset: u64) -> Result<bool> {
        if offset <= self.log_start {
            return Ok(false);
        }
        self.log_start = offset;
        // Durable: a stopped replica's files (dump-log) and every replica
        // after a crash say the same log start.
        self.meta.put(meta::KEY_LOG_START, Some(&offset), Sync::Durable)?;
        self.delete_retired_segments()?;
        self.note_segment_event();
        Ok(true)
    }

    /// Deletes, oldest first, the segments that hold only records below the
    /// log start offset and only entries Raft has purged (a follower that
    /// needs them gets a snapshot instead), never the active one; the
    /// directory is fsynced after. Returns how many. A crash part way
    /// leaves a shorter chain that still reaches the purge pointer.
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn delete_retired_segments(&mut self) -> Result<usize> {
        let Some(purged) = self.purged else { return Ok(0) };
        if self.log_start == 0 {
            // Retention never ran: nothing is retired (not even a first
            // segment that holds only configuration entries).
            return Ok(0);
        }
        let retired = |s: &Segment| s.next_offset() <= self.log_start && s.next_index() <= purged.index + 1;
        let count =
            self.segments[..self.segments.len().saturating_sub(1)].iter().take_while(|s| retired(s)).count();
        if count == 0 {
            return Ok(0);
        }
        // The purge pointer is saved lazily; before entries go from disk it
        // must be durable, or a crash would reopen a log whose first segment
        // starts after the purge pointer it finds (entries missing).
        self.meta.put(meta::KEY_PURGED, Some(&purged), Sync::Durable)?;
        let mut n = 0;
        while n < count {
            self.segments.remove(0).delete()?;
            n += 1;
        }
        if n > 0 {
            fsutil::sync_dir(&*self.fs, &self.dir)?;
            tracing::debug!(dir = %self.dir.display(), deleted = n, log_start = self.log_start, "retention deleted segments");
        }
        Ok(n)
    }

    /// The compaction target this replica has applied (see
    /// [`crate::compaction`]); zero until a leader decides one.
    pub fn compaction_target(&self) -> CompactionTarget {
        self.compaction
    }

    /// Moves the compaction target up to `target` (each field only up),
    /// persists it, and rolls the active segment if it holds records below
    /// the target, so that every replica's records below it are in sealed
    /// segments (only those are compacted). Returns whether it moved.
    ///
    /// # Errors
    /// [`StoreError::Meta`] if it cannot be saved; [`StoreError::Io`].
    pub fn set_compaction_target(&mut self, target: CompactionTarget) -> Result<bool> {
        let new = self.compaction.max(target);
        if new == self.compaction {
            return Ok(false);
        }
        self.meta.put(meta::KEY_COMPACTION, Some(&new), Sync::Durable)?;
        self.compaction = new;
        self.roll_below_compaction_target()?;
        Ok(true)
    }

    /// Rolls the active segment if it holds records below the compaction
    /// target (see [`PartitionLog::set_compaction_target`]).
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub(crate) fn roll_below_compaction_target(&mut self) -> Result<()> {
        let through = self.compaction.through;
        let interval = self.config.index_interval_bytes;
        let active = self.active()?;
        if !active.is_empty() && active.base_offset() < through {
            let (base_index, base_offset) = (active.next_index(), active.next_offset());
            self.seal_active()?;
            self.segments.push(Segment::create(&self.fs, &self.dir, base_index, base_offset, interval)?);
        }
        Ok(())
    }

    /// Notes a replacement or cut of the segment list: what a compaction
    /// pass finished may be gone.
    fn segments_changed(&mut self) {
        self.generation += 1;
        self.compacted_to = None;
    }

    /// See the `generation` field: changes whenever segments are replaced
    /// or cut.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The target the last compaction pass finished, if one did since open.
    pub fn compacted_to(&self) -> Option<CompactionTarget> {
        self.compacted_to
    }

    /// Records that a pass finished `target`.
    pub(crate) fn set_compacted_to(&mut self, target: CompactionTarget) {
        self.compacted_to = Some(target);
    }

    /// The sealed segments holding records in `log start..through` whose
    /// every entry is committed (committed entries never change, so the
    /// copy a pass writes stays right), oldest first; and whether they hold
    /// every record of that range (none in the active segment or in a
    /// segment not wholly committed yet).
    pub(crate) fn compaction_candidates(&self, through: u64) -> (Vec<CompactionCandidate>, bool) {
        let committed = self.committed.map_or(0, |c| c.index + 1);
        let start = self.log_start_offset();
        let mut out = Vec::new();
        let mut complete = true;
        let last = self.segments.len().saturating_sub(1);
        for (i, seg) in self.segments.iter().enumerate() {
            if seg.base_offset() >= through || seg.next_offset() <= start || seg.is_empty() {
                continue;
            }
            if i == last || !seg.is_sealed() || seg.next_index() > committed {
                complete = false;
                continue;
            }
            out.push(CompactionCandidate {
                path: seg.path().to_owned(),
                reader: seg.reader(),
                header: format::SegmentHeader {
                    base_index: seg.base_index(),
                    base_offset: seg.base_offset(),
                },
                size_bytes: seg.size_bytes(),
                modified: self.fs.metadata(seg.path()).map(|m| m.modified).ok(),
                index_interval_bytes: self.config.index_interval_bytes,
                fs: self.fs.clone(),
                file: seg.file().clone(),
            });
        }
        (out, complete)
    }

    /// Puts the compacted copy `tmp` (opened and sealed as `segment`, its
    /// index at `index_tmp`, both fsynced: [`Segment::seal_to`]) in place
    /// of the candidate it was made from, if that segment is still in the
    /// log unchanged (same file, same size, sealed); else removes both.
    /// Returns whether it swapped. Only renames happen here, under the
    /// log's lock; the caller fsyncs the directory after releasing it
    /// (a low-priority cleaner holding the lock through fsyncs would stall
    /// appends). The old index file goes first, so a crash at any point
    /// leaves either segment file with its own index, none, or (renames
    /// reordered by the crash) the other's, which does not match its size
    /// and is rebuilt at open (a compacted copy is always smaller than its
    /// original).
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub(crate) fn swap_compacted(
        &mut self,
        c: &CompactionCandidate,
        tmp: &Path,
        index_tmp: &Path,
        mut segment: Segment,
    ) -> Result<bool> {
        let last = self.segments.len().saturating_sub(1);
        let at = self.segments.iter().position(|s| s.base_index() == c.header.base_index);
        let same = at.filter(|&i| {
            let s = &self.segments[i];
            i < last && s.is_sealed() && Arc::ptr_eq(s.file(), &c.file) && s.size_bytes() == c.size_bytes
        });
        let Some(i) = same else {
            fsutil::remove_if_exists(&*self.fs, tmp)?;
            fsutil::remove_if_exists(&*self.fs, index_tmp)?;
            return Ok(false);
        };
        let old = &self.segments[i];
        if segment.next_index() != old.next_index() || segment.next_offset() != old.next_offset() {
            fsutil::remove_if_exists(&*self.fs, tmp)?;
            fsutil::remove_if_exists(&*self.fs, index_tmp)?;
            return Err(StoreError::Invalid(format!(
                "compacted copy of {} ends at index {} offset {}, the original at {} {}",
                c.path.display(),
                segment.next_index(),
                segment.next_offset(),
                old.next_index(),
                old.next_offset()
            )));
        }
        let index = c.path.with_extension("idx");
        fsutil::remove_if_exists(&*self.fs, &index)?;
        self.fs.rename(tmp, &c.path).map_err(|e| StoreError::io("rename", &c.path, e))?;
        // The path names the compacted file now: so must the log's state,
        // whatever happens to its index (without one, open rebuilds it).
        segment.moved_to(c.path.clone());
        self.segments[i] = segment;
        if let Err(e) = self.fs.rename(index_tmp, &index) {
            tracing::warn!(path = %index.display(), error = %e, "compacted segment's index not put in place; open rebuilds it");
            let _ = self.fs.remove_file(index_tmp);
        }
        Ok(true)
    }

    /// The Raft index of the last entry of the segments wholly below the
    /// log start offset (never the active one); `None` if there are none.
    pub fn retired_through_index(&self) -> Option<u64> {
        if self.log_start == 0 {
            return None;
        }
        let sealed = &self.segments[..self.segments.len().saturating_sub(1)];
        let retired = sealed.iter().take_while(|s| s.next_offset() <= self.log_start).last()?;
        retired.next_index().checked_sub(1)
    }

    /// A reader ([`crate::segment::SegmentReader`]) of the committed
    /// entries of every segment, the active one included, oldest first:
    /// what a scrub verifies without holding the log's lock. Committed
    /// entries are never truncated (Raft §5.3), so the bytes a reader
    /// covers do not change under it: a truncation past them cuts only
    /// later frames, and retention, compaction or a snapshot put other
    /// files in place while the readers keep the old ones open (so check
    /// [`PartitionLog::still_holds`] before calling what a reader found
    /// this log's damage). A segment whose committed part cannot be
    /// located (a frame header on the way does not verify) is left to the
    /// reads that will find it.
    pub fn committed_segment_readers(&self) -> Vec<crate::segment::SegmentReader> {
        let committed_next = self.committed.map_or(0, |c| c.index + 1);
        self.segments
            .iter()
            .filter(|s| s.base_index() < committed_next && !s.is_empty())
            .filter_map(|s| {
                let end = if s.next_index() <= committed_next {
                    s.size_bytes()
                } else {
                    s.position_of_index(committed_next).ok()?
                };
                Some(s.reader_to(end))
            })
            .collect()
    }

    /// Whether the segment `reader` reads is still part of this log as the
    /// reader saw it: same path, same open file, not cut below the view.
    pub fn still_holds(&self, reader: &crate::segment::SegmentReader) -> bool {
        self.segments.iter().any(|s| s.path() == reader.path() && s.still_read_by(reader))
    }

    /// Every segment as retention sees it, oldest first; the last is the
    /// active one.
    ///
    /// # Errors
    /// [`StoreError::Io`] if a segment file's modification time cannot be read.
    pub fn segment_summaries(&self) -> Result<Vec<SegmentSummary>> {
        self.segments
            .iter()
            .map(|s| {
                let modified = self
                    .fs
                    .metadata(s.path())
                    .map(|m| m.modified)
                    .map_err(|e| StoreError::io("stat", s.path(), e))?;
                let modified_ms = modified
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
                Ok(SegmentSummary {
                    base_offset: s.base_offset(),
                    next_offset: s.next_offset(),
                    size_bytes: s.size_bytes(),
                    max_timestamp_ms: s.max_timestamp_ms(),
                    modified_ms,
                })
            })
            .collect()
    }

    /// Log id of the last stored entry, ignoring the purge pointer.
    fn last_stored_log_id(&self) -> Option<LogId> {
        self.segments.iter().rev().find_map(Segment::last_log_id)
    }

    /// openraft's view: last purged and last log id (Raft paper §7).
    pub fn log_state(&self) -> LogState {
        let last = self.last_stored_log_id().filter(|l| Some(l.index) > self.purged.map(|p| p.index));
        LogState { last_purged_log_id: self.purged, last_log_id: last.or(self.purged) }
    }

    /// Appends entries (consecutive, starting at [`next_index`](Self::next_index)),
    /// assigning offsets, and arranges for `done` to run once they are
    /// durable under the flush policy. Rolls the active segment first if it
    /// is full or old.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a non-consecutive index or an unstorable
    /// entry (nothing is written then); [`StoreError::Io`] if a write fails
    /// (the segment written to is cut back to where that write began; the
    /// entries before it, in a segment rolled part way, stay: a valid
    /// prefix) or a roll fails (then the log refuses appends until it is
    /// reopened).
    pub fn append(&mut self, entries: Vec<Entry>, done: FlushCallback) -> Result<()> {
        if entries.is_empty() {
            done(Ok(()));
            return Ok(());
        }
        if let Some(e) = self.flush_error.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(StoreError::io("background fsync", &self.dir, std::io::Error::other(e)));
        }
        if self.sync_mark.is_tripped() {
            return Err(StoreError::io(
                "append after a failed fsync to",
                &self.dir,
                std::io::Error::other("the replica must be reopened (see the unsynced module)"),
            ));
        }
        let first = entries[0].log_id.index;
        if first != self.next_index() && self.last_stored_log_id().is_none() && self.log_end_offset() == 0 {
            // A log that never held a record may begin at any index (openraft
            // starts at 1 in some paths). Offsets are still 0 there.
            self.restart_at(first, 0)?;
        }
        self.maybe_roll()?;
        let mut buf = std::mem::take(&mut self.encode_buf);
        buf.clear();
        let mut headers = Vec::with_capacity(entries.len());
        let mut next_offset = self.log_end_offset();
        for (next_index, e) in (self.next_index()..).zip(&entries) {
            if e.log_id.index != next_index {
                self.encode_buf = buf;
                return Err(StoreError::Invalid(format!(
                    "append of index {} where {next_index} is next",
                    e.log_id.index
                )));
            }
            let h = match format::encode_entry(e, next_offset, &mut buf) {
                Ok(h) => h,
                Err(err) => {
                    self.encode_buf = buf;
                    return Err(StoreError::Invalid(format!("entry {}: {err}", e.log_id)));
                }
            };
            next_offset = h.next_offset();
            headers.push(h);
        }
        let (written, result) = self.append_frames(&buf, &headers);
        self.encode_buf = buf;
        for e in entries.into_iter().take(written) {
            self.cache.push(e);
        }
        result?;
        let file = self.active()?.file().clone();
        let (mark, covered) = (self.sync_mark.clone(), self.sync_mark.request(self.next_index()));
        match self.config.flush {
            FlushPolicy::Always => {
                let drop = self.take_cache_drop();
                let record = Arc::downgrade(&self.flushed);
                let checked: FlushCallback = Box::new(move |r| {
                    let r = mark.checked(r, covered);
                    if r.is_ok() {
                        FlushedRecord::raise_weak(&record, &mark);
                    }
                    done(r)
                });
                self.flusher.request_dropping(file, drop, Some(checked));
            }
            FlushPolicy::Interval { interval_ms } => {
                done(Ok(()));
                if self.last_interval_flush.elapsed() >= Duration::from_millis(interval_ms) {
                    self.last_interval_flush = Instant::now();
                    let drop = self.take_cache_drop();
                    let latch = self.flush_error.clone();
                    let flushed = Arc::downgrade(&self.flushed);
                    let record: FlushCallback = Box::new(move |r| match mark.checked(r, covered) {
                        Ok(()) => FlushedRecord::raise_weak(&flushed, &mark),
                        Err(e) => {
                            tracing::error!(error = %e, "background fsync failed; the replica stops accepting appends");
                            latch.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e.to_string());
                        }
                    });
                    self.flusher.request_dropping(file, drop, Some(record));
                }
            }
        }
        Ok(())
    }

    /// The part of the active segment to drop from the page cache with the
    /// flush requested next (see [`StoreConfig::page_cache_drop_behind_bytes`]):
    /// bytes written before the request, so made durable by its sync.
    fn take_cache_drop(&mut self) -> Option<crate::flusher::CacheDrop> {
        // The machine's own memory decides a left-out setting only for the
        // OS's files, not for an in-memory file system under test.
        let behind = if self.fs.is_os() {
            self.config.page_cache_drop_behind()
        } else {
            self.config.page_cache_drop_behind_bytes.unwrap_or(0)
        };
        let (offset, len) = self.segments.last_mut()?.take_cache_drop(behind)?;
        Some(crate::flusher::CacheDrop { offset, len, mark: self.sync_mark.clone() })
    }

    /// Counts a segment event on this log and in its flusher's total.
    fn note_segment_event(&self) {
        self.segment_events.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.flusher.note_segment_event();
    }

    /// Writes encoded frames (`frames`, described by `headers`) to the
    /// active segment, rolling it before a frame that would take it past
    /// `segment_bytes` (Kafka's rule: a segment stays within
    /// `segment.bytes` unless one frame alone is larger), so the sealed
    /// segments retention counts are never larger than configured.
    /// Returns how many frames were written, and the error that stopped
    /// the rest (the frames before it stay: a valid prefix).
    fn append_frames(&mut self, frames: &[u8], headers: &[format::FrameHeader]) -> (usize, Result<()>) {
        let bytes_max = self.config.segment_bytes;
        let (mut from, mut at) = (0, 0usize);
        while from < headers.len() {
            let active = match self.active() {
                Ok(a) => a,
                Err(e) => return (from, Err(e)),
            };
            let room = bytes_max.saturating_sub(active.size_bytes());
            let (mut to, mut len) = (from, 0u64);
            while let Some(h) = headers.get(to) {
                let frame = h.frame_bytes as u64;
                if len + frame > room && !(to == from && active.is_empty()) {
                    break;
                }
                len += frame;
                to += 1;
            }
            if to == from {
                if let Err(e) = self.roll() {
                    // A seal's fsync may have failed: after that nothing is
                    // known of what reached the disk (fsyncgate), so this log
                    // takes no more appends until it is reopened (and
                    // rescanned), as after a failed background fsync.
                    self.sync_mark.trip(&e);
                    let mut latch = self.flush_error.lock().unwrap_or_else(|p| p.into_inner());
                    latch.get_or_insert(format!("rolling the active segment: {e}"));
                    return (from, Err(e));
                }
                continue;
            }
            let end = at + len as usize;
            if let Err(e) = active.append(&frames[at..end], &headers[from..to]) {
                return (from, Err(e));
            }
            (from, at) = (to, end);
        }
        (from, Ok(()))
    }

    fn maybe_roll(&mut self) -> Result<()> {
        let (bytes_max, age_max) = (self.config.segment_bytes, self.config.segment_age_max());
        let active = self.active()?;
        let full = active.size_bytes() >= bytes_max;
        let old = active.age() >= age_max;
        if active.is_empty() || !(full || old) {
            return Ok(());
        }
        self.roll()
    }

    /// Seals the active segment and starts a new one after it.
    /// Seals the active segment. Its fsync covers entries flushes may still
    /// be waiting for: a failure trips the durable point
    /// ([`crate::unsynced`]) and the log takes no more appends.
    fn seal_active(&mut self) -> Result<()> {
        let covered = self.sync_mark.request(self.next_index());
        let result = self.active()?.seal();
        if let Err(e) = &result {
            self.sync_mark.trip(e);
            let mut latch = self.flush_error.lock().unwrap_or_else(|p| p.into_inner());
            latch.get_or_insert(format!("sealing the active segment: {e}"));
        } else {
            // The seal fsynced everything written to the segment.
            if self.sync_mark.checked(Ok(()), covered).is_ok() {
                self.flushed.raise(&self.sync_mark);
            }
        }
        result
    }

    fn roll(&mut self) -> Result<()> {
        let active = self.active()?;
        let (base_index, base_offset) = (active.next_index(), active.next_offset());
        self.seal_active()?;
        let seg =
            Segment::create(&self.fs, &self.dir, base_index, base_offset, self.config.index_interval_bytes)?;
        tracing::debug!(dir = %self.dir.display(), base_index, base_offset, "rolled segment");
        self.segments.push(seg);
        self.note_segment_event();
        Ok(())
    }

    /// A counter, readable without the log's lock, of what retention reacts
    /// to since the log opened: a roll of the active segment on an append
    /// (full or old; not compaction's rolls) and a move of the log start
    /// offset. A broker that polls it decides and deletes at once instead
    /// of at its next retention check.
    pub fn segment_events(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.segment_events.clone()
    }

    /// Entries with index in `start..end` that Raft may see (above the purge
    /// pointer), from the tail cache where possible, else from disk.
    ///
    /// # Errors
    /// [`StoreError::Corruption`] with file and position if a frame read
    /// from disk does not verify; [`StoreError::Io`].
    pub fn entries(&self, start: u64, end: u64) -> Result<Vec<Entry>> {
        let start = start.max(self.purged.map_or(0, |p| p.index + 1));
        let start = start.max(self.segments.first().map_or(0, Segment::base_index));
        let end = end.min(self.next_index());
        let mut out = Vec::with_capacity(end.saturating_sub(start).min(4096) as usize);
        if start >= end {
            return Ok(out);
        }
        let cache_first = self.cache.first_index().unwrap_or(u64::MAX).max(start);
        let disk_end = end.min(cache_first);
        let mut index = start;
        while index < disk_end {
            let seg = self.segment_for_index(index);
            let pos = seg.position_of_index(index)?;
            let (frames, _) = seg.read_frames(pos, usize::MAX, true, |h| h.index() < disk_end)?;
            if frames.is_empty() {
                break;
            }
            for (h, bytes) in frames {
                let e = format::decode_entry(&h, &bytes).map_err(|source| StoreError::Corruption {
                    path: seg.path().to_owned(),
                    position: pos,
                    source,
                })?;
                out.push(e);
                index = h.index() + 1;
            }
        }
        out.extend(self.cache.range(index, end));
        Ok(out)
    }

    /// The segment that holds (or would hold) `index`.
    fn segment_for_index(&self, index: u64) -> &Segment {
        let i = self.segments.partition_point(|s| s.base_index() <= index).saturating_sub(1);
        &self.segments[i]
    }

    /// Removes every entry after `last` (all of them for `None`); Raft calls
    /// this only for uncommitted entries (Raft paper §5.3). Fsyncs the cut.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] if asked to remove committed or purged
    /// entries; [`StoreError::Io`].
    pub fn truncate_after(&mut self, last: Option<LogId>) -> Result<()> {
        let keep_to = last.map_or(0, |l| l.index + 1);
        if keep_to >= self.next_index() {
            return Ok(());
        }
        self.segments_changed();
        if let Some(c) = self.committed.filter(|c| c.index >= keep_to) {
            return Err(StoreError::Invalid(format!("truncate to {keep_to} would remove committed {c}")));
        }
        let committed_unknown = self.committed.is_none();
        let first_index = self.segments.first().map_or(0, Segment::base_index);
        if keep_to < first_index {
            return Err(StoreError::Invalid(format!(
                "truncate to {keep_to} is below the first stored index {first_index}"
            )));
        }
        self.lower_flushed(keep_to)?;
        while self.segments.len() > 1 && self.segments[self.segments.len() - 1].base_index() > keep_to {
            if let Some(seg) = self.segments.pop() {
                seg.delete()?;
            }
        }
        let seg = self.active()?;
        if seg.is_sealed() && seg.next_index() == keep_to {
            // Nothing to cut in a sealed (possibly snapshot-linked) file:
            // start a fresh active segment instead of reopening it.
            let (i, o) = (seg.next_index(), seg.next_offset());
            self.segments.push(Segment::create(&self.fs, &self.dir, i, o, self.config.index_interval_bytes)?);
        } else {
            let pos = seg.position_of_index(keep_to)?;
            // Above a known commit index the cut is above every snapshot
            // (they hold applied entries only): in place. Without one, a
            // snapshot's linked prefix is spared.
            seg.truncate_at(pos, committed_unknown)?;
        }
        fsutil::sync_dir(&*self.fs, &self.dir)?;
        self.cache.truncate_from(keep_to);
        Ok(())
    }

    /// Moves the Raft purge pointer to `upto` (inclusive). Segment files
    /// stay: they are deleted by retention, not by Raft.
    ///
    /// Purging past the last stored entry needs to know the offset after
    /// `upto`: the caller replaces the log from the snapshot first
    /// ([`Replica`](crate::Replica) does). Here it is accepted only for a log
    /// that never held a record, whose offsets are all 0.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a purge past the end of a log with
    /// records; [`StoreError::Meta`] if the pointer cannot be saved;
    /// [`StoreError::Io`].
    pub fn purge(&mut self, upto: LogId) -> Result<()> {
        if self.purged.is_some_and(|p| p.index >= upto.index) {
            return Ok(());
        }
        if upto.index >= self.next_index() {
            if self.log_end_offset() != 0 {
                return Err(StoreError::Invalid(format!(
                    "purge to {upto} past the last entry {} without a snapshot to restart from",
                    self.next_index().saturating_sub(1)
                )));
            }
            self.restart_at(upto.index + 1, 0)?;
        }
        self.purged = Some(upto);
        self.meta.put(meta::KEY_PURGED, Some(&upto), Sync::Lazy)?;
        self.cache.purge_to(upto.index);
        self.delete_retired_segments()?;
        Ok(())
    }

    /// Replaces all segments with one empty segment starting at
    /// (`base_index`, `base_offset`).
    ///
    /// Crash-safe: old segments are removed newest first (a crash leaves a
    /// shorter but valid chain), then the new one is created; a crash with
    /// no segment left is resumed by `open`'s `empty_start`.
    pub(crate) fn restart_at(&mut self, base_index: u64, base_offset: u64) -> Result<()> {
        self.segments_changed();
        self.meta.put(meta::KEY_EMPTY_START, Some(&(base_index, base_offset)), Sync::Durable)?;
        self.remove_all_segments()?;
        let new =
            Segment::create(&self.fs, &self.dir, base_index, base_offset, self.config.index_interval_bytes)?;
        self.segments.push(new);
        // Nothing unflushed below the new start.
        self.sync_mark.raise_to(base_index);
        self.flushed.raise(&self.sync_mark);
        Ok(())
    }

    fn remove_all_segments(&mut self) -> Result<()> {
        self.lower_flushed(0)?;
        self.cache.clear();
        while let Some(seg) = self.segments.pop() {
            seg.delete()?;
        }
        fsutil::sync_dir(&*self.fs, &self.dir)
    }

    /// Replaces all segments with the verified segment files `files` (of
    /// a snapshot: each with the bytes of it that belong to the snapshot,
    /// `None` for all; see [`crate::snapshot::SnapshotFiles::segments`]),
    /// which must continue each other.
    pub(crate) fn replace_segments(
        &mut self,
        files: &[(PathBuf, Option<u64>)],
        expect_next: (u64, u64),
    ) -> Result<()> {
        self.segments_changed();
        let result = self.import_segments(files, expect_next);
        if self.segments.is_empty() {
            // Keep the invariant (never without an active segment) even when
            // the import failed half way; Raft will resend the snapshot.
            let seg = Segment::create(
                &self.fs,
                &self.dir,
                expect_next.0,
                expect_next.1,
                self.config.index_interval_bytes,
            )?;
            self.segments.push(seg);
        }
        result
    }

    ///
    /// Crash-safe: local segments are removed newest first, then each
    /// imported file is linked (or copied and fsynced) under a temporary
    /// name and renamed into place in log order, so a crash leaves a valid
    /// prefix of the new chain, or nothing (then `open` starts from its
    /// `empty_start`). A file longer than the part the snapshot holds (a
    /// prefix-linked segment of this broker's own snapshot) has just that
    /// part copied; any other is linked. A linked tail is never appended
    /// to: the log rolls a new active segment after it.
    fn import_segments(&mut self, files: &[(PathBuf, Option<u64>)], expect_next: (u64, u64)) -> Result<()> {
        let mut bases = Vec::with_capacity(files.len());
        for (f, _) in files {
            let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let base = parse_segment_file_name(name).ok_or_else(|| {
                StoreError::Invalid(format!("snapshot file {} is not a segment", f.display()))
            })?;
            bases.push(base);
        }
        // If a crash leaves no segment, the log restarts right after the
        // snapshot, which the caller recorded before calling this.
        let start = expect_next;
        self.meta.put(meta::KEY_EMPTY_START, Some(&start), Sync::Durable)?;
        self.meta.put(meta::KEY_IMPORTING, Some(&true), Sync::Durable)?;
        self.remove_all_segments()?;
        for ((f, prefix), base) in files.iter().zip(&bases) {
            let dst = self.dir.join(crate::segment::segment_file_name(*base));
            let tmp = dst.with_extension("seg.tmp");
            fsutil::remove_if_exists(&*self.fs, &tmp)?;
            let len = self.fs.metadata(f).map_err(|e| StoreError::io("stat", f, e))?.len;
            if let Some(want) = *prefix
                && want != len
            {
                if len < want {
                    return Err(StoreError::Invalid(format!(
                        "snapshot file {} holds {len} bytes, its manifest {want}",
                        f.display()
                    )));
                }
                fsutil::copy_prefix(&*self.fs, f, &tmp, Some(want))?;
            } else {
                fsutil::link_or_copy(&*self.fs, f, &tmp)?;
            }
            self.fs.rename(&tmp, &dst).map_err(|e| StoreError::io("rename", &dst, e))?;
        }
        fsutil::sync_dir(&*self.fs, &self.dir)?;
        // A snapshot's files are never repaired here: a damaged one fails the
        // install, and Raft sends the snapshot again.
        self.segments = open_chain(&self.fs, &self.dir, &bases, &self.config, false).map_err(|(_, e)| e)?;
        let ends_right = self.segments.last().map(|s| (s.next_index(), s.next_offset())) == Some(expect_next);
        if !ends_right {
            tracing::warn!(dir = %self.dir.display(), "snapshot segments do not end at the snapshot; starting empty after it");
            self.restart_at(expect_next.0, expect_next.1)?;
        } else {
            self.roll_if_linked()?;
        }
        // The snapshot's files were fsynced when put in place.
        self.sync_mark.raise_to(self.next_index());
        self.flushed.raise(&self.sync_mark);
        self.meta.put::<bool>(meta::KEY_IMPORTING, None, Sync::Durable)?;
        Ok(())
    }

    /// Segments holding entries up to and including `upto`, for a
    /// snapshot: `(path, None)` when every entry of the file is ≤ `upto`
    /// and the file is sealed (held whole); else `(path, Some(n))`, the
    /// byte length of the prefix that holds the entries ≤ `upto` (the file
    /// is linked all the same, with `n` in the manifest).
    pub(crate) fn snapshot_sources(&self, upto: u64, log_start: u64) -> Result<Vec<(PathBuf, Option<u64>)>> {
        let mut out = Vec::new();
        for (i, seg) in self.segments.iter().enumerate() {
            // A segment retention retired is left out: the snapshot holds
            // only what is served (and does not keep retired files alive
            // through its hard links).
            let retired = log_start > 0 && seg.next_offset() <= log_start && i + 1 < self.segments.len();
            if seg.base_index() > upto || seg.is_empty() || retired {
                continue;
            }
            let is_active = i + 1 == self.segments.len();
            if !is_active && seg.next_index() <= upto + 1 {
                out.push((seg.path().to_owned(), None));
            } else {
                let cut = seg.position_of_index((upto + 1).min(seg.next_index()))?;
                out.push((seg.path().to_owned(), Some(cut)));
            }
        }
        Ok(out)
    }

    /// Reads record batches for a consumer: whole batches starting with the
    /// one that holds `from_offset`, none reaching past `up_to_offset`
    /// (exclusive; the high watermark), at most `max_bytes` of frames unless
    /// the first batch alone is larger (KIP-74). Frames come back byte for
    /// byte as stored, CRC-verified. The same as [`PartitionLog::plan_read`]
    /// then [`ReadPlan::run`], with the log borrowed throughout.
    ///
    /// # Errors
    /// [`StoreError::OffsetOutOfRange`] if `from_offset` is below the log
    /// start offset or above `up_to_offset`; [`StoreError::Corruption`].
    pub fn read(&self, from_offset: u64, max_bytes: usize, up_to_offset: u64) -> Result<Vec<StoredBatch>> {
        self.plan_read(from_offset, max_bytes, up_to_offset)?.run()
    }

    /// Plans a consumer read (see [`PartitionLog::read`]) so that it can run
    /// without borrowing the log, i.e. without the lock appends need: checks
    /// the bounds, finds where the first batch starts through the sparse
    /// index (at most one index interval of frame headers read here), and
    /// takes a [`SegmentReader`] of each segment the read may reach (as many
    /// as `max_bytes` can cover).
    ///
    /// # Errors
    /// As [`PartitionLog::read`].
    pub fn plan_read(&self, from_offset: u64, max_bytes: usize, up_to_offset: u64) -> Result<ReadPlan> {
        let up_to = up_to_offset.min(self.log_end_offset());
        if from_offset < self.log_start_offset() || from_offset > self.log_end_offset() {
            return Err(StoreError::OffsetOutOfRange {
                offset: from_offset,
                log_start_offset: self.log_start_offset(),
                log_end_offset: self.log_end_offset(),
            });
        }
        let mut parts = Vec::new();
        if from_offset < up_to {
            let first = self.segments.partition_point(|s| s.next_offset() <= from_offset);
            let mut covered = 0u64;
            for (i, seg) in self.segments[first..].iter().enumerate() {
                // At least one segment is planned, however small
                // `max_bytes`: the first batch is returned whole (KIP-74).
                if seg.base_offset() >= up_to || (!parts.is_empty() && covered >= max_bytes as u64) {
                    break;
                }
                let pos =
                    if i == 0 { seg.position_of_offset(from_offset)? } else { SEGMENT_HEADER_BYTES as u64 };
                let reader = seg.reader();
                covered = covered.saturating_add(reader.bytes_from(pos));
                parts.push((reader, pos));
            }
        }
        Ok(ReadPlan { parts, from_offset, max_bytes, up_to })
    }

    /// Kafka's ListOffsets by timestamp (KIP-79) at record granularity: the
    /// first record, in offset order, whose timestamp is ≥ `timestamp_ms`,
    /// among the stored records below `up_to_offset` (the high watermark),
    /// as `(offset, record timestamp in ms)`; `None` if no such record is
    /// stored.
    ///
    /// The store does not know how records are encoded: `record_timestamps`
    /// decodes a batch's records (the frame payload) into their offset
    /// deltas and timestamps in offset order (a compacted batch holds fewer
    /// records than offsets). Only one batch is decoded: the first whose largest
    /// timestamp is ≥ the target, found through the segments' largest
    /// timestamps and the sparse index's "largest timestamp before this row"
    /// (a running maximum, so the binary search is on a monotone quantity
    /// whatever order the timestamps come in). No earlier batch holds a
    /// record that late, and this one holds at least one, unless compaction
    /// removed it: then later batches are read in turn.
    ///
    /// # Errors
    /// [`StoreError::Corruption`] for a frame that does not verify, for
    /// records `record_timestamps` cannot decode, or whose count or
    /// timestamps contradict the frame header (never a guessed answer);
    /// [`StoreError::Io`].
    pub fn offset_for_timestamp<E: std::fmt::Display>(
        &self,
        timestamp_ms: i64,
        up_to_offset: u64,
        mut record_timestamps: impl FnMut(Bytes) -> std::result::Result<Vec<(u32, i64)>, E>,
    ) -> Result<Option<(u64, i64)>> {
        let start = self.log_start_offset();
        let found = self.offset_for_timestamp_on_disk(timestamp_ms, up_to_offset, &mut record_timestamps)?;
        match found {
            // In a segment retention retired but Raft still keeps: the
            // answer is among the records served, from the log start on.
            Some((offset, _)) if offset < start => {
                self.scan_for_timestamp(start, timestamp_ms, up_to_offset, &mut record_timestamps)
            }
            other => Ok(other),
        }
    }

    /// [`PartitionLog::offset_for_timestamp`] over every segment on disk.
    fn offset_for_timestamp_on_disk<E: std::fmt::Display>(
        &self,
        timestamp_ms: i64,
        up_to_offset: u64,
        record_timestamps: &mut impl FnMut(Bytes) -> std::result::Result<Vec<(u32, i64)>, E>,
    ) -> Result<Option<(u64, i64)>> {
        for seg in self.segments.iter().filter(|s| s.max_timestamp_ms() >= timestamp_ms) {
            let pos = seg.position_of_timestamp(timestamp_ms)?;
            let Some((h, frame)) = seg.read_frames(pos, 1, true, |_| true)?.0.into_iter().next() else {
                continue;
            };
            if h.next_offset() > up_to_offset {
                // Batches are committed whole, and every later one is later still.
                return Ok(None);
            }
            let bad = |detail: String| StoreError::Corruption {
                path: seg.path().to_owned(),
                position: pos,
                source: format::DecodeError::Invalid { field: crate::error::RECORD_TIMESTAMPS_FIELD, detail },
            };
            let stamps = record_timestamps(frame.slice(format::FRAME_HEADER_BYTES..)).map_err(|e| {
                bad(format!("the records of the batch at offset {} do not decode: {e}", h.base_offset))
            })?;
            if stamps.len() > h.record_count as usize || stamps.iter().any(|(d, _)| *d >= h.record_count) {
                return Err(bad(format!(
                    "the batch at offset {} says it spans {} offsets but holds {} records (deltas up to {:?})",
                    h.base_offset,
                    h.record_count,
                    stamps.len(),
                    stamps.iter().map(|(d, _)| *d).max()
                )));
            }
            return match stamps.iter().find(|(_, t)| *t >= timestamp_ms) {
                Some((d, t)) => Ok(Some((h.base_offset + u64::from(*d), *t))),
                // Compaction removed the late record(s): the header keeps
                // the batch's original largest timestamp. Read on.
                None if stamps.len() < h.record_count as usize => {
                    self.scan_for_timestamp(h.next_offset(), timestamp_ms, up_to_offset, record_timestamps)
                }
                None => Err(bad(format!(
                    "the batch at offset {} says its largest timestamp is {} but no record is at or after {timestamp_ms}",
                    h.base_offset, h.max_timestamp_ms
                ))),
            };
        }
        Ok(None)
    }

    /// The first record at or after `from` (in offset order, below
    /// `up_to_offset`) whose timestamp is ≥ `timestamp_ms`, found by
    /// reading batches in turn: for a lookup whose indexed answer lies
    /// below the log start.
    fn scan_for_timestamp<E: std::fmt::Display>(
        &self,
        from: u64,
        timestamp_ms: i64,
        up_to_offset: u64,
        record_timestamps: &mut impl FnMut(Bytes) -> std::result::Result<Vec<(u32, i64)>, E>,
    ) -> Result<Option<(u64, i64)>> {
        let mut at = from;
        while at < up_to_offset.min(self.log_end_offset()) {
            let batches = self.read(at, 1 << 20, up_to_offset)?;
            let Some(last) = batches.last() else { return Ok(None) };
            at = last.header.next_offset();
            for b in &batches {
                let h = &b.header;
                if h.max_timestamp_ms < timestamp_ms {
                    continue;
                }
                let stamps = record_timestamps(b.records()).map_err(|e| {
                    StoreError::Invalid(format!(
                        "the records of the batch at offset {} do not decode: {e}",
                        h.base_offset
                    ))
                })?;
                if stamps.iter().any(|(d, _)| *d >= h.record_count) {
                    return Err(StoreError::Invalid(format!(
                        "the batch at offset {} spans {} offsets but holds a record at delta {:?}",
                        h.base_offset,
                        h.record_count,
                        stamps.iter().map(|(d, _)| *d).max()
                    )));
                }
                let hit =
                    stamps.iter().find(|(d, t)| *t >= timestamp_ms && h.base_offset + u64::from(*d) >= from);
                if let Some((d, t)) = hit {
                    return Ok(Some((h.base_offset + u64::from(*d), *t)));
                }
            }
        }
        Ok(None)
    }

    /// Persists the vote durably before returning (Raft paper §5.2).
    ///
    /// # Errors
    /// [`StoreError::Meta`].
    pub fn save_vote(&mut self, vote: &Vote) -> Result<()> {
        futures::executor::block_on(self.queue_vote(vote)?)?;
        self.vote_saved(*vote);
        Ok(())
    }

    /// Queues the vote's durable write: the returned future resolves once
    /// it is fsynced, and the vote must not be acted on (a vote granted, an
    /// election started) before then (Raft paper §5.2); then call
    /// [`PartitionLog::vote_saved`]. Waiting there, not under the log's
    /// lock, lets the votes of many replicas share one commit.
    ///
    /// # Errors
    /// [`StoreError::Meta`], now or from the future.
    pub fn queue_vote(
        &mut self,
        vote: &Vote,
    ) -> Result<impl Future<Output = Result<()>> + Send + 'static + use<>> {
        self.meta.put_durable(meta::KEY_VOTE, Some(vote))
    }

    /// Records that `vote`, queued by [`PartitionLog::queue_vote`], is durable.
    pub fn vote_saved(&mut self, vote: Vote) {
        self.vote = Some(vote);
    }

    /// The persisted vote.
    pub fn vote(&self) -> Option<Vote> {
        self.vote
    }

    /// Persists the committed log id atomically and lazily: durable within
    /// [`LAZY_DURABLE_WITHIN`](crate::meta_db::LAZY_DURABLE_WITHIN), without
    /// waiting; after a crash it may read back older, never newer or torn.
    /// The high watermark then restarts from the last durable value and
    /// Raft re-applies the rest (Kafka checkpoints its high watermark every
    /// 5 s the same way).
    ///
    /// # Errors
    /// [`StoreError::Meta`] if the value does not encode.
    pub fn save_committed(&mut self, committed: Option<LogId>) -> Result<()> {
        if committed == self.committed {
            return Ok(());
        }
        self.meta.put(meta::KEY_COMMITTED, committed.as_ref(), Sync::Lazy)?;
        self.committed = committed;
        Ok(())
    }

    /// The last committed log id this replica knows of.
    pub fn committed(&self) -> Option<LogId> {
        self.committed
    }

    /// The metadata database.
    pub(crate) fn meta(&self) -> &MetaStore {
        &self.meta
    }

    /// The active segment's file and path, to fsync without holding the
    /// log (see [`crate::Replica::sync`]); `None` without segments.
    pub fn active_file(&self) -> Option<(crate::vfs::FileRef, PathBuf)> {
        self.segments.last().map(|s| (s.file().clone(), s.path().to_path_buf()))
    }

    /// fsyncs the active segment now (used before a clean shutdown).
    ///
    /// # Errors
    /// [`StoreError::Io`].
    pub fn sync(&self) -> Result<()> {
        let Some(active) = self.segments.last() else { return Ok(()) };
        let covered = self.sync_mark.request(self.next_index());
        let result = active.file().sync_data();
        self.sync_mark.checked(result, covered).map_err(|e| StoreError::io("fsync", active.path(), e))?;
        self.flushed.raise(&self.sync_mark);
        Ok(())
    }

    /// What [`Replica`](crate::replica::Replica) needs to fsync the active
    /// segment outside the log's lock: the file, its path, the durable
    /// point to report to, and what the sync covers.
    pub(crate) fn sync_handle(
        &self,
    ) -> Option<(crate::vfs::FileRef, PathBuf, Arc<SyncMark>, unsynced::Covered)> {
        let active = self.segments.last()?;
        let covered = self.sync_mark.request(self.next_index());
        Some((active.file().clone(), active.path().to_owned(), self.sync_mark.clone(), covered))
    }

    /// At open, once the log's state is known: the durable point starts at
    /// the recorded flushed index (entries above it may be unflushed data
    /// a crash left in the page cache), and the tail is flushed through the
    /// flusher (batched with every other log opening) to raise it to the
    /// end. If that flush fails the mark trips below entries that may have
    /// been acknowledged, and the next open cuts them and marks the replica
    /// recovering (see `cut_unsynced_tail`).
    fn start_sync_mark(&mut self) {
        let start = self.flushed.recorded().min(self.next_index());
        self.sync_mark = Arc::new(SyncMark::new(self.fs.clone(), &self.dir, start));
        if let Some(active) = self.segments.last() {
            let (mark, covered) = (self.sync_mark.clone(), self.sync_mark.request(self.next_index()));
            let record = Arc::downgrade(&self.flushed);
            let callback: FlushCallback = Box::new(move |r| {
                if mark.checked(r, covered).is_ok() {
                    FlushedRecord::raise_weak(&record, &mark);
                }
            });
            self.flusher.request(active.file().clone(), Some(callback));
        }
    }

    /// At open: a log that ends below the index it recorded as flushed lost
    /// entries it had acknowledged (damage in its last frames looks like a
    /// torn tail and is cut as one): it is marked recovering, so it does
    /// not vote until a leader has brought it back.
    fn check_flushed_kept(&mut self) -> Result<()> {
        let flushed: u64 = self.meta.get(meta::KEY_FLUSHED)?.unwrap_or(0);
        if self.next_index() < flushed && self.recovering.is_none() {
            let reason = format!(
                "the log ends at index {} but had flushed (acknowledged) entries up to {}",
                self.next_index(),
                flushed - 1
            );
            tracing::error!(dir = %self.dir.display(), "{reason}; the replica does not vote until it has caught up");
            self.set_recovering(Some(reason))?;
        }
        Ok(())
    }

    /// Before the log's end moves back to `next_index`: lowers the recorded
    /// flushed index durably (so the shorter log is not taken for a damaged
    /// one), and the durable point.
    fn lower_flushed(&mut self, next_index: u64) -> Result<()> {
        self.flushed.lower(&self.sync_mark, next_index)
    }

    /// At open: cuts the entries a failed fsync left of unknown durability
    /// ([`crate::unsynced`]). None of them was acknowledged, so the replica
    /// may forget them; a recorded commit index above the cut is lowered to
    /// it (Raft does not need it durable: the leader tells it again).
    fn cut_unsynced_tail(&mut self) -> Result<()> {
        let Some(from) = unsynced::marker(&self.fs, &self.dir)? else { return Ok(()) };
        let first = self.segments.first().map_or(0, Segment::base_index);
        // Entries up to the purge pointer are in a snapshot: durable.
        let from = from.max(first).max(self.purged.map_or(0, |p| p.index + 1));
        if from < self.next_index() {
            let last = if self.purged.is_some_and(|p| p.index + 1 == from) {
                self.purged
            } else if from > first {
                self.entries(from - 1, from)?.first().map(|e| e.log_id)
            } else {
                None
            };
            tracing::warn!(dir = %self.dir.display(), from_index = from, to_index = self.next_index(),
                "cutting entries a failed fsync left of unknown durability; the leader sends them again");
            // Acknowledged entries may be among them when the durable point
            // was only the recorded flushed index (a failure of the flush
            // at open), or when appends are acknowledged before their fsync
            // (`flush = interval`): then the replica must not vote until a
            // leader brought it back.
            let flushed = self.flushed.recorded();
            if from <= flushed || matches!(self.config.flush, FlushPolicy::Interval { .. }) {
                self.set_recovering(Some(format!(
                    "entries from index {from} were cut after a failed fsync and may have been acknowledged"
                )))?;
            }
            if self.committed.is_some_and(|c| c.index >= from) {
                self.meta.put(meta::KEY_COMMITTED, last.as_ref(), Sync::Durable)?;
                self.committed = last;
            }
            if last.is_none() && from == first {
                // Everything goes: the log restarts empty where it began.
                let base_offset = self.segments.first().map_or(0, Segment::base_offset);
                self.restart_at(first, base_offset)?;
            } else {
                // Without a commit index the cut spares snapshot links (a
                // snapshot may hold a prefix of the file being cut).
                let committed = self.committed.take();
                let cut = self.truncate_after(last);
                self.committed = committed;
                cut?;
            }
        }
        unsynced::clear(&self.fs, &self.dir)
    }

    /// The offset one past the entry at `index`: the high watermark when
    /// `index` is the commit index. `None` if that entry is not stored.
    ///
    /// # Errors
    /// [`StoreError::Corruption`]; [`StoreError::Io`].
    pub fn next_offset_after(&self, index: u64) -> Result<Option<u64>> {
        if index + 1 == self.next_index() {
            return Ok(Some(self.log_end_offset()));
        }
        if index + 1 > self.next_index() || index < self.segments.first().map_or(0, Segment::base_index) {
            return Ok(None);
        }
        let seg = self.segment_for_index(index);
        let pos = seg.position_of_index(index)?;
        Ok(seg.read_frames(pos, 1, true, |_| true)?.0.first().map(|(h, _)| h.next_offset()))
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// When the active segment rolls: at `segment_bytes` bytes or
    /// `segment_ms` ms of age (a topic's `segment.bytes` / `segment.ms`),
    /// from the next append on. Segments already sealed stay as they are.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for values the store refuses (below 4 KiB,
    /// or 0 ms); nothing changes then.
    pub fn set_roll_limits(&mut self, segment_bytes: u64, segment_ms: u64) -> Result<()> {
        let next = StoreConfig { segment_bytes, segment_ms, ..self.config.clone() };
        next.validate().map_err(|e| StoreError::Invalid(e.to_string()))?;
        self.config = next;
        Ok(())
    }

    /// The active segment's roll limits: (`segment_bytes`, `segment_ms`).
    pub fn roll_limits(&self) -> (u64, u64) {
        (self.config.segment_bytes, self.config.segment_ms)
    }
}

/// Removes tail segments torn while being created (no whole header, so no
/// entry) from `bases`, deleting their files.
fn drop_torn_created(fs: &Fs, dir: &Path, bases: &mut Vec<u64>) -> Result<()> {
    while let Some(&last) = bases.last() {
        let path = dir.join(crate::segment::segment_file_name(last));
        let len = fs.metadata(&path).map_err(|e| StoreError::io("stat", &path, e))?.len;
        if len <= format::SEGMENT_HEADER_BYTES as u64 {
            let head = fsutil::read(&**fs, &path)?;
            if format::SegmentHeader::decode(&head).is_err() {
                // A crash while the segment was created left it without a
                // whole header, and so without any entry.
                tracing::warn!(path = %path.display(), "removing segment torn while being created");
                fsutil::remove_if_exists(&**fs, &path)?;
                bases.pop();
                continue;
            }
        }
        return Ok(());
    }
    Ok(())
}

/// Opens the segments with the given base indexes (sorted) in `dir` as one
/// chain; the last one is the tail and gets torn-write recovery (a bad
/// frame with nothing valid after it is cut). With `rescan`, sealed
/// segments are verified frame by frame instead of loaded from their index.
///
/// # Errors
/// `Err((i, e))`: the segment `bases[i]` is damaged or does not continue
/// the one before it ([`StoreError::Corruption`], whose position is where
/// its valid prefix ends), or an IO error while opening it.
fn open_chain(
    fs: &Fs,
    dir: &Path,
    bases: &[u64],
    config: &StoreConfig,
    rescan: bool,
) -> std::result::Result<Vec<Segment>, (usize, StoreError)> {
    let mut segments: Vec<Segment> = Vec::with_capacity(bases.len());
    for (i, &base) in bases.iter().enumerate() {
        let path = dir.join(crate::segment::segment_file_name(base));
        let is_tail = i + 1 == bases.len();
        if is_tail {
            fsutil::remove_if_exists(&**fs, &path.with_extension("idx")).map_err(|e| (i, e))?;
        }
        let (mut seg, cut) =
            Segment::open(fs, &path, is_tail, rescan, config.index_interval_bytes).map_err(|e| (i, e))?;
        if let Some(prev) = segments.last()
            && (seg.base_index() != prev.next_index() || seg.base_offset() != prev.next_offset())
        {
            let detail = format!(
                "segment starts at index {} offset {}, previous ends before index {} offset {}",
                seg.base_index(),
                seg.base_offset(),
                prev.next_index(),
                prev.next_offset()
            );
            let source = format::DecodeError::Invalid { field: "segment chain", detail };
            return Err((i, StoreError::Corruption { path, position: 0, source }));
        }
        if let Some(cut) = cut {
            let len = fs.metadata(&path).map(|m| m.len).unwrap_or(cut);
            tracing::warn!(path = %path.display(), position = cut, dropped_bytes = len - cut,
                "cutting torn tail left by a crash");
            // A torn tail lies past what was fsynced, so past any
            // snapshot's linked prefix: cut in place.
            seg.truncate_at(cut, false).map_err(|e| (i, e))?;
        }
        segments.push(seg);
    }
    Ok(segments)
}

/// Segment events of every log in this process (see
/// [`PartitionLog::segment_events`]): a poller reads this one counter and
/// scans its logs only when it moved.
impl Drop for PartitionLog {
    /// Records the flushed index (lazily: the metadata database makes it
    /// durable when it closes), so a clean close leaves no window.
    fn drop(&mut self) {
        self.flushed.raise(&self.sync_mark);
        self.flushed.detach();
    }
}

/// The log's record of the index below which every entry was flushed
/// ([`meta::KEY_FLUSHED`]), shared with its flush callbacks: each fsync
/// that completes raises it (a lazy write, durable within
/// [`crate::meta_db::LAZY_DURABLE_WITHIN`]), so it follows the last fsync
/// also when no append comes after it. Raised at the append that followed
/// an fsync, it had lagged an idle log's last entries for good, and a bit
/// flipped in them passed at open for a torn tail (found by the
/// simulation: seed 5280 lost a committed entry). Raising reads the
/// durable point and lowering moves it under one lock, so a callback that
/// read the point before a truncation cannot record it after.
///
/// A flush callback may still run when its log is dropped: the log
/// detaches the metadata first ([`FlushedRecord::detach`]), so no callback
/// keeps the log's claim on the replica's name alive (the replica could
/// not be opened again meanwhile: seen as "replica . is open already").
#[derive(Debug)]
struct FlushedRecord {
    state: Mutex<Flushed>,
}

#[derive(Debug)]
struct Flushed {
    recorded: u64,
    /// The log's metadata; `None` once the log is dropped.
    meta: Option<Arc<MetaStore>>,
}

impl FlushedRecord {
    fn state(&self) -> std::sync::MutexGuard<'_, Flushed> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `mark`'s durable point (lazily) if it is higher than what
    /// was recorded.
    fn raise(&self, mark: &SyncMark) {
        let mut st = self.state();
        let to = mark.synced_to();
        if to > st.recorded
            && let Some(meta) = &st.meta
        {
            let _ = meta.put(meta::KEY_FLUSHED, Some(&to), Sync::Lazy);
            st.recorded = to;
        }
    }

    /// Before the log's end moves back to `next_index`: lowers `mark` and
    /// the record (durably, so the shorter log is not taken for a damaged
    /// one at the next open).
    fn lower(&self, mark: &SyncMark, next_index: u64) -> Result<()> {
        let mut st = self.state();
        mark.lower_to(next_index);
        if st.recorded > next_index
            && let Some(meta) = &st.meta
        {
            meta.put(meta::KEY_FLUSHED, Some(&next_index), Sync::Durable)?;
            st.recorded = next_index;
        }
        Ok(())
    }

    /// [`FlushedRecord::raise`] from a flush callback, which holds the
    /// record weakly.
    fn raise_weak(record: &std::sync::Weak<Self>, mark: &SyncMark) {
        if let Some(r) = record.upgrade() {
            r.raise(mark);
        }
    }

    /// Lets go of the log's metadata (the log is being dropped); later
    /// raises do nothing.
    fn detach(&self) {
        self.state().meta = None;
    }

    fn recorded(&self) -> u64 {
        self.state().recorded
    }
}

/// Damage that [`PartitionLog::open`] found in the segment files and set
/// aside, keeping the valid prefix of the log. Entries after it are fetched
/// again from the leader; the set-aside bytes are kept for an operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Damage {
    /// The damaged (or out-of-chain) segment file.
    pub path: PathBuf,
    /// Byte position in it where the valid prefix ends (at or below the
    /// segment header: none of the file is kept).
    pub position: u64,
    /// What was wrong, as the check that failed reported it.
    pub detail: String,
    /// Directory holding copies of what was cut and the segments moved away.
    pub set_aside: PathBuf,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} damaged at byte {} ({}); what followed was set aside in {}",
            self.path.display(),
            self.position,
            self.detail,
            self.set_aside.display()
        )
    }
}

/// Name of the directory inside a log directory where damaged segments are
/// set aside (one subdirectory per repair, named by its time in ms).
pub const DAMAGED_DIR: &str = "damaged";

/// Keeps the valid prefix of the chain `bases` whose segment `at` failed
/// with `error`: that segment is copied aside and cut at the error's
/// position (or moved aside whole when nothing of it verifies), and every
/// later segment is moved aside. `bases` shrinks to what is kept.
fn set_aside(fs: &Fs, dir: &Path, bases: &mut Vec<u64>, at: usize, error: &StoreError) -> Result<Damage> {
    let (path, position, detail) = match error {
        StoreError::Corruption { path, position, source } => (path.clone(), *position, source.to_string()),
        other => (dir.join(crate::segment::segment_file_name(bases[at])), 0, other.to_string()),
    };
    let stamp = crate::runtime::wall_clock_ms();
    let aside = dir.join(DAMAGED_DIR).join(stamp.to_string());
    fsutil::create_dir_durable(&**fs, &aside)?;
    let move_aside = |base: u64| -> Result<()> {
        let seg = dir.join(crate::segment::segment_file_name(base));
        for p in [seg.with_extension("idx"), seg] {
            if let Some(name) = p.file_name()
                && fsutil::exists(&**fs, &p)?
            {
                let to = aside.join(name);
                fs.rename(&p, &to).map_err(|e| StoreError::io("move aside", &p, e))?;
            }
        }
        Ok(())
    };
    for &base in bases[at + 1..].iter().rev() {
        move_aside(base)?;
    }
    let keep_prefix = position > format::SEGMENT_HEADER_BYTES as u64;
    if keep_prefix {
        let name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        let copy = aside.join(name);
        fsutil::copy_prefix(&**fs, &path, &copy, None)?;
        fsutil::remove_if_exists(&**fs, &path.with_extension("idx"))?;
        fsutil::cut_file(&**fs, &path, position)?;
        bases.truncate(at + 1);
    } else {
        move_aside(bases[at])?;
        bases.truncate(at);
    }
    fsutil::sync_dir(&**fs, &aside)?;
    fsutil::sync_dir(&**fs, dir)?;
    let damage = Damage { path, position, detail, set_aside: aside };
    tracing::error!(%damage, "damaged log: keeping its valid prefix; the rest is fetched from the leader");
    Ok(damage)
}

/// Opens the chain of segments `bases` in `dir`, setting aside damaged
/// segments and everything after them (see [`set_aside`]) until what
/// remains verifies. Returns the segments and what was set aside.
///
/// # Errors
/// [`StoreError::Io`] if a file cannot be read, moved or cut.
fn open_segments(
    fs: &Fs,
    dir: &Path,
    bases: &[u64],
    config: &StoreConfig,
    rescan: bool,
) -> Result<(Vec<Segment>, Vec<Damage>)> {
    let mut bases = bases.to_vec();
    drop_torn_created(fs, dir, &mut bases)?;
    let mut damage = Vec::new();
    loop {
        match open_chain(fs, dir, &bases, config, rescan) {
            Ok(segments) => return Ok((segments, damage)),
            Err((at, e @ StoreError::Corruption { .. })) => {
                damage.push(set_aside(fs, dir, &mut bases, at, &e)?)
            }
            Err((_, e)) => return Err(e),
        }
    }
}
