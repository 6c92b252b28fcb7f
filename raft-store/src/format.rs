//! The on-disk format, as pure functions over byte slices: segment file
//! headers, entry frames, and sealed-segment index files. No IO here.
//!
//! ```text
//! segment file  = segment header (40 B) , frame*
//! segment header= magic "FLOGSEG\0" (8) | version u32 | flags u32 | base index u64
//!                 | base offset u64 | crc32c u32 (of the 32 bytes before) | zero u32
//! frame         = frame_len u32 (bytes after this field)
//!                 | crc32c u32 (Castagnoli, over every byte after this field)
//!                 | kind u8 | attrs u8 | reserved u16
//!                 | term u64 | leader node u64 | index u64
//!                 | base offset u64 | record count u32
//!                 | first timestamp ms i64 | max timestamp ms i64
//!                 | producer id i64 | producer epoch i16 | base sequence i32 | reserved u16
//!                 | payload (records, membership as protobuf, or nothing)
//! ```
//! All integers are little-endian. A frame carries its full Raft log id, so
//! any copy of a segment (a replica's, a snapshot's) is self-describing.

use bytes::Bytes;

use crate::batch::RecordBatch;
use crate::types::{Entry, EntryPayload, LogId, Membership, log_id};

/// Magic bytes at the start of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"FLOGSEG\0";
/// Magic bytes at the start of every sealed-segment index file.
pub const INDEX_MAGIC: [u8; 8] = *b"FLOGIDX\0";
/// Current on-disk format version of segment and index files.
pub const FORMAT_VERSION: u32 = 1;
/// Length of a segment file header, bytes.
pub const SEGMENT_HEADER_BYTES: usize = 40;
/// Length of a frame's fixed header, bytes (the two leading u32 included).
pub const FRAME_HEADER_BYTES: usize = 80;
/// Largest frame the decoder accepts, bytes. Anything larger is treated as
/// garbage, so a corrupt length can never make us allocate gigabytes.
pub const FRAME_BYTES_MAX: usize = 256 * 1024 * 1024;

/// Kind byte of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A leader's blank entry (Raft paper §8); occupies no offset.
    Blank = 1,
    /// A record batch; occupies `record_count` offsets.
    Records = 2,
    /// A membership change written before Ferrolog had its own peer
    /// protocol: the payload is the Raft library's JSON. Still read; never
    /// written.
    MembershipJson = 3,
    /// A membership change; occupies no offset. The payload is the
    /// protobuf `ferrolog.raft.v1.Membership` ([`crate::wire`]).
    Membership = 4,
    /// A leader's control decision ([`crate::batch::Control`]); occupies
    /// no offset. The payload is the control's encoding (a tag byte, then
    /// its fields little-endian). Peer protocol 1.9 and later.
    Control = 5,
}

impl FrameKind {
    /// The kind a frame's kind byte names; `None` for an unknown byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Blank),
            2 => Some(Self::Records),
            3 => Some(Self::MembershipJson),
            4 => Some(Self::Membership),
            5 => Some(Self::Control),
            _ => None,
        }
    }
}

/// Why bytes could not be decoded. Positions are relative to the slice given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the structure needs: a torn write at a file's tail,
    /// or a read that stopped short.
    #[error("truncated: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes the structure needs.
        needed: usize,
        /// Bytes available.
        available: usize,
    },
    /// The stored checksum does not match the bytes.
    #[error("crc32c mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// Checksum stored on disk.
        stored: u32,
        /// Checksum computed over the bytes read.
        computed: u32,
    },
    /// A field holds a value the format does not allow.
    #[error("invalid {field}: {detail}")]
    Invalid {
        /// Name of the field.
        field: &'static str,
        /// What was wrong.
        detail: String,
    },
}

fn invalid(field: &'static str, detail: impl Into<String>) -> DecodeError {
    DecodeError::Invalid { field, detail: detail.into() }
}

/// The parsed header of a segment file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Raft index of the first entry the segment holds (or will hold).
    pub base_index: u64,
    /// Offset of the first record the segment holds (or will hold).
    pub base_offset: u64,
}

impl SegmentHeader {
    /// Encodes the header into its fixed 40 bytes.
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_BYTES] {
        let mut b = [0u8; SEGMENT_HEADER_BYTES];
        b[0..8].copy_from_slice(&SEGMENT_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[16..24].copy_from_slice(&self.base_index.to_le_bytes());
        b[24..32].copy_from_slice(&self.base_offset.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..32]);
        b[32..36].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and verifies a segment header.
    ///
    /// # Errors
    /// [`DecodeError`] if the slice is short, the magic or version is wrong,
    /// or the checksum does not match.
    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        if b.len() < SEGMENT_HEADER_BYTES {
            return Err(DecodeError::Truncated { needed: SEGMENT_HEADER_BYTES, available: b.len() });
        }
        if b[0..8] != SEGMENT_MAGIC {
            return Err(invalid("segment magic", format!("{:?}", &b[0..8])));
        }
        let stored = u32_at(b, 32);
        let computed = crc32c::crc32c(&b[0..32]);
        if stored != computed {
            return Err(DecodeError::Checksum { stored, computed });
        }
        let version = u32_at(b, 8);
        if version != FORMAT_VERSION {
            return Err(invalid(
                "segment format version",
                format!("{version}, this build reads {FORMAT_VERSION}"),
            ));
        }
        Ok(Self { base_index: u64_at(b, 16), base_offset: u64_at(b, 24) })
    }
}

/// The fixed header of one frame: everything about an entry but its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Total length of the frame on disk, bytes (header and payload).
    pub frame_bytes: usize,
    /// What the entry is.
    pub kind: FrameKind,
    /// The entry's Raft log id.
    pub log_id: LogId,
    /// Offset of the entry's first record; for entries without records, the
    /// offset the next record will get.
    pub base_offset: u64,
    /// Records in the entry (0 unless `kind` is `Records`).
    pub record_count: u32,
    /// First record timestamp, ms since the Unix epoch (0 without records).
    pub first_timestamp_ms: i64,
    /// Largest record timestamp, ms since the Unix epoch (0 without records).
    pub max_timestamp_ms: i64,
    /// Idempotent producer id (KIP-98), or -1.
    pub producer_id: i64,
    /// Producer epoch.
    pub producer_epoch: i16,
    /// Sequence number of the first record.
    pub base_sequence: i32,
}

impl FrameHeader {
    /// Offset one past the entry's last record.
    pub fn next_offset(&self) -> u64 {
        self.base_offset + u64::from(self.record_count)
    }

    /// The Raft index of the entry.
    pub fn index(&self) -> u64 {
        self.log_id.index
    }
}

/// Appends the frame of `entry` to `out` and returns its header.
/// `base_offset` is the offset the entry's first record receives.
///
/// # Errors
/// [`DecodeError::Invalid`] if the entry cannot be stored: a record batch
/// with no records, a frame over [`FRAME_BYTES_MAX`], index `u64::MAX`, or
/// offsets past `u64::MAX`.
pub fn encode_entry(entry: &Entry, base_offset: u64, out: &mut Vec<u8>) -> Result<FrameHeader, DecodeError> {
    if entry.log_id.index == u64::MAX {
        return Err(invalid("index", "the last index is never written (the next one would overflow)"));
    }
    let start = out.len();
    out.resize(start + FRAME_HEADER_BYTES, 0);
    let (kind, batch) = match &entry.payload {
        EntryPayload::Blank => (FrameKind::Blank, None),
        EntryPayload::Normal(b) if b.is_control() => {
            b.control().map_err(|e| invalid("control", e))?;
            out.extend_from_slice(&b.records);
            (FrameKind::Control, None)
        }
        EntryPayload::Normal(b) => (FrameKind::Records, Some(b)),
        EntryPayload::Membership(m) => {
            prost::Message::encode(&crate::wire::membership_to_wire(m), out)
                .map_err(|e| invalid("membership", e.to_string()))?;
            (FrameKind::Membership, None)
        }
    };
    if let Some(b) = batch {
        if b.record_count == 0 {
            out.truncate(start);
            return Err(invalid("record_count", "a record batch must hold at least one record"));
        }
        if base_offset.checked_add(u64::from(b.record_count)).is_none() {
            out.truncate(start);
            return Err(invalid(
                "base offset",
                format!("{base_offset} + {} records is past the last offset", b.record_count),
            ));
        }
        out.extend_from_slice(&b.records);
    }
    let frame_bytes = out.len() - start;
    if frame_bytes > FRAME_BYTES_MAX {
        out.truncate(start);
        return Err(invalid("frame length", format!("{frame_bytes} bytes exceeds {FRAME_BYTES_MAX}")));
    }
    let header = FrameHeader {
        frame_bytes,
        kind,
        log_id: entry.log_id,
        base_offset,
        record_count: batch.map_or(0, |b| b.record_count),
        first_timestamp_ms: batch.map_or(0, |b| b.first_timestamp_ms),
        max_timestamp_ms: batch.map_or(0, |b| b.max_timestamp_ms),
        producer_id: match (kind, batch) {
            (FrameKind::Control, _) => crate::batch::CONTROL_PRODUCER_ID,
            (_, b) => b.map_or(-1, |b| b.producer_id),
        },
        producer_epoch: batch.map_or(0, |b| b.producer_epoch),
        base_sequence: batch.map_or(0, |b| b.base_sequence),
    };
    let h = &mut out[start..start + FRAME_HEADER_BYTES];
    h[0..4].copy_from_slice(&((frame_bytes - 4) as u32).to_le_bytes());
    h[8] = kind as u8;
    h[12..20].copy_from_slice(&header.log_id.leader_id.term.to_le_bytes());
    h[20..28].copy_from_slice(&header.log_id.leader_id.node_id.to_le_bytes());
    h[28..36].copy_from_slice(&header.log_id.index.to_le_bytes());
    h[36..44].copy_from_slice(&base_offset.to_le_bytes());
    h[44..48].copy_from_slice(&header.record_count.to_le_bytes());
    h[48..56].copy_from_slice(&header.first_timestamp_ms.to_le_bytes());
    h[56..64].copy_from_slice(&header.max_timestamp_ms.to_le_bytes());
    h[64..72].copy_from_slice(&header.producer_id.to_le_bytes());
    h[72..74].copy_from_slice(&header.producer_epoch.to_le_bytes());
    h[74..78].copy_from_slice(&header.base_sequence.to_le_bytes());
    let crc = crc32c::crc32c(&out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(header)
}

/// Reads the length prefix of the frame at the start of `b`: the frame's
/// total length in bytes, so a reader knows how much to fetch.
///
/// # Errors
/// [`DecodeError`] if fewer than 4 bytes are given or the length is outside
/// `FRAME_HEADER_BYTES..=FRAME_BYTES_MAX`.
pub fn frame_len(b: &[u8]) -> Result<usize, DecodeError> {
    if b.len() < 4 {
        return Err(DecodeError::Truncated { needed: 4, available: b.len() });
    }
    let len = u32_at(b, 0) as usize + 4;
    if !(FRAME_HEADER_BYTES..=FRAME_BYTES_MAX).contains(&len) {
        return Err(invalid("frame length", format!("{len} bytes")));
    }
    Ok(len)
}

/// Decodes and checksums the frame at the start of `b`, returning its header.
/// The payload is `b[FRAME_HEADER_BYTES..header.frame_bytes]`.
///
/// # Errors
/// [`DecodeError::Truncated`] if the frame extends past `b`,
/// [`DecodeError::Checksum`] if it fails its CRC32C, and
/// [`DecodeError::Invalid`] for an impossible length, kind, index or offset.
pub fn decode_frame_header(b: &[u8]) -> Result<FrameHeader, DecodeError> {
    let frame_bytes = frame_len(b)?;
    if b.len() < frame_bytes {
        return Err(DecodeError::Truncated { needed: frame_bytes, available: b.len() });
    }
    let stored = u32_at(b, 4);
    let computed = crc32c::crc32c(&b[8..frame_bytes]);
    if stored != computed {
        return Err(DecodeError::Checksum { stored, computed });
    }
    let kind = FrameKind::from_u8(b[8]).ok_or_else(|| invalid("frame kind", b[8].to_string()))?;
    let header = FrameHeader {
        frame_bytes,
        kind,
        log_id: log_id(u64_at(b, 12), u64_at(b, 20), u64_at(b, 28)),
        base_offset: u64_at(b, 36),
        record_count: u32_at(b, 44),
        first_timestamp_ms: i64_at(b, 48),
        max_timestamp_ms: i64_at(b, 56),
        producer_id: i64_at(b, 64),
        producer_epoch: i16::from_le_bytes([b[72], b[73]]),
        base_sequence: i32::from_le_bytes([b[74], b[75], b[76], b[77]]),
    };
    if (kind == FrameKind::Records) != (header.record_count > 0) {
        return Err(invalid("record_count", format!("{} for a {kind:?} frame", header.record_count)));
    }
    // No offset or index past the last: `next_offset` and the next index
    // must not overflow (frames found by fuzzing made the open of a
    // segment panic in debug builds, and wrap the log's next offset or
    // index to near zero in release builds).
    if header.base_offset.checked_add(u64::from(header.record_count)).is_none() {
        return Err(invalid(
            "base offset",
            format!("{} + {} records is past the last offset", header.base_offset, header.record_count),
        ));
    }
    if header.log_id.index == u64::MAX {
        return Err(invalid("index", "the last index is never written (the next one would overflow)"));
    }
    Ok(header)
}

/// Rebuilds the Raft entry of a verified frame. `frame` holds exactly the
/// frame's bytes (as [`decode_frame_header`] measured them); slicing a
/// shared buffer keeps record payloads zero-copy.
///
/// # Errors
/// [`DecodeError::Invalid`] if a membership payload does not decode (protobuf, or
/// JSON in an old kind-3 frame) or is not a valid configuration.
pub fn decode_entry(header: &FrameHeader, frame: &Bytes) -> Result<Entry, DecodeError> {
    let payload = frame.slice(FRAME_HEADER_BYTES..header.frame_bytes);
    let payload = match header.kind {
        FrameKind::Blank => EntryPayload::Blank,
        FrameKind::Records => EntryPayload::Normal(RecordBatch {
            record_count: header.record_count,
            first_timestamp_ms: header.first_timestamp_ms,
            max_timestamp_ms: header.max_timestamp_ms,
            producer_id: header.producer_id,
            producer_epoch: header.producer_epoch,
            base_sequence: header.base_sequence,
            records: payload,
        }),
        FrameKind::Control => {
            let b = RecordBatch::control_frame(payload);
            b.control().map_err(|e| invalid("control", e))?;
            EntryPayload::Normal(b)
        }
        FrameKind::MembershipJson => {
            let m: Membership =
                serde_json::from_slice(&payload).map_err(|e| invalid("membership", e.to_string()))?;
            // The Raft library's JSON is not checked as it is read (a voter
            // without an address, an empty voter set): check it as the
            // protobuf form is checked, or the entry would be accepted here
            // and refused by every follower it is sent to (found by fuzzing).
            EntryPayload::Membership(
                crate::wire::membership_from_wire(&crate::wire::membership_to_wire(&m))
                    .map_err(|e| invalid("membership", e.to_string()))?,
            )
        }
        FrameKind::Membership => {
            let m: ferrolog_proto::raft::Membership =
                prost::Message::decode(payload).map_err(|e| invalid("membership", e.to_string()))?;
            EntryPayload::Membership(
                crate::wire::membership_from_wire(&m).map_err(|e| invalid("membership", e.to_string()))?,
            )
        }
    };
    Ok(Entry { log_id: header.log_id, payload })
}

/// One row of a segment's sparse index: where an entry starts, which offset
/// it carries, and the largest record timestamp seen before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// Raft index of the entry.
    pub index: u64,
    /// The entry's base offset.
    pub offset: u64,
    /// Byte position of the entry's frame in the segment file.
    pub position: u64,
    /// Largest record timestamp of every entry before this one in the
    /// segment, ms (i64::MIN if none); monotonic, so binary-searchable.
    pub max_timestamp_before_ms: i64,
}

/// Summary of a sealed segment, stored with its index so the segment need
/// not be scanned on open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SealedSummary {
    /// Length of the segment file when sealed, bytes.
    pub size_bytes: u64,
    /// Raft index of the last entry.
    pub last_log_id: LogId,
    /// Offset one past the last record.
    pub next_offset: u64,
    /// Largest record timestamp in the segment, ms (i64::MIN if none).
    pub max_timestamp_ms: i64,
}

const INDEX_ROW_BYTES: usize = 32;
const INDEX_HEADER_BYTES: usize = 64;

/// Encodes a sealed segment's index file: header, summary, rows, crc32c.
pub fn encode_index(summary: &SealedSummary, rows: &[IndexEntry]) -> Vec<u8> {
    let mut b = Vec::with_capacity(INDEX_HEADER_BYTES + rows.len() * INDEX_ROW_BYTES + 4);
    b.extend_from_slice(&INDEX_MAGIC);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&(rows.len() as u32).to_le_bytes());
    b.extend_from_slice(&summary.size_bytes.to_le_bytes());
    b.extend_from_slice(&summary.last_log_id.leader_id.term.to_le_bytes());
    b.extend_from_slice(&summary.last_log_id.leader_id.node_id.to_le_bytes());
    b.extend_from_slice(&summary.last_log_id.index.to_le_bytes());
    b.extend_from_slice(&summary.next_offset.to_le_bytes());
    b.extend_from_slice(&summary.max_timestamp_ms.to_le_bytes());
    for r in rows {
        b.extend_from_slice(&r.index.to_le_bytes());
        b.extend_from_slice(&r.offset.to_le_bytes());
        b.extend_from_slice(&r.position.to_le_bytes());
        b.extend_from_slice(&r.max_timestamp_before_ms.to_le_bytes());
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// Decodes and verifies an index file written by [`encode_index`].
///
/// # Errors
/// [`DecodeError`] if the file is short, has the wrong magic or version,
/// fails its checksum, or names index `u64::MAX`.
pub fn decode_index(b: &[u8]) -> Result<(SealedSummary, Vec<IndexEntry>), DecodeError> {
    if b.len() < INDEX_HEADER_BYTES + 4 {
        return Err(DecodeError::Truncated { needed: INDEX_HEADER_BYTES + 4, available: b.len() });
    }
    let body = &b[..b.len() - 4];
    let stored = u32_at(b, b.len() - 4);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(DecodeError::Checksum { stored, computed });
    }
    if b[0..8] != INDEX_MAGIC {
        return Err(invalid("index magic", format!("{:?}", &b[0..8])));
    }
    let version = u32_at(b, 8);
    if version != FORMAT_VERSION {
        return Err(invalid("index format version", version.to_string()));
    }
    let count = u32_at(b, 12) as usize;
    if body.len() != INDEX_HEADER_BYTES + count * INDEX_ROW_BYTES {
        return Err(invalid("index length", format!("{} bytes for {count} rows", body.len())));
    }
    let summary = SealedSummary {
        size_bytes: u64_at(b, 16),
        last_log_id: log_id(u64_at(b, 24), u64_at(b, 32), u64_at(b, 40)),
        next_offset: u64_at(b, 48),
        max_timestamp_ms: i64_at(b, 56),
    };
    // As for frames: no entry has the last index (a segment loaded with
    // such an index file overflowed its next index; found by fuzzing).
    if summary.last_log_id.index == u64::MAX {
        return Err(invalid("index last log id", "the last index is never written"));
    }
    let rows = (0..count)
        .map(|i| {
            let p = INDEX_HEADER_BYTES + i * INDEX_ROW_BYTES;
            IndexEntry {
                index: u64_at(b, p),
                offset: u64_at(b, p + 8),
                position: u64_at(b, p + 16),
                max_timestamp_before_ms: i64_at(b, p + 24),
            }
        })
        .collect();
    Ok((summary, rows))
}

fn u32_at(b: &[u8], p: usize) -> u32 {
    u32::from_le_bytes([b[p], b[p + 1], b[p + 2], b[p + 3]])
}

fn u64_at(b: &[u8], p: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[p..p + 8]);
    u64::from_le_bytes(a)
}

fn i64_at(b: &[u8], p: usize) -> i64 {
    u64_at(b, p) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch_entry(index: u64, n: u32) -> Entry {
        Entry {
            log_id: log_id(3, 1, index),
            payload: EntryPayload::Normal(RecordBatch {
                record_count: n,
                first_timestamp_ms: 10,
                max_timestamp_ms: 20,
                producer_id: 7,
                producer_epoch: 1,
                base_sequence: 42,
                records: Bytes::from_static(b"hello records"),
            }),
        }
    }

    #[test]
    fn frame_round_trips() {
        let mut buf = Vec::new();
        let e = batch_entry(5, 3);
        let h = encode_entry(&e, 100, &mut buf).unwrap();
        assert_eq!(h.frame_bytes, buf.len());
        let d = decode_frame_header(&buf).unwrap();
        assert_eq!(d, h);
        assert_eq!(d.next_offset(), 103);
        assert_eq!(decode_entry(&d, &Bytes::from(buf)).unwrap(), e);
    }

    #[test]
    fn membership_frames_are_protobuf_and_old_json_ones_still_read() {
        let nodes: std::collections::BTreeMap<u64, crate::types::Node> =
            (1..=3).map(|id| (id, crate::types::Node { addr: format!("10.0.0.{id}:9093") })).collect();
        let m = Membership::new(vec![[1, 2, 3].into()], nodes).unwrap();
        let e = Entry { log_id: log_id(2, 1, 7), payload: EntryPayload::Membership(m.clone()) };
        let mut buf = Vec::new();
        let h = encode_entry(&e, 0, &mut buf).unwrap();
        assert_eq!(h.kind, FrameKind::Membership);
        assert_eq!(buf[8], 4, "kind byte");
        assert_eq!(decode_entry(&decode_frame_header(&buf).unwrap(), &Bytes::from(buf.clone())).unwrap(), e);

        // A frame as the first brokers wrote it: kind 3, openraft's JSON.
        let mut old = buf[..FRAME_HEADER_BYTES].to_vec();
        old[8] = 3;
        // Literal, as openraft 0.10.0-alpha.37 wrote it (not made by the
        // openraft linked now, so an upgrade that changes its JSON fails here).
        old.extend_from_slice(
            br#"{"configs":[[1,2,3]],"nodes":{"1":{"addr":"10.0.0.1:9093"},"2":{"addr":"10.0.0.2:9093"},"3":{"addr":"10.0.0.3:9093"}}}"#,
        );
        let len = u32::try_from(old.len() - 4).unwrap();
        old[0..4].copy_from_slice(&len.to_le_bytes());
        let crc = crc32c::crc32c(&old[8..]);
        old[4..8].copy_from_slice(&crc.to_le_bytes());
        let oh = decode_frame_header(&old).unwrap();
        assert_eq!(oh.kind, FrameKind::MembershipJson);
        assert_eq!(decode_entry(&oh, &Bytes::from(old)).unwrap(), e);
    }

    #[test]
    fn every_flipped_bit_is_detected() {
        let mut buf = Vec::new();
        encode_entry(&batch_entry(5, 3), 100, &mut buf).unwrap();
        for bit in 0..buf.len() * 8 {
            let mut c = buf.clone();
            c[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_frame_header(&c).is_err(), "bit {bit} flipped went unnoticed");
        }
    }

    #[test]
    fn torn_frame_is_truncated_not_garbage() {
        let mut buf = Vec::new();
        encode_entry(&batch_entry(5, 3), 100, &mut buf).unwrap();
        for cut in 0..buf.len() {
            assert!(matches!(
                decode_frame_header(&buf[..cut]),
                Err(DecodeError::Truncated { .. } | DecodeError::Invalid { .. })
            ));
        }
    }

    /// Sets a hand-made frame's length prefix and CRC32C.
    fn seal_frame(f: &mut [u8]) {
        let len = u32::try_from(f.len() - 4).unwrap();
        f[0..4].copy_from_slice(&len.to_le_bytes());
        let crc = crc32c::crc32c(&f[8..]);
        f[4..8].copy_from_slice(&crc.to_le_bytes());
    }

    /// Found by the `segment_frame` fuzz target (fuzz/regressions/segment_frame/):
    /// a records frame whose base offset plus record count overflows made
    /// `FrameHeader::next_offset` panic (debug) or wrap (release) when a
    /// segment holding it was opened.
    #[test]
    fn offsets_past_the_last_are_refused() {
        let mut crash = vec![0x4f, 0x00, 0x00, 0x00, 0xa8, 0xb2, 0x92, 0xec, 0x02, 0x00, 0x00];
        crash.extend_from_slice(&[0xff; 43]);
        crash.extend_from_slice(&[0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x05]);
        crash.extend_from_slice(&[0x00; 17]);
        crash.extend_from_slice(b"onene");
        seal_frame(&mut crash);
        assert!(matches!(
            decode_frame_header(&crash),
            Err(DecodeError::Invalid { field: "base offset", .. })
        ));

        let mut buf = Vec::new();
        let h = encode_entry(&batch_entry(5, 3), u64::MAX - 3, &mut buf).unwrap();
        assert_eq!(h.next_offset(), u64::MAX);
        assert_eq!(decode_frame_header(&buf).unwrap(), h, "the last offsets still fit");
        let mut past = Vec::new();
        assert!(encode_entry(&batch_entry(5, 3), u64::MAX - 2, &mut past).is_err());
        assert!(past.is_empty());
    }

    /// The flaw the `snapshot_manifest` fuzz target found in version 1
    /// manifests, in frames: an old JSON membership frame (kind 3) naming a
    /// voter without an address decoded, and its re-encoding (as every
    /// AppendEntries re-encodes entries) was refused.
    #[test]
    fn json_membership_frames_are_checked_as_protobuf_ones() {
        for json in [
            &br#"{"configs":[[1,2,3]],"nodes":{"1":{"addr":"a"},"2":{"addr":"b"}}}"#[..],
            &br#"{"configs":[[]],"nodes":{"1":{"addr":""}}}"#[..],
        ] {
            let mut f = Vec::new();
            encode_entry(&Entry { log_id: log_id(2, 1, 7), payload: EntryPayload::Blank }, 0, &mut f)
                .unwrap();
            f[8] = FrameKind::MembershipJson as u8;
            f.extend_from_slice(json);
            seal_frame(&mut f);
            let h = decode_frame_header(&f).unwrap();
            assert!(decode_entry(&h, &Bytes::from(f)).is_err(), "{}", String::from_utf8_lossy(json));
        }
    }

    /// Found by the `index_file` fuzz target (fuzz/regressions/index_file/):
    /// an index file that verifies and names index u64::MAX as its last
    /// made the open of its sealed segment overflow the next index, as a
    /// frame of that index did in a scan.
    #[test]
    fn the_last_index_is_refused_in_frames_and_index_files() {
        let hex = [
            "464c4f47494458000100000007000000d302000000000000ffffffffffffffffffffffffffffffffffffffffffffffff",
            "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
            "ffffffffffffffffffffffffffffffffffffffffffffffffffffffff0200000000000000010000000000000007000000",
            "000000000400000000000000f469e5cf8b01000001000000000000000000000000000000280000000000000000000000",
            "000000800200000000000000000000000000000078000000000000000000000000000080030000000000000003000000",
            "1f02000000000000f469e5cf8b010000070000000000000003000000000000008002000000000000f469e5cf8b010000",
            "16c5492e",
        ]
        .concat();
        let mut crash: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let n = crash.len() - 4;
        let crc = crc32c::crc32c(&crash[..n]);
        crash[n..].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(decode_index(&crash), Err(DecodeError::Invalid { field: "index last log id", .. })));

        let mut buf = Vec::new();
        assert!(encode_entry(&batch_entry(u64::MAX, 1), 0, &mut buf).is_err());
        assert!(buf.is_empty());
        encode_entry(&batch_entry(u64::MAX - 1, 1), 0, &mut buf).unwrap();
        buf[28..36].copy_from_slice(&u64::MAX.to_le_bytes());
        seal_frame(&mut buf);
        assert!(matches!(decode_frame_header(&buf), Err(DecodeError::Invalid { field: "index", .. })));
    }

    #[test]
    fn empty_batch_is_refused() {
        let mut buf = Vec::new();
        assert!(encode_entry(&batch_entry(1, 0), 0, &mut buf).is_err());
        assert!(buf.is_empty());
    }

    #[test]
    fn segment_header_and_index_round_trip() {
        let h = SegmentHeader { base_index: 9, base_offset: 77 };
        assert_eq!(SegmentHeader::decode(&h.encode()).unwrap(), h);
        let s = SealedSummary {
            size_bytes: 1000,
            last_log_id: log_id(2, 3, 40),
            next_offset: 90,
            max_timestamp_ms: 5,
        };
        let rows = vec![IndexEntry { index: 9, offset: 77, position: 40, max_timestamp_before_ms: i64::MIN }];
        let enc = encode_index(&s, &rows);
        assert_eq!(decode_index(&enc).unwrap(), (s, rows));
        let mut bad = enc.clone();
        bad[20] ^= 1;
        assert!(decode_index(&bad).is_err());
    }
}
