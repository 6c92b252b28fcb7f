//! openraft's `RaftStateMachine` for a partition.
//!
//! Applying a committed entry does not copy data: the records already sit in
//! the log. It assigns the batch its offsets (a prefix sum of record counts,
//! so every replica computes the same ones), tracks membership, and advances
//! the high watermark that bounds what consumers may read.

use std::io;

use futures::{Stream, TryStreamExt};
use openraft::OptionalSend;
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine};

use crate::batch::{AppendResult, Control};
use crate::replica::Replica;
use crate::snapshot::{self, SnapshotFiles};
use crate::types::{EntryPayload, LogId, SnapshotMeta, StoredMembership, TypeConfig};

/// A snapshot as openraft passes it around.
pub type Snapshot = openraft::alias::SnapshotOf<TypeConfig, SnapshotFiles>;

/// The state machine half of a replica. Clones share state.
#[derive(Clone, Debug)]
pub struct PartitionStateMachine {
    pub(crate) replica: Replica,
}

impl RaftSnapshotBuilder<TypeConfig> for PartitionStateMachine {
    type SnapshotData = SnapshotFiles;

    async fn build_snapshot(&mut self) -> Result<Snapshot, io::Error> {
        // Builds and installs run in different openraft tasks; one at a time.
        let _serial = self.replica.snapshot_lock();
        // The log start as of the applied index the snapshot is of: apply
        // moves it under the applied state's lock, so it is read under it
        // (the files are then copied without that lock).
        let (meta, next_offset, producers, log_start, compaction) = {
            let a = self.replica.applied();
            let meta = SnapshotMeta { last_log_id: a.last_applied, last_membership: a.membership.clone() };
            let log = self.replica.log();
            (meta, a.next_offset, a.producers.clone(), log.log_start_offset(), log.compaction_target())
        };
        let files = {
            let log = self.replica.log();
            snapshot::build(
                &log,
                self.replica.snapshot_root(),
                meta.clone(),
                next_offset,
                producers,
                log_start,
                compaction,
            )?
        };
        let current = self.replica.set_current_snapshot(&files, meta.clone(), next_offset)?;
        tracing::info!(dir = %self.replica.snapshot_root().display(), last = ?meta.last_log_id, "built snapshot");
        Ok(Snapshot { meta: current.meta.clone(), snapshot: self.replica.snapshot_files(&current) })
    }
}

impl RaftStateMachine<TypeConfig> for PartitionStateMachine {
    type SnapshotData = SnapshotFiles;
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        let a = self.replica.applied();
        Ok((a.last_applied, a.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        while let Some((entry, responder)) = entries.try_next().await? {
            let result = {
                let mut a = self.replica.applied();
                // Raft applies committed entries in log order, each once
                // (§5.3); offsets are the prefix sum of record counts only
                // if that holds. A repeat or a step back stops the group
                // (openraft reports a storage error; the broker restarts
                // the group) rather than numbering records twice. (A gap is
                // not checked: openraft's own storage suite applies entries
                // with gaps, so its contract does not promise none.)
                if let Some(last) = a.last_applied
                    && entry.log_id.index <= last.index
                {
                    return Err(io::Error::other(format!(
                        "apply out of order: entry {} after {last}",
                        entry.log_id
                    )));
                }
                let base_offset = a.next_offset;
                let record_count = match &entry.payload {
                    EntryPayload::Normal(b) if b.is_control() => {
                        // The same decision at the same log position on every replica.
                        match b.control().map_err(|e| {
                            io::Error::other(format!("entry {}: undecodable control: {e}", entry.log_id))
                        })? {
                            // Never past what is applied before it (the leader decides from
                            // committed records): a value beyond is ignored, the same way
                            // on every replica. Moved under the applied state's lock, so a
                            // snapshot of this applied index always holds the new log start.
                            Some(Control::LogStart(offset)) if offset <= a.next_offset => {
                                self.replica.log().advance_log_start(offset)?;
                            }
                            Some(Control::LogStart(offset)) => {
                                tracing::warn!(log_id = %entry.log_id, offset, next_offset = a.next_offset,
                                    "ignored a log start offset past the applied records");
                            }
                            // Likewise: a target within the applied records, under the
                            // applied state's lock (a snapshot carries it).
                            Some(Control::Compact(t))
                                if t.through <= a.next_offset && t.tombstones_below <= t.through =>
                            {
                                self.replica.log().set_compaction_target(t)?;
                            }
                            Some(Control::Compact(t)) => {
                                tracing::warn!(log_id = %entry.log_id, ?t, next_offset = a.next_offset,
                                    "ignored a compaction target past the applied records");
                            }
                            Some(Control::ExpireProducers { now_ms, expiration_ms }) => {
                                let gone = a.producers.expire(now_ms, expiration_ms);
                                tracing::debug!(log_id = %entry.log_id, gone, "expired idle producer ids");
                            }
                            None => {}
                        }
                        0
                    }
                    EntryPayload::Normal(b) => {
                        let result = AppendResult { base_offset, record_count: b.record_count };
                        if !a.producers.record(b, result) {
                            tracing::warn!(log_id = %entry.log_id, batch = %b, "applied a batch out of producer sequence");
                        }
                        b.record_count
                    }
                    EntryPayload::Membership(m) => {
                        a.membership = StoredMembership::new(Some(entry.log_id), m.clone());
                        0
                    }
                    EntryPayload::Blank => 0,
                };
                a.next_offset += u64::from(record_count);
                a.last_applied = Some(entry.log_id);
                AppendResult { base_offset, record_count }
            };
            self.replica.publish_high_watermark(result.base_offset + u64::from(result.record_count));
            if let Some(r) = responder {
                r.send(result);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, data: SnapshotFiles) -> Result<(), io::Error> {
        let _serial = self.replica.snapshot_lock();
        let files = snapshot::adopt(&data, self.replica.snapshot_root())?;
        let manifest = files.manifest()?;
        let next_offset = manifest.next_offset;
        // Record the snapshot before touching the log: a crash while the log
        // is replaced restarts from a snapshot that covers what is gone.
        let record = self.replica.set_current_snapshot(&files, meta.clone(), next_offset)?;
        if record.meta.last_log_id != meta.last_log_id {
            tracing::info!(last = ?meta.last_log_id, "ignoring a snapshot older than the current one");
            return Ok(());
        }
        if let Some(last) = meta.last_log_id {
            let mut log = self.replica.log();
            // Retention as of the snapshot, saved before the log is replaced:
            // a crash part way leaves it set (nothing below it is served here).
            log.advance_log_start(manifest.log_start_offset.min(next_offset))?;
            // And compaction's: the segments may be less compacted than the
            // target says; this replica finishes the work by the same rule.
            if let Some(t) = manifest.compaction_target.filter(|t| t.through <= next_offset) {
                log.set_compaction_target(t)?;
            }
            let local = log.entries(last.index, last.index + 1)?;
            // Raft Log Matching (§5.3): a local entry equal to the snapshot's
            // last one means the prefixes are equal and the log stays.
            // Otherwise the snapshot's segments replace the local log.
            if local.first().map(|e| e.log_id) != Some(last) {
                let files = self.replica.snapshot_files(&record);
                log.replace_segments(&files.segments()?, (last.index + 1, next_offset))?;
                log.roll_below_compaction_target()?;
            }
        }
        {
            let mut a = self.replica.applied();
            a.last_applied = meta.last_log_id;
            a.membership = meta.last_membership.clone();
            a.next_offset = next_offset;
            a.producers = manifest.producers;
        }
        self.replica.publish_high_watermark(next_offset);
        tracing::info!(last = ?meta.last_log_id, next_offset, "installed snapshot");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, io::Error> {
        let a = self.replica.applied();
        Ok(a.snapshot
            .as_ref()
            .map(|r| Snapshot { meta: r.meta.clone(), snapshot: self.replica.snapshot_files(r) }))
    }
}

/// An openraft node of a partition's group, running over this store.
pub type PartitionRaft = openraft::Raft<TypeConfig, PartitionStateMachine>;
