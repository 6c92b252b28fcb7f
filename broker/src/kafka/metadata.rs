//! Metadata: brokers (their Kafka listeners), topics, partition leaders,
//! replicas and in-sync replicas, the controller.

use kafka_protocol::ResponseError;
use kafka_protocol::messages::metadata_request::MetadataRequest;
use kafka_protocol::messages::metadata_response::{
    MetadataResponse, MetadataResponseBroker, MetadataResponsePartition, MetadataResponseTopic,
};
use kafka_protocol::messages::{BrokerId, TopicName};
use kafka_protocol::protocol::StrBytes;
use uuid::Uuid;

use super::KafkaService;
use super::errors;
use crate::config::BrokerId as BrokerIdNum;
use crate::coordinator::OFFSETS_TOPIC;
use crate::metadata::command::PartitionAssignment;
use crate::metadata::image::MetadataImage;

/// Cluster id reported to clients (Ferrolog has one cluster per metadata
/// group and no id of its own yet).
const CLUSTER_ID: &str = "ferrolog";

/// Answers Metadata. Topics not found are `UNKNOWN_TOPIC_OR_PARTITION`:
/// topics are not created by a Metadata request (Kafka's
/// `auto.create.topics.enable=false`). Brokers without a Kafka listener are
/// left out, and so are brokers this one does not hear from (Kafka lists
/// live brokers only; their replicas show as offline). A partition's leader epoch is -1 (not reported), so clients
/// skip the epoch checks of KIP-320.
pub async fn metadata(s: &KafkaService, r: MetadataRequest, version: i16) -> MetadataResponse {
    let core = &s.core;
    let image = core.controller.image();
    let brokers = listed_brokers(s, &image);
    // v0: an empty list means all topics; v1+: null means all, empty none.
    // From v10 a topic may be named by its id alone (KIP-516): one the
    // image does not hold is answered UNKNOWN_TOPIC_ID with that id.
    let mut topics = Vec::new();
    let mut by_id: Option<std::collections::HashMap<u128, &String>> = None;
    let names: Vec<String> = match r.topics {
        None => image.topics.keys().cloned().collect(),
        Some(t) if t.is_empty() && version == 0 => image.topics.keys().cloned().collect(),
        Some(t) => t
            .into_iter()
            .filter_map(|t| match t.name {
                Some(n) => Some(n.0.to_string()),
                None => {
                    let ids = by_id.get_or_insert_with(|| {
                        image.topics.iter().map(|(name, e)| (e.topic_id.0, name)).collect()
                    });
                    let found = ids.get(&t.topic_id.as_u128()).map(|name| (*name).clone());
                    if found.is_none() {
                        topics.push(
                            MetadataResponseTopic::default()
                                .with_topic_id(t.topic_id)
                                .with_error_code(ResponseError::UnknownTopicId.code()),
                        );
                    }
                    found
                }
            })
            .collect(),
    };
    let listed = ids(&brokers);
    topics.reserve(names.len());
    for name in names {
        let mut t = MetadataResponseTopic::default()
            .with_name(Some(TopicName(StrBytes::from_string(name.clone()))))
            .with_is_internal(name == OFFSETS_TOPIC);
        match image.topics.get(&name) {
            None => {
                t.error_code = ResponseError::UnknownTopicOrPartition.code();
            }
            Some(entry) => {
                t.topic_id = Uuid::from_u128(entry.topic_id.0);
                t.partitions =
                    entry.partitions.iter().enumerate().map(|(i, a)| partition(s, i, a, &listed)).collect();
            }
        }
        topics.push(t);
    }
    // Only a listed broker can be named (the Java admin client sends
    // controller calls to it).
    let controller = core
        .controller
        .leader()
        .and_then(|c| i32::try_from(c).ok())
        .filter(|c| listed.contains(c))
        .unwrap_or(-1);
    MetadataResponse::default()
        .with_brokers(brokers)
        .with_cluster_id(Some(StrBytes::from_static_str(CLUSTER_ID)))
        .with_controller_id(BrokerId(controller))
        .with_topics(topics)
}

/// The brokers a Metadata answer lists: live ones only, as Kafka lists
/// them (a client must not pick a dead one to bootstrap from or to ask for
/// a coordinator), with a Kafka listener.
fn listed_brokers(s: &KafkaService, image: &MetadataImage) -> Vec<MetadataResponseBroker> {
    let core = &s.core;
    image
        .brokers
        .iter()
        .filter(|(id, _)| **id == core.broker || core.liveness.is_alive(**id))
        .filter_map(|(id, b)| {
            let addr: std::net::SocketAddr = b.kafka_addr.parse().ok()?;
            Some(
                MetadataResponseBroker::default()
                    .with_node_id(BrokerId(i32::try_from(*id).ok()?))
                    .with_host(StrBytes::from_string(addr.ip().to_string()))
                    .with_port(i32::from(addr.port())),
            )
        })
        .collect()
}

fn ids(brokers: &[MetadataResponseBroker]) -> Vec<i32> {
    brokers.iter().map(|b| b.node_id.0).collect()
}

/// The ids of the brokers a Metadata answer from this broker lists now
/// ([`named_leader`] takes them).
pub(super) fn listed_ids(s: &KafkaService, image: &MetadataImage) -> Vec<i32> {
    ids(&listed_brokers(s, image))
}

/// The leader a Metadata answer names for partition `a`, or 0 for none: a
/// leader is named only if it is `listed` (clients look the id up among the
/// brokers; kafka-python's sender stops on one it cannot find), so one this
/// broker does not hear from (its view not updated yet after the leader
/// died) is no leader to send to.
pub(super) fn named_leader(s: &KafkaService, a: &PartitionAssignment, listed: &[i32]) -> BrokerIdNum {
    let leader = s.core.leader_of(a);
    if listed.contains(&(leader as i32)) { leader } else { 0 }
}

/// One partition: leader (-1 and `LEADER_NOT_AVAILABLE` when none is
/// known or it is not among the `listed` brokers), replicas, and in-sync replicas. This broker, when it leads,
/// counts a replica in sync when its log matches up to the commit index;
/// for a partition led elsewhere it lists the replicas whose brokers are
/// alive (the leader's own view is on the leader).
fn partition(
    s: &KafkaService,
    index: usize,
    a: &PartitionAssignment,
    listed: &[i32],
) -> MetadataResponsePartition {
    let core = &s.core;
    let leader = named_leader(s, a, listed);
    let replicas: Vec<BrokerId> = a.replicas.iter().map(|r| BrokerId(r.broker as i32)).collect();
    let isr: Vec<BrokerId> =
        match core.groups.partition_of(a.group).filter(|p| p.leader_broker() == Some(core.broker)) {
            Some(p) => {
                let st = p.status();
                let mut isr = vec![BrokerId(core.broker as i32)];
                isr.extend(
                    st.followers
                        .iter()
                        .filter(|f| !f.learner && f.matched.is_some_and(|m| m >= st.commit_index))
                        .map(|f| BrokerId(f.broker as i32)),
                );
                isr
            }
            None => a
                .replicas
                .iter()
                .filter(|r| r.broker == core.broker || core.liveness.is_alive(r.broker))
                .map(|r| BrokerId(r.broker as i32))
                .collect(),
        };
    let offline: Vec<BrokerId> = a
        .replicas
        .iter()
        .filter(|r| r.broker != core.broker && !core.liveness.is_alive(r.broker))
        .map(|r| BrokerId(r.broker as i32))
        .collect();
    let mut p = MetadataResponsePartition::default()
        .with_partition_index(index as i32)
        .with_leader_id(BrokerId(if leader == 0 { -1 } else { leader as i32 }))
        .with_leader_epoch(-1)
        .with_replica_nodes(replicas)
        .with_isr_nodes(isr)
        .with_offline_replicas(offline);
    if leader == 0 {
        p.error_code = ResponseError::LeaderNotAvailable.code();
    } else {
        p.error_code = errors::NONE;
    }
    p
}
