//! Turns a produce request's records into the stored batch, enforcing the
//! size limits, and decodes stored batches back into records.
//!
//! The stored payload of a batch produced through gRPC is a protobuf
//! `RecordSet` (`proto/ferrolog/client/v1/client.proto`), so a gRPC fetch
//! returns it to the client byte for byte; one produced through the Kafka
//! listener is the Kafka batch as it came ([`kafka_batch`]). Every reader
//! here takes both.

use bytes::Bytes;
use ferrolog_proto::client::{Record, RecordSet};
use ferrolog_raft_store::{KeyedRecord, NO_PRODUCER_ID, RecordBatch, RecordCodec};
use prost::Message;

use super::kafka_batch;

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

/// Encoded bytes a batch may take beyond `max_batch_bytes` of key, value
/// and headers, for its framing: field tags and lengths, timestamps (a
/// record's framing is 4 to 30 bytes, a header's 2 to 18).
pub const BATCH_FRAMING_BYTES: usize = 64 << 10;

/// The largest stored batch, encoded, for a broker's `max_batch_bytes`:
/// twice that plus [`BATCH_FRAMING_BYTES`], so that framing may take as
/// much as the records' own bytes (a batch of many tiny records). What the
/// transports (the client port's messages, the peer channel's
/// AppendEntries, a fetch of one batch) must carry.
pub fn batch_encoded_bytes_max(max_batch_bytes: usize) -> usize {
    max_batch_bytes.saturating_mul(2).saturating_add(BATCH_FRAMING_BYTES)
}

/// Bytes a record counts against `max_record_bytes` and, summed over a
/// batch, against `max_batch_bytes`: key, value, and each header's key and
/// value (Kafka's `message.max.bytes` counts the same payload plus a few
/// bytes of framing).
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
/// timestamp with `now_ms`, checks every record's [`record_size_bytes`]
/// against `max_record_bytes` and their sum against `max_batch_bytes` (the
/// same quantity, so a record within `max_record_bytes` ≤
/// `max_batch_bytes` is always accepted alone), and the encoded batch
/// against [`batch_encoded_bytes_max`].
///
/// # Errors
/// [`BatchError::Invalid`] for an empty batch or a bad producer field;
/// [`BatchError::TooLarge`] naming the limit (by its configuration key),
/// the size and, for a record, its index in the batch.
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
    let mut total = 0usize;
    for (i, r) in records.iter_mut().enumerate() {
        if r.offset_delta.is_some() {
            return Err(BatchError::Invalid(format!(
                "record {i} carries an offset delta; only the broker sets it (in compacted batches)"
            )));
        }
        if r.null_value && !r.value.is_empty() {
            return Err(BatchError::Invalid(format!(
                "record {i} says its value is null but carries {} value bytes",
                r.value.len()
            )));
        }
        // The same for header values: stored, such a header read as its
        // bytes through gRPC and as null through Kafka or once compressed
        // (found by fuzzing).
        if let Some((h, header)) =
            r.headers.iter().enumerate().find(|(_, h)| h.null_value && !h.value.is_empty())
        {
            return Err(BatchError::Invalid(format!(
                "record {i} header {h} says its value is null but carries {} value bytes",
                header.value.len()
            )));
        }
        let size = record_size_bytes(r);
        if size > max_record_bytes {
            return Err(BatchError::TooLarge(too_large_record(i, size, max_record_bytes)));
        }
        total = total.saturating_add(size);
        if r.timestamp_ms == 0 {
            r.timestamp_ms = now_ms;
        }
    }
    if total > max_batch_bytes {
        return Err(BatchError::TooLarge(format!(
            "the batch's {record_count} records are {total} bytes (key + value + headers); the limit, \
             limits.max_batch_bytes, is {max_batch_bytes} bytes"
        )));
    }
    let first_timestamp_ms = records[0].timestamp_ms;
    let max_timestamp_ms = records.iter().map(|r| r.timestamp_ms).max().unwrap_or(first_timestamp_ms);
    let set = RecordSet { records };
    let len = set.encoded_len();
    let encoded_max = batch_encoded_bytes_max(max_batch_bytes);
    if len > encoded_max {
        return Err(BatchError::TooLarge(format!(
            "the batch's {record_count} records are {len} bytes encoded, {} of them framing (tags, \
             lengths, timestamps); the limit is {encoded_max} bytes (2 × limits.max_batch_bytes + {} KiB)",
            len - total,
            BATCH_FRAMING_BYTES >> 10
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

/// The message of `RECORD_TOO_LARGE` for record `index` (0-based in its
/// batch) of `size` bytes (key + value + headers) over `max_record_bytes`;
/// the client library words its own check the same way.
pub fn too_large_record(index: usize, size: usize, max_record_bytes: usize) -> String {
    format!(
        "record {index} is {size} bytes (key + value + headers); the limit, limits.max_record_bytes, is \
         {max_record_bytes} bytes"
    )
}

/// Decodes a stored batch payload, in either encoding: Ferrolog's
/// `RecordSet`, or a Kafka batch produced through the Kafka listener
/// ([`kafka_batch::decode_payload`]).
///
/// # Errors
/// A message saying why it does not decode (the payload passed its CRC, so
/// this means a bug or a batch written by something else).
pub fn decode(records: &Bytes) -> Result<Vec<Record>, String> {
    if kafka_batch::is_kafka_payload(records) {
        return kafka_batch::decode_payload(records);
    }
    Ok(RecordSet::decode(records.clone()).map_err(|e| e.to_string())?.records)
}

/// A stored payload in Ferrolog's own encoding: itself when it is one, else
/// its records re-encoded as a `RecordSet` (what the gRPC API serves).
///
/// # Errors
/// As [`decode`].
pub fn as_record_set(records: Bytes) -> Result<Bytes, String> {
    if !kafka_batch::is_kafka_payload(&records) {
        return Ok(records);
    }
    Ok(Bytes::from(RecordSet { records: decode(&records)? }.encode_to_vec()))
}

/// Each record's offset delta in its batch, in order: the one it carries
/// (after records compaction removed), else one past the previous record's
/// (the first: 0). Saturates rather than wrapping on a malformed batch (the
/// store checks deltas against the batch's offsets).
pub fn offset_deltas(records: &[Record]) -> Vec<u32> {
    let mut next = 0u32;
    records
        .iter()
        .map(|r| {
            let d = r.offset_delta.unwrap_or(next);
            next = d.saturating_add(1);
            d
        })
        .collect()
}

/// The offset deltas and timestamps (ms since the Unix epoch) of a stored
/// batch's records, in offset order: what the store needs to answer
/// ListOffsets by timestamp at record granularity (KIP-79). Keys and values
/// are sliced from `records`, not copied.
///
/// # Errors
/// As [`decode`].
pub fn timestamps(records: Bytes) -> Result<Vec<(u32, i64)>, String> {
    let records = decode(&records)?;
    Ok(offset_deltas(&records).into_iter().zip(records.iter().map(|r| r.timestamp_ms)).collect())
}

/// The broker's record encoding as compaction sees it
/// ([`ferrolog_raft_store::compaction`]): keys, tombstones (null values)
/// and offset deltas of a stored batch, and the batch re-encoded with some
/// records left out, each survivor carrying its offset delta.
#[derive(Clone, Copy, Debug, Default)]
pub struct Codec;

impl RecordCodec for Codec {
    fn keyed(&self, records: &Bytes) -> Result<Vec<KeyedRecord>, String> {
        let records = decode(records)?;
        let deltas = offset_deltas(&records);
        Ok(records
            .into_iter()
            .zip(deltas)
            .map(|(r, offset_delta)| KeyedRecord { offset_delta, key: r.key, tombstone: r.null_value })
            .collect())
    }

    /// Each survivor carries its delta only when it follows removed
    /// records, so a thinned `RecordSet` is never larger than the original
    /// (a delta field is at most 6 bytes, a removed record at least 12); a
    /// thinned Kafka batch, recompressed, may come out a little larger than
    /// it was when its producer compressed harder.
    /// A Kafka batch stays a Kafka batch of its codec
    /// ([`kafka_batch::retain_payload`]).
    fn retain(&self, records: &Bytes, keep: &[bool]) -> Result<Bytes, String> {
        if kafka_batch::is_kafka_payload(records) {
            return kafka_batch::retain_payload(records, keep);
        }
        let records = decode(records)?;
        if records.len() != keep.len() {
            return Err(format!("{} records, {} keep flags", records.len(), keep.len()));
        }
        let deltas = offset_deltas(&records);
        let mut next = 0u32;
        let mut out = Vec::with_capacity(records.len());
        for ((mut r, d), k) in records.into_iter().zip(deltas).zip(keep) {
            if !*k {
                continue;
            }
            r.offset_delta = (d != next).then_some(d);
            next = d.saturating_add(1);
            out.push(r);
        }
        Ok(Bytes::from(RecordSet { records: out }.encode_to_vec()))
    }
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
            ..Record::default()
        }
    }

    const NONE: ProducerFields = ProducerFields { producer_id: -1, producer_epoch: 0, base_sequence: 0 };

    fn bare(value_len: usize) -> Record {
        Record { value: vec![b'v'; value_len].into(), ..Record::default() }
    }

    fn too_large(r: Result<RecordBatch, BatchError>) -> String {
        match r {
            Err(BatchError::TooLarge(m)) => m,
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    #[test]
    fn a_record_at_the_record_limit_fits_the_batch_limit_alone() {
        const MIB: usize = 1 << 20;
        // The record and batch limits count the same bytes: with equal
        // limits, a record of exactly the limit is accepted alone, with or
        // without key and headers, whatever its framing.
        let b = build_batch(vec![bare(MIB)], NONE, 1_700_000_000_000, MIB, MIB).expect("at the limit");
        assert_eq!(decode(&b.records).expect("decode")[0].value.len(), MIB);
        let mut full = bare(MIB - 290);
        full.key = Some(vec![b'k'; 100].into());
        full.headers = (0..10)
            .map(|i| ferrolog_proto::client::Header {
                key: format!("h{i:08}"),
                value: vec![b'x'; 10].into(),
                null_value: false,
            })
            .collect();
        assert_eq!(record_size_bytes(&full), MIB);
        build_batch(vec![full], NONE, 1, MIB, MIB).expect("key, value and headers at the limit");

        // Over: the message names the limit and the size.
        let m = too_large(build_batch(vec![bare(MIB + 1)], NONE, 1, MIB, MIB));
        assert!(
            m.contains("limits.max_record_bytes") && m.contains("1048577") && m.contains("1048576"),
            "{m}"
        );
        let m = too_large(build_batch(vec![bare(MIB / 2), bare(MIB / 2 + 1)], NONE, 1, MIB, MIB));
        assert!(
            m.contains("limits.max_batch_bytes") && m.contains("1048577") && m.contains("1048576"),
            "{m}"
        );
    }

    #[test]
    fn framing_of_many_tiny_records_is_bounded() {
        // 0 bytes of key + value + headers each, 2 bytes encoded each.
        let tiny = |n: usize| (0..n).map(|_| bare(0)).collect::<Vec<_>>();
        let max = 1000;
        let ceiling = batch_encoded_bytes_max(max);
        let fits = ceiling / 9; // 2 bytes of framing and 7 of timestamp each
        build_batch(tiny(fits), NONE, 1_700_000_000_000, 10, max).expect("within the encoded ceiling");
        let m = too_large(build_batch(tiny(fits * 2), NONE, 1_700_000_000_000, 10, max));
        assert!(m.contains(&ceiling.to_string()) && m.contains("limits.max_batch_bytes"), "{m}");
    }

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
        assert_eq!(timestamps(b.records).expect("decode"), vec![(0, 1000), (1, 5000), (2, 2000), (3, 3000)]);
        assert!(timestamps(Bytes::from_static(&[0xff, 0xff, 0xff])).is_err());
    }

    #[test]
    fn the_codec_keeps_offset_deltas_and_tells_null_from_empty() {
        let tomb = Record { key: Some(Bytes::from_static(b"k")), null_value: true, ..Record::default() };
        let empty = Record { key: Some(Bytes::new()), ..Record::default() };
        let records = vec![rec("a", 1), tomb, empty, rec("d", 4)];
        let b = build_batch(records, NONE, 2000, 100, 1000).expect("ok");
        let keyed = Codec.keyed(&b.records).expect("keyed");
        let flags: Vec<_> = keyed.iter().map(|r| (r.offset_delta, r.key.clone(), r.tombstone)).collect();
        assert_eq!(
            flags,
            vec![
                (0, Some(Bytes::from_static(b"k")), false),
                (1, Some(Bytes::from_static(b"k")), true),
                (2, Some(Bytes::new()), false),
                (3, Some(Bytes::from_static(b"k")), false),
            ],
            "an empty value is no tombstone, an empty key is a key"
        );
        let thinned = Codec.retain(&b.records, &[false, true, false, true]).expect("retain");
        let again = Codec.keyed(&thinned).expect("keyed");
        assert_eq!(again.iter().map(|r| r.offset_delta).collect::<Vec<_>>(), vec![1, 3]);
        assert!(again[0].tombstone);
        // Thinning twice keeps the original deltas.
        let twice = Codec.retain(&thinned, &[false, true]).expect("retain");
        assert_eq!(timestamps(twice).expect("decode"), vec![(3, 4)]);
        assert!(Codec.retain(&b.records, &[true]).is_err(), "one flag per record");
        // Only a record after removed ones carries its delta: never larger than before.
        let tail_gone = Codec.retain(&b.records, &[true, true, true, false]).expect("retain");
        assert!(
            RecordSet::decode(tail_gone.clone())
                .expect("decode")
                .records
                .iter()
                .all(|r| r.offset_delta.is_none())
        );
        let middle_gone = Codec.retain(&b.records, &[true, false, true, true]).expect("retain");
        let set = RecordSet::decode(middle_gone.clone()).expect("decode");
        let carried: Vec<_> = set.records.iter().map(|r| r.offset_delta).collect();
        assert_eq!(carried, vec![None, Some(2), None]);
        assert_eq!(offset_deltas(&set.records), vec![0, 2, 3]);
        assert!(middle_gone.len() < b.records.len() && tail_gone.len() < b.records.len());
    }

    #[test]
    fn producers_cannot_send_offset_deltas_or_null_values_with_bytes() {
        let mut r = rec("a", 1);
        r.offset_delta = Some(0);
        assert!(
            matches!(build_batch(vec![r], NONE, 0, 10, 100), Err(BatchError::Invalid(m)) if m.contains("offset delta"))
        );
        let mut r = rec("a", 1);
        r.null_value = true;
        assert!(
            matches!(build_batch(vec![r], NONE, 0, 10, 100), Err(BatchError::Invalid(m)) if m.contains("null"))
        );
    }

    /// Found by the `grpc_produce` fuzz target (fuzz/regressions/grpc_produce/):
    /// a header whose value was null and non-empty was stored, and read as
    /// its bytes through gRPC but as null through Kafka (and once a
    /// compressed topic stored it as a Kafka batch).
    #[test]
    fn producers_cannot_send_null_header_values_with_bytes() {
        let crash = [
            0x1a, 0x2b, 0x0a, 0x05, 0x68, 0x65, 0x6c, 0x6c, 0x6f, 0x1a, 0x0c, 0x0a, 0x05, 0x74, 0x72, 0x61,
            0x63, 0x65, 0x12, 0x03, 0x9f, 0x95, 0x63, 0x1a, 0x09, 0x12, 0x05, 0x65, 0x6d, 0x70, 0x74, 0x79,
            0x18, 0x01, 0x20, 0x80, 0xc8, 0x95, 0xff, 0xbc, 0x31, 0x30, 0x01, 0x20, 0x2a,
        ];
        let req = ferrolog_proto::client::ProduceRequest::decode(&crash[..]).unwrap();
        let fields = ProducerFields {
            producer_id: req.producer_id,
            producer_epoch: i16::try_from(req.producer_epoch).unwrap(),
            base_sequence: req.base_sequence,
        };
        assert!(
            matches!(build_batch(req.records, fields, 0, 100, 100), Err(BatchError::Invalid(m)) if m.contains("header 1"))
        );
    }
}
