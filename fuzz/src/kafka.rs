//! What must hold of a Kafka record batch the produce path accepted
//! (`ferrolog_broker::partition::kafka_batch::check_produced`): its stored
//! payload decodes to the same records, compaction's rewrite of it keeps
//! exactly the records kept, recompressing and restamping it keeps it
//! acceptable, and what a Kafka fetch serves from it is accepted again.

use bytes::{Bytes, BytesMut};
use ferrolog_broker::partition::kafka_batch::{self, BatchFields, CheckedBatch, Codec, KafkaRecord};
use ferrolog_broker::partition::records;
use ferrolog_proto::client::Record;
use ferrolog_raft_store::format::{self, FRAME_HEADER_BYTES};
use ferrolog_raft_store::types::{Entry, EntryPayload, log_id};
use ferrolog_raft_store::{KeyedRecord, RecordBatch, RecordCodec, StoredBatch};

/// The `max_batch_bytes` the targets check batches against: the broker's
/// default (`limits.max_batch_bytes`, 1 MiB).
pub const MAX_BATCH_BYTES: usize = 1 << 20;

/// The codec `n` picks, cycling over all five.
pub fn codec(n: u8) -> Codec {
    match n % 5 {
        0 => Codec::None,
        1 => Codec::Gzip,
        2 => Codec::Snappy,
        3 => Codec::Lz4,
        _ => Codec::Zstd,
    }
}

/// The absolute timestamp of record `r` of `b`, as the broker computes it.
fn timestamp(b: &CheckedBatch, r: &KafkaRecord) -> i64 {
    if b.header.log_append_time() {
        b.header.max_timestamp
    } else {
        b.header.base_timestamp.wrapping_add(r.timestamp_delta)
    }
}

/// Whether Ferrolog record `f` carries what Kafka record `k` does (key,
/// value or null, headers) with timestamp `ts`.
fn same_record(f: &Record, k: &KafkaRecord, ts: i64) -> bool {
    let headers_match = f.headers.len() == k.headers.len()
        && f.headers.iter().zip(&k.headers).all(|(fh, (kk, kv))| {
            fh.key == *kk && fh.null_value == kv.is_none() && fh.value == kv.clone().unwrap_or_default()
        });
    f.key == k.key
        && f.null_value == k.value.is_none()
        && f.value == k.value.clone().unwrap_or_default()
        && headers_match
        && f.timestamp_ms == ts
}

/// Checks `bytes` as a produced batch; when accepted, asserts every
/// invariant of the module comment. `ctl` picks the codec to recompress
/// with, the append time to stamp and which records compaction keeps.
///
/// # Panics
/// When an invariant does not hold (that is the finding).
pub fn check_batch(bytes: Bytes, ctl: u64) {
    let max = records::batch_encoded_bytes_max(MAX_BATCH_BYTES);
    let Ok(cb) = kafka_batch::check_produced(bytes.clone(), max) else { return };
    let n = cb.records.len();
    assert!(n >= 1, "an accepted batch holds at least one record");
    assert_eq!(i64::from(cb.header.record_count), n as i64, "record count");
    assert_eq!(cb.bytes, bytes, "the batch is kept as it came");
    for (i, r) in cb.records.iter().enumerate() {
        assert_eq!(usize::try_from(r.offset_delta).ok(), Some(i), "offset deltas 0, 1, 2, ...");
    }
    let _ = (cb.first_timestamp_ms(), cb.max_timestamp_ms());

    // Stored as it came, decoded back to the same records.
    let payload = cb.payload();
    assert!(kafka_batch::is_kafka_payload(&payload));
    assert_eq!(&payload[1..], &bytes[17..], "the payload is the batch from its CRC on");
    let decoded = kafka_batch::decode_payload(&payload).expect("an accepted batch's payload decodes");
    assert_eq!(decoded.len(), n);
    for (f, k) in decoded.iter().zip(&cb.records) {
        assert!(same_record(f, k, timestamp(&cb, k)), "decoded {f:?} is not produced {k:?}");
        assert_eq!(f.offset_delta, None, "sequential records carry no offset delta");
    }
    assert_eq!(records::decode(&payload).as_ref(), Ok(&decoded), "records::decode takes Kafka payloads");
    let ts = records::timestamps(payload.clone()).expect("timestamps of an accepted batch");
    assert_eq!(ts.len(), n);

    // Compaction's view, and its rewrite keeping the records `ctl` picks.
    let keyed: Vec<KeyedRecord> = records::Codec.keyed(&payload).expect("keyed");
    assert_eq!(keyed.len(), n);
    let keep: Vec<bool> = (0..n).map(|i| ctl >> (i % 64) & 1 == 1).collect();
    let thinned = records::Codec.retain(&payload, &keep).expect("retain of an accepted batch");
    let kept = kafka_batch::decode_payload(&thinned).expect("a thinned batch decodes");
    let want: Vec<(usize, &Record)> = decoded.iter().enumerate().filter(|(i, _)| keep[*i]).collect();
    assert_eq!(kept.len(), want.len(), "compaction keeps exactly the records kept");
    let mut next = 0u32;
    for (k, (i, w)) in kept.iter().zip(&want) {
        assert_eq!(
            (&k.key, &k.value, k.null_value, &k.headers, k.timestamp_ms),
            (&w.key, &w.value, w.null_value, &w.headers, w.timestamp_ms)
        );
        let d = u32::try_from(*i).expect("small");
        assert_eq!(
            k.offset_delta,
            (d != next).then_some(d),
            "a survivor after removed records carries its delta"
        );
        next = d + 1;
    }

    // Recompressed (a topic's compression.type) and restamped (its
    // timestamp type): still a batch the produce path accepts, same records.
    let mut re = cb.clone();
    if re.recompress(codec((ctl >> 8) as u8)).is_ok() {
        let again = kafka_batch::check_produced(re.bytes.clone(), usize::MAX)
            .expect("a recompressed batch is accepted");
        assert_eq!(again.records, cb.records, "recompressing keeps the records");
    }
    let mut stamped = cb.clone();
    let now = ctl as i64;
    stamped.stamp_log_append_time(now);
    let again = kafka_batch::check_produced(stamped.bytes.clone(), max).expect("a stamped batch is accepted");
    assert!(again.header.log_append_time());
    assert_eq!((again.first_timestamp_ms(), again.max_timestamp_ms()), (now, now));
    stamped.clear_log_append_time();
    let again =
        kafka_batch::check_produced(stamped.bytes.clone(), max).expect("an unstamped batch is accepted");
    assert!(!again.header.log_append_time());

    // What a Kafka fetch serves of the stored entry: accepted again, same records.
    let entry = Entry {
        log_id: log_id(7, 1, 9),
        payload: EntryPayload::Normal(RecordBatch {
            record_count: u32::try_from(n).expect("small"),
            first_timestamp_ms: cb.first_timestamp_ms(),
            max_timestamp_ms: cb.max_timestamp_ms(),
            producer_id: cb.header.producer_id,
            producer_epoch: cb.header.producer_epoch,
            base_sequence: cb.header.base_sequence,
            records: payload.clone(),
        }),
    };
    let mut frame = Vec::new();
    let header = format::encode_entry(&entry, 1000, &mut frame).expect("frame");
    assert_eq!(Bytes::from(frame.clone()).slice(FRAME_HEADER_BYTES..), payload);
    let stored = StoredBatch { header, frame: Bytes::from(frame) };
    let mut served = BytesMut::new();
    kafka_batch::serve(&stored, records::decode, &mut served).expect("serve");
    let back = kafka_batch::check_produced(served.freeze(), usize::MAX).expect("a served batch is accepted");
    assert_eq!(back.records, cb.records, "a fetch serves the records produced");

    // Ferrolog's records as a Kafka batch again (how gRPC-produced batches
    // are served to Kafka consumers): the same records come back.
    let fields = BatchFields {
        base_offset: 0,
        offsets: u32::try_from(n).expect("small"),
        leader_epoch: 1,
        producer_id: -1,
        producer_epoch: 0,
        base_sequence: -1,
        codec: Codec::None,
    };
    let mut out = BytesMut::new();
    kafka_batch::encode_batch(&decoded, &fields, &mut out).expect("encode_batch of decoded records");
    let back = kafka_batch::check_produced(out.freeze(), usize::MAX).expect("an encoded batch is accepted");
    for (f, k) in decoded.iter().zip(&back.records) {
        assert!(same_record(f, k, timestamp(&back, k)), "re-encoded {k:?} is not {f:?}");
    }
}
