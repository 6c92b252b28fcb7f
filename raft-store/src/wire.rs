//! Ferrolog's peer protocol (`proto/ferrolog/raft/v1/raft.proto`) to and
//! from the Raft library's types: the only place that knows both.
//!
//! Every message a broker sends another is a protobuf message of our own;
//! entries inside AppendEntries stay in the segment frame format
//! ([`crate::format`]) and are never re-encoded. What comes off the wire is
//! checked here: a message without a field the protocol requires, or a
//! membership whose voters are missing from its address book, is a
//! [`WireError`], never a panic. The encoding of every message is pinned by
//! golden-bytes tests below: changing a field's number or type fails them.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use ferrolog_proto::raft as pb;

use crate::format;
use crate::types::{
    AppendEntriesRequest, AppendEntriesResponse, Entry, LogId, Membership, Node, SnapshotMeta,
    StoredMembership, TransferLeaderError, TransferLeaderRequest, TransferLeaderResponse, Vote, VoteRequest,
    VoteResponse, log_id,
};

/// Why a peer message could not be turned into the Raft library's types.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A field the protocol requires is absent.
    #[error("{message}: required field {field} is missing")]
    Missing {
        /// The message.
        message: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A membership is not a valid configuration.
    #[error("invalid membership: {0}")]
    Membership(String),
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

fn missing(message: &'static str, field: &'static str) -> WireError {
    WireError::Missing { message, field }
}

/// A log id on the wire.
pub fn log_id_to_wire(l: &LogId) -> pb::LogId {
    pb::LogId { term: l.leader_id.term, leader_node: l.leader_id.node_id, index: l.index }
}

/// A log id from the wire.
pub fn log_id_from_wire(l: &pb::LogId) -> LogId {
    log_id(l.term, l.leader_node, l.index)
}

fn opt_log_id_to_wire(l: Option<&LogId>) -> Option<pb::LogId> {
    l.map(log_id_to_wire)
}

fn opt_log_id_from_wire(l: Option<&pb::LogId>) -> Option<LogId> {
    l.map(log_id_from_wire)
}

/// A vote on the wire.
pub fn vote_to_wire(v: &Vote) -> pb::Vote {
    pb::Vote { term: v.leader_id.term, node: v.leader_id.node_id, committed: v.committed }
}

/// A vote from the wire.
pub fn vote_from_wire(v: &pb::Vote) -> Vote {
    if v.committed { Vote::new_committed(v.term, v.node) } else { Vote::new(v.term, v.node) }
}

fn required_vote(
    v: Option<&pb::Vote>,
    message: &'static str,
    field: &'static str,
) -> Result<Vote, WireError> {
    v.map(vote_from_wire).ok_or_else(|| missing(message, field))
}

/// A membership on the wire: voter sets in order, node ids ascending.
pub fn membership_to_wire(m: &Membership) -> pb::Membership {
    pb::Membership {
        configs: m
            .get_joint_config()
            .iter()
            .map(|set| pb::VoterSet { voters: set.iter().copied().collect() })
            .collect(),
        // openraft keeps nodes in a BTreeMap: ascending ids.
        nodes: m.nodes().map(|(id, n)| pb::NodeAddress { node: *id, addr: n.addr.clone() }).collect(),
    }
}

/// A membership from the wire.
///
/// # Errors
/// [`WireError::Membership`] if a voter has no address book entry.
pub fn membership_from_wire(m: &pb::Membership) -> Result<Membership, WireError> {
    let configs: Vec<BTreeSet<u64>> =
        m.configs.iter().map(|set| set.voters.iter().copied().collect()).collect();
    let nodes: BTreeMap<u64, Node> =
        m.nodes.iter().map(|n| (n.node, Node { addr: n.addr.clone() })).collect();
    Membership::new(configs, nodes).map_err(|e| WireError::Membership(e.to_string()))
}

/// A stored membership on the wire.
pub fn stored_membership_to_wire(m: &StoredMembership) -> pb::StoredMembership {
    pb::StoredMembership {
        log_id: opt_log_id_to_wire(m.log_id().as_ref()),
        membership: Some(membership_to_wire(m.membership())),
    }
}

/// A stored membership from the wire.
///
/// # Errors
/// [`WireError`] if the membership is absent or invalid.
pub fn stored_membership_from_wire(m: &pb::StoredMembership) -> Result<StoredMembership, WireError> {
    let membership = m.membership.as_ref().ok_or_else(|| missing("StoredMembership", "membership"))?;
    Ok(StoredMembership::new(opt_log_id_from_wire(m.log_id.as_ref()), membership_from_wire(membership)?))
}

/// Snapshot metadata on the wire.
pub fn snapshot_meta_to_wire(m: &SnapshotMeta) -> pb::SnapshotMeta {
    pb::SnapshotMeta {
        last_log_id: opt_log_id_to_wire(m.last_log_id.as_ref()),
        last_membership: Some(stored_membership_to_wire(&m.last_membership)),
    }
}

/// Snapshot metadata from the wire.
///
/// # Errors
/// [`WireError`] if the membership is absent or invalid.
pub fn snapshot_meta_from_wire(m: &pb::SnapshotMeta) -> Result<SnapshotMeta, WireError> {
    let membership = m.last_membership.as_ref().ok_or_else(|| missing("SnapshotMeta", "last_membership"))?;
    Ok(SnapshotMeta {
        last_log_id: opt_log_id_from_wire(m.last_log_id.as_ref()),
        last_membership: stored_membership_from_wire(membership)?,
    })
}

/// A RequestVote (or pre-vote) for replica `target` of `group`.
pub fn vote_request_to_wire(group: u64, target: u64, r: &VoteRequest) -> pb::VoteRequest {
    pb::VoteRequest {
        group_id: group,
        target_node: target,
        vote: Some(vote_to_wire(&r.vote)),
        last_log_id: opt_log_id_to_wire(r.last_log_id.as_ref()),
        leadership_transfer: r.leadership_transfer,
    }
}

/// A RequestVote from the wire.
///
/// # Errors
/// [`WireError::Missing`] without the candidate's vote.
pub fn vote_request_from_wire(r: &pb::VoteRequest) -> Result<VoteRequest, WireError> {
    let mut v = VoteRequest::new(
        required_vote(r.vote.as_ref(), "VoteRequest", "vote")?,
        opt_log_id_from_wire(r.last_log_id.as_ref()),
    );
    v.leadership_transfer = r.leadership_transfer;
    Ok(v)
}

/// A vote's answer on the wire.
pub fn vote_response_to_wire(r: &VoteResponse) -> pb::VoteResponse {
    pb::VoteResponse {
        error: None,
        vote: Some(vote_to_wire(&r.vote)),
        vote_granted: r.vote_granted,
        last_log_id: opt_log_id_to_wire(r.last_log_id.as_ref()),
    }
}

/// A vote's answer from the wire (its `error` already handled).
///
/// # Errors
/// [`WireError::Missing`] without the voter's vote.
pub fn vote_response_from_wire(r: &pb::VoteResponse) -> Result<VoteResponse, WireError> {
    Ok(VoteResponse::new(
        required_vote(r.vote.as_ref(), "VoteResponse", "vote")?,
        opt_log_id_from_wire(r.last_log_id.as_ref()),
        r.vote_granted,
    ))
}

/// An AppendEntries for replica `target` of `group`, its entries framed as
/// on disk (the receiver assigns offsets itself; the frames' are unused).
///
/// # Errors
/// [`WireError::Frame`] if an entry cannot be framed (an empty record batch).
pub fn append_request_to_wire(
    group: u64,
    target: u64,
    r: &AppendEntriesRequest,
) -> Result<pb::AppendEntriesRequest, WireError> {
    let mut frames = Vec::new();
    for e in &r.entries {
        format::encode_entry(e, 0, &mut frames)
            .map_err(|source| WireError::Frame { position: frames.len(), source })?;
    }
    Ok(pb::AppendEntriesRequest {
        group_id: group,
        target_node: target,
        vote: Some(vote_to_wire(&r.vote)),
        prev_log_id: opt_log_id_to_wire(r.prev_log_id.as_ref()),
        leader_commit: opt_log_id_to_wire(r.leader_commit.as_ref()),
        entries: frames.into(),
    })
}

/// An AppendEntries from the wire, every frame's CRC32C verified.
///
/// # Errors
/// [`WireError`] without the leader's vote, or for a frame that does not
/// verify.
pub fn append_request_from_wire(r: pb::AppendEntriesRequest) -> Result<AppendEntriesRequest, WireError> {
    Ok(AppendEntriesRequest {
        vote: required_vote(r.vote.as_ref(), "AppendEntriesRequest", "vote")?,
        prev_log_id: opt_log_id_from_wire(r.prev_log_id.as_ref()),
        leader_commit: opt_log_id_from_wire(r.leader_commit.as_ref()),
        entries: decode_frames(&r.entries)?,
    })
}

/// The entries of consecutive frames, each CRC32C-verified.
fn decode_frames(frames: &Bytes) -> Result<Vec<Entry>, WireError> {
    let mut entries = Vec::new();
    let mut position = 0;
    while position < frames.len() {
        let fh = format::decode_frame_header(&frames[position..])
            .map_err(|source| WireError::Frame { position, source })?;
        let frame = frames.slice(position..position + fh.frame_bytes);
        entries
            .push(format::decode_entry(&fh, &frame).map_err(|source| WireError::Frame { position, source })?);
        position += fh.frame_bytes;
    }
    Ok(entries)
}

/// An AppendEntries answer on the wire.
pub fn append_response_to_wire(r: &AppendEntriesResponse) -> pb::AppendEntriesResponse {
    use pb::append_entries_response::Result as R;
    let result = match r {
        AppendEntriesResponse::Success => R::Success(pb::Empty {}),
        AppendEntriesResponse::PartialSuccess(m) => {
            R::PartialSuccess(pb::PartialSuccess { matching: opt_log_id_to_wire(m.as_ref()) })
        }
        AppendEntriesResponse::Conflict => R::Conflict(pb::Empty {}),
        AppendEntriesResponse::HigherVote(v) => R::HigherVote(vote_to_wire(v)),
    };
    pb::AppendEntriesResponse { error: None, result: Some(result) }
}

/// An AppendEntries answer from the wire (its `error` already handled).
///
/// # Errors
/// [`WireError::Missing`] without a result.
pub fn append_response_from_wire(r: &pb::AppendEntriesResponse) -> Result<AppendEntriesResponse, WireError> {
    use pb::append_entries_response::Result as R;
    Ok(match r.result.as_ref().ok_or_else(|| missing("AppendEntriesResponse", "result"))? {
        R::Success(_) => AppendEntriesResponse::Success,
        R::PartialSuccess(p) => {
            AppendEntriesResponse::PartialSuccess(opt_log_id_from_wire(p.matching.as_ref()))
        }
        R::Conflict(_) => AppendEntriesResponse::Conflict,
        R::HigherVote(v) => AppendEntriesResponse::HigherVote(vote_from_wire(v)),
    })
}

/// A leadership transfer for replica `target` of `group`.
pub fn transfer_request_to_wire(
    group: u64,
    target: u64,
    r: &TransferLeaderRequest,
) -> pb::TransferLeaderRequest {
    pb::TransferLeaderRequest {
        group_id: group,
        target_node: target,
        from_leader: Some(vote_to_wire(r.from_leader())),
        to_node: *r.to_node_id(),
        last_log_id: opt_log_id_to_wire(r.last_log_id()),
    }
}

/// A leadership transfer from the wire.
///
/// # Errors
/// [`WireError::Missing`] without the leader's vote.
pub fn transfer_request_from_wire(r: &pb::TransferLeaderRequest) -> Result<TransferLeaderRequest, WireError> {
    Ok(TransferLeaderRequest::new(
        required_vote(r.from_leader.as_ref(), "TransferLeaderRequest", "from_leader")?,
        r.to_node,
        opt_log_id_from_wire(r.last_log_id.as_ref()),
    ))
}

/// A leadership transfer's answer on the wire.
pub fn transfer_response_to_wire(r: &TransferLeaderResponse) -> pb::TransferLeaderResponse {
    use pb::transfer_refused::Reason;
    let refused = match r {
        Ok(()) => None,
        Err(TransferLeaderError::VoteChanged { expected, actual }) => {
            Some(Reason::VoteChanged(pb::VoteChanged {
                expected: Some(vote_to_wire(expected)),
                actual: Some(vote_to_wire(actual)),
            }))
        }
        Err(TransferLeaderError::LogNotFlushed { expected, actual }) => {
            Some(Reason::LogNotFlushed(pb::LogNotFlushed {
                expected: opt_log_id_to_wire(expected.as_ref()),
                actual: opt_log_id_to_wire(actual.as_ref()),
            }))
        }
    };
    pb::TransferLeaderResponse {
        error: None,
        refused: refused.map(|r| pb::TransferRefused { reason: Some(r) }),
    }
}

/// A leadership transfer's answer from the wire (its `error` already handled).
///
/// # Errors
/// [`WireError::Missing`] for a refusal without its reason or votes.
pub fn transfer_response_from_wire(
    r: &pb::TransferLeaderResponse,
) -> Result<TransferLeaderResponse, WireError> {
    use pb::transfer_refused::Reason;
    let Some(refused) = &r.refused else { return Ok(Ok(())) };
    Ok(Err(match refused.reason.as_ref().ok_or_else(|| missing("TransferRefused", "reason"))? {
        Reason::VoteChanged(v) => TransferLeaderError::VoteChanged {
            expected: required_vote(v.expected.as_ref(), "VoteChanged", "expected")?,
            actual: required_vote(v.actual.as_ref(), "VoteChanged", "actual")?,
        },
        Reason::LogNotFlushed(l) => TransferLeaderError::LogNotFlushed {
            expected: opt_log_id_from_wire(l.expected.as_ref()),
            actual: opt_log_id_from_wire(l.actual.as_ref()),
        },
    }))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prost::Message;

    use super::*;
    use crate::RecordBatch;
    use crate::types::EntryPayload;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn membership() -> Membership {
        let nodes: BTreeMap<u64, Node> = [(1, "10.0.0.1:9093"), (2, "10.0.0.2:9093"), (3, "10.0.0.3:9093")]
            .into_iter()
            .map(|(id, a)| (id, Node { addr: a.into() }))
            .collect();
        Membership::new(vec![[1, 2].into(), [2, 3].into()], nodes).unwrap()
    }

    /// The exact bytes of every peer message, from a fixed example each. A
    /// change to a field's number, type or presence changes them: bump the
    /// protocol version (`broker/src/network/protocol.rs`) if that was meant.
    #[test]
    fn golden_bytes_of_every_peer_message() {
        let vote = Vote::new_committed(7, 2);
        let last = log_id(6, 1, 41);
        let mut vote_req = VoteRequest::new(Vote::new(8, 3), Some(last));
        vote_req.leadership_transfer = true;
        let append = AppendEntriesRequest {
            vote,
            prev_log_id: Some(last),
            leader_commit: Some(log_id(6, 1, 40)),
            entries: vec![Entry { log_id: log_id(7, 2, 42), payload: EntryPayload::Blank }],
        };
        let meta = SnapshotMeta {
            last_log_id: Some(last),
            last_membership: StoredMembership::new(Some(log_id(1, 1, 1)), membership()),
        };
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("LogId", log_id_to_wire(&last).encode_to_vec(), "080610011829"),
            ("Vote", vote_to_wire(&vote).encode_to_vec(), "080710021801"),
            (
                "Membership",
                membership_to_wire(&membership()).encode_to_vec(),
                "0a040a0201020a040a02020312110801120d31302e302e302e313a3930393312110802120d31302e302e302e323a3930393312110803120d31302e302e302e333a39303933",
            ),
            (
                "SnapshotMeta",
                snapshot_meta_to_wire(&meta).encode_to_vec(),
                "0a06080610011829124f0a0608011001180112450a040a0201020a040a02020312110801120d31302e302e302e313a3930393312110802120d31302e302e302e323a3930393312110803120d31302e302e302e333a39303933",
            ),
            (
                "VoteRequest",
                vote_request_to_wire(5, 3, &vote_req).encode_to_vec(),
                "080510031a040808100322060806100118292801",
            ),
            (
                "VoteResponse",
                vote_response_to_wire(&VoteResponse::new(vote, Some(last), false)).encode_to_vec(),
                "12060807100218012206080610011829",
            ),
            (
                "AppendEntriesRequest",
                append_request_to_wire(5, 3, &append).unwrap().encode_to_vec(),
                "080510031a0608071002180122060806100118292a0608061001182832504c000000a9c0aa4801000000070000000000000002000000000000002a0000000000000000000000000000000000000000000000000000000000000000000000ffffffffffffffff0000000000000000",
            ),
            (
                "AppendEntriesResponse success",
                append_response_to_wire(&AppendEntriesResponse::Success).encode_to_vec(),
                "1200",
            ),
            (
                "AppendEntriesResponse partial",
                append_response_to_wire(&AppendEntriesResponse::PartialSuccess(Some(last))).encode_to_vec(),
                "1a080a06080610011829",
            ),
            (
                "AppendEntriesResponse partial none",
                append_response_to_wire(&AppendEntriesResponse::PartialSuccess(None)).encode_to_vec(),
                "1a00",
            ),
            (
                "Membership with a learner",
                membership_to_wire(
                    &Membership::new(
                        vec![[1].into()],
                        [(1, Node { addr: "a:1".into() }), (4, Node { addr: "b:2".into() })]
                            .into_iter()
                            .collect::<BTreeMap<u64, Node>>(),
                    )
                    .unwrap(),
                )
                .encode_to_vec(),
                "0a030a0101120708011203613a31120708041203623a32",
            ),
            (
                "AppendEntriesResponse conflict",
                append_response_to_wire(&AppendEntriesResponse::Conflict).encode_to_vec(),
                "2200",
            ),
            (
                "AppendEntriesResponse higher vote",
                append_response_to_wire(&AppendEntriesResponse::HigherVote(vote)).encode_to_vec(),
                "2a06080710021801",
            ),
            (
                "TransferLeaderRequest",
                transfer_request_to_wire(5, 3, &TransferLeaderRequest::new(vote, 3, Some(last)))
                    .encode_to_vec(),
                "080510031a0608071002180120032a06080610011829",
            ),
            ("TransferLeaderResponse ok", transfer_response_to_wire(&Ok(())).encode_to_vec(), ""),
            (
                "TransferLeaderResponse vote changed",
                transfer_response_to_wire(&Err(TransferLeaderError::VoteChanged {
                    expected: vote,
                    actual: Vote::new(8, 3),
                }))
                .encode_to_vec(),
                "12100a0e0a06080710021801120408081003",
            ),
            (
                "TransferLeaderResponse not flushed",
                transfer_response_to_wire(&Err(TransferLeaderError::LogNotFlushed {
                    expected: Some(last),
                    actual: None,
                }))
                .encode_to_vec(),
                "120a12080a06080610011829",
            ),
            (
                "SnapshotChunk first",
                pb::SnapshotChunk {
                    group_id: 5,
                    target_node: 3,
                    vote: Some(vote_to_wire(&vote)),
                    meta: Some(snapshot_meta_to_wire(&meta)),
                    ..Default::default()
                }
                .encode_to_vec(),
                "080510034a0608071002180152590a06080610011829124f0a0608011001180112450a040a0201020a040a02020312110801120d31302e302e302e313a3930393312110802120d31302e302e302e323a3930393312110803120d31302e302e302e333a39303933",
            ),
            (
                "SnapshotChunk data",
                pb::SnapshotChunk {
                    group_id: 5,
                    target_node: 3,
                    file_name: "00000000000000000042.seg".into(),
                    file_offset: 1 << 20,
                    data: Bytes::from_static(b"abc"),
                    ..Default::default()
                }
                .encode_to_vec(),
                "080510032a1830303030303030303030303030303030303034322e736567308080403a03616263",
            ),
            (
                "SnapshotChunk done",
                pb::SnapshotChunk { group_id: 5, target_node: 3, done: true, ..Default::default() }
                    .encode_to_vec(),
                "080510034001",
            ),
            (
                "SnapshotResponse",
                pb::SnapshotResponse { error: None, vote: Some(vote_to_wire(&vote)) }.encode_to_vec(),
                "1206080710021801",
            ),
            (
                "PeerError",
                pb::VoteResponse {
                    error: Some(pb::PeerError {
                        code: pb::PeerErrorCode::Recovering as i32,
                        message: "no".into(),
                    }),
                    ..Default::default()
                }
                .encode_to_vec(),
                "0a06080612026e6f",
            ),
            ("PingRequest", pb::PingRequest { from_broker: 2 }.encode_to_vec(), "0802"),
            (
                "PingResponse",
                pb::PingResponse {
                    broker_id: 1,
                    leading_groups: vec![5, 300],
                    metadata_initialized: true,
                    your_incarnation: 9,
                    image_caught_up: true,
                    metadata_last_index: 77,
                    boot_id: 0xfeed,
                    replicas_open: true,
                    protocol_major: 1,
                    protocol_minor: 0,
                    opening_floor: 1001,
                    draining: true,
                }
                .encode_to_vec(),
                "0801120305ac02180120092801304d38edfd034001480158e9076001",
            ),
            (
                "LogStateRequest",
                pb::LogStateRequest { group_id: 5, target_node: 3 }.encode_to_vec(),
                "08051003",
            ),
            (
                "LogStateResponse",
                pb::LogStateResponse {
                    error: None,
                    has_last: true,
                    last_term: 6,
                    last_index: 41,
                    recovering: true,
                }
                .encode_to_vec(),
                "1001180620292801",
            ),
            (
                "BatchRequest",
                pb::BatchRequest {
                    calls: vec![
                        pb::BatchCall {
                            call: Some(pb::batch_call::Call::AppendEntries(
                                append_request_to_wire(
                                    5,
                                    3,
                                    &AppendEntriesRequest { entries: vec![], ..append.clone() },
                                )
                                .unwrap(),
                            )),
                            timeout_ms: 500,
                        },
                        pb::BatchCall { call: None, timeout_ms: 0 },
                    ],
                }
                .encode_to_vec(),
                "0a210a1c080510031a0608071002180122060806100118292a0608061001182810f4030a00",
            ),
            (
                "BatchAnswer",
                pb::BatchAnswer {
                    index: 0,
                    answer: Some(pb::batch_answer::Answer::AppendEntries(append_response_to_wire(
                        &AppendEntriesResponse::Conflict,
                    ))),
                }
                .encode_to_vec(),
                "12022200",
            ),
            (
                // Since peer protocol 1.3.
                "BatchRequest with votes",
                pb::BatchRequest {
                    calls: vec![
                        pb::BatchCall {
                            call: Some(pb::batch_call::Call::PreVote(vote_request_to_wire(5, 3, &vote_req))),
                            timeout_ms: 1000,
                        },
                        pb::BatchCall {
                            call: Some(pb::batch_call::Call::Vote(vote_request_to_wire(5, 3, &vote_req))),
                            timeout_ms: 1000,
                        },
                    ],
                }
                .encode_to_vec(),
                "0a192214080510031a04080810032206080610011829280110e8070a191a14080510031a04080810032206080610011829280110e807",
            ),
            (
                "BatchAnswer with a vote",
                pb::BatchAnswer {
                    index: 1,
                    answer: Some(pb::batch_answer::Answer::Vote(vote_response_to_wire(&VoteResponse::new(
                        vote,
                        Some(last),
                        true,
                    )))),
                }
                .encode_to_vec(),
                "08011a12120608071002180118012206080610011829",
            ),
        ];
        let mut wrong = Vec::new();
        for (name, bytes, want) in &cases {
            if hex(bytes) != *want {
                wrong.push(format!("(\"{name}\", \"{}\")", hex(bytes)));
            }
        }
        assert!(wrong.is_empty(), "encodings changed:\n{}", wrong.join("\n"));
    }

    /// Every message comes back as it went, entries and membership
    /// included; missing required fields and damaged frames are errors.
    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let vote = Vote::new_committed(3, 1);
        let append = AppendEntriesRequest {
            vote,
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
                Entry { log_id: log_id(3, 1, 12), payload: EntryPayload::Membership(membership()) },
            ],
            leader_commit: Some(log_id(3, 1, 10)),
        };
        let on_wire = append_request_to_wire(4, 2, &append).unwrap();
        assert_eq!((on_wire.group_id, on_wire.target_node), (4, 2));
        let back = append_request_from_wire(on_wire.clone()).unwrap();
        assert_eq!(back.entries, append.entries);
        assert_eq!(
            (back.vote, back.prev_log_id, back.leader_commit),
            (append.vote, append.prev_log_id, append.leader_commit)
        );
        let mut flipped = on_wire.entries.to_vec();
        flipped[100] ^= 1;
        let bad = pb::AppendEntriesRequest { entries: flipped.into(), ..on_wire.clone() };
        assert!(matches!(append_request_from_wire(bad), Err(WireError::Frame { .. })));
        let short = pb::AppendEntriesRequest { entries: Bytes::from_static(&[1, 2, 3]), ..on_wire.clone() };
        assert!(matches!(append_request_from_wire(short), Err(WireError::Frame { .. })));
        let no_vote = pb::AppendEntriesRequest { vote: None, ..on_wire };
        assert!(matches!(append_request_from_wire(no_vote), Err(WireError::Missing { field: "vote", .. })));

        for r in [
            AppendEntriesResponse::Success,
            AppendEntriesResponse::PartialSuccess(None),
            AppendEntriesResponse::PartialSuccess(Some(log_id(3, 1, 11))),
            AppendEntriesResponse::Conflict,
            AppendEntriesResponse::HigherVote(Vote::new(4, 2)),
        ] {
            assert_eq!(append_response_from_wire(&append_response_to_wire(&r)).unwrap(), r);
        }
        assert!(append_response_from_wire(&pb::AppendEntriesResponse::default()).is_err());

        let mut v = VoteRequest::new(Vote::new(4, 2), None);
        v.leadership_transfer = true;
        assert_eq!(vote_request_from_wire(&vote_request_to_wire(1, 2, &v)).unwrap(), v);
        assert!(vote_request_from_wire(&pb::VoteRequest::default()).is_err());
        let answer = VoteResponse::new(vote, Some(log_id(3, 1, 12)), true);
        assert_eq!(vote_response_from_wire(&vote_response_to_wire(&answer)).unwrap(), answer);
        assert!(vote_response_from_wire(&pb::VoteResponse::default()).is_err());

        let t = TransferLeaderRequest::new(vote, 2, Some(log_id(3, 1, 12)));
        assert_eq!(transfer_request_from_wire(&transfer_request_to_wire(1, 2, &t)).unwrap(), t);
        for r in [
            Ok(()),
            Err(TransferLeaderError::VoteChanged { expected: vote, actual: Vote::new(4, 2) }),
            Err(TransferLeaderError::LogNotFlushed { expected: Some(log_id(3, 1, 12)), actual: None }),
        ] {
            let back = transfer_response_from_wire(&transfer_response_to_wire(&r)).unwrap();
            assert_eq!(format!("{back:?}"), format!("{r:?}"));
        }
        let empty_refusal =
            pb::TransferLeaderResponse { error: None, refused: Some(pb::TransferRefused { reason: None }) };
        assert!(transfer_response_from_wire(&empty_refusal).is_err());

        let meta = SnapshotMeta {
            last_log_id: Some(log_id(3, 1, 12)),
            last_membership: StoredMembership::new(Some(log_id(3, 1, 12)), membership()),
        };
        assert_eq!(snapshot_meta_from_wire(&snapshot_meta_to_wire(&meta)).unwrap(), meta);
        assert!(snapshot_meta_from_wire(&pb::SnapshotMeta::default()).is_err());
        let orphan = pb::Membership { configs: vec![pb::VoterSet { voters: vec![9] }], nodes: Vec::new() };
        assert!(matches!(membership_from_wire(&orphan), Err(WireError::Membership(_))));
    }
}
