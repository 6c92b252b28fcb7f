//! The controller's decisions, a pure function: the metadata image and a
//! request in, what to commit and what to answer out. The controller
//! (`super::controller::Controller::execute`) first applies everything
//! committed before (a barrier entry of its term, Raft paper §8), so the
//! image it decides on is current; then it proposes what [`decide`] says.

use std::collections::BTreeSet;

use ferrolog_proto::TopicId;

use super::command::{
    ControllerReply, ControllerRequest, MetadataCommand, PartitionAssignment, ReplicaAssignment,
};
use super::controller::validate_topic_name;
use super::image::MetadataImage;
use super::placement;
use crate::config::{BrokerId, Limits};
use crate::error::ApiError;

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
}

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
        ControllerRequest::RegisterBroker { id, client_addr, peer_addr, incarnation } => {
            let known = image.brokers.get(&id);
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
                    && (b.incarnation != 0 || incarnation == 0)
            });
            if same {
                return Ok(Decision::Answer(reply));
            }
            let command = MetadataCommand::BrokerRegistered { id, client_addr, peer_addr, incarnation };
            Ok(Decision::Commit { command, reply })
        }
        ControllerRequest::CreateTopic { name, partitions, replication_factor } => {
            validate_topic_name(&name)?;
            if partitions == 0 || partitions > f.limits.max_partitions_per_topic {
                return Err(ApiError::Invalid(format!(
                    "partitions must be 1..={}, got {partitions}",
                    f.limits.max_partitions_per_topic
                )));
            }
            if image.topics.contains_key(&name) {
                return Err(ApiError::TopicExists(name));
            }
            let brokers: Vec<BrokerId> =
                image.brokers.keys().copied().filter(|b| f.live.contains(b)).collect();
            let placed = placement::place(
                &brokers,
                &image.replica_counts(),
                &image.leader_counts(),
                partitions,
                replication_factor,
            )
            .ok_or_else(|| too_few_brokers(image, f, &brokers, replication_factor))?;
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
                assignments.push(PartitionAssignment { group, replicas, initial });
                group += 1;
            }
            // A collision with a live topic's id (2^-122 per pair) is refused
            // by the image and answered TOPIC_ALREADY_EXISTS; a retry draws anew.
            let command = MetadataCommand::TopicCreated {
                name: name.clone(),
                topic_id: Some(f.new_topic_id),
                replication_factor,
                partitions: assignments,
            };
            Ok(Decision::CreateTopic { command, name })
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
        ControllerRequest::AllocateProducerId => {
            let producer_id = image.next_producer_id;
            Ok(Decision::Commit {
                command: MetadataCommand::ProducerIdsAllocated { next_producer_id: producer_id + 1 },
                reply: ControllerReply::ProducerId { producer_id },
            })
        }
    }
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

    const ID: TopicId = TopicId(0x1234);

    fn image_with(brokers: &[(BrokerId, u64)]) -> MetadataImage {
        let mut image = MetadataImage::new();
        for (i, (id, incarnation)) in brokers.iter().enumerate() {
            let cmd = MetadataCommand::BrokerRegistered {
                id: *id,
                client_addr: format!("c{id}"),
                peer_addr: format!("p{id}"),
                incarnation: *incarnation,
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
        }
    }

    fn register(id: BrokerId, incarnation: u64) -> ControllerRequest {
        ControllerRequest::RegisterBroker {
            id,
            client_addr: format!("c{id}"),
            peer_addr: format!("p{id}"),
            incarnation,
        }
    }

    fn create(name: &str, partitions: u32, rf: u32) -> ControllerRequest {
        ControllerRequest::CreateTopic { name: name.into(), partitions, replication_factor: rf }
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
