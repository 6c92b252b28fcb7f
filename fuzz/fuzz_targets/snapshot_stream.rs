//! A snapshot streamed by a peer (`ferrolog_replica::snapshot::receive`):
//! the chunk stream of an InstallSnapshot RPC (prost-decoded
//! `SnapshotChunk`s, as tonic hands them over) staged in a directory of
//! the real file system, then its manifest read as the install does.
//!
//! Input: a flag byte (bit 0: the receiver knows no group, so the stream
//! is refused), then chunks, each a u16 length (little-endian) and that
//! many bytes of a protobuf `SnapshotChunk`. Asserted: no panic; a refused
//! stream leaves nothing behind; an accepted one staged exactly the files
//! its chunks named (plain names, inside the staging directory), each
//! holding what the chunks wrote at their offsets; the staged manifest
//! reads without panicking.
#![no_main]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use ferrolog_fuzz::Input;
use ferrolog_proto::raft::SnapshotChunk;
use ferrolog_raft_store::snapshot::SnapshotFiles;
use ferrolog_replica::snapshot;
use libfuzzer_sys::fuzz_target;
use prost::Message;

/// Files larger than this are checked by length only.
const MODEL_BYTES_MAX: u64 = 1 << 20;

fn root() -> &'static PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("ferrolog-fuzz-snapshot-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("staging root");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let flags = input.u8();
    let mut chunks = Vec::new();
    while !input.is_empty() {
        let n = usize::from(input.u16());
        let b = input.bytes(n);
        let Ok(c) = SnapshotChunk::decode(b) else { break };
        chunks.push(c);
        if chunks.len() > 64 {
            break;
        }
    }
    let root = root();
    let stream = futures::stream::iter(chunks.clone().into_iter().map(Ok::<_, std::io::Error>));
    let known = flags & 1 == 0;
    let result = futures::executor::block_on(snapshot::receive(stream, |_| known.then(|| root.clone())));
    let received = match result {
        Err(_) => {
            let left = std::fs::read_dir(root).expect("list root").count();
            assert_eq!(left, 0, "a refused stream left {left} entries behind");
            return;
        }
        Ok(r) => r,
    };
    assert!(known);
    let dir = received.staged_dir().to_owned();
    assert_eq!(dir.parent(), Some(root.as_path()), "staged outside the staging root");

    // What the chunks wrote, up to the final one.
    let mut model: BTreeMap<String, (u64, Vec<(u64, Vec<u8>)>)> = BTreeMap::new();
    for c in chunks.iter().skip(1).take_while(|c| !c.done) {
        let f = model.entry(c.file_name.clone()).or_default();
        if !c.data.is_empty() {
            f.0 = f.0.max(c.file_offset + c.data.len() as u64);
        }
        f.1.push((c.file_offset, c.data.to_vec()));
    }
    let mut staged: Vec<String> = std::fs::read_dir(&dir)
        .expect("list staged")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    staged.sort();
    assert_eq!(
        staged,
        model.keys().cloned().collect::<Vec<_>>(),
        "staged files are the ones the chunks named"
    );
    for (name, (len, writes)) in &model {
        let path = dir.join(name);
        assert_eq!(path.parent(), Some(dir.as_path()));
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), *len, "{name}: length");
        if *len <= MODEL_BYTES_MAX {
            let mut want = vec![0u8; *len as usize];
            for (at, bytes) in writes.iter().filter(|(_, b)| !b.is_empty()) {
                want[*at as usize..*at as usize + bytes.len()].copy_from_slice(bytes);
            }
            assert!(std::fs::read(&path).expect("read") == want, "{name}: contents");
        }
    }

    // Read as the install reads it.
    let files = SnapshotFiles::new(ferrolog_raft_store::vfs::real(), dir.clone());
    if files.manifest().is_ok() {
        let _ = files.check_lengths();
        let _ = files.segments();
    }
    std::fs::remove_dir_all(&dir).expect("clean up");
});
