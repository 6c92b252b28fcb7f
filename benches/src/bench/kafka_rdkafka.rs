//! The Kafka side of `ferrolog-bench kafka --client rdkafka`: librdkafka
//! (the `rdkafka` crate, built from source; feature `rdkafka`) in this
//! process, with the settings kcat gets, so the client's cost is the
//! library's alone (no file to read, no output to format).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};

/// Counts acknowledged and failed deliveries.
#[derive(Default)]
struct Counts {
    acked: AtomicU64,
    failed: AtomicU64,
}

struct Deliveries(Arc<Counts>);

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        let counter = if result.is_ok() { &self.0.acked } else { &self.0.failed };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Produces `n` records of `bytes` bytes (no key) to `topic` through
/// `bootstrap` (acks=all, 2 ms linger, 256 KiB batches, no idempotence, no
/// compression, as kcat is run); returns the seconds until every one was
/// acknowledged.
///
/// # Errors
/// A record that failed, or the client refusing its configuration.
pub fn produce(bootstrap: &str, topic: &str, n: u64, bytes: usize) -> anyhow::Result<f64> {
    let counts = Arc::new(Counts::default());
    let producer: ThreadedProducer<Deliveries> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("batch.size", "262144")
        .set("queue.buffering.max.messages", "1000000")
        .set("enable.idempotence", "false")
        .set("compression.codec", "none")
        .create_with_context(Deliveries(counts.clone()))
        .context("an rdkafka producer")?;
    let value = vec![b'x'; bytes];
    let start = Instant::now();
    for _ in 0..n {
        let mut record = BaseRecord::<(), [u8]>::to(topic).payload(&value[..]);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err((e, _)) => anyhow::bail!("rdkafka send: {e}"),
            }
        }
    }
    producer.flush(Duration::from_secs(120)).context("rdkafka flush")?;
    let seconds = start.elapsed().as_secs_f64();
    let (acked, failed) = (counts.acked.load(Ordering::Relaxed), counts.failed.load(Ordering::Relaxed));
    anyhow::ensure!(acked == n && failed == 0, "rdkafka: {acked} of {n} acknowledged, {failed} failed");
    Ok(seconds)
}

/// Reads `topic`'s `partitions` from the start until `n` records were read
/// (8 MiB per partition fetch, 16 MiB per response,
/// `queued.min.messages=1000000`, as kcat is run); returns the seconds.
///
/// # Errors
/// A consumer error, or fewer than `n` records within ten minutes.
pub fn consume(bootstrap: &str, topic: &str, partitions: u32, n: u64) -> anyhow::Result<f64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("bench-{topic}"))
        .set("enable.auto.commit", "false")
        .set("fetch.max.bytes", "16777216")
        .set("max.partition.fetch.bytes", "8388608")
        .set("queued.min.messages", "1000000")
        // librdkafka postpones a partition's next fetch by this much once
        // its queue passes the thresholds above (default 1 s: whole
        // pauses at 100 B records); its documentation advises lowering it
        // for this case.
        .set("fetch.queue.backoff.ms", "10")
        .create()
        .context("an rdkafka consumer")?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p as i32, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let start = Instant::now();
    let mut read = 0u64;
    while read < n {
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(m)) => {
                anyhow::ensure!(m.payload().is_some(), "a record without a value");
                read += 1;
            }
            Some(Err(e)) => anyhow::bail!("rdkafka consume: {e}"),
            None => anyhow::ensure!(start.elapsed() < Duration::from_secs(600), "stalled at {read} of {n}"),
        }
    }
    Ok(start.elapsed().as_secs_f64())
}
