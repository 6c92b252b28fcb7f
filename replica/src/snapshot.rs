//! Streaming a snapshot directory (manifest and segment files) between
//! brokers in chunks, and staging it on the receiver before install.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ferrolog_proto::raft::SnapshotChunk;
use ferrolog_raft_store::snapshot::SnapshotFiles;
use ferrolog_raft_store::state_machine::Snapshot;
use ferrolog_raft_store::types::{NodeId, SnapshotMeta, Vote};
use ferrolog_raft_store::vfs::{FileRef, Fs, OpenMode, Vfs};
use futures::{Stream, StreamExt};
use tokio_stream::wrappers::ReceiverStream;

/// A Raft group's id.
type GroupId = u64;

/// Bytes of file data per chunk.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Chunks read ahead of the network, per transfer.
const CHUNKS_AHEAD: usize = 4;
/// Most files a received snapshot may hold (segments and manifest).
pub const RECEIVE_FILES_MAX: usize = 100_000;
/// Largest file a received snapshot may hold, bytes (a segment is 1 GiB by
/// default; this leaves room for much larger configured segments).
pub const RECEIVE_FILE_BYTES_MAX: u64 = 64 << 30;

/// Why a snapshot could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotTransferError {
    /// Reading or writing a file failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The chunk stream broke the protocol.
    #[error("invalid snapshot stream: {0}")]
    Invalid(String),
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotTransferError + use<> {
    let path = path.to_owned();
    move |source| SnapshotTransferError::Io { op, path, source }
}

/// The chunks of `snapshot`'s directory, read lazily as the stream is polled.
///
/// # Errors
/// [`SnapshotTransferError`] if the directory cannot be listed or the
/// metadata not encoded.
pub(crate) fn chunks(
    group: GroupId,
    target: NodeId,
    vote: &Vote,
    snapshot: &Snapshot,
) -> Result<impl Stream<Item = SnapshotChunk> + Send + 'static + use<>, SnapshotTransferError> {
    let (fs, dir) = (snapshot.snapshot.fs.clone(), snapshot.snapshot.dir.clone());
    let files = fs.list(&dir).map_err(io_err("list", &dir))?;
    // A segment the snapshot holds only a prefix of (linked while the log
    // still appended to it) is streamed up to there.
    let files_of = &snapshot.snapshot;
    let bad =
        |e: ferrolog_raft_store::StoreError| SnapshotTransferError::Invalid(format!("snapshot to send: {e}"));
    let prefixes = files_of.manifest().map_err(bad)?.prefix_bytes;
    // The manifest as the peer must read it: without prefixes (every file
    // arrives whole), in a version older brokers read.
    let manifest = files_of.manifest_for_peer().map_err(bad)?;
    let vote = ferrolog_raft_store::wire::vote_to_wire(vote);
    let meta = ferrolog_raft_store::wire::snapshot_meta_to_wire(&snapshot.meta);
    let base = SnapshotChunk { group_id: group, target_node: target, ..SnapshotChunk::default() };
    let first = SnapshotChunk { vote: Some(vote), meta: Some(meta), ..base.clone() };
    let mut reader = ChunkReader {
        fs: fs.clone(),
        dir,
        prefixes,
        manifest,
        first: Some(first),
        files: files.into(),
        file: None,
        base,
        ended: false,
    };
    // On a simulation's in-memory disk the files are read as the stream is
    // polled (ferrolog_raft_store::runtime::blocking says why); else on a
    // blocking thread, CHUNKS_AHEAD ahead of the network.
    if fs.background_on_runtime() {
        return Ok(futures::future::Either::Left(futures::stream::iter(std::iter::from_fn(move || {
            reader.next_chunk()
        }))));
    }
    let (tx, rx) = tokio::sync::mpsc::channel(CHUNKS_AHEAD);
    #[allow(
        clippy::disallowed_methods,
        reason = "a sender on a blocking thread, only off a simulation's disk"
    )]
    tokio::task::spawn_blocking(move || {
        while let Some(chunk) = reader.next_chunk() {
            if tx.blocking_send(chunk).is_err() {
                return;
            }
        }
    });
    Ok(futures::future::Either::Right(ReceiverStream::new(rx)))
}

/// Reads a snapshot directory's chunks in order: the vote and metadata,
/// each file's (the manifest as given), then the `done` mark. A file that
/// vanished, cannot be read or is shorter than the manifest says ends the
/// chunks without that mark, so the receiver refuses the snapshot.
struct ChunkReader {
    fs: Fs,
    dir: PathBuf,
    /// Files sent only up to a length (bytes), by name.
    prefixes: std::collections::BTreeMap<String, u64>,
    /// The manifest as the peer must read it.
    manifest: Vec<u8>,
    /// The opening chunk, until sent.
    first: Option<SnapshotChunk>,
    /// Names of the files not yet begun.
    files: std::collections::VecDeque<String>,
    /// The file being sent: its name, where its bytes come from, and the
    /// offset of its next chunk.
    file: Option<(String, Source, u64)>,
    /// The group and target every chunk carries.
    base: SnapshotChunk,
    /// The `done` mark was sent, or the transfer failed.
    ended: bool,
}

/// Where a file's chunks are read from.
enum Source {
    /// [`ChunkReader::manifest`].
    Manifest,
    /// The open file, sent up to a length (bytes) if one is given.
    File(FileRef, Option<u64>),
}

impl ChunkReader {
    /// The next chunk; `None` after the `done` mark or a failure.
    fn next_chunk(&mut self) -> Option<SnapshotChunk> {
        if self.ended {
            return None;
        }
        if let Some(first) = self.first.take() {
            return Some(first);
        }
        loop {
            if self.file.is_some() {
                match self.read_chunk() {
                    Ok(Some(chunk)) => return Some(chunk),
                    Ok(None) => self.file = None,
                    Err(()) => {
                        self.ended = true;
                        return None;
                    }
                }
            }
            let Some(name) = self.files.pop_front() else {
                self.ended = true;
                return Some(SnapshotChunk { done: true, ..self.base.clone() });
            };
            if name == ferrolog_raft_store::snapshot::MANIFEST_FILE {
                self.file = Some((name, Source::Manifest, 0));
                continue;
            }
            let path = self.dir.join(&name);
            let Ok(f) = self.fs.open(&path, OpenMode::Read) else {
                tracing::warn!(path = %path.display(), "snapshot file vanished while sending");
                self.ended = true;
                return None;
            };
            let limit = self.prefixes.get(&name).copied();
            self.file = Some((name, Source::File(f, limit), 0));
        }
    }

    /// The current file's next chunk; `Ok(None)` at its end, `Err` (logged)
    /// when it cannot be sent.
    fn read_chunk(&mut self) -> Result<Option<SnapshotChunk>, ()> {
        let Some((name, source, offset)) = &mut self.file else { return Ok(None) };
        let data = match source {
            Source::Manifest => {
                let from = usize::try_from(*offset).unwrap_or(usize::MAX).min(self.manifest.len());
                let part = &self.manifest[from..];
                if part.is_empty() {
                    return Ok(None);
                }
                part[..part.len().min(CHUNK_BYTES)].to_vec()
            }
            Source::File(f, limit) => {
                let path = self.dir.join(&*name);
                let want = limit.map_or(CHUNK_BYTES, |l| {
                    usize::try_from(l.saturating_sub(*offset)).unwrap_or(usize::MAX).min(CHUNK_BYTES)
                });
                if want == 0 {
                    return Ok(None);
                }
                let mut buf = vec![0u8; want];
                match f.read_at(&mut buf, *offset) {
                    Ok(0) if limit.is_some() => {
                        tracing::warn!(path = %path.display(), offset = *offset, ?limit,
                            "snapshot file shorter than its manifest says; not sending it");
                        return Err(());
                    }
                    Ok(0) => return Ok(None),
                    Ok(n) => buf.truncate(n),
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "reading snapshot file");
                        return Err(());
                    }
                }
                buf
            }
        };
        let chunk = SnapshotChunk {
            file_name: name.clone(),
            file_offset: *offset,
            data: data.into(),
            ..self.base.clone()
        };
        *offset += chunk.data.len() as u64;
        Ok(Some(chunk))
    }
}

/// A snapshot received and staged on disk, ready to install.
#[derive(Debug)]
pub struct Received {
    /// The group it belongs to.
    pub group: GroupId,
    /// The replica it was addressed to.
    pub target: NodeId,
    /// The sending leader's vote.
    pub(crate) vote: Vote,
    /// The snapshot's metadata.
    pub(crate) meta: SnapshotMeta,
    /// The staged files.
    pub(crate) files: SnapshotFiles,
}

impl Received {
    /// The directory the files were staged in (remove it if the snapshot
    /// is not installed).
    pub fn staged_dir(&self) -> &Path {
        &self.files.dir
    }

    /// The file system the files were staged on.
    pub fn fs(&self) -> &Fs {
        &self.files.fs
    }
}

/// Removes what earlier receptions left in `staging_root` (a transfer cut
/// off midway, a process that died while installing): call it before the
/// replica's node starts, when nothing is being received into it.
///
/// # Errors
/// The directory cannot be listed or an entry not removed.
pub fn clear_staging(vfs: &dyn Vfs, staging_root: &Path) -> std::io::Result<()> {
    for name in vfs.list(staging_root)? {
        let path = staging_root.join(name);
        if vfs.metadata(&path)?.is_dir { vfs.remove_dir_all(&path)? } else { vfs.remove_file(&path)? }
    }
    Ok(())
}

fn valid_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Receives a chunk stream into a new directory under `staging_root(group)`,
/// fsyncing every file and the directory once the last chunk arrives.
///
/// # Errors
/// [`SnapshotTransferError::Invalid`] for a stream that breaks the protocol
/// (missing metadata, a file name with a path in it, mixed groups, no final
/// chunk); `Io` for disk failures. The staging directory is removed on error.
pub async fn receive<S, E>(
    mut stream: S,
    staging_root: impl Fn(GroupId) -> Option<(Fs, PathBuf)>,
) -> Result<Received, SnapshotTransferError>
where
    S: Stream<Item = Result<SnapshotChunk, E>> + Unpin,
    E: std::fmt::Display,
{
    let invalid = |m: String| SnapshotTransferError::Invalid(m);
    let first = match stream.next().await {
        Some(Ok(c)) => c,
        Some(Err(e)) => return Err(invalid(format!("stream failed: {e}"))),
        None => return Err(invalid("empty stream".into())),
    };
    let vote: Vote = first
        .vote
        .as_ref()
        .map(ferrolog_raft_store::wire::vote_from_wire)
        .ok_or_else(|| invalid("the first chunk carries no vote".into()))?;
    let meta =
        first.meta.as_ref().ok_or_else(|| invalid("the first chunk carries no snapshot metadata".into()))?;
    let meta: SnapshotMeta = ferrolog_raft_store::wire::snapshot_meta_from_wire(meta)
        .map_err(|e| invalid(format!("meta: {e}")))?;
    let (group, target) = (first.group_id, first.target_node);
    let (fs, root) = staging_root(group).ok_or_else(|| invalid(format!("unknown group {group}")))?;
    // Random, from the generator a simulation seeds: a clock's reading
    // could repeat there.
    let dir = root.join(format!("incoming-{:016x}", ferrolog_raft_store::runtime::random_u64()));
    fs.create_dir_all(&dir).map_err(io_err("create", &dir))?;
    let result = receive_files(&*fs, &mut stream, &dir, group).await;
    if let Err(e) = result {
        let _ = fs.remove_dir_all(&dir);
        return Err(e);
    }
    Ok(Received { group, target, vote, meta, files: SnapshotFiles::new(fs, dir) })
}

async fn receive_files<S, E>(
    fs: &dyn Vfs,
    stream: &mut S,
    dir: &Path,
    group: GroupId,
) -> Result<(), SnapshotTransferError>
where
    S: Stream<Item = Result<SnapshotChunk, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut open: HashMap<String, FileRef> = HashMap::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| SnapshotTransferError::Invalid(format!("stream failed: {e}")))?;
        if chunk.group_id != group {
            return Err(SnapshotTransferError::Invalid(format!(
                "chunk for group {} in group {group}",
                chunk.group_id
            )));
        }
        if chunk.done {
            for (name, f) in &open {
                f.sync_all().map_err(io_err("fsync", &dir.join(name)))?;
            }
            fs.sync_dir(dir).map_err(io_err("fsync", dir))?;
            return Ok(());
        }
        if !valid_file_name(&chunk.file_name) {
            return Err(SnapshotTransferError::Invalid(format!("file name {:?}", chunk.file_name)));
        }
        let end = chunk.file_offset.checked_add(chunk.data.len() as u64);
        if end.is_none_or(|e| e > RECEIVE_FILE_BYTES_MAX) {
            return Err(SnapshotTransferError::Invalid(format!(
                "chunk of {} at {} in {} is past the {RECEIVE_FILE_BYTES_MAX}-byte file limit",
                chunk.data.len(),
                chunk.file_offset,
                chunk.file_name
            )));
        }
        if !open.contains_key(&chunk.file_name) && open.len() >= RECEIVE_FILES_MAX {
            return Err(SnapshotTransferError::Invalid(format!("more than {RECEIVE_FILES_MAX} files")));
        }
        let path = dir.join(&chunk.file_name);
        let f = match open.entry(chunk.file_name.clone()) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(fs.open(&path, OpenMode::CreateTruncate).map_err(io_err("create", &path))?)
            }
        };
        f.write_all_at(&chunk.data, chunk.file_offset).map_err(io_err("write", &path))?;
    }
    Err(SnapshotTransferError::Invalid("stream ended before the final chunk".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolog_raft_store::types::{Vote, log_id};

    fn first(group: GroupId) -> SnapshotChunk {
        let meta = SnapshotMeta { last_log_id: Some(log_id(1, 1, 5)), last_membership: Default::default() };
        SnapshotChunk {
            group_id: group,
            target_node: 2,
            vote: Some(ferrolog_raft_store::wire::vote_to_wire(&Vote::new(1, 1))),
            meta: Some(ferrolog_raft_store::wire::snapshot_meta_to_wire(&meta)),
            ..SnapshotChunk::default()
        }
    }

    async fn run(chunks: Vec<SnapshotChunk>, root: &Path) -> Result<Received, SnapshotTransferError> {
        let stream = futures::stream::iter(chunks.into_iter().map(Ok::<_, std::io::Error>));
        let root = root.to_owned();
        receive(stream, move |g| (g == 9).then(|| (ferrolog_raft_store::vfs::real(), root.clone()))).await
    }

    fn data(name: &str, offset: u64, bytes: &[u8]) -> SnapshotChunk {
        SnapshotChunk {
            group_id: 9,
            file_name: name.into(),
            file_offset: offset,
            data: bytes.to_vec().into(),
            ..Default::default()
        }
    }

    #[test]
    fn clearing_staging_removes_what_a_cut_off_transfer_left() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("incoming-1")).unwrap();
        std::fs::write(root.path().join("incoming-1").join("a.seg"), b"partial").unwrap();
        std::fs::write(root.path().join("stray"), b"x").unwrap();
        clear_staging(&ferrolog_raft_store::RealFs, root.path()).unwrap();
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
        assert!(root.path().is_dir(), "the staging root itself stays");
    }

    #[tokio::test]
    async fn receives_files_and_refuses_a_peer_speaking_garbage() {
        let root = tempfile::tempdir().unwrap();
        let done = SnapshotChunk { group_id: 9, done: true, ..Default::default() };
        let ok = run(
            vec![first(9), data("a.seg", 0, b"hello "), data("a.seg", 6, b"world"), done.clone()],
            root.path(),
        )
        .await
        .unwrap();
        assert_eq!(std::fs::read(ok.files.dir.join("a.seg")).unwrap(), b"hello world");
        assert_eq!(ok.meta.last_log_id, Some(log_id(1, 1, 5)));

        let bad = [
            vec![first(9), data("../escape", 0, b"x"), done.clone()],
            vec![first(9), data("a/b", 0, b"x"), done.clone()],
            vec![first(9), data("a.seg", u64::MAX - 1, b"xyz"), done.clone()],
            vec![first(9), data("a.seg", RECEIVE_FILE_BYTES_MAX, b"x"), done.clone()],
            vec![first(9), data("a.seg", 0, b"x")],
            vec![first(8), done.clone()],
            vec![SnapshotChunk { meta: None, ..first(9) }, done.clone()],
            vec![SnapshotChunk { vote: None, ..first(9) }, done.clone()],
            // A membership whose voter has no address.
            vec![
                SnapshotChunk {
                    meta: Some(ferrolog_proto::raft::SnapshotMeta {
                        last_log_id: None,
                        last_membership: Some(ferrolog_proto::raft::StoredMembership {
                            log_id: None,
                            membership: Some(ferrolog_proto::raft::Membership {
                                configs: vec![ferrolog_proto::raft::VoterSet { voters: vec![7] }],
                                nodes: Vec::new(),
                            }),
                        }),
                    }),
                    ..first(9)
                },
                done.clone(),
            ],
            vec![],
        ];
        for (i, chunks) in bad.into_iter().enumerate() {
            assert!(run(chunks, root.path()).await.is_err(), "bad stream {i} accepted");
        }
        // Nothing but the accepted snapshot is left behind.
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }

    /// A reader over `files` (name, bytes) in a directory of an in-memory
    /// disk, `prefixes` sending some only up to a length.
    fn reader(files: &[(&str, Vec<u8>)], prefixes: &[(&str, u64)], manifest: &[u8]) -> ChunkReader {
        let fs: Fs = ferrolog_raft_store::FaultyFs::new(1).mount();
        let dir = PathBuf::from("/snap");
        fs.create_dir_all(&dir).unwrap();
        for (name, bytes) in files {
            let f = fs.open(&dir.join(name), OpenMode::CreateTruncate).unwrap();
            f.write_all_at(bytes, 0).unwrap();
        }
        let base = SnapshotChunk { group_id: 9, target_node: 2, ..SnapshotChunk::default() };
        let mut names: Vec<String> = files.iter().map(|(n, _)| (*n).to_owned()).collect();
        names.push(ferrolog_raft_store::snapshot::MANIFEST_FILE.to_owned());
        ChunkReader {
            fs,
            dir,
            prefixes: prefixes.iter().map(|(n, l)| ((*n).to_owned(), *l)).collect(),
            manifest: manifest.to_vec(),
            first: Some(first(9)),
            files: names.into(),
            file: None,
            base,
            ended: false,
        }
    }

    /// Every chunk the reader gives, as (file, offset, length, done).
    fn drain(mut r: ChunkReader) -> Vec<(String, u64, usize, bool)> {
        let mut out = Vec::new();
        while let Some(c) = r.next_chunk() {
            out.push((c.file_name, c.file_offset, c.data.len(), c.done));
            assert!(out.len() < 100, "the reader does not end");
        }
        assert!(r.next_chunk().is_none(), "a chunk after the end");
        out
    }

    #[test]
    fn the_chunk_reader_sends_each_file_in_chunks_up_to_its_prefix_then_done() {
        let big = vec![7u8; CHUNK_BYTES * 2 + 10];
        let got = drain(reader(
            &[("a.seg", big), ("b.seg", vec![1u8; 500]), ("empty.seg", Vec::new())],
            &[("b.seg", 100)],
            &vec![2u8; CHUNK_BYTES + 1],
        ));
        let m = ferrolog_raft_store::snapshot::MANIFEST_FILE.to_owned();
        let want = vec![
            (String::new(), 0, 0, false),
            ("a.seg".to_owned(), 0, CHUNK_BYTES, false),
            ("a.seg".to_owned(), CHUNK_BYTES as u64, CHUNK_BYTES, false),
            ("a.seg".to_owned(), 2 * CHUNK_BYTES as u64, 10, false),
            ("b.seg".to_owned(), 0, 100, false),
            (m.clone(), 0, CHUNK_BYTES, false),
            (m, CHUNK_BYTES as u64, 1, false),
            (String::new(), 0, 0, true),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn the_chunk_reader_ends_without_done_when_a_file_is_short_or_gone() {
        // Shorter than the manifest says.
        let got = drain(reader(&[("a.seg", vec![1u8; 50])], &[("a.seg", 100)], b"m"));
        assert_eq!(got.last().map(|c| (c.0.as_str(), c.1, c.2, c.3)), Some(("a.seg", 0, 50, false)));
        // Gone between the listing and the read.
        let mut r = reader(&[], &[], b"m");
        r.files.push_front("gone.seg".to_owned());
        let got = drain(r);
        assert_eq!(got.len(), 1, "only the opening chunk: {got:?}");
        assert!(!got.iter().any(|c| c.3), "no done mark");
        // An empty manifest sends no chunk of it, then done.
        let got = drain(reader(&[], &[], b""));
        assert_eq!(got, vec![(String::new(), 0, 0, false), (String::new(), 0, 0, true)]);
    }
}
