//! Consumer group coordination (issue 13): committed offsets kept in the
//! cluster, in the internal topic [`OFFSETS_TOPIC`], as Kafka keeps them.
//!
//! ```text
//!  client ──FindCoordinator──> any broker: partition = hash(group id) mod N, its leader
//!  client ──OffsetCommit──> coordinator (leader of that partition) ──Session──> checks
//!         (member, generation, topic, metadata size, no going back) ──Partition::produce_in_term──>
//!         the partition's Raft log: committed by a majority like any record ──> applied to memory
//!  a new leader ──Session──> reads the partition from its log start to the high watermark
//!         (records::decode ──> state::Groups::apply) before it answers a group call
//! ```
//!
//! - [`records`]: the stored keys and values (`proto/ferrolog/groups/v1`).
//! - [`state`]: one partition's groups in memory and the rules of a commit.
//! - [`membership`]: one group's members, generations and rebalances
//!   (Kafka's classic protocol), a state machine over explicit time.
//! - `session`: a coordinator partition held for one call: read back per
//!   term, written in a task of its own.
//! - `offsets`: OffsetCommit, OffsetFetch, DescribeGroup, DeleteGroup,
//!   ListGroups, and offset expiry.
//! - `members`: JoinGroup, SyncGroup, Heartbeat, LeaveGroup, and the loop
//!   that stores what rebalances need and answers the waiting members.
//!
//! A group's coordinator is the leader of partition
//! [`partition_for`]`(group id)` of [`OFFSETS_TOPIC`]; the topic is created
//! on the first group call (Kafka's auto-creation, with Kafka's
//! `offsets.topic.num.partitions` and `offsets.topic.replication.factor`,
//! `[groups]` in the broker config) and is key-compacted. Its state in
//! memory is that of one Raft term: a leader reads the partition once per
//! term, after every entry of its log is applied (an entry of its own term
//! among them, so everything committed before is there, Raft thesis §6.4),
//! in a task of its own (`Coordinator::open`); from then on it is the
//! only writer, so its memory stays exact while the term lasts. Its writes
//! are proposed in that term only (a leadership lost and won again in
//! between fails the write rather than appending from a stale view), run in
//! a task that holds the partition until settled, and memory is put back
//! only after they commit (`Session::append`). One group call at a time
//! per coordinator partition (a commit holds it until a majority stored
//! it): the order of commits is the log's. Expired offsets and those of
//! deleted topics are removed with tombstones (`Coordinator::expire_offsets`).
//!
//! Membership calls (JoinGroup, SyncGroup, Heartbeat, LeaveGroup) change
//! the group's [`membership::Membership`] under the partition's lock and
//! never wait there; what must be stored before members learn of it (a new
//! generation, the leader's assignment) is written by [`Coordinator::run`],
//! one background task per broker that also ends sessions and rebalances
//! whose time is up, and then answered. The assignment itself is computed
//! by the leader member (the client library's assignors), as in Kafka.

pub mod consumer_protocol;
mod members;
pub mod membership;
mod offsets;
pub mod records;
mod session;
pub mod state;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ferrolog_proto::TopicId;
use tokio::sync::Notify;

use self::records::Committed;
use self::session::{Cell, no_partitions};
use crate::config::{BrokerId, GroupsConfig, Limits};
use crate::control::liveness::Liveness;
use crate::error::ApiError;
use crate::groups::GroupRegistry;
use crate::metadata::command::ControllerRequest;
use crate::metadata::controller::Controller;
use crate::metadata::image::{MetadataImage, TopicEntry};

/// The internal topic of committed offsets and group records (Kafka's name).
pub const OFFSETS_TOPIC: &str = "__consumer_offsets";

/// Longest group id, bytes (Kafka has no limit; the key must stay small).
pub const GROUP_ID_MAX_BYTES: usize = 255;

/// The partition of [`OFFSETS_TOPIC`] (of `partitions`) that holds `group`:
/// Kafka's rule, `Utils.abs(groupId.hashCode()) % partitions` (the
/// absolute value, 0 for `Integer.MIN_VALUE`), with Java's
/// `String.hashCode` over UTF-16 code units, so a Kafka client's group
/// lands on the same partition number.
pub fn partition_for(group: &str, partitions: u32) -> u32 {
    let hash = group.encode_utf16().fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)));
    // Kafka's Utils.abs: the absolute value, and 0 for i32::MIN.
    hash.checked_abs().map_or(0, i32::unsigned_abs) % partitions.max(1)
}

/// Checks a group id.
///
/// # Errors
/// [`ApiError::InvalidGroupId`] for an empty id or one over
/// [`GROUP_ID_MAX_BYTES`].
pub fn validate_group_id(group: &str) -> Result<(), ApiError> {
    if group.is_empty() || group.len() > GROUP_ID_MAX_BYTES {
        return Err(ApiError::InvalidGroupId(format!(
            "a group id must be 1 to {GROUP_ID_MAX_BYTES} bytes, got {}",
            group.len()
        )));
    }
    Ok(())
}

/// One partition's commit in an OffsetCommit request.
#[derive(Clone, Debug)]
pub struct CommitRequest {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// The next offset the group will read.
    pub offset: u64,
    /// Free text stored with it.
    pub metadata: String,
    /// The topic's id (KIP-516) the offset belongs to, if the caller said.
    pub topic_id: Option<TopicId>,
}

/// A committed offset as answered: `None` when the group has none for
/// that partition (of the topic's current incarnation).
#[derive(Clone, Debug)]
pub struct CommittedOffset {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// The offset and what was stored with it.
    pub committed: Option<Committed>,
}

/// A group as listed or described.
#[derive(Clone, Debug)]
pub struct GroupDescription {
    /// Group id.
    pub group: String,
    /// Kafka's state name.
    pub state: &'static str,
    /// The generation of its last rebalance.
    pub generation: i32,
    /// The assignor in use.
    pub protocol: String,
    /// The members' protocol type ("consumer" for consumers; "" when it
    /// has no members).
    pub protocol_type: String,
    /// Its members.
    pub members: Vec<MemberDescription>,
    /// Its committed offsets (current topic incarnations only).
    pub offsets: Vec<CommittedOffset>,
}

/// A member as described.
#[derive(Clone, Debug)]
pub struct MemberDescription {
    /// Member id.
    pub id: String,
    /// The client's self-given name.
    pub client_id: String,
    /// Static membership's instance id.
    pub instance_id: Option<String>,
    /// Its metadata for the chosen protocol, as it sent it (Kafka's
    /// DescribeGroups `member_metadata`).
    pub metadata: bytes::Bytes,
    /// Its assignment, as the leader sent it (Kafka's DescribeGroups
    /// `member_assignment`); for a "consumer" group,
    /// [`consumer_protocol::assigned_partitions`] reads it.
    pub assignment: bytes::Bytes,
}

/// The group coordinator of one broker: serves the groups of the
/// [`OFFSETS_TOPIC`] partitions it leads. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Coordinator {
    me: BrokerId,
    groups: GroupRegistry,
    liveness: Liveness,
    controller: Controller,
    config: GroupsConfig,
    limits: Limits,
    /// Loaded state by the partition's Raft group id (a new incarnation of
    /// the topic has new group ids).
    loaded: Arc<std::sync::Mutex<HashMap<u64, Cell>>>,
    /// Wakes [`Coordinator::run`] when a membership call may let a group
    /// move on.
    kick: Arc<Notify>,
}

impl Coordinator {
    /// The coordinator of broker `me`.
    pub fn new(
        me: BrokerId,
        groups: GroupRegistry,
        liveness: Liveness,
        controller: Controller,
        config: GroupsConfig,
        limits: Limits,
    ) -> Self {
        Self {
            me,
            groups,
            liveness,
            controller,
            config,
            limits,
            loaded: Arc::default(),
            kick: Arc::default(),
        }
    }

    /// The [`OFFSETS_TOPIC`] entry of a confirmed-current image; when it
    /// does not exist, asks the controller to create it.
    ///
    /// # Errors
    /// [`ApiError::CoordinatorNotAvailable`] while it is created or the
    /// controller cannot be reached.
    async fn offsets_topic(&self) -> Result<(TopicEntry, Arc<MetadataImage>), ApiError> {
        let image = self.controller.image();
        if let Some(t) = image.topics.get(OFFSETS_TOPIC) {
            return Ok((t.clone(), image));
        }
        let confirmed = self
            .controller
            .current_image()
            .await
            .map_err(|e| ApiError::CoordinatorNotAvailable(format!("the metadata may be behind: {e}")))?;
        if let Some(t) = confirmed.image.topics.get(OFFSETS_TOPIC) {
            return Ok((t.clone(), confirmed.image.clone()));
        }
        let brokers = confirmed.image.brokers.values().filter(|b| !b.decommissioned).count();
        let rf = self.config.offsets_topic_replication_factor;
        if brokers < rf as usize {
            // As Kafka: not created with fewer replicas than configured (a
            // cluster still starting would keep them for good).
            return Err(ApiError::CoordinatorNotAvailable(format!(
                "{OFFSETS_TOPIC} needs groups.offsets_topic_replication_factor = {rf} brokers; {brokers} are registered"
            )));
        }
        let req = ControllerRequest::CreateTopic {
            name: OFFSETS_TOPIC.into(),
            partitions: self.config.offsets_topic_num_partitions,
            replication_factor: rf,
            config: BTreeMap::from([("cleanup.policy".into(), "compact".into())]),
        };
        match self.controller.handle(req).await {
            Ok(_) | Err(ApiError::TopicExists(_)) => {
                tracing::info!("created {OFFSETS_TOPIC} (or found it created)");
                Err(ApiError::CoordinatorNotAvailable(format!("{OFFSETS_TOPIC} is being created")))
            }
            Err(e) => Err(ApiError::CoordinatorNotAvailable(format!("cannot create {OFFSETS_TOPIC}: {e}"))),
        }
    }

    /// The [`OFFSETS_TOPIC`] partition of `group` and its leader's broker,
    /// if one is known (Kafka's FindCoordinator).
    ///
    /// # Errors
    /// [`ApiError::InvalidGroupId`]; [`ApiError::CoordinatorNotAvailable`]
    /// while the topic is created or the partition has no known leader.
    pub async fn find(&self, group: &str) -> Result<(u32, BrokerId), ApiError> {
        validate_group_id(group)?;
        let (topic, _) = self.offsets_topic().await?;
        let index = partition_for(group, topic.partitions.len() as u32);
        let a = topic.partitions.get(index as usize).ok_or_else(no_partitions)?;
        match self.groups.leader_of(&self.liveness, self.me, a) {
            0 => Err(ApiError::CoordinatorNotAvailable(format!("{OFFSETS_TOPIC}-{index} has no leader yet"))),
            b => Ok((index, b)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Java's `"...".hashCode()` values, and Kafka's partition for them
    /// with 50 partitions (`Utils.abs(hash) % 50`).
    #[test]
    fn partition_is_kafkas() {
        // Java: "a".hashCode() == 97, "group".hashCode() == 98629247,
        // "my-consumer-group".hashCode() == 1513705513.
        assert_eq!(partition_for("a", 50), 47);
        assert_eq!(partition_for("group", 50), 47);
        assert_eq!(partition_for("my-consumer-group", 50), 13);
        // Negative hashes: Kafka takes the absolute value ("my-group" is
        // -1906497762, "analytics" -1693017210), not the sign bit cleared.
        assert_eq!(partition_for("my-group", 50), 12);
        assert_eq!(partition_for("analytics", 50), 10);
        // "polygenelubricants".hashCode() is Integer.MIN_VALUE: Utils.abs gives 0.
        assert_eq!(partition_for("polygenelubricants", 50), 0);
        // A character outside the BMP counts as two UTF-16 units (1772899).
        assert_eq!(partition_for("😀", 50), 49);
        assert_eq!(partition_for("anything", 1), 0);
    }

    #[test]
    fn group_ids_are_checked() {
        assert!(validate_group_id("g").is_ok());
        assert!(matches!(validate_group_id(""), Err(ApiError::InvalidGroupId(_))));
        assert!(validate_group_id(&"x".repeat(GROUP_ID_MAX_BYTES)).is_ok());
        assert!(validate_group_id(&"x".repeat(GROUP_ID_MAX_BYTES + 1)).is_err());
    }
}
