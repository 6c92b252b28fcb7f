//! Records as the application sees them, and their wire form.

use bytes::Bytes;
use ferrolog_proto::client as pb;

/// A record header: a name and an opaque value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Header name.
    pub key: String,
    /// Header value (empty when `null_value`).
    pub value: Bytes,
    /// The value is null, not empty: Kafka's headers may carry null values
    /// (records produced through the Kafka listener).
    pub null_value: bool,
}

/// A record to produce.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// Partitioning key; `None` is Kafka's null key (sticky partitioning, KIP-480).
    pub key: Option<Bytes>,
    /// The payload.
    pub value: Bytes,
    /// The value is null, not empty (`value` must then be empty): Kafka's
    /// tombstone, which deletes the key from a compacted topic.
    pub null_value: bool,
    /// Headers, in order.
    pub headers: Vec<Header>,
    /// Milliseconds since the Unix epoch; 0 lets the broker stamp its own time.
    pub timestamp_ms: i64,
    /// Explicit partition; `None` lets the partitioner choose.
    pub partition: Option<u32>,
}

impl Record {
    /// A record with a value only.
    pub fn new(value: impl Into<Bytes>) -> Self {
        Record { value: value.into(), ..Default::default() }
    }

    /// A tombstone: `key` with a null value, which deletes the key from a
    /// compacted topic once compaction runs (Kafka's `cleanup.policy=compact`).
    pub fn tombstone(key: impl Into<Bytes>) -> Self {
        Record { key: Some(key.into()), null_value: true, ..Default::default() }
    }

    /// Sets the key.
    #[must_use]
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the timestamp, ms since the Unix epoch.
    #[must_use]
    pub fn with_timestamp_ms(mut self, timestamp_ms: i64) -> Self {
        self.timestamp_ms = timestamp_ms;
        self
    }

    /// Appends a header.
    #[must_use]
    pub fn with_header(mut self, key: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.push(Header { key: key.into(), value: value.into(), null_value: false });
        self
    }

    /// Sends the record to this partition instead of asking the partitioner.
    #[must_use]
    pub fn with_partition(mut self, partition: u32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// The wire form; the key, value and header values are shared, not
    /// copied (`bytes::Bytes` on both sides).
    #[cfg(test)]
    pub(crate) fn to_wire(&self) -> pb::Record {
        self.clone().into_wire()
    }

    /// The wire form, taking the record apart (no reference counts are
    /// touched: the producer's hot path, once per record).
    pub(crate) fn into_wire(self) -> pb::Record {
        pb::Record {
            key: self.key,
            value: self.value,
            headers: self
                .headers
                .into_iter()
                .map(|h| pb::Header { key: h.key, value: h.value, null_value: h.null_value })
                .collect(),
            timestamp_ms: self.timestamp_ms,
            offset_delta: None,
            null_value: self.null_value,
        }
    }
}

/// Where a produced record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordMetadata {
    /// Partition number.
    pub partition: u32,
    /// The record's offset in the partition.
    pub offset: u64,
}

/// A record read by a consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerRecord {
    /// Topic name.
    pub topic: String,
    /// Partition number.
    pub partition: u32,
    /// Offset in the partition.
    pub offset: u64,
    /// Key, `None` when the record has none.
    pub key: Option<Bytes>,
    /// Payload (empty when `null_value`).
    pub value: Bytes,
    /// The value is null (a tombstone), not empty.
    pub null_value: bool,
    /// Milliseconds since the Unix epoch (the producer's, or the broker's
    /// when the producer sent 0).
    pub timestamp_ms: i64,
    /// Headers, in order.
    pub headers: Vec<Header>,
}

impl ConsumerRecord {
    pub(crate) fn from_wire(topic: &str, partition: u32, offset: u64, r: pb::Record) -> Self {
        ConsumerRecord {
            topic: topic.to_owned(),
            partition,
            offset,
            key: r.key,
            value: r.value,
            null_value: r.null_value,
            timestamp_ms: r.timestamp_ms,
            headers: r
                .headers
                .into_iter()
                .map(|h| Header { key: h.key, value: h.value, null_value: h.null_value })
                .collect(),
        }
    }
}
