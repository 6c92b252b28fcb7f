//! The producer: batches records per partition and delivers them exactly
//! once per partition in the absence of fatal errors (idempotence, KIP-98),
//! in order, retrying through leader changes and broker restarts.
//!
//! ```text
//!  send(record) ──unbounded command channel──> worker ──> PartitionQueue per partition
//!     │ returns a Delivery future                 │ close batches at batch_bytes_max or after linger_ms
//!     │                                           │ ≤ max_in_flight_per_partition Produce requests each
//!     └── ready().await: backpressure            └──> spawned request tasks ──events──> worker
//! ```
//!
//! - Idempotence (default): one `InitProducerId` at start; each partition's
//!   batches carry `base_sequence` numbers starting at 0 and increasing by
//!   record count. A resend keeps its sequence, so a batch stored twice is
//!   answered `duplicate = true` with its original offset: success.
//! - Retries: `NOT_LEADER`, `UNAVAILABLE`, `DUPLICATE_IN_FLIGHT`, transport
//!   errors and timeouts refresh metadata, back off (20 ms doubling to 1 s)
//!   and resend every unacknowledged batch of the partition in order, until
//!   `delivery_timeout_ms` after the record was sent (Kafka's
//!   `delivery.timeout.ms`, KIP-91); a request in flight is not awaited past
//!   that either (its batch fails as of unknown outcome, `maybe_stored`).
//!   `OUT_OF_ORDER_SEQUENCE` is retried only while an earlier batch is
//!   unacknowledged.
//! - Permanent errors (`RECORD_TOO_LARGE`, `INVALID_REQUEST`, ...) fail the
//!   batch's records; the partition then continues under a new producer id.
//!   A record over the broker's `limits.max_record_bytes` (which `Metadata`
//!   states) fails with `RECORD_TOO_LARGE` at once, without a request.
//! - Keyed records go to `murmur2(key) % partitions` like Kafka; keyless
//!   records stick to one partition per batch (KIP-480).

mod queue;
mod worker;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::sync::{Notify, mpsc, oneshot};

use crate::error::{Error, Result};
use crate::metadata::MetadataCache;
use crate::record::{Record, RecordMetadata};

/// Producer settings. Defaults follow Kafka's where they carry over.
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    /// Close a partition's batch when its records reach this size, bytes.
    /// Default 64 KiB: larger than Kafka's 16 KiB `batch.size` because each
    /// batch here is its own request and Raft entry. At most 1 MiB, the
    /// broker's default `limits.max_batch_bytes`; batches close at the
    /// broker's `limits.max_batch_bytes` when that is lower. A record larger
    /// than this goes alone in its batch.
    pub batch_bytes_max: usize,
    /// Wait this long for more records before sending a batch that is not
    /// full, ms (Kafka's `linger.ms`, 5 since Kafka 4.0).
    pub linger_ms: u64,
    /// Most unacknowledged requests per partition (Kafka's
    /// `max.in.flight.requests.per.connection`, at most 5 with idempotence).
    pub max_in_flight_per_partition: usize,
    /// Give up on a record this long after `send`, ms (Kafka's
    /// `delivery.timeout.ms`, 120 s).
    pub delivery_timeout_ms: u64,
    /// [`Producer::ready`] waits while this many bytes of records are
    /// unacknowledged (Kafka's `buffer.memory`, 32 MiB).
    pub buffer_bytes_max: usize,
    /// Sequence numbers and a producer id so that retries are not stored
    /// twice (Kafka's `enable.idempotence`, default on).
    pub idempotent: bool,
    /// How long records for a topic missing from the metadata wait for it
    /// to appear, ms (Kafka's `max.block.ms` covers this, 60 s).
    pub topic_wait_ms: u64,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        ProducerConfig {
            batch_bytes_max: 64 << 10,
            linger_ms: 5,
            max_in_flight_per_partition: 5,
            delivery_timeout_ms: 120_000,
            buffer_bytes_max: 32 << 20,
            idempotent: true,
            topic_wait_ms: 15_000,
        }
    }
}

impl ProducerConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad setting.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(m.to_owned()));
        if !(1..=1 << 20).contains(&self.batch_bytes_max) {
            return bad("batch_bytes_max must be in 1 B ..= 1 MiB");
        }
        if !(1..=5).contains(&self.max_in_flight_per_partition) {
            return bad("max_in_flight_per_partition must be in 1..=5");
        }
        if self.delivery_timeout_ms == 0 || self.linger_ms >= self.delivery_timeout_ms {
            return bad("delivery_timeout_ms must be > 0 and exceed linger_ms");
        }
        if self.buffer_bytes_max < self.batch_bytes_max {
            return bad("buffer_bytes_max must be at least batch_bytes_max");
        }
        Ok(())
    }
}

/// Bytes of records handed to `send` and not yet resolved, shared by the
/// handles and the worker.
#[derive(Debug)]
pub(crate) struct BufferGauge {
    bytes: AtomicUsize,
    max: usize,
    freed: Notify,
}

impl BufferGauge {
    fn add(&self, n: usize) {
        self.bytes.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn release(&self, n: usize) {
        self.bytes.fetch_sub(n, Ordering::Relaxed);
        self.freed.notify_waiters();
    }
}

/// Messages from [`Producer`] handles to the worker.
pub(crate) enum Command {
    Send { topic: Arc<str>, record: Record, waiter: queue::Waiter },
    Flush(oneshot::Sender<()>),
}

struct Inner {
    commands: mpsc::UnboundedSender<Command>,
    buffer: Arc<BufferGauge>,
    closed: AtomicBool,
    /// The topic of the last `send`, shared with its command, so a stream
    /// of records to one topic does not allocate a name per record.
    last_topic: std::sync::Mutex<Option<Arc<str>>>,
}

impl Inner {
    /// `topic` as a shared name: the last one again if it is the same. Never
    /// waits: while another thread holds the cache, the name is copied.
    fn topic(&self, topic: &str) -> Arc<str> {
        let Ok(mut last) = self.last_topic.try_lock() else {
            return Arc::from(topic);
        };
        match &*last {
            Some(t) if &**t == topic => t.clone(),
            _ => last.insert(Arc::from(topic)).clone(),
        }
    }
}

/// The producer handle; cheap to clone, all clones share one worker. The
/// worker finishes delivering what was sent and stops once every handle is
/// dropped.
#[derive(Clone)]
pub struct Producer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer").field("buffered_bytes", &self.buffered_bytes()).finish_non_exhaustive()
    }
}

/// The outcome of one [`Producer::send`]: resolves to the record's partition
/// and offset once a majority of the partition's replicas stored it, or to
/// the error that made the producer give up.
#[derive(Debug)]
#[must_use = "a delivery tells whether the record was stored"]
pub struct Delivery {
    rx: oneshot::Receiver<Result<RecordMetadata>>,
}

impl Future for Delivery {
    type Output = Result<RecordMetadata>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(result)) => Poll::Ready(result),
            Poll::Ready(Err(_)) => Poll::Ready(Err(Error::Closed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Producer {
    /// Starts a producer (its worker task) on the current Tokio runtime.
    ///
    /// # Errors
    /// [`Error::Config`] for bad settings.
    pub fn new(meta: Arc<MetadataCache>, config: ProducerConfig) -> Result<Self> {
        config.validate()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let buffer = Arc::new(BufferGauge {
            bytes: AtomicUsize::new(0),
            max: config.buffer_bytes_max,
            freed: Notify::new(),
        });
        worker::spawn(meta, config, rx, buffer.clone());
        Ok(Producer {
            inner: Arc::new(Inner {
                commands: tx,
                buffer,
                closed: AtomicBool::new(false),
                last_topic: std::sync::Mutex::new(None),
            }),
        })
    }

    /// Hands a record to the producer for `topic` and returns its
    /// [`Delivery`]. Never waits: records sent by one task are delivered in
    /// the order of these calls (per partition). Memory is bounded only if
    /// the caller awaits [`Producer::ready`] before sending, or bounds its
    /// outstanding deliveries.
    pub fn send(&self, topic: &str, record: Record) -> Delivery {
        let (tx, rx) = oneshot::channel();
        if self.inner.closed.load(Ordering::Acquire) {
            let _ = tx.send(Err(Error::Closed));
            return Delivery { rx };
        }
        self.inner.buffer.add(record_size(&record));
        let command = Command::Send { topic: self.inner.topic(topic), record, waiter: tx };
        if let Err(mpsc::error::SendError(Command::Send { waiter, record, .. })) =
            self.inner.commands.send(command)
        {
            self.inner.buffer.release(record_size(&record));
            let _ = waiter.send(Err(Error::Closed));
        }
        Delivery { rx }
    }

    /// Waits until fewer than `buffer_bytes_max` bytes of records are
    /// unacknowledged (Kafka's `send` blocking on `buffer.memory`).
    pub async fn ready(&self) {
        let gauge = &self.inner.buffer;
        loop {
            let freed = gauge.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if gauge.bytes.load(Ordering::Relaxed) < gauge.max {
                return;
            }
            freed.await;
        }
    }

    /// Bytes of records sent and not yet resolved.
    pub fn buffered_bytes(&self) -> usize {
        self.inner.buffer.bytes.load(Ordering::Relaxed)
    }

    /// Sends every open batch now and waits until every record sent before
    /// this call is resolved (delivered or failed).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.inner.commands.send(Command::Flush(tx)).is_ok() {
            // An error means the worker stopped: nothing is left to wait for.
            let _ = rx.await;
        }
    }

    /// Refuses further sends (they resolve to [`Error::Closed`]) and waits
    /// for every record already sent to be resolved.
    pub async fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        self.flush().await;
    }
}

/// What a broker counts against `limits.max_record_bytes`: key, value, and
/// each header's key and value, bytes.
pub(crate) fn record_payload_bytes(record: &Record) -> usize {
    record.key.as_ref().map_or(0, bytes::Bytes::len)
        + record.value.len()
        + record.headers.iter().map(|h| h.key.len() + h.value.len()).sum::<usize>()
}

/// A record's encoded size on the wire, bytes: what batch sizes count.
pub(crate) fn record_size(record: &Record) -> usize {
    // Encoded length of the proto Record without copying it: key, value,
    // headers and timestamp fields with their tags and lengths.
    // Tag byte, length varint, bytes.
    fn field(len: usize) -> usize {
        1 + prost::encoding::encoded_len_varint(len as u64) + len
    }
    // proto3 leaves out empty strings and bytes (but not a present optional).
    fn implicit(len: usize) -> usize {
        if len == 0 { 0 } else { field(len) }
    }
    let mut n = record.key.as_ref().map_or(0, |k| field(k.len())) + implicit(record.value.len());
    for h in &record.headers {
        n += field(implicit(h.key.len()) + implicit(h.value.len()));
    }
    if record.timestamp_ms != 0 {
        n += 1 + prost::encoding::encoded_len_varint(record.timestamp_ms as u64);
    }
    n
}

/// [`record_size`] of an already encoded record (used in tests to check it).
#[cfg(test)]
fn wire_size(record: &Record) -> usize {
    prost::Message::encoded_len(&record.to_wire())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_bytes_are_key_value_and_headers() {
        let r = Record::new(vec![0u8; 10]).with_key("abc").with_header("hh", "vvvv").with_timestamp_ms(5);
        assert_eq!(record_payload_bytes(&r), 10 + 3 + 2 + 4);
        assert_eq!(record_payload_bytes(&Record::new("")), 0);
    }

    #[test]
    fn record_size_is_the_encoded_length() {
        let cases = [
            Record::new("v"),
            Record::new(vec![7u8; 300]).with_key("k"),
            Record::new("").with_key("").with_timestamp_ms(1_700_000_000_000),
            Record::new("x").with_header("h", "vv").with_header("", vec![1u8; 200]).with_timestamp_ms(-5),
        ];
        for r in cases {
            assert_eq!(record_size(&r), wire_size(&r), "{r:?}");
        }
    }

    #[test]
    fn config_defaults_are_valid_and_limits_hold() {
        ProducerConfig::default().validate().expect("defaults");
        let bad = [
            ProducerConfig { batch_bytes_max: 2 << 20, ..Default::default() },
            ProducerConfig { max_in_flight_per_partition: 6, ..Default::default() },
            ProducerConfig { delivery_timeout_ms: 0, ..Default::default() },
            ProducerConfig { buffer_bytes_max: 1, ..Default::default() },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }
}
