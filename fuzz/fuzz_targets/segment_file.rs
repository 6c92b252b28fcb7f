//! A segment file opened by the store (`ferrolog_raft_store::segment::
//! Segment::open`), on the in-memory file system: the scan that verifies
//! every frame at start-up, cuts a torn tail, refuses damage before valid
//! frames, and builds the sparse index; then reads, lookups, the cut,
//! sealing, and reopening from the index file it wrote.
//!
//! Input: a flag byte (bit 0: recompute every frame's CRC32C), the
//! segment's base index and base offset (u64 each), the index interval
//! (u16), three lookup values (u64 each), then the frames written after
//! the segment header. Asserted: no panic; an opened segment never claims
//! more bytes than the file holds; a cut lies at the end of the valid
//! prefix; reading from the start returns exactly that prefix, frames in
//! index and offset order; lookups land inside it; a sealed rescan agrees
//! with the tail scan; a sealed segment reopened from its index file has
//! the state the scan found.
#![no_main]

use std::path::Path;

use ferrolog_fuzz::{Input, fixup};
use ferrolog_raft_store::format::{self, SEGMENT_HEADER_BYTES, SegmentHeader};
use ferrolog_raft_store::segment::{Segment, segment_file_name};
use ferrolog_raft_store::vfs::{FaultyFs, Fs, OpenMode};
use libfuzzer_sys::fuzz_target;

/// What must agree between two opens of the same bytes.
fn state(s: &Segment) -> (u64, u64, u64, Option<ferrolog_raft_store::types::LogId>, i64) {
    (s.size_bytes(), s.next_index(), s.next_offset(), s.last_log_id(), s.max_timestamp_ms())
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let flags = input.u8();
    let base_index = input.u64();
    let base_offset = input.u64();
    let interval = u64::from(input.u16()) + 1;
    let (q1, q2, q3) = (input.u64(), input.u64(), input.u64());
    let mut body = input.rest().to_vec();
    if flags & 1 != 0 {
        fixup::frame_crcs(&mut body);
    }
    let mut file = SegmentHeader { base_index, base_offset }.encode().to_vec();
    file.extend_from_slice(&body);
    let file_len = file.len() as u64;

    let fs: Fs = FaultyFs::new(1).mount();
    let dir = Path::new("/p");
    fs.create_dir_all(dir).expect("mkdir");
    let path = dir.join(segment_file_name(base_index));
    fs.open(&path, OpenMode::CreateTruncate).expect("create").write_all_at(&file, 0).expect("write");

    // As a sealed segment without an index file: every frame must verify.
    let sealed = Segment::open(&fs, &path, false, true, interval).map(|(s, cut)| {
        assert_eq!(cut, None, "a sealed scan never cuts");
        state(&s)
    });

    // As the tail segment, as a replica opens its log.
    let Ok((mut seg, cut)) = Segment::open(&fs, &path, true, false, interval) else {
        assert!(sealed.is_err(), "the sealed scan accepted what the tail scan refused");
        return;
    };
    let size = seg.size_bytes();
    assert!(size >= SEGMENT_HEADER_BYTES as u64 && size <= file_len, "size {size} of a {file_len}-byte file");
    match cut {
        None => {
            assert_eq!(size, file_len, "no cut, yet the valid prefix ends early");
            assert_eq!(sealed.as_ref().ok(), Some(&state(&seg)), "sealed and tail scans disagree");
        }
        Some(p) => {
            assert_eq!(p, size, "the cut is where the valid prefix ends");
            assert!(p < file_len);
            assert!(sealed.is_err(), "the sealed scan accepted a torn file");
        }
    }
    if let Some(last) = seg.last_log_id() {
        assert_eq!(seg.next_index(), last.index.wrapping_add(1));
    } else {
        assert_eq!((seg.next_index(), seg.next_offset()), (base_index, base_offset));
    }

    // Everything read back from the start: exactly the valid prefix, in order.
    let (frames, at_end) = seg
        .read_frames(SEGMENT_HEADER_BYTES as u64, usize::MAX, true, |_| true)
        .expect("the valid prefix reads");
    assert!(at_end);
    let total: u64 = frames.iter().map(|(h, _)| h.frame_bytes as u64).sum();
    assert_eq!(total, size - SEGMENT_HEADER_BYTES as u64, "frames read cover the valid prefix");
    let (mut index, mut offset) = (base_index, base_offset);
    for (h, bytes) in &frames {
        assert_eq!(bytes.len(), h.frame_bytes);
        assert_eq!((h.index(), h.base_offset), (index, offset), "frames continue the log");
        index = index.wrapping_add(1);
        offset = h.next_offset();
        let _ = format::decode_entry(h, bytes);
    }

    // Lookups land inside the valid prefix.
    for p in ferrolog_fuzz::lookup_positions(&seg, base_index, (q1, q2, q3)) {
        assert!((SEGMENT_HEADER_BYTES as u64..=size).contains(&p), "lookup at {p} outside 40..={size}");
    }

    // The torn tail cut, as the log does on open.
    if let Some(p) = cut {
        seg.truncate_at(p, false).expect("cutting the torn tail");
        assert_eq!(seg.size_bytes(), p);
    }
    if seg.is_empty() {
        return;
    }
    // Sealed, then reopened from the index file it wrote.
    let before = state(&seg);
    seg.seal().expect("seal");
    drop(seg);
    let (again, cut) = Segment::open(&fs, &path, false, false, interval).expect("a sealed segment reopens");
    assert_eq!(cut, None);
    assert_eq!(state(&again), before, "the index file restores the scanned state");
    let (rescanned, _) = Segment::open(&fs, &path, false, true, interval).expect("a sealed segment rescans");
    assert_eq!(state(&rescanned), before);
});
