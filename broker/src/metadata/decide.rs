//! The controller's decisions, a pure function: the metadata image and a
//! request in, what to commit and what to answer out. The controller
//! (`super::controller::Controller::execute`) first applies everything
//! committed before (a barrier entry of its term, Raft paper §8), so the
//! image it decides on is current; then it proposes what [`decide`] says.

use std::collections::BTreeSet;

use ferrolog_proto::TopicId;

use super::command::{
    ControllerReply, ControllerRequest, MetadataCommand, PartitionAssignment, PartitionMove,
    ReplicaAssignment,
};
use super::controller::validate_topic_name;
use super::image::MetadataImage;
use super::placement;
use super::topic_config;
use crate::config::{BrokerId, Limits};
use crate::error::ApiError;
use ferrolog_raft_store::types::NodeId;

/// What the controller knows besides the image when it decides.
#[derive(Clone, Debug)]
pub struct Facts<'a> {
    /// Limits from the config.
    pub limits: &'a Limits,
    /// Registered brokers that answer pings now (the controller's own
    /// included): new replicas are placed only on them, as Kafka does.
    pub live: BTreeSet<BrokerId>,
    /// The cluster's brokers: the metadata group's members and every
    /// registered broker (for error messages).
    pub cluster: BTreeSet<BrokerId>,
    /// The id a topic created now gets (KIP-516: random, 128 bits).
    pub new_topic_id: TopicId,
    /// Live brokers that speak an older peer protocol than this build's
    /// (`crate::network::protocol::MINOR`), with their minor version:
    /// commands they cannot fold are refused while they answer.
    pub older_peers: Vec<(BrokerId, u32)>,
    /// The brokers whose metadata-group replicas vote now (the controller
    /// quorum, from the controller's own membership).
    pub controller_voters: BTreeSet<BrokerId>,
    /// Voters of the metadata group that are no registered broker's node
    /// (a founding member that never started): left out of
    /// `controller_voters`, so quorum changes wait for them.
    pub unregistered_voters: Vec<NodeId>,
}

/// The minor peer protocol version that reassignment commands need on
/// every broker (see `crate::network::protocol::MINOR`).
pub const REASSIGNMENT_MINOR: u32 = 5;
/// The minor peer protocol version that `ControllerVotersChanged` needs on
/// every broker.
pub const CONTROLLER_VOTERS_MINOR: u32 = 6;
/// The minor peer protocol version that topic configuration
/// (`TopicCreated::config`, `TopicConfigAltered`) needs on every broker.
pub const TOPIC_CONFIG_MINOR: u32 = 8;

/// What to do about a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Answer now; nothing to commit.
    Answer(ControllerReply),
    /// Commit `command`, then answer `reply`.
    Commit {
        /// The command to commit.
        command: MetadataCommand,
        /// The answer once it is committed.
        reply: ControllerReply,
    },
    /// Commit the creation of topic `name`, then answer `Ok` if the image
    /// holds the topic as created by that entry, `TOPIC_ALREADY_EXISTS`
    /// otherwise (another creation, or a topic id already in use, won).
    CreateTopic {
        /// The `TopicCreated` command.
        command: MetadataCommand,
        /// The topic's name.
        name: String,
    },
}

/// Decides `req` on `image`.
///
/// # Errors
/// The request's own errors: an invalid topic name or partition count,
/// `TOPIC_ALREADY_EXISTS`, `UNKNOWN_TOPIC_OR_PARTITION`, a replication
/// factor the cluster cannot place (`INVALID_REPLICATION_FACTOR`, or
/// unavailable while brokers are missing or silent).
pub fn decide(image: &MetadataImage, req: ControllerRequest, f: &Facts<'_>) -> Result<Decision, ApiError> {
    match req {
        ControllerRequest::RegisterBroker { id, client_addr, peer_addr, incarnation, kafka_addr } => {
            replaced(image, incarnation)?;
            let known = image.brokers.get(&id);
            if known.is_some_and(|b| b.decommissioned && b.incarnation != incarnation) {
                return Err(ApiError::Invalid(format!(
                    "broker {id} was decommissioned: it cannot rejoin under this id with another data directory"
                )));
            }
            if let Some(b) = known
                && b.incarnation != 0
                && incarnation != 0
                && b.incarnation != incarnation
            {
                // A wiped data directory: new node ids everywhere, so a
                // replica that forgot its votes never votes under an old id.
                let mut next = image.next_node_id;
                let metadata_node = next;
                next += 1;
                let mut replicas = Vec::new();
                for (_, _, a) in image.replicas_on(id) {
                    if let Some(r) = a.replicas.iter().find(|r| r.broker == id) {
                        replicas.push((a.group, r.node, next));
                        next += 1;
                    }
                }
                let command = MetadataCommand::BrokerReplaced {
                    id,
                    incarnation,
                    client_addr,
                    peer_addr,
                    metadata_node,
                    replicas,
                };
                return Ok(Decision::Commit {
                    command,
                    reply: ControllerReply::Registered { metadata_node },
                });
            }
            let metadata_node = known.map_or(u64::from(id), |b| b.metadata_node);
            let reply = ControllerReply::Registered { metadata_node };
            let same = known.is_some_and(|b| {
                b.client_addr == client_addr
                    && b.peer_addr == peer_addr
                    && b.kafka_addr == kafka_addr
                    && (b.incarnation != 0 || incarnation == 0)
            });
            if same {
                return Ok(Decision::Answer(reply));
            }
            let command =
                MetadataCommand::BrokerRegistered { id, client_addr, peer_addr, incarnation, kafka_addr };
            Ok(Decision::Commit { command, reply })
        }
        ControllerRequest::JoinBroker { id, client_addr, peer_addr, incarnation } => {
            join(image, f, id, client_addr, peer_addr, incarnation)
        }
        ControllerRequest::ReassignPartitions { moves } => {
            let key = |m: &PartitionMove| format!("{}-{}", m.topic, m.partition);
            let keys: Vec<String> = moves.iter().map(key).collect();
            let requests = moves.into_iter().map(PartitionMove::into_request);
            Ok(each(image, f, keys.into_iter().zip(requests)))
        }
        ControllerRequest::CompleteReassignments { reports } => {
            let requests = reports.into_iter().map(|r| (format!("group {}", r.group), r.into_request()));
            Ok(each(image, f, requests))
        }
        ControllerRequest::AddControllerVoter { id } => change_controller_voters(f, image, id, true),
        ControllerRequest::RemoveControllerVoter { id } => change_controller_voters(f, image, id, false),
        ControllerRequest::CreateTopic { name, partitions, replication_factor, config } => {
            validate_topic_name(&name)?;
            let config = topic_config::check_overrides(&config).map_err(ApiError::InvalidConfig)?;
            if !config.is_empty() {
                old_peers(f, TOPIC_CONFIG_MINOR)?;
            }
            if partitions == 0 || partitions > f.limits.max_partitions_per_topic {
                return Err(ApiError::Invalid(format!(
                    "partitions must be 1..={}, got {partitions}",
                    f.limits.max_partitions_per_topic
                )));
            }
            if image.topics.contains_key(&name) {
                return Err(ApiError::TopicExists(name));
            }
            let assignments = place_partitions(image, f, partitions, replication_factor)?;
            // A collision with a live topic's id (2^-122 per pair) is refused
            // by the image and answered TOPIC_ALREADY_EXISTS; a retry draws anew.
            let command = MetadataCommand::TopicCreated {
                name: name.clone(),
                topic_id: Some(f.new_topic_id),
                replication_factor,
                partitions: assignments,
                config,
            };
            Ok(Decision::CreateTopic { command, name })
        }
        ControllerRequest::AlterTopicConfig { name, set, delete } => {
            let Some(t) = image.topics.get(&name) else {
                return Err(ApiError::UnknownTopic(name));
            };
            let next = topic_config::altered(&t.config, &set, &delete).map_err(ApiError::InvalidConfig)?;
            if next == t.config {
                return Ok(Decision::Answer(ControllerReply::Ok));
            }
            old_peers(f, TOPIC_CONFIG_MINOR)?;
            let set =
                next.iter().filter(|(k, v)| t.config.get(*k) != Some(v)).map(|(k, v)| (k.clone(), v.clone()));
            let delete = t.config.keys().filter(|k| !next.contains_key(*k)).cloned().collect();
            Ok(Decision::Commit {
                command: MetadataCommand::TopicConfigAltered {
                    name,
                    topic_id: t.topic_id,
                    set: set.collect(),
                    delete,
                },
                reply: ControllerReply::Ok,
            })
        }
        ControllerRequest::DeleteTopic { name } => {
            if !image.topics.contains_key(&name) {
                return Err(ApiError::UnknownTopic(name));
            }
            Ok(Decision::Commit {
                command: MetadataCommand::TopicDeleted { name },
                reply: ControllerReply::Ok,
            })
        }
        ControllerRequest::DecommissionBroker { id } => {
            let Some(b) = image.brokers.get(&id) else {
                return Err(ApiError::Invalid(format!("broker {id} is not registered")));
            };
            if b.decommissioned {
                return Ok(Decision::Answer(ControllerReply::Ok));
            }
            let held: Vec<String> =
                image.replicas_on(id).iter().map(|(t, p, _)| format!("{t}-{p}")).collect();
            if !held.is_empty() {
                let shown = held.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
                return Err(ApiError::Invalid(format!(
                    "broker {id} still holds {} replicas ({shown}{}): move them off first (ferrolog cluster rebalance \
                     does, with the broker drained)",
                    held.len(),
                    if held.len() > 5 { ", ..." } else { "" }
                )));
            }
            old_peers(f, REASSIGNMENT_MINOR)?;
            let wanted = image.controller_voters.as_ref().unwrap_or(&f.controller_voters);
            if f.controller_voters.contains(&id) || wanted.contains(&id) {
                let remaining: BTreeSet<BrokerId> = wanted.iter().copied().filter(|v| *v != id).collect();
                if remaining.is_empty() {
                    return Err(ApiError::Invalid(format!(
                        "broker {id} is the only controller voter: add another first (ferrolog controller add)"
                    )));
                }
                quorum_change_possible(&f.controller_voters, &remaining, f)?;
            }
            Ok(Decision::Commit {
                command: MetadataCommand::BrokerDecommissioned { id },
                reply: ControllerReply::Ok,
            })
        }
        ControllerRequest::CreatePartitions { name, count } => {
            let Some(t) = image.topics.get(&name) else { return Err(ApiError::UnknownTopic(name)) };
            let have = t.partitions.len() as u32;
            if count <= have {
                return Err(ApiError::InvalidPartitions(format!(
                    "topic {name:?} has {have} partitions; the count can only grow (asked for {count})"
                )));
            }
            if count > f.limits.max_partitions_per_topic {
                return Err(ApiError::InvalidPartitions(format!(
                    "at most {} partitions per topic, asked for {count}",
                    f.limits.max_partitions_per_topic
                )));
            }
            old_peers(f, REASSIGNMENT_MINOR)?;
            let partitions = place_partitions(image, f, count - have, t.replication_factor)?;
            Ok(Decision::Commit {
                command: MetadataCommand::PartitionsCreated { name, first: have, partitions },
                reply: ControllerReply::Ok,
            })
        }
        ControllerRequest::ReassignPartition { topic, partition, replicas } => {
            let p = partition_of(image, &topic, partition)?;
            // Asked again for the move under way (a retry after an answer
            // was lost, or a batch committed in part): done already.
            if p.reassignment.as_ref().is_some_and(|r| !r.cancelled && r.target == replicas) {
                return Ok(Decision::Answer(ControllerReply::Ok));
            }
            if p.reassignment.is_some() {
                return Err(ApiError::ReassignmentInProgress(format!(
                    "{topic}-{partition} is moving to brokers {}; cancel it first",
                    list(&p.wanted_replicas().iter().map(|r| r.broker).collect::<Vec<_>>())
                )));
            }
            check_replica_list(image, &replicas)?;
            old_peers(f, REASSIGNMENT_MINOR)?;
            if p.replicas.iter().map(|r| r.broker).eq(replicas.iter().copied()) {
                return Ok(Decision::Answer(ControllerReply::Ok));
            }
            let mut node = image.next_node_id;
            let target = replicas
                .iter()
                .map(|b| match p.replicas.iter().find(|r| r.broker == *b) {
                    Some(kept) => *kept,
                    None => {
                        node += 1;
                        ReplicaAssignment { broker: *b, node: node - 1 }
                    }
                })
                .collect();
            Ok(Decision::Commit {
                command: MetadataCommand::ReassignmentStarted { group: p.group, target },
                reply: ControllerReply::Ok,
            })
        }
        ControllerRequest::CancelReassignment { topic, partition } => {
            let p = partition_of(image, &topic, partition)?;
            match &p.reassignment {
                None => Err(ApiError::NoReassignmentInProgress(format!("{topic}-{partition}"))),
                Some(r) if r.cancelled => Ok(Decision::Answer(ControllerReply::Ok)),
                Some(_) => Ok(Decision::Commit {
                    command: MetadataCommand::ReassignmentCancelled { group: p.group },
                    reply: ControllerReply::Ok,
                }),
            }
        }
        ControllerRequest::CompleteReassignment { group, voters, epoch } => {
            let Some((topic, partition, p)) = image.partition_by_group(group) else {
                return Err(ApiError::UnknownTopic(format!("group {group}")));
            };
            let Some(r) = &p.reassignment else { return Ok(Decision::Answer(ControllerReply::Ok)) };
            if r.epoch != epoch {
                return Err(ApiError::Invalid(format!(
                    "{topic}-{partition}: the report is about the target set at offset {epoch}; the current \
                     one was set at offset {}",
                    r.epoch
                )));
            }
            let wanted: BTreeSet<_> = p.wanted_replicas().iter().map(|r| r.node).collect();
            let reported: BTreeSet<_> = voters.iter().copied().collect();
            if wanted != reported {
                // Reported before a cancellation (or another change) the
                // leader has not seen yet: it reports again once it has.
                return Err(ApiError::Invalid(format!(
                    "{topic}-{partition}: voters {reported:?} are not the reassignment's target {wanted:?}"
                )));
            }
            Ok(Decision::Commit {
                command: MetadataCommand::ReassignmentCompleted { group, epoch },
                reply: ControllerReply::Ok,
            })
        }
        // Served before deciding (`Controller::execute`), without a
        // barrier; decided here only after one, when the image is current.
        ControllerRequest::ReadIndex => {
            Ok(Decision::Answer(ControllerReply::ReadIndex { offset: image.applied_offset }))
        }
        ControllerRequest::AllocateProducerId => {
            let producer_id = image.next_producer_id;
            Ok(Decision::Commit {
                command: MetadataCommand::ProducerIdsAllocated { next_producer_id: producer_id + 1 },
                reply: ControllerReply::ProducerId { producer_id },
            })
        }
    }
}

/// Refuses a request whose metadata command brokers older than peer
/// protocol 1.`need` cannot fold (their image would stop at it) while
/// such a broker answers pings.
fn old_peers(f: &Facts<'_>, need: u32) -> Result<(), ApiError> {
    match f.older_peers.iter().find(|(_, minor)| *minor < need) {
        Some((b, minor)) => Err(ApiError::Unavailable(format!(
            "broker {b} speaks peer protocol 1.{minor}; this needs 1.{need} on every broker (finish the upgrade \
             first)"
        ))),
        None => Ok(()),
    }
}

/// Whether a quorum change from `old` to `new` (broker ids) can commit with
/// the brokers that answer now: joint consensus needs a majority of each
/// (Raft paper §6).
fn quorum_change_possible(
    old: &BTreeSet<BrokerId>,
    new: &BTreeSet<BrokerId>,
    f: &Facts<'_>,
) -> Result<(), ApiError> {
    for (which, set) in [("current", old), ("new", new)] {
        let live: Vec<BrokerId> = set.iter().copied().filter(|b| f.live.contains(b)).collect();
        if live.len() * 2 <= set.len() {
            return Err(ApiError::Unavailable(format!(
                "only brokers {} of the {which} controller voters {} answer: the joint configuration needs a \
                 majority of both the current and the new voters",
                list(&live),
                list(&set.iter().copied().collect::<Vec<_>>())
            )));
        }
    }
    Ok(())
}

/// Decides each request of a batch (each keyed by the partition it is
/// about) on the image with the earlier ones' commands applied; the
/// commands go into one [`MetadataCommand::Batch`]. A partition named
/// twice gets an error the second time (one change per partition per
/// entry). Only single-partition requests belong here.
fn each(
    image: &MetadataImage,
    f: &Facts<'_>,
    requests: impl Iterator<Item = (String, ControllerRequest)>,
) -> Decision {
    let mut working: Option<MetadataImage> = None;
    let mut seen = BTreeSet::new();
    let mut commands = Vec::new();
    let mut results = Vec::new();
    for (key, req) in requests {
        if !seen.insert(key.clone()) {
            results.push(Err(ApiError::Invalid(format!("{key} is named twice in one request"))));
            continue;
        }
        let current = working.as_ref().unwrap_or(image);
        results.push(match decide(current, req, f) {
            Ok(Decision::Answer(_)) => Ok(()),
            Ok(Decision::Commit { command, .. }) => {
                let w = working.get_or_insert_with(|| image.clone());
                let offset = w.applied_offset;
                w.apply(offset, &command);
                commands.push(command);
                Ok(())
            }
            Ok(Decision::CreateTopic { .. }) => Err(ApiError::Invalid(format!("{key}: not a batch request"))),
            Err(e) => Err(e),
        });
    }
    let reply = ControllerReply::Each { results };
    if commands.is_empty() {
        Decision::Answer(reply)
    } else {
        Decision::Commit { command: MetadataCommand::Batch { commands }, reply }
    }
}

/// Refuses a data directory whose broker was replaced by another
/// directory (`BrokerReplaced`): its process, if it runs again, must not
/// register and take the broker's replicas back.
fn replaced(image: &MetadataImage, incarnation: u64) -> Result<(), ApiError> {
    if incarnation != 0 && image.replaced_incarnations.contains(&incarnation) {
        return Err(ApiError::Invalid(format!(
            "data directory incarnation {incarnation} belongs to a broker that was since replaced by another data \
             directory under the same id: this process must not run"
        )));
    }
    Ok(())
}

/// Decides a join (`ControllerRequest::JoinBroker`).
fn join(
    image: &MetadataImage,
    f: &Facts<'_>,
    id: BrokerId,
    client_addr: String,
    peer_addr: String,
    incarnation: u64,
) -> Result<Decision, ApiError> {
    if incarnation == 0 {
        return Err(ApiError::Invalid("a joining broker must give its data directory's incarnation".into()));
    }
    replaced(image, incarnation)?;
    // Asked again (the answer was lost, or the broker restarted before
    // storing it): the same answer.
    if let Some((b, entry)) = image.brokers.iter().find(|(_, b)| b.incarnation == incarnation)
        && (id == 0 || id == *b)
    {
        return Ok(Decision::Answer(ControllerReply::Joined {
            broker_id: *b,
            metadata_node: entry.metadata_node,
        }));
    }
    // A metadata node id that some broker has (or had) must not become a
    // new broker's: metadata nodes are broker ids, and node ids handed out
    // for wiped brokers (`BrokerReplaced`).
    let taken = |b: BrokerId| {
        let node = NodeId::from(b);
        image.brokers.contains_key(&b)
            || f.cluster.contains(&b)
            || image.retired_metadata_nodes.contains_key(&node)
            || image.brokers.values().any(|x| x.metadata_node == node)
    };
    // Broker ids stay below the node ids the controller hands out.
    let below = |b: BrokerId| u64::from(b) < super::image::FIRST_NODE_ID;
    let id = if id == 0 {
        let mut next = image.brokers.keys().chain(&f.cluster).copied().max().unwrap_or(0).saturating_add(1);
        while below(next) && taken(next) {
            next += 1;
        }
        if !below(next) {
            return Err(ApiError::Invalid(format!(
                "no free broker id below {}: give one with --node-id",
                super::image::FIRST_NODE_ID
            )));
        }
        next
    } else if !below(id) {
        return Err(ApiError::Invalid(format!(
            "broker id {id}: broker ids are below {}",
            super::image::FIRST_NODE_ID
        )));
    } else if let Some(known) = image.brokers.get(&id) {
        // Taking over a registered id is how two processes end up
        // replacing each other's replicas: never by a join. (A founding
        // broker that lost its disk comes back with its original command
        // line, `--initial-cluster`, and is recognized as wiped.)
        return Err(ApiError::Invalid(format!(
            "broker id {id} is registered (at {}{}): give another id, or none to be assigned one; a broker \
             that lost its disk joins as a new one, and the old id is decommissioned",
            known.peer_addr,
            if f.live.contains(&id) { ", alive" } else { ", down" }
        )));
    } else if taken(id) {
        return Err(ApiError::Invalid(format!(
            "broker id {id} is a founding member's or a metadata node id in use: give another id, or none to be \
             assigned one"
        )));
    } else {
        id
    };
    let command = MetadataCommand::BrokerRegistered {
        id,
        client_addr,
        peer_addr,
        incarnation,
        kafka_addr: String::new(),
    };
    Ok(Decision::Commit {
        command,
        reply: ControllerReply::Joined { broker_id: id, metadata_node: NodeId::from(id) },
    })
}

/// Decides `controller add|remove` (KIP-853's AddRaftVoter and
/// RemoveRaftVoter): the new quorum, if it changes.
fn change_controller_voters(
    f: &Facts<'_>,
    image: &MetadataImage,
    id: BrokerId,
    add: bool,
) -> Result<Decision, ApiError> {
    let Some(b) = image.brokers.get(&id) else {
        return Err(ApiError::Invalid(format!("broker {id} is not registered")));
    };
    if b.decommissioned {
        return Err(ApiError::Invalid(format!("broker {id} was decommissioned")));
    }
    // The quorum the metadata asks for (a change not yet carried out
    // included), else the group's voters now.
    if let Some(n) = f.unregistered_voters.first() {
        return Err(ApiError::Unavailable(format!(
            "controller voter node {n} is no registered broker (a founding member that never started?): start it \
             first, so that a quorum change does not drop it unasked"
        )));
    }
    let current = &f.controller_voters;
    let base = image.controller_voters.clone().unwrap_or_else(|| current.clone());
    let mut wanted = base.clone();
    if add {
        wanted.insert(id);
    } else {
        wanted.remove(&id);
    }
    if wanted == base {
        return Ok(Decision::Answer(ControllerReply::Ok));
    }
    if wanted.is_empty() {
        return Err(ApiError::Invalid(format!(
            "broker {id} is the only controller voter: add another first"
        )));
    }
    if add && !f.live.contains(&id) {
        return Err(ApiError::Unavailable(format!(
            "broker {id} does not answer: a voter that cannot catch up would hold the change"
        )));
    }
    old_peers(f, CONTROLLER_VOTERS_MINOR)?;
    quorum_change_possible(current, &wanted, f)?;
    Ok(Decision::Commit {
        command: MetadataCommand::ControllerVotersChanged { voters: wanted.into_iter().collect() },
        reply: ControllerReply::Ok,
    })
}

/// `count` new partitions of `rf` replicas on the live registered brokers,
/// with fresh group and node ids, balanced against the partitions placed
/// already (`placement::place`).
///
/// # Errors
/// Too few brokers (see [`too_few_brokers`]).
fn place_partitions(
    image: &MetadataImage,
    f: &Facts<'_>,
    count: u32,
    rf: u32,
) -> Result<Vec<PartitionAssignment>, ApiError> {
    let brokers: Vec<BrokerId> = image
        .brokers
        .iter()
        .filter(|(id, b)| f.live.contains(id) && !b.decommissioned)
        .map(|(id, _)| *id)
        .collect();
    let placed = placement::place(&brokers, &image.replica_counts(), &image.leader_counts(), count, rf)
        .ok_or_else(|| too_few_brokers(image, f, &brokers, rf))?;
    let (mut group, mut node) = (image.next_group_id, image.next_node_id);
    let mut assignments = Vec::with_capacity(placed.len());
    for brokers in placed {
        let replicas: Vec<ReplicaAssignment> = brokers
            .into_iter()
            .map(|broker| {
                node += 1;
                ReplicaAssignment { broker, node: node - 1 }
            })
            .collect();
        let initial = replicas.iter().map(|r| r.node).collect();
        assignments.push(PartitionAssignment { group, replicas, initial, reassignment: None });
        group += 1;
    }
    Ok(assignments)
}

/// Partition `partition` of `topic`, or `UNKNOWN_TOPIC_OR_PARTITION`.
fn partition_of<'a>(
    image: &'a MetadataImage,
    topic: &str,
    partition: u32,
) -> Result<&'a PartitionAssignment, ApiError> {
    image
        .topics
        .get(topic)
        .and_then(|t| t.partitions.get(partition as usize))
        .ok_or_else(|| ApiError::UnknownTopic(format!("{topic}-{partition}")))
}

/// A reassignment's target must be a non-empty list of distinct registered
/// brokers (Kafka's `INVALID_REPLICA_ASSIGNMENT` otherwise). Brokers that
/// do not answer now are accepted, as in Kafka: the move waits for them
/// (and can be cancelled).
fn check_replica_list(image: &MetadataImage, replicas: &[BrokerId]) -> Result<(), ApiError> {
    if replicas.is_empty() {
        return Err(ApiError::InvalidReplicaAssignment("the replica list is empty".into()));
    }
    let distinct: BTreeSet<_> = replicas.iter().collect();
    if distinct.len() != replicas.len() {
        return Err(ApiError::InvalidReplicaAssignment(format!("broker listed twice in {}", list(replicas))));
    }
    if let Some(b) = replicas.iter().find(|b| image.brokers.get(b).is_none_or(|x| x.decommissioned)) {
        return Err(ApiError::InvalidReplicaAssignment(format!(
            "broker {b} is not registered or was decommissioned (registered: {})",
            list(
                &image
                    .brokers
                    .iter()
                    .filter(|(_, x)| !x.decommissioned)
                    .map(|(id, _)| *id)
                    .collect::<Vec<_>>()
            )
        )));
    }
    Ok(())
}

fn list(ids: &[BrokerId]) -> String {
    ids.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

/// Why `rf` replicas cannot be placed on `live` (the registered brokers
/// that answer): the cluster is too small, brokers have not registered
/// yet, or registered ones do not answer.
fn too_few_brokers(image: &MetadataImage, f: &Facts<'_>, live: &[BrokerId], rf: u32) -> ApiError {
    let registered = image.brokers.len();
    let list = |ids: Vec<BrokerId>| ids.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    if rf == 0 || f.cluster.len() < rf as usize {
        return ApiError::InvalidReplicationFactor(format!(
            "replication factor {rf} needs that many brokers; the cluster has {} ({registered} registered)",
            f.cluster.len()
        ));
    }
    if registered < rf as usize {
        let missing = f.cluster.iter().copied().filter(|b| !image.brokers.contains_key(b)).collect();
        return ApiError::Unavailable(format!(
            "replication factor {rf} needs {rf} registered brokers; {registered} of the cluster's {} have \
             registered so far (not yet: {})",
            f.cluster.len(),
            list(missing)
        ));
    }
    let silent = image.brokers.keys().copied().filter(|b| !live.contains(b)).collect();
    ApiError::Unavailable(format!(
        "replication factor {rf} needs {rf} live brokers; {} of the {registered} registered answer (not \
         answering: {})",
        live.len(),
        list(silent)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::command::CompletionReport;

    const ID: TopicId = TopicId(0x1234);

    fn image_with(brokers: &[(BrokerId, u64)]) -> MetadataImage {
        let mut image = MetadataImage::new();
        for (i, (id, incarnation)) in brokers.iter().enumerate() {
            let cmd = MetadataCommand::BrokerRegistered {
                id: *id,
                client_addr: format!("c{id}"),
                peer_addr: format!("p{id}"),
                incarnation: *incarnation,
                kafka_addr: String::new(),
            };
            image.apply(i as u64, &cmd);
        }
        image
    }

    fn facts<'a>(limits: &'a Limits, live: &[BrokerId], cluster: &[BrokerId]) -> Facts<'a> {
        Facts {
            limits,
            live: live.iter().copied().collect(),
            cluster: cluster.iter().copied().collect(),
            new_topic_id: ID,
            older_peers: vec![],
            controller_voters: live.iter().copied().collect(),
            unregistered_voters: vec![],
        }
    }

    fn register(id: BrokerId, incarnation: u64) -> ControllerRequest {
        ControllerRequest::RegisterBroker {
            id,
            client_addr: format!("c{id}"),
            peer_addr: format!("p{id}"),
            incarnation,
            kafka_addr: String::new(),
        }
    }

    fn create(name: &str, partitions: u32, rf: u32) -> ControllerRequest {
        ControllerRequest::CreateTopic {
            name: name.into(),
            partitions,
            replication_factor: rf,
            config: std::collections::BTreeMap::new(),
        }
    }

    /// Decides and applies what it commits, as the controller would.
    fn run(image: &mut MetadataImage, req: ControllerRequest, f: &Facts<'_>) -> Result<Decision, ApiError> {
        let d = decide(image, req, f)?;
        let offset = image.applied_offset;
        match &d {
            Decision::Commit { command, .. } | Decision::CreateTopic { command, .. } => {
                image.apply(offset, command)
            }
            Decision::Answer(_) => {}
        }
        Ok(d)
    }

    fn map(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn topic_config_is_checked_stored_and_altered_by_difference() {
        let limits = Limits::default();
        let f = facts(&limits, &[1, 2, 3], &[1, 2, 3]);
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3)]);
        let with = |config| ControllerRequest::CreateTopic {
            name: "t".into(),
            partitions: 1,
            replication_factor: 3,
            config,
        };
        // Refused with the key named; nothing is committed.
        let e = decide(&image, with(map(&[("retention.hours", "1")])), &f).unwrap_err();
        assert!(matches!(&e, ApiError::InvalidConfig(m) if m.contains("retention.hours")), "{e:?}");
        let e = decide(&image, with(map(&[("retention.ms", "-5")])), &f).unwrap_err();
        assert!(matches!(&e, ApiError::InvalidConfig(m) if m.contains("retention.ms")), "{e:?}");
        // Stored in stored form.
        run(&mut image, with(map(&[("retention.ms", " 60000"), ("cleanup.policy", "delete,compact")])), &f)
            .unwrap();
        assert_eq!(
            image.topics["t"].config,
            map(&[("retention.ms", "60000"), ("cleanup.policy", "compact,delete")])
        );
        let alter = |set: &[(&str, &str)], delete: &[&str]| ControllerRequest::AlterTopicConfig {
            name: "t".into(),
            set: map(set),
            delete: delete.iter().map(|k| (*k).to_owned()).collect(),
        };
        // The command carries only what changes, and the topic's id.
        let d = run(
            &mut image,
            alter(&[("retention.ms", "60000"), ("retention.bytes", "1024")], &["cleanup.policy"]),
            &f,
        )
        .unwrap();
        let Decision::Commit {
            command: MetadataCommand::TopicConfigAltered { set, delete, topic_id, .. },
            ..
        } = d
        else {
            panic!("not committed: {d:?}");
        };
        assert_eq!(
            (set, delete, topic_id),
            (map(&[("retention.bytes", "1024")]), vec!["cleanup.policy".to_owned()], ID)
        );
        assert_eq!(image.topics["t"].config, map(&[("retention.ms", "60000"), ("retention.bytes", "1024")]));
        // Asking for what is there already commits nothing.
        assert_eq!(
            decide(&image, alter(&[("retention.bytes", "1024")], &[]), &f).unwrap(),
            Decision::Answer(ControllerReply::Ok)
        );
        let e = decide(&image, alter(&[("segment.bytes", "12")], &[]), &f).unwrap_err();
        assert!(matches!(&e, ApiError::InvalidConfig(m) if m.contains("segment.bytes")), "{e:?}");
        let unknown = ControllerRequest::AlterTopicConfig {
            name: "u".into(),
            set: map(&[("retention.ms", "1")]),
            delete: vec![],
        };
        assert!(matches!(decide(&image, unknown, &f), Err(ApiError::UnknownTopic(_))));
        // Refused while a broker that could not fold it answers.
        let old = Facts { older_peers: vec![(2, 7)], ..f.clone() };
        assert!(matches!(
            decide(&image, alter(&[("retention.ms", "5")], &[]), &old),
            Err(ApiError::Unavailable(_))
        ));
        let plain = ControllerRequest::CreateTopic {
            name: "p".into(),
            partitions: 1,
            replication_factor: 3,
            config: map(&[]),
        };
        assert!(decide(&image, plain, &old).is_ok(), "a topic without config is created as before");
    }

    #[test]
    fn a_registration_commits_only_what_changed() {
        let limits = Limits::default();
        let f = facts(&limits, &[1, 2, 3], &[1, 2, 3]);
        let mut image = image_with(&[(1, 7)]);
        let d = decide(&image, register(1, 7), &f).unwrap();
        assert_eq!(d, Decision::Answer(ControllerReply::Registered { metadata_node: 1 }), "nothing changed");
        let d = run(&mut image, register(2, 9), &f).unwrap();
        assert!(matches!(
            d,
            Decision::Commit { command: MetadataCommand::BrokerRegistered { id: 2, .. }, .. }
        ));
        let moved = ControllerRequest::RegisterBroker {
            id: 2,
            client_addr: "c2".into(),
            peer_addr: "new".into(),
            incarnation: 9,
            kafka_addr: String::new(),
        };
        assert!(
            matches!(decide(&image, moved, &f).unwrap(), Decision::Commit { .. }),
            "a new address is recorded"
        );
    }

    #[test]
    fn a_wiped_broker_gets_new_node_ids_in_every_group() {
        let limits = Limits::default();
        let f = facts(&limits, &[1, 2, 3], &[1, 2, 3]);
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3)]);
        run(&mut image, create("t", 2, 3), &f).unwrap();
        let first_free = image.next_node_id;
        let d = decide(&image, register(2, 99), &f).unwrap();
        let Decision::Commit {
            command: MetadataCommand::BrokerReplaced { metadata_node, replicas, .. },
            reply,
        } = d
        else {
            panic!("a new incarnation was not replaced: {d:?}");
        };
        assert_eq!(metadata_node, first_free);
        assert_eq!(reply, ControllerReply::Registered { metadata_node });
        assert_eq!(replicas.len(), 2, "one new node id per hosted partition");
        let new_ids: Vec<u64> = replicas.iter().map(|(_, _, new)| *new).collect();
        assert_eq!(new_ids, [first_free + 1, first_free + 2]);
        assert!(replicas.iter().all(|(_, old, _)| *old < first_free), "old ids are the assigned ones");
    }

    #[test]
    fn a_topic_is_placed_on_live_brokers_with_fresh_group_and_node_ids() {
        let limits = Limits::default();
        let f = facts(&limits, &[1, 2, 3], &[1, 2, 3, 4]);
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3), (4, 4)]);
        let (group, node) = (image.next_group_id, image.next_node_id);
        let d = run(&mut image, create("orders", 3, 2), &f).unwrap();
        let Decision::CreateTopic {
            command: MetadataCommand::TopicCreated { partitions, topic_id, .. },
            name,
        } = d
        else {
            panic!("not a creation: {d:?}");
        };
        assert_eq!((name.as_str(), topic_id), ("orders", Some(ID)));
        let groups: Vec<u64> = partitions.iter().map(|a| a.group).collect();
        assert_eq!(groups, [group, group + 1, group + 2]);
        let nodes: Vec<u64> = partitions.iter().flat_map(|a| a.replicas.iter().map(|r| r.node)).collect();
        assert_eq!(nodes, (node..node + 6).collect::<Vec<_>>(), "node ids are consecutive and never reused");
        assert!(
            partitions.iter().flat_map(|a| &a.replicas).all(|r| r.broker != 4),
            "broker 4 does not answer"
        );
        assert_eq!(decide(&image, create("orders", 1, 1), &f), Err(ApiError::TopicExists("orders".into())));
    }

    fn reassign(topic: &str, partition: u32, replicas: &[BrokerId]) -> ControllerRequest {
        ControllerRequest::ReassignPartition { topic: topic.into(), partition, replicas: replicas.to_vec() }
    }

    fn brokers(p: &PartitionAssignment) -> Vec<BrokerId> {
        p.replicas.iter().map(|r| r.broker).collect()
    }

    /// 4 brokers, topic "t" with one partition on brokers 1, 2, 3 (in that
    /// order: placement is by counts, all equal, so by id).
    fn moving_setup(limits: &Limits) -> (MetadataImage, Facts<'_>) {
        let f = facts(limits, &[1, 2, 3], &[1, 2, 3, 4]);
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3), (4, 4)]);
        run(&mut image, create("t", 1, 3), &f).unwrap();
        let mut sorted = brokers(&image.topics["t"].partitions[0]);
        sorted.sort_unstable();
        assert_eq!(sorted, [1, 2, 3]);
        (image, f)
    }

    #[test]
    fn a_reassignment_hosts_old_and_new_replicas_until_the_target_votes() {
        let limits = Limits::default();
        let (mut image, f) = moving_setup(&limits);
        let before = image.topics["t"].partitions[0].clone();
        let leaving = before.replicas.iter().find(|r| r.broker == 1).copied().unwrap();
        let next = image.next_node_id;
        run(&mut image, reassign("t", 0, &[4, 2, 3]), &f).unwrap();
        let p = image.topics["t"].partitions[0].clone();
        assert_eq!(brokers(&p), [4, 2, 3, 1], "target first, then the replica leaving");
        assert_eq!(p.replicas[0].node, next, "the added replica gets a fresh node id");
        assert_eq!(image.next_node_id, next + 1);
        assert_eq!(p.replicas[3], leaving, "the leaving replica keeps its node id");
        assert_eq!((p.adding(), p.removing()), (vec![4], vec![1]));
        assert_eq!(p.wanted_replicas().iter().map(|r| r.broker).collect::<Vec<_>>(), [4, 2, 3]);
        assert_eq!(p.initial, before.initial, "the founders never change");
        // Another move meanwhile is refused; so is completion by the wrong voters.
        assert!(matches!(
            decide(&image, reassign("t", 0, &[1, 2, 3]), &f),
            Err(ApiError::ReassignmentInProgress(_))
        ));
        let old_voters: Vec<u64> = before.replicas.iter().map(|r| r.node).collect();
        let epoch = p.reassignment.as_ref().map_or(0, |r| r.epoch);
        let complete =
            |voters: Vec<u64>| ControllerRequest::CompleteReassignment { group: p.group, voters, epoch };
        assert!(matches!(decide(&image, complete(old_voters), &f), Err(ApiError::Invalid(_))));
        let new_voters: Vec<u64> = p.wanted_replicas().iter().map(|r| r.node).collect();
        run(&mut image, complete(new_voters.clone()), &f).unwrap();
        let done = &image.topics["t"].partitions[0];
        assert_eq!(brokers(done), [4, 2, 3]);
        assert!(done.reassignment.is_none());
        assert!(image.replicas_on(1).is_empty(), "broker 1 no longer hosts it");
        // A repeated report (the leader retries) changes nothing.
        assert_eq!(decide(&image, complete(new_voters), &f).unwrap(), Decision::Answer(ControllerReply::Ok));
    }

    #[test]
    fn a_cancelled_reassignment_goes_back_to_the_original_replicas() {
        let limits = Limits::default();
        let (mut image, f) = moving_setup(&limits);
        let before = image.topics["t"].partitions[0].clone();
        let cancel = ControllerRequest::CancelReassignment { topic: "t".into(), partition: 0 };
        assert!(matches!(decide(&image, cancel.clone(), &f), Err(ApiError::NoReassignmentInProgress(_))));
        run(&mut image, reassign("t", 0, &[2, 3, 4]), &f).unwrap();
        run(&mut image, cancel.clone(), &f).unwrap();
        let p = image.topics["t"].partitions[0].clone();
        assert!(p.reassignment.as_ref().is_some_and(|r| r.cancelled));
        assert_eq!(&p.replicas[..3], &before.replicas[..], "the original replicas in their order first");
        assert_eq!(p.replicas[3].broker, 4, "the replica being added still hosts the group");
        assert_eq!((p.adding(), p.removing()), (vec![], vec![4]));
        assert_eq!(
            decide(&image, cancel, &f).unwrap(),
            Decision::Answer(ControllerReply::Ok),
            "twice is fine"
        );
        let voters: Vec<u64> = before.replicas.iter().map(|r| r.node).collect();
        let started = p.reassignment.as_ref().map_or(0, |r| r.epoch) - 1;
        let stale = ControllerRequest::CompleteReassignment {
            group: p.group,
            voters: voters.clone(),
            epoch: started,
        };
        assert!(
            matches!(decide(&image, stale, &f), Err(ApiError::Invalid(_))),
            "a report about the target before the cancellation"
        );
        let epoch = p.reassignment.as_ref().map_or(0, |r| r.epoch);
        run(&mut image, ControllerRequest::CompleteReassignment { group: p.group, voters, epoch }, &f)
            .unwrap();
        assert_eq!(image.topics["t"].partitions[0], before, "back to what it was");
        assert!(image.replicas_on(4).is_empty());
    }

    #[test]
    fn bad_reassignments_are_refused_with_the_reason() {
        let limits = Limits::default();
        let (image, f) = moving_setup(&limits);
        let invalid = |r: Result<Decision, ApiError>| matches!(r, Err(ApiError::InvalidReplicaAssignment(_)));
        assert!(invalid(decide(&image, reassign("t", 0, &[]), &f)));
        assert!(invalid(decide(&image, reassign("t", 0, &[2, 2, 3]), &f)));
        assert!(invalid(decide(&image, reassign("t", 0, &[2, 3, 9]), &f)));
        assert!(matches!(decide(&image, reassign("t", 1, &[1, 2, 3]), &f), Err(ApiError::UnknownTopic(_))));
        assert!(matches!(decide(&image, reassign("u", 0, &[1, 2, 3]), &f), Err(ApiError::UnknownTopic(_))));
        let same = brokers(&image.topics["t"].partitions[0]);
        assert_eq!(
            decide(&image, reassign("t", 0, &same), &f).unwrap(),
            Decision::Answer(ControllerReply::Ok),
            "the replicas it has: nothing to do"
        );
    }

    #[test]
    fn a_topic_grows_by_new_partitions_with_fresh_ids() {
        let limits = Limits::default();
        let f = facts(&limits, &[1, 2, 3], &[1, 2, 3]);
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3)]);
        run(&mut image, create("t", 3, 2), &f).unwrap();
        let grow = |count| ControllerRequest::CreatePartitions { name: "t".into(), count };
        assert!(matches!(decide(&image, grow(3), &f), Err(ApiError::InvalidPartitions(_))));
        assert!(matches!(decide(&image, grow(2), &f), Err(ApiError::InvalidPartitions(_))));
        let missing = ControllerRequest::CreatePartitions { name: "u".into(), count: 4 };
        assert!(matches!(decide(&image, missing, &f), Err(ApiError::UnknownTopic(_))));
        let (group, node) = (image.next_group_id, image.next_node_id);
        let before = image.topics["t"].partitions.clone();
        let Decision::Commit { command, .. } = run(&mut image, grow(6), &f).unwrap() else {
            panic!("not a commit")
        };
        let t = &image.topics["t"];
        assert_eq!(t.partitions.len(), 6);
        assert_eq!(&t.partitions[..3], &before[..], "the old partitions are untouched");
        assert_eq!(
            t.partitions[3..].iter().map(|p| p.group).collect::<Vec<_>>(),
            [group, group + 1, group + 2]
        );
        assert!(
            t.partitions[3..]
                .iter()
                .all(|p| p.replicas.len() == 2 && p.replicas.iter().all(|r| r.node >= node))
        );
        // The same command again (a duplicate in the log): nothing changes.
        let snapshot = image.clone();
        image.apply(image.applied_offset, &command);
        assert_eq!(image.topics, snapshot.topics);
    }

    #[test]
    fn decommission_needs_an_empty_broker_and_leaves_a_live_quorum() {
        let limits = Limits::default();
        let mut f = facts(&limits, &[1, 2, 3, 4], &[1, 2, 3, 4]);
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3), (4, 4)]);
        let on_123 = facts(&limits, &[1, 2, 3], &[1, 2, 3, 4]);
        run(&mut image, create("t", 1, 3), &on_123).unwrap();
        f.controller_voters = [1, 2, 3].into();
        let retire = |id| ControllerRequest::DecommissionBroker { id };
        assert!(matches!(decide(&image, retire(9), &f), Err(ApiError::Invalid(_))), "not registered");
        match decide(&image, retire(1), &f) {
            Err(ApiError::Invalid(m)) => assert!(m.contains("still holds 1 replicas (t-0)"), "{m}"),
            other => panic!("{other:?}"),
        }
        // Broker 4 holds nothing and is no controller voter.
        run(&mut image, retire(4), &f).unwrap();
        assert!(image.brokers[&4].decommissioned);
        assert_eq!(decide(&image, retire(4), &f).unwrap(), Decision::Answer(ControllerReply::Ok));
        assert!(!image.cluster_brokers([]).contains(&4), "no longer part of the cluster");
        assert!(matches!(
            decide(&image, reassign("t", 0, &[2, 3, 4]), &f),
            Err(ApiError::InvalidReplicaAssignment(_))
        ));
        assert!(
            matches!(decide(&image, register(4, 99), &f), Err(ApiError::Invalid(_))),
            "no comeback wiped"
        );
        assert!(
            image.metadata_voters([1, 2, 3, 4]).iter().eq([1, 2, 3].iter()),
            "out of the controller quorum"
        );
        // Move t-0 off broker 1, then: a voter whose leaving would leave one...
        run(&mut image, reassign("t", 0, &[2, 3]), &f).unwrap();
        let p = image.topics["t"].partitions[0].clone();
        let (voters, epoch) =
            (p.wanted_replicas().iter().map(|r| r.node).collect(), p.reassignment.map_or(0, |r| r.epoch));
        run(&mut image, ControllerRequest::CompleteReassignment { group: p.group, voters, epoch }, &f)
            .unwrap();
        f.controller_voters = [1].into();
        assert!(matches!(decide(&image, retire(1), &f), Err(ApiError::Invalid(_))), "no voter would remain");
        // ...or while another voter is down, is refused.
        f.controller_voters = [1, 2, 3].into();
        f.live = [1, 2].into();
        assert!(matches!(decide(&image, retire(1), &f), Err(ApiError::Unavailable(_))), "voter 3 is down");
        f.live = [1, 2, 3].into();
        assert!(matches!(decide(&image, retire(1), &f), Ok(Decision::Commit { .. })));
    }

    #[test]
    fn many_moves_are_decided_one_by_one_and_committed_as_one_entry() {
        let limits = Limits::default();
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3), (4, 4)]);
        let f = facts(&limits, &[1, 2, 3, 4], &[1, 2, 3, 4]);
        run(&mut image, create("t", 3, 2), &facts(&limits, &[1, 2, 3], &[1, 2, 3, 4])).unwrap();
        let mv = |partition, replicas: Option<Vec<BrokerId>>| PartitionMove {
            topic: "t".into(),
            partition,
            replicas,
        };
        let moves = vec![
            mv(0, Some(vec![4, 1])),
            mv(1, Some(vec![4, 2])),
            mv(0, Some(vec![3, 4])),
            mv(9, Some(vec![1, 2])),
            mv(2, None),
        ];
        let before = image.next_node_id;
        let d = run(&mut image, ControllerRequest::ReassignPartitions { moves }, &f).unwrap();
        let Decision::Commit {
            command: MetadataCommand::Batch { commands },
            reply: ControllerReply::Each { results },
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(commands.len(), 2, "{commands:?}");
        assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
        assert!(matches!(&results[2], Err(ApiError::Invalid(m)) if m.contains("twice")), "{results:?}");
        assert!(matches!(results[3], Err(ApiError::UnknownTopic(_))), "{results:?}");
        assert!(matches!(results[4], Err(ApiError::NoReassignmentInProgress(_))), "{results:?}");
        // Both moves applied from the one entry, with distinct new node ids
        // and the entry's offset as their epoch.
        let parts = &image.topics["t"].partitions;
        let (a, b) = (parts[0].clone(), parts[1].clone());
        assert_eq!(a.reassignment.as_ref().map(|r| r.target.clone()), Some(vec![4, 1]));
        assert_eq!(b.reassignment.as_ref().map(|r| r.target.clone()), Some(vec![4, 2]));
        assert_eq!(a.reassignment.as_ref().map(|r| r.epoch), b.reassignment.as_ref().map(|r| r.epoch));
        let new_a = a.replicas.iter().find(|r| r.broker == 4).map(|r| r.node);
        let new_b = b.replicas.iter().find(|r| r.broker == 4).map(|r| r.node);
        assert_ne!(new_a, new_b);
        assert_eq!(image.next_node_id, before + 2);
        // Their completions, reported together, also commit as one entry.
        let reports = [a, b]
            .iter()
            .map(|p| CompletionReport {
                group: p.group,
                voters: p.wanted_replicas().iter().map(|r| r.node).collect(),
                epoch: p.reassignment.as_ref().map_or(0, |r| r.epoch),
            })
            .collect();
        let d = run(&mut image, ControllerRequest::CompleteReassignments { reports }, &f).unwrap();
        assert!(
            matches!(d, Decision::Commit { command: MetadataCommand::Batch { ref commands }, .. } if commands.len() == 2)
        );
        assert!(image.topics["t"].partitions.iter().all(|p| p.reassignment.is_none()));
        assert_eq!(
            image.topics["t"].partitions[0].replicas.iter().map(|r| r.broker).collect::<Vec<_>>(),
            [4, 1]
        );
    }

    #[test]
    fn a_joining_broker_gets_the_next_free_id_once() {
        let limits = Limits::default();
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3)]);
        // Founder 4 of initial_cluster has not registered yet: not handed out.
        let f = facts(&limits, &[1, 2, 3], &[1, 2, 3, 4]);
        let join = |id, incarnation| ControllerRequest::JoinBroker {
            id,
            client_addr: "c".into(),
            peer_addr: "p".into(),
            incarnation,
        };
        let joined = |broker_id, metadata_node| ControllerReply::Joined { broker_id, metadata_node };
        match run(&mut image, join(0, 50), &f).unwrap() {
            Decision::Commit { reply, .. } => assert_eq!(reply, joined(5, 5)),
            other => panic!("{other:?}"),
        }
        assert_eq!(image.brokers[&5].incarnation, 50);
        // Asked again with the same incarnation (a lost answer): the same id.
        assert_eq!(decide(&image, join(0, 50), &f).unwrap(), Decision::Answer(joined(5, 5)));
        assert_eq!(decide(&image, join(5, 50), &f).unwrap(), Decision::Answer(joined(5, 5)));
        // Another directory gets another id; a given free id is taken as is.
        assert!(
            matches!(decide(&image, join(0, 51), &f).unwrap(), Decision::Commit { reply, .. } if reply == joined(6, 6))
        );
        assert!(
            matches!(decide(&image, join(9, 51), &f).unwrap(), Decision::Commit { reply, .. } if reply == joined(9, 9))
        );
        // A live broker's id, a founder's, or no incarnation: refused.
        assert!(matches!(decide(&image, join(2, 51), &f), Err(ApiError::Invalid(m)) if m.contains("alive")));
        assert!(
            matches!(decide(&image, join(4, 51), &f), Err(ApiError::Invalid(m)) if m.contains("founding"))
        );
        assert!(matches!(decide(&image, join(0, 0), &f), Err(ApiError::Invalid(_))));
        // Nor a registered broker's that is down, nor one in the node id range.
        let two_down = facts(&limits, &[1, 3, 5], &[1, 2, 3, 4]);
        assert!(
            matches!(decide(&image, join(2, 52), &two_down), Err(ApiError::Invalid(m)) if m.contains("down"))
        );
        assert!(matches!(decide(&image, join(1000, 52), &f), Err(ApiError::Invalid(_))));
        // A founder wiped and replaced: its old directory may not come back.
        let wiped = run(&mut image, register(2, 60), &f).unwrap();
        assert!(matches!(wiped, Decision::Commit { command: MetadataCommand::BrokerReplaced { .. }, .. }));
        assert!(
            matches!(decide(&image, register(2, 2), &f), Err(ApiError::Invalid(m)) if m.contains("replaced"))
        );
        assert!(matches!(decide(&image, join(0, 2), &f), Err(ApiError::Invalid(_))));
    }

    #[test]
    fn the_controller_quorum_changes_one_broker_at_a_time_with_majorities_live() {
        let limits = Limits::default();
        let mut image = image_with(&[(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]);
        let mut f = facts(&limits, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5]);
        f.controller_voters = [1, 2, 3].into();
        let add = |id| ControllerRequest::AddControllerVoter { id };
        let remove = |id| ControllerRequest::RemoveControllerVoter { id };
        assert_eq!(
            decide(&image, add(2), &f).unwrap(),
            Decision::Answer(ControllerReply::Ok),
            "a voter already"
        );
        assert!(matches!(decide(&image, add(9), &f), Err(ApiError::Invalid(_))), "not registered");
        run(&mut image, add(4), &f).unwrap();
        assert_eq!(image.controller_voters, Some([1, 2, 3, 4].into()));
        assert!(image.metadata_voters([1, 2, 3]).iter().eq([1, 2, 3, 4].iter()));
        assert!(image.metadata_learners(&[1, 2, 3, 4].into()).iter().eq([5].iter()), "5 follows");
        // A second change builds on the wanted quorum, not the group's
        // voters (the first one is not carried out yet).
        run(&mut image, remove(1), &f).unwrap();
        assert_eq!(image.controller_voters, Some([2, 3, 4].into()));
        assert!(image.metadata_learners(&[2, 3, 4].into()).iter().eq([1, 5].iter()), "1 stays a broker");
        // Majorities: with voters {1,2,3} and only 1 live, nothing changes.
        f.live = [1, 4, 5].into();
        assert!(matches!(decide(&image, remove(2), &f), Err(ApiError::Unavailable(_))));
        // A broker that does not answer is not added.
        f.live = [1, 2, 3, 4].into();
        assert!(matches!(decide(&image, add(5), &f), Err(ApiError::Unavailable(_))));
        // Never none; a broker older than 1.6 holds the change.
        f.controller_voters = [2].into();
        let mut one = image_with(&[(1, 1), (2, 2)]);
        assert!(matches!(decide(&one, remove(2), &f), Err(ApiError::Invalid(_))));
        f.older_peers = vec![(1, 5)];
        assert!(matches!(decide(&one, add(1), &f), Err(ApiError::Unavailable(m)) if m.contains("1.5")));
        // Decommissioning a wanted voter takes it out of the wanted quorum.
        f.older_peers = vec![];
        run(&mut one, add(1), &f).unwrap();
        run(&mut one, ControllerRequest::DecommissionBroker { id: 2 }, &f).unwrap();
        assert_eq!(one.controller_voters, Some([1].into()));
        assert!(one.metadata_learners(&[1].into()).is_empty(), "a decommissioned broker does not follow");
    }

    #[test]
    fn bad_creations_are_refused_with_the_reason() {
        let limits = Limits::default();
        let image = image_with(&[(1, 1), (2, 2), (3, 3)]);
        let f = facts(&limits, &[1, 2, 3], &[1, 2, 3]);
        assert!(matches!(decide(&image, create("", 1, 1), &f), Err(ApiError::Invalid(_))));
        assert!(matches!(decide(&image, create("a/b", 1, 1), &f), Err(ApiError::Invalid(_))));
        assert!(matches!(decide(&image, create("t", 0, 1), &f), Err(ApiError::Invalid(_))));
        let too_many = limits.max_partitions_per_topic + 1;
        assert!(matches!(decide(&image, create("t", too_many, 1), &f), Err(ApiError::Invalid(_))));
        assert!(matches!(decide(&image, create("t", 1, 4), &f), Err(ApiError::InvalidReplicationFactor(_))));
        let one_silent = facts(&limits, &[1, 2], &[1, 2, 3]);
        match decide(&image, create("t", 1, 3), &one_silent) {
            Err(ApiError::Unavailable(m)) => assert!(m.contains("not answering: 3"), "{m}"),
            other => panic!("{other:?}"),
        }
        let unregistered = facts(&limits, &[1, 2, 3], &[1, 2, 3, 4]);
        match decide(&image, create("t", 1, 4), &unregistered) {
            Err(ApiError::Unavailable(m)) => assert!(m.contains("not yet: 4"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn deletes_and_producer_ids() {
        let limits = Limits::default();
        let f = facts(&limits, &[1], &[1]);
        let mut image = image_with(&[(1, 1)]);
        assert_eq!(
            decide(&image, ControllerRequest::DeleteTopic { name: "t".into() }, &f),
            Err(ApiError::UnknownTopic("t".into()))
        );
        run(&mut image, create("t", 1, 1), &f).unwrap();
        let d = decide(&image, ControllerRequest::DeleteTopic { name: "t".into() }, &f).unwrap();
        assert!(matches!(
            d,
            Decision::Commit { command: MetadataCommand::TopicDeleted { .. }, reply: ControllerReply::Ok }
        ));
        let first = run(&mut image, ControllerRequest::AllocateProducerId, &f).unwrap();
        let second = run(&mut image, ControllerRequest::AllocateProducerId, &f).unwrap();
        let id = |d: Decision| match d {
            Decision::Commit { reply: ControllerReply::ProducerId { producer_id }, .. } => producer_id,
            other => panic!("{other:?}"),
        };
        assert_eq!(id(second), id(first) + 1, "producer ids are never handed out twice");
    }
}
