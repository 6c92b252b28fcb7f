//! Kafka's record batch (magic 2, the format of KIP-98) as Ferrolog stores
//! and serves it.
//!
//! A batch produced through the Kafka listener is stored as it came: the
//! payload of its log entry is [`PAYLOAD_TAG`] followed by the batch's bytes
//! from its CRC field to its end (what the CRC covers, and the CRC). A fetch
//! through the Kafka listener puts back the 17 bytes in front of the CRC
//! (base offset from the log, batch length, partition leader epoch, magic):
//! nothing is re-encoded or recompressed on that path. The tag can never
//! start a protobuf `RecordSet` (it reads as field 31 with wire type 7, which
//! does not exist), so a stored payload says which encoding it is, and a
//! broker that does not know this one fails to decode it rather than
//! misreading it.
//!
//! Batches in Ferrolog's own encoding are turned into uncompressed Kafka
//! batches for Kafka consumers ([`encode_batch`]), and Kafka batches into
//! Ferrolog records for the gRPC API and compaction ([`decode_payload`]).
//!
//! Layout of a batch (all integers big-endian; Kafka's
//! `DefaultRecordBatch`): base offset i64, batch length i32, partition
//! leader epoch i32, magic i8, CRC-32C u32 (over everything after it),
//! attributes i16, last offset delta i32, base timestamp i64, max timestamp
//! i64, producer id i64, producer epoch i16, base sequence i32, record count
//! i32, then the records (compressed as a block when the attributes say so).
//! A record: length varint, attributes i8, timestamp delta varlong, offset
//! delta varint, key (varint length, -1 for null), value (likewise), header
//! count varint, headers (key: varint length and UTF-8 bytes; value: varint
//! length, -1 for null).

use bytes::{BufMut, Bytes, BytesMut};
use ferrolog_proto::client::{Header, Record};
use ferrolog_raft_store::StoredBatch;

pub use super::kafka_codec::{Codec, compress, decompress};

/// First byte of a stored payload that holds a Kafka batch (see the module
/// comment).
pub const PAYLOAD_TAG: u8 = 0xFF;

/// Bytes of a batch before its first record.
pub const BATCH_OVERHEAD_BYTES: usize = 61;

/// Bytes in front of the CRC field (base offset, length, leader epoch, magic).
const PREFIX_BYTES: usize = 17;
/// Byte position of the attributes (the first byte the CRC covers).
const CRC_START: usize = 21;

/// Attributes: the compression codec (bits 0–2).
const COMPRESSION_MASK: i16 = 0x07;
/// Attributes: timestamps are the broker's append time (bit 3).
const LOG_APPEND_TIME: i16 = 1 << 3;
/// Attributes: part of a transaction (bit 4).
const TRANSACTIONAL: i16 = 1 << 4;
/// Attributes: a control batch (bit 5).
const CONTROL: i16 = 1 << 5;

/// Most bytes a stored batch's records may decompress to when read back,
/// bytes: produce checked them against the limits of the day, so this only
/// bounds memory against a damaged or foreign payload.
pub const STORED_DECOMPRESSED_MAX: usize = 256 << 20;

/// Why a produced batch was refused, by the Kafka error it maps to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// The CRC does not match, or the bytes end early (Kafka's
    /// `CORRUPT_MESSAGE`).
    #[error("corrupt record batch: {0}")]
    Corrupt(String),
    /// A well-formed batch Ferrolog does not take (Kafka's
    /// `INVALID_RECORD`): wrong offsets deltas, a control or transactional
    /// batch, a header key that is not UTF-8, a null key in a compacted topic.
    #[error("invalid record batch: {0}")]
    Invalid(String),
    /// An old message format (magic 0 or 1; Kafka's
    /// `UNSUPPORTED_FOR_MESSAGE_FORMAT`).
    #[error("unsupported message format: {0}")]
    Unsupported(String),
    /// A record or the batch over its limit (Kafka's `MESSAGE_TOO_LARGE`).
    #[error("{0}")]
    TooLarge(String),
}

/// The fixed fields of a batch after the CRC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    /// Attributes (codec, timestamp type, transactional, control).
    pub attributes: i16,
    /// Offset of the last record minus the base offset.
    pub last_offset_delta: i32,
    /// Timestamp the records' deltas are relative to, ms since the epoch.
    pub base_timestamp: i64,
    /// Largest record timestamp (or the append time), ms since the epoch.
    pub max_timestamp: i64,
    /// Idempotent producer id (KIP-98), or -1.
    pub producer_id: i64,
    /// Producer epoch.
    pub producer_epoch: i16,
    /// Sequence number of the first record.
    pub base_sequence: i32,
    /// Records in the batch.
    pub record_count: i32,
}

impl BatchHeader {
    /// The codec of the records.
    ///
    /// # Errors
    /// An unknown codec number.
    pub fn codec(&self) -> Result<Codec, String> {
        Codec::from_id(self.attributes & COMPRESSION_MASK)
    }

    /// Whether the records' timestamps are the broker's append time.
    pub fn log_append_time(&self) -> bool {
        self.attributes & LOG_APPEND_TIME != 0
    }

    /// Parses the fields from `b`, the batch from its attributes on.
    fn parse(b: &[u8]) -> Result<Self, String> {
        if b.len() < BATCH_OVERHEAD_BYTES - CRC_START {
            return Err(format!("{} bytes after the CRC, fewer than a batch header", b.len()));
        }
        let mut r = Reader { b, at: 0 };
        Ok(Self {
            attributes: r.i16()?,
            last_offset_delta: r.i32()?,
            base_timestamp: r.i64()?,
            max_timestamp: r.i64()?,
            producer_id: r.i64()?,
            producer_epoch: r.i16()?,
            base_sequence: r.i32()?,
            record_count: r.i32()?,
        })
    }
}

/// One record of a batch, its byte fields sliced from the batch's
/// (decompressed) records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KafkaRecord {
    /// Timestamp minus the batch's base timestamp, ms.
    pub timestamp_delta: i64,
    /// Offset minus the batch's base offset.
    pub offset_delta: i32,
    /// Key; `None` is Kafka's null key.
    pub key: Option<Bytes>,
    /// Value; `None` is null (a tombstone).
    pub value: Option<Bytes>,
    /// Headers in order: UTF-8 key, value (`None`: null).
    pub headers: Vec<(String, Option<Bytes>)>,
}

impl KafkaRecord {
    /// Bytes the record counts against `max_record_bytes`: key, value and
    /// each header's key and value, as for a record produced through gRPC
    /// ([`super::records::record_size_bytes`]).
    pub fn size_bytes(&self) -> usize {
        self.key.as_ref().map_or(0, Bytes::len)
            + self.value.as_ref().map_or(0, Bytes::len)
            + self.headers.iter().map(|(k, v)| k.len() + v.as_ref().map_or(0, Bytes::len)).sum::<usize>()
    }
}

/// A produced batch, checked ([`check_produced`]).
#[derive(Clone, Debug)]
pub struct CheckedBatch {
    /// Its header.
    pub header: BatchHeader,
    /// Its records, decoded.
    pub records: Vec<KafkaRecord>,
    /// The records' bytes, decompressed (the records above slice them).
    pub plain: Bytes,
    /// The whole batch as it came (or as [`CheckedBatch::recompress`] made it).
    pub bytes: Bytes,
}

impl CheckedBatch {
    /// Timestamp of the first record, ms since the epoch (the append time
    /// for a `LogAppendTime` batch).
    pub fn first_timestamp_ms(&self) -> i64 {
        if self.header.log_append_time() {
            return self.header.max_timestamp;
        }
        self.records.first().map_or(self.header.base_timestamp, |r| {
            self.header.base_timestamp.wrapping_add(r.timestamp_delta)
        })
    }

    /// Largest record timestamp, ms since the epoch, computed from the
    /// records rather than taken from the header (the time index is built
    /// from it).
    pub fn max_timestamp_ms(&self) -> i64 {
        if self.header.log_append_time() {
            return self.header.max_timestamp;
        }
        self.records
            .iter()
            .map(|r| self.header.base_timestamp.wrapping_add(r.timestamp_delta))
            .max()
            .unwrap_or(self.header.base_timestamp)
    }

    /// Makes it a `LogAppendTime` batch stamped `now_ms` (Kafka's
    /// `message.timestamp.type=LogAppendTime`): sets the attribute bit and
    /// the max timestamp, and recomputes the CRC; records keep their deltas
    /// (consumers read the batch's max timestamp as every record's).
    pub fn stamp_log_append_time(&mut self, now_ms: i64) {
        let mut b = BytesMut::from(&self.bytes[..]);
        self.header.attributes |= LOG_APPEND_TIME;
        self.header.max_timestamp = now_ms;
        b[CRC_START..CRC_START + 2].copy_from_slice(&self.header.attributes.to_be_bytes());
        b[35..43].copy_from_slice(&now_ms.to_be_bytes());
        let crc = crc32c::crc32c(&b[CRC_START..]);
        b[PREFIX_BYTES..CRC_START].copy_from_slice(&crc.to_be_bytes());
        self.bytes = b.freeze();
    }

    /// Makes it a `CreateTime` batch (a producer set the bit on a topic
    /// whose timestamps are the producers'): clears the attribute bit and
    /// recomputes the CRC; the timestamps are then the records' own.
    pub fn clear_log_append_time(&mut self) {
        let mut b = BytesMut::from(&self.bytes[..]);
        self.header.attributes &= !LOG_APPEND_TIME;
        b[CRC_START..CRC_START + 2].copy_from_slice(&self.header.attributes.to_be_bytes());
        let crc = crc32c::crc32c(&b[CRC_START..]);
        b[PREFIX_BYTES..CRC_START].copy_from_slice(&crc.to_be_bytes());
        self.bytes = b.freeze();
    }

    /// Makes its records compressed with `codec` (a topic's
    /// `compression.type` other than `producer`, as Kafka's broker
    /// recompresses): the header is kept but for the codec bits; the CRC is
    /// recomputed. Nothing is done when the batch already has that codec.
    ///
    /// # Errors
    /// [`BatchError::Invalid`] if the codec's library fails.
    pub fn recompress(&mut self, codec: Codec) -> Result<(), BatchError> {
        if self.header.codec() == Ok(codec) {
            return Ok(());
        }
        let body = compress(codec, &self.plain).map_err(BatchError::Invalid)?;
        self.header.attributes = (self.header.attributes & !COMPRESSION_MASK) | codec.id();
        let mut b = BytesMut::with_capacity(BATCH_OVERHEAD_BYTES + body.len());
        b.extend_from_slice(&self.bytes[..8]); // base offset
        let length = i32::try_from(BATCH_OVERHEAD_BYTES - 12 + body.len())
            .map_err(|_| BatchError::TooLarge("a recompressed batch over 2 GiB".into()))?;
        b.put_i32(length);
        b.extend_from_slice(&self.bytes[12..PREFIX_BYTES]); // leader epoch, magic
        b.put_u32(0); // the CRC, below
        b.put_i16(self.header.attributes);
        b.extend_from_slice(&self.bytes[CRC_START + 2..BATCH_OVERHEAD_BYTES]);
        b.extend_from_slice(&body);
        let crc = crc32c::crc32c(&b[CRC_START..]);
        b[PREFIX_BYTES..CRC_START].copy_from_slice(&crc.to_be_bytes());
        self.bytes = b.freeze();
        Ok(())
    }

    /// The stored payload: [`PAYLOAD_TAG`], then the batch from its CRC on.
    pub fn payload(&self) -> Bytes {
        let mut p = BytesMut::with_capacity(1 + self.bytes.len() - PREFIX_BYTES);
        p.put_u8(PAYLOAD_TAG);
        p.extend_from_slice(&self.bytes[PREFIX_BYTES..]);
        p.freeze()
    }
}

/// Checks a batch as a producer sent it (one batch: Kafka's produce
/// request v3 and later carry exactly one per partition) and decodes its
/// records, decompressing at most `decompressed_max` bytes (also the most
/// a batch may take as it came).
///
/// Checked: the length, magic 2, the CRC-32C, a known codec, neither
/// control nor transactional, at least one record, `last offset delta` =
/// count − 1 and offset deltas 0, 1, 2, …, each record's length, header
/// keys in UTF-8, and no bytes after the last record.
///
/// # Errors
/// [`BatchError`] naming what is wrong.
pub fn check_produced(bytes: Bytes, decompressed_max: usize) -> Result<CheckedBatch, BatchError> {
    if bytes.len() < BATCH_OVERHEAD_BYTES {
        return Err(BatchError::Corrupt(format!(
            "{} bytes is shorter than a record batch header ({BATCH_OVERHEAD_BYTES} bytes)",
            bytes.len()
        )));
    }
    if bytes.len() > decompressed_max {
        return Err(BatchError::TooLarge(format!(
            "a batch of {} bytes; at most {decompressed_max} are taken",
            bytes.len()
        )));
    }
    let magic = bytes[16] as i8;
    if magic != 2 {
        return Err(BatchError::Unsupported(format!(
            "message format v{magic}; Ferrolog takes record batches v2 only (Kafka 0.11 and later clients)"
        )));
    }
    let length = i32::from_be_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if usize::try_from(length).ok() != Some(bytes.len() - 12) {
        return Err(BatchError::Corrupt(format!(
            "batch length field says {length} bytes, the request carries {} (exactly one batch per \
             partition is taken)",
            bytes.len() - 12
        )));
    }
    let crc = u32::from_be_bytes([bytes[17], bytes[18], bytes[19], bytes[20]]);
    let actual = crc32c::crc32c(&bytes[CRC_START..]);
    if crc != actual {
        return Err(BatchError::Corrupt(format!("CRC-32C is {actual:#010x}, the batch says {crc:#010x}")));
    }
    let header = BatchHeader::parse(&bytes[CRC_START..]).map_err(BatchError::Corrupt)?;
    if header.attributes & CONTROL != 0 {
        return Err(BatchError::Invalid("control batches are written by brokers, not producers".into()));
    }
    if header.attributes & TRANSACTIONAL != 0 {
        return Err(BatchError::Invalid("transactional batches: transactions are not supported".into()));
    }
    if header.record_count < 1 {
        return Err(BatchError::Invalid(format!("{} records in the batch", header.record_count)));
    }
    if header.last_offset_delta != header.record_count - 1 {
        return Err(BatchError::Invalid(format!(
            "last offset delta {} with {} records",
            header.last_offset_delta, header.record_count
        )));
    }
    let (records, plain) = records_of(&header, bytes.slice(BATCH_OVERHEAD_BYTES..), decompressed_max)?;
    for (i, r) in records.iter().enumerate() {
        if usize::try_from(r.offset_delta).ok() != Some(i) {
            return Err(BatchError::Invalid(format!("record {i} has offset delta {}", r.offset_delta)));
        }
    }
    Ok(CheckedBatch { header, records, plain, bytes })
}

/// Decodes the records of a batch whose header is `header` from `body`
/// (the bytes after the header), decompressing at most `decompressed_max`;
/// returns them and the decompressed bytes they slice.
fn records_of(
    header: &BatchHeader,
    body: Bytes,
    decompressed_max: usize,
) -> Result<(Vec<KafkaRecord>, Bytes), BatchError> {
    let codec = header.codec().map_err(BatchError::Invalid)?;
    let count = usize::try_from(header.record_count).unwrap_or(0);
    let plain = match codec {
        Codec::None => body,
        c => Bytes::from(decompress(c, &body, decompressed_max)?),
    };
    // Every record takes at least 7 bytes: never reserve more than the
    // bytes can hold, whatever the count says.
    if count > plain.len() / 7 {
        return Err(BatchError::Corrupt(format!(
            "{count} records cannot fit in {} bytes of records",
            plain.len()
        )));
    }
    let mut out = Vec::with_capacity(count);
    let mut r = Reader { b: &plain, at: 0 };
    for i in 0..count {
        out.push(read_record(&mut r, &plain).map_err(|e| BatchError::Corrupt(format!("record {i}: {e}")))?);
    }
    if r.at != plain.len() {
        return Err(BatchError::Corrupt(format!(
            "{} bytes after the last of {count} records",
            plain.len() - r.at
        )));
    }
    Ok((out, plain))
}

fn read_record(r: &mut Reader<'_>, all: &Bytes) -> Result<KafkaRecord, String> {
    let len = r.varint()?;
    let len = usize::try_from(len).map_err(|_| format!("negative record length {len}"))?;
    let end = r.at.checked_add(len).filter(|e| *e <= all.len()).ok_or("record length past the end")?;
    let _attributes = r.i8()?;
    let timestamp_delta = r.varlong()?;
    let offset_delta = r.varint()?;
    let key = r.nullable_bytes(all)?;
    let value = r.nullable_bytes(all)?;
    let n = r.varint()?;
    let n = usize::try_from(n).map_err(|_| format!("negative header count {n}"))?;
    if n > end.saturating_sub(r.at) / 2 {
        return Err(format!("{n} headers cannot fit in the record"));
    }
    let mut headers = Vec::with_capacity(n);
    for _ in 0..n {
        let k = r.nullable_bytes(all)?.ok_or("a header key is null")?;
        let k = String::from_utf8(k.to_vec()).map_err(|_| "a header key is not UTF-8".to_owned())?;
        headers.push((k, r.nullable_bytes(all)?));
    }
    if r.at != end {
        return Err(format!("the record says {len} bytes, its fields take {}", len + r.at - end));
    }
    Ok(KafkaRecord { timestamp_delta, offset_delta, key, value, headers })
}

/// Whether a stored payload holds a Kafka batch.
pub fn is_kafka_payload(payload: &[u8]) -> bool {
    payload.first() == Some(&PAYLOAD_TAG)
}

/// The records of a stored Kafka payload as Ferrolog records (what the
/// gRPC API serves and compaction reads): timestamps made absolute (a
/// `LogAppendTime` batch's max timestamp for all), null values and header
/// values kept as null, offset deltas carried where they are not one past
/// the previous record's.
///
/// # Errors
/// A message when the payload is not a well-formed Kafka batch (it passed
/// its frame's CRC, so this means damage before the write or a bug).
pub fn decode_payload(payload: &Bytes) -> Result<Vec<Record>, String> {
    if !is_kafka_payload(payload) || payload.len() < 1 + BATCH_OVERHEAD_BYTES - PREFIX_BYTES {
        return Err(format!("a payload of {} bytes is not a stored Kafka batch", payload.len()));
    }
    let header = BatchHeader::parse(&payload[1 + 4..])?;
    let body = payload.slice(1 + BATCH_OVERHEAD_BYTES - PREFIX_BYTES..);
    let (records, _) = records_of(&header, body, STORED_DECOMPRESSED_MAX).map_err(|e| e.to_string())?;
    let mut next = 0i64;
    Ok(records
        .into_iter()
        .map(|r| {
            let delta = i64::from(r.offset_delta);
            let offset_delta = (delta != next).then(|| u32::try_from(delta).unwrap_or(0));
            next = delta + 1;
            let timestamp_ms = if header.log_append_time() {
                header.max_timestamp
            } else {
                header.base_timestamp.wrapping_add(r.timestamp_delta)
            };
            Record {
                key: r.key,
                null_value: r.value.is_none(),
                value: r.value.unwrap_or_default(),
                headers: r
                    .headers
                    .into_iter()
                    .map(|(key, v)| Header { key, null_value: v.is_none(), value: v.unwrap_or_default() })
                    .collect(),
                timestamp_ms,
                offset_delta,
            }
        })
        .collect())
}

/// The Kafka batch a fetch through the Kafka listener returns for a stored
/// batch, appended to `out`: a stored Kafka payload with its 17 leading
/// bytes put back (its CRC still holds); Ferrolog's own encoding, decoded
/// by `decode` and encoded as an uncompressed batch ([`encode_batch`]).
/// The partition leader epoch is the entry's Raft term.
///
/// # Errors
/// A message when the stored records do not decode.
pub fn serve(
    batch: &StoredBatch,
    decode: impl FnOnce(&Bytes) -> Result<Vec<Record>, String>,
    out: &mut BytesMut,
) -> Result<(), String> {
    let payload = batch.records();
    let epoch = i32::try_from(batch.header.log_id.leader_id.term).unwrap_or(i32::MAX);
    if is_kafka_payload(&payload) {
        let length = i32::try_from(payload.len() + 4).map_err(|_| "a stored batch over 2 GiB".to_owned())?;
        out.reserve(payload.len() + 16);
        out.put_i64(i64::try_from(batch.header.base_offset).unwrap_or(i64::MAX));
        out.put_i32(length);
        out.put_i32(epoch);
        out.put_i8(2);
        out.extend_from_slice(&payload[1..]);
        return Ok(());
    }
    let records = decode(&payload)?;
    let h = &batch.header;
    encode_batch(
        &records,
        &BatchFields {
            base_offset: h.base_offset,
            offsets: h.record_count,
            leader_epoch: epoch,
            producer_id: h.producer_id,
            producer_epoch: h.producer_epoch,
            base_sequence: h.base_sequence,
            codec: Codec::None,
        },
        out,
    )
}

/// The stored payload ([`PAYLOAD_TAG`], then the batch from its CRC on) of
/// Ferrolog records as one Kafka batch compressed with `codec`: how a
/// topic whose `compression.type` names a codec stores batches produced
/// through the gRPC API. Idempotence fields as the request carried them;
/// `log_append_time` marks the batch so (its records were stamped with
/// the append time; the max timestamp is theirs).
///
/// # Errors
/// As [`encode_batch`].
pub fn payload_of(
    records: &[Record],
    producer_id: i64,
    producer_epoch: i16,
    base_sequence: i32,
    codec: Codec,
    log_append_time: bool,
) -> Result<Bytes, String> {
    let offsets = u32::try_from(records.len()).map_err(|_| "too many records")?;
    let fields = BatchFields {
        base_offset: 0,
        offsets,
        leader_epoch: -1,
        producer_id,
        producer_epoch,
        base_sequence,
        codec,
    };
    let mut b = BytesMut::new();
    encode_batch(records, &fields, &mut b)?;
    if log_append_time {
        let attributes = codec.id() | LOG_APPEND_TIME;
        b[CRC_START..CRC_START + 2].copy_from_slice(&attributes.to_be_bytes());
        let crc = crc32c::crc32c(&b[CRC_START..]);
        b[PREFIX_BYTES..CRC_START].copy_from_slice(&crc.to_be_bytes());
    }
    b[PREFIX_BYTES - 1] = PAYLOAD_TAG;
    Ok(b.freeze().slice(PREFIX_BYTES - 1..))
}

/// Batch-level fields of [`encode_batch`].
#[derive(Clone, Copy, Debug)]
pub struct BatchFields {
    /// Offset of the batch's first offset.
    pub base_offset: u64,
    /// Offsets the batch spans (its last offset delta + 1; more than its
    /// records after compaction).
    pub offsets: u32,
    /// Partition leader epoch.
    pub leader_epoch: i32,
    /// Idempotent producer id, or -1.
    pub producer_id: i64,
    /// Producer epoch.
    pub producer_epoch: i16,
    /// Base sequence, or -1.
    pub base_sequence: i32,
    /// Codec the records are compressed with.
    pub codec: Codec,
}

/// Encodes Ferrolog records as one Kafka batch (CreateTime timestamps),
/// its records compressed with `f.codec`, appended to `out`.
///
/// # Errors
/// A record's offset delta outside the batch's span; a codec failure.
pub fn encode_batch(records: &[Record], f: &BatchFields, out: &mut BytesMut) -> Result<(), String> {
    let deltas = super::records::offset_deltas(records);
    if let Some(d) = deltas.iter().find(|d| **d >= f.offsets.max(1)) {
        return Err(format!("offset delta {d} outside a batch of {} offsets", f.offsets));
    }
    let base_timestamp = records.first().map_or(0, |r| r.timestamp_ms);
    let max_timestamp = records.iter().map(|r| r.timestamp_ms).max().unwrap_or(base_timestamp);
    let mut body = BytesMut::new();
    for (r, d) in records.iter().zip(&deltas) {
        put_record(
            &mut body,
            r.timestamp_ms.wrapping_sub(base_timestamp),
            i64::from(*d),
            r.key.as_deref(),
            (!r.null_value).then_some(&r.value[..]),
            r.headers.iter().map(|h| (h.key.as_bytes(), (!h.null_value).then_some(&h.value[..]))),
        );
    }
    let body = match f.codec {
        Codec::None => body,
        codec => BytesMut::from(&compress(codec, &body)?[..]),
    };
    let start = out.len();
    out.reserve(BATCH_OVERHEAD_BYTES + body.len());
    out.put_i64(i64::try_from(f.base_offset).unwrap_or(i64::MAX));
    out.put_i32(i32::try_from(BATCH_OVERHEAD_BYTES - 12 + body.len()).map_err(|_| "batch over 2 GiB")?);
    out.put_i32(f.leader_epoch);
    out.put_i8(2);
    out.put_u32(0); // the CRC, below
    out.put_i16(f.codec.id());
    out.put_i32(i32::try_from(f.offsets.max(1) - 1).unwrap_or(i32::MAX));
    out.put_i64(base_timestamp);
    out.put_i64(max_timestamp);
    out.put_i64(f.producer_id);
    out.put_i16(f.producer_epoch);
    out.put_i32(f.base_sequence);
    out.put_i32(i32::try_from(records.len()).map_err(|_| "too many records")?);
    out.extend_from_slice(&body);
    let crc = crc32c::crc32c(&out[start + CRC_START..]);
    out[start + PREFIX_BYTES..start + CRC_START].copy_from_slice(&crc.to_be_bytes());
    Ok(())
}

/// One record (see the module comment), appended to `body`.
fn put_record<'a>(
    body: &mut BytesMut,
    timestamp_delta: i64,
    offset_delta: i64,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: impl ExactSizeIterator<Item = (&'a [u8], Option<&'a [u8]>)>,
) {
    let mut rec = BytesMut::new();
    rec.put_i8(0);
    put_varlong(&mut rec, timestamp_delta);
    put_varlong(&mut rec, offset_delta);
    put_nullable(&mut rec, key);
    put_nullable(&mut rec, value);
    put_varlong(&mut rec, headers.len() as i64);
    for (k, v) in headers {
        put_nullable(&mut rec, Some(k));
        put_nullable(&mut rec, v);
    }
    put_varlong(body, rec.len() as i64);
    body.extend_from_slice(&rec);
}

/// A stored Kafka payload holding only the records whose `keep` flag is
/// set, in order (`keep` parallels the records): what compaction writes,
/// as Kafka's log cleaner rewrites a batch. The header is kept (codec,
/// timestamp type, producer fields, and the last offset delta: the batch
/// still spans its offsets), survivors keep their offset and timestamp
/// deltas, the records are compressed again with the batch's codec and the
/// CRC is recomputed.
///
/// # Errors
/// A message when the payload is not a well-formed Kafka batch, or `keep`
/// does not match its records.
pub fn retain_payload(payload: &Bytes, keep: &[bool]) -> Result<Bytes, String> {
    if !is_kafka_payload(payload) || payload.len() < 1 + BATCH_OVERHEAD_BYTES - PREFIX_BYTES {
        return Err(format!("a payload of {} bytes is not a stored Kafka batch", payload.len()));
    }
    let head = 1 + BATCH_OVERHEAD_BYTES - PREFIX_BYTES;
    let header = BatchHeader::parse(&payload[1 + 4..])?;
    let (records, _) =
        records_of(&header, payload.slice(head..), STORED_DECOMPRESSED_MAX).map_err(|e| e.to_string())?;
    if records.len() != keep.len() {
        return Err(format!("{} records, {} keep flags", records.len(), keep.len()));
    }
    let mut body = BytesMut::new();
    let mut kept = 0i32;
    for r in records.iter().zip(keep).filter(|(_, k)| **k).map(|(r, _)| r) {
        put_record(
            &mut body,
            r.timestamp_delta,
            i64::from(r.offset_delta),
            r.key.as_deref(),
            r.value.as_deref(),
            r.headers.iter().map(|(k, v)| (k.as_bytes(), v.as_deref())),
        );
        kept += 1;
    }
    // A batch left empty is written uncompressed with no records, as
    // Kafka's cleaner writes one (`DefaultRecordBatch.writeEmptyHeader`).
    let codec = if kept == 0 { Codec::None } else { header.codec()? };
    let body = match codec {
        Codec::None => body.freeze(),
        c => Bytes::from(compress(c, &body)?),
    };
    let mut out = BytesMut::with_capacity(head + body.len());
    out.put_u8(PAYLOAD_TAG);
    out.put_u32(0); // the CRC, below
    out.put_i16((header.attributes & !COMPRESSION_MASK) | codec.id());
    // The header from the last offset delta to the base sequence, unchanged.
    out.extend_from_slice(&payload[1 + 4 + 2..head - 4]);
    out.put_i32(kept);
    out.extend_from_slice(&body);
    let crc = crc32c::crc32c(&out[5..]);
    out[1..5].copy_from_slice(&crc.to_be_bytes());
    Ok(out.freeze())
}

fn put_varlong(b: &mut BytesMut, v: i64) {
    let mut z = ((v << 1) ^ (v >> 63)) as u64;
    while z >= 0x80 {
        b.put_u8((z as u8) | 0x80);
        z >>= 7;
    }
    b.put_u8(z as u8);
}

fn put_nullable(b: &mut BytesMut, v: Option<&[u8]>) {
    match v {
        None => put_varlong(b, -1),
        Some(v) => {
            put_varlong(b, v.len() as i64);
            b.extend_from_slice(v);
        }
    }
}

/// A bounds-checked big-endian reader.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let s = self.b.get(self.at..self.at + N).ok_or("the bytes end early")?;
        self.at += N;
        s.try_into().map_err(|_| "the bytes end early".to_owned())
    }
    fn i8(&mut self) -> Result<i8, String> {
        Ok(i8::from_be_bytes(self.take::<1>()?))
    }
    fn i16(&mut self) -> Result<i16, String> {
        Ok(i16::from_be_bytes(self.take::<2>()?))
    }
    fn i32(&mut self) -> Result<i32, String> {
        Ok(i32::from_be_bytes(self.take::<4>()?))
    }
    fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_be_bytes(self.take::<8>()?))
    }
    /// A zig-zag varint of at most 10 bytes.
    fn varlong(&mut self) -> Result<i64, String> {
        let mut z = 0u64;
        for i in 0..10 {
            let [byte] = self.take::<1>()?;
            z |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(((z >> 1) as i64) ^ -((z & 1) as i64));
            }
        }
        Err("a varint longer than 10 bytes".into())
    }
    fn varint(&mut self) -> Result<i32, String> {
        let v = self.varlong()?;
        i32::try_from(v).map_err(|_| format!("varint {v} out of range"))
    }
    /// Varint length then bytes, sliced from `all`; length -1 is null.
    fn nullable_bytes(&mut self, all: &Bytes) -> Result<Option<Bytes>, String> {
        let n = self.varint()?;
        if n == -1 {
            return Ok(None);
        }
        let n = usize::try_from(n).map_err(|_| format!("length {n}"))?;
        let end = self.at.checked_add(n).filter(|e| *e <= self.b.len()).ok_or("a field past the end")?;
        let s = all.slice(self.at..end);
        self.at = end;
        Ok(Some(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(key: Option<&str>, value: Option<&str>, ts: i64) -> Record {
        Record {
            key: key.map(|k| Bytes::copy_from_slice(k.as_bytes())),
            null_value: value.is_none(),
            value: value.map(|v| Bytes::copy_from_slice(v.as_bytes())).unwrap_or_default(),
            headers: vec![
                Header { key: "h".into(), value: Bytes::from_static(b"x"), null_value: false },
                Header { key: "n".into(), value: Bytes::new(), null_value: true },
            ],
            timestamp_ms: ts,
            offset_delta: None,
        }
    }

    fn fields(offsets: u32) -> BatchFields {
        BatchFields {
            base_offset: 0,
            offsets,
            leader_epoch: 0,
            producer_id: 7,
            producer_epoch: 1,
            base_sequence: 3,
            codec: Codec::None,
        }
    }

    fn batch_of(records: &[Record]) -> Bytes {
        let mut out = BytesMut::new();
        encode_batch(records, &fields(records.len() as u32), &mut out).expect("encode");
        out.freeze()
    }

    #[test]
    fn a_batch_round_trips_through_the_stored_payload() {
        let records =
            vec![rec(Some("k"), Some("v"), 1000), rec(None, None, 900), rec(Some(""), Some(""), 1200)];
        let checked = check_produced(batch_of(&records), 1 << 20).expect("valid");
        assert_eq!(checked.records.len(), 3);
        assert_eq!((checked.first_timestamp_ms(), checked.max_timestamp_ms()), (1000, 1200));
        assert_eq!(checked.header.producer_id, 7);
        let payload = checked.payload();
        assert!(is_kafka_payload(&payload));
        assert_eq!(decode_payload(&payload).expect("decode"), records, "null vs empty, headers, timestamps");
    }

    #[test]
    fn damage_and_foreign_batches_are_refused() {
        let good = batch_of(&[rec(Some("k"), Some("v"), 1)]);
        let mut flipped = BytesMut::from(&good[..]);
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(
            matches!(check_produced(flipped.freeze(), 1 << 20), Err(BatchError::Corrupt(m)) if m.contains("CRC"))
        );
        let mut v1 = BytesMut::from(&good[..]);
        v1[16] = 1;
        assert!(matches!(check_produced(v1.freeze(), 1 << 20), Err(BatchError::Unsupported(_))));
        assert!(matches!(check_produced(good.slice(..good.len() - 1), 1 << 20), Err(BatchError::Corrupt(_))));
        assert!(matches!(check_produced(Bytes::from_static(&[0; 10]), 1 << 20), Err(BatchError::Corrupt(_))));
        // A record count far beyond the bytes: refused before any allocation.
        let mut huge = BytesMut::from(&good[..]);
        huge[57..61].copy_from_slice(&i32::MAX.to_be_bytes());
        huge[23..27].copy_from_slice(&(i32::MAX - 1).to_be_bytes());
        let crc = crc32c::crc32c(&huge[CRC_START..]);
        huge[PREFIX_BYTES..CRC_START].copy_from_slice(&crc.to_be_bytes());
        assert!(
            matches!(check_produced(huge.freeze(), 1 << 20), Err(BatchError::Corrupt(m)) if m.contains("cannot fit"))
        );
    }

    #[test]
    fn compressed_batches_decompress_within_their_bound() {
        let plain = batch_of(&[rec(Some("k"), Some(&"v".repeat(1000)), 5)]);
        let records = &plain[BATCH_OVERHEAD_BYTES..];
        let compressed: Vec<(i16, Vec<u8>)> = vec![
            (1, {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                std::io::Write::write_all(&mut e, records).expect("gzip");
                e.finish().expect("gzip")
            }),
            (2, snap::raw::Encoder::new().compress_vec(records).expect("snappy")),
            (3, {
                let mut e = lz4_flex::frame::FrameEncoder::new(Vec::new());
                std::io::Write::write_all(&mut e, records).expect("lz4");
                e.finish().expect("lz4")
            }),
            (4, zstd::encode_all(records, 3).expect("zstd")),
        ];
        for (codec, data) in compressed {
            let mut b = BytesMut::from(&plain[..BATCH_OVERHEAD_BYTES]);
            b.extend_from_slice(&data);
            let len = (b.len() - 12) as i32;
            b[8..12].copy_from_slice(&len.to_be_bytes());
            b[21..23].copy_from_slice(&codec.to_be_bytes());
            let crc = crc32c::crc32c(&b[CRC_START..]);
            b[PREFIX_BYTES..CRC_START].copy_from_slice(&crc.to_be_bytes());
            let b = b.freeze();
            let checked = check_produced(b.clone(), 1 << 20).unwrap_or_else(|e| panic!("codec {codec}: {e}"));
            assert_eq!(checked.records[0].value.as_ref().map(Bytes::len), Some(1000));
            assert!(checked.payload().len() < 1000, "stored compressed, as it came");
            assert!(
                matches!(check_produced(b, 500), Err(BatchError::TooLarge(_))),
                "codec {codec}: the bound holds"
            );
        }
    }

    const CODECS: [Codec; 5] = [Codec::None, Codec::Gzip, Codec::Snappy, Codec::Lz4, Codec::Zstd];

    #[test]
    fn a_topic_codec_recompresses_any_produced_codec_and_keeps_the_records() {
        let records: Vec<Record> = (0..50)
            .map(|i| {
                rec(Some(&format!("k{i}")), (i % 7 != 0).then_some("a value that compresses well"), 1000 + i)
            })
            .collect();
        let expected = {
            let c = check_produced(batch_of(&records), 1 << 20).expect("valid");
            decode_payload(&c.payload()).expect("decode")
        };
        for from in CODECS {
            let mut out = BytesMut::new();
            encode_batch(&records, &BatchFields { codec: from, ..fields(50) }, &mut out).expect("encode");
            for to in CODECS {
                let mut c = check_produced(out.clone().freeze(), 1 << 20).expect("valid");
                assert_eq!(c.header.codec(), Ok(from));
                c.recompress(to).expect("recompress");
                // What is stored passes the produce checks again: CRC, length, codec.
                let again = check_produced(c.bytes.clone(), 1 << 20).expect("a valid batch");
                assert_eq!(again.header.codec(), Ok(to), "{from:?} -> {to:?}");
                assert_eq!((again.header.producer_id, again.header.base_sequence), (7, 3));
                assert_eq!(decode_payload(&again.payload()).expect("decode"), expected, "{from:?} -> {to:?}");
            }
        }
        // gRPC-produced records stored with a topic's codec.
        for codec in CODECS {
            let p = payload_of(&records, 7, 1, 3, codec, false).expect("payload");
            assert!(is_kafka_payload(&p));
            assert_eq!(decode_payload(&p).expect("decode"), expected, "{codec:?}");
        }
    }

    #[test]
    fn compaction_thins_a_kafka_batch_in_its_codec_keeping_offsets_and_timestamps() {
        let records: Vec<Record> = (0..6).map(|i| rec(Some(&format!("k{i}")), Some("v"), 5000 + i)).collect();
        let keep = [false, true, false, false, true, true];
        for codec in CODECS {
            let mut out = BytesMut::new();
            encode_batch(&records, &BatchFields { codec, ..fields(6) }, &mut out).expect("encode");
            let payload = check_produced(out.freeze(), 1 << 20).expect("valid").payload();
            let thinned = retain_payload(&payload, &keep).expect("retain");
            let header = BatchHeader::parse(&thinned[5..]).expect("header");
            assert_eq!(header.codec(), Ok(codec), "the codec is kept");
            assert_eq!(
                (header.last_offset_delta, header.record_count),
                (5, 3),
                "the batch spans its offsets"
            );
            assert_eq!(u32::from_be_bytes(thinned[1..5].try_into().unwrap()), crc32c::crc32c(&thinned[5..]));
            let left = decode_payload(&thinned).expect("decode");
            let got: Vec<(Option<u32>, i64)> =
                left.iter().map(|r| (r.offset_delta, r.timestamp_ms)).collect();
            assert_eq!(got, vec![(Some(1), 5001), (Some(4), 5004), (None, 5005)], "{codec:?}");
            assert_eq!(retain_payload(&payload, &[true]).unwrap_err(), "6 records, 1 keep flags");
            // Emptied: no records, uncompressed, still spanning its offsets.
            let empty = retain_payload(&payload, &[false; 6]).expect("retain");
            let header = BatchHeader::parse(&empty[5..]).expect("header");
            assert_eq!(
                (header.codec(), header.record_count, header.last_offset_delta),
                (Ok(Codec::None), 0, 5)
            );
            assert_eq!(empty.len(), 1 + BATCH_OVERHEAD_BYTES - PREFIX_BYTES, "no body");
            assert!(decode_payload(&empty).expect("decode").is_empty());
        }
    }

    #[test]
    fn log_append_time_restamps_and_keeps_the_crc_valid() {
        let mut checked = check_produced(batch_of(&[rec(Some("k"), Some("v"), 5)]), 1 << 20).expect("valid");
        checked.stamp_log_append_time(99);
        let again = check_produced(checked.bytes.clone(), 1 << 20).expect("CRC recomputed");
        assert!(again.header.log_append_time());
        assert_eq!((again.first_timestamp_ms(), again.max_timestamp_ms()), (99, 99));
        assert_eq!(decode_payload(&again.payload()).expect("decode")[0].timestamp_ms, 99);
    }

    proptest::proptest! {
        /// Batches with bytes changed (the CRC then recomputed, so the
        /// record decoding is reached) never panic the checks or the
        /// readers of stored payloads.
        #[test]
        fn no_batch_bytes_panic(
            flips in proptest::collection::vec((0usize..400, 0u8..=255), 1..8),
            cut in 0usize..400,
            fix_crc in proptest::bool::ANY,
        ) {
            let mut b = BytesMut::from(&batch_of(&[rec(Some("k"), Some("v"), 5), rec(None, None, 9)])[..]);
            for (i, x) in flips {
                let n = b.len();
                b[i % n] = x;
            }
            b.truncate(cut.max(1).min(b.len()));
            if fix_crc && b.len() > CRC_START {
                let crc = crc32c::crc32c(&b[CRC_START..]);
                b[PREFIX_BYTES..CRC_START].copy_from_slice(&crc.to_be_bytes());
            }
            let b = b.freeze();
            if let Ok(mut checked) = check_produced(b.clone(), 1 << 16) {
                checked.stamp_log_append_time(1);
                let _ = decode_payload(&checked.payload());
            }
            let mut tagged = BytesMut::from(&[PAYLOAD_TAG][..]);
            tagged.extend_from_slice(&b[b.len().min(PREFIX_BYTES)..]);
            let _ = decode_payload(&tagged.freeze());
        }
    }

    #[test]
    fn bad_records_are_refused() {
        let mut r = rec(Some("k"), Some("v"), 1);
        r.offset_delta = Some(1);
        let mut out = BytesMut::new();
        encode_batch(&[r], &fields(2), &mut out).expect("encode");
        // lastOffsetDelta 1 with one record.
        assert!(matches!(check_produced(out.freeze(), 1 << 20), Err(BatchError::Invalid(_))));
    }
}
