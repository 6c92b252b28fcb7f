//! The records of `__consumer_offsets`: keys and values in the protobuf
//! messages of `proto/ferrolog/groups/v1/offsets.proto`, to and from the
//! client API's [`Record`].
//!
//! A key's bytes must be the same every time the same key is written:
//! compaction keeps the last record per key by comparing bytes. prost
//! encodes fields in field-number order and has no maps here, so one key
//! always encodes the same.

use bytes::Bytes;
use ferrolog_proto::TopicId;
use ferrolog_proto::client::Record;
use ferrolog_proto::groups::{
    GroupMemberRecord, GroupMetadataKey, GroupMetadataValue, OffsetCommitKey, OffsetCommitValue, OffsetsKey,
    offsets_key,
};
use prost::Message;

/// A committed offset as stored (Kafka's OffsetCommitValue).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    /// The next offset the group will read.
    pub offset: u64,
    /// The commit's free-text metadata.
    pub metadata: String,
    /// When it was committed, ms since the Unix epoch.
    pub commit_timestamp_ms: i64,
    /// The topic's id (KIP-516) at commit time; `None` in a record that
    /// carries none (never written so: every commit names the id).
    pub topic_id: Option<TopicId>,
}

/// A group's membership record as stored (Kafka's GroupMetadataValue).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct GroupMeta {
    /// The generation of the last rebalance.
    pub generation: i32,
    /// The assignor in use.
    pub protocol: String,
    /// When the group last changed state, ms since the Unix epoch.
    pub state_timestamp_ms: i64,
    /// The members' protocol type ("consumer").
    pub protocol_type: String,
    /// The leader member's id.
    pub leader: String,
    /// The generation's members.
    pub members: Vec<MemberMeta>,
    /// Whether the leader's assignment is in (the generation is Stable).
    pub assignment_complete: bool,
}

/// One member in a [`GroupMeta`].
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct MemberMeta {
    /// Member id.
    pub id: String,
    /// Static membership's instance id (KIP-345).
    pub instance_id: Option<String>,
    /// The client's self-given name.
    pub client_id: String,
    /// Session timeout, ms.
    pub session_timeout_ms: i32,
    /// Rebalance timeout, ms.
    pub rebalance_timeout_ms: i32,
    /// Its metadata for the chosen protocol.
    pub subscription: Bytes,
    /// Its assignment (empty until the generation is complete).
    pub assignment: Bytes,
}

/// One decoded record of `__consumer_offsets`; `None` values are tombstones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A committed offset of `group` for `topic`'s `partition`.
    Offset {
        /// Group id.
        group: String,
        /// Topic name.
        topic: String,
        /// Partition number.
        partition: u32,
        /// The offset, or `None`: deleted.
        value: Option<Committed>,
    },
    /// A group's membership record.
    Group {
        /// Group id.
        group: String,
        /// The record, or `None`: deleted.
        value: Option<GroupMeta>,
    },
    /// A key of a kind this version does not know (written by a later
    /// version): skipped.
    Unknown,
}

/// The record storing `value` (a tombstone for `None`) for the offset of
/// `group` on `topic`'s `partition`, stamped `now_ms`.
pub fn offset_record(
    group: &str,
    topic: &str,
    partition: u32,
    value: Option<&Committed>,
    now_ms: i64,
) -> Record {
    let key = OffsetsKey {
        kind: Some(offsets_key::Kind::Offset(OffsetCommitKey {
            group_id: group.to_owned(),
            topic: topic.to_owned(),
            partition,
        })),
    };
    let value = value.map(|c| OffsetCommitValue {
        offset: c.offset,
        metadata: c.metadata.clone(),
        commit_timestamp_ms: c.commit_timestamp_ms,
        topic_id: c.topic_id.map(TopicId::to_wire).unwrap_or_default(),
    });
    record(key, value.map(|v| v.encode_to_vec()), now_ms)
}

/// The record storing `value` (a tombstone for `None`) as `group`'s
/// membership record, stamped `now_ms`.
pub fn group_record(group: &str, value: Option<&GroupMeta>, now_ms: i64) -> Record {
    let key =
        OffsetsKey { kind: Some(offsets_key::Kind::Group(GroupMetadataKey { group_id: group.to_owned() })) };
    let value = value.map(|g| GroupMetadataValue {
        generation_id: g.generation,
        protocol: g.protocol.clone(),
        state_timestamp_ms: g.state_timestamp_ms,
        protocol_type: g.protocol_type.clone(),
        leader: g.leader.clone(),
        members: g
            .members
            .iter()
            .map(|m| GroupMemberRecord {
                member_id: m.id.clone(),
                group_instance_id: m.instance_id.clone(),
                client_id: m.client_id.clone(),
                session_timeout_ms: m.session_timeout_ms,
                rebalance_timeout_ms: m.rebalance_timeout_ms,
                subscription: m.subscription.clone(),
                assignment: m.assignment.clone(),
            })
            .collect(),
        assignment_complete: g.assignment_complete,
    });
    record(key, value.map(|v| v.encode_to_vec()), now_ms)
}

fn record(key: OffsetsKey, value: Option<Vec<u8>>, now_ms: i64) -> Record {
    Record {
        key: Some(Bytes::from(key.encode_to_vec())),
        null_value: value.is_none(),
        value: value.map(Bytes::from).unwrap_or_default(),
        headers: Vec::new(),
        timestamp_ms: now_ms,
        offset_delta: None,
    }
}

/// Decodes a stored record.
///
/// # Errors
/// A record without a key, or whose key or value does not decode (the
/// topic is written only by coordinators, and its batches passed their
/// CRC: this is a bug or another program's record), described.
pub fn decode(r: &Record) -> Result<Entry, String> {
    let key = r.key.as_ref().ok_or("a record without a key")?;
    let key = OffsetsKey::decode(key.as_ref()).map_err(|e| format!("a key that does not decode: {e}"))?;
    match key.kind {
        None => Ok(Entry::Unknown),
        Some(offsets_key::Kind::Offset(k)) => {
            let value = if r.null_value {
                None
            } else {
                let v = OffsetCommitValue::decode(r.value.as_ref())
                    .map_err(|e| format!("an offset value that does not decode: {e}"))?;
                let topic_id = if v.topic_id.is_empty() {
                    None
                } else {
                    TopicId::from_wire(&v.topic_id).map_err(|e| format!("an offset value's topic id: {e}"))?
                };
                Some(Committed {
                    offset: v.offset,
                    metadata: v.metadata,
                    commit_timestamp_ms: v.commit_timestamp_ms,
                    topic_id,
                })
            };
            Ok(Entry::Offset { group: k.group_id, topic: k.topic, partition: k.partition, value })
        }
        Some(offsets_key::Kind::Group(k)) => {
            let value = if r.null_value {
                None
            } else {
                let v = GroupMetadataValue::decode(r.value.as_ref())
                    .map_err(|e| format!("a group value that does not decode: {e}"))?;
                Some(GroupMeta {
                    generation: v.generation_id,
                    protocol: v.protocol,
                    state_timestamp_ms: v.state_timestamp_ms,
                    protocol_type: v.protocol_type,
                    leader: v.leader,
                    members: v
                        .members
                        .into_iter()
                        .map(|m| MemberMeta {
                            id: m.member_id,
                            instance_id: m.group_instance_id,
                            client_id: m.client_id,
                            session_timeout_ms: m.session_timeout_ms,
                            rebalance_timeout_ms: m.rebalance_timeout_ms,
                            subscription: m.subscription,
                            assignment: m.assignment,
                        })
                        .collect(),
                    assignment_complete: v.assignment_complete,
                })
            };
            Ok(Entry::Group { group: k.group_id, value })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_and_groups_round_trip_and_tombstones_decode_as_none() {
        let c = Committed {
            offset: 42,
            metadata: "m".into(),
            commit_timestamp_ms: 1_700_000_000_000,
            topic_id: Some(TopicId(7 << 100)),
        };
        let r = offset_record("g", "t", 3, Some(&c), 5);
        assert_eq!(r.timestamp_ms, 5);
        let want = Entry::Offset { group: "g".into(), topic: "t".into(), partition: 3, value: Some(c) };
        assert_eq!(decode(&r).unwrap(), want);
        let t = offset_record("g", "t", 3, None, 5);
        assert!(t.null_value && t.value.is_empty());
        assert_eq!(
            decode(&t).unwrap(),
            Entry::Offset { group: "g".into(), topic: "t".into(), partition: 3, value: None }
        );
        // The tombstone's key is the same bytes: compaction removes the offset.
        assert_eq!(t.key, r.key);
        let m = GroupMeta {
            generation: 4,
            protocol: "range".into(),
            state_timestamp_ms: 9,
            protocol_type: "consumer".into(),
            leader: "m-1".into(),
            members: vec![MemberMeta {
                id: "m-1".into(),
                instance_id: Some("i".into()),
                client_id: "c".into(),
                session_timeout_ms: 6000,
                rebalance_timeout_ms: 9000,
                subscription: Bytes::from_static(b"s"),
                assignment: Bytes::from_static(b"a"),
            }],
            assignment_complete: true,
        };
        assert_eq!(
            decode(&group_record("g", Some(&m), 1)).unwrap(),
            Entry::Group { group: "g".into(), value: Some(m) }
        );
        assert_eq!(
            decode(&group_record("g", None, 1)).unwrap(),
            Entry::Group { group: "g".into(), value: None }
        );
    }

    /// The key bytes are pinned: a change would make compaction keep two
    /// records for one key across an upgrade.
    #[test]
    fn key_bytes_are_pinned() {
        let r = offset_record("g1", "t", 2, None, 0);
        assert_eq!(r.key.unwrap().as_ref(), b"\x0a\x09\x0a\x02g1\x12\x01t\x18\x02");
        let r = group_record("g1", None, 0);
        assert_eq!(r.key.unwrap().as_ref(), b"\x12\x04\x0a\x02g1");
    }

    #[test]
    fn garbage_is_an_error_and_unknown_kinds_are_skipped() {
        let mut r = offset_record("g", "t", 0, None, 0);
        r.key = Some(Bytes::from_static(b"\xff\xff"));
        assert!(decode(&r).is_err());
        r.key = None;
        assert!(decode(&r).is_err());
        // Field 9: a key kind from a later version.
        r.key = Some(Bytes::from_static(b"\x4a\x00"));
        assert_eq!(decode(&r).unwrap(), Entry::Unknown);
    }
}
