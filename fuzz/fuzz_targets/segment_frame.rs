//! Segment frames and segment file headers (`ferrolog_raft_store::format`):
//! the bytes every replica reads back from its segment files, snapshots
//! carry, and AppendEntries requests hold.
//!
//! Input: a flag byte (bit 0: recompute every frame's CRC32C and the
//! segment header's, so mutations get past the checksums), then frames
//! back to back. Asserted: no panic; an accepted frame's length is within
//! the input and the format's bounds and agrees with `frame_len`; its
//! record count fits its kind; decode(encode(decode(frame))) gives the
//! same entry and header; a decoded segment header re-encodes to itself.
#![no_main]

use bytes::Bytes;
use ferrolog_fuzz::{Input, fixup};
use ferrolog_raft_store::format::{
    self, FRAME_BYTES_MAX, FRAME_HEADER_BYTES, FrameKind, SEGMENT_HEADER_BYTES, SegmentHeader,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let flags = input.u8();
    let mut b = input.rest().to_vec();
    if flags & 1 != 0 {
        fixup::frame_crcs(&mut b);
    }

    // The same bytes as a segment file header.
    let mut head = b.clone();
    if flags & 1 != 0 {
        fixup::segment_header_crc(&mut head);
    }
    if let Ok(h) = SegmentHeader::decode(&head) {
        assert!(head.len() >= SEGMENT_HEADER_BYTES);
        assert_eq!(SegmentHeader::decode(&h.encode()), Ok(h), "segment header round trip");
    }

    let all = Bytes::from(b);
    let mut at = 0;
    while at < all.len() {
        let rest = &all[at..];
        let len = format::frame_len(rest);
        if let Ok(l) = len {
            assert!((FRAME_HEADER_BYTES..=FRAME_BYTES_MAX).contains(&l));
        }
        let Ok(h) = format::decode_frame_header(rest) else { break };
        assert_eq!(Ok(h.frame_bytes), len, "decode_frame_header agrees with frame_len");
        assert!(h.frame_bytes <= rest.len(), "a frame claims {} bytes of {}", h.frame_bytes, rest.len());
        assert_eq!(h.kind == FrameKind::Records, h.record_count > 0, "record count fits the kind");
        let _ = (h.index(), h.next_offset());
        let frame = all.slice(at..at + h.frame_bytes);
        if let Ok(entry) = format::decode_entry(&h, &frame) {
            assert_eq!(entry.log_id, h.log_id);
            let mut again = Vec::new();
            let h2 =
                format::encode_entry(&entry, h.base_offset, &mut again).expect("a decoded entry encodes");
            assert_eq!(h2.frame_bytes, again.len());
            let d2 = format::decode_frame_header(&again).expect("an encoded frame decodes");
            assert_eq!(d2, h2, "header of a re-encoded frame");
            let e2 =
                format::decode_entry(&d2, &Bytes::from(again.clone())).expect("a re-encoded entry decodes");
            assert_eq!(e2, entry, "entry round trip");
            match h.kind {
                // Records frames keep every header field.
                FrameKind::Records => {
                    assert_eq!(h2, h, "records frame header round trip");
                    assert_eq!(&again[12..78], &frame[12..78], "records frame fields");
                    assert_eq!(&again[FRAME_HEADER_BYTES..], &frame[FRAME_HEADER_BYTES..], "records payload");
                }
                // Old JSON membership frames are rewritten as protobuf ones.
                FrameKind::MembershipJson => assert_eq!(h2.kind, FrameKind::Membership),
                k => assert_eq!(h2.kind, k),
            }
        }
        at += h.frame_bytes;
    }
});
