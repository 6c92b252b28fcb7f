//! The client library's error type.
//!
//! Brokers report errors in-band with a stable numeric [`ErrorCode`]
//! (`client.proto`; a retired code is never reused); `Error::from_wire` is
//! the one place that turns them into [`Error`]. Transport failures (gRPC
//! status, timeouts, refused connections) are [`Error::Transport`] and
//! [`Error::Timeout`].
//!
//! [`Error::retry`] says whether an operation may be retried: the producer,
//! consumer and admin client retry [`Retry::Yes`] errors with backoff until
//! their deadline, and retry [`Retry::AfterEarlierFailure`] only when an
//! earlier batch of the same partition is still unacknowledged.

use ferrolog_proto::client as pb;
pub use ferrolog_proto::client::ErrorCode;

/// Shorthand for results of this library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where a partition's leader is, as a broker that is not the leader
/// reported it with `NOT_LEADER`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderHint {
    /// The leader's broker id (≥ 1).
    pub broker_id: u32,
    /// The leader's client API address, `host:port`.
    pub address: String,
}

/// Whether an operation that failed with an error may be retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Transient: retry after backoff (refreshing metadata first when
    /// [`Error::needs_metadata_refresh`] says so).
    Yes,
    /// `OUT_OF_ORDER_SEQUENCE`: transient when an earlier batch of the same
    /// producer and partition has not been acknowledged (it failed or is
    /// still in flight, so the broker saw a gap); otherwise the broker and
    /// the producer disagree on the sequence and the batch fails (KIP-98).
    AfterEarlierFailure,
    /// Permanent: retrying the same request cannot succeed.
    No,
}

/// Everything that can go wrong in the client library.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A broker answered `operation` with an in-band error other than the
    /// ones that have their own variant.
    #[error("{operation}: {}: {message}", code_name(*code))]
    Broker {
        /// What was asked, e.g. `produce to orders/3`.
        operation: String,
        /// The wire's [`ErrorCode`] as a number (unknown codes are kept).
        code: i32,
        /// The broker's explanation.
        message: String,
        /// With `NOT_LEADER`: the leader, when the broker knows it.
        leader: Option<LeaderHint>,
    },
    /// `OFFSET_OUT_OF_RANGE`: the fetch offset is outside the partition's
    /// retained records.
    #[error(
        "{topic}/{partition}: offset {offset} is out of range: the partition holds offsets \
         {log_start_offset} up to (not including) {log_end_offset}"
    )]
    OffsetOutOfRange {
        /// Topic name.
        topic: String,
        /// Partition number.
        partition: u32,
        /// The offset asked for.
        offset: u64,
        /// First retained offset.
        log_start_offset: u64,
        /// Offset after the last committed record (the high watermark).
        log_end_offset: u64,
    },
    /// `RECORD_TOO_LARGE`: a record or batch exceeds the broker's
    /// `limits.max_record_bytes` / `limits.max_batch_bytes` (key + value +
    /// headers), or a request exceeds a gRPC message limit. The producer
    /// checks each record against the broker's `max_record_bytes` before
    /// sending it. Never retried.
    #[error("{topic}/{partition}: record too large ({bytes} bytes in the batch): {message}")]
    RecordTooLarge {
        /// Topic name.
        topic: String,
        /// Partition number.
        partition: u32,
        /// Encoded size of the rejected batch's records, bytes; for a record
        /// the producer refused itself, its key + value + headers.
        bytes: usize,
        /// The explanation: it names the limit and the size.
        message: String,
    },
    /// The topic does not exist (after waiting for metadata to show it).
    #[error("unknown topic {topic:?}")]
    UnknownTopic {
        /// Topic name.
        topic: String,
    },
    /// A partition number at or above the topic's partition count.
    #[error("topic {topic:?} has {partitions} partitions; there is no partition {partition}")]
    UnknownPartition {
        /// Topic name.
        topic: String,
        /// The partition asked for.
        partition: u32,
        /// The topic's partition count.
        partitions: u32,
    },
    /// The gRPC call failed: connection refused or reset, broker shutting
    /// down, or a gRPC status from the server stack.
    #[error("{operation}: transport error with {address}: {code:?}: {message}")]
    Transport {
        /// What was asked.
        operation: String,
        /// The broker's client API address.
        address: String,
        /// The gRPC status code.
        code: tonic::Code,
        /// The status message.
        message: String,
    },
    /// No answer within the request timeout.
    #[error("{operation}: no answer from {address} within {timeout_ms} ms")]
    Timeout {
        /// What was asked.
        operation: String,
        /// The broker's client API address.
        address: String,
        /// The timeout, ms.
        timeout_ms: u64,
    },
    /// A broker address that cannot be turned into a gRPC endpoint.
    #[error("invalid broker address {address:?}: {message}")]
    InvalidAddress {
        /// The address as given.
        address: String,
        /// Why it is invalid.
        message: String,
    },
    /// No broker answered a metadata request.
    #[error("no broker answered (tried {tried}); last error: {last}")]
    NoBrokerReachable {
        /// The addresses tried, comma-separated.
        tried: String,
        /// The last failure.
        last: Box<Error>,
    },
    /// The producer gave up on a batch after `delivery_timeout_ms`.
    #[error("{topic}/{partition}: not delivered within {timeout_ms} ms{}", last_error_suffix(last))]
    DeliveryTimeout {
        /// Topic name.
        topic: String,
        /// Partition number.
        partition: u32,
        /// The delivery timeout, ms.
        timeout_ms: u64,
        /// The last error seen while retrying, if any.
        last: Option<Box<Error>>,
    },
    /// An operation did not finish before its deadline (admin calls, waits).
    #[error("{operation}: gave up after {timeout_ms} ms{}", last_error_suffix(last))]
    Deadline {
        /// What was attempted.
        operation: String,
        /// The deadline, ms.
        timeout_ms: u64,
        /// The last error seen while retrying, if any.
        last: Option<Box<Error>>,
    },
    /// A broker's answer that breaks the protocol (undecodable records,
    /// counts that disagree).
    #[error("malformed response from the broker: {0}")]
    Protocol(String),
    /// The producer was closed, or its worker stopped, before the record
    /// was delivered.
    #[error("the producer is closed")]
    Closed,
    /// A configuration value that cannot work.
    #[error("invalid client configuration: {0}")]
    Config(String),
    /// `UNKNOWN_TOPIC_ID` (KIP-516): the topic this client started on was
    /// deleted, or deleted and re-created under the same name (a new
    /// incarnation with a new id). Offsets and records of the old
    /// incarnation mean nothing in the new one, so this is never retried:
    /// the consumer stops the partition (or, with
    /// [`crate::consumer::OnTopicRecreated::Restart`], starts the new
    /// incarnation from its beginning) and the producer fails the records.
    #[error("{operation}: topic {topic:?} was deleted or re-created (UNKNOWN_TOPIC_ID): {message}")]
    TopicRecreated {
        /// What was asked, e.g. `fetch from orders/3`.
        operation: String,
        /// Topic name.
        topic: String,
        /// The broker's explanation (names the old and the current id).
        message: String,
    },
}

fn code_name(code: i32) -> String {
    match ErrorCode::try_from(code) {
        Ok(c) => c.as_str_name().to_owned(),
        Err(_) => format!("error code {code}"),
    }
}

fn last_error_suffix(last: &Option<Box<Error>>) -> String {
    match last {
        Some(e) => format!("; last error: {e}"),
        None => String::new(),
    }
}

/// What a request was about, so that a wire error can name it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Op<'a> {
    /// Verb, e.g. `produce to`.
    pub name: &'static str,
    /// Topic, or "" for cluster-wide calls.
    pub topic: &'a str,
    /// Partition, for partition calls.
    pub partition: Option<u32>,
    /// The offset asked for (fetch).
    pub offset: u64,
    /// Size of the records sent (produce), bytes.
    pub bytes: usize,
}

impl<'a> Op<'a> {
    /// A cluster-wide or topic-wide call.
    pub(crate) fn new(name: &'static str, topic: &'a str) -> Self {
        Op { name, topic, partition: None, offset: 0, bytes: 0 }
    }

    /// A call about one partition.
    pub(crate) fn partition(name: &'static str, topic: &'a str, partition: u32) -> Self {
        Op { name, topic, partition: Some(partition), offset: 0, bytes: 0 }
    }

    pub(crate) fn describe(&self) -> String {
        match (self.topic.is_empty(), self.partition) {
            (true, _) => self.name.to_owned(),
            (false, None) => format!("{} {}", self.name, self.topic),
            (false, Some(p)) => format!("{} {}/{}", self.name, self.topic, p),
        }
    }
}

impl Error {
    /// Maps a response's in-band error to `Ok(())` (absent or `NONE`) or an
    /// [`Error`]. The one place wire errors become library errors.
    pub(crate) fn from_wire(op: &Op<'_>, error: Option<pb::Error>) -> Result<()> {
        let Some(e) = error else { return Ok(()) };
        let topic = op.topic.to_owned();
        let partition = op.partition.unwrap_or(0);
        match ErrorCode::try_from(e.code) {
            Ok(ErrorCode::None) => Ok(()),
            Ok(ErrorCode::OffsetOutOfRange) => Err(Error::OffsetOutOfRange {
                topic,
                partition,
                offset: op.offset,
                log_start_offset: e.log_start_offset,
                log_end_offset: e.log_end_offset,
            }),
            Ok(ErrorCode::RecordTooLarge) => {
                Err(Error::RecordTooLarge { topic, partition, bytes: op.bytes, message: e.message })
            }
            Ok(ErrorCode::UnknownTopicId) => {
                // Our brokers' message starts with what Display says already.
                let said = format!("topic {topic:?} was deleted or re-created: ");
                let message = e.message.strip_prefix(&said).map_or(e.message.clone(), str::to_owned);
                Err(Error::TopicRecreated { operation: op.describe(), topic, message })
            }
            _ => Err(Error::Broker {
                operation: op.describe(),
                code: e.code,
                message: e.message,
                leader: e
                    .leader
                    .filter(|l| l.broker_id != 0 && !l.address.is_empty())
                    .map(|l| LeaderHint { broker_id: l.broker_id, address: l.address }),
            }),
        }
    }

    /// Wraps a gRPC status from a call to `address`.
    pub(crate) fn transport(op: &Op<'_>, address: &str, status: tonic::Status) -> Error {
        Error::Transport {
            operation: op.describe(),
            address: address.to_owned(),
            code: status.code(),
            message: status.message().to_owned(),
        }
    }

    /// The wire error code, for [`Error::Broker`] and the variants mapped
    /// from a code.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Broker { code, .. } => ErrorCode::try_from(*code).ok(),
            Error::OffsetOutOfRange { .. } => Some(ErrorCode::OffsetOutOfRange),
            Error::RecordTooLarge { .. } => Some(ErrorCode::RecordTooLarge),
            Error::TopicRecreated { .. } => Some(ErrorCode::UnknownTopicId),
            _ => None,
        }
    }

    /// The leader named by a `NOT_LEADER` answer, if any.
    pub fn leader_hint(&self) -> Option<&LeaderHint> {
        match self {
            Error::Broker { leader, .. } => leader.as_ref(),
            _ => None,
        }
    }

    /// Whether retrying may help; see [`Retry`].
    ///
    /// Retried: `NOT_LEADER`, `UNAVAILABLE`, `DUPLICATE_IN_FLIGHT`, the
    /// coordinator's `NOT_COORDINATOR`, `COORDINATOR_NOT_AVAILABLE` and
    /// `COORDINATOR_LOAD_IN_PROGRESS`, `UNKNOWN_TOPIC` (metadata of a new topic reaches brokers at different
    /// times; Kafka retries `UNKNOWN_TOPIC_OR_PARTITION` too), transport
    /// failures and timeouts. `OUT_OF_ORDER_SEQUENCE` is
    /// [`Retry::AfterEarlierFailure`]. Everything else is permanent,
    /// `UNKNOWN_TOPIC_ID` ([`Error::TopicRecreated`]) included: retrying
    /// with the same topic id cannot succeed, and without it would carry
    /// offsets or records into another incarnation of the topic.
    pub fn retry(&self) -> Retry {
        match self {
            Error::Broker { code, .. } => match ErrorCode::try_from(*code) {
                Ok(
                    ErrorCode::NotLeader
                    | ErrorCode::Unavailable
                    | ErrorCode::DuplicateInFlight
                    | ErrorCode::UnknownTopic
                    | ErrorCode::NotCoordinator
                    | ErrorCode::CoordinatorNotAvailable
                    | ErrorCode::CoordinatorLoadInProgress,
                ) => Retry::Yes,
                Ok(ErrorCode::OutOfOrderSequence) => Retry::AfterEarlierFailure,
                _ => Retry::No,
            },
            Error::Transport { code, .. } => match code {
                // The server understood the call and refused it as such:
                // sending it again gets the same answer.
                tonic::Code::InvalidArgument
                | tonic::Code::Unimplemented
                | tonic::Code::ResourceExhausted
                | tonic::Code::PermissionDenied
                | tonic::Code::Unauthenticated
                | tonic::Code::FailedPrecondition
                | tonic::Code::OutOfRange
                | tonic::Code::AlreadyExists
                | tonic::Code::NotFound => Retry::No,
                _ => Retry::Yes,
            },
            Error::Timeout { .. } | Error::NoBrokerReachable { .. } => Retry::Yes,
            _ => Retry::No,
        }
    }

    /// Shorthand for `retry() == Retry::Yes`.
    pub fn is_retriable(&self) -> bool {
        self.retry() == Retry::Yes
    }

    /// Whether the client's idea of who leads what may be stale: leadership
    /// errors, unknown topics (or topic ids) and any failure to reach a broker.
    pub fn needs_metadata_refresh(&self) -> bool {
        match self {
            Error::TopicRecreated { .. } => true,
            Error::Broker { .. } => {
                matches!(
                    self.code(),
                    Some(
                        ErrorCode::NotLeader
                            | ErrorCode::Unavailable
                            | ErrorCode::UnknownTopic
                            | ErrorCode::NotCoordinator
                            | ErrorCode::CoordinatorNotAvailable
                    )
                )
            }
            Error::Transport { .. } | Error::Timeout { .. } | Error::NoBrokerReachable { .. } => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(code: ErrorCode) -> Option<pb::Error> {
        Some(pb::Error { code: code as i32, message: "m".into(), ..Default::default() })
    }

    #[test]
    fn absent_or_none_is_ok() {
        let op = Op::partition("produce to", "t", 1);
        assert!(Error::from_wire(&op, None).is_ok());
        assert!(Error::from_wire(&op, wire(ErrorCode::None)).is_ok());
    }

    #[test]
    fn classifies_codes() {
        let op = Op::partition("produce to", "t", 1);
        let retry = |c| Error::from_wire(&op, wire(c)).expect_err("error").retry();
        assert_eq!(retry(ErrorCode::NotLeader), Retry::Yes);
        assert_eq!(retry(ErrorCode::Unavailable), Retry::Yes);
        assert_eq!(retry(ErrorCode::DuplicateInFlight), Retry::Yes);
        assert_eq!(retry(ErrorCode::OutOfOrderSequence), Retry::AfterEarlierFailure);
        assert_eq!(retry(ErrorCode::RecordTooLarge), Retry::No);
        assert_eq!(retry(ErrorCode::InvalidRequest), Retry::No);
        assert_eq!(retry(ErrorCode::ProducerFenced), Retry::No);
        assert_eq!(retry(ErrorCode::UnknownTopicId), Retry::No);
        let recreated = Error::from_wire(&op, wire(ErrorCode::UnknownTopicId)).expect_err("error");
        assert!(matches!(&recreated, Error::TopicRecreated { topic, .. } if topic == "t"));
        assert_eq!(recreated.code(), Some(ErrorCode::UnknownTopicId));
        assert!(recreated.needs_metadata_refresh());
        assert!(recreated.to_string().contains("topic \"t\" was deleted or re-created"), "{recreated}");
        let unavailable = Error::transport(&op, "a:1", tonic::Status::unavailable("down"));
        assert!(unavailable.is_retriable());
        assert!(unavailable.needs_metadata_refresh());
        let bad = Error::transport(&op, "a:1", tonic::Status::invalid_argument("no"));
        assert_eq!(bad.retry(), Retry::No);
    }

    #[test]
    fn keeps_leader_hint_and_bounds() {
        let op = Op { offset: 7, ..Op::partition("fetch from", "t", 2) };
        let mut e = wire(ErrorCode::NotLeader).expect("some");
        e.leader = Some(pb::LeaderHint { broker_id: 3, address: "h:9403".into() });
        let err = Error::from_wire(&op, Some(e)).expect_err("error");
        assert_eq!(err.leader_hint(), Some(&LeaderHint { broker_id: 3, address: "h:9403".into() }));
        assert_eq!(err.code(), Some(ErrorCode::NotLeader));
        assert!(err.to_string().contains("NOT_LEADER"), "{err}");

        let mut e = wire(ErrorCode::OffsetOutOfRange).expect("some");
        e.log_start_offset = 10;
        e.log_end_offset = 20;
        match Error::from_wire(&op, Some(e)) {
            Err(Error::OffsetOutOfRange { offset: 7, log_start_offset: 10, log_end_offset: 20, .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn unknown_codes_are_kept_and_fatal() {
        let op = Op::new("metadata", "");
        let err = Error::from_wire(&op, Some(pb::Error { code: 999, ..Default::default() })).expect_err("e");
        assert_eq!(err.code(), None);
        assert_eq!(err.retry(), Retry::No);
        assert!(err.to_string().contains("error code 999"));
    }
}
