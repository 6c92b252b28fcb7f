//! The broker's API error: one variant per stable wire code. Mapped to the
//! wire in exactly one place (`grpc::errors`).

use crate::config::BrokerId;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum ApiError {
    /// This broker does not lead the partition or the controller.
    #[error("not the leader{}", leader.map(|l| format!("; broker {l} is")).unwrap_or_default())]
    NotLeader {
        /// The leader's broker id, if known.
        leader: Option<BrokerId>,
    },
    /// No such topic or partition.
    #[error("unknown topic or partition: {0}")]
    UnknownTopic(String),
    /// Fetch offset outside the partition's bounds.
    #[error("offset {offset} is outside [{log_start_offset}, {log_end_offset}]")]
    OffsetOutOfRange {
        /// The requested offset.
        offset: u64,
        /// First stored offset.
        log_start_offset: u64,
        /// The high watermark.
        log_end_offset: u64,
    },
    /// A record or batch over a size limit.
    #[error("record too large: {0}")]
    RecordTooLarge(String),
    /// Malformed request.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Temporarily unable to serve; retry.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The topic exists already.
    #[error("topic {0:?} already exists")]
    TopicExists(String),
    /// A producer batch out of sequence (KIP-98).
    #[error("out of order sequence: expected {expected}, got {got}")]
    OutOfOrderSequence {
        /// The expected first sequence number.
        expected: i32,
        /// The batch's first sequence number.
        got: i32,
    },
    /// An older producer epoch (KIP-98).
    #[error("producer fenced: epoch {got} is older than {current}")]
    ProducerFenced {
        /// The epoch in force.
        current: i16,
        /// The batch's epoch.
        got: i16,
    },
    /// The broker could not store or read data.
    #[error("storage error: {0}")]
    Storage(String),
    /// An earlier send of this batch is still replicating.
    #[error("an earlier send of this batch is still being replicated")]
    DuplicateInFlight,
    /// The cluster has fewer brokers than the replication factor (too few
    /// registered or answering in a big enough cluster is `Unavailable`).
    #[error("invalid replication factor: {0}")]
    InvalidReplicationFactor(String),
    /// The request named a topic and its id (KIP-516), and the topic of
    /// that name has another id (deleted and re-created) or is gone.
    #[error("topic {topic:?} was deleted or re-created: it no longer has id {id}{}", current_suffix(current))]
    UnknownTopicId {
        /// Topic name.
        topic: String,
        /// The id the request carried (UUID text).
        id: String,
        /// The current incarnation's id (UUID text), if the name exists.
        current: Option<String>,
    },
    /// TransferLeader: the requested replica leads already (Kafka's
    /// `ELECTION_NOT_NEEDED`).
    #[error("election not needed: {0}")]
    ElectionNotNeeded(String),
    /// TransferLeader: the requested replica cannot take over now (Kafka's
    /// `PREFERRED_LEADER_NOT_AVAILABLE`); the leadership did not move to it
    /// (the message says whether it stayed or went elsewhere).
    #[error("preferred leader not available: {0}")]
    PreferredLeaderNotAvailable(String),
    /// A reassignment of the partition runs already (Kafka's
    /// `REASSIGNMENT_IN_PROGRESS`): cancel it or wait for it to complete.
    #[error("reassignment in progress: {0}")]
    ReassignmentInProgress(String),
    /// Cancel of a partition that has no reassignment under way (Kafka's
    /// `NO_REASSIGNMENT_IN_PROGRESS`).
    #[error("no reassignment in progress: {0}")]
    NoReassignmentInProgress(String),
    /// A partition count a topic cannot be grown to (Kafka's
    /// `INVALID_PARTITIONS`): not more than it has, or over the limit.
    #[error("invalid partitions: {0}")]
    InvalidPartitions(String),
    /// A replica list that cannot be a partition's (Kafka's
    /// `INVALID_REPLICA_ASSIGNMENT`): empty, a broker twice, an unknown broker.
    #[error("invalid replica assignment: {0}")]
    InvalidReplicaAssignment(String),
    /// A topic configuration key Ferrolog does not know, or a value the key
    /// does not take (Kafka's `INVALID_CONFIG`); the message names the key.
    #[error("invalid config: {0}")]
    InvalidConfig(String),
    /// A produced record its topic does not take (Kafka's `INVALID_RECORD`):
    /// a record without a key in a compacted topic. The batch is refused whole.
    #[error("invalid record: {0}")]
    InvalidRecord(String),
    /// Group calls: this broker is not the group's coordinator (Kafka's
    /// `NOT_COORDINATOR`); `coordinator` is the one it knows of.
    #[error("not the group's coordinator{}", coordinator.map(|c| format!("; broker {c} is")).unwrap_or_default())]
    NotCoordinator {
        /// The coordinator's broker id, if known.
        coordinator: Option<BrokerId>,
    },
    /// The group's coordinator partition has no leader, or
    /// `__consumer_offsets` is being created (Kafka's
    /// `COORDINATOR_NOT_AVAILABLE`). Retriable.
    #[error("coordinator not available: {0}")]
    CoordinatorNotAvailable(String),
    /// The coordinator is reading its partition (Kafka's
    /// `COORDINATOR_LOAD_IN_PROGRESS`). Retriable.
    #[error("coordinator load in progress: {0}")]
    CoordinatorLoadInProgress(String),
    /// A member call from a generation that is not the group's current one
    /// (Kafka's `ILLEGAL_GENERATION`).
    #[error("illegal generation: {0}")]
    IllegalGeneration(String),
    /// A member call from a member id the group does not have (Kafka's
    /// `UNKNOWN_MEMBER_ID`).
    #[error("unknown member id: {0}")]
    UnknownMemberId(String),
    /// The group has neither members nor committed offsets (Kafka's
    /// `GROUP_ID_NOT_FOUND`).
    #[error("group {0:?} not found")]
    GroupIdNotFound(String),
    /// The group has members (Kafka's `NON_EMPTY_GROUP`).
    #[error("group {0:?} has members; stop them first")]
    NonEmptyGroup(String),
    /// An empty or over-long group id (Kafka's `INVALID_GROUP_ID`).
    #[error("invalid group id: {0}")]
    InvalidGroupId(String),
    /// A commit's metadata over `groups.offset_metadata_max_bytes` (Kafka's
    /// `OFFSET_METADATA_TOO_LARGE`).
    #[error("offset metadata too large: {0}")]
    OffsetMetadataTooLarge(String),
    /// A commit below the committed offset without `allow_backwards`.
    #[error("commit goes backwards: {0}")]
    OffsetCommitBackwards(String),
    /// The group is rebalancing (Kafka's `REBALANCE_IN_PROGRESS`): rejoin.
    #[error("rebalance in progress: {0}")]
    RebalanceInProgress(String),
    /// A session timeout outside the broker's bounds (Kafka's
    /// `INVALID_SESSION_TIMEOUT`).
    #[error("invalid session timeout: {0}")]
    InvalidSessionTimeout(String),
    /// A static member replaced by a newer instance (Kafka's
    /// `FENCED_INSTANCE_ID`).
    #[error("fenced instance id: {0}")]
    FencedInstanceId(String),
    /// A member whose protocols the group's members do not share (Kafka's
    /// `INCONSISTENT_GROUP_PROTOCOL`).
    #[error("inconsistent group protocol: {0}")]
    InconsistentGroupProtocol(String),
    /// OffsetDelete of a topic that a member of the group subscribes to
    /// (Kafka's `GROUP_SUBSCRIBED_TO_TOPIC`, KIP-496): the offset is kept.
    #[error("group subscribed to topic: {0}")]
    GroupSubscribedToTopic(String),
    /// A produce to an internal topic (`__consumer_offsets`).
    #[error("topic {0:?} is internal: only its coordinators write it")]
    InternalTopic(String),
}

fn current_suffix(current: &Option<String>) -> String {
    current
        .as_ref()
        .map(|c| format!(" (its id is now {c})"))
        .unwrap_or_else(|| " (it no longer exists)".into())
}
