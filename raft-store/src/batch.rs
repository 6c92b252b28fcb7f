//! The application data of a partition's Raft log: one producer record batch
//! per entry, and the result of applying it.

use std::fmt;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// `producer_id` of a batch sent without an idempotent producer (Kafka's
/// `NO_PRODUCER_ID`, KIP-98).
pub const NO_PRODUCER_ID: i64 = -1;

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
