//! The queue workload of Jepsen's Kafka test, through `ferrolog-client`.
//!
//! - Producer processes send 1..=`msgs_per_send_max` unique values per
//!   operation to keys drawn from a window of `keys_active` partitions that
//!   rotates every `key_rotate_ms` over all `partitions`; the producer is
//!   idempotent. An operation is `ok` when every value is acknowledged,
//!   `fail` when every value was definitely refused, else `info`; after a
//!   non-ok operation the process continues as a new process with a new
//!   producer (a new producer id).
//! - Consumer processes assign a random set of partitions, seek to the
//!   earliest or latest offset, and poll; every so often they reassign.
//! - The final read: one consumer per partition reads from the start until
//!   it reaches the high watermark seen when it started.
//!
//! The `group` workload (`group` set): consumers are members of one
//! consumer group ([`group_consumer`]) that commit the position after each
//! poll (commit after processing), and every so often leave and join again
//! as new members; the checker's group checks hold them to at least once.
//!
//! The `compact` workload (`record_keys > 0`) writes to a compacted topic
//! (`cleanup.policy=compact`): each value goes to one of `record_keys`
//! record keys of its partition, and a fraction `tombstone_ratio` of the
//! records are tombstones (null values) that delete their key. Every record
//! carries its unique integer in an `id` header, so tombstones too can be
//! traced to their send.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use ferrolog_client::{
    Consumer, ConsumerConfig, ConsumerRecord, Error, MetadataCache, Producer, ProducerConfig, Record, Seek,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

use crate::history::{Key, Msg, Op, OpType, Outcome, Recorder};

/// Workload settings.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    /// The topic.
    pub topic: String,
    /// Its partitions: all the keys.
    pub partitions: u32,
    /// Keys written at any one time.
    pub keys_active: u32,
    /// How often the active window moves by one key, ms.
    pub key_rotate_ms: u64,
    /// Producer processes.
    pub producers: u32,
    /// Consumer processes.
    pub consumers: u32,
    /// Send operations per second, over all producers.
    pub rate: f64,
    /// Most values per send operation.
    pub msgs_per_send_max: u32,
    /// A send operation's values are given up on after this long, ms.
    pub send_timeout_ms: u64,
    /// Seed of the random choices.
    pub seed: u64,
    /// Record keys per partition: 0 for the queue workload (records keyed
    /// by their partition), more for the `compact` workload.
    pub record_keys: u32,
    /// In the `compact` workload, the fraction of records that are
    /// tombstones.
    pub tombstone_ratio: f64,
    /// The `group` workload: consumers are members of this consumer group
    /// (with these assignors), committing after each poll.
    pub group: Option<(String, Vec<ferrolog_client::assignor::Assignor>)>,
}

impl WorkloadConfig {
    /// Whether this is the `compact` workload, on a compacted topic.
    pub fn compacted(&self) -> bool {
        self.record_keys > 0
    }

    /// The workload's name: `queue`, `compact` or `group`.
    pub fn name(&self) -> &'static str {
        if self.compacted() {
            "compact"
        } else if self.group.is_some() {
            "group"
        } else {
            "queue"
        }
    }
}

/// The header that carries a record's unique integer.
pub const ID_HEADER: &str = "id";

/// `delete.retention.ms` of the `compact` workload's topic: tombstones go
/// within a run, and a consumer that reads a partition from the start in
/// less than this sees its final state (Kafka's rule for tombstones; the
/// run checks its final read keeps to it).
pub const COMPACT_DELETE_RETENTION_MS: u64 = 10_000;

/// The brokers' extra configuration for the `compact` workload: a
/// compaction check every second (the default is 15 s).
pub const COMPACT_BROKER_CONFIG: &str = "[compaction]\ncheck_interval_ms = 1000\n";

/// The `compact` workload's topic configuration: compacted, small segments
/// rolled every 2 s, compacted as soon as anything is dirty.
pub fn compact_topic_config() -> std::collections::BTreeMap<String, String> {
    [
        ("cleanup.policy", "compact".to_owned()),
        ("segment.bytes", "4096".to_owned()),
        ("segment.ms", "2000".to_owned()),
        ("min.compaction.lag.ms", "0".to_owned()),
        ("min.cleanable.dirty.ratio", "0.01".to_owned()),
        ("delete.retention.ms", COMPACT_DELETE_RETENTION_MS.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// Shared counters of a workload.
#[derive(Debug, Default)]
pub struct Ids {
    next_value: AtomicU64,
    next_process: AtomicU32,
}

impl Ids {
    /// A new process id.
    pub fn process(&self) -> u32 {
        self.next_process.fetch_add(1, Ordering::Relaxed)
    }

    fn value(&self) -> u64 {
        self.next_value.fetch_add(1, Ordering::Relaxed)
    }
}

/// The keys written at `elapsed`.
pub fn active_keys(cfg: &WorkloadConfig, elapsed: Duration) -> Vec<Key> {
    let window = (elapsed.as_millis() / u128::from(cfg.key_rotate_ms.max(1))) as u32;
    (0..cfg.keys_active.min(cfg.partitions)).map(|i| (window + i) % cfg.partitions).collect()
}

/// Whether a send error means the value was definitely not stored.
fn definitely_failed(e: &Error) -> bool {
    matches!(
        e,
        Error::RecordTooLarge { .. }
            | Error::UnknownTopic { .. }
            | Error::UnknownPartition { .. }
            | Error::Config(_)
    )
}

fn producer_config(cfg: &WorkloadConfig) -> ProducerConfig {
    ProducerConfig { delivery_timeout_ms: cfg.send_timeout_ms, linger_ms: 2, ..ProducerConfig::default() }
}

/// One producer slot: runs send operations until `stop` turns true.
pub async fn producer(
    cfg: Arc<WorkloadConfig>,
    meta: Arc<MetadataCache>,
    rec: Recorder,
    ids: Arc<Ids>,
    slot: u32,
    mut stop: watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(cfg.seed ^ (u64::from(slot) << 32) ^ 0x5e4d);
    let period = Duration::from_secs_f64(f64::from(cfg.producers) / cfg.rate.max(0.001));
    let mut process = ids.process();
    let Ok(mut producer) = Producer::new(meta.clone(), producer_config(&cfg)) else { return };
    let mut next = Instant::now() + period.mul_f64(rng.gen_range(0.0..1.0));
    while !*stop.borrow() {
        tokio::select! {
            _ = tokio::time::sleep_until(next.into()) => {}
            _ = stop.changed() => break,
        }
        next += period.mul_f64(rng.gen_range(0.5..1.5));
        let keys = active_keys(&cfg, rec.start().elapsed());
        let n = rng.gen_range(1..=cfg.msgs_per_send_max.max(1));
        let mut msgs: Vec<Msg> = (0..n)
            .map(|_| {
                let m = Msg::unacked(keys[rng.gen_range(0..keys.len())], ids.value());
                if cfg.compacted() {
                    m.keyed(
                        rng.gen_range(0..cfg.record_keys),
                        rng.gen_bool(cfg.tombstone_ratio.clamp(0.0, 1.0)),
                    )
                } else {
                    m
                }
            })
            .collect();
        let inv = rec.invoke(process);
        let deliveries: Vec<_> = msgs.iter().map(|m| producer.send(&cfg.topic, record_of(m))).collect();
        let (mut acked, mut failed, mut error) = (0, 0, None);
        let limit = Duration::from_millis(cfg.send_timeout_ms + 5_000);
        for (m, d) in msgs.iter_mut().zip(deliveries) {
            match tokio::time::timeout(limit, d).await {
                Ok(Ok(md)) if md.partition == m.key => {
                    m.offset = Some(md.offset);
                    acked += 1;
                }
                Ok(Ok(md)) => {
                    error = Some(format!("value {} acknowledged in partition {}", m.value, md.partition))
                }
                Ok(Err(e)) => {
                    if definitely_failed(&e) {
                        failed += 1;
                    }
                    error = Some(e.to_string());
                }
                Err(_) => error = Some(format!("no answer within {limit:?}")),
            }
        }
        let outcome = if acked == msgs.len() {
            Outcome::Ok
        } else if failed == msgs.len() {
            Outcome::Fail
        } else {
            Outcome::Info
        };
        rec.complete(inv, OpType::Send, outcome, msgs, error);
        if outcome != Outcome::Ok {
            process = ids.process();
            match Producer::new(meta.clone(), producer_config(&cfg)) {
                Ok(p) => producer = p,
                Err(_) => return,
            }
        }
    }
    producer.close().await;
}

/// The record that carries `m`: keyed by its partition in the queue
/// workload, by its record key in the `compact` one.
fn record_of(m: &Msg) -> Record {
    let id = m.value.to_string();
    let r = match m.record_key {
        None => Record::new(id).with_key(m.key.to_string()),
        Some(k) if m.tombstone => Record::tombstone(k.to_string()).with_header(ID_HEADER, id),
        Some(k) => Record::new(id.clone()).with_key(k.to_string()).with_header(ID_HEADER, id),
    };
    r.with_partition(m.key)
}

/// Parses a decimal number; `u64::MAX` for anything else (which the
/// checker reports as a value no operation sent).
fn number(bytes: &[u8]) -> u64 {
    std::str::from_utf8(bytes).ok().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX)
}

fn to_msgs(cfg: &WorkloadConfig, records: &[ConsumerRecord]) -> Vec<Msg> {
    records
        .iter()
        .map(|r| {
            let id = r.headers.iter().find(|h| h.key == ID_HEADER).map(|h| &h.value).unwrap_or(&r.value);
            let m = Msg::at(r.partition, number(id), r.offset);
            if cfg.compacted() {
                let key = r.key.as_deref().map_or(u64::MAX, number);
                m.keyed(u32::try_from(key).unwrap_or(u32::MAX), r.null_value)
            } else {
                m
            }
        })
        .collect()
}

fn consumer_config() -> ConsumerConfig {
    ConsumerConfig { fetch_max_wait_ms: 200, list_offsets_timeout_ms: 5_000, ..ConsumerConfig::default() }
}

/// One consumer process: assign, seek, poll until `stop` turns true.
pub async fn consumer(
    cfg: Arc<WorkloadConfig>,
    meta: Arc<MetadataCache>,
    rec: Recorder,
    ids: Arc<Ids>,
    slot: u32,
    stop: watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(cfg.seed ^ (u64::from(slot) << 32) ^ 0xc045);
    let process = ids.process();
    let mut consumer = Consumer::new(meta.clone(), consumer_config());
    let mut polls_left = 0u32;
    let mut reset = false;
    while !*stop.borrow() {
        if polls_left == 0 {
            let n = rng.gen_range(1..=cfg.partitions);
            let mut parts = BTreeSet::new();
            while parts.len() < n as usize {
                parts.insert(rng.gen_range(0..cfg.partitions));
            }
            let seek = if rng.gen_bool(0.8) { Seek::Earliest } else { Seek::Latest };
            consumer = Consumer::new(meta.clone(), consumer_config());
            consumer.assign(&cfg.topic, parts, seek);
            polls_left = rng.gen_range(10..60);
            reset = true;
        }
        polls_left -= 1;
        let inv = rec.invoke(process);
        let result = consumer.poll(Duration::from_millis(500)).await;
        let (outcome, msgs, error) = match result {
            Ok(records) => (Outcome::Ok, to_msgs(&cfg, &records), None),
            Err(e) => {
                polls_left = 0; // re-seek the paused partition
                (Outcome::Fail, Vec::new(), Some(e.to_string()))
            }
        };
        rec.push(Op {
            index: 0,
            process: inv.process,
            op_type: OpType::Poll,
            outcome,
            invoke_ns: inv.invoke_ns,
            complete_ns: rec.now_ns(),
            msgs,
            reset: std::mem::take(&mut reset),
            final_read: false,
            group: false,
            error,
        });
    }
}

/// Reads `partition` from its start to the high watermark seen at the start
/// (retrying for up to `timeout`), recording every poll as a final-read
/// operation. Returns the end offset reached and how long the last pass
/// took, from its seek to the start to its end.
///
/// # Errors
/// If the end is not reached within `timeout`.
pub async fn final_read(
    cfg: &WorkloadConfig,
    meta: Arc<MetadataCache>,
    rec: &Recorder,
    ids: &Ids,
    partition: u32,
    timeout: Duration,
) -> anyhow::Result<(u64, Duration)> {
    let deadline = Instant::now() + timeout;
    let process = ids.process();
    let mut consumer = Consumer::new(meta, consumer_config());
    let end = loop {
        match consumer.list_offset(&cfg.topic, partition, Seek::Latest).await {
            Ok(o) => break o,
            Err(e) if Instant::now() >= deadline => bail!("partition {partition}: no high watermark: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    consumer.assign(&cfg.topic, [partition], Seek::Earliest);
    let mut pass_started = Instant::now();
    let mut reset = true;
    while consumer.position(&cfg.topic, partition).is_none_or(|p| p < end) {
        if Instant::now() >= deadline {
            bail!(
                "partition {partition}: final read reached {:?} of {end} within {timeout:?}",
                consumer.position(&cfg.topic, partition)
            );
        }
        let inv = rec.invoke(process);
        let result = consumer.poll(Duration::from_millis(500)).await;
        let (outcome, msgs, error) = match result {
            Ok(records) => (Outcome::Ok, to_msgs(cfg, &records), None),
            Err(e) => {
                consumer.seek(&cfg.topic, partition, Seek::Earliest);
                pass_started = Instant::now();
                (Outcome::Fail, Vec::new(), Some(e.to_string()))
            }
        };
        let failed = outcome != Outcome::Ok;
        rec.push(Op {
            index: 0,
            process,
            op_type: OpType::Poll,
            outcome,
            invoke_ns: inv.invoke_ns,
            complete_ns: rec.now_ns(),
            msgs,
            reset: std::mem::take(&mut reset),
            final_read: true,
            group: false,
            error,
        });
        reset = failed;
    }
    Ok((end, pass_started.elapsed()))
}

/// The brokers' extra configuration for the `group` workload: 8 partitions
/// of `__consumer_offsets` (the default 50 only adds idle groups here).
pub const GROUP_BROKER_CONFIG: &str = "[groups]\noffsets_topic_num_partitions = 8\n";

/// One consumer-group member process (`group` workload): polls, records
/// each poll, commits the positions after it and records the commit; after
/// 20 to 150 polls it closes (leaving the group) and a new member (a new
/// process) takes its place, until `stop` turns true.
pub async fn group_consumer(
    cfg: Arc<WorkloadConfig>,
    meta: Arc<MetadataCache>,
    rec: Recorder,
    ids: Arc<Ids>,
    slot: u32,
    stop: watch::Receiver<bool>,
) {
    let Some((group, assignors)) = cfg.group.clone() else { return };
    let mut rng = StdRng::seed_from_u64(cfg.seed ^ (u64::from(slot) << 32) ^ 0x6a0f);
    while !*stop.borrow() {
        let process = ids.process();
        let mut config = ferrolog_client::GroupConsumerConfig::new(group.clone());
        config.client_id = format!("jepsen-{process}");
        config.session_timeout_ms = 6_000;
        config.heartbeat_interval_ms = 500;
        config.max_poll_interval_ms = 60_000;
        config.assignors.clone_from(&assignors);
        config.enable_auto_commit = false;
        config.auto_offset_reset = ferrolog_client::AutoOffsetReset::Earliest;
        config.consumer = consumer_config();
        let Ok(mut member) = ferrolog_client::GroupConsumer::new(meta.clone(), config, &[cfg.topic.as_str()])
        else {
            return;
        };
        let mut polls_left = rng.gen_range(20..150u32);
        let mut last_committed: Vec<Msg> = Vec::new();
        while polls_left > 0 && !*stop.borrow() {
            polls_left -= 1;
            let inv = rec.invoke(process);
            let result = member.poll(Duration::from_millis(500)).await;
            // A rebalance inside the poll moved positions: not comparable
            // with this process's earlier polls.
            let reset = !member.take_events().is_empty();
            let (outcome, msgs, error) = match result {
                Ok(records) => (Outcome::Ok, to_msgs(&cfg, &records), None),
                Err(e) => (Outcome::Fail, Vec::new(), Some(e.to_string())),
            };
            let read_some = outcome == Outcome::Ok && !msgs.is_empty();
            rec.push(Op {
                index: 0,
                process,
                op_type: OpType::Poll,
                outcome,
                invoke_ns: inv.invoke_ns,
                complete_ns: rec.now_ns(),
                msgs,
                reset,
                final_read: false,
                group: true,
                error,
            });
            let positions: Vec<Msg> =
                member.positions().into_iter().map(|((_, p), offset)| Msg::at(p, 0, offset)).collect();
            // After records were read, or when what was read before is not
            // committed yet (a commit that failed): never past a record
            // nobody read.
            if !read_some && (outcome != Outcome::Ok || positions == last_committed) {
                continue;
            }
            let inv = rec.invoke(process);
            let result = member.commit().await;
            let (outcome, error) = match &result {
                Ok(()) => {
                    last_committed.clone_from(&positions);
                    (Outcome::Ok, None)
                }
                // Refused whole by the coordinator: nothing stored.
                Err(e)
                    if matches!(
                        e.code(),
                        Some(
                            ferrolog_client::error::ErrorCode::IllegalGeneration
                                | ferrolog_client::error::ErrorCode::UnknownMemberId
                                | ferrolog_client::error::ErrorCode::FencedInstanceId
                                | ferrolog_client::error::ErrorCode::RebalanceInProgress
                        )
                    ) =>
                {
                    (Outcome::Fail, Some(e.to_string()))
                }
                Err(e) => (Outcome::Info, Some(e.to_string())),
            };
            rec.push(Op {
                index: 0,
                process,
                op_type: OpType::Commit,
                outcome,
                invoke_ns: inv.invoke_ns,
                complete_ns: rec.now_ns(),
                msgs: positions,
                reset: false,
                final_read: false,
                group: true,
                error,
            });
        }
        // Leaves the group: its partitions move to the others.
        let _ = member.close().await;
    }
}

/// Waits until `group` has committed, for every partition of the topic,
/// the high watermark (every record processed), or `timeout`; the
/// partitions still behind, as (partition, committed, high watermark).
pub async fn group_caught_up(
    cfg: &WorkloadConfig,
    meta: Arc<MetadataCache>,
    timeout: Duration,
) -> Vec<(u32, Option<u64>, u64)> {
    let Some((group, _)) = &cfg.group else { return Vec::new() };
    let groups = ferrolog_client::Groups::new(meta.clone()).with_timeout(Duration::from_secs(5));
    let reader = Consumer::new(meta, consumer_config());
    let deadline = Instant::now() + timeout;
    loop {
        let mut behind = Vec::new();
        let asked: Vec<(String, u32)> = (0..cfg.partitions).map(|p| (cfg.topic.clone(), p)).collect();
        let committed = groups.committed(group, &asked).await.unwrap_or_default();
        for p in 0..cfg.partitions {
            let end = reader.list_offset(&cfg.topic, p, Seek::Latest).await.unwrap_or(u64::MAX);
            let c = committed.iter().find(|c| c.partition == p).and_then(|c| c.offset);
            if end > 0 && c.is_none_or(|c| c < end) {
                behind.push((p, c, end));
            }
        }
        if behind.is_empty() || Instant::now() >= deadline {
            return behind;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
