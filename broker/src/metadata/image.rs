//! The metadata image: the state folded from the metadata log, identical on
//! every broker once it has applied the same offset.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::command::{MetadataCommand, PartitionAssignment, Reassignment, ReplicaAssignment};
use crate::config::BrokerId;
use ferrolog_proto::TopicId;
use ferrolog_raft_store::types::NodeId;

/// A registered broker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerEntry {
    /// Client API address, `host:port`.
    pub client_addr: String,
    /// Peer (Raft) address, `host:port`.
    pub peer_addr: String,
    /// Kafka listener address, `host:port`; empty when the broker runs none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kafka_addr: String,
    /// Incarnation of its data directory (0: not reported).
    #[serde(default)]
    pub incarnation: u64,
    /// Its node id in the metadata group.
    pub metadata_node: NodeId,
    /// Decommissioned: never placed on again, not a controller voter.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub decommissioned: bool,
}

/// A topic and its partitions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopicEntry {
    /// The topic's id (KIP-516): from its `TopicCreated` command, or
    /// [`fallback_topic_id`] for a command written before topic ids.
    #[serde(with = "topic_id_text")]
    pub topic_id: TopicId,
    /// Replicas per partition.
    pub replication_factor: u32,
    /// Placement of each partition, by partition number.
    pub partitions: Vec<PartitionAssignment>,
    /// Metadata log offset of the command that created it.
    pub created_at_offset: u64,
    /// Configuration overrides in stored form
    /// ([`super::topic_config`]); keys not here take the broker default.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub config: BTreeMap<String, String>,
}

/// The cluster metadata as of `applied_offset`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetadataImage {
    /// Metadata log offset one past the last applied command.
    pub applied_offset: u64,
    /// Registered brokers.
    pub brokers: BTreeMap<BrokerId, BrokerEntry>,
    /// Topics by name.
    pub topics: BTreeMap<String, TopicEntry>,
    /// The next unused partition group id (group ids are never reused).
    pub next_group_id: u64,
    /// The next unused Raft node id for partition replicas (never reused).
    pub next_node_id: u64,
    /// The next unused producer id.
    pub next_producer_id: i64,
    /// Metadata-group node ids retired when their broker's data was wiped,
    /// with the broker they belonged to.
    #[serde(default)]
    pub retired_metadata_nodes: BTreeMap<NodeId, BrokerId>,
    /// The controller quorum as last set by `controller add|remove`
    /// (`ControllerVotersChanged`), minus brokers decommissioned since;
    /// `None` until then: the founding voters, as the group's membership
    /// has them ([`MetadataImage::metadata_voters`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller_voters: Option<std::collections::BTreeSet<BrokerId>>,
    /// Incarnations of data directories whose broker came back with
    /// another one (`BrokerReplaced`): never registered again.
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub replaced_incarnations: std::collections::BTreeSet<u64>,
}

/// The id of a topic whose `TopicCreated` command carries none (written
/// before topic ids): its first partition's Raft group id, deterministic on
/// every broker and on every replay, and never another topic's (group ids
/// are never reused; controller-assigned ids are version-4 UUIDs, above
/// 2^64). A command without partitions (never written) gets 0.
pub fn fallback_topic_id(partitions: &[PartitionAssignment]) -> TopicId {
    TopicId(partitions.first().map_or(0, |p| u128::from(p.group)))
}

/// Serde for a [`TopicId`] as its UUID text.
mod topic_id_text {
    use ferrolog_proto::TopicId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(id: &TopicId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&id.to_string())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TopicId, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Partition group ids start here; 0 is the metadata group.
pub const FIRST_GROUP_ID: u64 = 1;
/// Partition replica node ids start here, far from broker ids (which are
/// the metadata group's node ids) to make logs easier to read.
pub const FIRST_NODE_ID: u64 = 1000;

impl MetadataImage {
    /// An image with nothing applied.
    pub fn new() -> Self {
        Self { next_group_id: FIRST_GROUP_ID, next_node_id: FIRST_NODE_ID, ..Self::default() }
    }

    /// Applies the command stored at `offset`. Commands that no longer make
    /// sense (a topic created twice by racing requests, deleting a missing
    /// topic, a topic id some live topic already has) change nothing: the
    /// first one in the log wins.
    pub fn apply(&mut self, offset: u64, command: &MetadataCommand) {
        self.apply_one(offset, command);
        self.applied_offset = offset + 1;
    }

    /// Applies one command (each command of a batch in turn) without
    /// moving `applied_offset`.
    fn apply_one(&mut self, offset: u64, command: &MetadataCommand) {
        match command {
            MetadataCommand::Batch { commands } => {
                for c in commands {
                    self.apply_one(offset, c);
                }
            }
            MetadataCommand::BrokerRegistered { id, client_addr, peer_addr, incarnation, kafka_addr } => {
                let metadata_node = self.brokers.get(id).map_or(NodeId::from(*id), |b| b.metadata_node);
                let known = self.brokers.get(id).map_or(0, |b| b.incarnation);
                self.brokers.insert(
                    *id,
                    BrokerEntry {
                        client_addr: client_addr.clone(),
                        peer_addr: peer_addr.clone(),
                        kafka_addr: kafka_addr.clone(),
                        incarnation: if known == 0 { *incarnation } else { known },
                        metadata_node,
                        decommissioned: self.brokers.get(id).is_some_and(|b| b.decommissioned),
                    },
                );
            }
            MetadataCommand::BrokerReplaced {
                id,
                incarnation,
                client_addr,
                peer_addr,
                metadata_node,
                replicas,
            } => {
                let fresh = *metadata_node >= self.next_node_id
                    && replicas.iter().all(|(_, _, new)| *new >= self.next_node_id);
                if fresh {
                    let highest = replicas.iter().map(|r| r.2).chain([*metadata_node]).max().unwrap_or(0);
                    self.next_node_id = highest + 1;
                    let old = self.brokers.get(id).map_or(NodeId::from(*id), |b| b.metadata_node);
                    self.retired_metadata_nodes.insert(old, *id);
                    if let Some(gone) = self.brokers.get(id).map(|b| b.incarnation).filter(|i| *i != 0) {
                        self.replaced_incarnations.insert(gone);
                    }
                    self.brokers.insert(
                        *id,
                        BrokerEntry {
                            client_addr: client_addr.clone(),
                            peer_addr: peer_addr.clone(),
                            kafka_addr: String::new(),
                            incarnation: *incarnation,
                            metadata_node: *metadata_node,
                            decommissioned: self.brokers.get(id).is_some_and(|b| b.decommissioned),
                        },
                    );
                    for p in self.topics.values_mut().flat_map(|t| t.partitions.iter_mut()) {
                        for (group, old, new) in replicas.iter().filter(|r| r.0 == p.group) {
                            let _ = group;
                            for r in p.replicas.iter_mut().filter(|r| r.node == *old && r.broker == *id) {
                                r.node = *new;
                            }
                        }
                    }
                }
            }
            MetadataCommand::TopicCreated { name, topic_id, replication_factor, partitions, config } => {
                let ids_fresh = partitions.iter().all(|p| {
                    p.group >= self.next_group_id && p.replicas.iter().all(|r| r.node >= self.next_node_id)
                });
                let topic_id = topic_id.unwrap_or_else(|| fallback_topic_id(partitions));
                let id_unused = self.topics.values().all(|t| t.topic_id != topic_id);
                if !self.topics.contains_key(name) && ids_fresh && id_unused {
                    for p in partitions {
                        self.next_group_id = self.next_group_id.max(p.group + 1);
                        for r in &p.replicas {
                            self.next_node_id = self.next_node_id.max(r.node + 1);
                        }
                    }
                    self.topics.insert(
                        name.clone(),
                        TopicEntry {
                            topic_id,
                            replication_factor: *replication_factor,
                            partitions: partitions.clone(),
                            created_at_offset: offset,
                            config: config.clone(),
                        },
                    );
                }
            }
            MetadataCommand::TopicConfigAltered { name, topic_id, set, delete } => {
                if let Some(t) = self.topics.get_mut(name)
                    && t.topic_id == *topic_id
                {
                    for k in delete {
                        t.config.remove(k);
                    }
                    t.config.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
            }
            MetadataCommand::TopicDeleted { name } => {
                self.topics.remove(name);
            }
            MetadataCommand::ControllerVotersChanged { voters } => {
                // Only registered, active brokers, and never none (the
                // controller checked; a command that fails it changes nothing).
                let valid = !voters.is_empty()
                    && voters.iter().all(|b| self.brokers.get(b).is_some_and(|x| !x.decommissioned));
                if valid {
                    self.controller_voters = Some(voters.iter().copied().collect());
                }
            }
            MetadataCommand::ProducerIdsAllocated { next_producer_id } => {
                self.next_producer_id = self.next_producer_id.max(*next_producer_id);
            }
            MetadataCommand::BrokerDecommissioned { id } => {
                let holds = self
                    .topics
                    .values()
                    .flat_map(|t| &t.partitions)
                    .any(|p| p.replicas.iter().any(|r| r.broker == *id));
                if let Some(b) = self.brokers.get_mut(id)
                    && !holds
                {
                    b.decommissioned = true;
                    if let Some(v) = self.controller_voters.as_mut() {
                        v.remove(id);
                    }
                }
            }
            MetadataCommand::PartitionsCreated { name, first, partitions } => {
                let ids_fresh = partitions.iter().all(|p| {
                    p.group >= self.next_group_id && p.replicas.iter().all(|r| r.node >= self.next_node_id)
                });
                if let Some(t) = self.topics.get_mut(name)
                    && t.partitions.len() == *first as usize
                    && ids_fresh
                {
                    for p in partitions {
                        self.next_group_id = self.next_group_id.max(p.group + 1);
                        for r in &p.replicas {
                            self.next_node_id = self.next_node_id.max(r.node + 1);
                        }
                    }
                    t.partitions.extend(partitions.iter().cloned());
                }
            }
            MetadataCommand::ReassignmentStarted { group, target } => {
                self.start_reassignment(offset, *group, target);
            }
            MetadataCommand::ReassignmentCancelled { group } => {
                if let Some(p) = self.partition_mut(*group)
                    && let Some(r) = p.reassignment.as_mut()
                    && !r.cancelled
                {
                    r.target = r.original.clone();
                    r.cancelled = true;
                    r.epoch = offset;
                    let order = r.target.clone();
                    p.replicas
                        .sort_by_key(|x| order.iter().position(|b| *b == x.broker).unwrap_or(usize::MAX));
                }
            }
            MetadataCommand::ReassignmentCompleted { group, epoch } => {
                if let Some(p) = self.partition_mut(*group)
                    && p.reassignment.as_ref().is_some_and(|r| r.epoch == *epoch)
                {
                    p.replicas = p.wanted_replicas();
                    p.reassignment = None;
                }
            }
        }
    }

    /// The partition whose Raft group is `group`.
    pub fn partition_by_group(&self, group: u64) -> Option<(&str, u32, &PartitionAssignment)> {
        self.topics.iter().find_map(|(name, t)| {
            t.partitions
                .iter()
                .enumerate()
                .find(|(_, p)| p.group == group)
                .map(|(i, p)| (name.as_str(), i as u32, p))
        })
    }

    fn partition_mut(&mut self, group: u64) -> Option<&mut PartitionAssignment> {
        self.topics.values_mut().flat_map(|t| t.partitions.iter_mut()).find(|p| p.group == group)
    }

    /// Applies `ReassignmentStarted`: refused (nothing changes) when the
    /// group is unknown, a reassignment runs already, a kept broker's node
    /// id differs, an added replica's node id was handed out before, or a
    /// broker is listed twice.
    fn start_reassignment(&mut self, offset: u64, group: u64, target: &[ReplicaAssignment]) {
        let next_node_id = self.next_node_id;
        let Some(p) = self.partition_mut(group) else { return };
        let distinct = target.iter().map(|r| r.broker).collect::<std::collections::BTreeSet<_>>().len();
        let valid = p.reassignment.is_none()
            && !target.is_empty()
            && distinct == target.len()
            && target.iter().all(|t| match p.replicas.iter().find(|r| r.broker == t.broker) {
                Some(kept) => kept.node == t.node,
                None => t.node >= next_node_id,
            });
        if !valid {
            return;
        }
        let original: Vec<_> = p.replicas.iter().map(|r| r.broker).collect();
        let leaving: Vec<ReplicaAssignment> =
            p.replicas.iter().filter(|r| !target.iter().any(|t| t.broker == r.broker)).copied().collect();
        p.replicas = target.iter().copied().chain(leaving).collect();
        p.reassignment = Some(Reassignment {
            target: target.iter().map(|r| r.broker).collect(),
            original,
            cancelled: false,
            epoch: offset,
        });
        let highest = target.iter().map(|r| r.node).max().unwrap_or(0);
        self.next_node_id = self.next_node_id.max(highest + 1);
    }

    /// The metadata group's voters as they should be, given the current
    /// ones: the metadata nodes of [`MetadataImage::controller_voters`]
    /// once set; before, the current ones, where a voter retired by a wiped
    /// broker is replaced by that broker's new node id. Decommissioned
    /// brokers never vote.
    pub fn metadata_voters(
        &self,
        current: impl IntoIterator<Item = NodeId>,
    ) -> std::collections::BTreeSet<NodeId> {
        if let Some(set) = &self.controller_voters {
            return set
                .iter()
                .filter_map(|b| self.brokers.get(b))
                .filter(|b| !b.decommissioned)
                .map(|b| b.metadata_node)
                .collect();
        }
        let decommissioned: std::collections::BTreeSet<NodeId> =
            self.brokers.values().filter(|b| b.decommissioned).map(|b| b.metadata_node).collect();
        current
            .into_iter()
            .map(|v| match self.retired_metadata_nodes.get(&v).and_then(|b| self.brokers.get(b)) {
                Some(b) => b.metadata_node,
                None => v,
            })
            .filter(|v| !decommissioned.contains(v))
            .collect()
    }

    /// The metadata group's learners as they should be, given its wanted
    /// `voters`: every registered broker that is not decommissioned and
    /// does not vote follows the metadata (its image serves its clients and
    /// drives its replicas).
    pub fn metadata_learners(
        &self,
        voters: &std::collections::BTreeSet<NodeId>,
    ) -> std::collections::BTreeSet<NodeId> {
        self.brokers
            .values()
            .filter(|b| !b.decommissioned && !voters.contains(&b.metadata_node))
            .map(|b| b.metadata_node)
            .collect()
    }

    /// The brokers the cluster consists of: every member (voter or learner)
    /// of the metadata group, given as `(node id, peer address)`, as a
    /// broker id, together with every registered broker. This is what
    /// `initial_cluster` founded (the metadata group's membership is fixed
    /// to it), so a broker in it but not in [`MetadataImage::brokers`] has
    /// not registered yet.
    ///
    /// A member is the registered broker whose metadata node it is, else
    /// the one registered at its peer address (a wiped broker's new node id
    /// before this image records it), else a founding member that has not
    /// registered yet, whose node id is its broker id. A node id that is no
    /// broker id (above `u32::MAX`) and matches no broker is left out.
    pub fn cluster_brokers<'a>(
        &self,
        members: impl IntoIterator<Item = (NodeId, &'a str)>,
    ) -> std::collections::BTreeSet<BrokerId> {
        let mut out: std::collections::BTreeSet<BrokerId> = self.brokers.keys().copied().collect();
        for (node, addr) in members {
            let known = self
                .brokers
                .iter()
                .find(|(_, b)| b.metadata_node == node)
                .or_else(|| self.brokers.iter().find(|(_, b)| b.peer_addr == addr))
                .map(|(id, _)| *id)
                .or_else(|| self.retired_metadata_nodes.get(&node).copied());
            if let Some(id) = known.or_else(|| BrokerId::try_from(node).ok()) {
                out.insert(id);
            }
        }
        // A decommissioned broker is no longer part of the cluster.
        out.retain(|id| self.brokers.get(id).is_none_or(|b| !b.decommissioned));
        out
    }

    /// The broker owning node `node` of group `group` (0: the metadata group).
    pub fn broker_of_node(&self, group: u64, node: NodeId) -> Option<BrokerId> {
        if group == 0 {
            return self
                .brokers
                .iter()
                .find(|(_, b)| b.metadata_node == node)
                .map(|(id, _)| *id)
                .or_else(|| BrokerId::try_from(node).ok().filter(|id| self.brokers.contains_key(id)));
        }
        self.topics
            .values()
            .flat_map(|t| t.partitions.iter())
            .find(|p| p.group == group)
            .and_then(|p| p.replicas.iter().find(|r| r.node == node))
            .map(|r| r.broker)
    }

    /// The current peer address of every Raft node's broker: the metadata
    /// group's nodes and every partition replica's, from the brokers'
    /// latest registrations (a broker that moved re-registers its new
    /// address; see `crate::network::PeerAddresses::set_node_addresses`).
    pub fn node_addresses(&self) -> std::collections::HashMap<NodeId, String> {
        let mut out = std::collections::HashMap::new();
        for b in self.brokers.values() {
            out.insert(b.metadata_node, b.peer_addr.clone());
        }
        for t in self.topics.values() {
            for p in &t.partitions {
                for r in &p.replicas {
                    if let Some(b) = self.brokers.get(&r.broker) {
                        out.insert(r.node, b.peer_addr.clone());
                    }
                }
            }
        }
        out
    }

    /// Every partition replica placed on `broker`: (topic, partition, assignment).
    pub fn replicas_on(&self, broker: BrokerId) -> Vec<(String, u32, PartitionAssignment)> {
        let mut out = Vec::new();
        for (name, t) in &self.topics {
            for (i, p) in t.partitions.iter().enumerate() {
                if p.replicas.iter().any(|r| r.broker == broker) {
                    out.push((name.clone(), i as u32, p.clone()));
                }
            }
        }
        out
    }

    /// Replica count per registered broker (brokers with none included).
    pub fn replica_counts(&self) -> BTreeMap<BrokerId, usize> {
        let mut counts: BTreeMap<BrokerId, usize> = self.brokers.keys().map(|b| (*b, 0)).collect();
        for t in self.topics.values() {
            for p in &t.partitions {
                for r in &p.replicas {
                    *counts.entry(r.broker).or_default() += 1;
                }
            }
        }
        counts
    }

    /// Preferred-leader (first replica) count per registered broker.
    pub fn leader_counts(&self) -> BTreeMap<BrokerId, usize> {
        let mut counts: BTreeMap<BrokerId, usize> = self.brokers.keys().map(|b| (*b, 0)).collect();
        for t in self.topics.values() {
            for p in &t.partitions {
                if let Some(r) = p.replicas.first() {
                    *counts.entry(r.broker).or_default() += 1;
                }
            }
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::command::ReplicaAssignment;

    fn topic(name: &str, group: u64, node: u64) -> MetadataCommand {
        MetadataCommand::TopicCreated {
            name: name.into(),
            topic_id: None,
            replication_factor: 1,
            partitions: vec![PartitionAssignment {
                group,
                replicas: vec![ReplicaAssignment { broker: 1, node }],
                initial: vec![node],
                reassignment: None,
            }],
            config: BTreeMap::new(),
        }
    }

    fn registered(id: BrokerId, peer: &str) -> MetadataCommand {
        MetadataCommand::BrokerRegistered {
            id,
            client_addr: format!("c{id}"),
            peer_addr: peer.into(),
            incarnation: 1,
            kafka_addr: String::new(),
        }
    }

    #[test]
    fn node_addresses_follow_a_broker_that_registers_a_new_address() {
        let mut m = MetadataImage::new();
        m.apply(0, &registered(1, "old:1"));
        m.apply(1, &registered(2, "p2"));
        assert_eq!(m.node_addresses().get(&1).map(String::as_str), Some("old:1"));
        m.apply(2, &registered(1, "new:1"));
        assert_eq!(m.node_addresses().get(&1).map(String::as_str), Some("new:1"), "the metadata node moved");
        assert_eq!(m.node_addresses().get(&2).map(String::as_str), Some("p2"));
    }

    #[test]
    fn cluster_brokers_are_the_metadata_members_and_the_registered() {
        let mut m = MetadataImage::new();
        let members = [(1u64, "p1"), (2, "p2"), (3, "p3")];
        assert_eq!(
            m.cluster_brokers(members).into_iter().collect::<Vec<_>>(),
            vec![1, 2, 3],
            "none registered"
        );
        m.apply(0, &registered(2, "p2"));
        assert_eq!(m.cluster_brokers(members).len(), 3);
        // Broker 2 wiped: its new metadata node (1005) is found by its peer
        // address before the image records the replacement...
        let during = [(1u64, "p1"), (2, "p2"), (3, "p3"), (1005, "p2")];
        assert_eq!(m.cluster_brokers(during).into_iter().collect::<Vec<_>>(), vec![1, 2, 3]);
        // ...and by its node id after.
        m.apply(
            1,
            &MetadataCommand::BrokerReplaced {
                id: 2,
                incarnation: 9,
                client_addr: "c2".into(),
                peer_addr: "p2-new".into(),
                metadata_node: 1005,
                replicas: vec![],
            },
        );
        let after = [(1u64, "p1"), (1005, "p2-new"), (3, "p3")];
        assert_eq!(m.cluster_brokers(after).into_iter().collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(
            m.cluster_brokers([]).into_iter().collect::<Vec<_>>(),
            vec![2],
            "registered brokers count"
        );
    }

    #[test]
    fn reassignment_commands_that_do_not_fit_change_nothing() {
        let mut m = MetadataImage::new();
        m.apply(0, &topic("a", 1, 1000));
        let start =
            |target: Vec<ReplicaAssignment>| MetadataCommand::ReassignmentStarted { group: 1, target };
        let before = m.clone();
        // A reused node id, a kept broker under another node id, a broker twice, nothing.
        for bad in [
            start(vec![ReplicaAssignment { broker: 2, node: 1000 }]),
            start(vec![ReplicaAssignment { broker: 1, node: 1001 }]),
            start(vec![
                ReplicaAssignment { broker: 2, node: 1001 },
                ReplicaAssignment { broker: 2, node: 1002 },
            ]),
            start(vec![]),
            MetadataCommand::ReassignmentStarted {
                group: 9,
                target: vec![ReplicaAssignment { broker: 2, node: 1001 }],
            },
            MetadataCommand::ReassignmentCancelled { group: 1 },
            MetadataCommand::ReassignmentCompleted { group: 1, epoch: 0 },
        ] {
            m.apply(1, &bad);
            assert_eq!(m.topics, before.topics, "{bad:?}");
            assert_eq!(m.next_node_id, before.next_node_id);
        }
        // A good one, replayed from JSON, then a second start is ignored.
        let good = start(vec![ReplicaAssignment { broker: 2, node: 1001 }]);
        let log =
            vec![topic("a", 1, 1000), good.clone(), start(vec![ReplicaAssignment { broker: 3, node: 1002 }])];
        let m = replay(&log);
        let p = &m.topics["a"].partitions[0];
        assert_eq!(p.replicas.iter().map(|r| r.broker).collect::<Vec<_>>(), [2, 1]);
        assert_eq!(p.reassignment.as_ref().map(|r| r.target.clone()), Some(vec![2]));
        assert_eq!(m.next_node_id, 1002);
    }

    #[test]
    fn first_creation_wins_and_ids_are_never_reused() {
        let mut m = MetadataImage::new();
        m.apply(0, &topic("a", 1, 1000));
        m.apply(1, &topic("a", 2, 1001));
        assert_eq!(m.topics["a"].partitions[0].group, 1);
        m.apply(2, &MetadataCommand::TopicDeleted { name: "a".into() });
        assert!(m.topics.is_empty());
        m.apply(3, &topic("b", 1, 1000));
        assert!(m.topics.is_empty(), "a reused group id is refused");
        m.apply(4, &topic("b", 2, 1001));
        assert_eq!(m.next_group_id, 3);
        assert_eq!(m.next_node_id, 1002);
        assert_eq!(m.applied_offset, 5);
    }

    fn with_id(command: MetadataCommand, id: u128) -> MetadataCommand {
        match command {
            MetadataCommand::TopicCreated { name, replication_factor, partitions, config, .. } => {
                MetadataCommand::TopicCreated {
                    name,
                    topic_id: Some(TopicId(id)),
                    replication_factor,
                    partitions,
                    config,
                }
            }
            other => other,
        }
    }

    /// The commands as they travel in the metadata log (JSON), folded into
    /// a fresh image: what a broker does on every start.
    fn replay(log: &[MetadataCommand]) -> MetadataImage {
        let mut m = MetadataImage::new();
        for (offset, c) in log.iter().enumerate() {
            let json = serde_json::to_vec(c).expect("encode");
            let decoded: MetadataCommand = serde_json::from_slice(&json).expect("decode");
            assert_eq!(&decoded, c);
            m.apply(offset as u64, &decoded);
        }
        m
    }

    #[test]
    fn topic_ids_come_from_the_command_and_survive_replay() {
        let a = TopicId::v4_from_random(7 << 90);
        let b = TopicId::v4_from_random(9 << 90);
        let log = vec![
            with_id(topic("t", 1, 1000), a.0),
            MetadataCommand::TopicDeleted { name: "t".into() },
            with_id(topic("t", 2, 1001), b.0),
        ];
        let m = replay(&log[..1]);
        assert_eq!(m.topics["t"].topic_id, a);
        let m = replay(&log);
        assert_eq!(m.topics["t"].topic_id, b, "the re-created topic has the new id");
        assert_eq!(replay(&log), m, "a restart (replay) gives the same ids");
    }

    #[test]
    fn topic_config_is_created_altered_and_never_reaches_a_re_created_topic() {
        let a = TopicId::v4_from_random(7 << 90);
        let b = TopicId::v4_from_random(9 << 90);
        let mut created = with_id(topic("t", 1, 1000), a.0);
        if let MetadataCommand::TopicCreated { config, .. } = &mut created {
            config.insert("retention.ms".into(), "60000".into());
            config.insert("cleanup.policy".into(), "delete".into());
        }
        let alter = |id: TopicId| MetadataCommand::TopicConfigAltered {
            name: "t".into(),
            topic_id: id,
            set: BTreeMap::from([("retention.bytes".into(), "4096".into())]),
            delete: vec!["retention.ms".into()],
        };
        // The command's JSON is part of the metadata log's format.
        assert_eq!(
            serde_json::to_string(&alter(a)).unwrap(),
            format!(
                r#"{{"type":"topic_config_altered","name":"t","topic_id":"{a}","set":{{"retention.bytes":"4096"}},"delete":["retention.ms"]}}"#
            )
        );
        let m = replay(&[created.clone(), alter(a)]);
        let want = BTreeMap::from([
            ("cleanup.policy".to_owned(), "delete".to_owned()),
            ("retention.bytes".to_owned(), "4096".to_owned()),
        ]);
        assert_eq!(m.topics["t"].config, want);
        // An alter decided for the topic's earlier incarnation changes nothing.
        let m = replay(&[
            created,
            MetadataCommand::TopicDeleted { name: "t".into() },
            with_id(topic("t", 2, 1001), b.0),
            alter(a),
        ]);
        assert!(m.topics["t"].config.is_empty(), "{:?}", m.topics["t"].config);
    }

    #[test]
    fn commands_without_an_id_decode_and_get_the_first_group_as_id() {
        // A TopicCreated command as written before topic ids.
        let old = br#"{"type":"topic_created","name":"old","replication_factor":1,
            "partitions":[{"group":5,"replicas":[{"broker":1,"node":1000}],"initial":[1000]},
                          {"group":6,"replicas":[{"broker":1,"node":1001}],"initial":[1001]}]}"#;
        let command: MetadataCommand = serde_json::from_slice(old).expect("old commands decode");
        let mut m = MetadataImage::new();
        m.apply(0, &command);
        assert_eq!(m.topics["old"].topic_id, TopicId(5));
        // The same topic re-created after an upgrade gets a controller id.
        m.apply(1, &MetadataCommand::TopicDeleted { name: "old".into() });
        m.apply(2, &with_id(topic("old", 7, 1002), TopicId::v4_from_random(1).0));
        assert_ne!(m.topics["old"].topic_id, TopicId(5));
        assert_ne!(m.topics["old"].topic_id, TopicId(7));
    }

    #[test]
    fn a_topic_id_held_by_a_live_topic_is_refused() {
        let mut m = MetadataImage::new();
        m.apply(0, &with_id(topic("a", 1, 1000), 1 << 100));
        m.apply(1, &with_id(topic("b", 2, 1001), 1 << 100));
        assert!(!m.topics.contains_key("b"));
        // Nor one that an old command's fallback gave a live topic.
        m.apply(2, &topic("c", 3, 1002));
        assert_eq!(m.topics["c"].topic_id, TopicId(3));
        m.apply(3, &with_id(topic("d", 4, 1003), 3));
        assert!(!m.topics.contains_key("d"));
    }
}
