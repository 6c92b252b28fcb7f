//! The application data of a partition's Raft log: one producer record batch
//! per entry, and the result of applying it.

use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// `producer_id` of a batch sent without an idempotent producer (Kafka's
/// `NO_PRODUCER_ID`, KIP-98).
pub const NO_PRODUCER_ID: i64 = -1;

/// `producer_id` of a control batch ([`RecordBatch::control`]): written by a
/// partition's leader, never by a producer (the broker refuses producer ids
/// below [`NO_PRODUCER_ID`]).
pub const CONTROL_PRODUCER_ID: i64 = -2;

/// A decision a partition's leader replicates through the partition's own
/// Raft log, so that every replica carries it out at the same log position.
/// Stored as a control frame that holds no record and occupies no offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// Retention: the log start offset becomes this offset (never lower
    /// than it was); records below it are no longer served, and segments
    /// wholly below it are deleted once Raft no longer needs their entries
    /// (Kafka's log start offset, KIP-107).
    LogStart(u64),
    /// Compaction (Kafka's `cleanup.policy=compact`): every replica compacts
    /// the records below the target's `through` offset to the latest record
    /// of each key, by the same rule, so all derive the same log (see
    /// [`crate::compaction`]). Targets only move up.
    Compact(crate::compaction::CompactionTarget),
    /// Idempotent producer state expiry (Kafka's `producer.id.expiration.ms`):
    /// every replica drops the producer ids that last wrote `expiration_ms`
    /// or more before `now_ms` (the leader's clock when it decided; see
    /// [`crate::ProducerStates::expire`]).
    ExpireProducers {
        /// The leader's time of the decision, ms since the Unix epoch.
        now_ms: i64,
        /// `producer.id.expiration.ms`.
        expiration_ms: i64,
    },
}

/// Payload tag of [`Control::LogStart`].
const CONTROL_LOG_START: u8 = 1;
/// Payload tag of [`Control::Compact`].
const CONTROL_COMPACT: u8 = 2;
/// Payload tag of [`Control::ExpireProducers`].
const CONTROL_EXPIRE_PRODUCERS: u8 = 3;

/// A batch of records as a producer sent it, carried whole as one Raft entry.
///
/// The store does not look inside `records`: it is the broker's encoding of
/// the batch's records (keys, values, headers, per-record timestamps), stored
/// and returned byte for byte. The store only needs the record count, which
/// fixes how many offsets the batch occupies, and the timestamps, which feed
/// the time index; to answer a lookup by time at record granularity its
/// caller decodes the per-record timestamps of the one batch it finds
/// ([`PartitionLog::offset_for_timestamp`](crate::PartitionLog::offset_for_timestamp)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordBatch {
    /// Number of records in `records`; the batch occupies this many
    /// consecutive offsets. Must be at least 1.
    pub record_count: u32,
    /// Timestamp of the first record, milliseconds since the Unix epoch.
    pub first_timestamp_ms: i64,
    /// Largest record timestamp in the batch, milliseconds since the Unix
    /// epoch; the time index is built from it (as Kafka's is, KIP-33).
    pub max_timestamp_ms: i64,
    /// Idempotent producer id, or [`NO_PRODUCER_ID`] (KIP-98).
    pub producer_id: i64,
    /// Producer epoch, fencing older instances of the same producer id.
    pub producer_epoch: i16,
    /// Sequence number of the first record of the batch for this producer
    /// and partition.
    pub base_sequence: i32,
    /// The encoded records, opaque to the store.
    pub records: Bytes,
}

impl RecordBatch {
    /// The control batch that carries `control` (no records, no offsets).
    pub fn control_batch(control: Control) -> Self {
        let mut payload = Vec::with_capacity(17);
        match control {
            Control::LogStart(offset) => {
                payload.push(CONTROL_LOG_START);
                payload.extend_from_slice(&offset.to_le_bytes());
            }
            Control::Compact(t) => {
                payload.push(CONTROL_COMPACT);
                payload.extend_from_slice(&t.through.to_le_bytes());
                payload.extend_from_slice(&t.tombstones_below.to_le_bytes());
            }
            Control::ExpireProducers { now_ms, expiration_ms } => {
                payload.push(CONTROL_EXPIRE_PRODUCERS);
                payload.extend_from_slice(&now_ms.to_le_bytes());
                payload.extend_from_slice(&expiration_ms.to_le_bytes());
            }
        }
        RecordBatch {
            record_count: 0,
            producer_id: CONTROL_PRODUCER_ID,
            records: Bytes::from(payload),
            ..RecordBatch::default()
        }
    }

    /// The control batch a control frame's payload holds (not checked).
    pub(crate) fn control_frame(payload: Bytes) -> Self {
        RecordBatch {
            record_count: 0,
            producer_id: CONTROL_PRODUCER_ID,
            records: payload,
            ..RecordBatch::default()
        }
    }

    /// Whether this is a control batch (see [`RecordBatch::control`]).
    pub fn is_control(&self) -> bool {
        self.producer_id == CONTROL_PRODUCER_ID && self.record_count == 0
    }

    /// The decision a control batch carries; `None` for a record batch.
    ///
    /// # Errors
    /// A message for a control batch whose payload is not one this version
    /// knows (a newer leader's decision, or damage).
    pub fn control(&self) -> Result<Option<Control>, String> {
        if !self.is_control() {
            return Ok(None);
        }
        match self.records.as_ref() {
            [CONTROL_LOG_START, rest @ ..] if rest.len() == 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(rest);
                Ok(Some(Control::LogStart(u64::from_le_bytes(b))))
            }
            [CONTROL_COMPACT, rest @ ..] if rest.len() == 16 => {
                let (a, b) = rest.split_at(8);
                let through = u64::from_le_bytes(a.try_into().map_err(|_| "compact: through")?);
                let tombstones_below =
                    u64::from_le_bytes(b.try_into().map_err(|_| "compact: tombstones_below")?);
                Ok(Some(Control::Compact(crate::compaction::CompactionTarget { through, tombstones_below })))
            }
            [CONTROL_EXPIRE_PRODUCERS, rest @ ..] if rest.len() == 16 => {
                let (a, b) = rest.split_at(8);
                let now_ms = i64::from_le_bytes(a.try_into().map_err(|_| "expire: now")?);
                let expiration_ms = i64::from_le_bytes(b.try_into().map_err(|_| "expire: expiration")?);
                Ok(Some(Control::ExpireProducers { now_ms, expiration_ms }))
            }
            other => {
                Err(format!("unknown control payload of {} bytes (tag {:?})", other.len(), other.first()))
            }
        }
    }
}

impl fmt::Display for RecordBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RecordBatch{{records: {}, bytes: {}, producer: {}/{}/{}}}",
            self.record_count,
            self.records.len(),
            self.producer_id,
            self.producer_epoch,
            self.base_sequence
        )
    }
}

/// What applying a committed entry produced: the offsets the batch received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppendResult {
    /// Offset of the batch's first record.
    pub base_offset: u64,
    /// Number of records, so the batch holds `base_offset..base_offset + record_count`.
    pub record_count: u32,
}
