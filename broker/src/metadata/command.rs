//! The commands of the metadata log, and the requests brokers forward to
//! the controller.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::BrokerId;
use ferrolog_proto::TopicId;
use ferrolog_raft_store::types::NodeId;

/// One replica of a partition: the broker that hosts it and its Raft node
/// id in the partition's group (unique within the group, never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReplicaAssignment {
    /// Hosting broker.
    pub broker: BrokerId,
    /// Raft node id in the partition's group.
    pub node: NodeId,
}

/// Placement of one partition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionAssignment {
    /// The partition's Raft group id.
    pub group: u64,
    /// Current replicas; the first is the preferred leader.
    pub replicas: Vec<ReplicaAssignment>,
    /// Node ids of the founding replicas: only these may initialize the
    /// group (a replica added later joins through the leader).
    pub initial: Vec<NodeId>,
    /// The reassignment under way, if any (KIP-455). While one runs,
    /// `replicas` holds the target replicas first, in the target's order,
    /// then the replicas being removed: every one of them hosts the group
    /// until the partition's leader has changed the voters to the target
    /// and the controller has committed the completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reassignment: Option<Reassignment>,
}

/// A partition reassignment in progress, as the metadata log recorded it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reassignment {
    /// The brokers the partition moves to, in order (the first is the
    /// preferred leader once it completes).
    pub target: Vec<BrokerId>,
    /// The brokers it had when the reassignment began, in order: what a
    /// cancellation goes back to.
    pub original: Vec<BrokerId>,
    /// Whether it was cancelled: `target` is then `original`, and the
    /// replicas that were being added are removed once the voters are back.
    #[serde(default)]
    pub cancelled: bool,
    /// Metadata log offset of the command that set the current target (the
    /// start, or the cancellation): a completion names it, so a late report
    /// about an earlier target never completes a later one.
    pub epoch: u64,
}

impl PartitionAssignment {
    /// The replicas the partition's Raft voters should be now: the target
    /// of a reassignment under way, else every replica.
    pub fn wanted_replicas(&self) -> Vec<ReplicaAssignment> {
        match &self.reassignment {
            Some(r) => r
                .target
                .iter()
                .filter_map(|b| self.replicas.iter().find(|x| x.broker == *b).copied())
                .collect(),
            None => self.replicas.clone(),
        }
    }

    /// Brokers whose replicas a reassignment under way adds (in the target,
    /// not in the original set); empty when none runs.
    pub fn adding(&self) -> Vec<BrokerId> {
        self.reassignment
            .as_ref()
            .map_or_else(Vec::new, |r| r.target.iter().copied().filter(|b| !r.original.contains(b)).collect())
    }

    /// Brokers whose replicas a reassignment under way removes (in the
    /// current replicas, not in the target); empty when none runs.
    pub fn removing(&self) -> Vec<BrokerId> {
        self.reassignment.as_ref().map_or_else(Vec::new, |r| {
            self.replicas.iter().map(|x| x.broker).filter(|b| !r.target.contains(b)).collect()
        })
    }
}

/// A change to the cluster metadata; the value of one metadata log record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum MetadataCommand {
    /// A broker announced (or changed) its addresses.
    BrokerRegistered {
        /// Broker id.
        id: BrokerId,
        /// Client API address.
        client_addr: String,
        /// Peer (Raft) address.
        peer_addr: String,
        /// The data directory's incarnation (`crate::identity`).
        #[serde(default)]
        incarnation: u64,
        /// Kafka listener address, `host:port`; empty when the broker runs
        /// none (or predates it).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        kafka_addr: String,
    },
    /// A broker came back with a new data directory: it gets a new node id
    /// in the metadata group and in every partition it hosts; leaders then
    /// swap the old node ids out of their groups.
    BrokerReplaced {
        /// Broker id.
        id: BrokerId,
        /// The new incarnation.
        incarnation: u64,
        /// Client API address.
        client_addr: String,
        /// Peer address.
        peer_addr: String,
        /// New node id in the metadata group.
        metadata_node: NodeId,
        /// (group, old node, new node) for each partition replica it hosts.
        replicas: Vec<(u64, NodeId, NodeId)>,
    },
    /// A topic was created with these partitions (index = partition number).
    TopicCreated {
        /// Topic name.
        name: String,
        /// The topic's id (KIP-516), chosen by the controller: a random
        /// version-4 UUID, stored as its text. Absent in commands written
        /// before topic ids: the image then uses the first partition's
        /// group id ([`super::image::fallback_topic_id`]).
        #[serde(default, skip_serializing_if = "Option::is_none", with = "topic_id_text")]
        topic_id: Option<TopicId>,
        /// Replicas per partition.
        replication_factor: u32,
        /// Placement of each partition.
        partitions: Vec<PartitionAssignment>,
        /// Configuration overrides in stored form
        /// (`super::topic_config`); absent when none (and in commands
        /// written before peer protocol 1.8).
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        config: BTreeMap<String, String>,
    },
    /// A topic's configuration overrides changed (Kafka's
    /// IncrementalAlterConfigs, KIP-339): `set` adds or replaces, `delete`
    /// drops. Applied only to the topic of that name whose id is
    /// `topic_id`, so it never reaches a topic deleted and re-created
    /// meanwhile.
    TopicConfigAltered {
        /// Topic name.
        name: String,
        /// The topic's id (KIP-516) when the change was decided.
        #[serde(with = "topic_id_text::required")]
        topic_id: TopicId,
        /// Keys set, in stored form.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        set: BTreeMap<String, String>,
        /// Keys deleted (back to the broker default).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        delete: Vec<String>,
    },
    /// A topic was deleted; its partitions' data is removed from every broker.
    TopicDeleted {
        /// Topic name.
        name: String,
    },
    /// Partitions were added to a topic (Kafka's CreatePartitions, KIP-195):
    /// `partitions[i]` becomes partition `first + i`.
    PartitionsCreated {
        /// Topic name.
        name: String,
        /// The topic's partition count before (the first new partition's number).
        first: u32,
        /// Placement of each new partition.
        partitions: Vec<PartitionAssignment>,
    },
    /// A broker that holds no replica left the cluster for good: it is
    /// never placed on again, and its node leaves the metadata group's
    /// voters (the controller quorum).
    BrokerDecommissioned {
        /// Broker id.
        id: BrokerId,
    },
    /// A reassignment of one partition began (KIP-455): the target's new
    /// replicas get fresh node ids and host the group beside the old ones.
    ReassignmentStarted {
        /// The partition's Raft group id.
        group: u64,
        /// The target replicas in order: kept ones with their node ids,
        /// added ones with new node ids.
        target: Vec<ReplicaAssignment>,
    },
    /// A reassignment under way was cancelled: it now goes back to the
    /// replicas it started from.
    ReassignmentCancelled {
        /// The partition's Raft group id.
        group: u64,
    },
    /// The partition's voters are the reassignment's target (reported by
    /// its leader, checked by the controller): the replicas outside the
    /// target are dropped and their brokers delete their data.
    ReassignmentCompleted {
        /// The partition's Raft group id.
        group: u64,
        /// The [`Reassignment::epoch`] it completes; ignored if the target
        /// changed since.
        epoch: u64,
    },
    /// The controller quorum (the metadata group's voters) should be these
    /// brokers (KIP-853's AddRaftVoter / RemoveRaftVoter, decided one
    /// broker at a time); the controller's leader changes the group's
    /// voters to their metadata nodes by joint consensus. Every other
    /// registered broker follows the metadata as a learner.
    ControllerVotersChanged {
        /// The brokers, ascending.
        voters: Vec<BrokerId>,
    },
    /// Several commands committed as one metadata log entry (a request
    /// about many partitions: one commit, and one new image on every
    /// broker, instead of one each). Applied in order, each as if it were
    /// the entry itself (the entry's offset is each one's epoch).
    Batch {
        /// The commands, none of them a batch.
        commands: Vec<MetadataCommand>,
    },
    /// Producer ids up to `next_producer_id - 1` are handed out.
    ProducerIdsAllocated {
        /// The next unused producer id.
        next_producer_id: i64,
    },
}

/// A request a broker forwards to the controller (over the peer API).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControllerRequest {
    /// Record this broker's addresses.
    RegisterBroker {
        /// Broker id.
        id: BrokerId,
        /// Client API address.
        client_addr: String,
        /// Peer address.
        peer_addr: String,
        /// The data directory's incarnation.
        #[serde(default)]
        incarnation: u64,
        /// Kafka listener address, `host:port`; empty when the broker runs
        /// none (or predates it).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        kafka_addr: String,
    },
    /// A broker that is not one of the founders joins the cluster (its
    /// `--join`): as [`ControllerRequest::RegisterBroker`], and with `id`
    /// 0 the controller assigns the next free broker id. Answered
    /// [`ControllerReply::Joined`]; asked again with the same incarnation,
    /// it answers the same.
    JoinBroker {
        /// The broker id asked for; 0: assign one.
        id: BrokerId,
        /// Client API address.
        client_addr: String,
        /// Peer address.
        peer_addr: String,
        /// The new data directory's incarnation.
        incarnation: u64,
    },
    /// Make a registered broker a controller voter (KIP-853's AddRaftVoter).
    AddControllerVoter {
        /// Broker id.
        id: BrokerId,
    },
    /// Take a broker out of the controller voters (KIP-853's
    /// RemoveRaftVoter); it stays a broker and follows the metadata as a
    /// learner.
    RemoveControllerVoter {
        /// Broker id.
        id: BrokerId,
    },
    /// Create a topic.
    CreateTopic {
        /// Topic name.
        name: String,
        /// Number of partitions.
        partitions: u32,
        /// Replicas per partition.
        replication_factor: u32,
        /// Configuration overrides (`super::topic_config` keys), as given.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        config: BTreeMap<String, String>,
    },
    /// Change a topic's configuration overrides (Kafka's
    /// IncrementalAlterConfigs, KIP-339). Answered `Ok`.
    AlterTopicConfig {
        /// Topic name.
        name: String,
        /// Keys to set (add or replace), as given.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        set: BTreeMap<String, String>,
        /// Keys to delete (back to the broker default).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        delete: Vec<String>,
    },
    /// Delete a topic.
    DeleteTopic {
        /// Topic name.
        name: String,
    },
    /// Hand out a new producer id (KIP-98).
    AllocateProducerId,
    /// Retire a broker that holds no replica any more.
    DecommissionBroker {
        /// Broker id.
        id: BrokerId,
    },
    /// Grow a topic to `count` partitions (KIP-195).
    CreatePartitions {
        /// Topic name.
        name: String,
        /// The new partition count.
        count: u32,
    },
    /// Move a partition to these brokers (KIP-455's
    /// AlterPartitionReassignments for one partition).
    ReassignPartition {
        /// Topic name.
        topic: String,
        /// Partition number.
        partition: u32,
        /// Target brokers, in order; the first is the preferred leader.
        replicas: Vec<BrokerId>,
    },
    /// Cancel a partition's reassignment: back to its original replicas.
    CancelReassignment {
        /// Topic name.
        topic: String,
        /// Partition number.
        partition: u32,
    },
    /// Start or cancel the reassignments of many partitions at once
    /// (KIP-455's AlterPartitionReassignments): decided one by one, on the
    /// image with the earlier ones applied, and committed together.
    /// Answered [`ControllerReply::Each`], in order.
    ReassignPartitions {
        /// The moves.
        moves: Vec<PartitionMove>,
    },
    /// Several [`ControllerRequest::CompleteReassignment`] reports (one
    /// leader's, from one pass over its groups), committed together.
    /// Answered [`ControllerReply::Each`], in order.
    CompleteReassignments {
        /// The reports.
        reports: Vec<CompletionReport>,
    },
    /// A partition leader reports that its group's committed voters are
    /// `voters` (and it has no other member), so a reassignment whose
    /// target they are is complete.
    CompleteReassignment {
        /// The partition's Raft group id.
        group: u64,
        /// The group's voters, node ids.
        voters: Vec<NodeId>,
        /// The [`Reassignment::epoch`] of the target the leader's image showed.
        epoch: u64,
    },
    /// How far the metadata log is committed now (ReadIndex, Raft thesis
    /// §6.4): the controller confirms its leadership with a quorum, writes
    /// nothing, and answers [`ControllerReply::ReadIndex`]. A broker whose
    /// image has folded up to that offset knows every metadata change
    /// committed before it asked (peer protocol 1.7).
    ReadIndex,
}

/// One partition of [`ControllerRequest::ReassignPartitions`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionMove {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// Target brokers in order (the first is the preferred leader); `None`
    /// cancels the reassignment under way.
    pub replicas: Option<Vec<BrokerId>>,
}

impl PartitionMove {
    /// The single-partition request this move stands for (what a batch is
    /// decided as, and what a controller older than 1.6 is sent).
    pub fn into_request(self) -> ControllerRequest {
        match self.replicas {
            Some(replicas) => ControllerRequest::ReassignPartition {
                topic: self.topic,
                partition: self.partition,
                replicas,
            },
            None => ControllerRequest::CancelReassignment { topic: self.topic, partition: self.partition },
        }
    }
}

/// One report of [`ControllerRequest::CompleteReassignments`], as
/// [`ControllerRequest::CompleteReassignment`] has it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompletionReport {
    /// The partition's Raft group id.
    pub group: u64,
    /// The group's committed voters, node ids.
    pub voters: Vec<NodeId>,
    /// The [`Reassignment::epoch`] of the target the leader's image showed.
    pub epoch: u64,
}

impl CompletionReport {
    /// The single report this stands for (as [`PartitionMove::into_request`]).
    pub fn into_request(self) -> ControllerRequest {
        ControllerRequest::CompleteReassignment { group: self.group, voters: self.voters, epoch: self.epoch }
    }
}

/// The controller's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControllerReply {
    /// Done.
    Ok,
    /// One outcome per item of a request about many partitions, in order.
    Each {
        /// `Ok` or the item's own error.
        results: Vec<Result<(), crate::error::ApiError>>,
    },
    /// Registered: the broker's node id in the metadata group.
    Registered {
        /// Node id to run the metadata group's replica under.
        metadata_node: NodeId,
    },
    /// Joined: the broker's id and its node id in the metadata group.
    Joined {
        /// The broker id (assigned, or the one asked for).
        broker_id: BrokerId,
        /// Node id to run the metadata group's replica under.
        metadata_node: NodeId,
    },
    /// A producer id.
    ProducerId {
        /// The id.
        producer_id: i64,
    },
    /// The answer to [`ControllerRequest::ReadIndex`].
    ReadIndex {
        /// Metadata log offset (records, as an image's `applied_offset`)
        /// up to which the controller's log was committed and applied
        /// when it confirmed its leadership.
        offset: u64,
    },
}

impl ControllerRequest {
    /// The minor peer protocol version a controller needs to serve this
    /// request as asked; 0 for requests every version serves. A controller
    /// of 1.7 or older would drop a new topic's configuration (an unknown
    /// field) or not decode `alter_topic_config`.
    pub fn controller_minor(&self) -> u32 {
        match self {
            ControllerRequest::CreateTopic { config, .. } if !config.is_empty() => {
                super::decide::TOPIC_CONFIG_MINOR
            }
            ControllerRequest::AlterTopicConfig { .. } => super::decide::TOPIC_CONFIG_MINOR,
            _ => 0,
        }
    }
}

/// Serde for an optional [`TopicId`] as its UUID text (`"6f1c...-..."`),
/// readable in logs and `dump-log` output.
mod topic_id_text {
    use ferrolog_proto::TopicId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(id: &Option<TopicId>, s: S) -> Result<S::Ok, S::Error> {
        match id {
            Some(id) => s.serialize_str(&id.to_string()),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<TopicId>, D::Error> {
        match Option::<String>::deserialize(d)? {
            Some(text) => text.parse().map(Some).map_err(serde::de::Error::custom),
            None => Ok(None),
        }
    }

    /// The same for a [`TopicId`] that is always there.
    pub(super) mod required {
        use ferrolog_proto::TopicId;
        use serde::{Deserialize, Deserializer, Serializer};

        pub(in super::super) fn serialize<S: Serializer>(id: &TopicId, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&id.to_string())
        }

        pub(in super::super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TopicId, D::Error> {
            String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ApiError;

    /// Controller forwarding (`ControllerCall`/`ControllerAnswer` of the
    /// peer protocol) carries these as JSON: their exact text is part of
    /// the protocol, pinned here like the protobuf messages are in
    /// `ferrolog_raft_store::wire`.
    #[test]
    fn golden_json_of_forwarded_controller_calls() {
        let requests = [
            (
                ControllerRequest::RegisterBroker {
                    id: 2,
                    client_addr: "10.0.0.2:9092".into(),
                    peer_addr: "10.0.0.2:9093".into(),
                    incarnation: 77,
                    kafka_addr: String::new(),
                },
                r#"{"type":"register_broker","id":2,"client_addr":"10.0.0.2:9092","peer_addr":"10.0.0.2:9093","incarnation":77}"#,
            ),
            (
                ControllerRequest::CreateTopic {
                    name: "orders".into(),
                    partitions: 3,
                    replication_factor: 3,
                    config: BTreeMap::new(),
                },
                r#"{"type":"create_topic","name":"orders","partitions":3,"replication_factor":3}"#,
            ),
            (
                ControllerRequest::CreateTopic {
                    name: "orders".into(),
                    partitions: 3,
                    replication_factor: 3,
                    config: BTreeMap::from([("retention.ms".into(), "60000".into())]),
                },
                r#"{"type":"create_topic","name":"orders","partitions":3,"replication_factor":3,"config":{"retention.ms":"60000"}}"#,
            ),
            (
                ControllerRequest::AlterTopicConfig {
                    name: "orders".into(),
                    set: BTreeMap::from([("cleanup.policy".into(), "compact".into())]),
                    delete: vec!["retention.ms".into()],
                },
                r#"{"type":"alter_topic_config","name":"orders","set":{"cleanup.policy":"compact"},"delete":["retention.ms"]}"#,
            ),
            (
                ControllerRequest::DeleteTopic { name: "orders".into() },
                r#"{"type":"delete_topic","name":"orders"}"#,
            ),
            (ControllerRequest::AllocateProducerId, r#"{"type":"allocate_producer_id"}"#),
            (
                ControllerRequest::ReassignPartition {
                    topic: "orders".into(),
                    partition: 2,
                    replicas: vec![4, 2, 3],
                },
                r#"{"type":"reassign_partition","topic":"orders","partition":2,"replicas":[4,2,3]}"#,
            ),
            (ControllerRequest::DecommissionBroker { id: 4 }, r#"{"type":"decommission_broker","id":4}"#),
            (
                ControllerRequest::CreatePartitions { name: "orders".into(), count: 6 },
                r#"{"type":"create_partitions","name":"orders","count":6}"#,
            ),
            (
                ControllerRequest::CancelReassignment { topic: "orders".into(), partition: 2 },
                r#"{"type":"cancel_reassignment","topic":"orders","partition":2}"#,
            ),
            (
                ControllerRequest::CompleteReassignment {
                    group: 7,
                    voters: vec![1001, 1002, 1010],
                    epoch: 42,
                },
                r#"{"type":"complete_reassignment","group":7,"voters":[1001,1002,1010],"epoch":42}"#,
            ),
            (
                ControllerRequest::JoinBroker {
                    id: 0,
                    client_addr: "10.0.0.4:9092".into(),
                    peer_addr: "10.0.0.4:9093".into(),
                    incarnation: 78,
                },
                r#"{"type":"join_broker","id":0,"client_addr":"10.0.0.4:9092","peer_addr":"10.0.0.4:9093","incarnation":78}"#,
            ),
            (ControllerRequest::AddControllerVoter { id: 4 }, r#"{"type":"add_controller_voter","id":4}"#),
            (
                ControllerRequest::RemoveControllerVoter { id: 1 },
                r#"{"type":"remove_controller_voter","id":1}"#,
            ),
            (
                ControllerRequest::ReassignPartitions {
                    moves: vec![
                        PartitionMove { topic: "orders".into(), partition: 2, replicas: Some(vec![4, 2]) },
                        PartitionMove { topic: "orders".into(), partition: 3, replicas: None },
                    ],
                },
                r#"{"type":"reassign_partitions","moves":[{"topic":"orders","partition":2,"replicas":[4,2]},{"topic":"orders","partition":3,"replicas":null}]}"#,
            ),
            (
                ControllerRequest::CompleteReassignments {
                    reports: vec![CompletionReport { group: 7, voters: vec![1001], epoch: 42 }],
                },
                r#"{"type":"complete_reassignments","reports":[{"group":7,"voters":[1001],"epoch":42}]}"#,
            ),
            (ControllerRequest::ReadIndex, r#"{"type":"read_index"}"#),
        ];
        for (request, text) in requests {
            assert_eq!(serde_json::to_string(&request).unwrap(), text);
            assert_eq!(serde_json::from_str::<ControllerRequest>(text).unwrap(), request);
        }
        let answers: [(Result<ControllerReply, ApiError>, &str); 7] = [
            (Ok(ControllerReply::ReadIndex { offset: 91 }), r#"{"Ok":{"type":"read_index","offset":91}}"#),
            (
                Ok(ControllerReply::Joined { broker_id: 4, metadata_node: 4 }),
                r#"{"Ok":{"type":"joined","broker_id":4,"metadata_node":4}}"#,
            ),
            (
                Ok(ControllerReply::Each { results: vec![Ok(()), Err(ApiError::TopicExists("t".into()))] }),
                r#"{"Ok":{"type":"each","results":[{"Ok":null},{"Err":{"TopicExists":"t"}}]}}"#,
            ),
            (Ok(ControllerReply::Ok), r#"{"Ok":{"type":"ok"}}"#),
            (
                Ok(ControllerReply::Registered { metadata_node: 5 }),
                r#"{"Ok":{"type":"registered","metadata_node":5}}"#,
            ),
            (
                Ok(ControllerReply::ProducerId { producer_id: 1000 }),
                r#"{"Ok":{"type":"producer_id","producer_id":1000}}"#,
            ),
            (Err(ApiError::TopicExists("orders".into())), r#"{"Err":{"TopicExists":"orders"}}"#),
        ];
        for (answer, text) in answers {
            assert_eq!(serde_json::to_string(&answer).unwrap(), text);
            assert_eq!(serde_json::from_str::<Result<ControllerReply, ApiError>>(text).unwrap(), answer);
        }
    }
}
