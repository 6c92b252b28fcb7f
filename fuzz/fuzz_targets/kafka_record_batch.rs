//! Kafka record batches (magic 2) as the broker parses them
//! (`ferrolog_broker::partition::kafka_batch`, `kafka_codec`, `records`):
//! a produced batch's checks and records (`check_produced`, with
//! decompression of all four codecs bounded), a stored payload decoded
//! for a gRPC fetch or compaction (`decode_payload`, `records::decode`,
//! `retain_payload`), and the codecs themselves.
//!
//! Input: a flag byte (bit 0: make the batch's length field and CRC-32C
//! agree with its bytes; bit 1: also read the bytes as a stored payload,
//! its CRC made to agree; bit 2: also decompress them as the codec the
//! control word picks, with a small bound), a control word (u64: codec,
//! append time and which records compaction keeps), then the batch.
//! Asserted: no panic; decompression never returns more than its bound;
//! compress then decompress gives the input back; and for an accepted
//! batch every invariant of `ferrolog_fuzz::kafka::check_batch`.
#![no_main]

use bytes::Bytes;
use ferrolog_broker::partition::kafka_batch::{self, PAYLOAD_TAG};
use ferrolog_broker::partition::{kafka_codec, records};
use ferrolog_fuzz::{Input, fixup, kafka};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let flags = input.u8();
    let ctl = input.u64();
    let raw = input.rest();

    let mut batch = raw.to_vec();
    if flags & 1 != 0 {
        fixup::kafka_batch(&mut batch);
    }
    kafka::check_batch(Bytes::from(batch.clone()), ctl);

    if flags & 2 != 0 {
        // A stored payload: the tag, then the batch from its CRC on.
        let mut p = vec![PAYLOAD_TAG];
        p.extend_from_slice(batch.get(17..).unwrap_or(&[]));
        fixup::kafka_payload(&mut p);
        let p = Bytes::from(p);
        if let Ok(rs) = kafka_batch::decode_payload(&p) {
            assert_eq!(records::decode(&p).as_ref(), Ok(&rs));
            let keep: Vec<bool> = (0..rs.len()).map(|i| ctl >> (i % 64) & 1 == 1).collect();
            let thinned =
                kafka_batch::retain_payload(&p, &keep).expect("a payload that decodes can be thinned");
            let kept = kafka_batch::decode_payload(&thinned).expect("a thinned payload decodes");
            assert_eq!(kept.len(), keep.iter().filter(|k| **k).count());
        }
        let _ = records::timestamps(p.clone());
    }
    // Ferrolog's own stored encoding (a protobuf RecordSet) from the same bytes.
    let _ = records::decode(&Bytes::copy_from_slice(raw));

    if flags & 4 != 0 {
        let codec = kafka::codec(ctl as u8);
        let max = usize::from((ctl >> 8) as u16);
        if let Ok(out) = kafka_codec::decompress(codec, raw, max) {
            assert!(out.len() <= max, "{} bytes out of {codec:?} with a bound of {max}", out.len());
        }
        let packed = kafka_codec::compress(codec, raw).expect("compress");
        let back =
            kafka_codec::decompress(codec, &packed, raw.len()).expect("decompress what was compressed");
        assert!(back == raw, "{codec:?} round trip");
    }
});
