//! The consumer: reads assigned partitions from positions chosen by seeks.
//!
//! Each assigned partition has at most one request outstanding, kept across
//! [`Consumer::poll`] calls: a `ListOffsets` to turn a [`Seek`] into an
//! offset, then long-poll `Fetch`es (`fetch_max_wait_ms`) from the
//! partition's leader. A `Fetch` answers whole stored batches, each an
//! encoded `RecordSet`; the first may start before the requested offset,
//! and the records below it are skipped.
//!
//! `NOT_LEADER`, `UNAVAILABLE`, unknown topics and transport failures are
//! retried with backoff after a metadata refresh, forever (as Kafka's
//! consumer does); `poll` returns what other partitions have meanwhile.
//! `OFFSET_OUT_OF_RANGE` and malformed answers are returned by `poll` and
//! pause the partition until the next [`Consumer::seek`].
//!
//! Topic identity (KIP-516): each partition remembers the id of the topic
//! incarnation its position belongs to (from the metadata when it was
//! assigned or when a seek was resolved) and sends it with every
//! `ListOffsets` and `Fetch`. When the topic was deleted or re-created the
//! broker answers `UNKNOWN_TOPIC_ID`: `poll` returns
//! [`Error::TopicRecreated`] and pauses the partition
//! ([`OnTopicRecreated::Fail`], the default), or the partition starts the
//! new incarnation from its beginning ([`OnTopicRecreated::Restart`],
//! reported by [`Consumer::take_restarts`]). An offset is never carried
//! from one incarnation to another.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrolog_proto::TopicId;
use ferrolog_proto::client as pb;
use prost::Message;
use tokio::task::{AbortHandle, JoinSet};

use crate::error::{Error, Op, Result, Retry};
use crate::metadata::MetadataCache;
use crate::record::ConsumerRecord;

/// Where to start reading a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seek {
    /// The first retained record (the log start offset).
    Earliest,
    /// After the last committed record (the high watermark): only new records.
    Latest,
    /// This offset.
    Offset(u64),
    /// The first record, in offset order, whose timestamp is at or after
    /// this time, ms since the Unix epoch (Kafka's rule, KIP-79, whatever
    /// order timestamps come in); the high watermark when none is.
    Timestamp(i64),
}

/// What the consumer does with a partition whose topic was deleted or
/// re-created (`UNKNOWN_TOPIC_ID`, KIP-516) under its position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnTopicRecreated {
    /// `poll` returns [`Error::TopicRecreated`] and the partition stops
    /// until the next [`Consumer::seek`] (a seek to `Earliest`, `Latest` or
    /// a time reads the topic now bearing the name).
    #[default]
    Fail,
    /// The partition starts again at the beginning (log start offset) of
    /// the topic now bearing the name, as soon as it exists; each restart
    /// is logged as a warning and listed by [`Consumer::take_restarts`].
    Restart,
}

/// A partition that started a new incarnation of its topic from the
/// beginning ([`OnTopicRecreated::Restart`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicRestart {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// Where the partition was in the old incarnation: the offset of the
    /// next record it would have read.
    pub old_position: u64,
    /// The broker's explanation (names the old and the current topic id).
    pub reason: String,
}

/// Consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// How long a broker holds a fetch when there is nothing new, ms
    /// (Kafka's `fetch.max.wait.ms`, 500).
    pub fetch_max_wait_ms: u32,
    /// Most bytes asked per partition per fetch (Kafka's
    /// `max.partition.fetch.bytes`, 1 MiB); at least one batch is always
    /// returned (KIP-74).
    pub fetch_max_bytes: u32,
    /// How long `list_offsets` retries transient errors.
    pub list_offsets_timeout_ms: u64,
    /// When the topic is deleted or re-created under a partition's
    /// position (KIP-516): fail (default) or restart from the beginning of
    /// the new incarnation.
    pub on_topic_recreated: OnTopicRecreated,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            fetch_max_wait_ms: 500,
            fetch_max_bytes: 1 << 20,
            list_offsets_timeout_ms: 30_000,
            on_topic_recreated: OnTopicRecreated::Fail,
        }
    }
}

/// A partition's position: an offset, or a seek still to resolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Position {
    Offset(u64),
    Pending(Seek),
}

#[derive(Debug)]
struct Assigned {
    position: Position,
    /// Incremented by each seek, so answers to older requests are dropped.
    epoch: u64,
    in_flight: Option<AbortHandle>,
    retry_at: Option<Instant>,
    failures: u32,
    /// A permanent error stopped the partition until the next seek.
    paused: bool,
    high_watermark: Option<u64>,
    log_start_offset: Option<u64>,
    /// After a timestamp seek: skip records of the first fetched batch
    /// before the first one at or after this time (the broker finds the
    /// batch; Kafka's `ListOffsets` names the record).
    first_batch_min_timestamp_ms: Option<i64>,
    /// The id of the topic incarnation the position belongs to (KIP-516);
    /// `None` until learned from the metadata by the first request.
    topic_id: Option<TopicId>,
}

type Key = (String, u32);

/// What a partition's request task found.
enum Outcome {
    /// A seek resolved to an offset; for a timestamp seek that found a
    /// batch, the timestamp to skip to within that first batch.
    Resolved { offset: u64, first_batch_min_timestamp_ms: Option<i64>, topic_id: Option<TopicId> },
    Fetched {
        topic_id: Option<TopicId>,
        records: Vec<ConsumerRecord>,
        next_offset: u64,
        high_watermark: u64,
        log_start_offset: u64,
    },
}

struct Done {
    key: Key,
    epoch: u64,
    result: Result<Outcome>,
}

/// Reads records from assigned partitions. Not shared between tasks: one
/// consumer per reading task.
pub struct Consumer {
    meta: Arc<MetadataCache>,
    config: ConsumerConfig,
    assigned: BTreeMap<Key, Assigned>,
    tasks: JoinSet<Done>,
    task_keys: HashMap<tokio::task::Id, Key>,
    ready: VecDeque<ConsumerRecord>,
    restarts: Vec<TopicRestart>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer").field("assigned", &self.assigned.keys()).finish_non_exhaustive()
    }
}

impl Consumer {
    /// A consumer with nothing assigned.
    pub fn new(meta: Arc<MetadataCache>, config: ConsumerConfig) -> Self {
        Consumer {
            meta,
            config,
            assigned: BTreeMap::new(),
            tasks: JoinSet::new(),
            task_keys: HashMap::new(),
            ready: VecDeque::new(),
            restarts: Vec::new(),
        }
    }

    /// The partitions that started a new incarnation of their topic from
    /// the beginning since the last call ([`OnTopicRecreated::Restart`]),
    /// for the caller to report.
    pub fn take_restarts(&mut self) -> Vec<TopicRestart> {
        std::mem::take(&mut self.restarts)
    }

    /// Assigns partitions of `topic`, each starting at `from`. Reassigning a
    /// partition seeks it.
    pub fn assign(&mut self, topic: &str, partitions: impl IntoIterator<Item = u32>, from: Seek) {
        for p in partitions {
            self.seek(topic, p, from);
        }
    }

    /// Assigns every partition of `topic`, waiting up to `wait` for the
    /// topic to appear in the metadata; returns the partition numbers.
    /// The partitions are bound to the topic's id as the metadata gave it
    /// (KIP-516): if that incarnation is deleted before they are read,
    /// they get `UNKNOWN_TOPIC_ID`.
    ///
    /// # Errors
    /// [`Error::UnknownTopic`] when it does not appear in time.
    pub async fn assign_topic(&mut self, topic: &str, from: Seek, wait: Duration) -> Result<Vec<u32>> {
        let t = self.meta.topic(topic, wait).await?;
        let partitions: Vec<u32> = t.partitions.iter().map(|p| p.partition).collect();
        self.assign(topic, partitions.iter().copied(), from);
        if let Some(id) = t.topic_id {
            self.bind_topic_id(topic, id);
        }
        Ok(partitions)
    }

    /// Binds every assigned partition of `topic` to the topic incarnation
    /// `topic_id` (KIP-516), e.g. the id in the metadata the caller used to
    /// choose partitions: requests carry it, and if that incarnation is
    /// gone they get `UNKNOWN_TOPIC_ID` rather than reading another one.
    pub fn bind_topic_id(&mut self, topic: &str, topic_id: TopicId) {
        for ((t, _), a) in &mut self.assigned {
            if t == topic {
                a.topic_id = Some(topic_id);
            }
        }
    }

    /// Moves a partition's position (assigning it if needed); records
    /// already fetched for it from the old position are dropped. A seek to
    /// an offset keeps the topic id the partition is bound to (an offset
    /// means something only in its incarnation); a seek to `Earliest`,
    /// `Latest` or a time binds it to whichever incarnation bears the name
    /// when the seek is resolved.
    pub fn seek(&mut self, topic: &str, partition: u32, to: Seek) {
        let key = (topic.to_owned(), partition);
        let position = match to {
            Seek::Offset(o) => Position::Offset(o),
            other => Position::Pending(other),
        };
        let a = self.assigned.entry(key).or_insert(Assigned {
            position,
            epoch: 0,
            in_flight: None,
            retry_at: None,
            failures: 0,
            paused: false,
            high_watermark: None,
            log_start_offset: None,
            first_batch_min_timestamp_ms: None,
            topic_id: None,
        });
        if !matches!(to, Seek::Offset(_)) {
            a.topic_id = None;
        }
        a.position = position;
        a.epoch += 1;
        a.paused = false;
        a.retry_at = None;
        a.first_batch_min_timestamp_ms = None;
        a.failures = 0;
        if let Some(task) = a.in_flight.take() {
            task.abort();
        }
        self.ready.retain(|r| !(r.topic == topic && r.partition == partition));
    }

    /// Stops reading a partition: its position, request in flight and
    /// buffered records are dropped (a later [`Consumer::seek`] assigns it
    /// again).
    pub fn unassign(&mut self, topic: &str, partition: u32) {
        if let Some(mut a) = self.assigned.remove(&(topic.to_owned(), partition))
            && let Some(task) = a.in_flight.take()
        {
            task.abort();
        }
        self.ready.retain(|r| !(r.topic == topic && r.partition == partition));
    }

    /// Binds one assigned partition to the topic incarnation `topic_id`
    /// (see [`Consumer::bind_topic_id`]).
    pub fn bind_partition(&mut self, topic: &str, partition: u32, topic_id: TopicId) {
        if let Some(a) = self.assigned.get_mut(&(topic.to_owned(), partition)) {
            a.topic_id = Some(topic_id);
        }
    }

    /// The topic id (KIP-516) an assigned partition is bound to, once known.
    pub fn topic_id(&self, topic: &str, partition: u32) -> Option<TopicId> {
        self.assigned.get(&(topic.to_owned(), partition))?.topic_id
    }

    /// The assigned partitions.
    pub fn assignment(&self) -> Vec<(String, u32)> {
        self.assigned.keys().cloned().collect()
    }

    /// The offset of the next record `poll` returns for the partition;
    /// `None` when unassigned or while a seek is unresolved.
    pub fn position(&self, topic: &str, partition: u32) -> Option<u64> {
        let a = self.assigned.get(&(topic.to_owned(), partition))?;
        let buffered = self.ready.iter().find(|r| r.topic == topic && r.partition == partition);
        match (buffered, a.position) {
            (Some(r), _) => Some(r.offset),
            (None, Position::Offset(o)) => Some(o),
            (None, Position::Pending(_)) => None,
        }
    }

    /// The high watermark the last fetch of the partition reported.
    pub fn high_watermark(&self, topic: &str, partition: u32) -> Option<u64> {
        self.assigned.get(&(topic.to_owned(), partition))?.high_watermark
    }

    /// The log start offset the last fetch of the partition reported.
    pub fn log_start_offset(&self, topic: &str, partition: u32) -> Option<u64> {
        self.assigned.get(&(topic.to_owned(), partition))?.log_start_offset
    }

    /// Asks the partition's leader for an offset: `Earliest` → log start,
    /// `Latest` → high watermark, `Timestamp` → first offset at or after
    /// it, `Offset` → itself. Retries transient errors.
    ///
    /// # Errors
    /// Permanent errors, or [`Error::Deadline`] after `list_offsets_timeout_ms`.
    pub async fn list_offset(&self, topic: &str, partition: u32, seek: Seek) -> Result<u64> {
        let id = self.bound_topic_id(topic, partition);
        list_offset(&self.meta, &self.config, topic, partition, seek, id).await.map(|(offset, ..)| offset)
    }

    /// The topic id an assigned partition is bound to, if known.
    fn bound_topic_id(&self, topic: &str, partition: u32) -> Option<TopicId> {
        self.assigned.get(&(topic.to_owned(), partition)).and_then(|a| a.topic_id)
    }

    /// Kafka's ListOffsets by timestamp (KIP-79): the first committed record
    /// of the partition, in offset order, whose timestamp is at or after
    /// `timestamp_ms` (ms since the Unix epoch), as `(offset, its
    /// timestamp)`; `None` when no committed record is that late. Retries
    /// transient errors.
    ///
    /// # Errors
    /// Permanent errors, or [`Error::Deadline`] after `list_offsets_timeout_ms`.
    pub async fn offset_for_timestamp(
        &self,
        topic: &str,
        partition: u32,
        timestamp_ms: i64,
    ) -> Result<Option<(u64, i64)>> {
        let seek = Seek::Timestamp(timestamp_ms);
        let id = self.bound_topic_id(topic, partition);
        let (offset, found, ts, _) =
            list_offset(&self.meta, &self.config, topic, partition, seek, id).await?;
        // A broker from before record granularity sends no timestamp.
        Ok(found.then_some((offset, ts.unwrap_or(timestamp_ms))))
    }

    /// Returns records fetched since the last call, waiting up to `timeout`
    /// for some to arrive. Records of one partition come in offset order.
    ///
    /// # Errors
    /// [`Error::OffsetOutOfRange`] (with the partition's bounds),
    /// [`Error::TopicRecreated`] (the topic was deleted or re-created,
    /// KIP-516; unless [`OnTopicRecreated::Restart`]) or
    /// [`Error::Protocol`] for one partition, which is paused until
    /// [`Consumer::seek`]; records of other partitions stay buffered for the
    /// next call.
    pub async fn poll(&mut self, timeout: Duration) -> Result<Vec<ConsumerRecord>> {
        let deadline = Instant::now() + timeout;
        loop {
            if !self.ready.is_empty() {
                return Ok(self.ready.drain(..).collect());
            }
            let now = Instant::now();
            self.start_requests(now);
            if now >= deadline {
                return Ok(Vec::new());
            }
            let retry = self
                .assigned
                .values()
                .filter(|a| a.in_flight.is_none() && !a.paused)
                .filter_map(|a| a.retry_at);
            let wake = retry.min().map_or(deadline, |t| t.min(deadline));
            if self.tasks.is_empty() {
                tokio::time::sleep_until(wake.into()).await;
                continue;
            }
            tokio::select! {
                joined = self.tasks.join_next_with_id() => {
                    if let Some(joined) = joined {
                        self.finished(joined)?;
                    }
                    while let Some(joined) = self.tasks.try_join_next_with_id() {
                        self.finished(joined)?;
                    }
                }
                () = tokio::time::sleep_until(wake.into()) => {}
            }
        }
    }

    /// Starts a request for every partition that needs one now.
    fn start_requests(&mut self, now: Instant) {
        for (key, a) in &mut self.assigned {
            if a.in_flight.is_some() || a.paused || a.retry_at.is_some_and(|t| now < t) {
                continue;
            }
            let (meta, config, key2, epoch, position, min_ts, topic_id) = (
                self.meta.clone(),
                self.config.clone(),
                key.clone(),
                a.epoch,
                a.position,
                a.first_batch_min_timestamp_ms,
                a.topic_id,
            );
            let handle = self.tasks.spawn(async move {
                let (topic, partition) = (&key2.0, key2.1);
                let result = match position {
                    Position::Pending(seek) => list_offset(&meta, &config, topic, partition, seek, topic_id)
                        .await
                        .map(|(offset, found, _, topic_id)| {
                            let first_batch_min_timestamp_ms = match seek {
                                Seek::Timestamp(t) if found => Some(t),
                                _ => None,
                            };
                            Outcome::Resolved { offset, first_batch_min_timestamp_ms, topic_id }
                        }),
                    Position::Offset(offset) => {
                        fetch(&meta, &config, topic, partition, offset, min_ts, topic_id).await
                    }
                };
                Done { key: key2, epoch, result }
            });
            self.task_keys.insert(handle.id(), key.clone());
            a.in_flight = Some(handle);
        }
    }

    /// Applies one finished request.
    fn finished(
        &mut self,
        joined: std::result::Result<(tokio::task::Id, Done), tokio::task::JoinError>,
    ) -> Result<()> {
        let done = match joined {
            Ok((id, done)) => {
                self.task_keys.remove(&id);
                done
            }
            Err(e) => {
                // Aborted by a seek (its partition already moved on), or panicked.
                if let Some(key) = self.task_keys.remove(&e.id())
                    && let Some(a) = self.assigned.get_mut(&key)
                    && a.in_flight.as_ref().is_some_and(|h| h.id() == e.id())
                {
                    a.in_flight = None;
                }
                if e.is_panic() {
                    return Err(Error::Protocol(format!("consumer request task panicked: {e}")));
                }
                return Ok(());
            }
        };
        let Some(a) = self.assigned.get_mut(&done.key) else { return Ok(()) };
        if done.epoch != a.epoch {
            return Ok(());
        }
        a.in_flight = None;
        let (topic, partition) = (&done.key.0, done.key.1);
        match done.result {
            Ok(Outcome::Resolved { offset, first_batch_min_timestamp_ms, topic_id }) => {
                a.topic_id = a.topic_id.or(topic_id);
                a.position = Position::Offset(offset);
                a.first_batch_min_timestamp_ms = first_batch_min_timestamp_ms;
                a.failures = 0;
            }
            Ok(Outcome::Fetched { topic_id, records, next_offset, high_watermark, log_start_offset }) => {
                a.topic_id = a.topic_id.or(topic_id);
                a.failures = 0;
                a.high_watermark = Some(high_watermark);
                a.log_start_offset = Some(log_start_offset);
                a.position = Position::Offset(next_offset);
                if !records.is_empty() {
                    a.first_batch_min_timestamp_ms = None;
                }
                self.ready.extend(records);
            }
            Err(Error::TopicRecreated { message, .. })
                if self.config.on_topic_recreated == OnTopicRecreated::Restart =>
            {
                self.meta.forget_leader(topic, partition);
                let old_position = match a.position {
                    Position::Offset(o) => o,
                    Position::Pending(_) => 0,
                };
                tracing::warn!(%topic, partition, old_position, reason = %message,
                    "topic was deleted or re-created: reading the new one from its beginning");
                a.topic_id = None;
                a.position = Position::Pending(Seek::Earliest);
                a.first_batch_min_timestamp_ms = None;
                a.high_watermark = None;
                a.log_start_offset = None;
                a.failures = 0;
                a.retry_at = None;
                self.restarts.push(TopicRestart {
                    topic: topic.clone(),
                    partition,
                    old_position,
                    reason: message,
                });
            }
            Err(e) if e.retry() == Retry::Yes => {
                self.meta.note_failure(topic, partition, &e);
                let delay = self.meta.config().backoff.delay(a.failures);
                a.failures = a.failures.saturating_add(1);
                a.retry_at = Some(Instant::now() + delay);
                if a.failures == 10 {
                    tracing::warn!(%topic, partition, error = %e, "still failing to read; retrying");
                } else {
                    tracing::debug!(%topic, partition, error = %e, "read failed; retrying");
                }
            }
            Err(e) => {
                if matches!(e, Error::TopicRecreated { .. }) {
                    self.meta.forget_leader(topic, partition);
                }
                a.paused = true;
                return Err(e);
            }
        }
        Ok(())
    }
}

/// The id to send for `topic`: the one the partition is bound to, else the
/// one in the metadata now (which the answer then belongs to).
fn topic_id_to_send(meta: &MetadataCache, topic: &str, bound: Option<TopicId>) -> Option<TopicId> {
    bound.or_else(|| meta.snapshot().topics.get(topic).and_then(|t| t.topic_id))
}

pub(crate) async fn list_offset(
    meta: &MetadataCache,
    config: &ConsumerConfig,
    topic: &str,
    partition: u32,
    seek: Seek,
    topic_id: Option<TopicId>,
) -> Result<(u64, bool, Option<i64>, Option<TopicId>)> {
    let (spec, timestamp_ms) = match seek {
        Seek::Offset(o) => return Ok((o, true, None, topic_id)),
        Seek::Earliest => (pb::OffsetSpec::Earliest, 0),
        Seek::Latest => (pb::OffsetSpec::Latest, 0),
        Seek::Timestamp(t) => (pb::OffsetSpec::Timestamp, t),
    };
    let op = Op::partition("list offsets of", topic, partition);
    let timeout = Duration::from_millis(config.list_offsets_timeout_ms);
    meta.retrying("list offsets", timeout, || async {
        let address = meta.leader_address(topic, partition).await?;
        let id = topic_id_to_send(meta, topic, topic_id);
        let request = pb::ListOffsetsRequest {
            topic: topic.to_owned(),
            partition,
            spec: spec as i32,
            timestamp_ms,
            topic_id: id.map(TopicId::to_wire).unwrap_or_default(),
        };
        let r = meta.call(&op, &address, 0, |mut c| async move { c.list_offsets(request).await }).await;
        let r =
            r.and_then(|r| Error::from_wire(&op, r.error).map(|()| (r.offset, r.found, r.timestamp_ms, id)));
        if let Err(e) = &r {
            meta.note_failure(topic, partition, e);
        }
        r
    })
    .await
}

async fn fetch(
    meta: &MetadataCache,
    config: &ConsumerConfig,
    topic: &str,
    partition: u32,
    offset: u64,
    first_batch_min_timestamp_ms: Option<i64>,
    topic_id: Option<TopicId>,
) -> Result<Outcome> {
    let address = meta.leader_address(topic, partition).await?;
    let op = Op { offset, ..Op::partition("fetch from", topic, partition) };
    let topic_id = topic_id_to_send(meta, topic, topic_id);
    let request = pb::FetchRequest {
        topic: topic.to_owned(),
        partition,
        offset,
        max_bytes: config.fetch_max_bytes,
        max_wait_ms: config.fetch_max_wait_ms,
        topic_id: topic_id.map(TopicId::to_wire).unwrap_or_default(),
    };
    let wait = u64::from(config.fetch_max_wait_ms);
    let r = meta.call(&op, &address, wait, |mut c| async move { c.fetch(request).await }).await?;
    Error::from_wire(&op, r.error)?;
    let (records, next_offset) =
        decode_batches(topic, partition, offset, r.batches, first_batch_min_timestamp_ms)?;
    Ok(Outcome::Fetched {
        topic_id,
        records,
        next_offset,
        high_watermark: r.high_watermark,
        log_start_offset: r.log_start_offset,
    })
}

/// Decodes fetched batches into records at or after `offset`; returns them
/// and the offset after the last one (`offset` itself when there is none).
/// With `first_batch_min_timestamp_ms`, records of the first batch before
/// the first one stamped at or after it are skipped too (when it has one).
///
/// # Errors
/// [`Error::Protocol`] when a batch does not decode, holds a different
/// number of records than it says, or batches go backwards.
pub(crate) fn decode_batches(
    topic: &str,
    partition: u32,
    offset: u64,
    batches: Vec<pb::RecordBatch>,
    first_batch_min_timestamp_ms: Option<i64>,
) -> Result<(Vec<ConsumerRecord>, u64)> {
    let mut records = Vec::new();
    let mut next = offset;
    let mut min_timestamp_ms = first_batch_min_timestamp_ms;
    for b in batches {
        let set = pb::RecordSet::decode(b.records.clone()).map_err(|e| {
            Error::Protocol(format!(
                "{topic}/{partition}: batch at offset {} does not decode: {e}",
                b.base_offset
            ))
        })?;
        // A compacted batch holds fewer records than the offsets it spans,
        // each with its offset delta; else record i is at delta i.
        let deltas = record_deltas(&set.records, b.record_count).ok_or_else(|| {
            Error::Protocol(format!(
                "{topic}/{partition}: batch at offset {} spans {} offsets but holds {} records with \
                 offset deltas out of order or out of range",
                b.base_offset,
                b.record_count,
                set.records.len()
            ))
        })?;
        let Some(batch_end) = b.base_offset.checked_add(u64::from(b.record_count)) else {
            return Err(Error::Protocol(format!(
                "{topic}/{partition}: batch at offset {} overflows the offset space",
                b.base_offset
            )));
        };
        if batch_end <= next && next > offset {
            return Err(Error::Protocol(format!(
                "{topic}/{partition}: batch at offset {} goes back before offset {next}",
                b.base_offset
            )));
        }
        let first_wanted_delta = next.saturating_sub(b.base_offset);
        let first_wanted = deltas.partition_point(|d| u64::from(*d) < first_wanted_delta);
        if batch_end <= next {
            continue;
        }
        // Records compaction removed leave offsets no record holds: the
        // position moves past the whole batch.
        let end_of_batch = batch_end;
        if first_wanted >= set.records.len() {
            next = end_of_batch;
            continue;
        }
        // The first batch with records to return: a timestamp seek starts at
        // its first record stamped at or after the time, if it has one.
        let mut skip = first_wanted;
        if let Some(t) = min_timestamp_ms.take()
            && let Some(j) = set.records[first_wanted..].iter().position(|r| r.timestamp_ms >= t)
        {
            skip += j;
        }
        for (r, d) in set.records.into_iter().zip(deltas).skip(skip) {
            // Below batch_end, which did not overflow.
            let o = b.base_offset + u64::from(d);
            records.push(ConsumerRecord::from_wire(topic, partition, o, r));
        }
        next = end_of_batch;
    }
    Ok((records, next))
}

/// Each record's offset delta in its batch: the one it carries (after
/// records compaction removed), else one past the previous record's (the
/// first: 0); `None` if they are not strictly increasing below
/// `record_count`.
fn record_deltas(records: &[pb::Record], record_count: u32) -> Option<Vec<u32>> {
    let mut out: Vec<u32> = Vec::with_capacity(records.len());
    let mut next = 0u32;
    for r in records {
        let d = r.offset_delta.unwrap_or(next);
        if d >= record_count || out.last().is_some_and(|p| d <= *p) {
            return None;
        }
        out.push(d);
        next = d + 1;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(base: u64, values: &[&str]) -> pb::RecordBatch {
        let set = pb::RecordSet {
            records: values
                .iter()
                .map(|v| pb::Record { value: v.as_bytes().to_vec().into(), ..Default::default() })
                .collect(),
        };
        pb::RecordBatch {
            base_offset: base,
            record_count: values.len() as u32,
            records: set.encode_to_vec().into(),
        }
    }

    #[test]
    fn skips_records_below_the_requested_offset() {
        let (records, next) =
            decode_batches("t", 0, 12, vec![batch(10, &["a", "b", "c"]), batch(13, &["d"])], None)
                .expect("decode");
        let got: Vec<_> = records.iter().map(|r| (r.offset, r.value.clone())).collect();
        assert_eq!(got, vec![(12, "c".into()), (13, "d".into())]);
        assert_eq!(next, 14);
    }

    #[test]
    fn nothing_new_keeps_the_position() {
        assert_eq!(decode_batches("t", 0, 5, vec![], None).expect("decode").1, 5);
        // A batch wholly below the offset (the broker's first batch) is skipped.
        assert_eq!(decode_batches("t", 0, 5, vec![batch(2, &["x", "y"])], None).expect("decode").1, 5);
    }

    fn stamped(base: u64, stamps: &[i64]) -> pb::RecordBatch {
        let set = pb::RecordSet {
            records: stamps.iter().map(|t| pb::Record { timestamp_ms: *t, ..Default::default() }).collect(),
        };
        pb::RecordBatch {
            base_offset: base,
            record_count: stamps.len() as u32,
            records: set.encode_to_vec().into(),
        }
    }

    #[test]
    fn timestamp_seeks_start_at_the_first_late_enough_record_of_the_first_batch() {
        let batches = vec![stamped(10, &[5, 30, 7, 40]), stamped(14, &[1, 50])];
        let (records, next) = decode_batches("t", 0, 10, batches.clone(), Some(30)).expect("decode");
        let offsets: Vec<_> = records.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, vec![11, 12, 13, 14, 15], "later records are kept whatever their time");
        assert_eq!(next, 16);
        // No record of the first batch is late enough: keep them all.
        let (records, _) = decode_batches("t", 0, 10, batches, Some(99)).expect("decode");
        assert_eq!(records.len(), 6);
        // Only records that would be skipped: the position still moves past them.
        let (records, next) =
            decode_batches("t", 0, 0, vec![stamped(0, &[1, 2, 9])], Some(9)).expect("decode");
        assert_eq!((records.len(), next), (1, 3));
    }

    #[test]
    fn rejects_malformed_batches() {
        let mut too_many = batch(0, &["a", "b", "c"]);
        too_many.record_count = 2;
        assert!(matches!(decode_batches("t", 0, 0, vec![too_many], None), Err(Error::Protocol(_))));
        let garbage =
            pb::RecordBatch { base_offset: 0, record_count: 1, records: vec![0xff, 0xff, 0xff].into() };
        let at_the_end = batch(u64::MAX, &["a"]);
        assert!(matches!(decode_batches("t", 0, 0, vec![at_the_end], None), Err(Error::Protocol(_))));
        assert!(matches!(decode_batches("t", 0, 0, vec![garbage], None), Err(Error::Protocol(_))));
        let backwards = vec![batch(0, &["a", "b"]), batch(0, &["a", "b"])];
        assert!(matches!(decode_batches("t", 0, 0, backwards, None), Err(Error::Protocol(_))));
    }

    /// A batch compaction thinned: `base`, spanning `count` offsets,
    /// holding values at the given deltas.
    fn thinned(base: u64, count: u32, kept: &[(u32, &str)]) -> pb::RecordBatch {
        let set = pb::RecordSet {
            records: kept
                .iter()
                .map(|(d, v)| pb::Record {
                    value: v.as_bytes().to_vec().into(),
                    offset_delta: Some(*d),
                    ..Default::default()
                })
                .collect(),
        };
        pb::RecordBatch { base_offset: base, record_count: count, records: set.encode_to_vec().into() }
    }

    #[test]
    fn compacted_batches_keep_their_offsets_and_move_the_position_past_their_gaps() {
        let batches = vec![thinned(10, 5, &[(1, "b"), (3, "d")]), thinned(15, 3, &[]), batch(18, &["s"])];
        let (records, next) = decode_batches("t", 0, 10, batches.clone(), None).expect("decode");
        let got: Vec<_> = records.iter().map(|r| (r.offset, r.value.clone())).collect();
        assert_eq!(got, vec![(11, "b".into()), (13, "d".into()), (18, "s".into())]);
        assert_eq!(next, 19);
        // From inside a gap: the next kept record.
        let (records, _) = decode_batches("t", 0, 12, batches, None).expect("decode");
        assert_eq!(records.first().map(|r| r.offset), Some(13));
        // A batch of only removed records still moves the position on.
        let (records, next) = decode_batches("t", 0, 15, vec![thinned(15, 3, &[])], None).expect("decode");
        assert!(records.is_empty());
        assert_eq!(next, 18);
        // A record without a delta follows the one before it.
        let mut mixed = thinned(20, 6, &[(0, "a"), (3, "d"), (4, "e")]);
        let mut set = pb::RecordSet::decode(mixed.records.clone()).expect("decode");
        set.records[0].offset_delta = None;
        set.records[2].offset_delta = None;
        mixed.records = set.encode_to_vec().into();
        let (records, next) = decode_batches("t", 0, 20, vec![mixed], None).expect("decode");
        assert_eq!(records.iter().map(|r| r.offset).collect::<Vec<_>>(), vec![20, 23, 24]);
        assert_eq!(next, 26);
        // Deltas out of order or past the batch are refused.
        for bad in [thinned(0, 2, &[(1, "a"), (0, "b")]), thinned(0, 2, &[(2, "a")])] {
            assert!(matches!(decode_batches("t", 0, 0, vec![bad], None), Err(Error::Protocol(_))));
        }
    }

    #[tokio::test]
    async fn seek_positions_and_drops_buffered_records() {
        let meta = MetadataCache::new(crate::metadata::ClientConfig::from_list("127.0.0.1:1")).expect("meta");
        let mut c = Consumer::new(meta, ConsumerConfig::default());
        c.assign("t", [0, 1], Seek::Offset(4));
        assert_eq!(c.position("t", 0), Some(4));
        c.ready.push_back(ConsumerRecord {
            topic: "t".into(),
            partition: 1,
            offset: 9,
            key: None,
            value: "v".into(),
            null_value: false,
            timestamp_ms: 0,
            headers: vec![],
        });
        assert_eq!(c.position("t", 1), Some(9), "the next record poll returns");
        c.seek("t", 1, Seek::Latest);
        assert_eq!(c.position("t", 1), None, "unresolved");
        assert!(c.ready.is_empty());
        assert_eq!(c.assignment().len(), 2);
    }
}
