//! Wire encoding of Raft RPCs: entries as segment frames, the rest as JSON.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use ferrolog_raft_store::format;
use ferrolog_raft_store::types::{Entry, LogId, TypeConfig, Vote};
use openraft::raft::AppendEntriesRequest;

/// Why a peer message could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The JSON part does not parse.
    #[error("bad json: {0}")]
    Json(#[from] serde_json::Error),
    /// An entry frame does not verify or parse.
    #[error("bad entry frame at byte {position}: {source}")]
    Frame {
        /// Byte position of the frame in the entries field.
        position: usize,
        /// What was wrong.
        #[source]
        source: format::DecodeError,
    },
}

#[derive(Serialize, Deserialize)]
struct AppendHeader {
    vote: Vote,
    prev_log_id: Option<LogId>,
    leader_commit: Option<LogId>,
}

/// Encodes an AppendEntries request: `(header JSON, entry frames)`.
///
/// # Errors
/// [`CodecError`] if an entry cannot be framed (an empty record batch).
pub fn encode_append(req: &AppendEntriesRequest<TypeConfig>) -> Result<(Vec<u8>, Vec<u8>), CodecError> {
    let header =
        AppendHeader { vote: req.vote, prev_log_id: req.prev_log_id, leader_commit: req.leader_commit };
    let mut frames = Vec::new();
    for e in &req.entries {
        // The receiver assigns offsets itself; the frame's offset is unused.
        format::encode_entry(e, 0, &mut frames)
            .map_err(|source| CodecError::Frame { position: frames.len(), source })?;
    }
    Ok((serde_json::to_vec(&header)?, frames))
}

/// Decodes an AppendEntries request, verifying every frame's CRC32C.
///
/// # Errors
/// [`CodecError`] for bad JSON or a frame that does not verify.
pub fn decode_append(header: &[u8], frames: Bytes) -> Result<AppendEntriesRequest<TypeConfig>, CodecError> {
    let h: AppendHeader = serde_json::from_slice(header)?;
    let mut entries: Vec<Entry> = Vec::new();
    let mut position = 0;
    while position < frames.len() {
        let rest = &frames[position..];
        let fh =
            format::decode_frame_header(rest).map_err(|source| CodecError::Frame { position, source })?;
        let frame = frames.slice(position..position + fh.frame_bytes);
        entries.push(
            format::decode_entry(&fh, &frame).map_err(|source| CodecError::Frame { position, source })?,
        );
        position += fh.frame_bytes;
    }
    Ok(AppendEntriesRequest {
        vote: h.vote,
        prev_log_id: h.prev_log_id,
        entries,
        leader_commit: h.leader_commit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrolog_raft_store::RecordBatch;
    use ferrolog_raft_store::types::{EntryPayload, log_id};

    #[test]
    fn append_round_trips_and_rejects_garbage() {
        let req = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new(3, 1),
            prev_log_id: Some(log_id(2, 1, 9)),
            entries: vec![
                Entry { log_id: log_id(3, 1, 10), payload: EntryPayload::Blank },
                Entry {
                    log_id: log_id(3, 1, 11),
                    payload: EntryPayload::Normal(RecordBatch {
                        record_count: 2,
                        records: Bytes::from_static(b"two records"),
                        ..RecordBatch::default()
                    }),
                },
            ],
            leader_commit: Some(log_id(3, 1, 10)),
        };
        let (h, f) = encode_append(&req).unwrap();
        let back = decode_append(&h, Bytes::from(f.clone())).unwrap();
        assert_eq!(back.entries, req.entries);
        assert_eq!(
            (back.vote, back.prev_log_id, back.leader_commit),
            (req.vote, req.prev_log_id, req.leader_commit)
        );
        let mut bad = f.clone();
        bad[100] ^= 1;
        assert!(matches!(decode_append(&h, Bytes::from(bad)), Err(CodecError::Frame { .. })));
        assert!(decode_append(b"{not json", Bytes::from(f)).is_err());
        assert!(decode_append(&h, Bytes::from_static(&[1, 2, 3])).is_err());
    }
}
