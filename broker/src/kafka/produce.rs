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
use std::sync::Arc;

use futures::StreamExt;
use futures::future::BoxFuture;
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
use crate::partition::{Partition, Produced};

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

/// A produce answer still to come: `None` for `acks=0` when every batch
/// was stored; for `acks=0`, the first failure is an error (the connection
/// is then closed).
pub type PendingProduce = BoxFuture<'static, Result<Option<ProduceResponse>, String>>;

/// Answers Produce in two steps: every batch is checked and proposed before
/// this returns (so requests that follow on the connection are proposed
/// after it, in order); the returned future waits for the commits and
/// builds the answer.
pub async fn produce(s: &KafkaService, r: ProduceRequest) -> PendingProduce {
    if r.transactional_id.is_some() {
        let refused = || {
            Outcome::failed(
                ResponseError::TransactionalIdAuthorizationFailed.code(),
                "transactions are not supported".into(),
            )
        };
        let outcomes = r.topic_data.iter().flat_map(|t| t.partition_data.iter().map(|_| refused())).collect();
        let acks = r.acks.max(1); // a refusal is always answered
        return Box::pin(futures::future::ready(answer(r, acks, outcomes)));
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
    let begun: Vec<Begun> = futures::stream::iter(work)
        .map(|(topic, index, records, twice)| async move {
            if twice {
                let e = ApiError::Invalid(format!("{topic}-{index} is named twice in one produce request"));
                return Begun::Done(Outcome::failed(errors::code(&e), e.to_string()));
            }
            begin(s, &topic, index, records).await
        })
        .buffered(PARTITIONS_AT_ONCE)
        .collect()
        .await;
    Box::pin(async move {
        let outcomes = futures::future::join_all(begun.into_iter().map(Begun::outcome)).await;
        answer(r, acks, outcomes)
    })
}

/// The answer once every batch's outcome is known.
fn answer(r: ProduceRequest, acks: i16, outcomes: Vec<Outcome>) -> Result<Option<ProduceResponse>, String> {
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

/// One partition's batch: refused, or proposed.
enum Begun {
    /// Refused (or answered) before any proposal.
    Done(Outcome),
    /// Proposed; its commit to await.
    Proposed { ticket: Produced, partition: Arc<Partition>, log_append_time: bool, now: i64 },
}

impl Begun {
    async fn outcome(self) -> Outcome {
        match self {
            Begun::Done(o) => o,
            // A duplicate (KIP-98) is answered as Kafka does: no error, the
            // original batch's offset.
            Begun::Proposed { ticket, partition, log_append_time, now } => match ticket.wait().await {
                Ok((base_offset, _duplicate)) => Outcome {
                    error: errors::NONE,
                    message: None,
                    base_offset: i64::try_from(base_offset).unwrap_or(-1),
                    log_append_time_ms: if log_append_time { now } else { -1 },
                    log_start_offset: i64::try_from(partition.replica.log_start_offset()).unwrap_or(-1),
                },
                Err(e) => Outcome::failed(errors::code(&e), e.to_string()),
            },
        }
    }
}

async fn begin(s: &KafkaService, topic: &str, index: i32, records: Option<Bytes>) -> Begun {
    match one(s, topic, index, records).await {
        Ok(b) => b,
        Err(o) => Begun::Done(o),
    }
}

#[allow(clippy::result_large_err)]
async fn one(s: &KafkaService, topic: &str, index: i32, records: Option<Bytes>) -> Result<Begun, Outcome> {
    let failed = Outcome::failed;
    let api = |e: ApiError| failed(errors::code(&e), e.to_string());
    if topic == OFFSETS_TOPIC {
        return Err(api(ApiError::InternalTopic(topic.to_owned())));
    }
    let Ok(partition) = u32::try_from(index) else {
        return Err(api(ApiError::UnknownTopic(format!("{topic} has no partition {index}"))));
    };
    let served = s.core.served(topic, partition, None).await.map_err(api)?;
    let Some(bytes) = records.filter(|b| !b.is_empty()) else {
        return Err(failed(ResponseError::CorruptMessage.code(), "no record batch".into()));
    };
    let now = now_ms();
    // Decoded records are dropped before the write is awaited.
    let stored = checked(s, &served, topic, bytes, now)?;
    let ticket = served.partition.produce_begin(stored).await.map_err(api)?;
    Ok(Begun::Proposed { ticket, partition: served.partition, log_append_time: served.log_append_time, now })
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
    // The topic's codec and timestamp type rule, whatever the producer's
    // attributes say (as Kafka's broker does).
    if let Some(codec) = served.compression {
        batch.recompress(codec).map_err(|e| failed(errors::batch_code(&e), e.to_string()))?;
        // Kafka checks the size again after recompressing (an incompressible
        // batch may grow).
        let max = records::batch_encoded_bytes_max(max_batch);
        if batch.bytes.len() > max {
            let e = BatchError::TooLarge(format!(
                "the batch is {} bytes recompressed with the topic's compression.type={}; at most {max} are stored",
                batch.bytes.len(),
                codec.name()
            ));
            return Err(failed(errors::batch_code(&e), e.to_string()));
        }
    }
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
