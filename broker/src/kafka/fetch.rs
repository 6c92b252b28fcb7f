//! Fetch and ListOffsets.
//!
//! A fetch returns committed records only (below the high watermark), in
//! whole batches: the stored Kafka batches as they were produced (still
//! compressed), batches written through gRPC encoded as uncompressed Kafka
//! batches. Limits follow KIP-74: `partition_max_bytes` per partition and
//! `max_bytes` per response, except that the first batch of the first
//! partition with data is returned whatever its size. Fetch sessions
//! (KIP-227) are declined (session id 0): every fetch is a full one.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use futures::stream::{FuturesUnordered, StreamExt};
use kafka_protocol::ResponseError;
use kafka_protocol::messages::BrokerId;
use kafka_protocol::messages::fetch_request::FetchRequest;
use kafka_protocol::messages::fetch_response::{FetchResponse, FetchableTopicResponse, PartitionData};
use kafka_protocol::messages::list_offsets_request::ListOffsetsRequest;
use kafka_protocol::messages::list_offsets_response::{
    ListOffsetsPartitionResponse, ListOffsetsResponse, ListOffsetsTopicResponse,
};

use super::{KafkaService, errors};
use crate::error::ApiError;
use crate::partition::{Partition, kafka_batch, records};

/// One partition of a fetch: where to read, and the replica once found.
struct Want {
    topic: usize,
    index: i32,
    offset: i64,
    max_bytes: usize,
    partition: Result<Arc<Partition>, ApiError>,
}

/// Answers Fetch.
pub async fn fetch(s: &KafkaService, r: FetchRequest) -> FetchResponse {
    if r.session_id != 0 {
        // No session was ever handed out (KIP-227).
        return FetchResponse::default().with_error_code(ResponseError::FetchSessionIdNotFound.code());
    }
    let mut wants = Vec::new();
    for (ti, t) in r.topics.iter().enumerate() {
        for p in &t.partitions {
            let partition = match u32::try_from(p.partition) {
                Ok(i) => s.core.partition(&t.topic.0, i, None).await,
                Err(_) => {
                    Err(ApiError::UnknownTopic(format!("{} has no partition {}", &*t.topic.0, p.partition)))
                }
            };
            wants.push(Want {
                topic: ti,
                index: p.partition,
                offset: p.fetch_offset,
                max_bytes: usize::try_from(p.partition_max_bytes).unwrap_or(0),
                partition,
            });
        }
    }
    let max_total = usize::try_from(r.max_bytes).unwrap_or(0).min(s.core.limits.max_fetch_bytes).max(1);
    let min_bytes = usize::try_from(r.min_bytes).unwrap_or(0);
    let wait =
        Duration::from_millis(u64::try_from(r.max_wait_ms).unwrap_or(0).min(s.core.limits.max_fetch_wait_ms));
    let deadline = tokio::time::Instant::now() + wait;
    let mut answer = read_all(&wants, max_total).await;
    // Long poll: until `min_bytes` are there, a partition has an error to
    // tell (a moved leader, an offset out of range: answered at once), or
    // the wait ends. Each round waits for a partition's high watermark to
    // pass what the last read saw, so no round spins.
    loop {
        let erred = answer.partitions.iter().any(|d| d.error_code != errors::NONE);
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if answer.bytes >= min_bytes.max(1) || erred || left.is_zero() {
            break;
        }
        let mut waits: FuturesUnordered<_> = wants
            .iter()
            .zip(&answer.partitions)
            .filter_map(|(w, d)| {
                let p = w.partition.as_ref().ok()?.clone();
                let seen = u64::try_from(w.offset.max(d.high_watermark)).ok()?;
                Some(async move { p.wait_past(seen, left).await })
            })
            .collect();
        if waits.is_empty() {
            break;
        }
        let _ = tokio::time::timeout(left, waits.next()).await;
        drop(waits);
        answer = read_all(&wants, max_total).await;
    }
    let mut topics: Vec<FetchableTopicResponse> = r
        .topics
        .iter()
        .map(|t| FetchableTopicResponse::default().with_topic(t.topic.clone()).with_topic_id(t.topic_id))
        .collect();
    for (w, data) in wants.iter().zip(answer.partitions) {
        topics[w.topic].partitions.push(data);
    }
    FetchResponse::default().with_session_id(0).with_responses(topics)
}

struct Answer {
    partitions: Vec<PartitionData>,
    bytes: usize,
}

/// Partitions of one fetch read at once.
const READS_AT_ONCE: usize = 4;

/// One partition's read: its batches (none past the response's limit),
/// high watermark and log start offset.
type Read = Result<(Vec<ferrolog_raft_store::StoredBatch>, u64, u64), ApiError>;

async fn read_all(wants: &[Want], max_total: usize) -> Answer {
    // Read a few partitions at a time, in order; the response is assembled
    // in order, within the limits. A read that starts once the response
    // is full only answers the offsets.
    let used = std::sync::atomic::AtomicUsize::new(0);
    let used = &used;
    let futures: Vec<futures::future::BoxFuture<'_, Option<Read>>> = wants
        .iter()
        .map(|w| -> futures::future::BoxFuture<'_, Option<Read>> {
            Box::pin(async move {
                let (Ok(p), Ok(offset)) = (&w.partition, u64::try_from(w.offset)) else {
                    return None;
                };
                let room = max_total
                    .saturating_sub(used.load(std::sync::atomic::Ordering::Relaxed))
                    .min(w.max_bytes);
                let read: Read = if room == 0 {
                    p.offsets().await.map(|(start, hw)| (Vec::new(), hw, start))
                } else {
                    p.fetch(offset, room, Duration::ZERO)
                        .await
                        .map(|o| (o.batches, o.high_watermark, o.log_start_offset))
                };
                Some(read)
            })
        })
        .collect();
    let mut reads = futures::stream::iter(futures).buffered(READS_AT_ONCE);
    let mut partitions = Vec::with_capacity(wants.len());
    let mut total = 0usize;
    for w in wants {
        let read = reads.next().await.flatten();
        let mut d = PartitionData::default()
            .with_partition_index(w.index)
            .with_high_watermark(-1)
            .with_last_stable_offset(-1)
            .with_log_start_offset(-1)
            .with_preferred_read_replica(BrokerId(-1))
            .with_aborted_transactions(Some(Vec::new()));
        let p = match &w.partition {
            Ok(p) => p,
            Err(e) => {
                partitions.push(d.with_error_code(errors::code(e)));
                continue;
            }
        };
        let Some(read) = read else {
            partitions.push(d.with_error_code(ResponseError::OffsetOutOfRange.code()));
            continue;
        };
        let room = max_total.saturating_sub(total).min(w.max_bytes);
        match read {
            Ok((batches, hw, start)) => {
                let mut out = BytesMut::new();
                for b in batches.iter().filter(|b| b.header.record_count > 0) {
                    let before = out.len();
                    if let Err(e) = kafka_batch::serve(b, records::decode, &mut out) {
                        tracing::error!(partition = %format!("{}-{}", p.topic, p.partition), "kafka fetch: {e}");
                        d.error_code = ResponseError::KafkaStorageError.code();
                        break;
                    }
                    // KIP-74: beyond the first batch of the response, stay within the limits.
                    if (total > 0 || before > 0) && out.len() > room {
                        out.truncate(before);
                        break;
                    }
                }
                total += out.len();
                used.store(total, std::sync::atomic::Ordering::Relaxed);
                let hw = i64::try_from(hw).unwrap_or(-1);
                d = d
                    .with_high_watermark(hw)
                    .with_last_stable_offset(hw)
                    .with_log_start_offset(i64::try_from(start).unwrap_or(-1))
                    .with_records(Some(out.freeze()));
            }
            Err(e) => {
                if let ApiError::OffsetOutOfRange { log_start_offset, log_end_offset, .. } = &e {
                    d = d
                        .with_high_watermark(i64::try_from(*log_end_offset).unwrap_or(-1))
                        .with_log_start_offset(i64::try_from(*log_start_offset).unwrap_or(-1));
                }
                d.error_code = errors::code(&e);
            }
        }
        partitions.push(d);
    }
    Answer { partitions, bytes: total }
}

/// ListOffsets timestamp: the latest offset (the high watermark).
const LATEST: i64 = -1;
/// ListOffsets timestamp: the earliest offset (the log start offset).
const EARLIEST: i64 = -2;

/// Answers ListOffsets: earliest (-2), latest (-1), or the first record
/// whose timestamp is at least the one given (KIP-79); none that late is
/// offset -1, timestamp -1, as Kafka answers.
pub async fn list_offsets(s: &KafkaService, r: ListOffsetsRequest) -> ListOffsetsResponse {
    let mut topics = Vec::with_capacity(r.topics.len());
    for t in r.topics {
        let mut parts = Vec::with_capacity(t.partitions.len());
        for p in &t.partitions {
            let result: Result<(i64, i64), ApiError> = async {
                let i = u32::try_from(p.partition_index)
                    .map_err(|_| ApiError::UnknownTopic(format!("no partition {}", p.partition_index)))?;
                let part = s.core.partition(&t.name.0, i, None).await?;
                let (start, hw) = part.offsets().await?;
                Ok(match p.timestamp {
                    LATEST => (hw as i64, -1),
                    EARLIEST => (start as i64, -1),
                    ts if ts >= 0 => match part.offset_for_timestamp(ts).await? {
                        Some((offset, at)) => (offset as i64, at),
                        None => (-1, -1),
                    },
                    other => return Err(ApiError::Invalid(format!("timestamp query {other} is not served"))),
                })
            }
            .await;
            let resp = ListOffsetsPartitionResponse::default()
                .with_partition_index(p.partition_index)
                .with_leader_epoch(-1);
            parts.push(match result {
                Ok((offset, timestamp)) => resp.with_offset(offset).with_timestamp(timestamp),
                Err(e) => resp.with_error_code(errors::code(&e)).with_offset(-1).with_timestamp(-1),
            });
        }
        topics.push(ListOffsetsTopicResponse::default().with_name(t.name).with_partitions(parts));
    }
    ListOffsetsResponse::default().with_topics(topics)
}
