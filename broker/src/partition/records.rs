//! Turns a produce request's records into the stored batch, enforcing the
//! size limits, and decodes stored batches back into records.
//!
//! The stored payload of a batch is a protobuf `RecordSet`
//! (`proto/ferrolog/client/v1/client.proto`), so a fetch returns it to the
//! client byte for byte.

use bytes::Bytes;
use ferrolog_proto::client::{Record, RecordSet};
use ferrolog_raft_store::{NO_PRODUCER_ID, RecordBatch};
use prost::Message;

/// Why a batch was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// A record or the batch is over its limit (`RECORD_TOO_LARGE`).
    #[error("{0}")]
    TooLarge(String),
    /// Empty batch or a bad field (`INVALID_REQUEST`).
    #[error("{0}")]
    Invalid(String),
}

/// Bytes a record counts against `max_record_bytes`: key, value and headers.
pub fn record_size_bytes(r: &Record) -> usize {
    r.key.as_ref().map_or(0, bytes::Bytes::len)
        + r.value.len()
        + r.headers.iter().map(|h| h.key.len() + h.value.len()).sum::<usize>()
}

/// Idempotence fields of a produced batch (KIP-98).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProducerFields {
    /// Producer id, or [`NO_PRODUCER_ID`].
    pub producer_id: i64,
    /// Producer epoch.
    pub producer_epoch: i16,
    /// Sequence number of the batch's first record.
    pub base_sequence: i32,
}

/// Builds the stored batch from a request's records: stamps records without
/// timestamp with `now_ms`, checks every record against `max_record_bytes`
/// and the encoded batch against `max_batch_bytes`.
///
/// # Errors
/// [`BatchError::Invalid`] for an empty batch or a bad producer field;
/// [`BatchError::TooLarge`] naming the record and the limit.
pub fn build_batch(
    mut records: Vec<Record>,
    producer: ProducerFields,
    now_ms: i64,
    max_record_bytes: usize,
    max_batch_bytes: usize,
) -> Result<RecordBatch, BatchError> {
    if records.is_empty() {
        return Err(BatchError::Invalid("a produce request needs at least one record".into()));
    }
    let record_count = u32::try_from(records.len())
        .map_err(|_| BatchError::Invalid(format!("{} records in one batch", records.len())))?;
    if producer.producer_id < NO_PRODUCER_ID || (producer.producer_id >= 0 && producer.base_sequence < 0) {
        return Err(BatchError::Invalid(format!(
            "bad producer fields: id {} sequence {}",
            producer.producer_id, producer.base_sequence
        )));
    }
    for (i, r) in records.iter_mut().enumerate() {
        let size = record_size_bytes(r);
        if size > max_record_bytes {
            return Err(BatchError::TooLarge(format!(
                "record {i} is {size} bytes; the limit (max_record_bytes) is {max_record_bytes}"
            )));
        }
        if r.timestamp_ms == 0 {
            r.timestamp_ms = now_ms;
        }
    }
    let first_timestamp_ms = records[0].timestamp_ms;
    let max_timestamp_ms = records.iter().map(|r| r.timestamp_ms).max().unwrap_or(first_timestamp_ms);
    let set = RecordSet { records };
    let len = set.encoded_len();
    if len > max_batch_bytes {
        return Err(BatchError::TooLarge(format!(
            "the batch is {len} bytes encoded; the limit (max_batch_bytes) is {max_batch_bytes}"
        )));
    }
    Ok(RecordBatch {
        record_count,
        first_timestamp_ms,
        max_timestamp_ms,
        producer_id: producer.producer_id,
        producer_epoch: producer.producer_epoch,
        base_sequence: producer.base_sequence,
        records: Bytes::from(set.encode_to_vec()),
    })
}

/// Decodes a stored batch payload.
///
/// # Errors
/// The protobuf decode error (the payload passed its CRC, so this means a
/// bug or a batch written by something else).
pub fn decode(records: &[u8]) -> Result<Vec<Record>, prost::DecodeError> {
    Ok(RecordSet::decode(records)?.records)
}

/// The timestamps of a stored batch's records, ms since the Unix epoch, in
/// offset order: what the store needs to answer ListOffsets by timestamp at
/// record granularity (KIP-79). Keys and values are sliced from `records`,
/// not copied.
///
/// # Errors
/// As [`decode`].
pub fn timestamps(records: Bytes) -> Result<Vec<i64>, prost::DecodeError> {
    Ok(RecordSet::decode(records)?.records.iter().map(|r| r.timestamp_ms).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(value: &str, ts: i64) -> Record {
        Record {
            key: Some(b"k".to_vec().into()),
            value: value.as_bytes().to_vec().into(),
            headers: vec![],
            timestamp_ms: ts,
        }
    }

    const NONE: ProducerFields = ProducerFields { producer_id: -1, producer_epoch: 0, base_sequence: 0 };

    #[test]
    fn builds_checks_and_round_trips() {
        let b = build_batch(vec![rec("a", 0), rec("bb", 7)], NONE, 5, 100, 1000).expect("ok");
        assert_eq!((b.record_count, b.first_timestamp_ms, b.max_timestamp_ms), (2, 5, 7));
        let back = decode(&b.records).expect("decode");
        assert_eq!(&back[1].value[..], b"bb");
        assert!(matches!(build_batch(vec![], NONE, 0, 10, 10), Err(BatchError::Invalid(_))));
        assert!(matches!(
            build_batch(vec![rec(&"x".repeat(11), 1)], NONE, 0, 10, 100),
            Err(BatchError::TooLarge(_))
        ));
        let many: Vec<_> = (0..20).map(|_| rec("123456789", 1)).collect();
        assert!(matches!(build_batch(many, NONE, 0, 10, 100), Err(BatchError::TooLarge(_))));
        let bad = ProducerFields { producer_id: 3, producer_epoch: 0, base_sequence: -1 };
        assert!(matches!(build_batch(vec![rec("a", 1)], bad, 0, 10, 100), Err(BatchError::Invalid(_))));
    }

    #[test]
    fn timestamps_come_back_in_offset_order() {
        let records = vec![rec("a", 1000), rec("b", 5000), rec("c", 0), rec("d", 3000)];
        let b = build_batch(records, NONE, 2000, 100, 1000).expect("ok");
        assert_eq!(timestamps(b.records).expect("decode"), vec![1000, 5000, 2000, 3000]);
        assert!(timestamps(Bytes::from_static(&[0xff, 0xff, 0xff])).is_err());
    }
}
