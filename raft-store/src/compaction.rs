//! Log compaction (Kafka's `cleanup.policy=compact`): keep the latest
//! record of each key, drop tombstones after a while, never move an offset.
//!
//! **Deterministic, not replicated.** A partition's leader decides a
//! [`CompactionTarget`] and replicates it through the partition's Raft log
//! as a control entry; every replica then rewrites its own sealed segments
//! by one rule that depends only on the committed records below the
//! target and on the target itself:
//!
//! > a record at offset `o < through` with key `k` is kept iff no later
//! > record below `through` has key `k`, and, when its value is null (a
//! > tombstone), `o ≥ tombstones_below`. Records at or above `through`,
//! > and records without a key, are always kept.
//!
//! So every replica derives the same records at the same offsets from the
//! same prefix, whatever its segment boundaries or how often it compacted:
//! the rule is idempotent and a later target only removes more (a record
//! superseded below one `through` is superseded below every later one).
//! One exception, by design: a replica may cap `tombstones_below` at its
//! own horizon ([`Replica::compact`]), so for a while replicas may differ
//! in which tombstones they still hold; once every cap passes the target's
//! they hold the same records.
//! Shipping compacted segments instead would send every byte a second time
//! over the network; deriving them costs each replica one read of the
//! region it compacts.
//!
//! Raft entries are never removed: a batch keeps its frame, log id, base
//! offset and record count (the offsets it spans) and loses records from
//! its payload, each survivor carrying its offset delta. So Raft indices,
//! the offset index and every reader's arithmetic stay as they were, and
//! an entry a leader sends from a compacted segment is the same entry with
//! fewer records: what the follower's own compaction produces for the same
//! target (tombstones aside, under a cap).
//!
//! The store does not know how records are encoded: the broker hands it a
//! [`RecordCodec`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::format::{self, FrameKind, SEGMENT_HEADER_BYTES, SegmentHeader};
use crate::fsutil;
use crate::log::{CompactionCandidate, StoredBatch};
use crate::replica::Replica;
use crate::segment::Segment;
use crate::types::EntryPayload;
use crate::vfs::{OpenMode, Vfs};

/// What every replica compacts to (see the module documentation); carried
/// by [`crate::Control::Compact`] and a snapshot's manifest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompactionTarget {
    /// Records below this offset are compacted (exclusive; ≤ the high
    /// watermark when the leader decided it).
    pub through: u64,
    /// Tombstones below this offset are removed (≤ `through`): the leader
    /// sets it to an earlier `through` its own passes finished at least
    /// `delete.retention.ms` ago (KIP-534).
    pub tombstones_below: u64,
}

impl CompactionTarget {
    /// The same target removing tombstones only below `tombstones_below_max`
    /// too (a replica's own horizon; see [`Replica::compact`]).
    pub fn capped(self, tombstones_below_max: u64) -> Self {
        CompactionTarget { tombstones_below: self.tombstones_below.min(tombstones_below_max), ..self }
    }

    /// The target that compacts at least as much as both.
    pub fn max(self, other: Self) -> Self {
        CompactionTarget {
            through: self.through.max(other.through),
            tombstones_below: self.tombstones_below.max(other.tombstones_below),
        }
    }
}

/// One record as compaction sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyedRecord {
    /// Its offset minus its batch's base offset.
    pub offset_delta: u32,
    /// Its key; `None` for a record without one (always kept).
    pub key: Option<Bytes>,
    /// Whether its value is null (Kafka's tombstone).
    pub tombstone: bool,
}

/// How a batch's records are encoded, for compaction (the broker's
/// encoding; the store does not look inside a batch otherwise).
pub trait RecordCodec: Send + Sync {
    /// The batch's records in offset order.
    ///
    /// # Errors
    /// A message when the payload does not decode.
    fn keyed(&self, records: &Bytes) -> std::result::Result<Vec<KeyedRecord>, String>;

    /// The payload holding only the records whose `keep` flag is set
    /// (`keep` parallels [`RecordCodec::keyed`]'s list), each carrying its
    /// offset delta.
    ///
    /// # Errors
    /// A message when the payload does not decode.
    fn retain(&self, records: &Bytes, keep: &[bool]) -> std::result::Result<Bytes, String>;
}

/// What one compaction pass did ([`Replica::compact`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompactionStats {
    /// The target compacted to.
    pub target: CompactionTarget,
    /// Bytes of frames read (building the key map and rewriting).
    pub bytes_read: u64,
    /// Segment files rewritten.
    pub segments_rewritten: usize,
    /// Their size before, bytes.
    pub bytes_before: u64,
    /// Their size after, bytes.
    pub bytes_after: u64,
    /// Records removed.
    pub records_removed: u64,
    /// Distinct keys in the largest key map (of all keys below the target
    /// when the pass ran in one chunk).
    pub keys: usize,
    /// Chunks the range was compacted in (the key map's limit).
    pub chunks: usize,
    /// Whether the pass finished the target (else the next pass goes on:
    /// records below it were in a segment not wholly committed, or a
    /// segment changed under the pass).
    pub complete: bool,
}

/// Bytes a key-map pass reads per lock-free read.
const READ_CHUNK_BYTES: usize = 4 << 20;

/// Bytes a key map entry is counted for beside its key's own: the copy's
/// header, the offset and the table's slot.
const MAP_ENTRY_OVERHEAD_BYTES: usize = 64;

impl Replica {
    /// Compacts this replica's sealed segments to its compaction target
    /// (see the module documentation), if it has not already: builds the
    /// map of each key's latest offset below the target from the committed
    /// records, then rewrites each sealed, wholly committed segment holding
    /// records below the target in which a record goes. A rewritten segment
    /// is written beside the old one, fsynced, and renamed over it under the
    /// log's lock (readers and snapshots holding the old file keep it); a
    /// segment that changed meanwhile (retention, a snapshot install) is
    /// left for the next pass. Blocking file IO: call it off async worker
    /// threads. Returns `None` when there was nothing to do (or another
    /// pass of this replica is running).
    ///
    /// `throttle` is called with the bytes read after each read, and may
    /// sleep (Kafka's `log.cleaner.io.max.bytes.per.second`). The key map
    /// holds at most about `map_bytes_max` bytes (Kafka's
    /// `log.cleaner.dedupe.buffer.size`); more keys are compacted in chunks.
    ///
    /// Tombstones go only below `tombstones_below_max` as well as below the
    /// target's `tombstones_below`: the caller's own horizon (where this
    /// replica's passes finished at least `delete.retention.ms` ago, KIP-534),
    /// so a replica that lagged never drops a value and the tombstone that
    /// shadows it in one pass, which a reader that read the value before the
    /// pass would miss. `u64::MAX` takes the target as it is. The pass
    /// finishes the target so capped ([`Replica::compaction_pending`]);
    /// once the cap reaches the target, every replica holds the same records.
    ///
    /// # Errors
    /// [`StoreError::Corruption`] for a frame that does not verify or
    /// records `codec` cannot decode (nothing is rewritten from it);
    /// [`StoreError::Io`].
    pub fn compact(
        &self,
        codec: &dyn RecordCodec,
        map_bytes_max: usize,
        tombstones_below_max: u64,
        throttle: &mut dyn FnMut(u64),
    ) -> Result<Option<CompactionStats>> {
        // One pass at a time (they would write the same temporary files).
        let _pass = match self.inner.compacting.try_lock() {
            Ok(g) => g,
            // A pass that panicked left nothing half done that a new pass
            // does not redo (files are swapped whole).
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(None),
        };
        let (target, start, generation) = {
            let mut log = self.log();
            let target = log.compaction_target().capped(tombstones_below_max);
            if target.through == 0 || log.compacted_to() == Some(target) {
                return Ok(None);
            }
            // Records below the target may sit in the active segment again
            // (a truncation reopened a sealed one; a crash before the roll).
            log.roll_below_compaction_target()?;
            (target, log.log_start_offset(), log.generation())
        };
        let mut stats = CompactionStats { target, ..CompactionStats::default() };
        let mut all_done = true;
        // The key map holds at most `map_bytes_max`: when the keys below the
        // target do not fit, the range is compacted in chunks, each up to
        // where its map ends, oldest first (Kafka's cleaner does the same).
        // After chunk `[from, end)`, records below `end` are those the rule
        // keeps for a target at `end`; a record below `from` whose key is
        // not in the next chunk's map is already its key's latest, so the
        // last chunk leaves what the rule keeps for the whole target.
        let mut from = start;
        while from < target.through {
            let Some((latest, end)) =
                self.key_map(codec, from, target.through, map_bytes_max, &mut stats, throttle)?
            else {
                return Ok(None);
            };
            stats.keys = stats.keys.max(latest.len());
            stats.chunks += 1;
            let chunk = CompactionTarget { through: end, tombstones_below: target.tombstones_below.min(end) };
            // `complete`: every record below the chunk's end is in a
            // sealed, wholly committed segment listed here (else a later
            // pass finishes).
            let (candidates, complete) = self.log().compaction_candidates(end);
            all_done &= complete;
            for c in candidates {
                match rewrite(&c, codec, &latest, chunk, start, &mut stats, throttle)? {
                    Rewrite::Unchanged => {}
                    Rewrite::Written { tmp, index_tmp, segment, before, after } => {
                        let swapped = self.log().swap_compacted(&c, &tmp, &index_tmp, *segment)?;
                        if swapped {
                            // The renames' durability, outside the log's lock.
                            fsutil::sync_dir(&*c.fs, c.path.parent().unwrap_or(Path::new(".")))?;
                            stats.segments_rewritten += 1;
                            stats.bytes_before += before;
                            stats.bytes_after += after;
                        } else {
                            all_done = false;
                        }
                    }
                }
            }
            from = end;
        }
        let mut log = self.log();
        // Finished `target` even if a newer one was applied meanwhile
        // (targets only grow; the next pass takes the newer one), unless
        // segments were replaced or cut under it.
        if all_done && log.generation() == generation {
            log.set_compacted_to(target);
            stats.complete = true;
        }
        Ok(Some(stats))
    }

    /// Each key's latest offset in `from..end`, read from committed batches
    /// without holding the log's lock, with `end`: `through`, or the end of
    /// the batch after which the map outgrew `map_bytes_max` (at least one
    /// batch is mapped). `None` when the log start moved past `from`
    /// meanwhile (the next pass starts from it).
    fn key_map(
        &self,
        codec: &dyn RecordCodec,
        from: u64,
        through: u64,
        map_bytes_max: usize,
        stats: &mut CompactionStats,
        throttle: &mut dyn FnMut(u64),
    ) -> Result<Option<(HashMap<Bytes, u64>, u64)>> {
        let mut latest: HashMap<Bytes, u64> = HashMap::new();
        let mut map_bytes = 0usize;
        let mut at = from;
        while at < through {
            let batches = match self.read(at, READ_CHUNK_BYTES) {
                Ok(b) => b,
                Err(StoreError::OffsetOutOfRange { .. }) => return Ok(None),
                Err(e) => return Err(e),
            };
            let Some(last) = batches.last() else {
                // Fewer committed records than the target says (cannot
                // happen: the target is applied after them): an incomplete
                // map would drop records, so compact nothing.
                return Ok(None);
            };
            let next = last.header.next_offset();
            let read: u64 = batches.iter().map(|b| b.frame.len() as u64).sum();
            stats.bytes_read += read;
            for b in &batches {
                for r in keyed(codec, b)? {
                    let offset = b.header.base_offset + u64::from(r.offset_delta);
                    if offset < from || offset >= through {
                        continue;
                    }
                    if let Some(k) = r.key {
                        // A copy: a slice would keep the whole batch alive.
                        if latest.insert(Bytes::copy_from_slice(&k), offset).is_none() {
                            map_bytes += k.len() + MAP_ENTRY_OVERHEAD_BYTES;
                        }
                    }
                }
                let end = b.header.next_offset();
                if map_bytes >= map_bytes_max && end < through && end > from {
                    throttle(read);
                    return Ok(Some((latest, end)));
                }
            }
            throttle(read);
            if next <= at {
                return Ok(None);
            }
            at = next;
        }
        Ok(Some((latest, through)))
    }
}

fn keyed(codec: &dyn RecordCodec, b: &StoredBatch) -> Result<Vec<KeyedRecord>> {
    let records = codec.keyed(&b.records()).map_err(|e| corrupt_records(b, &e))?;
    let count = b.header.record_count;
    let mut prev: Option<u32> = None;
    for r in &records {
        if r.offset_delta >= count || prev.is_some_and(|p| r.offset_delta <= p) {
            return Err(corrupt_records(
                b,
                &format!("offset delta {} out of order or past the batch's {count} offsets", r.offset_delta),
            ));
        }
        prev = Some(r.offset_delta);
    }
    Ok(records)
}

fn corrupt_records(b: &StoredBatch, detail: &str) -> StoreError {
    StoreError::Invalid(format!(
        "compaction: the records of the batch at offset {} (entry {}) do not decode: {detail}",
        b.header.base_offset,
        b.header.index()
    ))
}

enum Rewrite {
    Unchanged,
    Written { tmp: PathBuf, index_tmp: PathBuf, segment: Box<Segment>, before: u64, after: u64 },
}

/// Writes the compacted copy of one segment beside it (`*.seg.compact.tmp`,
/// removed by the next open if a crash leaves it), fsynced and opened; or
/// says nothing in it goes.
fn rewrite(
    c: &CompactionCandidate,
    codec: &dyn RecordCodec,
    latest: &HashMap<Bytes, u64>,
    target: CompactionTarget,
    start: u64,
    stats: &mut CompactionStats,
    throttle: &mut dyn FnMut(u64),
) -> Result<Rewrite> {
    let mut out: Vec<u8> = Vec::new();
    let mut changed = false;
    let mut removed = 0u64;
    let mut pos = SEGMENT_HEADER_BYTES as u64;
    loop {
        let (frames, exhausted) = c.reader.read_frames(pos, READ_CHUNK_BYTES, true, |_| true)?;
        let read: u64 = frames.iter().map(|(h, _)| h.frame_bytes as u64).sum();
        stats.bytes_read += read;
        for (h, frame) in frames {
            pos += h.frame_bytes as u64;
            let b = StoredBatch { header: h, frame };
            let below =
                h.kind == FrameKind::Records && h.base_offset < target.through && h.next_offset() > start;
            if !below {
                out.extend_from_slice(&b.frame);
                continue;
            }
            let records = keyed(codec, &b)?;
            let keep: Vec<bool> = records
                .iter()
                .map(|r| {
                    let o = h.base_offset + u64::from(r.offset_delta);
                    let Some(k) = &r.key else { return true };
                    if o >= target.through || o < start {
                        return true;
                    }
                    // A key missing from the map was not written in the
                    // chunk: the record is its key's latest before it.
                    latest.get(k).is_none_or(|l| *l == o) && !(r.tombstone && o < target.tombstones_below)
                })
                .collect();
            let gone = keep.iter().filter(|k| !**k).count() as u64;
            if gone == 0 {
                out.extend_from_slice(&b.frame);
                continue;
            }
            let payload = codec.retain(&b.records(), &keep).map_err(|e| corrupt_records(&b, &e))?;
            changed = true;
            removed += gone;
            let mut entry = format::decode_entry(&h, &b.frame).map_err(|source| StoreError::Corruption {
                path: c.path.clone(),
                position: pos - h.frame_bytes as u64,
                source,
            })?;
            let EntryPayload::Normal(batch) = &mut entry.payload else {
                return Err(StoreError::Invalid(format!("entry {} is not a record batch", h.index())));
            };
            batch.records = payload;
            format::encode_entry(&entry, h.base_offset, &mut out)
                .map_err(|e| StoreError::Invalid(format!("re-encoding entry {}: {e}", h.index())))?;
        }
        throttle(read);
        if exhausted {
            break;
        }
    }
    if !changed {
        return Ok(Rewrite::Unchanged);
    }
    stats.records_removed += removed;
    let tmp = c.path.with_extension("seg.compact.tmp");
    write_segment(&*c.fs, &tmp, c.header, &out, c.modified)?;
    let (mut segment, cut) = Segment::open(&c.fs, &tmp, false, true, c.index_interval_bytes)?;
    if cut.is_some() {
        return Err(StoreError::Invalid(format!("compacted copy {} does not verify", tmp.display())));
    }
    // Ends in `.tmp` too, so an open after a crash removes it.
    let index_tmp = c.path.with_extension("idx.compact.tmp");
    segment.seal_to(&index_tmp)?;
    let after = segment.size_bytes();
    Ok(Rewrite::Written { tmp, index_tmp, segment: Box::new(segment), before: c.size_bytes, after })
}

/// Writes a segment file: header, frames, fsync; its modification time set
/// to `modified` (the original's: retention and the tombstone horizon judge
/// a segment by its last append, which compaction is not).
fn write_segment(
    fs: &dyn Vfs,
    path: &Path,
    header: SegmentHeader,
    frames: &[u8],
    modified: Option<std::time::SystemTime>,
) -> Result<()> {
    let io = |what: &'static str| move |e: std::io::Error| StoreError::io(what, path, e);
    let f = fs.open(path, OpenMode::CreateTruncate).map_err(io("create"))?;
    let head = header.encode();
    f.write_all_at(&head, 0).map_err(io("write"))?;
    f.write_all_at(frames, head.len() as u64).map_err(io("write"))?;
    if let Some(t) = modified {
        f.set_modified(t).map_err(io("set modification time of"))?;
    }
    // sync_all: the modification time set above must be durable too.
    f.sync_all().map_err(io("fsync"))
}
