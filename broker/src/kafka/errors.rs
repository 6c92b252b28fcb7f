//! [`ApiError`] → Kafka's error codes (Kafka's `Errors` enum; the codes are
//! the protocol's, the names those of `ResponseError`).

use kafka_protocol::ResponseError as K;

use crate::error::ApiError;
use crate::partition::kafka_batch::BatchError;

/// The Kafka error code for `e`.
///
/// Where Ferrolog has no exact counterpart: `Unavailable` (no leader ready,
/// no quorum, metadata behind) is `LEADER_NOT_AVAILABLE`, retriable and
/// making clients refresh their metadata; a retry of a batch still being
/// replicated is `REQUEST_TIMED_OUT`, retriable; an internal topic is
/// `INVALID_TOPIC_EXCEPTION`, as Kafka answers a produce to one. Commits
/// through the Kafka listener may go backwards (Kafka's meaning), so
/// `OffsetCommitBackwards` does not arise there.
pub fn code(e: &ApiError) -> i16 {
    let k = match e {
        ApiError::NotLeader { .. } => K::NotLeaderOrFollower,
        ApiError::UnknownTopic(_) => K::UnknownTopicOrPartition,
        ApiError::OffsetOutOfRange { .. } => K::OffsetOutOfRange,
        ApiError::RecordTooLarge(_) => K::MessageTooLarge,
        ApiError::Invalid(_) => K::InvalidRequest,
        ApiError::Unavailable(_) => K::LeaderNotAvailable,
        ApiError::TopicExists(_) => K::TopicAlreadyExists,
        ApiError::OutOfOrderSequence { .. } => K::OutOfOrderSequenceNumber,
        // For an idempotent producer without a transactional id, Kafka
        // answers an old epoch with INVALID_PRODUCER_EPOCH.
        ApiError::ProducerFenced { .. } => K::InvalidProducerEpoch,
        ApiError::Storage(_) => K::KafkaStorageError,
        ApiError::DuplicateInFlight => K::RequestTimedOut,
        ApiError::InvalidReplicationFactor(_) => K::InvalidReplicationFactor,
        ApiError::UnknownTopicId { .. } => K::UnknownTopicId,
        ApiError::ElectionNotNeeded(_) => K::ElectionNotNeeded,
        ApiError::PreferredLeaderNotAvailable(_) => K::PreferredLeaderNotAvailable,
        ApiError::ReassignmentInProgress(_) => K::ReassignmentInProgress,
        ApiError::NoReassignmentInProgress(_) => K::NoReassignmentInProgress,
        ApiError::InvalidPartitions(_) => K::InvalidPartitions,
        ApiError::InvalidReplicaAssignment(_) => K::InvalidReplicaAssignment,
        ApiError::InvalidConfig(_) => K::InvalidConfig,
        ApiError::InvalidRecord(_) => K::InvalidRecord,
        ApiError::NotCoordinator { .. } => K::NotCoordinator,
        ApiError::CoordinatorNotAvailable(_) => K::CoordinatorNotAvailable,
        ApiError::CoordinatorLoadInProgress(_) => K::CoordinatorLoadInProgress,
        ApiError::IllegalGeneration(_) => K::IllegalGeneration,
        ApiError::UnknownMemberId(_) => K::UnknownMemberId,
        ApiError::GroupIdNotFound(_) => K::GroupIdNotFound,
        ApiError::NonEmptyGroup(_) => K::NonEmptyGroup,
        ApiError::InvalidGroupId(_) => K::InvalidGroupId,
        ApiError::OffsetMetadataTooLarge(_) => K::OffsetMetadataTooLarge,
        ApiError::OffsetCommitBackwards(_) => K::InvalidCommitOffsetSize,
        ApiError::InternalTopic(_) => K::InvalidTopicException,
        ApiError::RebalanceInProgress(_) => K::RebalanceInProgress,
        ApiError::InvalidSessionTimeout(_) => K::InvalidSessionTimeout,
        ApiError::FencedInstanceId(_) => K::FencedInstanceId,
        ApiError::InconsistentGroupProtocol(_) => K::InconsistentGroupProtocol,
        ApiError::GroupSubscribedToTopic(_) => K::GroupSubscribedToTopic,
    };
    k.code()
}

/// The Kafka error code for `e` answered by a group API: as Kafka's group
/// coordinator answers, so clients retry rather than fail. A write to
/// `__consumer_offsets` that cannot commit now (no quorum, leader moving,
/// storage) is `COORDINATOR_NOT_AVAILABLE` (clients look the coordinator
/// up again); the partition's leadership gone is `NOT_COORDINATOR`; a
/// commit record over the size limit is `INVALID_COMMIT_OFFSET_SIZE`.
pub fn group_code(e: &ApiError) -> i16 {
    match e {
        ApiError::Unavailable(_) | ApiError::DuplicateInFlight | ApiError::Storage(_) => {
            K::CoordinatorNotAvailable.code()
        }
        ApiError::NotLeader { .. } => K::NotCoordinator.code(),
        ApiError::RecordTooLarge(_) => K::InvalidCommitOffsetSize.code(),
        other => code(other),
    }
}

/// The Kafka error code for a refused produce batch.
pub fn batch_code(e: &BatchError) -> i16 {
    match e {
        BatchError::Corrupt(_) => K::CorruptMessage,
        BatchError::Invalid(_) => K::InvalidRecord,
        BatchError::Unsupported(_) => K::UnsupportedForMessageFormat,
        BatchError::TooLarge(_) => K::MessageTooLarge,
    }
    .code()
}

/// Code 0: no error.
pub const NONE: i16 = 0;
