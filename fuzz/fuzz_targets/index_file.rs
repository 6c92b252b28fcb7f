//! A sealed segment's index file (`ferrolog_raft_store::format::
//! decode_index`), alone and as the store loads it with its segment
//! (`Segment::open` of a sealed segment, which trusts an index file that
//! verifies and matches the segment instead of scanning it).
//!
//! Input: a flag byte (bit 0: recompute the index file's CRC32C; bit 1:
//! make its summary name the segment's length and its first row the
//! segment's base index, so the store takes it; bit 2: load it with a
//! segment), three lookup values (u64 each), then the index file.
//! Asserted: no panic; a decoded index has exactly the rows its length
//! allows and re-encodes to the same bytes; a segment opened with it
//! never claims more bytes than its file holds, and its lookups and reads
//! stay inside the file.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use ferrolog_fuzz::{Input, fixup, seeds};
use ferrolog_raft_store::format::{self, SEGMENT_HEADER_BYTES};
use ferrolog_raft_store::segment::{Segment, segment_file_name};
use ferrolog_raft_store::vfs::{FaultyFs, Fs, OpenMode};
use libfuzzer_sys::fuzz_target;

/// Header, summary and row sizes of the index file format (`format.rs`).
const HEADER: usize = 64;
const ROW: usize = 32;

fn segment() -> &'static (u64, Vec<u8>) {
    static SEGMENT: OnceLock<(u64, Vec<u8>)> = OnceLock::new();
    SEGMENT.get_or_init(|| {
        (
            seeds::SEGMENT_BASE_INDEX,
            seeds::segment_file(seeds::SEGMENT_BASE_INDEX, seeds::SEGMENT_BASE_OFFSET),
        )
    })
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let flags = input.u8();
    let (q1, q2, q3) = (input.u64(), input.u64(), input.u64());
    let mut idx = input.rest().to_vec();
    let (base_index, seg) = segment();
    if flags & 2 != 0 && idx.len() >= HEADER + ROW {
        idx[16..24].copy_from_slice(&(seg.len() as u64).to_le_bytes());
        idx[HEADER..HEADER + 8].copy_from_slice(&base_index.to_le_bytes());
    }
    if flags & 1 != 0 {
        fixup::index_crc(&mut idx);
    }

    if let Ok((summary, rows)) = format::decode_index(&idx) {
        assert_eq!(idx.len(), HEADER + rows.len() * ROW + 4, "rows and length agree");
        assert_eq!(format::encode_index(&summary, &rows), idx, "index round trip");
    }
    if flags & 4 == 0 {
        return;
    }

    let fs: Fs = FaultyFs::new(1).mount();
    let dir = Path::new("/p");
    fs.create_dir_all(dir).expect("mkdir");
    let path = dir.join(segment_file_name(*base_index));
    fs.open(&path, OpenMode::CreateTruncate).expect("create").write_all_at(seg, 0).expect("write");
    fs.open(&path.with_extension("idx"), OpenMode::CreateTruncate)
        .expect("create")
        .write_all_at(&idx, 0)
        .expect("write");
    let Ok((s, cut)) = Segment::open(&fs, &path, false, false, 4096) else { return };
    assert_eq!(cut, None);
    let size = s.size_bytes();
    assert!(
        size >= SEGMENT_HEADER_BYTES as u64 && size <= seg.len() as u64,
        "size {size} of a {}-byte file",
        seg.len()
    );
    for p in ferrolog_fuzz::lookup_positions(&s, *base_index, (q1, q2, q3)) {
        assert!(p <= size, "lookup at {p} past the segment's {size} bytes");
        if let Ok((frames, _)) = s.read_frames(p, 1 << 20, true, |_| true) {
            let total: u64 = frames.iter().map(|(h, _)| h.frame_bytes as u64).sum();
            assert!(p + total <= size, "read past the segment");
        }
    }
});
