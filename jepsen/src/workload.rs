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
        let mut msgs: Vec<Msg> =
            (0..n).map(|_| Msg::unacked(keys[rng.gen_range(0..keys.len())], ids.value())).collect();
        let inv = rec.invoke(process);
        let deliveries: Vec<_> = msgs
            .iter()
            .map(|m| {
                producer.send(
                    &cfg.topic,
                    Record::new(m.value.to_string()).with_key(m.key.to_string()).with_partition(m.key),
                )
            })
            .collect();
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

fn to_msgs(records: &[ConsumerRecord]) -> Vec<Msg> {
    records
        .iter()
        .map(|r| {
            let value = std::str::from_utf8(&r.value).ok().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX);
            Msg::at(r.partition, value, r.offset)
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
            Ok(records) => (Outcome::Ok, to_msgs(&records), None),
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
            error,
        });
    }
}

/// Reads `partition` from its start to the high watermark seen at the start
/// (retrying for up to `timeout`), recording every poll as a final-read
/// operation. Returns the values read and the end offset reached.
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
) -> anyhow::Result<u64> {
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
            Ok(records) => (Outcome::Ok, to_msgs(&records), None),
            Err(e) => {
                consumer.seek(&cfg.topic, partition, Seek::Earliest);
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
            error,
        });
        reset = failed;
    }
    Ok(end)
}
