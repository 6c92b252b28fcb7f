//! A snapshot's manifest (`manifest.json`), as a replica reads it from a
//! snapshot another broker streamed to it (`ferrolog_raft_store::
//! snapshot::SnapshotFiles`: `manifest`, `check_lengths`, `segments`,
//! `manifest_for_peer`), on the in-memory file system.
//!
//! Input: a flag byte (bit 0: create the segment files the manifest names,
//! with lengths taken from the next bytes), a length byte per file, then
//! the manifest's bytes. Asserted: no panic; an accepted manifest has a
//! known version, names plain segment files only (nothing outside the
//! snapshot directory) and prefixes only of its own segments; it survives
//! a JSON round trip; the copy for a peer is an accepted manifest of
//! version 2 or lower without prefixes and otherwise the same.
#![no_main]

use std::path::Path;

use ferrolog_fuzz::Input;
use ferrolog_raft_store::segment::parse_segment_file_name;
use ferrolog_raft_store::snapshot::{MANIFEST_FILE, MANIFEST_VERSION, SnapshotFiles, SnapshotManifest};
use ferrolog_raft_store::vfs::{FaultyFs, Fs, OpenMode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let flags = input.u8();
    let lengths = input.bytes(8).to_vec();
    let json = input.rest();

    let fs: Fs = FaultyFs::new(1).mount();
    let dir = Path::new("/snapshots/00000000000000000007-1");
    fs.create_dir_all(dir).expect("mkdir");
    fs.open(&dir.join(MANIFEST_FILE), OpenMode::CreateTruncate)
        .expect("create")
        .write_all_at(json, 0)
        .expect("write");
    let files = SnapshotFiles::new(fs.clone(), dir.to_owned());

    let Ok(m) = files.manifest() else {
        assert!(files.segments().is_err() && files.manifest_for_peer().is_err());
        return;
    };
    assert!((1..=MANIFEST_VERSION).contains(&m.version), "version {}", m.version);
    for s in &m.segments {
        assert!(parse_segment_file_name(s).is_some(), "{s:?} is not a segment file name");
        assert!(!s.contains('/') && !s.contains(".."), "{s:?} reaches outside the snapshot");
    }
    for k in m.prefix_bytes.keys() {
        assert!(m.segments.contains(k), "a prefix of {k:?}, not a segment");
    }
    let again: SnapshotManifest =
        serde_json::from_slice(&serde_json::to_vec(&m).expect("encode")).expect("a written manifest reads");
    assert_eq!(again, m, "manifest JSON round trip");

    let segments = files.segments().expect("segments of an accepted manifest");
    assert_eq!(segments.len(), m.segments.len());
    for (path, prefix) in &segments {
        assert_eq!(path.parent(), Some(dir), "{} is outside the snapshot", path.display());
        assert_eq!(*prefix, path.file_name().and_then(|n| m.prefix_bytes.get(n.to_str()?).copied()));
    }

    if flags & 1 != 0 {
        for (i, (path, _)) in segments.iter().enumerate() {
            let len = u64::from(lengths.get(i % 8).copied().unwrap_or(0)) * 16;
            let f = fs.open(path, OpenMode::CreateTruncate).expect("create");
            f.set_len(len).expect("set_len");
        }
        if let Ok(()) = files.check_lengths() {
            for (path, prefix) in &segments {
                let len = fs.metadata(path).expect("stat").len;
                assert!(prefix.is_none_or(|p| len >= p), "{} shorter than its prefix", path.display());
            }
        }
    } else {
        let _ = files.check_lengths();
    }

    let peer = files.manifest_for_peer().expect("the copy for a peer of an accepted manifest");
    fs.open(&dir.join(MANIFEST_FILE), OpenMode::CreateTruncate)
        .expect("create")
        .write_all_at(&peer, 0)
        .expect("write");
    let p = files.manifest().expect("a peer accepts the copy sent to it");
    assert!(p.version <= 2 && p.version <= m.version, "peer copy version {} of {}", p.version, m.version);
    assert!(p.prefix_bytes.is_empty());
    assert_eq!(
        SnapshotManifest { version: m.version, prefix_bytes: m.prefix_bytes.clone(), ..p },
        m,
        "the peer copy differs only in version and prefixes"
    );
});
