//! The producer's worker: one task that owns every partition queue. It
//! reacts to commands from the handles and to events from the request
//! tasks it spawns, then `drive`s: closes lingering batches, expires old
//! ones, resets partitions with a sequence gap, and sends what the queue
//! rules allow. All decisions about a batch happen here, on one task.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrolog_proto::client as pb;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use super::queue::{Batch, Failure, PartitionQueue, ProducerId, SendSpec, Waiter};
use super::{BufferGauge, Command, ProducerConfig, record_payload_bytes, record_size};
use crate::error::{Error, Op, Result};
use crate::metadata::{BrokerLimits, ClusterMeta, MetadataCache, TopicMeta};
use crate::partitioner::{StickyPartitioner, partition_for_key};
use crate::record::{Record, RecordMetadata};
use ferrolog_proto::TopicId;

/// Commands handled per wake-up before driving the queues, so a burst of
/// sends is batched without starving events.
const COMMANDS_PER_WAKE_MAX: usize = 4096;

/// Events (answers to produce requests, metadata, producer ids) handled
/// per wake-up before driving the queues: a drive looks at every
/// partition's queue, so with many partitions one drive per answer cost
/// more than the answers.
const EVENTS_PER_WAKE_MAX: usize = 4096;

/// Shortest pause between two metadata refreshes asked by the worker.
const REFRESH_INTERVAL_MIN: Duration = Duration::from_millis(50);

/// Pause before asking again for a producer id after a failure.
const PRODUCER_ID_RETRY: Duration = Duration::from_secs(1);

/// Results that request tasks send back to the worker.
enum Event {
    Produced {
        topic: String,
        partition: u32,
        batch_id: u64,
        topic_id: Option<TopicId>,
        /// The broker the request went to.
        address: String,
        result: Result<u64>,
        /// The wait ended at the batch's delivery deadline, before the
        /// request timeout: the batch expires, the broker is not blamed.
        at_deadline: bool,
    },
    ProducerId {
        target: Option<(String, u32)>,
        result: Result<ProducerId>,
    },
    Metadata(Result<Arc<ClusterMeta>>),
    Topic {
        topic: String,
        result: Result<TopicMeta>,
    },
}

/// A record whose topic's partition count is not known yet.
struct Waiting {
    record: Record,
    waiter: Waiter,
    record_id: u64,
}

#[derive(Default)]
struct TopicState {
    /// Partition count; 0 while unknown.
    partitions: u32,
    /// The id of the topic incarnation new batches go to (KIP-516), from
    /// the lookup; forgotten (with the partition count) when a broker
    /// answers `UNKNOWN_TOPIC_ID` for it, so that records sent afterwards
    /// wait for a fresh lookup.
    topic_id: Option<TopicId>,
    waiting: Vec<Waiting>,
    lookup_in_flight: bool,
    /// The topic id was forgotten after `UNKNOWN_TOPIC_ID`: the next
    /// lookup refreshes the metadata first.
    recreated: bool,
    queues: BTreeMap<u32, PartitionQueue>,
}

/// Records not yet resolved, the memory they hold, and flush waiters.
///
/// A flush waits for every record sent before it. Each record is resolved
/// exactly once (its waiter is consumed), so a flush needs only a count:
/// the records unresolved when it was asked, counted down as records below
/// its mark resolve. That is O(flushes) per record and no memory per
/// record; a `BTreeSet` of unresolved ids cost a tree insert and removal
/// per record (4% of a pipelined producer's CPU, measured 2026-12-02).
struct Ledger {
    /// Records sent and not yet resolved.
    unresolved: usize,
    buffer: Arc<BufferGauge>,
    flushes: Vec<FlushWait>,
}

/// A flush waiting for the records sent before it.
struct FlushWait {
    /// Records with ids below this were sent before the flush.
    upto: u64,
    /// How many of them are still unresolved.
    left: usize,
    done: oneshot::Sender<()>,
}

impl Ledger {
    /// Counts a record sent (ids are handed out in increasing order).
    fn sent(&mut self) {
        self.unresolved += 1;
    }

    /// Adds a flush of everything sent before `upto` (the next record id):
    /// every unresolved record is below it.
    fn flush(&mut self, upto: u64, done: oneshot::Sender<()>) {
        if self.unresolved == 0 {
            let _ = done.send(());
        } else {
            self.flushes.push(FlushWait { upto, left: self.unresolved, done });
        }
    }

    fn resolve_batch(&mut self, partition: u32, batch: Batch, result: Result<u64>) {
        for id in &batch.record_ids {
            self.resolved(*id);
        }
        self.buffer.release(batch.bytes);
        batch.complete(partition, result);
    }

    fn resolve_one(&mut self, record_id: u64, bytes: usize, waiter: Waiter, result: Result<RecordMetadata>) {
        self.resolved(record_id);
        self.buffer.release(bytes);
        let _ = waiter.send(result);
    }

    /// Counts record `id` resolved, and tells the flushes it completes.
    fn resolved(&mut self, id: u64) {
        debug_assert!(self.unresolved > 0, "record {id} resolved twice");
        self.unresolved = self.unresolved.saturating_sub(1);
        if self.flushes.is_empty() {
            return;
        }
        for f in self.flushes.iter_mut().filter(|f| id < f.upto) {
            f.left = f.left.saturating_sub(1);
        }
        let (done, waiting): (Vec<_>, Vec<_>) = self.flushes.drain(..).partition(|f| f.left == 0);
        self.flushes = waiting;
        for f in done {
            let _ = f.done.send(());
        }
    }
}

struct Worker {
    meta: Arc<MetadataCache>,
    config: ProducerConfig,
    /// The brokers' size limits, from the latest metadata.
    limits: BrokerLimits,
    commands: mpsc::UnboundedReceiver<Command>,
    commands_open: bool,
    events_tx: mpsc::UnboundedSender<Event>,
    events: mpsc::UnboundedReceiver<Event>,
    topics: HashMap<String, TopicState>,
    sticky: StickyPartitioner,
    ledger: Ledger,
    next_record_id: u64,
    next_batch_id: u64,
    /// Close every open batch at the next drive (a flush was asked).
    close_all: bool,
    /// The producer-wide id from the first `InitProducerId`.
    shared_producer: Option<ProducerId>,
    /// `InitProducerId` requests outstanding: `None` is the shared one.
    producer_id_requests: HashSet<Option<(String, u32)>>,
    producer_id_retry_at: Option<Instant>,
    last_producer_id_error: Option<Error>,
    refresh_wanted: bool,
    refresh_in_flight: bool,
    refresh_failures: u32,
    refresh_not_before: Option<Instant>,
}

/// Starts the worker task.
pub(super) fn spawn(
    meta: Arc<MetadataCache>,
    config: ProducerConfig,
    commands: mpsc::UnboundedReceiver<Command>,
    buffer: Arc<BufferGauge>,
) {
    let (events_tx, events) = mpsc::unbounded_channel();
    let worker = Worker {
        limits: meta.snapshot().limits,
        meta,
        config,
        commands,
        commands_open: true,
        events_tx,
        events,
        topics: HashMap::new(),
        sticky: StickyPartitioner::default(),
        ledger: Ledger { unresolved: 0, buffer, flushes: Vec::new() },
        next_record_id: 0,
        next_batch_id: 0,
        close_all: false,
        shared_producer: None,
        producer_id_requests: HashSet::new(),
        producer_id_retry_at: None,
        last_producer_id_error: None,
        refresh_wanted: false,
        refresh_in_flight: false,
        refresh_failures: 0,
        refresh_not_before: None,
    };
    tokio::spawn(worker.run().instrument(tracing::info_span!("producer")));
}

/// A request too big for a gRPC message limit (this client's
/// `max_message_bytes`, or the broker's, about four times its
/// `limits.max_batch_bytes`) is refused by the transport before the broker
/// can answer `RECORD_TOO_LARGE`; report it as that, with the transport's
/// message (which names its limit and the size). The producer's own check
/// against the broker's `max_record_bytes` usually answers first.
fn oversized_request(topic: &str, partition: u32, bytes: usize, e: Error) -> Error {
    match e {
        Error::Transport {
            code: tonic::Code::OutOfRange | tonic::Code::ResourceExhausted, message, ..
        } if message.contains("too large") => {
            Error::RecordTooLarge { topic: topic.to_owned(), partition, bytes, message }
        }
        other => other,
    }
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl Worker {
    async fn run(mut self) {
        if self.config.idempotent {
            self.request_producer_id(None);
        }
        loop {
            let wake = self.drive(Instant::now());
            if !self.commands_open && self.ledger.unresolved == 0 {
                tracing::debug!("every handle dropped and every record resolved: stopping");
                return;
            }
            let sleep = async {
                match wake {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                command = self.commands.recv(), if self.commands_open => match command {
                    Some(c) => {
                        self.command(c);
                        for _ in 1..COMMANDS_PER_WAKE_MAX {
                            match self.commands.try_recv() {
                                Ok(c) => self.command(c),
                                Err(_) => break,
                            }
                        }
                    }
                    None => self.commands_open = false,
                },
                Some(event) = self.events.recv() => {
                    self.event(event);
                    for _ in 1..EVENTS_PER_WAKE_MAX {
                        match self.events.try_recv() {
                            Ok(e) => self.event(e),
                            Err(_) => break,
                        }
                    }
                }
                () = sleep => {}
            }
        }
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Send { topic, record, waiter } => {
                let record_id = self.next_record_id;
                self.next_record_id += 1;
                self.ledger.sent();
                // Looked up before inserting, so a known topic's name is
                // not copied for every record.
                let state = match self.topics.get_mut(&*topic) {
                    Some(state) => state,
                    None => self.topics.entry(topic.to_string()).or_default(),
                };
                if state.partitions == 0 {
                    state.waiting.push(Waiting { record, waiter, record_id });
                    if !state.lookup_in_flight {
                        state.lookup_in_flight = true;
                        // After UNKNOWN_TOPIC_ID the cached metadata still
                        // names the old incarnation: refresh it first.
                        let fresh = state.recreated;
                        state.recreated = false;
                        self.lookup_topic(topic.to_string(), fresh);
                    }
                } else {
                    self.place(&topic, record, waiter, record_id);
                }
            }
            Command::Flush(done) => {
                let upto = self.next_record_id;
                self.ledger.flush(upto, done);
                self.close_all = true;
            }
        }
    }

    /// Puts a record into its partition's queue (the topic's partition
    /// count is known).
    fn place(&mut self, topic: &str, record: Record, waiter: Waiter, record_id: u64) {
        let Some(state) = self.topics.get_mut(topic) else { return };
        let partitions = state.partitions;
        let topic_id = state.topic_id;
        let bytes = record_size(&record);
        let partition = match (record.partition, &record.key) {
            (Some(p), _) if p >= partitions => {
                let e = Error::UnknownPartition { topic: topic.to_owned(), partition: p, partitions };
                self.ledger.resolve_one(record_id, bytes, waiter, Err(e));
                return;
            }
            (Some(p), _) => p,
            (None, Some(key)) => partition_for_key(key, partitions),
            (None, None) => self.sticky.partition(topic, partitions),
        };
        if let Some(max) = self.limits.max_record_bytes {
            let size = record_payload_bytes(&record);
            if size > max {
                let e = Error::RecordTooLarge {
                    topic: topic.to_owned(),
                    partition,
                    bytes: size,
                    message: format!(
                        "the record is {size} bytes (key + value + headers); the limit, \
                         limits.max_record_bytes, is {max} bytes"
                    ),
                };
                self.ledger.resolve_one(record_id, bytes, waiter, Err(e));
                return;
            }
        }
        // Batches close at the broker's limit when it is lower (encoded
        // bytes, which are never fewer than the key + value + headers it counts).
        let batch_bytes_max = self
            .limits
            .max_batch_bytes
            .map_or(self.config.batch_bytes_max, |b| b.min(self.config.batch_bytes_max));
        let queue = state
            .queues
            .entry(partition)
            .or_insert_with(|| PartitionQueue::new(self.shared_producer, self.config.idempotent));
        let next_batch_id = &mut self.next_batch_id;
        let closed = queue.add(
            record.into_wire(),
            bytes,
            record_id,
            waiter,
            || {
                *next_batch_id += 1;
                // The clock is read when a batch opens, not per record.
                let mut batch = Batch::new(*next_batch_id, Instant::now());
                batch.topic_id = topic_id;
                batch
            },
            batch_bytes_max,
        );
        if closed {
            self.sticky.batch_closed(topic, partition, partitions);
        }
    }

    fn event(&mut self, event: Event) {
        let now = Instant::now();
        match event {
            Event::Produced { topic, partition, batch_id, topic_id, address, result, at_deadline } => {
                if let Err(Error::TopicRecreated { .. }) = &result {
                    self.topic_recreated(&topic, topic_id);
                }
                let Some(queue) = self.topics.get_mut(&topic).and_then(|t| t.queues.get_mut(&partition))
                else {
                    return;
                };
                match result {
                    // The batch's own delivery timeout ended the wait, not a
                    // failure of the broker: no metadata refresh, no
                    // back-off for the partition's other batches. It
                    // expires at the next drive, as of unknown outcome.
                    Err(e @ Error::Timeout { .. }) if at_deadline => {
                        tracing::debug!(%topic, partition, batch_id, "delivery timeout reached in flight");
                        queue.on_deadline(batch_id, e);
                    }
                    Ok(base_offset) => {
                        tracing::trace!(%topic, partition, batch_id, base_offset, "produced");
                        if let Some(batch) = queue.on_success(batch_id) {
                            self.ledger.resolve_batch(partition, batch, Ok(base_offset));
                        }
                    }
                    Err(e) => {
                        self.meta.note_failure(&topic, partition, &e);
                        if e.needs_metadata_refresh() && e.leader_hint().is_none() {
                            self.refresh_wanted = true;
                        }
                        tracing::debug!(%topic, partition, batch_id, error = %e, "produce failed");
                        // The leader is gone (connection refused or reset)
                        // or says it no longer leads, naming nobody: not a
                        // timeout or UNAVAILABLE from a leader that is
                        // only slow, where refreshing fast adds load.
                        let leader_gone = e.leader_hint().is_none()
                            && (matches!(e, Error::Transport { .. })
                                || e.code() == Some(crate::error::ErrorCode::NotLeader));
                        let backoff = self.meta.config().backoff;
                        match queue.on_error(batch_id, e, now, &backoff) {
                            Failure::Failed(batch, e) => self.ledger.resolve_batch(partition, batch, Err(e)),
                            // The leader it went to is gone or no longer
                            // leads: the backoff ends early once the
                            // metadata names another (see `drive`).
                            Failure::Retrying => queue.failed_leader = leader_gone.then_some(address),
                            Failure::Unknown => {}
                        }
                    }
                }
            }
            Event::ProducerId { target, result } => {
                self.producer_id_requests.remove(&target);
                match result {
                    Ok(id) => match target {
                        None => self.shared_producer = Some(id),
                        Some((topic, partition)) => {
                            if let Some(q) =
                                self.topics.get_mut(&topic).and_then(|t| t.queues.get_mut(&partition))
                            {
                                q.producer = Some(id);
                            }
                        }
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, "could not get a producer id; retrying");
                        self.producer_id_retry_at = Some(now + PRODUCER_ID_RETRY);
                        self.last_producer_id_error = Some(e);
                    }
                }
            }
            Event::Metadata(result) => {
                self.refresh_in_flight = false;
                match result {
                    Ok(cluster) => {
                        self.limits = cluster.limits;
                        self.refresh_failures = 0;
                        self.refresh_not_before = Some(now + REFRESH_INTERVAL_MIN);
                        for (name, state) in &mut self.topics {
                            if let Some(t) = cluster.topics.get(name)
                                && state.partitions != 0
                                && t.partition_count() > 0
                            {
                                state.partitions = t.partition_count();
                            }
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "metadata refresh failed");
                        self.refresh_not_before =
                            Some(now + self.config_backoff().delay(self.refresh_failures));
                        self.refresh_failures = self.refresh_failures.saturating_add(1);
                        self.refresh_wanted = true;
                    }
                }
            }
            Event::Topic { topic, result } => {
                let Some(state) = self.topics.get_mut(&topic) else { return };
                state.lookup_in_flight = false;
                let waiting = std::mem::take(&mut state.waiting);
                match result {
                    Ok(t) if t.partition_count() > 0 => {
                        state.partitions = t.partition_count();
                        state.topic_id = t.topic_id;
                        self.limits = self.meta.snapshot().limits;
                        for w in waiting {
                            self.place(&topic, w.record, w.waiter, w.record_id);
                        }
                    }
                    other => {
                        let e = match other {
                            Err(e) => e,
                            Ok(_) => Error::UnknownTopic { topic: topic.clone() },
                        };
                        for w in waiting {
                            let bytes = record_size(&w.record);
                            self.ledger.resolve_one(w.record_id, bytes, w.waiter, Err(e.clone()));
                        }
                    }
                }
            }
        }
    }

    /// A broker answered `UNKNOWN_TOPIC_ID` for a batch sent to incarnation
    /// `topic_id` of `topic`: if new batches still go there, forget it and
    /// close the open batches, so that records sent from now on wait for a
    /// fresh lookup and go to the topic now bearing the name. Batches
    /// already made keep their id and fail the same way (KIP-516: records
    /// are never moved to another incarnation).
    fn topic_recreated(&mut self, topic: &str, topic_id: Option<TopicId>) {
        let Some(state) = self.topics.get_mut(topic) else { return };
        if state.topic_id != topic_id || state.partitions == 0 {
            return;
        }
        tracing::warn!(%topic, "topic was deleted or re-created: failing the records sent to the old one");
        state.topic_id = None;
        state.partitions = 0;
        state.recreated = true;
        for q in state.queues.values_mut() {
            if q.open.is_some() {
                q.close_open();
            }
        }
    }

    fn config_backoff(&self) -> crate::retry::Backoff {
        self.meta.config().backoff
    }

    /// Applies the queue rules to every partition at `now`; returns when
    /// to drive again if nothing else happens first.
    fn drive(&mut self, now: Instant) -> Option<Instant> {
        let cluster = self.meta.snapshot();
        let linger = Duration::from_millis(self.config.linger_ms);
        let timeout = Duration::from_millis(self.config.delivery_timeout_ms);
        let close_all = self.close_all || !self.commands_open;
        self.close_all = false;
        let mut wake = None;
        let mut sends: Vec<(String, u32, String, SendSpec)> = Vec::new();
        let mut expired: Vec<(u32, Batch, Error)> = Vec::new();
        let mut want_ids: Vec<(String, u32)> = Vec::new();
        for (topic, state) in &mut self.topics {
            for (&partition, q) in &mut state.queues {
                // Like Kafka's accumulator, the open batch keeps growing past
                // its linger while an earlier batch waits to be sent: under
                // backpressure batches fill up instead of piling up small.
                let could_send = q.in_flight < self.config.max_in_flight_per_partition && !q.has_unsent();
                if q.open.is_some() && (close_all || (could_send && q.linger_expired(now, linger))) {
                    q.close_open();
                    self.sticky.batch_closed(topic, partition, state.partitions);
                }
                if could_send {
                    wake = earliest(wake, q.open.as_ref().map(|b| b.created + linger));
                }
                for b in q.expire(now, timeout) {
                    tracing::trace!(%topic, partition, batch_id = b.id, "expired");
                    let e = Error::DeliveryTimeout {
                        topic: topic.clone(),
                        partition,
                        timeout_ms: self.config.delivery_timeout_ms,
                        last: b.last_error.clone().map(Box::new),
                    };
                    expired.push((partition, b, e));
                }
                if q.reset_if_drained() {
                    tracing::info!(%topic, partition, "sequence gap after a failed batch: new producer id");
                }
                if q.producer.is_none() {
                    if q.wants_own_producer_id {
                        want_ids.push((topic.clone(), partition));
                    } else {
                        q.producer = self.shared_producer;
                    }
                    if let Some(e) = &self.last_producer_id_error {
                        for b in q.batches.iter_mut().filter(|b| b.last_error.is_none()) {
                            b.last_error = Some(e.clone());
                        }
                    }
                }
                // After its leader failed, a partition backs off, but
                // not past the moment the metadata names a new leader:
                // while it names none or the failed one, it is refreshed
                // every REFRESH_INTERVAL_MIN (a failover is over as soon
                // as an election is, not at the next backoff step).
                if let Some(failed) = &q.failed_leader
                    && q.retry_at.is_some_and(|t| now < t)
                {
                    match cluster.leader(topic, partition) {
                        Some((_, address)) if address != *failed => {
                            q.retry_at = None;
                            q.failed_leader = None;
                        }
                        _ => self.refresh_wanted = true,
                    }
                }
                let has_unsent = q.has_unsent();
                if has_unsent && q.producer.is_some() {
                    match cluster.leader(topic, partition) {
                        Some((_, address)) => {
                            while let Some(spec) = q.next_send(now, self.config.max_in_flight_per_partition) {
                                sends.push((topic.clone(), partition, address.clone(), spec));
                            }
                        }
                        None => self.refresh_wanted = true,
                    }
                }
                wake = earliest(wake, q.retry_at.filter(|t| *t > now));
                wake = earliest(wake, q.next_expiry(timeout));
            }
        }
        for (partition, batch, e) in expired {
            self.ledger.resolve_batch(partition, batch, Err(e));
        }
        for (topic, partition, address, spec) in sends {
            self.send(topic, partition, address, spec);
        }
        let ids_allowed = self.producer_id_retry_at.is_none_or(|t| now >= t);
        if ids_allowed {
            for target in want_ids {
                self.request_producer_id(Some(target));
            }
            if self.config.idempotent && self.shared_producer.is_none() {
                self.request_producer_id(None);
            }
        } else {
            wake = earliest(wake, self.producer_id_retry_at);
        }
        if self.refresh_wanted && !self.refresh_in_flight {
            match self.refresh_not_before {
                Some(t) if t > now => wake = earliest(wake, Some(t)),
                _ => {
                    self.refresh_wanted = false;
                    self.refresh_in_flight = true;
                    let (meta, events) = (self.meta.clone(), self.events_tx.clone());
                    tokio::spawn(async move {
                        let _ = events.send(Event::Metadata(meta.refresh().await));
                    });
                }
            }
        }
        wake
    }

    fn send(&self, topic: String, partition: u32, address: String, spec: SendSpec) {
        tracing::trace!(%topic, partition, batch_id = spec.batch_id, producer_id = spec.producer.id, base_sequence = spec.base_sequence, records = spec.records.len(), "produce");
        let (meta, events) = (self.meta.clone(), self.events_tx.clone());
        // A request waits for its answer no longer than its batch may live
        // (Kafka expires in-flight batches at `delivery.timeout.ms` too,
        // KIP-91): past that the batch fails as of unknown outcome, rather
        // than a full `request_timeout_ms` after a broker stopped answering.
        let deadline = spec.created + Duration::from_millis(self.config.delivery_timeout_ms);
        // Rounded up: a wait cut at the deadline ends at or after it, so the
        // batch has expired by the time its answer is handled.
        let left_ms = deadline.saturating_duration_since(Instant::now()).as_micros().div_ceil(1000);
        let timeout_ms =
            u64::try_from(left_ms).unwrap_or(u64::MAX).clamp(1, meta.config().request_timeout_ms);
        let task = async move {
            let op = Op { bytes: spec.bytes, ..Op::partition("produce to", &topic, partition) };
            let request = pb::ProduceRequest {
                topic: topic.clone(),
                partition,
                records: spec.records,
                producer_id: spec.producer.id,
                producer_epoch: spec.producer.epoch,
                base_sequence: spec.base_sequence,
                topic_id: spec.topic_id.map(TopicId::to_wire).unwrap_or_default(),
            };
            let result = meta
                .call_within(&op, &address, timeout_ms, |mut c| async move { c.produce(request).await })
                .await
                .map_err(|e| oversized_request(&topic, partition, spec.bytes, e))
                .and_then(|r| Error::from_wire(&op, r.error).map(|()| r.base_offset));
            let at_deadline = timeout_ms < meta.config().request_timeout_ms;
            let _ = events.send(Event::Produced {
                at_deadline,
                topic,
                partition,
                batch_id: spec.batch_id,
                topic_id: spec.topic_id,
                address,
                result,
            });
        };
        tokio::spawn(task.in_current_span());
    }

    /// Looks `topic` up in the metadata (refreshed first when `fresh`).
    fn lookup_topic(&self, topic: String, fresh: bool) {
        let (meta, events) = (self.meta.clone(), self.events_tx.clone());
        let wait = Duration::from_millis(self.config.topic_wait_ms);
        tokio::spawn(async move {
            if fresh && let Err(e) = meta.refresh().await {
                tracing::debug!(error = %e, "metadata refresh failed");
            }
            let result = meta.topic(&topic, wait).await;
            let _ = events.send(Event::Topic { topic, result });
        });
    }

    /// Asks for a producer id: the shared one (`None`) or one for a
    /// partition after a reset. One request per target at a time.
    fn request_producer_id(&mut self, target: Option<(String, u32)>) {
        if !self.producer_id_requests.insert(target.clone()) {
            return;
        }
        let (meta, events) = (self.meta.clone(), self.events_tx.clone());
        let timeout = Duration::from_millis(self.config.delivery_timeout_ms);
        let task = async move {
            let op = Op::new("init producer id", "");
            let result = meta
                .retrying("init producer id", timeout, || async {
                    let address = meta.current().await?.answered_by.clone();
                    let request = pb::InitProducerIdRequest {};
                    let r = meta
                        .call(&op, &address, 0, |mut c| async move { c.init_producer_id(request).await })
                        .await?;
                    Error::from_wire(&op, r.error)?;
                    if r.producer_id < 0 {
                        return Err(Error::Protocol(format!("InitProducerId answered id {}", r.producer_id)));
                    }
                    Ok(ProducerId { id: r.producer_id, epoch: r.producer_epoch })
                })
                .await;
            let _ = events.send(Event::ProducerId { target, result });
        };
        tokio::spawn(task.in_current_span());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_requests_are_record_too_large() {
        let op = Op::partition("produce to", "t", 1);
        let refused =
            Error::transport(&op, "a:1", tonic::Status::out_of_range("decoded message length too large"));
        assert!(matches!(oversized_request("t", 1, 9, refused), Error::RecordTooLarge { bytes: 9, .. }));
        let other = Error::transport(&op, "a:1", tonic::Status::unavailable("down"));
        assert!(matches!(oversized_request("t", 1, 9, other), Error::Transport { .. }));
    }

    #[test]
    fn a_flush_waits_for_the_records_sent_before_it_and_no_others() {
        let buffer = Arc::new(BufferGauge {
            bytes: std::sync::atomic::AtomicUsize::new(0),
            max: 1 << 20,
            freed: tokio::sync::Notify::new(),
        });
        let mut ledger = Ledger { unresolved: 0, buffer, flushes: Vec::new() };
        // Nothing unresolved: done at once.
        let (tx, mut idle) = oneshot::channel();
        ledger.flush(0, tx);
        assert!(idle.try_recv().is_ok());
        // Records 0..3 sent, a flush, then records 3..5.
        for _ in 0..3 {
            ledger.sent();
        }
        let (tx, mut first) = oneshot::channel();
        ledger.flush(3, tx);
        for _ in 3..5 {
            ledger.sent();
        }
        let (tx, mut second) = oneshot::channel();
        ledger.flush(5, tx);
        // Records after the first flush do not hold it; out of order.
        for id in [4, 1, 3, 0] {
            ledger.resolved(id);
            assert!(first.try_recv().is_err(), "first flush done before record 2");
        }
        ledger.resolved(2);
        assert!(first.try_recv().is_ok(), "first flush done once 0..3 resolved");
        assert!(second.try_recv().is_ok(), "second flush done: all five resolved");
        assert_eq!(ledger.unresolved, 0);
        assert!(ledger.flushes.is_empty());
    }
}
