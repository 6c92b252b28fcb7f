//! [`ApiError`] → wire `Error`, with the leader's address on `NOT_LEADER`.

use ferrolog_proto::client::{Error, ErrorCode, LeaderHint};

use crate::error::ApiError;
use crate::metadata::image::MetadataImage;

/// The wire error for `e`; `image` resolves a leader's broker id to its
/// client address.
pub fn to_wire(e: &ApiError, image: &MetadataImage) -> Error {
    let code = match e {
        ApiError::NotLeader { .. } => ErrorCode::NotLeader,
        ApiError::UnknownTopic(_) => ErrorCode::UnknownTopic,
        ApiError::OffsetOutOfRange { .. } => ErrorCode::OffsetOutOfRange,
        ApiError::RecordTooLarge(_) => ErrorCode::RecordTooLarge,
        ApiError::Invalid(_) => ErrorCode::InvalidRequest,
        ApiError::Unavailable(_) => ErrorCode::Unavailable,
        ApiError::TopicExists(_) => ErrorCode::TopicAlreadyExists,
        ApiError::OutOfOrderSequence { .. } => ErrorCode::OutOfOrderSequence,
        ApiError::ProducerFenced { .. } => ErrorCode::ProducerFenced,
        ApiError::Storage(_) => ErrorCode::StorageError,
        ApiError::DuplicateInFlight => ErrorCode::DuplicateInFlight,
        ApiError::InvalidReplicationFactor(_) => ErrorCode::InvalidReplicationFactor,
        ApiError::UnknownTopicId { .. } => ErrorCode::UnknownTopicId,
        ApiError::ElectionNotNeeded(_) => ErrorCode::ElectionNotNeeded,
        ApiError::PreferredLeaderNotAvailable(_) => ErrorCode::PreferredLeaderNotAvailable,
        ApiError::ReassignmentInProgress(_) => ErrorCode::ReassignmentInProgress,
        ApiError::NoReassignmentInProgress(_) => ErrorCode::NoReassignmentInProgress,
        ApiError::InvalidReplicaAssignment(_) => ErrorCode::InvalidReplicaAssignment,
        ApiError::InvalidPartitions(_) => ErrorCode::InvalidPartitions,
        ApiError::InvalidConfig(_) => ErrorCode::InvalidConfig,
        ApiError::InvalidRecord(_) => ErrorCode::InvalidRecord,
        ApiError::NotCoordinator { .. } => ErrorCode::NotCoordinator,
        ApiError::CoordinatorNotAvailable(_) => ErrorCode::CoordinatorNotAvailable,
        ApiError::CoordinatorLoadInProgress(_) => ErrorCode::CoordinatorLoadInProgress,
        ApiError::IllegalGeneration(_) => ErrorCode::IllegalGeneration,
        ApiError::UnknownMemberId(_) => ErrorCode::UnknownMemberId,
        ApiError::GroupIdNotFound(_) => ErrorCode::GroupIdNotFound,
        ApiError::NonEmptyGroup(_) => ErrorCode::NonEmptyGroup,
        ApiError::InvalidGroupId(_) => ErrorCode::InvalidGroupId,
        ApiError::OffsetMetadataTooLarge(_) => ErrorCode::OffsetMetadataTooLarge,
        ApiError::OffsetCommitBackwards(_) => ErrorCode::OffsetCommitBackwards,
        ApiError::InternalTopic(_) => ErrorCode::InternalTopic,
        ApiError::RebalanceInProgress(_) => ErrorCode::RebalanceInProgress,
        ApiError::InvalidSessionTimeout(_) => ErrorCode::InvalidSessionTimeout,
        ApiError::FencedInstanceId(_) => ErrorCode::FencedInstanceId,
        ApiError::InconsistentGroupProtocol(_) => ErrorCode::InconsistentGroupProtocol,
        ApiError::GroupSubscribedToTopic(_) => ErrorCode::GroupSubscribedToTopic,
    };
    let mut wire = Error { code: code as i32, message: e.to_string(), ..Error::default() };
    match e {
        ApiError::NotLeader { leader: Some(id) } | ApiError::NotCoordinator { coordinator: Some(id) } => {
            wire.leader =
                image.brokers.get(id).map(|b| LeaderHint { broker_id: *id, address: b.client_addr.clone() });
        }
        ApiError::OffsetOutOfRange { log_start_offset, log_end_offset, .. } => {
            wire.log_start_offset = *log_start_offset;
            wire.log_end_offset = *log_end_offset;
        }
        _ => {}
    }
    wire
}
