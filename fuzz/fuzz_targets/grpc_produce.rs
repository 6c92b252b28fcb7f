//! The gRPC client API's Produce request (`ferrolog.client.v1.
//! ProduceRequest`, prost-decoded as tonic does), validated and turned into
//! the stored batch as `ferrolog_broker::grpc::service` does: the topic id
//! (`TopicId::from_wire`), the producer epoch, then `partition::records::
//! build_batch` (sizes, producer fields, null values, offset deltas); and
//! for a topic with a `compression.type`, the Kafka payload it is stored
//! as (`kafka_batch::payload_of`).
//!
//! (The handler itself needs a running broker; the validation steps it
//! takes before proposing are repeated here, in the same order.)
//!
//! Input: a flag byte (bits 0–2: the topic's codec, 5 meaning none; bit 3:
//! LogAppendTime), a control word (u64: which records compaction keeps),
//! then the request. Asserted: no panic; an accepted batch holds the
//! request's records, stamped, and decodes back to them; compaction's
//! rewrite keeps exactly the records kept; the Kafka payload of a
//! compressed topic decodes to the same records and, served to a Kafka
//! consumer, passes every produce-path check.
#![no_main]

use bytes::{BufMut, Bytes, BytesMut};
use ferrolog_broker::partition::kafka_batch;
use ferrolog_broker::partition::records::{self, ProducerFields};
use ferrolog_fuzz::{Input, kafka};
use ferrolog_proto::TopicId;
use ferrolog_proto::client::ProduceRequest;
use ferrolog_raft_store::RecordCodec;
use libfuzzer_sys::fuzz_target;
use prost::Message;

const NOW_MS: i64 = 1_700_000_000_000;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let flags = input.u8();
    let ctl = input.u64();
    let Ok(req) = ProduceRequest::decode(input.rest()) else { return };

    if let Ok(Some(id)) = TopicId::from_wire(&req.topic_id) {
        assert_eq!(TopicId::from_wire(&id.to_wire()), Ok(Some(id)));
    }
    let log_append_time = flags & 8 != 0;
    let mut rows = req.records.clone();
    if log_append_time {
        for r in &mut rows {
            r.timestamp_ms = 0;
        }
    }
    let Ok(epoch) = i16::try_from(req.producer_epoch) else { return };
    let producer = ProducerFields {
        producer_id: req.producer_id,
        producer_epoch: epoch,
        base_sequence: req.base_sequence,
    };
    let max = kafka::MAX_BATCH_BYTES;
    let Ok(batch) = records::build_batch(rows.clone(), producer, NOW_MS, max, max) else { return };

    // The stored RecordSet holds the request's records, stamped.
    assert_eq!(batch.record_count as usize, rows.len());
    assert!(batch.records.len() <= records::batch_encoded_bytes_max(max));
    let stamped: Vec<_> = rows
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if r.timestamp_ms == 0 {
                r.timestamp_ms = NOW_MS;
            }
            r
        })
        .collect();
    let decoded = records::decode(&batch.records).expect("a built batch decodes");
    assert_eq!(decoded, stamped, "the stored batch holds the request's records");
    assert_eq!(batch.first_timestamp_ms, stamped[0].timestamp_ms);
    assert_eq!(Some(batch.max_timestamp_ms), stamped.iter().map(|r| r.timestamp_ms).max());

    // Compaction's rewrite keeps exactly the records kept, with their deltas.
    let keep: Vec<bool> = (0..decoded.len()).map(|i| ctl >> (i % 64) & 1 == 1).collect();
    let thinned = records::decode(&records::Codec.retain(&batch.records, &keep).expect("retain"))
        .expect("a thinned batch decodes");
    let deltas: Vec<u32> = records::offset_deltas(&thinned);
    let want: Vec<u32> = (0..decoded.len() as u32).filter(|i| keep[*i as usize]).collect();
    assert_eq!(deltas, want, "survivors keep their offsets");

    // A topic with a compression.type stores a Kafka batch of that codec.
    if flags & 7 == 5 {
        return;
    }
    let codec = kafka::codec(flags & 7);
    let payload = kafka_batch::payload_of(
        &decoded,
        batch.producer_id,
        batch.producer_epoch,
        batch.base_sequence,
        codec,
        log_append_time,
    )
    .expect("payload_of");
    let back = kafka_batch::decode_payload(&payload).expect("a Kafka payload of ours decodes");
    assert_eq!(back.len(), decoded.len());
    for (b, d) in back.iter().zip(&decoded) {
        let ts = if log_append_time { batch.max_timestamp_ms } else { d.timestamp_ms };
        assert_eq!(
            (&b.key, &b.value, b.null_value, &b.headers, b.timestamp_ms),
            (&d.key, &d.value, d.null_value, &d.headers, ts)
        );
    }
    // As a Kafka fetch serves it: the 17 bytes before the CRC put back.
    let mut full = BytesMut::new();
    full.put_i64(0);
    full.put_i32(i32::try_from(payload.len() + 4).expect("small"));
    full.put_i32(0);
    full.put_i8(2);
    full.extend_from_slice(&payload[1..]);
    let full: Bytes = full.freeze();
    kafka_batch::check_produced(full.clone(), usize::MAX).expect("a batch of ours passes the produce checks");
    kafka::check_batch(full, ctl);
});
