//! The peer protocol's decoders: the protobuf messages a broker receives
//! from other brokers (`proto/ferrolog/raft/v1/raft.proto`, decoded by
//! prost as tonic does) turned into the Raft library's types by
//! `ferrolog_raft_store::wire` (AppendEntries with its CRC-checked entry
//! frames, votes, leadership transfers, snapshot metadata, memberships,
//! batches of calls), and the controller's JSON requests and metadata log
//! commands (`ferrolog_broker::metadata::command`, serde_json).
//!
//! Input: a selector byte (low 4 bits: the message; bit 7: recompute the
//! CRC32C of the AppendEntries frames after decoding), then the message.
//! Asserted: no panic; whatever decodes converts back to the same wire
//! message's meaning: from_wire(to_wire(from_wire(m))) == from_wire(m);
//! an AppendEntries' entries re-encode into frames that decode to them.
#![no_main]

use ferrolog_broker::metadata::command::{ControllerRequest, MetadataCommand};
use ferrolog_fuzz::{Input, fixup};
use ferrolog_proto::raft as pb;
use ferrolog_raft_store::wire;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn append_request(mut r: pb::AppendEntriesRequest, fix: bool) {
    if fix {
        let mut e = r.entries.to_vec();
        fixup::frame_crcs(&mut e);
        r.entries = e.into();
    }
    let (group, target) = (r.group_id, r.target_node);
    let Ok(a) = wire::append_request_from_wire(r) else { return };
    let w = wire::append_request_to_wire(group, target, &a).expect("decoded entries encode");
    assert_eq!((w.group_id, w.target_node), (group, target));
    let b = wire::append_request_from_wire(w).expect("an encoded AppendEntries decodes");
    assert_eq!(a.vote, b.vote);
    assert_eq!(a.prev_log_id, b.prev_log_id);
    assert_eq!(a.leader_commit, b.leader_commit);
    assert_eq!(a.entries, b.entries, "entries round trip");
}

fn vote_request(r: &pb::VoteRequest) {
    let Ok(a) = wire::vote_request_from_wire(r) else { return };
    let w = wire::vote_request_to_wire(r.group_id, r.target_node, &a);
    assert_eq!(wire::vote_request_from_wire(&w).expect("round trip"), a);
}

fn json_round_trip<T>(bytes: &[u8])
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let Ok(a) = serde_json::from_slice::<T>(bytes) else { return };
    let json = serde_json::to_vec(&a).expect("a decoded value encodes");
    let b: T = serde_json::from_slice(&json).expect("an encoded value decodes");
    assert_eq!(a, b, "JSON round trip");
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let selector = input.u8();
    let fix = selector & 0x80 != 0;
    let body = input.rest();
    match selector & 0x0f {
        0 => {
            if let Ok(r) = pb::AppendEntriesRequest::decode(body) {
                append_request(r, fix);
            }
        }
        1 => {
            if let Ok(r) = pb::AppendEntriesResponse::decode(body)
                && let Ok(a) = wire::append_response_from_wire(&r)
            {
                let w = wire::append_response_to_wire(&a);
                assert_eq!(wire::append_response_from_wire(&w).expect("round trip"), a);
            }
        }
        2 => {
            if let Ok(r) = pb::VoteRequest::decode(body) {
                vote_request(&r);
            }
        }
        3 => {
            if let Ok(r) = pb::VoteResponse::decode(body)
                && let Ok(a) = wire::vote_response_from_wire(&r)
            {
                let w = wire::vote_response_to_wire(&a);
                assert_eq!(wire::vote_response_from_wire(&w).expect("round trip"), a);
            }
        }
        4 => {
            if let Ok(r) = pb::TransferLeaderRequest::decode(body)
                && let Ok(a) = wire::transfer_request_from_wire(&r)
            {
                let w = wire::transfer_request_to_wire(r.group_id, r.target_node, &a);
                assert_eq!(wire::transfer_request_from_wire(&w).expect("round trip"), a);
            }
        }
        5 => {
            if let Ok(r) = pb::TransferLeaderResponse::decode(body)
                && let Ok(a) = wire::transfer_response_from_wire(&r)
            {
                let w = wire::transfer_response_to_wire(&a);
                assert_eq!(wire::transfer_response_from_wire(&w).expect("round trip"), a);
            }
        }
        6 => {
            // The first chunk of a snapshot stream: the leader's vote and the snapshot's metadata.
            if let Ok(c) = pb::SnapshotChunk::decode(body) {
                if let Some(v) = &c.vote {
                    let vote = wire::vote_from_wire(v);
                    assert_eq!(wire::vote_from_wire(&wire::vote_to_wire(&vote)), vote);
                }
                if let Some(m) = &c.meta
                    && let Ok(a) = wire::snapshot_meta_from_wire(m)
                {
                    let w = wire::snapshot_meta_to_wire(&a);
                    assert_eq!(wire::snapshot_meta_from_wire(&w).expect("round trip"), a);
                }
            }
        }
        7 => {
            if let Ok(r) = pb::Membership::decode(body)
                && let Ok(a) = wire::membership_from_wire(&r)
            {
                let w = wire::membership_to_wire(&a);
                assert_eq!(wire::membership_from_wire(&w).expect("round trip"), a);
            }
        }
        8 => {
            if let Ok(r) = pb::StoredMembership::decode(body)
                && let Ok(a) = wire::stored_membership_from_wire(&r)
            {
                let w = wire::stored_membership_to_wire(&a);
                assert_eq!(wire::stored_membership_from_wire(&w).expect("round trip"), a);
            }
        }
        9 => {
            // Heartbeats, commit notices and votes of many groups in one Batch RPC.
            if let Ok(b) = pb::BatchRequest::decode(body) {
                for call in b.calls {
                    match call.call {
                        Some(pb::batch_call::Call::AppendEntries(r)) => append_request(r, fix),
                        Some(pb::batch_call::Call::Vote(r) | pb::batch_call::Call::PreVote(r)) => {
                            vote_request(&r)
                        }
                        None => {}
                    }
                }
            }
        }
        10 => {
            // The controller RPC: a forwarded request as JSON.
            if let Ok(c) = pb::ControllerCall::decode(body) {
                json_round_trip::<ControllerRequest>(&c.request_json);
            }
        }
        11 => json_round_trip::<MetadataCommand>(body),
        _ => {}
    }
});
