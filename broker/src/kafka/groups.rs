//! The consumer group APIs, on the coordinator of `crate::coordinator`
//! (Kafka's classic group protocol; the same groups the gRPC API serves).
//!
//! Commits through this listener may move an offset backwards, as Kafka's
//! do (a consumer that seeks back and commits). A simple commit (no
//! member, generation -1) is taken, as Kafka takes it. Member metadata and
//! assignments are passed on as the members sent them (DescribeGroups
//! answers them so); the coordinator reads the subscribed topics out of
//! them for OffsetDelete only.

use std::collections::HashMap;
use std::net::SocketAddr;

use bytes::Bytes;

use kafka_protocol::ResponseError;
use kafka_protocol::messages::delete_groups_request::DeleteGroupsRequest;
use kafka_protocol::messages::delete_groups_response::{DeletableGroupResult, DeleteGroupsResponse};
use kafka_protocol::messages::describe_groups_request::DescribeGroupsRequest;
use kafka_protocol::messages::describe_groups_response::{
    DescribeGroupsResponse, DescribedGroup, DescribedGroupMember,
};
use kafka_protocol::messages::find_coordinator_request::FindCoordinatorRequest;
use kafka_protocol::messages::find_coordinator_response::{Coordinator, FindCoordinatorResponse};
use kafka_protocol::messages::heartbeat_request::HeartbeatRequest;
use kafka_protocol::messages::heartbeat_response::HeartbeatResponse;
use kafka_protocol::messages::join_group_request::JoinGroupRequest;
use kafka_protocol::messages::join_group_response::{JoinGroupResponse, JoinGroupResponseMember};
use kafka_protocol::messages::leave_group_request::LeaveGroupRequest;
use kafka_protocol::messages::leave_group_response::{LeaveGroupResponse, MemberResponse};
use kafka_protocol::messages::list_groups_request::ListGroupsRequest;
use kafka_protocol::messages::list_groups_response::{ListGroupsResponse, ListedGroup};
use kafka_protocol::messages::offset_commit_request::OffsetCommitRequest;
use kafka_protocol::messages::offset_commit_response::{
    OffsetCommitResponse, OffsetCommitResponsePartition, OffsetCommitResponseTopic,
};
use kafka_protocol::messages::offset_delete_request::OffsetDeleteRequest;
use kafka_protocol::messages::offset_delete_response::{
    OffsetDeleteResponse, OffsetDeleteResponsePartition, OffsetDeleteResponseTopic,
};
use kafka_protocol::messages::offset_fetch_request::OffsetFetchRequest;
use kafka_protocol::messages::offset_fetch_response::{
    OffsetFetchResponse, OffsetFetchResponsePartition, OffsetFetchResponseTopic,
};
use kafka_protocol::messages::sync_group_request::SyncGroupRequest;
use kafka_protocol::messages::sync_group_response::SyncGroupResponse;
use kafka_protocol::messages::{BrokerId, GroupId, TopicName};
use kafka_protocol::protocol::StrBytes;

use super::{KafkaService, errors};
use crate::coordinator::CommitRequest;
use crate::coordinator::consumer_protocol;
use crate::coordinator::membership::JoinRequest;
use crate::error::ApiError;

fn s(v: impl Into<String>) -> StrBytes {
    StrBytes::from_string(v.into())
}

/// FindCoordinator key type of a consumer group (1 is a transactional id).
const GROUP_KEY: i8 = 0;

/// Answers FindCoordinator, single (v0–v3) or batched (v4, KIP-699).
pub async fn find_coordinator(
    k: &KafkaService,
    r: FindCoordinatorRequest,
    version: i16,
) -> FindCoordinatorResponse {
    let keys: Vec<StrBytes> = if version >= 4 { r.coordinator_keys.clone() } else { vec![r.key.clone()] };
    let mut found = Vec::with_capacity(keys.len());
    for key in keys {
        let mut c = Coordinator::default().with_key(key.clone()).with_node_id(BrokerId(-1)).with_port(-1);
        let result = if r.key_type != GROUP_KEY {
            Err(ApiError::Invalid("transactions are not supported: no transaction coordinators".into()))
        } else {
            k.core.coordinator.find(&key).await
        };
        match result.and_then(|(_, broker)| {
            let addr = k.core.controller.image().brokers.get(&broker).map(|b| b.kafka_addr.clone());
            addr.and_then(|a| a.parse::<SocketAddr>().ok()).map(|a| (broker, a)).ok_or_else(|| {
                ApiError::CoordinatorNotAvailable(format!("broker {broker} has no Kafka listener registered"))
            })
        }) {
            Ok((broker, addr)) => {
                c = c
                    .with_node_id(BrokerId(broker as i32))
                    .with_host(s(addr.ip().to_string()))
                    .with_port(i32::from(addr.port()));
            }
            Err(e) => {
                c = c.with_error_code(errors::group_code(&e)).with_error_message(Some(s(e.to_string())));
            }
        }
        found.push(c);
    }
    if version >= 4 {
        return FindCoordinatorResponse::default().with_coordinators(found);
    }
    let c = found.pop().unwrap_or_default();
    FindCoordinatorResponse::default()
        .with_error_code(c.error_code)
        .with_error_message(c.error_message)
        .with_node_id(c.node_id)
        .with_host(c.host)
        .with_port(c.port)
}

/// Answers JoinGroup (waits for the rebalance, as Kafka's does).
pub async fn join_group(k: &KafkaService, r: JoinGroupRequest, client_id: &str) -> JoinGroupResponse {
    let req = JoinRequest {
        member_id: r.member_id.to_string(),
        instance_id: r.group_instance_id.map(|i| i.to_string()),
        client_id: client_id.to_owned(),
        session_timeout_ms: r.session_timeout_ms,
        // v0 has no rebalance timeout: Kafka takes the session timeout.
        rebalance_timeout_ms: if r.rebalance_timeout_ms > 0 {
            r.rebalance_timeout_ms
        } else {
            r.session_timeout_ms
        },
        protocol_type: r.protocol_type.to_string(),
        protocols: r.protocols.into_iter().map(|p| (p.name.to_string(), p.metadata)).collect(),
    };
    match k.core.coordinator.join(&r.group_id, req).await {
        Ok(j) => JoinGroupResponse::default()
            .with_generation_id(j.generation)
            .with_protocol_type(Some(r.protocol_type))
            .with_protocol_name(Some(s(j.protocol)))
            .with_leader(s(j.leader))
            .with_member_id(s(j.member_id))
            .with_members(
                j.members
                    .into_iter()
                    .map(|(id, instance, metadata)| {
                        JoinGroupResponseMember::default()
                            .with_member_id(s(id))
                            .with_group_instance_id(instance.map(s))
                            .with_metadata(metadata)
                    })
                    .collect(),
            ),
        Err(e) => JoinGroupResponse::default()
            .with_error_code(errors::group_code(&e))
            .with_generation_id(-1)
            .with_member_id(r.member_id),
    }
}

/// Answers SyncGroup.
pub async fn sync_group(k: &KafkaService, r: SyncGroupRequest) -> SyncGroupResponse {
    let assignments = r.assignments.into_iter().map(|a| (a.member_id.to_string(), a.assignment)).collect();
    let instance = r.group_instance_id.as_ref().map(|i| i.to_string());
    match k
        .core
        .coordinator
        .sync(&r.group_id, r.generation_id, &r.member_id, instance.as_deref(), assignments)
        .await
    {
        Ok(x) => SyncGroupResponse::default()
            .with_protocol_type(r.protocol_type)
            .with_protocol_name(Some(s(x.protocol)))
            .with_assignment(x.assignment),
        Err(e) => SyncGroupResponse::default().with_error_code(errors::group_code(&e)),
    }
}

/// Answers Heartbeat.
pub async fn heartbeat(k: &KafkaService, r: HeartbeatRequest) -> HeartbeatResponse {
    let instance = r.group_instance_id.as_ref().map(|i| i.to_string());
    let result =
        k.core.coordinator.heartbeat(&r.group_id, r.generation_id, &r.member_id, instance.as_deref()).await;
    HeartbeatResponse::default()
        .with_error_code(result.err().map_or(errors::NONE, |e| errors::group_code(&e)))
}

/// Answers LeaveGroup: one member (v0–v2) or several (v3+, KIP-345).
pub async fn leave_group(k: &KafkaService, r: LeaveGroupRequest, version: i16) -> LeaveGroupResponse {
    if version < 3 {
        let result = k.core.coordinator.leave(&r.group_id, &r.member_id, None).await;
        return LeaveGroupResponse::default()
            .with_error_code(result.err().map_or(errors::NONE, |e| errors::group_code(&e)));
    }
    let mut members = Vec::with_capacity(r.members.len());
    for m in r.members {
        let instance = m.group_instance_id.as_ref().map(|i| i.to_string());
        let result = k.core.coordinator.leave(&r.group_id, &m.member_id, instance.as_deref()).await;
        members.push(
            MemberResponse::default()
                .with_member_id(m.member_id)
                .with_group_instance_id(m.group_instance_id)
                .with_error_code(result.err().map_or(errors::NONE, |e| errors::group_code(&e))),
        );
    }
    LeaveGroupResponse::default().with_members(members)
}

/// Answers OffsetCommit.
pub async fn offset_commit(k: &KafkaService, r: OffsetCommitRequest) -> OffsetCommitResponse {
    let mut offsets = Vec::new();
    let mut refused: Vec<(usize, i32, i16)> = Vec::new();
    for (ti, t) in r.topics.iter().enumerate() {
        for p in &t.partitions {
            match (u32::try_from(p.partition_index), u64::try_from(p.committed_offset)) {
                (Ok(partition), Ok(offset)) => offsets.push((
                    ti,
                    CommitRequest {
                        topic: t.name.0.to_string(),
                        partition,
                        offset,
                        metadata: p.committed_metadata.as_ref().map(|m| m.to_string()).unwrap_or_default(),
                        topic_id: None,
                    },
                )),
                _ => refused.push((ti, p.partition_index, ResponseError::InvalidCommitOffsetSize.code())),
            }
        }
    }
    let instance = r.group_instance_id.as_ref().map(|i| i.to_string());
    let member = (&*r.member_id, instance.as_deref());
    let (tis, commits): (Vec<usize>, Vec<CommitRequest>) = offsets.into_iter().unzip();
    let result =
        k.core.coordinator.commit(&r.group_id, r.generation_id_or_member_epoch, member, commits, true).await;
    let mut topics: Vec<OffsetCommitResponseTopic> =
        r.topics.iter().map(|t| OffsetCommitResponseTopic::default().with_name(t.name.clone())).collect();
    match result {
        Ok(results) => {
            for (ti, (c, e)) in tis.into_iter().zip(results) {
                topics[ti].partitions.push(
                    OffsetCommitResponsePartition::default()
                        .with_partition_index(c.partition as i32)
                        .with_error_code(e.map_or(errors::NONE, |e| errors::group_code(&e))),
                );
            }
        }
        Err(e) => {
            let code = errors::group_code(&e);
            for (ti, t) in r.topics.iter().enumerate() {
                for p in &t.partitions {
                    topics[ti].partitions.push(
                        OffsetCommitResponsePartition::default()
                            .with_partition_index(p.partition_index)
                            .with_error_code(code),
                    );
                }
            }
            refused.clear();
        }
    }
    for (ti, index, code) in refused {
        topics[ti]
            .partitions
            .push(OffsetCommitResponsePartition::default().with_partition_index(index).with_error_code(code));
    }
    OffsetCommitResponse::default().with_topics(topics)
}

/// Answers OffsetFetch (one group, v1–v7); no topics (v2+) is every
/// partition the group has committed. A partition without a commit is
/// offset -1.
pub async fn offset_fetch(k: &KafkaService, r: OffsetFetchRequest, version: i16) -> OffsetFetchResponse {
    let asked: Vec<(String, u32, Option<ferrolog_proto::TopicId>)> = r
        .topics
        .iter()
        .flatten()
        .flat_map(|t| {
            t.partition_indexes
                .iter()
                .filter_map(|p| u32::try_from(*p).ok())
                .map(|p| (t.name.0.to_string(), p, None))
        })
        .collect();
    if r.topics.as_ref().is_some_and(Vec::is_empty) {
        // An empty list asks for nothing (null asks for everything).
        return OffsetFetchResponse::default();
    }
    match k.core.coordinator.fetch(&r.group_id, asked).await {
        Ok(offsets) => {
            let mut topics: Vec<OffsetFetchResponseTopic> = Vec::new();
            for c in offsets {
                if topics.last().is_none_or(|t| *t.name.0 != *c.topic) {
                    topics.push(OffsetFetchResponseTopic::default().with_name(TopicName(s(c.topic.clone()))));
                }
                let (offset, metadata) = match c.committed {
                    Some(v) => (i64::try_from(v.offset).unwrap_or(-1), v.metadata),
                    None => (-1, String::new()),
                };
                if let Some(t) = topics.last_mut() {
                    t.partitions.push(
                        OffsetFetchResponsePartition::default()
                            .with_partition_index(c.partition as i32)
                            .with_committed_offset(offset)
                            .with_committed_leader_epoch(-1)
                            .with_metadata(Some(s(metadata))),
                    );
                }
            }
            OffsetFetchResponse::default().with_topics(topics)
        }
        Err(e) => {
            let code = errors::group_code(&e);
            if version >= 2 {
                return OffsetFetchResponse::default().with_error_code(code);
            }
            // v1 carries errors per partition only.
            let topics = r
                .topics
                .into_iter()
                .flatten()
                .map(|t| {
                    let parts = t
                        .partition_indexes
                        .iter()
                        .map(|p| {
                            OffsetFetchResponsePartition::default()
                                .with_partition_index(*p)
                                .with_committed_offset(-1)
                                .with_error_code(code)
                        })
                        .collect();
                    OffsetFetchResponseTopic::default().with_name(t.name).with_partitions(parts)
                })
                .collect();
            OffsetFetchResponse::default().with_topics(topics)
        }
    }
}

/// Answers ListGroups, filtered by state (v4) when asked.
pub async fn list_groups(k: &KafkaService, r: ListGroupsRequest) -> ListGroupsResponse {
    let (listed, error) = k.core.coordinator.list().await;
    let groups = listed
        .into_iter()
        .filter(|g| {
            r.states_filter.is_empty() || r.states_filter.iter().any(|f| f.eq_ignore_ascii_case(g.state))
        })
        .map(|g| {
            ListedGroup::default()
                .with_group_id(GroupId(s(g.group)))
                .with_protocol_type(s(g.protocol_type))
                .with_group_state(StrBytes::from_static_str(g.state))
        })
        .collect();
    ListGroupsResponse::default()
        .with_error_code(error.map_or(errors::NONE, |e| errors::group_code(&e)))
        .with_groups(groups)
}

/// Answers DescribeGroups; a group that does not exist is `Dead`, as Kafka
/// answers it.
pub async fn describe_groups(k: &KafkaService, r: DescribeGroupsRequest) -> DescribeGroupsResponse {
    let mut out = Vec::with_capacity(r.groups.len());
    for g in r.groups {
        let d = DescribedGroup::default().with_group_id(g.clone()).with_authorized_operations(i32::MIN);
        out.push(match k.core.coordinator.describe(&g).await {
            Ok(desc) => {
                // As Kafka's GroupMetadata.summary: the protocol, metadata
                // and assignments only of a Stable group; a consumer group's
                // in Kafka's encoding (the client library's converted).
                let stable = desc.state == "Stable";
                let consumer = desc.protocol_type == "consumer";
                let members = desc
                    .members
                    .into_iter()
                    .map(|m| {
                        let (metadata, assignment) = match (stable, consumer) {
                            (false, _) => (Bytes::new(), Bytes::new()),
                            (true, true) => (
                                consumer_protocol::kafka_subscription(&m.metadata),
                                consumer_protocol::kafka_assignment(&m.assignment),
                            ),
                            (true, false) => (m.metadata, m.assignment),
                        };
                        DescribedGroupMember::default()
                            .with_member_id(s(m.id))
                            .with_group_instance_id(m.instance_id.map(s))
                            .with_client_id(s(m.client_id))
                            .with_member_metadata(metadata)
                            .with_member_assignment(assignment)
                    })
                    .collect();
                d.with_group_state(StrBytes::from_static_str(desc.state))
                    .with_protocol_type(s(desc.protocol_type))
                    .with_protocol_data(if stable { s(desc.protocol) } else { StrBytes::default() })
                    .with_members(members)
            }
            Err(ApiError::GroupIdNotFound(_)) => d.with_group_state(StrBytes::from_static_str("Dead")),
            // (error_message exists from v6 only; v0–v5 are served.)
            Err(e) => d.with_error_code(errors::group_code(&e)),
        });
    }
    DescribeGroupsResponse::default().with_groups(out)
}

/// Answers DeleteGroups.
pub async fn delete_groups(k: &KafkaService, r: DeleteGroupsRequest) -> DeleteGroupsResponse {
    let mut out = Vec::with_capacity(r.groups_names.len());
    for g in r.groups_names {
        let result = k.core.coordinator.delete(&g).await;
        out.push(
            DeletableGroupResult::default()
                .with_group_id(g)
                .with_error_code(result.err().map_or(errors::NONE, |e| errors::group_code(&e))),
        );
    }
    DeleteGroupsResponse::default().with_results(out)
}

/// Answers OffsetDelete (KIP-496). A topic or partition this broker's
/// metadata does not know is answered `UNKNOWN_TOPIC_OR_PARTITION`; the
/// coordinator is asked for the rest (even none, so group-level errors
/// come back as Kafka gives them). A topic named twice is answered once,
/// its partitions in the order asked.
pub async fn offset_delete(k: &KafkaService, r: OffsetDeleteRequest) -> OffsetDeleteResponse {
    /// A partition's code until the coordinator has answered.
    const ASKED: i16 = i16::MIN;
    let image = k.core.controller.image();
    let mut topics: Vec<OffsetDeleteResponseTopic> = Vec::new();
    // Parallel to `topics`: the partitions the coordinator is asked about.
    let mut asked: Vec<(String, Vec<u32>)> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    for t in &r.topics {
        let i = *at.entry(t.name.as_str()).or_insert_with(|| {
            topics.push(OffsetDeleteResponseTopic::default().with_name(t.name.clone()));
            asked.push((t.name.to_string(), Vec::new()));
            topics.len() - 1
        });
        let count = image.topics.get(t.name.as_str()).map_or(0, |e| e.partitions.len());
        for p in &t.partitions {
            let code = match u32::try_from(p.partition_index) {
                Ok(index) if (index as usize) < count => {
                    asked[i].1.push(index);
                    ASKED
                }
                _ => ResponseError::UnknownTopicOrPartition.code(),
            };
            topics[i].partitions.push(
                OffsetDeleteResponsePartition::default()
                    .with_partition_index(p.partition_index)
                    .with_error_code(code),
            );
        }
    }
    let results = match k.core.coordinator.delete_offsets(&r.group_id, &asked).await {
        Ok(results) => results,
        Err(e) => return OffsetDeleteResponse::default().with_error_code(errors::group_code(&e)),
    };
    debug_assert_eq!(results.len(), topics.len(), "one answer list per topic asked");
    for (topic, codes) in topics.iter_mut().zip(results) {
        let mut codes = codes.into_iter();
        for p in topic.partitions.iter_mut().filter(|p| p.error_code == ASKED) {
            p.error_code = match codes.next() {
                Some(None) => errors::NONE,
                Some(Some(e)) => errors::group_code(&e),
                // Never: the coordinator answers every partition asked.
                None => ResponseError::UnknownServerError.code(),
            };
        }
    }
    // Never: every topic was answered above.
    for p in topics.iter_mut().flat_map(|t| t.partitions.iter_mut()).filter(|p| p.error_code == ASKED) {
        p.error_code = ResponseError::UnknownServerError.code();
    }
    OffsetDeleteResponse::default().with_topics(topics)
}
