//! Produce and InitProducerId.
//!
//! `acks=all` waits for the Raft commit: a majority has the batch fsynced.
//! `acks=1` is treated like `all`: a Ferrolog leader has no meaningful
//! "written locally" point to acknowledge earlier (its own write is part
//! of the commit it waits for), and answering before the commit would
//! promise less than the log keeps. `acks=0` is stored the same way and
//! gets no response, as Kafka does; a failure then closes the connection
//! (Kafka's way of telling such a producer), which the client notices.

use bytes::Bytes;
use ferrolog_raft_store::RecordBatch;
use futures::StreamExt;
use kafka_protocol::ResponseError;
use kafka_protocol::messages::ProducerId;
use kafka_protocol::messages::init_producer_id_request::InitProducerIdRequest;
use kafka_protocol::messages::init_producer_id_response::InitProducerIdResponse;
use kafka_protocol::messages::produce_request::ProduceRequest;
use kafka_protocol::messages::produce_response::{
    PartitionProduceResponse, ProduceResponse, TopicProduceResponse,
};
use kafka_protocol::protocol::StrBytes;

use super::{KafkaService, errors};
use crate::coordinator::OFFSETS_TOPIC;
use crate::error::ApiError;
use crate::metadata::command::{ControllerReply, ControllerRequest};
use crate::metadata::controller::now_ms;
use crate::partition::kafka_batch::{self, BatchError};
use crate::partition::records;

/// Partitions of one produce request stored at once.
const PARTITIONS_AT_ONCE: usize = 8;

/// The outcome of one partition's batch.
struct Outcome {
    error: i16,
    message: Option<String>,
    base_offset: i64,
    log_append_time_ms: i64,
    log_start_offset: i64,
}

impl Outcome {
    fn failed(error: i16, message: String) -> Self {
        Outcome {
            error,
            message: Some(message),
            base_offset: -1,
            log_append_time_ms: -1,
            log_start_offset: -1,
        }
    }
}

/// Answers Produce; `None` for `acks=0` when every batch was stored.
///
/// # Errors
/// For `acks=0`, the first failure (the connection is then closed).
pub async fn produce(s: &KafkaService, r: ProduceRequest) -> Result<Option<ProduceResponse>, String> {
    if r.transactional_id.is_some() {
        let mut resp = ProduceResponse::default();
        for t in r.topic_data {
            let parts = t
                .partition_data
                .iter()
                .map(|p| {
                    PartitionProduceResponse::default()
                        .with_index(p.index)
                        .with_error_code(ResponseError::TransactionalIdAuthorizationFailed.code())
                        .with_error_message(Some(StrBytes::from_static_str("transactions are not supported")))
                })
                .collect();
            resp.responses
                .push(TopicProduceResponse::default().with_name(t.name).with_partition_responses(parts));
        }
        return Ok(Some(resp));
    }
    let acks = r.acks;
    let mut work = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for t in &r.topic_data {
        for p in &t.partition_data {
            let twice = !seen.insert((t.name.0.clone(), p.index));
            work.push((t.name.0.to_string(), p.index, p.records.clone(), twice));
        }
    }
    // A few partitions at a time, in order: each holds at most one batch's
    // decoding, so a request's memory stays within a few batches.
    let outcomes: Vec<Outcome> = futures::stream::iter(work)
        .map(|(topic, index, records, twice)| async move {
            if twice {
                let e = ApiError::Invalid(format!("{topic}-{index} is named twice in one produce request"));
                return Outcome::failed(errors::code(&e), e.to_string());
            }
            one(s, &topic, index, records).await
        })
        .buffered(PARTITIONS_AT_ONCE)
        .collect()
        .await;
    if acks == 0 {
        if let Some(o) = outcomes.iter().find(|o| o.error != errors::NONE) {
            return Err(format!(
                "an acks=0 produce failed (error {}: {})",
                o.error,
                o.message.clone().unwrap_or_default()
            ));
        }
        return Ok(None);
    }
    let mut outcomes = outcomes.into_iter();
    let mut resp = ProduceResponse::default();
    for t in r.topic_data {
        let parts = t
            .partition_data
            .iter()
            .map(|p| {
                let o = outcomes.next().unwrap_or(Outcome {
                    error: ResponseError::UnknownServerError.code(),
                    message: None,
                    base_offset: -1,
                    log_append_time_ms: -1,
                    log_start_offset: -1,
                });
                PartitionProduceResponse::default()
                    .with_index(p.index)
                    .with_error_code(o.error)
                    .with_error_message(o.message.map(StrBytes::from_string))
                    .with_base_offset(o.base_offset)
                    .with_log_append_time_ms(o.log_append_time_ms)
                    .with_log_start_offset(o.log_start_offset)
            })
            .collect();
        resp.responses
            .push(TopicProduceResponse::default().with_name(t.name).with_partition_responses(parts));
    }
    Ok(Some(resp))
}

async fn one(s: &KafkaService, topic: &str, index: i32, records: Option<Bytes>) -> Outcome {
    let failed = Outcome::failed;
    let api = |e: ApiError| failed(errors::code(&e), e.to_string());
    if topic == OFFSETS_TOPIC {
        return api(ApiError::InternalTopic(topic.to_owned()));
    }
    let Ok(partition) = u32::try_from(index) else {
        return api(ApiError::UnknownTopic(format!("{topic} has no partition {index}")));
    };
    let served = match s.core.served(topic, partition, None).await {
        Ok(served) => served,
        Err(e) => return api(e),
    };
    let Some(bytes) = records.filter(|b| !b.is_empty()) else {
        return failed(ResponseError::CorruptMessage.code(), "no record batch".into());
    };
    let now = now_ms();
    // Decoded records are dropped before the write is awaited.
    let stored = match checked(s, &served, topic, bytes, now) {
        Ok(stored) => stored,
        Err(o) => return o,
    };
    match served.partition.produce(stored).await {
        // A duplicate (KIP-98) is answered as Kafka does: no error, the
        // original batch's offset.
        Ok((base_offset, _duplicate)) => Outcome {
            error: errors::NONE,
            message: None,
            base_offset: i64::try_from(base_offset).unwrap_or(-1),
            log_append_time_ms: if served.log_append_time { now } else { -1 },
            log_start_offset: i64::try_from(served.partition.replica.log_start_offset()).unwrap_or(-1),
        },
        Err(e) => api(e),
    }
}

/// The stored batch for a produced one, or the refusal: the batch's checks
/// (`kafka_batch::check_produced`), then the topic's limits and rules.
#[allow(clippy::result_large_err)]
fn checked(
    s: &KafkaService,
    served: &crate::grpc::service::Served,
    topic: &str,
    bytes: Bytes,
    now: i64,
) -> Result<RecordBatch, Outcome> {
    let failed = Outcome::failed;
    let api = |e: ApiError| failed(errors::code(&e), e.to_string());
    let max_batch = served.max_batch_bytes;
    let max_record = s.core.limits.max_record_bytes.min(max_batch);
    let mut batch = kafka_batch::check_produced(bytes, records::batch_encoded_bytes_max(max_batch))
        .map_err(|e| failed(errors::batch_code(&e), e.to_string()))?;
    let mut total = 0usize;
    for (i, r) in batch.records.iter().enumerate() {
        let size = r.size_bytes();
        if size > max_record {
            let e = BatchError::TooLarge(records::too_large_record(i, size, max_record));
            return Err(failed(errors::batch_code(&e), e.to_string()));
        }
        total = total.saturating_add(size);
        if served.compacted && r.key.is_none() {
            let e = ApiError::InvalidRecord(format!(
                "record {i} has no key, and topic {topic:?} is compacted (cleanup.policy=compact)"
            ));
            return Err(api(e));
        }
    }
    if total > max_batch {
        let e = BatchError::TooLarge(format!(
            "the batch's records are {total} bytes (key + value + headers); the limit is {max_batch} bytes"
        ));
        return Err(failed(errors::batch_code(&e), e.to_string()));
    }
    // The topic's timestamp type rules, whatever the producer's attributes
    // say (as Kafka's broker does).
    if served.log_append_time {
        batch.stamp_log_append_time(now);
    } else if batch.header.log_append_time() {
        batch.clear_log_append_time();
    }
    let h = batch.header;
    if h.producer_id < -1 || (h.producer_id >= 0 && h.base_sequence < 0) {
        return Err(api(ApiError::Invalid(format!(
            "bad producer fields: id {} sequence {}",
            h.producer_id, h.base_sequence
        ))));
    }
    Ok(RecordBatch {
        record_count: batch.records.len() as u32,
        first_timestamp_ms: batch.first_timestamp_ms(),
        max_timestamp_ms: batch.max_timestamp_ms(),
        producer_id: h.producer_id,
        producer_epoch: h.producer_epoch,
        base_sequence: h.base_sequence,
        records: batch.payload(),
    })
}

/// Answers InitProducerId for idempotent producers (KIP-98): a new producer
/// id with epoch 0, from the controller. A producer that names its current
/// id and epoch (KIP-360, v3+) gets a new id too, which the protocol
/// allows. A transactional id is refused: transactions are not supported.
pub async fn init_producer_id(s: &KafkaService, r: InitProducerIdRequest) -> InitProducerIdResponse {
    let resp = InitProducerIdResponse::default().with_producer_id(ProducerId(-1)).with_producer_epoch(-1);
    if r.transactional_id.is_some() {
        return resp.with_error_code(ResponseError::TransactionalIdAuthorizationFailed.code());
    }
    match s.core.admin(ControllerRequest::AllocateProducerId).await {
        Ok(ControllerReply::ProducerId { producer_id }) => {
            resp.with_producer_id(ProducerId(producer_id)).with_producer_epoch(0)
        }
        Ok(_) => resp.with_error_code(ResponseError::CoordinatorLoadInProgress.code()),
        Err(e) => resp.with_error_code(match e {
            // The id is allocated by the controller: retriable while it moves
            // (COORDINATOR_NOT_AVAILABLE would send a Java producer looking for
            // a transaction coordinator, which is not served).
            ApiError::Unavailable(_) | ApiError::NotLeader { .. } => {
                ResponseError::CoordinatorLoadInProgress.code()
            }
            other => errors::code(&other),
        }),
    }
}
