//! One segment file of a partition replica's log, with its sparse index.
//!
//! A segment holds consecutive Raft entries starting at `base_index`. The
//! active (last) segment is appended to; the others are sealed: fsynced, never
//! written again, and indexed by a `.idx` file written when they were sealed,
//! so opening a log scans only its active segment.

use std::path::{Path, PathBuf};
use std::sync::Arc;
// tokio's clock: the OS's monotonic clock, except in a simulation whose
// runtime pauses time (then it is the simulated time).
use tokio::time::Instant;

use bytes::Bytes;

use crate::error::{Result, StoreError};
use crate::format::{
    self, DecodeError, FRAME_HEADER_BYTES, FrameHeader, IndexEntry, SEGMENT_HEADER_BYTES, SealedSummary,
    SegmentHeader,
};
use crate::fsutil;
use crate::types::LogId;
use crate::vfs::{FileRef, Fs, OpenMode, VfsFile};

/// Bytes read per IO when walking frames.
const READ_CHUNK_BYTES: usize = 256 * 1024;
/// Granularity of the ranges [`Segment::take_cache_drop`] hands out,
/// bytes: at most one `posix_fadvise(2)` per MiB written.
pub const CACHE_DROP_STEP_BYTES: u64 = 1 << 20;
/// Most bytes one range of [`Segment::take_cache_drop`] covers beyond
/// its overlap: the flusher drops on its own thread between rounds, so a
/// backlog (the whole segment after a reopen) is worked off a bounded
/// piece per append.
pub const CACHE_DROP_MAX_BYTES: u64 = 64 << 20;
/// How far each range reaches back over the previous one, bytes: the
/// kernel keeps a cached folio (up to 2 MiB on ext4 and XFS with 4 KiB
/// pages; larger ones, on 64 KiB-page machines, may still straddle) that a
/// range covers only in part, so one straddling a boundary between two
/// ranges would otherwise stay.
pub const CACHE_DROP_OVERLAP_BYTES: u64 = 2 << 20;

/// File name of the segment whose first entry has Raft index `base_index`.
pub fn segment_file_name(base_index: u64) -> String {
    format!("{base_index:020}.seg")
}

/// Parses a segment file name back to its base index.
pub fn parse_segment_file_name(name: &str) -> Option<u64> {
    name.strip_suffix(".seg").filter(|s| s.len() == 20).and_then(|s| s.parse().ok())
}

/// One segment file and its in-memory sparse index.
#[derive(Debug)]
pub struct Segment {
    fs: Fs,
    path: PathBuf,
    file: FileRef,
    header: SegmentHeader,
    /// Length of the valid part of the file, bytes: where the next frame goes.
    size_bytes: u64,
    last_log_id: Option<LogId>,
    next_index: u64,
    next_offset: u64,
    max_timestamp_ms: i64,
    rows: Vec<IndexEntry>,
    bytes_since_row: u64,
    index_interval_bytes: u64,
    opened_at: Instant,
    sealed: bool,
    /// File position below which this segment's pages were asked to leave
    /// the page cache ([`Segment::take_cache_drop`]), bytes.
    cache_dropped_to: u64,
}

/// A read-only view of one segment, for reading frames without the log's
/// lock: the file stays open (and readable after a purge or a snapshot
/// removes it) while the view lives, and only the bytes written when it
/// was taken (`end`) are read. Frames at or below the high watermark never
/// change once written (Raft: committed entries are never overwritten,
/// §5.3); bytes past it may be truncated and rewritten meanwhile, so a
/// caller that reads up to the high watermark and meets a frame that does
/// not verify must retry under the lock before it reports corruption
/// (`crate::replica::Replica::read` does).
#[derive(Clone, Debug)]
pub struct SegmentReader {
    path: PathBuf,
    file: FileRef,
    end: u64,
    /// Whether reads yield the CPU between chunks ([`SegmentReader::sharing_cpu`]).
    share_cpu: bool,
}

impl SegmentReader {
    /// Reads verified frames from `position` (a frame boundary) while `keep`
    /// accepts them and the total stays within `max_bytes`. With
    /// `first_whole`, the first frame is returned even if it alone exceeds
    /// `max_bytes` (so a consumer always makes progress, KIP-74). Each frame
    /// comes back as its header and its exact bytes, sliced without copying
    /// from the read buffer. The flag says whether the read stopped at the
    /// end of the segment (rather than at the budget or at `keep`).
    ///
    /// # Errors
    /// [`StoreError::Corruption`] for a frame that does not verify;
    /// [`StoreError::Io`].
    pub fn read_frames(
        &self,
        position: u64,
        max_bytes: usize,
        first_whole: bool,
        keep: impl FnMut(&FrameHeader) -> bool,
    ) -> Result<(Vec<(FrameHeader, Bytes)>, bool)> {
        let cursor = FrameCursor::new(position, self.end, self.share_cpu);
        read_frames(cursor, &*self.file, &self.path, max_bytes, first_whole, keep)
    }

    /// This view, reading with yields of the CPU between chunks (see
    /// `FrameCursor::share_cpu`). Only for reads made without the log's
    /// lock: a yield holding it would hold up the appends that need it.
    /// (Compaction's key map reads this way holding only the replica's
    /// compaction flag, which others only try to take.)
    pub fn sharing_cpu(mut self) -> Self {
        self.share_cpu = true;
        self
    }

    /// Bytes of the segment from `position` to the end of the view.
    pub fn bytes_from(&self, position: u64) -> u64 {
        self.end.saturating_sub(position)
    }

    /// The segment file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the whole view back from the file and verifies it: the
    /// segment header, then every frame's CRC32C and that it continues the
    /// one before (index and offset: a frame written in the wrong place
    /// passes its checksum), `chunk_bytes` at a time
    /// (at least one frame per read), calling `after_chunk` with each
    /// read's bytes (a throttle may sleep in it). Returns the bytes
    /// verified. Used by a background scrub to find bit rot in sealed
    /// segments nobody reads; the reads go through the OS page cache, so
    /// rot under a cached page shows once the kernel has evicted it.
    /// Blocking file IO.
    ///
    /// # Errors
    /// [`StoreError::Corruption`] with the position of the header or frame
    /// that does not verify; [`StoreError::Io`].
    pub fn verify(&self, chunk_bytes: usize, after_chunk: &mut dyn FnMut(u64)) -> Result<u64> {
        let head = fsutil::read_up_to(&*self.file, &self.path, 0, SEGMENT_HEADER_BYTES)?;
        let header = SegmentHeader::decode(&head).map_err(|source| StoreError::Corruption {
            path: self.path.clone(),
            position: 0,
            source,
        })?;
        let mut position = SEGMENT_HEADER_BYTES as u64;
        let mut verified = position;
        let (mut next_index, mut next_offset) = (header.base_index, header.base_offset);
        after_chunk(position);
        while position < self.end {
            let (frames, _) = self.read_frames(position, chunk_bytes, true, |_| true)?;
            let mut at = position;
            for (h, _) in &frames {
                check_continues(&self.path, h, at, next_index, next_offset)?;
                (next_index, next_offset) = (h.index() + 1, h.next_offset());
                at += h.frame_bytes as u64;
            }
            let read = at - position;
            if read == 0 {
                // A view ends on a frame boundary; bytes that hold no
                // whole frame before its end are not a log.
                return Err(StoreError::Corruption {
                    path: self.path.clone(),
                    position,
                    source: DecodeError::Invalid {
                        field: "segment length",
                        detail: format!("{} bytes at the end hold no whole frame", self.end - position),
                    },
                });
            }
            position += read;
            verified += read;
            after_chunk(read);
        }
        Ok(verified)
    }
}

/// See [`SegmentReader::read_frames`]; `end` is the length to read up to.
fn read_frames(
    mut cursor: FrameCursor,
    file: &dyn VfsFile,
    path: &Path,
    max_bytes: usize,
    first_whole: bool,
    mut keep: impl FnMut(&FrameHeader) -> bool,
) -> Result<(Vec<(FrameHeader, Bytes)>, bool)> {
    let mut out = Vec::new();
    let mut total = 0usize;
    let end = cursor.end;
    loop {
        let at = cursor.position;
        match cursor.next(file, path)? {
            None => return Ok((out, true)),
            Some(Ok((h, bytes))) => {
                let oversize = total + h.frame_bytes > max_bytes && !(first_whole && out.is_empty());
                if !keep(&h) || oversize {
                    return Ok((out, false));
                }
                total += h.frame_bytes;
                out.push((h, bytes));
                if total >= max_bytes {
                    let at_end = cursor.position >= end;
                    return Ok((out, at_end));
                }
            }
            Some(Err(source)) => {
                return Err(StoreError::Corruption { path: path.to_owned(), position: at, source });
            }
        }
    }
}

/// Checks that frame `h`, at `position` of the segment at `path`, is entry
/// `want_index` with offset `want_offset`: a frame that verifies but does
/// not continue the log (written in the wrong place) is corruption.
fn check_continues(
    path: &Path,
    h: &FrameHeader,
    position: u64,
    want_index: u64,
    want_offset: u64,
) -> Result<()> {
    if h.index() != want_index || h.base_offset != want_offset {
        return Err(StoreError::Corruption {
            path: path.to_owned(),
            position,
            source: DecodeError::Invalid {
                field: "log continuity",
                detail: format!(
                    "frame has index {} offset {}, expected index {want_index} offset {want_offset}",
                    h.index(),
                    h.base_offset
                ),
            },
        });
    }
    Ok(())
}

/// How a scan treats a frame that does not verify.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OnBadFrame {
    /// Report corruption (sealed segments, and data before the tail).
    Fail,
    /// Stop there and report the position, so the caller can cut a torn tail.
    Stop,
}

impl Segment {
    /// Creates an empty segment file whose first entry will be `base_index`
    /// with offset `base_offset`, durably (file and directory fsynced).
    ///
    /// # Errors
    /// [`StoreError::Io`] if the file cannot be created or synced.
    pub fn create(
        fs: &Fs,
        dir: &Path,
        base_index: u64,
        base_offset: u64,
        index_interval_bytes: u64,
    ) -> Result<Self> {
        let path = dir.join(segment_file_name(base_index));
        let file = fs
            .open(&path, OpenMode::CreateTruncate)
            .map_err(|e| StoreError::io("create segment", &path, e))?;
        let header = SegmentHeader { base_index, base_offset };
        file.write_all_at(&header.encode(), 0).map_err(|e| StoreError::io("write", &path, e))?;
        file.sync_data().map_err(|e| StoreError::io("fsync", &path, e))?;
        fsutil::sync_dir(&**fs, dir)?;
        Ok(Self::empty(fs.clone(), path, file, header, index_interval_bytes))
    }

    fn empty(fs: Fs, path: PathBuf, file: FileRef, header: SegmentHeader, index_interval_bytes: u64) -> Self {
        Self {
            fs,
            path,
            file,
            header,
            size_bytes: SEGMENT_HEADER_BYTES as u64,
            last_log_id: None,
            next_index: header.base_index,
            next_offset: header.base_offset,
            max_timestamp_ms: i64::MIN,
            rows: Vec::new(),
            bytes_since_row: 0,
            index_interval_bytes,
            opened_at: Instant::now(),
            sealed: false,
            cache_dropped_to: 0,
        }
    }

    /// Opens an existing segment. A sealed segment is loaded from its index
    /// file when that is intact (and `rescan` is false), otherwise scanned
    /// with every frame verified. The tail segment (`is_tail`) is always
    /// scanned; a frame that does not verify ends it, and the returned
    /// position is where the torn tail starts (the caller cuts it with
    /// [`Segment::truncate_at`]).
    ///
    /// # Errors
    /// [`StoreError::Corruption`] for a bad header, for any bad frame in a
    /// sealed segment, for a bad frame in the tail followed by valid ones, or
    /// for a frame that verifies but does not continue the log (wrong index
    /// or offset); its position is where the valid prefix ends.
    /// [`StoreError::Io`] for IO failures.
    pub fn open(
        fs: &Fs,
        path: &Path,
        is_tail: bool,
        rescan: bool,
        index_interval_bytes: u64,
    ) -> Result<(Self, Option<u64>)> {
        let mode = if is_tail { OpenMode::ReadWrite } else { OpenMode::Read };
        let file = fs.open(path, mode).map_err(|e| StoreError::io("open segment", path, e))?;
        let head = fsutil::read_up_to(&*file, path, 0, SEGMENT_HEADER_BYTES)?;
        let header = SegmentHeader::decode(&head).map_err(|source| StoreError::Corruption {
            path: path.to_owned(),
            position: 0,
            source,
        })?;
        let file_len = file.len().map_err(|e| StoreError::io("stat", path, e))?;
        let mut seg = Self::empty(fs.clone(), path.to_owned(), file, header, index_interval_bytes);
        if !is_tail {
            seg.sealed = true;
            if !rescan && seg.load_index(file_len) {
                return Ok((seg, None));
            }
        }
        let policy = if is_tail { OnBadFrame::Stop } else { OnBadFrame::Fail };
        let cut = seg.scan(file_len, policy)?;
        Ok((seg, cut))
    }

    fn index_path(&self) -> PathBuf {
        self.path.with_extension("idx")
    }

    /// Loads the index file if it exists, verifies and matches this file.
    fn load_index(&mut self, file_len: u64) -> bool {
        let Ok(bytes) = fsutil::read(&*self.fs, &self.index_path()) else { return false };
        let Ok((summary, rows)) = format::decode_index(&bytes) else {
            tracing::warn!(path = %self.index_path().display(), "index file does not verify; rescanning segment");
            return false;
        };
        if summary.size_bytes != file_len || rows.first().is_none_or(|r| r.index != self.header.base_index) {
            tracing::warn!(path = %self.index_path().display(), "index file does not match segment; rescanning");
            return false;
        }
        self.size_bytes = summary.size_bytes;
        self.last_log_id = Some(summary.last_log_id);
        self.next_index = summary.last_log_id.index + 1;
        self.next_offset = summary.next_offset;
        self.max_timestamp_ms = summary.max_timestamp_ms;
        self.rows = rows;
        true
    }

    /// Walks frames from the current end (`size_bytes`) to `file_len`,
    /// verifying each and indexing it.
    fn scan(&mut self, file_len: u64, policy: OnBadFrame) -> Result<Option<u64>> {
        let mut cursor = FrameCursor::new(self.size_bytes, file_len, false);
        loop {
            let position = cursor.position;
            match cursor.next(&*self.file, &self.path)? {
                None => return Ok(None),
                Some(Ok((h, _))) => {
                    self.check_continues(&h, position)?;
                    self.note_frame(&h, position);
                    self.size_bytes = position + h.frame_bytes as u64;
                }
                Some(Err(source)) => {
                    if policy == OnBadFrame::Fail {
                        return Err(StoreError::Corruption { path: self.path.clone(), position, source });
                    }
                    // A torn write is the end of what was written. A valid
                    // frame that continues the log after the bad one means
                    // the bad one was damaged after it was written: refuse
                    // rather than cut acknowledged entries away.
                    if let Some(later) = self.later_valid_frame(position + 1, file_len)? {
                        tracing::error!(path = %self.path.display(), position, later, "damaged frame before valid ones");
                        return Err(StoreError::Corruption { path: self.path.clone(), position, source });
                    }
                    // So is a last frame whose every byte is there but
                    // whose checksum fails: a write cut short by a crash
                    // leaves fewer bytes than the frame says it holds, bit
                    // rot leaves them all. The frame may have been
                    // acknowledged (the recorded flushed index can lag the
                    // last fsync), so it is damage, not a torn tail: the
                    // replica keeps the prefix and does not vote until it
                    // has caught up. (A disk that tears a write inside a
                    // sector it had already extended the file over looks
                    // the same; treating it as damage costs only that wait.)
                    if let DecodeError::Checksum { .. } = source {
                        tracing::error!(path = %self.path.display(), position, "last frame complete but damaged");
                        return Err(StoreError::Corruption { path: self.path.clone(), position, source });
                    }
                    return Ok(Some(position));
                }
            }
        }
    }

    /// Position of a verified frame at or after `from` whose index is past
    /// the last good entry, searching byte by byte (recovery only).
    fn later_valid_frame(&self, from: u64, end: u64) -> Result<Option<u64>> {
        const WINDOW: usize = 4 << 20;
        let min_index = self.next_index();
        let mut start = from;
        while start + (FRAME_HEADER_BYTES as u64) <= end {
            let window =
                fsutil::read_up_to(&*self.file, &self.path, start, WINDOW.min((end - start) as usize))?;
            let last_candidate = window.len().saturating_sub(FRAME_HEADER_BYTES);
            for k in 0..=last_candidate {
                let b = &window[k..];
                // Cheap filters before reading a whole frame: a known kind,
                // zero reserved bytes, a plausible length and index.
                if format::FrameKind::from_u8(b[8]).is_none() || b[9] != 0 || b[10] != 0 || b[11] != 0 {
                    continue;
                }
                let Ok(len) = format::frame_len(b) else { continue };
                let index = u64::from_le_bytes(b[28..36].try_into().unwrap_or([0; 8]));
                let at = start + k as u64;
                if index < min_index || at + len as u64 > end {
                    continue;
                }
                let frame = fsutil::read_up_to(&*self.file, &self.path, at, len)?;
                if format::decode_frame_header(&frame).is_ok() {
                    return Ok(Some(at));
                }
            }
            start += (last_candidate + 1) as u64;
        }
        Ok(None)
    }

    fn check_continues(&self, h: &FrameHeader, position: u64) -> Result<()> {
        check_continues(&self.path, h, position, self.next_index(), self.next_offset)
    }

    fn note_frame(&mut self, h: &FrameHeader, position: u64) {
        if self.rows.is_empty() || self.bytes_since_row >= self.index_interval_bytes {
            self.rows.push(IndexEntry {
                index: h.index(),
                offset: h.base_offset,
                position,
                max_timestamp_before_ms: self.max_timestamp_ms,
            });
            self.bytes_since_row = 0;
        }
        self.bytes_since_row += h.frame_bytes as u64;
        self.last_log_id = Some(h.log_id);
        self.next_index = h.index() + 1;
        self.next_offset = h.next_offset();
        if h.record_count > 0 {
            self.max_timestamp_ms = self.max_timestamp_ms.max(h.max_timestamp_ms);
        }
    }

    /// Appends encoded frames (`frames` holds them back to back, described
    /// by `headers`) with one positional write. Not durable until
    /// [`Segment::sync`] or the flusher syncs the file.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] if the segment is sealed or the frames do not
    /// continue the log; [`StoreError::Io`] if the write fails (the segment
    /// is then truncated back, so a retry starts from a clean end).
    pub fn append(&mut self, frames: &[u8], headers: &[FrameHeader]) -> Result<()> {
        if self.sealed {
            return Err(StoreError::Invalid(format!("append to sealed segment {}", self.path.display())));
        }
        let start = self.size_bytes;
        if let Err(e) = self.file.write_all_at(frames, start) {
            let _ = self.file.set_len(start);
            return Err(StoreError::io("write", &self.path, e));
        }
        let mut position = start;
        for h in headers {
            self.note_frame(h, position);
            position += h.frame_bytes as u64;
        }
        self.size_bytes = position;
        Ok(())
    }

    /// Cuts the file at `position` (a frame boundary) and fsyncs it, then
    /// rebuilds the in-memory state of what remains.
    ///
    /// With `spare_links`, a file a snapshot also links is not cut in
    /// place but replaced by a copy of what stays ([`fsutil::cut_file`]):
    /// for a cut that may go below a snapshot's prefix. Without, the cut is
    /// in place: the caller knows it is above every snapshot's prefix (a
    /// Raft truncation above the commit index; a torn tail, which lies past
    /// what was fsynced, and a snapshot's prefix is fsynced before it is
    /// linked).
    ///
    /// # Errors
    /// [`StoreError::Io`] on IO failure, [`StoreError::Corruption`] if the
    /// remaining frames do not verify.
    pub fn truncate_at(&mut self, position: u64, spare_links: bool) -> Result<()> {
        let position = position.max(SEGMENT_HEADER_BYTES as u64);
        if self.sealed {
            self.sealed = false;
            fsutil::remove_if_exists(&*self.fs, &self.index_path())?;
        }
        self.file = if spare_links {
            fsutil::cut_file(&*self.fs, &self.path, position)?
        } else {
            let f = self
                .fs
                .open(&self.path, OpenMode::ReadWrite)
                .map_err(|e| StoreError::io("reopen segment", &self.path, e))?;
            f.set_len(position).map_err(|e| StoreError::io("truncate", &self.path, e))?;
            f.sync_data().map_err(|e| StoreError::io("fsync", &self.path, e))?;
            f
        };
        // A file cut in place keeps its dropped range below the cut; a copy
        // (written through the page cache, and fsynced) starts over.
        self.cache_dropped_to = if spare_links {
            0
        } else {
            self.cache_dropped_to.min(position / CACHE_DROP_STEP_BYTES * CACHE_DROP_STEP_BYTES)
        };
        // Restart the in-memory state from the last index row before the cut.
        self.rows.retain(|r| r.position < position);
        match self.rows.pop() {
            Some(r) => {
                self.size_bytes = r.position;
                self.next_index = r.index;
                self.next_offset = r.offset;
                self.max_timestamp_ms = r.max_timestamp_before_ms;
            }
            None => {
                self.size_bytes = SEGMENT_HEADER_BYTES as u64;
                self.next_index = self.header.base_index;
                self.next_offset = self.header.base_offset;
                self.max_timestamp_ms = i64::MIN;
            }
        }
        self.bytes_since_row = self.index_interval_bytes;
        self.last_log_id = None;
        self.scan(position, OnBadFrame::Fail)?;
        if self.last_log_id.is_none() {
            // Empty now: the last entry before it is in an earlier segment.
            self.bytes_since_row = 0;
        }
        Ok(())
    }

    /// Byte position where the entry with Raft index `index` starts, or the
    /// end of the segment if `index` is one past its last entry.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] if the index is outside the segment;
    /// [`StoreError::Corruption`] if a frame on the way does not verify.
    pub fn position_of_index(&self, index: u64) -> Result<u64> {
        if index < self.header.base_index || index > self.next_index() {
            return Err(StoreError::Invalid(format!("index {index} not in segment {}", self.path.display())));
        }
        if index == self.next_index() {
            return Ok(self.size_bytes);
        }
        let row = self.rows.partition_point(|r| r.index <= index).saturating_sub(1);
        self.walk_headers(self.rows[row].position, |h| h.index() >= index)
    }

    /// Byte position of the first entry holding an offset ≥ `offset` (the
    /// batch containing `offset`, or the next one), or the segment end.
    ///
    /// # Errors
    /// [`StoreError::Corruption`] if a frame on the way does not verify.
    pub fn position_of_offset(&self, offset: u64) -> Result<u64> {
        let row = self.rows.partition_point(|r| r.offset <= offset).saturating_sub(1);
        let start = self.rows.get(row).map_or(self.size_bytes, |r| r.position);
        self.walk_headers(start, |h| h.record_count > 0 && h.next_offset() > offset)
    }

    /// Byte position of the first record batch whose largest timestamp is ≥
    /// `timestamp_ms` (Kafka's ListOffsets by time, KIP-79), or the end.
    ///
    /// # Errors
    /// [`StoreError::Corruption`] if a frame on the way does not verify.
    pub fn position_of_timestamp(&self, timestamp_ms: i64) -> Result<u64> {
        let row = self.rows.partition_point(|r| r.max_timestamp_before_ms < timestamp_ms).saturating_sub(1);
        let start = self.rows.get(row).map_or(self.size_bytes, |r| r.position);
        self.walk_headers(start, |h| h.record_count > 0 && h.max_timestamp_ms >= timestamp_ms)
    }

    /// Walks verified frames from `position` until `stop` holds for one;
    /// returns its position, or the segment end. Bounded by one index
    /// interval plus one frame in the common case.
    fn walk_headers(&self, position: u64, stop: impl Fn(&FrameHeader) -> bool) -> Result<u64> {
        let mut cursor = FrameCursor::new(position, self.size_bytes, false);
        loop {
            let at = cursor.position;
            match cursor.next(&*self.file, &self.path)? {
                None => return Ok(self.size_bytes),
                Some(Ok((h, _))) if stop(&h) => return Ok(at),
                Some(Ok(_)) => {}
                Some(Err(source)) => {
                    return Err(StoreError::Corruption { path: self.path.clone(), position: at, source });
                }
            }
        }
    }

    /// Reads verified frames from `position`; see [`SegmentReader::read_frames`].
    ///
    /// # Errors
    /// [`StoreError::Corruption`] for a frame that does not verify.
    pub fn read_frames(
        &self,
        position: u64,
        max_bytes: usize,
        first_whole: bool,
        keep: impl FnMut(&FrameHeader) -> bool,
    ) -> Result<(Vec<(FrameHeader, Bytes)>, bool)> {
        let cursor = FrameCursor::new(position, self.size_bytes, false);
        read_frames(cursor, &*self.file, &self.path, max_bytes, first_whole, keep)
    }

    /// What a read of this segment needs, as it is now: the open file and
    /// the length written so far. Taken under the log's lock and used
    /// without it (see [`SegmentReader`]).
    pub fn reader(&self) -> SegmentReader {
        self.reader_to(self.size_bytes)
    }

    /// As [`Segment::reader`], reading only up to byte `end` (a frame
    /// boundary; at most the length written so far).
    pub fn reader_to(&self, end: u64) -> SegmentReader {
        SegmentReader {
            path: self.path.clone(),
            file: Arc::clone(&self.file),
            end: end.min(self.size_bytes),
            share_cpu: false,
        }
    }

    /// Whether `reader` reads this segment as it is now: the same open file
    /// (not a copy put in its place), at least as long as the reader's view.
    pub fn still_read_by(&self, reader: &SegmentReader) -> bool {
        Arc::ptr_eq(&self.file, &reader.file) && self.size_bytes >= reader.end
    }

    /// fsyncs the segment's data.
    ///
    /// # Errors
    /// [`StoreError::Io`] if fsync fails.
    pub fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(|e| StoreError::io("fsync", &self.path, e))
    }

    /// Seals a segment written whole elsewhere (a compacted copy at a
    /// temporary path, its data already fsynced): writes its index to
    /// `index_tmp` and fsyncs it, so that putting both in place
    /// ([`Segment::moved_to`] after the renames) needs no further file
    /// sync, only the directory's. Done before the log's lock is taken.
    ///
    /// # Errors
    /// [`StoreError::Io`] on IO failure; [`StoreError::Invalid`] if empty.
    pub(crate) fn seal_to(&mut self, index_tmp: &Path) -> Result<()> {
        let Some(last_log_id) = self.last_log_id else {
            return Err(StoreError::Invalid(format!("cannot seal empty segment {}", self.path.display())));
        };
        let summary = SealedSummary {
            size_bytes: self.size_bytes,
            last_log_id,
            next_offset: self.next_offset,
            max_timestamp_ms: self.max_timestamp_ms,
        };
        fsutil::write_synced(&*self.fs, index_tmp, &format::encode_index(&summary, &self.rows))?;
        self.sealed = true;
        Ok(())
    }

    /// Seals the segment: fsyncs it and writes its index file durably.
    ///
    /// # Errors
    /// [`StoreError::Io`] on IO failure; [`StoreError::Invalid`] if empty.
    pub fn seal(&mut self) -> Result<()> {
        let Some(last_log_id) = self.last_log_id else {
            return Err(StoreError::Invalid(format!("cannot seal empty segment {}", self.path.display())));
        };
        self.sync()?;
        let summary = SealedSummary {
            size_bytes: self.size_bytes,
            last_log_id,
            next_offset: self.next_offset,
            max_timestamp_ms: self.max_timestamp_ms,
        };
        fsutil::write_durable(&*self.fs, &self.index_path(), &format::encode_index(&summary, &self.rows))?;
        self.sealed = true;
        Ok(())
    }

    /// Records that the file was renamed to `path` (a compacted copy put in
    /// place of the original; see [`crate::compaction`]).
    pub(crate) fn moved_to(&mut self, path: PathBuf) {
        self.path = path;
    }

    /// Deletes the segment's files.
    ///
    /// # Errors
    /// [`StoreError::Io`] if a file cannot be removed.
    pub fn delete(self) -> Result<()> {
        fsutil::remove_if_exists(&*self.fs, &self.index_path())?;
        fsutil::remove_if_exists(&*self.fs, &self.path)
    }

    /// Raft index of the segment's first entry.
    pub fn base_index(&self) -> u64 {
        self.header.base_index
    }
    /// Offset of the segment's first record.
    pub fn base_offset(&self) -> u64 {
        self.header.base_offset
    }
    /// Raft index the next appended entry must have.
    pub fn next_index(&self) -> u64 {
        self.next_index
    }
    /// Offset the next record will get.
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }
    /// Log id of the last entry, if any.
    pub fn last_log_id(&self) -> Option<LogId> {
        self.last_log_id
    }
    /// Valid length of the file, bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
    /// Largest record timestamp in the segment, ms (i64::MIN if none).
    pub fn max_timestamp_ms(&self) -> i64 {
        self.max_timestamp_ms
    }
    /// Whether the segment is sealed (read-only, indexed on disk).
    pub fn is_sealed(&self) -> bool {
        self.sealed
    }
    /// Whether no entry is stored.
    pub fn is_empty(&self) -> bool {
        self.last_log_id.is_none()
    }
    /// Time since the segment was opened or created.
    pub fn age(&self) -> std::time::Duration {
        self.opened_at.elapsed()
    }
    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The open file, shared with the flusher.
    pub fn file(&self) -> &FileRef {
        &self.file
    }

    /// The bytes of the file (offset, length) that may leave the OS page
    /// cache once what is written now is fsynced: from where the last such
    /// range ended (less [`CACHE_DROP_OVERLAP_BYTES`]) up to `behind`
    /// bytes before the end of the written data, at most
    /// [`CACHE_DROP_MAX_BYTES`] past where the last one ended; both ends at
    /// multiples of [`CACHE_DROP_STEP_BYTES`], so whole pages of any page
    /// size up to it. `None` when `behind` is 0 (never drop) or no whole
    /// step lies between. Every byte named was written before the call.
    pub fn take_cache_drop(&mut self, behind: u64) -> Option<(u64, u64)> {
        if behind == 0 {
            return None;
        }
        let step = CACHE_DROP_STEP_BYTES;
        let end = self.size_bytes.saturating_sub(behind) / step * step;
        let done = self.cache_dropped_to;
        if end <= done {
            return None;
        }
        debug_assert_eq!(done % step, 0, "drop ranges end at whole steps");
        let to = end.min(done + CACHE_DROP_MAX_BYTES);
        let from = done.saturating_sub(CACHE_DROP_OVERLAP_BYTES);
        assert!(to <= self.size_bytes, "a drop range past the written data");
        self.cache_dropped_to = to;
        Some((from, to - from))
    }
}

/// Reads frames sequentially in large chunks, verifying each.
struct FrameCursor {
    position: u64,
    end: u64,
    buf: Bytes,
    buf_start: u64,
    /// Whether the cursor yields its thread's CPU (`sched_yield(2)`) before each
    /// read after its first, i.e. every [`READ_CHUNK_BYTES`] (a larger
    /// frame is one read, with no yield inside it; each segment of a plan
    /// has a cursor of its own, which does not yield before its first
    /// read): a long read
    /// of cached pages never blocks, so the scheduler lets it run its whole
    /// slice, and a thread woken meanwhile on the same CPU waits behind it.
    /// Measured (`perf sched timehist`, `ferrolog-bench contention`, Linux
    /// 6.18, 2 vCPUs): a Raft worker thread waited 4.2 ms behind a 16 MiB
    /// fetch's read while the other CPU was idle. With answers cut to one
    /// byte of records (a probe build, to see the reads alone), yielding
    /// between chunks took the fetch loop's cost to one-in-flight appends'
    /// p99 from +3.2–3.6 ms to +1.0–1.4 ms.
    share_cpu: bool,
}

impl FrameCursor {
    fn new(position: u64, end: u64, share_cpu: bool) -> Self {
        Self { position, end, buf: Bytes::new(), buf_start: position, share_cpu }
    }

    /// Next frame: `None` at the end, `Some(Err)` for a frame that does not
    /// verify (or is cut short by the end), `Err` for an IO failure.
    #[allow(clippy::type_complexity)]
    fn next(
        &mut self,
        file: &dyn VfsFile,
        path: &Path,
    ) -> Result<Option<std::result::Result<(FrameHeader, Bytes), DecodeError>>> {
        if self.position >= self.end {
            return Ok(None);
        }
        let remaining = (self.end - self.position) as usize;
        let mut have = self.available();
        if have.len() < FRAME_HEADER_BYTES.min(remaining) {
            self.fill(file, path, READ_CHUNK_BYTES)?;
            have = self.available();
        }
        let len = match format::frame_len(&have) {
            Ok(l) => l,
            Err(e) => return Ok(Some(Err(e))),
        };
        if have.len() < len && remaining >= len {
            self.fill(file, path, len.max(READ_CHUNK_BYTES))?;
            have = self.available();
        }
        let have = &have[..have.len().min(remaining)];
        match format::decode_frame_header(have) {
            Ok(h) => {
                let off = (self.position - self.buf_start) as usize;
                let bytes = self.buf.slice(off..off + h.frame_bytes);
                self.position += h.frame_bytes as u64;
                Ok(Some(Ok((h, bytes))))
            }
            Err(e) => Ok(Some(Err(e))),
        }
    }

    fn available(&self) -> Bytes {
        let skip = (self.position - self.buf_start) as usize;
        if skip >= self.buf.len() { Bytes::new() } else { self.buf.slice(skip..) }
    }

    fn fill(&mut self, file: &dyn VfsFile, path: &Path, want: usize) -> Result<()> {
        let len = want.min((self.end - self.position) as usize);
        if self.share_cpu && !self.buf.is_empty() {
            std::thread::yield_now();
        }
        self.buf = Bytes::from(fsutil::read_up_to(file, path, self.position, len)?);
        self.buf_start = self.position;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::vfs::FaultyFs;

    const MIB: u64 = 1 << 20;

    /// An empty segment on an in-memory disk, its size then set by hand
    /// (the ranges depend on nothing else).
    fn segment() -> Segment {
        let fs: Fs = FaultyFs::new(3).mount();
        fs.create_dir_all(Path::new("/log")).expect("dir");
        Segment::create(&fs, Path::new("/log"), 0, 0, 4096).expect("create")
    }

    #[test]
    fn cache_drop_ranges_are_whole_mib_bounded_and_overlapping() {
        let mut s = segment();
        assert_eq!(s.take_cache_drop(0), None, "0 never drops");
        s.size_bytes = 10 * MIB;
        assert_eq!(s.take_cache_drop(64 * MIB), None, "a distance larger than the file drops nothing");
        // 10 MiB written, 2 MiB kept: [0, 8 MiB).
        assert_eq!(s.take_cache_drop(2 * MIB), Some((0, 8 * MIB)));
        // Less than a whole MiB more: nothing.
        s.size_bytes = 10 * MIB + MIB / 2;
        assert_eq!(s.take_cache_drop(2 * MIB), None);
        // Next range reaches 2 MiB back over the last one.
        s.size_bytes = 13 * MIB + 5;
        assert_eq!(s.take_cache_drop(2 * MIB), Some((6 * MIB, 5 * MIB)));
        // A backlog is worked off at most 64 MiB past the last range a call.
        s.size_bytes = 300 * MIB;
        assert_eq!(s.take_cache_drop(2 * MIB), Some((9 * MIB, 66 * MIB)));
        assert_eq!(s.take_cache_drop(2 * MIB), Some((73 * MIB, 66 * MIB)));
    }

    #[test]
    fn a_cut_moves_the_dropped_mark_back_and_a_copy_starts_over() {
        let mut s = segment();
        s.size_bytes = 40 * MIB;
        assert_eq!(s.take_cache_drop(MIB), Some((0, 39 * MIB)));
        // Cut in place below the mark (to the header: the file holds no
        // frames to verify), then written again: drops start over below.
        s.truncate_at(SEGMENT_HEADER_BYTES as u64, false).expect("cut");
        assert_eq!(s.cache_dropped_to, 0);
        s.size_bytes = 30 * MIB;
        assert_eq!(s.take_cache_drop(MIB), Some((0, 29 * MIB)));
        // A cut that copies the file starts over whatever the cut.
        s.truncate_at(SEGMENT_HEADER_BYTES as u64, true).expect("cut by copy");
        assert_eq!(s.cache_dropped_to, 0);
    }
}
